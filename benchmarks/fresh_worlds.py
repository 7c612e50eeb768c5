"""A comparison confirmed on questions no earlier choice saw: the test splits of fresh worlds.

A setting picked after its test result was seen (the mDPO lr sweep's 2e-6, better than SFT on the 150 test questions
by 5 / 2) cannot be shown on those questions again. This script tests it on new ones from the same distribution:
worlds generated with the source run's world settings and other seeds (1-5 by default, 150 test questions each, so
750), every one's own corpus and BM25 index, and the same greedy agent. The claim, the models (by content hash), the
worlds and the rule are written to ``declaration.json`` before any evaluation; a later run with another declaration is
refused, so what is tested cannot change once evaluation has begun. The harness judges the claim (one-sided
exact test on the discordant questions, shown at p < 0.05).

    python benchmarks/fresh_worlds.py --source docs/results/learn_acesearcher/lr_sweep \\
        --before sft=RUNS/learn-acesearcher/sft --after mdpo-1=RUNS/learn-acesearcher/mdpo-8d95eb0b43df/iter1/model \\
        --claim "mDPO-1 (lr 2e-6) > SFT" --results docs/results/learn_acesearcher/fresh_worlds --declare-only
    # commit declaration.json, then the same command without --declare-only

Every evaluation is cached under its key (:mod:`harness`): a killed run resumes at the next world.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402  (the benchmarks directory is not a package)
    Experiment,
    ModelServer,
    bootstrap_ci,
    content_hash,
    declare,
    difference_table,
    runs_home,
    stage_table,
)


def agent_from(settings: dict[str, Any]) -> Any:
    """The source run's greedy agent (its ``results.json`` ``settings.agent``)."""
    from sleuth.agents.acesearcher import AceSearcherConfig
    from sleuth.train.config import from_mapping

    return from_mapping(AceSearcherConfig, settings["agent"], source="settings.agent")


def declaration(args: argparse.Namespace, source: dict[str, Any], models: dict[str, Path]) -> dict[str, Any]:
    world = dict(source["settings"]["world"])
    before, after = (name.split("=", 1)[0] for name in (args.before, args.after))
    return {
        "claim": {"name": args.claim, "metric": args.metric, "before": before, "after": after},
        "rule": "harness.claims: one-sided exact binomial test on the questions where the two differ, shown at "
        "p < 0.05 on all the fresh worlds' test questions together",
        "models": {stage: {"path": str(path), "sha256": content_hash(path)} for stage, path in models.items()},
        "worlds": [{**world, "seed": seed} for seed in args.seeds],
        "questions_per_world": args.questions or world["test_questions"],
        "source": str(Path(args.source)),
        "agent": source["settings"]["agent"],
        "engine": args.engine,
        "llm_options": source["settings"]["llm_options"],
    }


def tested(declared: dict[str, Any]) -> dict[str, Any]:
    """What a declaration fixes: claim, rule, worlds, agent, engine and the models by content; not where the files
    lie (another checkout or machine with the same models runs the same test) nor when it was declared."""
    fixed = {k: v for k, v in declared.items() if k not in ("declared_at", "commit", "source", "models")}
    return {**fixed, "models": {stage: m["sha256"] for stage, m in declared["models"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="a learn_acesearcher results directory (its settings)")
    parser.add_argument("--before", required=True, help="STAGE=MODEL_DIR, the claim's baseline")
    parser.add_argument("--after", required=True, help="STAGE=MODEL_DIR, the claim's trained model")
    parser.add_argument("--claim", required=True, help="the claim's name")
    parser.add_argument("--metric", default="em")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--questions", type=int, default=0, help="per world (default: the source's test questions)")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None, help="default: RUNS/fresh-worlds")
    parser.add_argument("--engine", default="auto", help="hf, vllm or auto (vllm when installed)")
    parser.add_argument("--declare-only", action="store_true", help="write declaration.json and stop")
    args = parser.parse_args()
    from learn_acesearcher import evaluate

    from sleuth.data.synth import load_synth, synthesize
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.train.common import auto_engine

    args.engine = auto_engine(args.engine)
    source = json.loads((Path(args.source) / "results.json").read_text())
    models = {name: Path(path).expanduser() for name, path in (s.split("=", 1) for s in (args.before, args.after))}
    declared = declare(args.results / "declaration.json", declaration(args, source, models), tested)
    print(f"declared: {declared['claim']['name']} on {len(args.seeds)} fresh worlds", flush=True)
    if args.declare_only:
        return
    agent = agent_from(source["settings"])
    options = declared["llm_options"]
    work = args.work or runs_home() / "fresh-worlds"
    exp = Experiment("learn_acesearcher", work, args.results, claims=[declared["claim"]])
    splits: dict[int, tuple[list[Any], str]] = {}
    for world in declared["worlds"]:
        seed = world["seed"]
        directory, index = work / f"world-{seed}", work / f"index-{seed}"

        def make(directory: Path = directory, index: Path = index, world: dict[str, Any] = world) -> dict[str, str]:
            if not (directory / "world.json").exists():
                synthesize(directory, **world)
            if not index.exists():
                build_bm25_index(directory / "corpus.jsonl", index)
            return {"world": str(directory), "index": str(index)}

        exp.stage(f"world-{seed}", world, make)
        splits[seed] = (list(load_synth(directory / "test.jsonl"))[: declared["questions_per_world"]], str(index))
    per_world: dict[str, dict[str, Any]] = {}
    for stage, model in models.items():
        with ModelServer(model, args.engine, options) as server:
            for seed, (examples, index) in splits.items():
                key = {
                    "agent": dataclasses.asdict(agent),
                    "index": index,
                    "options": options,
                    "model": str(model),
                    "questions": len(examples),
                    "world": declared["worlds"][args.seeds.index(seed)],
                }
                run = functools.partial(evaluate, server, examples, index, agent)
                per_world[f"{stage}@{seed}"] = exp.evaluate(stage, f"world-{seed}", key, run)
    pooled: dict[str, dict[str, Any]] = {}
    for stage in models:
        scores: dict[str, list[float]] = {}
        for seed in args.seeds:
            for metric, values in per_world[f"{stage}@{seed}"]["per_example"].items():
                scores.setdefault(metric, []).extend(values)
        ci = {m: bootstrap_ci(v, seed=exp.seed) for m, v in scores.items()}
        pooled[stage] = {"per_example": scores, "ci": ci}
    before, after = declared["claim"]["before"], declared["claim"]["after"]
    results = {
        "declaration": declared,
        "test_questions": len(pooled[after]["per_example"][args.metric]),
        "test": pooled,
        "worlds": per_world,
        "differences": exp.differences(pooled, [(after, before)], ["em", "f1"]),
    }
    lines = exp.header(
        f"Fresh worlds: {declared['claim']['name']}",
        f"Test splits of {len(args.seeds)} worlds generated with seeds {args.seeds} and the settings of "
        f"`{declared['source']}` ({declared['questions_per_world']} questions each, their own corpus and BM25 index), "
        f"declared in `declaration.json` ({declared['declared_at']}, commit {declared['commit'][:10]}) before any "
        "evaluation; models by content hash there. Greedy agent and engine as in the source run.",
    )
    lines += ["## All worlds", ""]
    model_cells = {stage: f"`{m['path']}` (sha256 {m['sha256'][:12]})" for stage, m in declared["models"].items()}
    lines += stage_table(pooled, ["em", "f1"], model_cells)
    lines += ["", *difference_table(results["differences"], ["em", "f1"]), "", "## Per world", ""]
    lines += ["| world seed | " + " | ".join(f"{s} EM" for s in models) + " |", "|---" * (len(models) + 1) + "|"]
    for seed in args.seeds:
        cells = [f"{100 * per_world[f'{s}@{seed}']['ci'][args.metric]['mean']:.1f}" for s in models]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    exp.write(results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
