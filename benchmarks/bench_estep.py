"""Time of ExSearch's E-step with best-of-n sampling, the importance weights scored on hf vs on the vLLM server
(issue 37 §2).

The E-step samples every model turn as the best of ``--best-of`` candidates ranked by p(text | conversation) and
then weights each trajectory by p(gold answer | x, z) (:mod:`sleuth.train.exsearch_em`). Both are ``score`` calls;
sampling runs on a vLLM server in either arm. Arm ``hf``: scores from the ``hf:`` backend on CPU (the E-step before
issue 37); arm ``vllm``: scores from the server (``prompt_logprobs`` on token ids, ``score_on_engine: true``; off by
default on CPU, where it is slower). The arms alternate ``--repeats`` times on the same questions, with the server's
prefix cache off so that neither arm's sampling is served from the other's cache. Sampling is stochastic, so the
candidates differ between arms; the numbers of candidates and scores are reported next to the times.

    python benchmarks/bench_estep.py --questions 3 --best-of 8 --out docs/results/bench_estep.json   # ~11 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from sleuth.agents import Context
from sleuth.data.loaders import load_examples
from sleuth.llm import LLM, load_llm
from sleuth.retrieval import load_retriever
from sleuth.train.exsearch_em import METHOD, EMConfig, EngineAndScorer, best_of_sampler, score_answers
from sleuth.train.exsearch_em import trajectory_messages as context_of
from sleuth.train.rollouts import RolloutStore, collect


def estep(llm: LLM, examples: list[Any], retriever: Any, config: EMConfig, workdir: Path) -> dict[str, Any]:
    """One E-step: best-of sampling of ``config.samples`` trajectories per question, then the weights' scores."""
    agent = config.rollout_agent()
    sampler, best_of = best_of_sampler(llm, config.best_of, agent.sampling)
    assert best_of["applied"], best_of
    store = RolloutStore(workdir)
    started = time.perf_counter()
    collect(METHOD, examples, Context(llm=sampler, retriever=retriever, config=agent), store, config.samples)
    sampling_s = time.perf_counter() - started
    items = [
        (context, r.trace.example.answers[0])
        for r in store
        if r.trace.example.answers and (context := context_of(r.trace)) is not None
    ]
    started = time.perf_counter()
    scores = score_answers(llm, items, config.concurrency)
    weights_s = time.perf_counter() - started
    report = sampler.report()  # type: ignore[attr-defined]
    return {
        "sampling_with_best_of_s": round(sampling_s, 1),
        "weights_s": round(weights_s, 1),
        "estep_s": round(sampling_s + weights_s, 1),
        "best_of_calls": report["calls"],
        "candidates": report["candidates"],
        "candidates_scored": report["scored"],
        "trajectories_weighted": len(scores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/hotpotqa/hotpot.json")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1, help="trajectories per question")
    parser.add_argument("--best-of", type=int, default=8)
    parser.add_argument("--vllm", default="vllm:default?args=--no-enable-prefix-caching")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    examples = load_examples(args.data, limit=args.questions)
    retriever = load_retriever(None)
    config = EMConfig(samples=args.samples, best_of=args.best_of)
    engine = load_llm(args.vllm)
    hf = load_llm("default")
    runs: dict[str, list[dict[str, Any]]] = {"hf": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for arm in ("hf", "vllm"):
                llm = EngineAndScorer(engine, lambda: hf, on_engine=arm == "vllm")
                assert llm.scorer_name() == ("engine" if arm == "vllm" else "hf"), llm.scorer_name()
                result = estep(llm, examples, retriever, config, Path(tmp) / f"{arm}{r}")
                runs[arm].append(result)
                print(f"scorer {arm:<5} round {r + 1}: {json.dumps(result)}", flush=True)
    summary = {
        arm: {key: round(sum(run[key] for run in rows) / len(rows), 1) for key in rows[0]}
        for arm, rows in runs.items()
    }
    speedup = round(summary["hf"]["estep_s"] / summary["vllm"]["estep_s"], 2)
    result = {
        "command": "python benchmarks/bench_estep.py "
        + " ".join(
            f"--{k.replace('_', '-')} {json.dumps(v) if isinstance(v, str) and '?' in v else v}"
            for k, v in vars(args).items()
            if v is not None and k != "out"
        ),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "sampling_engine": engine.describe(),
        "hf_scorer": hf.describe(),
        "runs": runs,
        "mean": summary,
        "estep_speedup_vllm_scorer": speedup,
    }
    print(json.dumps(summary, indent=2))
    print(f"E-step with the vLLM scorer: {speedup}x faster than with the hf scorer")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    asyncio.run(engine.aclose())


if __name__ == "__main__":
    main()
