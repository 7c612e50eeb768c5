"""Can s3's reward carry signal here? The frozen generator's accuracy with the gold passages (the ceiling a
searcher could reach), with naive RAG's top-k for the question (the baseline Gain Beyond RAG subtracts), and with
no passages, for each candidate generator, on the dev questions of a synthetic world.

s3 trains the searcher on GBR = Acc(G(Q, D_s3), A) - Acc(G(Q, D_RAG), A) (s3.md §3). If the generator cannot read
(ceiling ≈ naive RAG), every rollout scores ≈ 0 and PPO has nothing to learn from: the first s3 benchmark measured
exactly that (0 of 2 steps with a mean reward above 0). This probe picks a generator and a world where
ceiling − naive RAG is large before any RL compute is spent.

    python benchmarks/s3_signal.py --world runs/learn-acesearcher/world --generator runs/learn-acesearcher/sft

Each generator is served once (``--engine``, vLLM when installed); the answers are scored with s3's GenAcc span
check, as the s3 benchmark scores them. Results: ``docs/results/learn_s3/signal.md`` / ``signal.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Experiment, ModelServer, difference_table, key_hash, short, stage_table  # noqa: E402


def passages_by_id(corpus: Path) -> dict[str, Any]:
    from sleuth.corpus import read_corpus

    return {p.id: p for p in read_corpus(corpus)}


def contexts(examples: list[Any], corpus: dict[str, Any], index: str, k: int) -> dict[str, list[list[Any]]]:
    """Per question, the passages of each context: the gold supporting passages, naive RAG's top-k, none."""
    from sleuth.retrieval import load_retriever

    retriever = load_retriever(index)
    return {
        "gold": [[corpus[i] for i in e.supporting_ids if i in corpus] for e in examples],
        f"naive top-{k}": retriever.search([e.question for e in examples], k),
    }


def score(generator: Any, examples: list[Any], docs: list[list[Any]], agent: Any) -> dict[str, Any]:
    from sleuth.train.rewards import generator_accuracy

    async def one(example: Any, passages: list[Any]) -> tuple[float, str]:
        return await generator_accuracy(example.question, passages, example.answers, generator, agent, None, "span")

    async def everything() -> list[tuple[float, str]]:
        limit = asyncio.Semaphore(64)

        async def bounded(example: Any, passages: list[Any]) -> tuple[float, str]:
            async with limit:
                return await one(example, passages)

        return list(await asyncio.gather(*(bounded(e, d) for e, d in zip(examples, docs, strict=True))))

    scored = asyncio.run(everything())
    return {"per_example": {"acc": [a for a, _ in scored]}, "answers": [ans for _, ans in scored][:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=Path, required=True, help="a synthetic world directory (sleuth data synth)")
    parser.add_argument("--index", default="", help="retriever spec (default: WORLD/../index)")
    parser.add_argument("--generator", action="append", default=[], help="a model directory (repeatable)")
    parser.add_argument("--questions", type=int, default=100, help="dev questions")
    parser.add_argument("--k", type=int, default=3, help="naive RAG's top-k (the s3 benchmark's k_initial)")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "s3-signal")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "results" / "learn_s3")
    args = parser.parse_args()

    from sleuth.agents.s3 import S3Config
    from sleuth.assets import ensure_default_model
    from sleuth.data.synth import load_synth
    from sleuth.llm import Sampling
    from sleuth.train.common import auto_engine

    engine = auto_engine(args.engine)
    index = args.index or str(args.world.parent / "index")
    exp = Experiment("s3_signal", args.work, args.work / "results")
    examples = list(load_synth(args.world / "dev.jsonl"))[: args.questions]
    docs = contexts(examples, passages_by_id(args.world / "corpus.jsonl"), index, args.k)
    docs["no passages"] = [[] for _ in examples]
    agent = S3Config(k=args.k, k_initial=args.k, max_turns=2, sampling=Sampling(max_new_tokens=96))
    agent.generator_sampling = dataclasses.replace(agent.generator_sampling, max_new_tokens=24)  # as learn_s3
    generators = [str(ensure_default_model()), *args.generator]
    evaluations: dict[str, dict[str, Any]] = {}
    for generator in generators:
        with ModelServer(Path(generator), engine, args.llm_options) as server:
            for name, context in docs.items():
                if name == "no passages":
                    continue  # the agent makes no generator call on an empty context: accuracy 0 by construction
                key = {"generator": generator, "world": str(args.world), "context": name, "n": len(examples)}
                label = f"{short(generator)} · {name}"
                evaluations[label] = exp.evaluate(
                    f"{Path(generator).name}-{name.replace(' ', '')}-{key_hash(key)[:4]}",
                    "dev",
                    key,
                    lambda context=context, server=server: score(server.get(), examples, context, agent),
                )
    pairs = [(f"{short(g)} · gold", f"{short(g)} · naive top-{args.k}") for g in generators]
    differences = exp.differences(evaluations, pairs, ["acc"])
    lines = [
        "# s3 signal probe: can Gain Beyond RAG be above 0?",
        "",
        f"`python benchmarks/s3_signal.py {' '.join(sys.argv[1:])}`; {len(examples)} dev questions of "
        f"`{short(args.world)}`, engine {engine}. GenAcc (span) of the frozen generator's answer, s3's generator "
        "prompt (paper, Fig. 12), 95% bootstrap CIs. gold = the question's supporting passages (a perfect "
        f"searcher's context); naive top-{args.k} = BM25 for the question itself (what GBR subtracts).",
        "",
        *stage_table(evaluations, ["acc"]),
        "",
        "Ceiling − naive RAG (the most a searcher can gain, per generator):",
        "",
        *difference_table(differences, ["acc"]),
        "",
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "signal.md").write_text("\n".join(lines))
    (args.results / "signal.json").write_text(
        json.dumps({"evaluations": evaluations, "differences": differences}, indent=1, default=str) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
