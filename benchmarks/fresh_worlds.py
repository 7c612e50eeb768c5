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

The source run's benchmark decides what is evaluated: learn_acesearcher's greedy agent on each model (EM, F1), or
learn_s3's searchers with the source run's frozen generator (also fixed by content hash; GenAcc with the searcher's
documents and with naive RAG's, so the declaration adds the claim "AFTER > naive RAG", s3's Gain Beyond RAG):

    python benchmarks/fresh_worlds.py --source docs/results/learn_s3 --before "warm start=WARM/model" \
        --after ppo=PPO/model --claim "after PPO > warm start" --seeds 16 17 18 --results ... --declare-only

Every evaluation is cached under its key (:mod:`harness`): a killed run resumes at the next world.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
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
    key_hash,
    runs_home,
    stage_table,
)

# what each source benchmark's evaluation reports (the first metric is the default claim's)
METRICS = {"learn_acesearcher": ["em", "f1"], "learn_exsearch": ["em", "f1"], "learn_s3": ["genacc", "genacc_naive"]}
# learn_s3's default --llm-options (its results.json settings do not record them)
S3_LLM_OPTIONS = "threads=2&max_batch=32"


def agent_from(benchmark: str, settings: dict[str, Any]) -> Any:
    """The source run's greedy agent (its ``results.json`` ``settings.agent``)."""
    from sleuth.agents.acesearcher import AceSearcherConfig
    from sleuth.agents.exsearch import ExSearchConfig
    from sleuth.agents.s3 import S3Config
    from sleuth.train.config import from_mapping

    config = {"learn_s3": S3Config, "learn_exsearch": ExSearchConfig}.get(benchmark, AceSearcherConfig)
    return from_mapping(config, settings["agent"], source="settings.agent")


def generator_of(source: dict[str, Any], given: str | None = None) -> Path:
    """learn_s3's frozen generator: ``given``, else the source's ``settings.generator`` (under ``$SLEUTH_HOME`` when
    it starts with ``runs/``, as the committed runs' do); the declaration fixes it by content hash whatever the
    path."""
    path = Path(given or source["settings"]["generator"]).expanduser()
    if not path.is_absolute() and path.parts[:1] == ("runs",) and not path.exists():
        path = runs_home().joinpath(*path.parts[1:])
    return path


def declaration(args: argparse.Namespace, source: dict[str, Any], models: dict[str, Path]) -> dict[str, Any]:
    benchmark = source.get("benchmark", "learn_acesearcher")
    world = dict(source["settings"]["world"])
    before, after = (name.split("=", 1)[0] for name in (args.before, args.after))
    metric = args.metric or METRICS[benchmark][0]
    declared = {
        "claim": {"name": args.claim, "metric": metric, "before": before, "after": after},
        "rule": "harness.claims: one-sided exact binomial test on the questions where the two differ, shown at "
        "p < 0.05 on all the fresh worlds' test questions together",
        "models": {stage: {"path": str(path), "sha256": content_hash(path)} for stage, path in models.items()},
        "worlds": [{**world, "seed": seed} for seed in args.seeds],
        "questions_per_world": args.questions or world["test_questions"],
        "source": str(Path(args.source)),
        "agent": source["settings"]["agent"],
        "engine": args.engine,
        "llm_options": source["settings"].get("llm_options", S3_LLM_OPTIONS),
    }
    if benchmark != "learn_acesearcher":  # absent in declarations made before other benchmarks were supported
        declared["benchmark"] = benchmark
    if benchmark == "learn_s3":  # the frozen generator, and s3's Gain Beyond RAG on the same evaluations
        generator = generator_of(source, args.generator)
        declared["generator"] = {"path": str(generator), "sha256": content_hash(generator)}
        declared["also"] = [
            {
                "name": f"{after} > naive RAG",
                "metric": metric,
                "before": after,
                "before_metric": "genacc_naive",
                "after": after,
            }
        ]
    return declared


def tested(declared: dict[str, Any]) -> dict[str, Any]:
    """What a declaration fixes: claims, rule, worlds, agent, engine and the models (and s3's generator) by content;
    not where the files lie (another checkout or machine with the same models runs the same test) nor when it was
    declared."""
    loose = ("declared_at", "commit", "source", "models", "generator")
    fixed = {k: v for k, v in declared.items() if k not in loose}
    fixed["models"] = {stage: m["sha256"] for stage, m in declared["models"].items()}
    if "generator" in declared:
        fixed["generator"] = declared["generator"]["sha256"]
    return fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source", required=True, help="a learn_acesearcher, learn_exsearch or learn_s3 results directory"
    )
    parser.add_argument("--before", required=True, help="STAGE=MODEL_DIR, the claim's baseline")
    parser.add_argument("--after", required=True, help="STAGE=MODEL_DIR, the claim's trained model")
    parser.add_argument("--claim", required=True, help="the claim's name")
    parser.add_argument(
        "--generator", default=None, help="learn_s3 only: the frozen generator (default: the source run's)"
    )
    parser.add_argument("--metric", default=None, help="the claim's metric (default: em, or genacc for learn_s3)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--questions", type=int, default=0, help="per world (default: the source's test questions)")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None, help="default: RUNS/fresh-worlds (-learn_s3 for s3)")
    parser.add_argument("--engine", default="auto", help="hf, vllm or auto (vllm when installed)")
    parser.add_argument("--declare-only", action="store_true", help="write declaration.json and stop")
    args = parser.parse_args()
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
    benchmark = declared.get("benchmark", "learn_acesearcher")
    metrics = METRICS[benchmark]
    agent = agent_from(benchmark, source["settings"])
    options = declared["llm_options"]
    # one work directory per source benchmark: their worlds share seeds but not settings (s3's has other sizes)
    work = args.work or runs_home() / (
        "fresh-worlds" if benchmark == "learn_acesearcher" else f"fresh-worlds-{benchmark}"
    )
    exp = Experiment(benchmark, work, args.results, claims=[declared["claim"], *declared.get("also", [])])
    splits: dict[int, tuple[list[Any], str]] = {}
    for world in declared["worlds"]:
        seed = world["seed"]
        directory, index = work / f"world-{seed}", work / f"index-{seed}"

        def make(directory: Path = directory, index: Path = index, world: dict[str, Any] = world) -> dict[str, str]:
            if not (directory / "world.json").exists():
                synthesize(directory, **world)
            made = json.loads((directory / "world.json").read_text())["config"]
            if any(made.get(k) != v for k, v in world.items()):
                raise SystemExit(f"{directory} holds another world ({made}); give another --work")
            if not index.exists():
                build_bm25_index(directory / "corpus.jsonl", index)
            return {"world": str(directory), "index": str(index)}

        exp.stage(f"world-{seed}", world, make)
        splits[seed] = (list(load_synth(directory / "test.jsonl"))[: declared["questions_per_world"]], str(index))
    per_world: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as open_servers:
        generator = None
        if benchmark == "learn_s3":  # the given generator (the declaration matched it by content, wherever it lies)
            generator = open_servers.enter_context(
                ModelServer(generator_of(source, args.generator), args.engine, options)
            )
            # on a GPU the generator's server and each searcher's share its memory (0.45 each, as learn_s3 runs them)
            os.environ.setdefault("SLEUTH_VLLM_GPU_SERVERS", "2")
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
                    if generator is not None:
                        key["generator"] = str(generator.model_dir)
                    run = evaluation(benchmark, server, generator, examples, index, agent, options, args.engine)
                    if benchmark == "learn_exsearch":
                        traces = work / "eval" / f"world-{seed}" / f"{stage}-{key_hash(key)}.traces.jsonl"
                        run = functools.partial(exsearch_evaluation, server, examples, index, agent, traces)
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
        "test_questions": len(pooled[after]["per_example"][declared["claim"]["metric"]]),
        "test": pooled,
        "worlds": per_world,
        "differences": exp.differences(pooled, [(after, before)], metrics),
    }
    lines = exp.header(
        f"Fresh worlds: {declared['claim']['name']}",
        f"Test splits of {len(args.seeds)} worlds generated with seeds {args.seeds} and the settings of "
        f"`{declared['source']}` ({declared['questions_per_world']} questions each, their own corpus and BM25 index), "
        f"declared in `declaration.json` ({declared['declared_at']}, commit {declared['commit'][:10]}) before any "
        "evaluation; models by content hash there. Greedy agent and engine as in the source run."
        + (
            f" Frozen generator `{declared['generator']['path']}` (sha256 {declared['generator']['sha256'][:12]}); "
            "genacc_naive is its accuracy on naive RAG's top-k for the same question."
            if "generator" in declared
            else ""
        ),
    )
    lines += ["## All worlds", ""]
    model_cells = {stage: f"`{m['path']}` (sha256 {m['sha256'][:12]})" for stage, m in declared["models"].items()}
    lines += stage_table(pooled, metrics, model_cells)
    lines += ["", *difference_table(results["differences"], metrics), "", "## Per world", ""]
    columns = [(s, m) for s in models for m in metrics]
    lines += ["| world seed | " + " | ".join(f"{s} {m}" for s, m in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for seed in args.seeds:
        cells = [f"{100 * per_world[f'{s}@{seed}']['ci'][m]['mean']:.1f}" for s, m in columns]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    exp.write(results, "\n".join(lines) + "\n")


def exsearch_evaluation(
    server: ModelServer, examples: list[Any], index: str, agent: Any, traces: Path
) -> dict[str, Any]:
    """learn_exsearch's greedy evaluation of the server's model on one world: per-question EM and F1, searches."""
    from sleuth.retrieval import load_retriever
    from sleuth.train.exsearch_em import evaluate

    traces.parent.mkdir(parents=True, exist_ok=True)
    result = evaluate(examples, server.get(), load_retriever(index), agent, traces, 64)
    per_example = {"em": result["per_example_em"], "f1": result["per_example_f1"]}
    return {"per_example": per_example, "searches": result["searches"], "errors": result["errors"]}


def evaluation(
    benchmark: str,
    server: ModelServer,
    generator: ModelServer | None,
    examples: list[Any],
    index: str,
    agent: Any,
    options: str,
    engine: str,
) -> Any:
    """The source benchmark's evaluation of one model on one world, as a function of no arguments."""
    if benchmark == "learn_s3":
        from learn_s3 import evaluate as s3_evaluate

        assert generator is not None
        return lambda: s3_evaluate(
            server.model_dir, generator.get(), examples, index, agent, options, engine, llm=server.get()
        )
    from learn_acesearcher import evaluate

    return functools.partial(evaluate, server, examples, index, agent)


if __name__ == "__main__":
    main()
