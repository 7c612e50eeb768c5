"""Throughput of the runner: the same questions answered batched (through the runner) and one at a time.

Both passes run in one process on the same model and index, so the ratio is robust to a noisy shared machine.
Greedy decoding, so both passes must produce identical answers (checked and printed). A third pass reads every
prompt one at a time with a budget of one new token: the prefill floor. Batching cannot make reading prompts
cheaper on a compute-bound CPU, so ``sequential / prefill floor`` bounds the ratio batching can reach.

    python benchmarks/bench_runner.py                 # 32 questions, naive_rag, k=5, SmolLM2 on CPU
    python benchmarks/bench_runner.py --k 1 --n 32     # shorter prompts: decoding dominates
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

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig, NaiveRAGConfig
from sleuth.llm import Sampling, load_llm
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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
