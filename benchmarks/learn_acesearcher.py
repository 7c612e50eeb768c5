"""Does AceSearcher's training recipe teach a small model? EM on held-out synthetic questions, stage by stage.

A synthetic multi-hop world (2-3 hops, invented entities: nothing is answerable from pre-training) is generated;
SmolLM2-135M-Instruct on CPU then goes through the paper's two stages, and the same held-out test questions are
answered greedily by the ``acesearcher`` agent (BM25 over the world's corpus) after each stage:

1. ``base``: the model as shipped;
2. ``sft``: after Stage I (:func:`sleuth.train.sft.train_sft`: decomposition, sub-question answering with passages
   and final-answer records built from the world's gold decompositions);
3. ``mdpo-1`` .. ``mdpo-T``: after each iteration of Stage II (:func:`sleuth.train.mdpo.train_mdpo`: m x m' sampled
   trajectories per training question, EM x format rewards, DPO against the previous iteration's model).

Reported per stage: EM with a bootstrap 95% CI over test questions, and paired bootstrap CIs of the EM difference
between stages (same questions, so the pairing removes the question difficulty variance). Results go to
``docs/results/learn_acesearcher/`` (``results.json``, ``results.md``, ``curve.png``).

The scale is tiny next to the paper's (hundreds of questions instead of 180K SFT records and 49K RFT prompts, a
135M model), so learning rates are raised and batches shrunk (flags below); the point is the direction of the
curve and whether each stage's change is distinguishable from noise, not the paper's numbers.

    python benchmarks/learn_acesearcher.py            # about 45-60 minutes on 2 CPU cores (hf engine)
    python benchmarks/learn_acesearcher.py --smoke    # tiny random model, a handful of questions, 1-2 steps
    python benchmarks/learn_acesearcher.py --engine "vllm:{model}?max_num_seqs=64"   # a vLLM server per model

``--engine`` runs every evaluation and the mDPO sampling on ``hf`` or on a vLLM server sleuth starts on each model
(``vllm``, or a ``vllm:{model}?...`` template; :mod:`sleuth.train.mdpo`). The default, ``auto``, is ``vllm`` when
vLLM is installed (``make vllm``), else ``hf``; ``--smoke`` defaults to ``hf`` (its tiny random model would make vLLM
compile a new model for minutes).
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
RESULTS = REPO / "docs" / "results" / "learn_acesearcher"


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def evaluate(
    model_dir: Path, examples: list[Any], index: str, agent: Any, options: str, engine: str = "hf"
) -> dict[str, Any]:
    """Greedy acesearcher EM of one model on ``examples`` (per-question values kept for the paired CIs)."""
    from types import SimpleNamespace

    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.train.mdpo import close_llm, engine_spec, evaluate_dev

    started = time.perf_counter()
    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=options), model_dir))
    try:
        result = evaluate_dev(examples, llm, load_retriever(index), agent, concurrency=64, progress=True)
    finally:
        close_llm(llm)
    result["engine"] = engine
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["model"] = str(model_dir)
    return result


def settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        return {
            "world": {
                "seed": args.seed,
                "min_hops": 2,
                "max_hops": 3,
                "train_entities": 60,
                "dev_entities": 30,
                "test_entities": 30,
                "train_questions": 12,
                "dev_questions": 2,
                "test_questions": 4,
            },
            "sft_questions": {"decompose": 4, "context_qa": 4, "final": 4},
            "sft_steps": 2,
            "sft_lr": 1e-3,
            "sft_batch": 4,
            "max_length": 1024,
            "rft_questions": 2,
            "decompositions": 2,
            "solutions": 2,
            "iterations": 2,
            "dpo_steps": 1,
            "dpo_lr": 1e-3,
            "dpo_batch": 2,
            "dev_questions": 1,
            "k": 2,
            "total_passages": 4,
            "tokens": {"decompose": 16, "subanswer": 6, "final": 12},
        }
    return {
        "world": {
            "seed": args.seed,
            "min_hops": 2,
            "max_hops": 3,
            "train_questions": 2000,
            "dev_questions": 100,
            "test_questions": args.test_questions,
        },
        "sft_questions": {
            "decompose": args.sft_decompose_questions,
            "context_qa": args.sft_questions,
            "final": args.sft_questions,
        },
        "sft_steps": -1,
        "sft_lr": args.sft_lr,
        "sft_batch": 8,
        "max_length": 1024,
        "rft_questions": args.rft_questions,
        "decompositions": args.decompositions,
        "solutions": args.solutions,
        "iterations": args.iterations,
        "dpo_steps": -1,
        "dpo_lr": args.dpo_lr,
        "dpo_batch": 8,
        "dev_questions": 0,
        "k": args.k,
        "total_passages": args.total_passages,
        # the final call restates each sub-answer before <answer> (as the SFT records do): 48 tokens truncated
        # 3-hop chains before the tag in the first run, so the budget is 128
        "tokens": {"decompose": 64, "subanswer": 12, "final": 128},
    }


def base_model(args: argparse.Namespace, work: Path) -> Path:
    if args.smoke:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_model

        target = work / "tiny-model"
        return target if (target / "config.json").exists() else build_tiny_model(target)
    from sleuth.assets import ensure_default_model

    return ensure_default_model()


def run_sft(base: Path, world: Path, out: Path, s: dict[str, Any], agent: Any, seed: int) -> tuple[Path, float]:
    from sleuth.train.sft import SFTConfig, train_sft

    train = str(world / "train.jsonl")
    limit = s["sft_questions"]  # per competency: decompositions are short, context records are long and costly
    config = SFTConfig(
        model=str(base),
        output_dir=str(out),
        sources=[
            {"path": train, "format": "synth", "kind": "decompose", "limit": limit["decompose"]},
            {"path": train, "format": "synth", "kind": "context_qa", "steps": True, "limit": limit["context_qa"]},
            {"path": train, "format": "synth", "kind": "final", "limit": limit["final"]},
        ],
        val_fraction=0.0,
        lr=s["sft_lr"],
        batch_size=s["sft_batch"],
        per_device_batch_size=4,
        max_steps=s["sft_steps"],
        max_length=s["max_length"],
        context_passages=s["k"],  # as many passages as the agent retrieves per sub-question
        save_steps=100,
        logging_steps=5,
        seed=seed,
        gradient_checkpointing=False,
        agent=agent,
    )
    if not (out / "config.json").exists():  # the final model is saved last; a killed run resumes its checkpoints
        train_sft(config)
    return out, _sft_runtime(out)


def _sft_runtime(out: Path) -> float:
    """The SFT trainer's own ``train_runtime`` (recorded in its log), so a resumed benchmark still reports it."""
    log = out / "log.jsonl"
    runtime = 0.0
    if log.exists():
        for line in log.read_text().splitlines():
            runtime = json.loads(line).get("train_runtime", runtime)
    return float(runtime)


def _mdpo_seconds(out: Path) -> float:
    """Sampling + pair building + DPO seconds of every mDPO iteration, from each iteration's ``stats.json``."""
    total = 0.0
    for stats in sorted(out.glob("iter*/stats.json")):
        total += sum(v for v in json.loads(stats.read_text()).get("seconds", {}).values() if v)
    return total


def run_mdpo(model: Path, world: Path, out: Path, s: dict[str, Any], agent: Any, args: argparse.Namespace) -> dict:
    from sleuth.train.mdpo import MDPOConfig, train_mdpo

    config = MDPOConfig(
        model=str(model),
        output_dir=str(out),
        data_dir=str(world),
        index=args.index,
        train_limit=s["rft_questions"],
        dev_limit=s["dev_questions"],
        llm_options=args.llm_options,
        engine=args.engine,
        agent=agent,
        decompositions=s["decompositions"],
        solutions=s["solutions"],
        iterations=s["iterations"],
        learning_rate=s["dpo_lr"],
        batch_size=s["dpo_batch"],
        per_device_batch_size=1,
        max_steps=s["dpo_steps"],
        max_length=s["max_length"],
        warmup_ratio=0.0 if args.smoke else 0.05,
        seed=args.seed,
        eval_initial=False,
    )
    return train_mdpo(config)


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def plot(stages: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'sleuth[report]'): no curve.png")
        return False
    names = [s["stage"] for s in stages]
    means = [100 * s["em"]["mean"] for s in stages]
    lower = [100 * (s["em"]["mean"] - s["em"]["lo"]) for s in stages]
    upper = [100 * (s["em"]["hi"] - s["em"]["mean"]) for s in stages]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.errorbar(range(len(names)), means, yerr=[lower, upper], marker="o", capsize=4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("test EM (%)")
    ax.set_title("AceSearcher recipe on the synthetic world (95% bootstrap CI)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _short(path: str) -> str:
    """A model directory for the table: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def _num(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Learning benchmark: AceSearcher SFT + mDPO on the synthetic world",
        "",
        f"`python benchmarks/learn_acesearcher.py{' --smoke' if results['smoke'] else ''}"
        f" --engine '{results['settings'].get('engine', 'hf')}'` "
        f"on {results['machine']}; recorded compute per stage (summed over resumed runs): "
        + ", ".join(f"{k} {v / 60:.0f} min" for k, v in results["seconds"].items())
        + f"; this invocation {results['seconds_total'] / 60:.0f} min.",
        "",
        f"Test questions: {results['test_questions']} held-out questions (2-3 hops, entities disjoint from "
        "training). Greedy decoding, BM25 top-k per sub-question. EM with a 95% bootstrap CI over questions "
        "(1000 resamples).",
        "",
        "| stage | model | EM | 95% CI |",
        "|---|---|---|---|",
    ]
    for s in results["stages"]:
        em = s["em"]
        lines.append(
            f"| {s['stage']} | `{_short(s['model'])}` | {100 * em['mean']:.1f} | "
            f"[{100 * em['lo']:.1f}, {100 * em['hi']:.1f}] |"
        )
    lines += [
        "",
        "Paired differences (same questions; p = share of resamples with a difference <= 0):",
        "",
        "| comparison | EM difference | 95% CI | p |",
        "|---|---|---|---|",
    ]
    for name, d in results["differences"].items():
        lines.append(
            f"| {name} | {100 * d['mean']:+.1f} | [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | "
            f"{d['p_not_better']:.3f} |"
        )
    if results.get("mdpo"):
        lines += [
            "",
            "mDPO iterations (training-question rollouts):",
            "",
            "| iteration | trajectories | ties (decomposition / solver groups) | pairs (decompose / subq / final) "
            "| mean reward | reward margin | DPO steps | DPO accuracy | final implicit-reward margin |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for it in results["mdpo"]["iterations"]:
            pairs = it.get("pairs") or {}
            ties = it.get("degenerate") or {}
            lines.append(
                f"| {it['iteration']} | {it.get('trajectories', '–')} | {ties.get('decompose_tie', '–')} / "
                f"{ties.get('solver_tie', '–')} | {pairs.get('decompose', 0)} / {pairs.get('subq', 0)} / "
                f"{pairs.get('final', 0)} | {_num(it.get('mean_reward'))} | {_num(it.get('reward_margin'))} | "
                f"{it.get('dpo_steps', '–')} | {_num(it.get('dpo_accuracy'))} | {_num(it.get('dpo_final_margin'))} |"
            )
    lines += ["", "Settings:", "", "```json", json.dumps(results["settings"], indent=2), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few questions, 1-2 steps")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default runs/learn-acesearcher)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-questions", type=int, default=60)
    parser.add_argument(
        "--sft-questions", type=int, default=24, help="training questions turned into context-QA and final records"
    )
    parser.add_argument(
        "--sft-decompose-questions", type=int, default=160, help="training questions turned into decomposition records"
    )
    parser.add_argument("--rft-questions", type=int, default=16, help="training questions sampled per mDPO iteration")
    parser.add_argument("--decompositions", type=int, default=2, help="m (paper: 3)")
    parser.add_argument("--solutions", type=int, default=3, help="m' (paper: 4)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--k", type=int, default=3, help="passages per sub-question (paper: 10)")
    parser.add_argument("--total-passages", type=int, default=6, help="N, the final call's passage budget (paper: 15)")
    parser.add_argument("--sft-lr", type=float, default=1e-4, help="paper: 5e-6 (1.5B, 180K records)")
    parser.add_argument("--dpo-lr", type=float, default=5e-6, help="paper: 1e-6 (1.5B, 49K prompts)")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--index", default="", help="retriever spec (default: BM25 over the world's corpus)")
    parser.add_argument(
        "--engine",
        default="auto",
        help="hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    args = parser.parse_args()
    from sleuth.train.mdpo import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)

    from sleuth.agents.acesearcher import AceSearcherConfig
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.llm import Sampling
    from sleuth.retrieval.bm25 import build_bm25_index

    started = time.perf_counter()
    s = settings(args)
    work = args.work or REPO / "runs" / ("learn-acesearcher-smoke" if args.smoke else "learn-acesearcher")
    results_dir = args.results or (work / "results" if args.smoke else RESULTS)
    work.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    # resumption reuses the world, models and cached evals of the working directory: only with the same settings
    stamp = work / "settings.json"
    engine = {"engine": args.engine} if args.engine != "hf" else {}  # hf runs from before the option still resume
    key = json.loads(json.dumps({**s, "index": args.index, "llm_options": args.llm_options, **engine}))
    if stamp.exists() and json.loads(stamp.read_text()) != key:
        raise SystemExit(f"{work} holds a run with other settings ({stamp}); remove it or pass --work DIR")
    stamp.write_text(json.dumps(key, indent=2) + "\n")
    world = work / "world"
    if not (world / "world.json").exists():
        synthesize(world, **s["world"])
    if not args.index:
        index_dir = work / "index"
        if not index_dir.exists():
            build_bm25_index(world / "corpus.jsonl", index_dir)
        args.index = str(index_dir)
    tokens = s["tokens"]
    agent = AceSearcherConfig(
        k=s["k"],
        total_passages=s["total_passages"],
        max_subquestions=4,
        sampling=Sampling(temperature=0.0, max_new_tokens=max(tokens.values())),
        decompose_max_new_tokens=tokens["decompose"],
        subanswer_max_new_tokens=tokens["subanswer"],
        final_max_new_tokens=tokens["final"],
    )
    test = list(load_synth(world / "test.jsonl"))[: s["world"]["test_questions"]]

    stages: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}

    def measure(stage: str, model: Path) -> None:
        cached = work / "eval" / f"{stage}.json"  # a rerun after a kill skips the stages already measured
        if cached.exists():
            result = json.loads(cached.read_text())
        else:
            result = evaluate(model, test, args.index, agent, args.llm_options, args.engine)
            cached.parent.mkdir(exist_ok=True)
            cached.write_text(json.dumps(result) + "\n")
        stages.append(
            {
                "stage": stage,
                "model": str(model),
                "em": bootstrap_ci(result["per_example_em"], seed=args.seed),
                "per_example_em": result["per_example_em"],
                "errors": result["errors"],
                "seconds": result["seconds"],
            }
        )
        print(f"{stage}: EM {100 * stages[-1]['em']['mean']:.1f} on {len(test)} test questions", flush=True)

    base = base_model(args, work)
    measure("base", base)
    try:
        sft, seconds["sft"] = run_sft(base, world, work / "sft", s, agent, args.seed)
    except ImportError as exc:  # the SFT trainer needs the train extra
        raise SystemExit(f"SFT needs sleuth[train]: {exc}") from None
    measure("sft", sft)
    summary = run_mdpo(sft, world, work / "mdpo", s, agent, args)
    seconds["mdpo"] = _mdpo_seconds(work / "mdpo")
    for it in summary["iterations"]:  # what the table needs to explain a flat curve: ties and how far DPO moved
        stats_file = work / "mdpo" / f"iter{it['iteration']}" / "stats.json"
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            it["trajectories"] = stats.get("trajectories")
            it["degenerate"] = stats.get("degenerate")
            it["dpo_steps"] = (stats.get("dpo") or {}).get("steps")
            it["dpo_final_margin"] = (stats.get("dpo") or {}).get("final_margin")
    for it in summary["iterations"]:
        measure(f"mdpo-{it['iteration']}", work / "mdpo" / f"iter{it['iteration']}" / "model")

    by_name = {st["stage"]: st["per_example_em"] for st in stages}
    names = [st["stage"] for st in stages]
    comparisons = [("sft", "base"), *[(n, "sft") for n in names if n.startswith("mdpo")]]
    comparisons += [(names[i], names[i - 1]) for i in range(3, len(names))]
    differences = {
        f"{after} - {before}": paired_difference_ci(by_name[before], by_name[after], seed=args.seed)
        for after, before in comparisons
    }
    results = {
        "smoke": args.smoke,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "test_questions": len(test),
        "settings": {
            **s,
            "agent": dataclasses.asdict(agent),
            "llm_options": args.llm_options,
            "index": args.index,
            "engine": args.engine,
        },
        "stages": stages,
        "differences": differences,
        "mdpo": summary,
        "seconds": {**seconds, "eval": sum(st["seconds"] for st in stages)},
        "seconds_total": time.perf_counter() - started,
    }
    (results_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    plot(stages, results_dir / "curve.png")
    (results_dir / "results.md").write_text(markdown(results))
    print(f"results in {results_dir}")


if __name__ == "__main__":
    main()
