"""Does ARENA's GRPO teach a small reader to answer and cite? EM / F1 and citation precision / recall on the dev
files, before and after training, with bootstrap CIs.

Training questions come from the HotpotQA / 2Wiki / MuSiQue train files in ../shared/data (given paragraphs as the
numbered references, supporting paragraphs as the relevance ground truth); evaluation is greedy ``arena`` on the
dev files' first questions, with their given paragraphs. SmolLM2-135M-Instruct with LoRA (the reference is the
base with the adapter disabled), ARENA's rewards (format + EM + relevance + bonus 10), ARENA's KL estimator.

The scale is tiny next to the paper's (tens of prompts instead of 24,500, a 135M model, references cut to the
first ``--max-references`` paragraphs to keep CPU prefill affordable), so the learning rate is raised; the point is
the direction of each metric and whether it is distinguishable from noise.

    python benchmarks/learn_arena.py            # CPU: expect well over an hour at the defaults (see docs)
    python benchmarks/learn_arena.py --smoke    # tiny random model, a few questions, 1 step
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
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "docs" / "results" / "learn_arena"
TRAIN = ["hotpotqa/hotpotqa_train.json", "2wikimultihopqa/wikihop_train_preprocess.json", "musique/musique_train.json"]
DEV = ["hotpotqa/hotpot.json", "2wikimultihopqa/wikihop.json", "musique/musique.json"]
METRICS = ("em", "f1", "citation_precision", "citation_recall", "format_ok")


def evaluate(model: Path, files: list[str], limit: int, agent: Any, options: str, out: Path) -> dict[str, Any]:
    """Greedy arena on the first ``limit`` questions of each dev file; per-question metrics (cached in ``out``)."""
    from sleuth.agents import Context
    from sleuth.data import load_examples
    from sleuth.eval.metrics import score_example
    from sleuth.llm import load_llm
    from sleuth.runner import run

    if out.exists():
        return json.loads(out.read_text())
    started = time.perf_counter()
    examples = [e for f in files for e in load_examples(f, limit=limit)]
    llm = load_llm(f"hf:{model}" + (f"?{options}" if options else ""))
    traces = run("arena", examples, Context(llm=llm, retriever=None, config=agent), progress=True)
    per: dict[str, list[float]] = {m: [] for m in METRICS}
    for trace in traces:
        scores = score_example(trace.example, trace.answer or "")
        per["em"].append(float(scores.get("em") or 0.0))
        per["f1"].append(float(scores.get("f1") or 0.0))
        per["citation_precision"].append(float(trace.meta.get("citation_precision") or 0.0))
        per["citation_recall"].append(float(trace.meta.get("citation_recall") or 0.0))
        per["format_ok"].append(float(bool(trace.meta.get("format_ok"))))
    result = {"model": str(model), "n": len(traces), "per_example": per, "seconds": time.perf_counter() - started}
    out.write_text(json.dumps(result) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--dev-questions", type=int, default=30, help="per dev file")
    parser.add_argument("--train-questions", type=int, default=200, help="per train file")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="G (paper: 7)")
    parser.add_argument("--max-references", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate (paper: 3e-6, full fine-tuning)")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Sampling
    from sleuth.train.arena_rl import ArenaRLConfig, train_arena

    started = time.perf_counter()
    work = args.work or REPO / "runs" / ("learn-arena-smoke" if args.smoke else "learn-arena")
    results = args.results or (work / "results" if args.smoke else RESULTS)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    (work / "eval").mkdir(exist_ok=True)
    if args.smoke:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_model

        base = work / "tiny-model"
        if not (base / "config.json").exists():
            build_tiny_model(base)
        args.dev_questions, args.train_questions, args.steps, args.prompts, args.group = 2, 4, 1, 2, 2
        tokens = 8
    else:
        from sleuth.assets import ensure_default_model

        base = ensure_default_model()
        tokens = 160
    dev = [str(DATA / f) for f in DEV]
    agent = ArenaConfig(sampling=Sampling(max_new_tokens=tokens), max_references=args.max_references)
    before = evaluate(base, dev, args.dev_questions, agent, args.llm_options, work / "eval" / "base.json")
    config = ArenaRLConfig(
        model=str(base),
        output_dir=str(work / "grpo"),
        train_files=[str(DATA / f) for f in TRAIN],
        train_limit=args.train_questions,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        learning_rate=args.lr,
        warmup_steps=0,
        micro_batch=2,
        lora=not args.smoke,
        save_steps=2,
        seed=args.seed,
        agent=agent,
    )
    t = time.perf_counter()
    summary = train_arena(config)
    train_seconds = time.perf_counter() - t
    after = evaluate(
        work / "grpo" / "model", dev, args.dev_questions, agent, args.llm_options, work / "eval" / "grpo.json"
    )

    table = {}
    for metric in METRICS:
        b, a = before["per_example"][metric], after["per_example"][metric]
        table[metric] = {
            "before": bootstrap_ci(b, seed=args.seed),
            "after": bootstrap_ci(a, seed=args.seed),
            "difference": paired_difference_ci(b, a, seed=args.seed),
        }
    log = [json.loads(line) for line in (work / "grpo" / "log.jsonl").read_text().splitlines()]
    out = {
        "smoke": args.smoke,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "dev_questions": before["n"],
        "settings": {**vars(args), "work": str(work), "results": str(results), "agent": dataclasses.asdict(agent)},
        "metrics": table,
        "training": {"summary": summary, "seconds": train_seconds},
        "log": log,
        "seconds_total": time.perf_counter() - started,
    }
    (results / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    lines = [
        "# Learning benchmark: ARENA GRPO (LoRA) on the multi-hop train files",
        "",
        f"`python benchmarks/learn_arena.py{' --smoke' if args.smoke else ''}` on {out['machine']}; "
        f"{out['seconds_total']:.0f} s in all ({train_seconds:.0f} s training). {before['n']} dev questions.",
        "",
        "| metric | before | after | difference (paired 95% CI) | p |",
        "|---|---|---|---|---|",
    ]
    for metric, row in table.items():
        d = row["difference"]
        lines.append(
            f"| {metric} | {100 * row['before']['mean']:.1f} | {100 * row['after']['mean']:.1f} | "
            f"{100 * d['mean']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | {d['p_not_better']:.3f} |"
        )
    lines += ["", "Training curves: `curves.png` (reward components, KL, entropy, response length per step).", ""]
    (results / "results.md").write_text("\n".join(lines))
    curves = work / "grpo" / "curves.png"
    if curves.exists():
        (results / "curves.png").write_bytes(curves.read_bytes())
    print(f"results in {results}")


if __name__ == "__main__":
    main()
