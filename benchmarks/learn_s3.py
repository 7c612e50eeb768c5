"""Does s3's RL teach a small searcher to find what a frozen generator needs? Generator accuracy with the
searcher's documents vs with naive RAG (top-3 for the question), before and after training, on held-out synthetic
multi-hop questions, with bootstrap CIs.

The searcher is SmolLM2-135M-Instruct (LoRA off: full fine-tuning of the 135M model), the frozen generator is the
same base model loaded separately (it never changes). Training: ``sleuth.train.s3_rl`` (PPO with a value head, KL
in the reward, Gain Beyond RAG; the paper's filter drops questions naive RAG already answers). Accuracy is s3's
GenAcc span check (normalised gold contained in the answer), no judge.

    python benchmarks/learn_s3.py            # CPU: expect over an hour at the defaults (see docs)
    python benchmarks/learn_s3.py --smoke    # tiny random searcher, a few questions, 1 step

``--engine`` runs the frozen generator (one server for the whole run) and the searcher's evaluations on ``hf`` or on
vLLM servers sleuth starts (``vllm``, or a ``vllm:{model}?...`` template); ``auto`` (the default) is ``vllm`` when
vLLM is installed (``make vllm``), else ``hf``, and ``hf`` with ``--smoke``. The PPO rollouts sample from the live
searcher: a vLLM rollout server reloads LoRA adapters, and this benchmark fine-tunes all weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from sleuth.eval.stats import bootstrap_ci, paired_difference_ci

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "learn_s3"


def evaluate(
    searcher: Path,
    generator: Any,
    examples: list[Any],
    index: str,
    agent: Any,
    opts: str,
    out: Path,
    engine: str = "hf",
) -> dict:
    """Greedy s3 on ``examples``: per-question GenAcc (span) with the searcher's documents and with naive RAG's
    top-k (the same generator and prompt on the documents retrieved for the question itself)."""
    import asyncio
    from types import SimpleNamespace

    from sleuth.agents import Context
    from sleuth.eval.metrics import accuracy
    from sleuth.llm import load_llm
    from sleuth.records import Passage
    from sleuth.retrieval import load_retriever
    from sleuth.runner import run
    from sleuth.train.mdpo import close_llm, engine_spec
    from sleuth.train.rewards import generator_accuracy

    if out.exists():
        return json.loads(out.read_text())
    started = time.perf_counter()
    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=opts), searcher))
    ctx = Context(llm=llm, retriever=load_retriever(index), config=agent, roles={"generator": generator})
    try:
        traces = run("s3", examples, ctx, progress=True)
    finally:
        close_llm(llm)

    async def naive_accuracy() -> list[float]:
        async def one(trace: Any) -> float:
            docs = [Passage.from_dict(p) for p in trace.meta.get("naive_rag_passages") or []]
            question = trace.meta.get("generator_question") or trace.example.question
            acc, _ = await generator_accuracy(question, docs, trace.example.answers, generator, agent, None, "span")
            return acc

        return list(await asyncio.gather(*(one(t) for t in traces)))

    result = {
        "model": str(searcher),
        "n": len(traces),
        "acc_s3": [float(accuracy(t.answer or "", t.example.answers)) for t in traces],
        "acc_naive": asyncio.run(naive_accuracy()),
        "searches": [max(len(t.meta.get("rounds") or []) - 1, 0) for t in traces],
        "selected": [len(t.meta.get("selected_ids") or []) for t in traces],
        "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(result) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--test-questions", type=int, default=60)
    parser.add_argument("--train-questions", type=int, default=400, help="before the naive-RAG filter")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16, help="questions per step (paper: 120)")
    parser.add_argument("--lr", type=float, default=1e-5, help="actor (paper: 1e-6 for 7B)")
    parser.add_argument("--critic-lr", type=float, default=1e-4, help="value head (paper: 1e-5)")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        default="auto",
        help="generator and evaluations: hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed "
        "(hf with --smoke)",
    )
    args = parser.parse_args()
    from sleuth.train.mdpo import auto_engine, close_llm, engine_spec

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)

    from sleuth.agents.s3 import S3Config
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.llm import Sampling, load_llm
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.train.s3_rl import S3RLConfig, train_s3

    started = time.perf_counter()
    work = args.work or REPO / "runs" / ("learn-s3-smoke" if args.smoke else "learn-s3")
    results = args.results or (work / "results" if args.smoke else RESULTS)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    (work / "eval").mkdir(exist_ok=True)
    world = work / "world"
    sizes: dict[str, Any] = {"min_hops": 2, "max_hops": 3, "train_questions": args.train_questions}
    if args.smoke:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_model

        searcher = work / "tiny-model"
        if not (searcher / "config.json").exists():
            build_tiny_model(searcher)
        args.test_questions, args.steps, args.prompts = 3, 1, 2
        sizes.update(train_entities=60, dev_entities=30, test_entities=30, train_questions=12, dev_questions=2)
        tokens = 12
    else:
        from sleuth.assets import ensure_default_model

        searcher = ensure_default_model()
        tokens = 96
    if not (world / "world.json").exists():
        synthesize(world, seed=args.seed, test_questions=args.test_questions, **sizes)
    index = work / "index"
    if not index.exists():
        build_bm25_index(world / "corpus.jsonl", index)
    from sleuth.assets import ensure_default_model

    generator = load_llm(engine_spec(args, ensure_default_model()))  # frozen: never trained
    agent = S3Config(k=3, k_initial=3, max_turns=2, sampling=Sampling(max_new_tokens=tokens))
    agent.generator_sampling = dataclasses.replace(agent.generator_sampling, max_new_tokens=24)
    test = list(load_synth(world / "test.jsonl"))[: args.test_questions]
    base_eval = work / "eval" / "base.json"
    before = evaluate(searcher, generator, test, str(index), agent, args.llm_options, base_eval, args.engine)
    config = S3RLConfig(
        model=str(searcher),
        output_dir=str(work / "ppo"),
        data_dir=str(world),
        index=str(index),
        steps=args.steps,
        prompts_per_step=args.prompts,
        mini_batches=2,
        micro_batch=2,
        learning_rate=args.lr,
        critic_learning_rate=args.critic_lr,
        save_steps=2,
        seed=args.seed,
        agent=agent,
    )
    t = time.perf_counter()
    summary = train_s3(config, generator=generator)
    train_seconds = time.perf_counter() - t
    after = evaluate(
        work / "ppo" / "model",
        generator,
        test,
        str(index),
        agent,
        args.llm_options,
        work / "eval" / "ppo.json",
        args.engine,
    )
    close_llm(generator)
    table = {
        "naive RAG": bootstrap_ci(before["acc_naive"], seed=args.seed),
        "s3 before": bootstrap_ci(before["acc_s3"], seed=args.seed),
        "s3 after": bootstrap_ci(after["acc_s3"], seed=args.seed),
    }
    differences = {
        "s3 before - naive RAG": paired_difference_ci(before["acc_naive"], before["acc_s3"], seed=args.seed),
        "s3 after - naive RAG": paired_difference_ci(after["acc_naive"], after["acc_s3"], seed=args.seed),
        "s3 after - s3 before": paired_difference_ci(before["acc_s3"], after["acc_s3"], seed=args.seed),
    }
    log = [json.loads(line) for line in (work / "ppo" / "log.jsonl").read_text().splitlines()]
    step_seconds = sum(r.get("seconds", 0.0) for r in log)  # the steps' own times, also across resumed runs
    rewarded = sum(1 for r in log if r.get("reward", 0.0) > 0)
    out = {
        "smoke": args.smoke,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "test_questions": len(test),
        "settings": {**vars(args), "work": str(work), "results": str(results), "agent": dataclasses.asdict(agent)},
        "accuracy": table,
        "differences": differences,
        "searches": {"before": before["searches"], "after": after["searches"]},
        "training": {"summary": summary, "seconds": train_seconds, "step_seconds": step_seconds},
        "eval_seconds": {"before": before["seconds"], "after": after["seconds"]},
        "log": log,
        "seconds_total": time.perf_counter() - started,
    }
    (results / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    lines = [
        "# Learning benchmark: s3 PPO on the synthetic world (frozen SmolLM2 generator)",
        "",
        f"`{' '.join(['python', 'benchmarks/learn_s3.py', *sys.argv[1:]])}` on {out['machine']} (last invocation); "
        f"{len(log)} PPO steps x {args.prompts} questions ({step_seconds:.0f} s of steps; evals "
        f"{before['seconds']:.0f} s before, {after['seconds']:.0f} s after; {rewarded} step(s) with a mean reward "
        f"above 0). {len(test)} test questions; training data after the filter: {summary['data']}.",
        "",
        "| generator context | GenAcc | 95% CI |",
        "|---|---|---|",
        *[f"| {k} | {100 * v['mean']:.1f} | [{100 * v['lo']:.1f}, {100 * v['hi']:.1f}] |" for k, v in table.items()],
        "",
        "| comparison | difference | paired 95% CI | p |",
        "|---|---|---|---|",
        *[
            f"| {k} | {100 * d['mean']:+.1f} | [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | "
            f"{d['p_not_better']:.3f} |"
            for k, d in differences.items()
        ],
        "",
    ]
    (results / "results.md").write_text("\n".join(lines))
    curves = work / "ppo" / "curves.png"
    if curves.exists():
        (results / "curves.png").write_bytes(curves.read_bytes())
    print(f"results in {results}")


if __name__ == "__main__":
    main()
