"""AceSearcher: independent sub-questions answered in parallel waves vs strictly one after another.

Both passes answer the same questions one question at a time (the latency a user of ``sleuth ask`` sees), in one
process on the same model and index, so the ratio is robust to a noisy machine. Decoding is greedy, so both
passes make the same calls and produce the same answers (checked and printed); only the scheduling differs: the
parallel pass sends each wave of independent sub-questions to the backend together (one batched generate), the
sequential pass one sub-question per round.

    python benchmarks/bench_acesearcher_parallel.py            # 6 HotpotQA dev questions, SmolLM2 on CPU, k=3
    python benchmarks/bench_acesearcher_parallel.py --llm hf:/path/to/model?device=cuda --k 10 --n 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

from sleuth.agents import Context
from sleuth.agents.acesearcher import AceSearcherConfig
from sleuth.data import load_examples
from sleuth.llm import load_llm
from sleuth.records import Example, Trace
from sleuth.retrieval import load_retriever
from sleuth.runner import arun


async def one_at_a_time(examples: list[Example], ctx: Context) -> tuple[list[float], list[Trace]]:
    seconds, traces = [], []
    for example in examples:
        started = time.perf_counter()
        traces += await arun("acesearcher", [example], ctx, concurrency=1, progress=False)
        seconds.append(time.perf_counter() - started)
    return seconds, traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/hotpotqa/hotpot.json")
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--llm", default=None, help="LLM spec (default: the embedded SmolLM2)")
    parser.add_argument("--index", default=None, help="retriever spec (default: the bundled wiki index)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--subanswer-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    llm = load_llm(args.llm)
    retriever = load_retriever(args.index)
    examples = load_examples(args.data, limit=args.n)
    base = AceSearcherConfig(
        k=args.k, decompose_max_new_tokens=96, subanswer_max_new_tokens=args.subanswer_tokens, final_max_new_tokens=64
    )
    results = {}
    traces_by_mode = {}
    for mode, parallel in (("sequential", False), ("parallel", True)):
        ctx = Context(llm=llm, retriever=retriever, config=replace(base, parallel=parallel))
        seconds, traces = asyncio.run(one_at_a_time(examples, ctx))
        traces_by_mode[mode] = traces
        results[mode] = {
            "seconds_per_question": round(sum(seconds) / len(seconds), 2),
            "llm_calls_per_question": sum(t.llm_calls for t in traces) / len(traces),
            "rounds_per_question": sum(t.meta.get("waves", 0) for t in traces) / len(traces),
            "subquestions_per_question": sum(len(t.meta.get("decomposition", [])) for t in traces) / len(traces),
            "errors": sum(1 for t in traces if t.error),
        }
    same = sum(
        a.answer == b.answer for a, b in zip(traces_by_mode["sequential"], traces_by_mode["parallel"], strict=True)
    )
    ratio = results["sequential"]["seconds_per_question"] / results["parallel"]["seconds_per_question"]
    report = {
        "benchmark": "acesearcher parallel waves vs sequential sub-questions (one question at a time)",
        "command": "python benchmarks/bench_acesearcher_parallel.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "llm": llm.spec,
        "config": asdict(base),
        "questions": len(examples),
        **results,
        "speedup_parallel_vs_sequential": round(ratio, 2),
        "identical_answers": f"{same}/{len(examples)}",
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
