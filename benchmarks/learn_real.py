"""Does AceSearcher's SFT (Stage I) teach SmolLM2 on the real multi-hop training files? EM / F1 per dataset of
``sleuth eval --method acesearcher --open`` on held-out questions of the real dev files, before and after training,
with bootstrap CIs (issue 19 item 5).

SmolLM2-135M-Instruct is fine-tuned with :func:`sleuth.train.sft.train_sft` on AceSearcher's mixture built from the
train files in ../shared/data, each competency from the files whose annotation supports it:

* ``decompose`` (question -> ``### Q1:`` lines): MuSiQue ``question_decomposition`` and 2Wiki ``evidences``;
  HotpotQA has no gold decomposition (every record would be skipped);
* ``context_qa`` (question + k passages, the supporting ones and distractors shuffled -> short answer; ``steps``:
  one more record per gold sub-question with its own supporting paragraph): HotpotQA, MuSiQue and 2Wiki;
* ``final`` (question + gold sub-answers + pooled passages -> templated rationale and ``<answer>``): MuSiQue and 2Wiki.

Every record's prompt is the agent's own prompt with the evaluation's settings (k passages per sub-question, the
paper's prompts), so the trained model runs unchanged. The untrained and the fine-tuned model are then evaluated
exactly as ``sleuth eval --method acesearcher --open --k 5`` evaluates (the untrained run in
``docs/results/acesearcher-smollm2-open-50``, whose settings are kept: k 5, 15 final passages, token budgets 128 /
48 / 128): per dev file a BM25 index over the paragraphs its evaluated questions give
(``sleuth.eval.evaluate``'s open retriever), greedy decoding, SQuAD-normalised EM and F1 (``score_trace``).

Splits of each dev file (HotpotQA ``hotpot.json``, 2Wiki ``wikihop.json``, MuSiQue ``musique.json``, 200 questions):

* ``test`` (held out, reported, never used to choose anything): the first 50 questions of each file (150), the
  questions of the untrained run in docs/results;
* ``dev`` (settings are compared on it, by F1 since EM starts at 0; every setting tried is listed from
  ``trials.json``): questions 151-184 of each file (34 per file, 102), each slice with its own open index, as
  ``sleuth eval --open`` builds one per file given.

Reported overall and per dataset: EM and F1 with 95% bootstrap CIs and the paired bootstrap difference sft - base.
Results go to ``docs/results/learn_real/`` (``results.json``, ``results.md``, ``curve.png``); traces, indexes and
checkpoints stay in the working directory (``runs/learn-real``), which git ignores: they hold benchmark text.

    python benchmarks/learn_real.py            # CPU, 2 cores, vLLM: ~35 min SFT + ~25-40 min evaluation (see below)
    python benchmarks/learn_real.py --smoke    # tiny random model, 2 questions per file, 2 SFT steps (~1 min)
    python benchmarks/learn_real.py --full     # every train record, 2 epochs, 150 test / 50 dev per file: a GPU

Time, measured (``docs/results/learn_real``, vLLM engine): the four evaluations took 23 min (6-7 min per 150 test
questions, 4-6 min per 102 dev questions); the SFT took 86 min while a CI run shared the cores, at 21-28 s per
step once they were free, i.e. ~40-45 min alone. The estimate it was sized with: SFT cost is about proportional to the
trained tokens: ~25 s per optimiser step of 8 records of ~600 tokens for SmolLM2-135M on the 2-core CPU, i.e.
~5 ms per token. The default mixture (``--scale 1``) is 826 records (400 decomposition, 326 context-QA, 100 final),
419K tokens counted with SmolLM2's tokenizer (means: decomposition ~150, context-QA ~650, final ~1,100 for 2Wiki and
~1,650 for MuSiQue), 104 steps: ~36 min. Evaluation runs 252 questions per model (150 test + 102 dev), 504 in
all: ~2.7 s per question with vLLM (bench_engines.md: AceSearcher on HotpotQA) to ~5 s (longer 2Wiki / MuSiQue
chains) is 25-40 min; with ``--engine hf`` (14-26 s per question) several hours. ``--scale 0.5`` halves the SFT.

Stated deviations:

* Token budgets and k are the untrained baseline's (k 5, decomposition 128, sub-answer 48, final 128 new tokens),
  not the paper's (k 10); the SFT records show k = 5 passages per sub-question accordingly.
* SFT size: 826 records (``--full``: all 3,214 the files give, 2.1M tokens, 2 epochs) against the paper's 180,600,
  and lr 1e-4 (paper 5e-6 for 1.5B) with a global batch of 8 (paper 64): a 135M model and ~100 steps.
* ``max_length`` 2048 (the paper's §5.1), not 1024: at 1024 ~50% of the 2Wiki and ~99% of the MuSiQue final
  records would lose their ``<answer>`` (truncated at the end); at 2048, 5 of the 826 records still are.
  Micro-batches of 1 record, so no padding is computed.
* Not used: the FireAct ReAct trajectories (another agent's ``search[...]`` format: they teach no AceSearcher
  prompt), and ``musique/dev.json`` (gold decompositions of MuSiQue *dev* questions: the test questions come from
  MuSiQue dev, and MuSiQue's questions share single-hop parts, so it would leak test sub-answers).
* No mDPO stage yet (issue 19 item 5: "then mDPO if time allows").

Every stage is cached in the working directory under the settings it depends on (``benchmarks/harness.py``): a
killed run resumes (the SFT from its last checkpoint), and another SFT setting (``--sft-lr``, ``--scale``,
``--epochs``) trains into its own directory beside the first. ``--engine`` runs the evaluations on ``hf`` or on a
vLLM server sleuth starts per model; ``auto`` (the default) is ``vllm`` when installed (``make vllm``), ``hf`` with
``--smoke``. The engine says how an evaluation is computed, not what: it is not part of the keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402  (the benchmarks directory is not a package)
    DATA,
    REPO,
    Experiment,
    ModelServer,
    base_model,
    difference_table,
    plot,
    run_dirs,
    settings_block,
    short,
    stage_table,
    trials_table,
)

RESULTS = REPO / "docs" / "results" / "learn_real"
DEV = ["hotpotqa/hotpot.json", "2wikimultihopqa/wikihop.json", "musique/musique.json"]
DEV_OFFSET = 150  # per dev file: the test slice lies below, the dev slice from here on
METRICS = ("em", "f1")
# The claims this benchmark is run to test, on the test split: harness.claims gives each the one-sided exact test
# (results.json "claims", results.md "Claims"; benchmarks/recompute_claims.py redoes them from committed results)
CLAIMS = [
    {"name": "SFT > base", "metric": "em", "before": "base", "after": "sft"},
    {"name": "SFT > base", "metric": "f1", "before": "base", "after": "sft"},
]
BASELINE = "docs/results/acesearcher-smollm2-open-50"

# Records read from the start of each train file, per competency (None: all of them). Sized for ~35 min of SFT on
# 2 CPU cores (module docstring); --scale multiplies every limit.
MIXTURE: dict[str, dict[str, int | None]] = {
    "hotpotqa/hotpotqa_train.json": {"context_qa": 60},
    "musique/musique_train.json": {"decompose": 100, "context_qa": 30, "final": 30},
    "2wikimultihopqa/wikihop_train_preprocess.json": {"decompose": 300, "context_qa": 50, "final": 70},
}
SMOKE_MIXTURE: dict[str, dict[str, int | None]] = {
    "hotpotqa/hotpotqa_train.json": {"context_qa": 2},
    "musique/musique_train.json": {"decompose": 2, "context_qa": 1, "final": 1},
    "2wikimultihopqa/wikihop_train_preprocess.json": {"decompose": 2, "context_qa": 1, "final": 1},
}


# ---------------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------------


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, grouped by what reads it. ``--smoke`` fixes the sizes and the token budgets (a
    random tiny model), ``--full`` takes every record and more questions."""
    if args.smoke:
        mixture = SMOKE_MIXTURE
        split = {"test_per_file": 2, "dev_per_file": 2}
        sft = {"lr": args.sft_lr, "batch": 2, "max_length": 1024, "epochs": 1.0, "steps": 2}
        agent = {"k": 2, "tokens": {"decompose": 16, "subanswer": 6, "final": 12}}
    else:
        mixture = {f: {kind: None for kind in kinds} for f, kinds in MIXTURE.items()} if args.full else MIXTURE
        if args.scale != 1.0 and not args.full:
            mixture = {
                f: {kind: None if n is None else max(1, round(n * args.scale)) for kind, n in kinds.items()}
                for f, kinds in mixture.items()
            }
        split = {"test_per_file": 150 if args.full else 50, "dev_per_file": 50 if args.full else 34}
        sft = {"lr": args.sft_lr, "batch": 8, "max_length": 2048, "epochs": args.epochs, "steps": -1}
        agent = {"k": 5, "tokens": {"decompose": 128, "subanswer": 48, "final": 128}}
    if split["test_per_file"] > DEV_OFFSET or DEV_OFFSET + split["dev_per_file"] > 200:
        raise SystemExit(f"at most {DEV_OFFSET} test and {200 - DEV_OFFSET} dev questions per dev file")
    return {"split": {**split, "dev_offset": DEV_OFFSET}, "mixture": mixture, "sft": sft, "agent": agent}


def agent_config(s: dict[str, Any]) -> Any:
    """The acesearcher config ``sleuth eval --k K --set ..._max_new_tokens=...`` resolves (defaults otherwise)."""
    from sleuth.agents import get_agent
    from sleuth.agents.base import configure

    tokens = s["agent"]["tokens"]
    config = configure(
        get_agent("acesearcher").config_cls,
        {
            "decompose_max_new_tokens": tokens["decompose"],
            "subanswer_max_new_tokens": tokens["subanswer"],
            "final_max_new_tokens": tokens["final"],
        },
    )
    config.k = s["agent"]["k"]
    return config


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def sft_sources(mixture: dict[str, dict[str, int | None]]) -> list[dict[str, Any]]:
    return [
        {"path": str(DATA / f), "kind": kind, "limit": limit, "steps": kind == "context_qa"}
        for f, kinds in mixture.items()
        for kind, limit in kinds.items()
    ]


def run_sft(base: Path, out: Path, s: dict[str, Any], agent: Any, seed: int) -> dict[str, Any]:
    """Fine-tune ``base`` on the mixture into ``out`` (resumes a killed run from its last checkpoint)."""
    from sleuth.train.sft import SFTConfig, train_sft

    sft = s["sft"]
    config = SFTConfig(
        model=str(base),
        output_dir=str(out),
        sources=sft_sources(s["mixture"]),
        val_fraction=0.0,
        learning_rate=sft["lr"],
        batch_size=sft["batch"],
        per_device_batch_size=1,  # records range from 150 to 2,000 tokens: no padding trained
        epochs=sft["epochs"],
        max_steps=sft["steps"],
        max_length=sft["max_length"],
        context_passages=s["agent"]["k"],  # as many passages as the agent retrieves per sub-question
        save_steps=20,
        logging_steps=5,
        seed=seed,
        gradient_checkpointing=False,
        agent=agent,
    )
    if not (out / "config.json").exists():  # the final model is saved last
        train_sft(config)
    summary = json.loads((out / "data_summary.json").read_text())
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {
        "model": str(out),
        "records": summary["train"],
        "by_kind": summary["train_by_kind"],
        "by_source": {src["name"]: src["selected"] for src in summary["sources"]},
        "skipped": {src["name"]: src["skipped"] for src in summary["sources"] if src["skipped"]},
        "dropped_by_length": summary.get("dropped_by_length", 0),
        "steps": max((r["step"] for r in log), default=0),
        "train_runtime": next((r["train_runtime"] for r in reversed(log) if "train_runtime" in r), None),
        "losses": [(r["step"], r["loss"]) for r in log if "loss" in r],
    }


def load_split(start: int, count: int) -> dict[str, list[Any]]:
    """Questions ``start`` to ``start + count`` of each dev file, by dataset name (``sleuth eval``'s labels), with
    ``sleuth eval``'s id de-duplication and ``dataset`` metadata."""
    from sleuth.data import load_examples
    from sleuth.eval.evaluate import dataset_name, unique_ids

    out = {}
    for f in DEV:
        name = dataset_name(DATA / f)
        examples = unique_ids(load_examples(str(DATA / f), limit=start + count))[start:]
        for example in examples:
            example.metadata["dataset"] = name
        out[name] = examples
    return out


def evaluate(llm: Any, split: dict[str, list[Any]], agent: Any, index_root: Path, traces: Path) -> dict[str, Any]:
    """``sleuth eval --method acesearcher --open`` on ``split`` with ``llm``: per dataset an open BM25 index over
    the paragraphs of its questions (the evaluator's own builder), every trace scored by the evaluator's scorer.
    Per-question EM / F1 (file after file) and each question's dataset, for the per-dataset CIs."""
    from sleuth.agents import Context
    from sleuth.eval.evaluate import open_retriever, score_trace
    from sleuth.runner import run

    per: dict[str, list[float]] = {m: [] for m in METRICS}
    datasets: list[str] = []
    errors = fallbacks = calls = 0
    traces.parent.mkdir(parents=True, exist_ok=True)
    with open(traces, "w", encoding="utf-8") as sink:
        for name, examples in split.items():
            retriever = open_retriever(examples, index_root, name)
            ctx = Context(llm=llm, retriever=retriever, config=agent)
            for trace in run("acesearcher", examples, ctx, concurrency=32, progress=True, description=name):
                scores = score_trace(trace)
                trace.meta["scores"] = scores
                sink.write(trace.to_json() + "\n")
                for m in METRICS:
                    per[m].append(float(scores.get(m) or 0.0))
                datasets.append(name)
                errors += trace.error is not None
                fallbacks += len(trace.fallbacks)
                calls += trace.llm_calls
    return {
        "per_example": per,
        "datasets": datasets,
        "errors": errors,
        "fallbacks": fallbacks,
        "llm_calls_per_question": calls / max(1, len(datasets)),
        "traces": short(traces),
    }


def by_dataset(evaluation: dict[str, Any], seed: int) -> dict[str, dict[str, Any]]:
    """The evaluation's questions split by dataset, each with its own bootstrap CIs (``Experiment.evaluate``'s
    shape, so the harness tables take them)."""
    from sleuth.eval.stats import bootstrap_ci

    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(evaluation["datasets"]):
        rows = [i for i, d in enumerate(evaluation["datasets"]) if d == name]
        per = {m: [v[i] for i in rows] for m, v in evaluation["per_example"].items()}
        out[name] = {"per_example": per, "ci": {m: bootstrap_ci(v, seed=seed) for m, v in per.items()}}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def split_section(exp: Experiment, title: str, evals: dict[str, dict[str, Any]], models: dict[str, str]) -> list[str]:
    """Overall and per-dataset tables of one split, with the paired sft - base differences."""
    lines = [f"## {title}", "", *stage_table(evals, METRICS, models), ""]
    lines += difference_table(exp.differences(evals, [("sft", "base")], METRICS), METRICS)
    per = {stage: by_dataset(e, exp.seed) for stage, e in evals.items()}
    for name in per.get("base", {}):
        rows = {stage: per[stage][name] for stage in per if name in per[stage]}
        lines += ["", f"### {name}", "", *stage_table(rows, METRICS), ""]
        lines += difference_table(exp.differences(rows, [("sft", "base")], METRICS), METRICS)[:-2]
    return lines + [""]


def differences_by_dataset(exp: Experiment, evals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {"overall": exp.differences(evals, [("sft", "base")], METRICS)}
    per = {stage: by_dataset(e, exp.seed) for stage, e in evals.items()}
    for name in per.get("base", {}):
        rows = {stage: per[stage][name] for stage in per if name in per[stage]}
        out[name] = exp.differences(rows, [("sft", "base")], METRICS)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 2 questions per file, 2 SFT steps")
    parser.add_argument("--full", action="store_true", help="every train record, 2 epochs, 150 test / 50 dev: a GPU")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default $SLEUTH_HOME/runs/learn-real)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every per-file record limit of the mix")
    parser.add_argument("--sft-lr", type=float, default=1e-4, help="paper: 5e-6 (1.5B, 180K records)")
    parser.add_argument("--epochs", type=float, default=None, help="SFT epochs (default 1; --full: 2)")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32", help="hf engine options")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        default="auto",
        help="hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    args = parser.parse_args()
    if args.epochs is None:
        args.epochs = 2.0 if args.full else 1.0

    from sleuth.train.common import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)
    s = settings(args)
    work, results = run_dirs("learn_real", args, RESULTS)
    exp = Experiment("learn_real", work, results, args.seed, claims=CLAIMS)
    agent = agent_config(s)
    agent_key = dataclasses.asdict(agent)
    sp = s["split"]
    slices = {"test": (0, sp["test_per_file"]), "dev": (sp["dev_offset"], sp["dev_per_file"])}
    splits = {name: load_split(*bounds) for name, bounds in slices.items()}
    evaluations: dict[str, dict[str, dict[str, Any]]] = {"test": {}, "dev": {}}
    models: dict[str, str] = {}

    def measure(stage: str, model: Path) -> None:
        models[stage] = short(model)
        with ModelServer(model, args.engine, args.llm_options) as server:
            for split, (start, count) in slices.items():
                key = {"model": str(model), "files": DEV, "start": start, "per_file": count, "agent": agent_key}
                name = exp.stage_dir(stage, key).name  # the traces' file, named by the evaluation's key

                def run(split: str = split, start: int = start, count: int = count, name: str = name) -> dict:
                    result = evaluate(
                        server.get(),
                        splits[split],
                        agent,
                        work / "index" / f"{split}-{start}-{count}",
                        work / "traces" / split / f"{name}.jsonl",
                    )
                    return {**result, "engine": args.engine, "model": str(model)}

                evaluations[split][stage] = exp.evaluate(stage, split, key, run)

    base = base_model(args.smoke, work)
    measure("base", base)
    sft_key = {"base": str(base), "mixture": s["mixture"], "sft": s["sft"], "agent": agent_key, "seed": args.seed}
    sft_dir = exp.stage_dir("sft", sft_key)
    try:  # one stage and directory per SFT setting: settings tried on dev sit side by side
        sft = exp.stage(sft_dir.name, sft_key, lambda: run_sft(base, sft_dir, s, agent, args.seed))
    except ImportError as exc:
        raise SystemExit(f"SFT needs sleuth[train]: {exc}") from None
    measure("sft", Path(sft["model"]))

    trial = {**{k: v for k, v in s.items() if k != "split"}, "engine": args.engine}
    trials = exp.record_trial(trial, evaluations["dev"], "f1")
    differences = {split: differences_by_dataset(exp, evaluations[split]) for split in evaluations}
    test = evaluations["test"]
    per_test = {stage: by_dataset(e, exp.seed) for stage, e in test.items()}
    curve = {f"F1 {name}": [(st, per[name]["ci"]["f1"]) for st, per in per_test.items()] for name in per_test["base"]}
    curve["F1 overall"] = [(stage, e["ci"]["f1"]) for stage, e in test.items()]
    plot(curve, exp.results / "curve.png", "F1 (%)", "AceSearcher SFT on the real train files (test, 95% CI)")

    lines = exp.header(
        "Learning benchmark: AceSearcher SFT on the real multi-hop train files",
        f"`sleuth eval --method acesearcher --open` (k {agent.k}, token budgets {s['agent']['tokens']}) on the "
        f"first {sp['test_per_file']} questions of each dev file (test, {sum(map(len, splits['test'].values()))} in "
        f"all, never used to choose) and questions {sp['dev_offset'] + 1}-{sp['dev_offset'] + sp['dev_per_file']} "
        f"(dev, {sum(map(len, splits['dev'].values()))}, for the settings). SFT: {sft['records']} records "
        f"({sft['by_kind']}), {sft['steps']} steps, {sft['dropped_by_length']} dropped by max_length. Engine "
        f"{args.engine}. SQuAD-normalised EM / F1 with 95% bootstrap CIs over questions (1000 resamples)."
        + (
            ""
            if args.smoke or args.full
            else f" The untrained run in `{BASELINE}` (hf engine, the same test "
            "questions and settings) scored EM 0.0, F1 6.0."
        ),
    )
    lines += split_section(exp, "Test (held out)", test, models)
    lines += split_section(exp, "Dev", evaluations["dev"], models)
    lines += ["## Settings tried", "", *trials_table(trials), "", exp.seconds_line(), ""]
    lines += ["SFT records per source: " + ", ".join(f"`{k}` {v}" for k, v in sft["by_source"].items()) + ".", ""]
    lines += settings_block(trial)
    exp.write(
        {
            "smoke": args.smoke,
            "settings": {**trial, "split": sp, "agent_config": agent_key},
            "models": models,
            "evaluations": evaluations,
            "differences": differences,
            "sft": sft,
            "trials": trials,
        },
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
