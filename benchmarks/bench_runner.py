"""Throughput of the runner: the same questions answered batched (through the runner) and one at a time.

Both passes run in one process on the same model and index, so the ratio is robust to a noisy shared machine.
Greedy decoding, so both passes must produce identical answers (checked and printed). A third pass reads every
prompt one at a time with a budget of one new token: the prefill floor. Batching cannot make reading prompts
cheaper on a compute-bound CPU, so ``sequential / prefill floor`` bounds the ratio batching can reach.

    python benchmarks/bench_runner.py                 # 32 questions, naive_rag, k=5, SmolLM2 on CPU
    python benchmarks/bench_runner.py --k 1 --n 32     # shorter prompts: decoding dominates

With ``--vllm SPEC`` (a ``vllm:`` or ``openai:`` spec) it compares engines instead (issue 18), four arms alternating
``--repeats`` times, medians reported: one prompt at a time through the hf backend, the runner on hf, the runner
on the vLLM server, and raw vLLM (the runner's prompts sent all at once over plain HTTP, no sleuth), with the
answer agreement of every arm against the first on the same questions. vLLM's prefix cache would serve a prompt it
has seen from cache, so each round draws fresh questions and the server sees every question once (issue 37); the
warm-cache case (both vLLM arms again on questions already served) is reported apart::

    python benchmarks/bench_runner.py --vllm vllm:default --out docs/results/bench_engines.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig, NaiveRAGConfig
from sleuth.llm import Sampling, load_llm
from sleuth.llm.base import LLM, Generation, Messages, Request, Score
from sleuth.records import Example, Trace
from sleuth.retrieval import load_retriever
from sleuth.runner import arun


def questions(retriever, n: int, seed: int) -> list[Example]:
    """Questions about n random wiki-summary titles (deterministic per seed)."""
    rng = random.Random(seed)
    picks = rng.sample(range(len(retriever)), n)
    return [Example(id=str(i), question=f"What is {retriever.store[i].title} known for?") for i in picks]


async def timed(method: str, examples: list[Example], ctx: Context, concurrency: int) -> tuple[float, list[Trace]]:
    started = time.perf_counter()
    traces = await arun(method, examples, ctx, concurrency=concurrency, progress=False)
    return time.perf_counter() - started, traces


def summary(label: str, seconds: float, traces: list[Trace]) -> dict:
    completion = sum(t.completion_tokens for t in traces)
    prompt = sum(t.prompt_tokens for t in traces)
    return {
        "mode": label,
        "seconds": round(seconds, 2),
        "questions_per_s": round(len(traces) / seconds, 4),
        "completion_tokens_per_s": round(completion / seconds, 2),
        "prompt_tokens_per_s": round(prompt / seconds, 1),
        "mean_prompt_tokens": round(prompt / len(traces), 1),
        "mean_completion_tokens": round(completion / len(traces), 1),
        "errors": sum(1 for t in traces if t.error),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="naive_rag", choices=["naive_rag", "direct"])
    parser.add_argument("--n", type=int, default=32, help="questions")
    parser.add_argument("--k", type=int, default=5, help="passages per question (naive_rag)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--llm", default=None, help="LLM spec (default: embedded SmolLM2)")
    parser.add_argument("--index", default=None, help="retriever spec (default: bundled wiki BM25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--vllm", default=None, help="compare engines: hf vs this vllm:/openai: server (4 arms)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four arms (--vllm only)")
    args = parser.parse_args()
    if args.vllm:
        engines(args)
        return

    retriever = load_retriever(args.index)
    llm = load_llm(args.llm)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    config = NaiveRAGConfig(k=args.k, sampling=sampling) if args.method == "naive_rag" else DirectConfig(sampling)
    ctx = Context(llm=llm, retriever=retriever, config=config)
    examples = questions(retriever, args.n, args.seed)

    asyncio.run(timed(args.method, examples[:1], ctx, 1))  # warm-up: first-call allocations, lazy imports
    calls0 = llm.stats.calls
    batched_s, batched = asyncio.run(timed(args.method, examples, ctx, concurrency=args.n))
    batched_calls = llm.stats.calls - calls0
    calls0 = llm.stats.calls
    sequential_s, sequential = asyncio.run(timed(args.method, examples, ctx, concurrency=1))
    sequential_calls = llm.stats.calls - calls0

    ctx.config = replace(config, sampling=replace(sampling, max_new_tokens=1))
    calls0 = llm.stats.calls
    floor_s, floor = asyncio.run(timed(args.method, examples, ctx, concurrency=1))
    floor_calls = llm.stats.calls - calls0

    rows = [
        summary("batched (runner)", batched_s, batched),
        summary("sequential", sequential_s, sequential),
        summary("prefill floor", floor_s, floor),
    ]
    for row, calls in zip(rows, (batched_calls, sequential_calls, floor_calls), strict=True):
        row["model_calls"] = calls
    same = sum(a.answer == b.answer for a, b in zip(batched, sequential, strict=True))
    result = {
        "command": "python benchmarks/bench_runner.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "llm": llm.describe(),
        "config": asdict(config),
        "results": rows,
        "throughput_ratio": round(sequential_s / batched_s, 2),
        "ratio_bound_from_prefill": round(sequential_s / floor_s, 2),
        "identical_answers": f"{same}/{len(examples)}",
    }
    header = f"{'mode':<18}{'s':>8}{'q/s':>8}{'gen tok/s':>11}{'prompt tok/s':>14}{'calls':>7}"
    print(header)
    for r in rows:
        print(
            f"{r['mode']:<18}{r['seconds']:>8.1f}{r['questions_per_s']:>8.3f}{r['completion_tokens_per_s']:>11.1f}"
            f"{r['prompt_tokens_per_s']:>14.1f}{r['model_calls']:>7}"
        )
    print(
        f"throughput ratio batched/sequential: {result['throughput_ratio']}x "
        f"(bound from the prefill floor: {result['ratio_bound_from_prefill']}x); "
        f"identical answers: {result['identical_answers']}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class _Recorder(LLM):
    """Answers nothing, records nothing but the prompts the agent builds: the raw arm's prompts for questions the
    server has not seen yet (running the runner arm first to get them would put them in vLLM's prefix cache)."""

    def __init__(self, served: LLM) -> None:
        super().__init__()
        self.served = served
        self.spec = "recorder"

    def special_tokens(self) -> tuple[str, ...]:
        return self.served.special_tokens()  # the same neutralised passages as the vLLM runner arm's

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        return [Generation(texts=[""] * sampling.n, completion_tokens=[0] * sampling.n) for _ in requests]

    async def score(self, prompt: Messages | str, completion: str) -> Score:
        raise NotImplementedError


async def _raw(served: Any, prompts: list[list[dict[str, str]]], sampling: Sampling) -> tuple[float, list[str], int]:
    """All prompts at once to the server's chat endpoint with plain httpx: what the engine does without sleuth.
    Returns the seconds, the texts and the prompt tokens the server counted."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=3600, limits=limits, trust_env=False) as client:

        async def one(messages: list[dict[str, str]]) -> tuple[str, int]:
            body = {
                "model": served.model,
                "messages": messages,
                "temperature": 0.0,
                "max_tokens": sampling.max_new_tokens,
            }
            response = await client.post(f"{served.base_url}/chat/completions", json=body)
            response.raise_for_status()
            data = response.json()
            return data["choices"][0]["message"]["content"] or "", int(data.get("usage", {}).get("prompt_tokens", 0))

        started = time.perf_counter()
        replies = await asyncio.gather(*(one(m) for m in prompts))
        took = time.perf_counter() - started
        return took, [text for text, _ in replies], sum(tokens for _, tokens in replies)


def engines(args: argparse.Namespace) -> None:
    """The four arms of issue 18 in one process, alternating, medians of ``--repeats``, every vLLM measurement on
    questions the server has never seen (issue 37).

    vLLM keeps a prefix cache (on by default): a prompt it has served before skips most of its prefill. So every
    round draws fresh question sets: X, which both hf arms (no cache to warm) and one vLLM arm answer, and Y, which
    the other vLLM arm answers; the vLLM arm that shares X alternates (the runner in rounds 1, 3, ..., raw in rounds
    2, 4, ...). The server thus sees each question once, and every arm is compared with the first on the same
    questions (the answer agreement). Afterwards both vLLM arms run again on round 1's X, which the server has
    already served: the warm-cache figures, reported apart.
    """
    retriever = load_retriever(args.index)
    hf = load_llm(args.llm)
    served = load_llm(args.vllm)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    config = NaiveRAGConfig(k=args.k, sampling=sampling) if args.method == "naive_rag" else DirectConfig(sampling)
    n = args.n
    pool = questions(retriever, 2 + 2 * n * args.repeats, args.seed)  # distinct titles: every set is fresh
    warmup, rest = pool[:2], pool[2:]
    sets = [(rest[2 * n * r : 2 * n * r + n], rest[2 * n * r + n : 2 * n * (r + 1)]) for r in range(args.repeats)]
    contexts = {
        name: Context(llm=llm, retriever=retriever, config=config)
        for name, llm in (("hf", hf), ("vllm", served), ("recorder", _Recorder(served)))
    }

    def prompts_of(examples: list[Example]) -> list[list[dict[str, str]]]:
        _, traces = asyncio.run(timed(args.method, examples, contexts["recorder"], 1))
        return [[step for step in t.steps if step.messages is not None][0].messages for t in traces]

    for name in ("hf", "vllm"):  # warm-up: first-call allocations, lazy imports, the server's first batch
        asyncio.run(timed(args.method, warmup, contexts[name], 2))
    asyncio.run(_raw(served, prompts_of(warmup), sampling))

    arms = ["hf, one prompt at a time", "hf, sleuth runner", "vllm, sleuth runner", "vllm, raw (no sleuth)"]
    warm_arms = ["vllm, sleuth runner (warm cache)", "vllm, raw (no sleuth) (warm cache)"]
    seconds: dict[str, list[float]] = {arm: [] for arm in arms + warm_arms}
    tokens: dict[str, list[int]] = {arm: [] for arm in arms + warm_arms}
    answers: dict[str, dict[str, str]] = {arm: {} for arm in arms + warm_arms}  # question id -> output

    def measure(arm: str, examples: list[Example], label: str) -> None:
        if arm.startswith("vllm, raw"):
            took, texts, prompt_tokens = asyncio.run(_raw(served, prompts_of(examples), sampling))
        else:
            ctx = contexts[arm.split(",")[0]]
            took, traces = asyncio.run(timed(args.method, examples, ctx, 1 if "one prompt" in arm else n))
            llm_steps = [[step for step in t.steps if step.messages is not None] for t in traces]
            assert all(len(steps) == 1 for steps in llm_steps), "one LLM call per question expected"
            texts = [steps[0].output or "" for steps in llm_steps]
            prompt_tokens = sum(t.prompt_tokens for t in traces)
        seconds[arm].append(took)
        tokens[arm].append(prompt_tokens)
        answers[arm].update({e.id: text for e, text in zip(examples, texts, strict=True)})
        print(f"{arm:<36}{label:<12}{took:>8.1f} s  {prompt_tokens:>7} prompt tokens", flush=True)

    for r, (x, y) in enumerate(sets):
        shares_x = arms[2] if r % 2 == 0 else arms[3]
        for arm in arms:
            on_x = arm in arms[:2] or arm == shares_x
            measure(arm, x if on_x else y, f"round {r + 1} {'X' if on_x else 'Y'}")
    for r in range(args.repeats):
        for warm in warm_arms:
            measure(warm, sets[0][0], f"warm {r + 1}")

    reference = answers[arms[0]]

    def agreement(arm: str) -> str:
        shared = [q for q in answers[arm] if q in reference]
        return f"{sum(answers[arm][q] == reference[q] for q in shared)}/{len(shared)}"

    rows = [
        {
            "arm": arm,
            "cache": "warm (questions served before)" if arm in warm_arms else "cold (fresh questions)",
            "median_s": round(_median(seconds[arm]), 2),
            "runs_s": [round(x, 2) for x in seconds[arm]],
            "s_per_question": round(_median(seconds[arm]) / n, 3),
            "prompt_tokens_per_run": tokens[arm],
            "same_outputs_as_first_arm": agreement(arm),
        }
        for arm in arms + warm_arms
    ]
    median = {row["arm"]: row["median_s"] for row in rows}
    result = {
        "command": "python benchmarks/bench_runner.py "
        + " ".join(
            f"--{k.replace('_', '-')} {json.dumps(v) if isinstance(v, str) and '?' in v else v}"
            for k, v in vars(args).items()
            if v is not None and k != "out"
        ),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "llm": hf.describe(),
        "vllm": served.describe(),
        "config": asdict(config),
        "design": "every round: fresh question sets X and Y (n each); both hf arms and one vLLM arm answer X, the "
        "other vLLM arm Y (the runner shares X in odd-numbered rounds, raw in even ones); the server sees each "
        "question once. Warm-cache rows: both vLLM arms again on round 1's X, already served.",
        "results": rows,
        "runner_vllm_vs_raw_vllm_throughput": round(median[arms[3]] / median[arms[2]], 2),
        "runner_vllm_vs_runner_hf_speedup": round(median[arms[1]] / median[arms[2]], 2),
        "warm_cache_runner_vllm_vs_raw_vllm_throughput": round(median[warm_arms[1]] / median[warm_arms[0]], 2),
        "warm_cache_runner_vllm_vs_runner_hf_speedup": round(median[arms[1]] / median[warm_arms[0]], 2),
    }
    print(f"{'arm':<36}{'median s':>10}{'s/q':>8}  same outputs")
    for row in rows:
        print(
            f"{row['arm']:<36}{row['median_s']:>10.1f}{row['s_per_question']:>8.2f}"
            f"  {row['same_outputs_as_first_arm']}"
        )
    print(
        f"cold: runner through vLLM {result['runner_vllm_vs_raw_vllm_throughput']}x raw vLLM's throughput "
        f"(target >= 0.8), {result['runner_vllm_vs_runner_hf_speedup']}x the hf runner (target >= 1.8); "
        f"warm cache: {result['warm_cache_runner_vllm_vs_raw_vllm_throughput']}x raw, "
        f"{result['warm_cache_runner_vllm_vs_runner_hf_speedup']}x the hf runner"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    close = getattr(served, "close", None)
    if close:
        close()


if __name__ == "__main__":
    main()
