"""Does ExSearch's generalized EM teach a small model to search? Held-out EM on synthetic questions, stage by stage,
with the paper's "w/o w(z)" ablation (uniform weights) in the same run.

A synthetic multi-hop world (2-3 hops, invented entities: nothing is answerable from pre-training; the same world as
``learn_acesearcher.py`` for a seed) is generated; SmolLM2-135M-Instruct on CPU then goes through ExSearch's recipe
and the same held-out test questions are answered greedily by the ``exsearch`` agent (BM25 over the world) after
each stage:

1. ``base``: the model as shipped;
2. ``warm-up``: SFT on seed trajectories in the ExSearch format (FireAct ReAct trajectories from ../shared/data
   when present + gold trajectories from the world's training decompositions), observation tokens masked;
3. ``em-t``: after EM iteration t with the paper's weights w(z) = p(gold | x, z) (Algorithm 1);
4. ``uniform-t``: the same iterations with every weight 1 (naive self-training, the paper's ablation). Iteration 0
   of both arms trains on the *same* sampled trajectories (the E-step rollouts are shared), so the two differ only
   in the weighting.

Reported per stage: EM with a bootstrap 95% CI over test questions, paired bootstrap CIs of the differences, the
weight distribution and the searches per trajectory. Results go to ``docs/results/learn_exsearch/``.

The scale is tiny next to the paper's (tens of E-step questions instead of 10^4-10^5, a 135M model, k=2 documents
per search, one EM iteration by default), so learning rates are raised; the point is the direction and whether
the weighting matters, not the paper's numbers. There is no dev-based early stopping here (every iteration is
measured on the test questions instead; ``sleuth train exsearch`` stops early on dev EM).

    python benchmarks/learn_exsearch.py              # about 45 minutes on 2 CPU cores
    python benchmarks/learn_exsearch.py --smoke      # tiny random model, a handful of questions, 1 step
    python benchmarks/learn_exsearch.py --engine vllm   # evaluations and E-step sampling on vLLM servers

``--engine`` runs the evaluations and the E-step sampling on ``hf`` or on a vLLM server sleuth starts on each model
(``vllm``, or a ``vllm:{model}?...`` template; the E-step's scoring stays on hf, see
:mod:`sleuth.train.exsearch_em`). The default, ``auto``, is ``vllm`` when vLLM is installed (``make vllm``), else
``hf``; ``--smoke`` defaults to ``hf`` (its tiny random model would make vLLM compile a new model for minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from sleuth.eval.stats import bootstrap_ci, paired_difference_ci

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "learn_exsearch"
FIREACT = REPO.parent / "shared" / "data" / "fireact" / "hotpotqa_react_trajectories.jsonl"


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
            "warmup_synth": 4,
            "fireact_limit": 2,
            "warmup_epochs": 1,
            "warmup_lr": 1e-3,
            "em_questions": 3,
            "samples": 2,
            "iterations": 1,
            "em_lr": 1e-3,
            "em_epochs": 1,
            "batch": 2,
            "max_steps": 1,
            "k": 2,
            "tokens": {"turn": 8, "answer": 6},
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
        "warmup_synth": args.warmup_questions,
        "fireact_limit": args.fireact,
        "warmup_epochs": 2,
        "warmup_lr": args.warmup_lr,
        "em_questions": args.em_questions,
        "samples": 2,
        "iterations": args.iterations,
        "em_lr": args.em_lr,
        "em_epochs": 1,
        "batch": 8,
        "max_steps": -1,
        "k": 2,
        "tokens": {"turn": 48, "answer": 16},
    }


def base_model(args: argparse.Namespace, work: Path) -> Path:
    if args.smoke:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_model

        target = work / "tiny-model"
        return target if (target / "config.json").exists() else build_tiny_model(target)
    from sleuth.assets import ensure_default_model

    return ensure_default_model()


def em_config(s: dict[str, Any], args: argparse.Namespace, agent: Any, **fields: Any) -> Any:
    from sleuth.train.exsearch_em import EMConfig

    return EMConfig(
        llm_options=args.llm_options,
        engine=args.engine,
        agent=agent,
        fireact=str(FIREACT) if FIREACT.exists() and s["fireact_limit"] else "",
        fireact_limit=s["fireact_limit"],
        warmup_synth=s["warmup_synth"],
        warmup_epochs=s["warmup_epochs"],
        warmup_lr=s["warmup_lr"],
        train_limit=s["em_questions"],
        dev_limit=0,
        samples=s["samples"],
        iterations=s["iterations"],
        patience=s["iterations"],
        learning_rate=s["em_lr"],
        epochs=s["em_epochs"],
        batch_size=s["batch"],
        per_device_batch_size=2,
        warmup_ratio=0.0 if args.smoke else 0.1,
        max_length=2048,
        max_steps=s["max_steps"],
        save_steps=25,
        seed=args.seed,
        **fields,
    )


def evaluate(
    model_dir: Path, examples: list[Any], index: str, agent: Any, options: str, out: Path, engine: str = "hf"
) -> dict:
    """Greedy exsearch EM of one model on ``examples`` (per-question values kept for the paired CIs); cached in
    ``out`` so a rerun after a kill skips finished stages."""
    from types import SimpleNamespace

    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.train.exsearch_em import evaluate as run_eval
    from sleuth.train.mdpo import close_llm, engine_spec

    if out.exists():
        return json.loads(out.read_text())
    started = time.perf_counter()
    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=options), model_dir))
    try:
        result = run_eval(examples, llm, load_retriever(index), agent, out.with_suffix(".traces.jsonl"), 64)
    finally:
        close_llm(llm)
    result["engine"] = engine
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["model"] = str(model_dir)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


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
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    shared = [s for s in stages if s["arm"] == "shared"]
    iterations = max(len([s for s in stages if s["arm"] == arm]) for arm in ("em", "uniform"))
    for arm, style in (("em", "o-"), ("uniform", "s--")):
        line = shared + [s for s in stages if s["arm"] == arm]
        means = [100 * s["em"]["mean"] for s in line]
        err = [
            [100 * (s["em"]["mean"] - s["em"]["lo"]) for s in line],
            [100 * (s["em"]["hi"] - s["em"]["mean"]) for s in line],
        ]
        label = "EM, w(z) = p(y | x, z)" if arm == "em" else "w/o w(z) (uniform)"
        ax.errorbar(range(len(line)), means, yerr=err, fmt=style, capsize=4, label=label, alpha=0.85)
    names = [s["stage"] for s in shared] + [f"EM iter {i}" for i in range(iterations)]
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("test EM (%)")
    ax.set_title("ExSearch EM on the synthetic world (95% bootstrap CI)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Learning benchmark: ExSearch warm-up + generalized EM on the synthetic world",
        "",
        f"`python benchmarks/learn_exsearch.py{' --smoke' if results['smoke'] else ''}"
        f" --engine '{results['settings'].get('engine', 'hf')}'` "
        f"on {results['machine']}; this invocation {results['seconds_total']:.0f} s (stage totals below).",
        "",
        f"Test questions: {results['test_questions']} held-out questions (2-3 hops, entities disjoint from "
        "training). Greedy decoding, BM25 top-k per sub-query. EM with a 95% bootstrap CI over questions "
        "(1000 resamples).",
        "",
        "| stage | EM | 95% CI | F1 | searches / question | eval s |",
        "|---|---|---|---|---|---|",
    ]
    for s in results["stages"]:
        em = s["em"]
        lines.append(
            f"| {s['stage']} | {_pct(em['mean'])} | [{_pct(em['lo'])}, {_pct(em['hi'])}] | {_pct(s['f1'])} | "
            f"{s['searches']:.2f} | {s['seconds']:.0f} |"
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
    lines += [
        "",
        "E-step trajectories per iteration (training questions, sampled at T=0.8; weights before training):",
        "",
        "| arm | iteration | trajectories | sampled EM | mean w | median w | w > 0.5 | searches | M-step loss "
        "first -> last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, its in results["iterations"].items():
        for it in its:
            traj, m = it.get("trajectories") or {}, it.get("m_step") or {}
            w = traj.get("weight") or {}
            first, last = m.get("first_loss"), m.get("last_loss")
            lines.append(
                f"| {arm} | {it['iteration']} | {traj.get('n')} | {_pct(traj.get('sampled_em'))} | "
                f"{w.get('mean', 0):.3f} | {w.get('median', 0):.3f} | {w.get('above_0.5')} | "
                f"{traj.get('searches_per_trajectory', 0):.2f} | "
                f"{'-' if first is None else f'{first:.3f}'} -> {'-' if last is None else f'{last:.3f}'} |"
            )
    warm = results.get("warmup_data") or {}
    lines += [
        "",
        f"Warm-up data: {warm.get('records')} trajectories "
        + ", ".join(f"{r['source']}: {r['records']} (skipped {r['skipped']})" for r in warm.get("sources", [])),
        "",
        "Recorded compute per stage, seconds (a resumed run keeps the earlier runs' timings): "
        + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items()),
        "",
        "Settings:",
        "",
        "```json",
        json.dumps(results["settings"], indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few questions, 1 step")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default runs/learn-exsearch)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-questions", type=int, default=60)
    parser.add_argument("--warmup-questions", type=int, default=40, help="gold synthetic warm-up trajectories")
    parser.add_argument("--fireact", type=int, default=20, help="FireAct warm-up trajectories (0: none)")
    parser.add_argument("--em-questions", type=int, default=24, help="training questions per E-step")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--warmup-lr", type=float, default=1e-4, help="paper: 2e-6 (3B-24B, 1,000 trajectories)")
    parser.add_argument("--em-lr", type=float, default=3e-5, help="paper: 2e-6")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument(
        "--engine",
        default="auto",
        help="hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    args = parser.parse_args()
    from sleuth.train.mdpo import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)

    from sleuth.agents.exsearch import ExSearchConfig
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.llm import Sampling
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.train.exsearch_em import train_exsearch, train_weighted, warmup_records

    started = time.perf_counter()
    s = settings(args)
    work = args.work or REPO / "runs" / ("learn-exsearch-smoke" if args.smoke else "learn-exsearch")
    results_dir = args.results or (work / "results" if args.smoke else RESULTS)
    work.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    world = work / "world"
    if not (world / "world.json").exists():
        synthesize(world, **s["world"])
    index = work / "index"
    if not index.exists():
        build_bm25_index(world / "corpus.jsonl", index)
    agent = ExSearchConfig(
        k=s["k"],
        max_steps=4,
        sampling=Sampling(temperature=0.0, max_new_tokens=s["tokens"]["turn"]),
        answer_max_new_tokens=s["tokens"]["answer"],
    )
    test = list(load_synth(world / "test.jsonl"))[: s["world"]["test_questions"]]
    train = list(load_synth(world / "train.jsonl"))
    seconds: dict[str, float] = {}
    stages: list[dict[str, Any]] = []

    def measure(stage: str, arm: str, model: Path) -> None:
        result = evaluate(
            model, test, str(index), agent, args.llm_options, work / "eval" / f"{stage}.json", args.engine
        )
        stages.append(
            {
                "stage": stage,
                "arm": arm,
                "model": str(model),
                "em": bootstrap_ci(result["per_example_em"], seed=args.seed),
                "f1": result["f1"],
                "searches": result["searches"],
                "per_example_em": result["per_example_em"],
                "errors": result["errors"],
                "seconds": result["seconds"],
            }
        )
        print(f"{stage}: EM {100 * stages[-1]['em']['mean']:.1f} on {len(test)} test questions", flush=True)

    (work / "eval").mkdir(exist_ok=True)
    base = base_model(args, work)
    measure("base", "shared", base)

    # warm-up: the same records and trainer `sleuth train exsearch` uses
    t = time.perf_counter()
    warm_dir = work / "warmup"
    warm_dir.mkdir(exist_ok=True)
    config = em_config(s, args, agent, model=str(base), output_dir=str(warm_dir), data_dir=str(world))
    data = warm_dir / "data.jsonl"
    if not data.exists():
        # warm-up questions from the second half of the training split: the E-step samples the first ones
        records, report = warmup_records(config, train[len(train) // 2 :], load_retriever(str(index)))
        (warm_dir / "data_summary.json").write_text(json.dumps(report, indent=2) + "\n")
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
    records = [json.loads(line) for line in data.read_text().splitlines()]
    warm_stats = train_weighted(records, base, warm_dir, config, s["warmup_lr"], s["warmup_epochs"])
    seconds["warmup"] = warm_stats.get("seconds") or time.perf_counter() - t  # the trainer's time survives a resume
    warm = warm_dir / "model"
    measure("warm-up", "shared", warm)

    # EM with the paper's weights, then the uniform ablation on the same iteration-0 rollouts
    summaries: dict[str, Any] = {}
    for arm, weighting in (("em", "likelihood"), ("uniform", "uniform")):
        out = work / arm
        if arm == "uniform" and not (out / "iter0" / "rollouts").exists() and (work / "em" / "iter0").exists():
            (out / "iter0").mkdir(parents=True, exist_ok=True)
            shutil.copytree(work / "em" / "iter0" / "rollouts", out / "iter0" / "rollouts")
        t = time.perf_counter()
        config = em_config(
            s,
            args,
            agent,
            model=str(warm),
            output_dir=str(out),
            data_dir=str(world),
            index=str(index),
            warmup=False,
            weighting=weighting,
        )
        summaries[arm] = train_exsearch(config)
        # E-step + M-step seconds recorded per iteration (stats.json), so a resumed run still reports them
        recorded = [
            sum(json.loads((out / f"iter{it['iteration']}" / "stats.json").read_text()).get("seconds", {}).values())
            for it in summaries[arm]["iterations"]
        ]
        seconds[arm] = sum(recorded) if all(recorded) else time.perf_counter() - t
        for it in summaries[arm]["iterations"]:
            measure(f"{arm}-{it['iteration']}", arm, out / f"iter{it['iteration']}" / "model")

    by_name = {st["stage"]: st["per_example_em"] for st in stages}
    comparisons = [("warm-up", "base")]
    for i in range(s["iterations"]):
        if f"em-{i}" in by_name:
            comparisons.append((f"em-{i}", "warm-up"))
        if f"uniform-{i}" in by_name:
            comparisons.append((f"uniform-{i}", "warm-up"))
        if f"em-{i}" in by_name and f"uniform-{i}" in by_name:
            comparisons.append((f"em-{i}", f"uniform-{i}"))
    differences = {
        f"{after} - {before}": paired_difference_ci(by_name[before], by_name[after], seed=args.seed)
        for after, before in comparisons
    }
    iterations = {
        arm: [json.loads((work / arm / f"iter{i['iteration']}" / "stats.json").read_text()) for i in sm["iterations"]]
        for arm, sm in summaries.items()
    }
    warmup_data = json.loads((warm_dir / "data_summary.json").read_text())
    results = {
        "smoke": args.smoke,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "test_questions": len(test),
        "settings": {**s, "agent": dataclasses.asdict(agent), "llm_options": args.llm_options, "engine": args.engine},
        "stages": stages,
        "differences": differences,
        "iterations": iterations,
        "warmup_data": warmup_data,
        "warmup_training": warm_stats,
        "seconds": {**seconds, "eval": sum(st["seconds"] for st in stages)},
        "seconds_total": time.perf_counter() - started,
    }
    (results_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    plot(stages, results_dir / "curve.png")
    (results_dir / "results.md").write_text(markdown(results))
    print(f"results in {results_dir}")


if __name__ == "__main__":
    main()
