"""Does ARENA's GRPO teach a small reader to answer and cite? EM / F1 and citation precision / recall on the dev
files, before and after training, with bootstrap CIs.

Training questions come from the HotpotQA / 2Wiki / MuSiQue train files in ../shared/data (given paragraphs as the
numbered references, supporting paragraphs as the relevance ground truth); evaluation is greedy ``arena`` on the
dev files' first questions, with their given paragraphs. SmolLM2-135M-Instruct with LoRA (the reference is the
base with the adapter disabled), ARENA's rewards (format + EM + relevance + bonus 10), ARENA's KL estimator.

The scale is tiny next to the paper's (tens of prompts instead of 24,500, a 135M model, references cut to the
first ``--max-references`` paragraphs to keep CPU prefill affordable), so the learning rate is raised; the point is
the direction of each metric and whether it is distinguishable from noise.

Format warm start (a deviation, on by default): SmolLM2-135M never writes ``<relevance>/<analysis>/<answer>``
(0 of 150 greedy dev answers, 0 of 24 samples at T=0.9 on train prompts), and every ARENA reward component reads
those tags, so GRPO from the base model sees reward 0 in every group: zero advantages, no gradient. Before GRPO
the model is fine-tuned for a few steps on ``--format-warmup`` train questions (taken after the GRPO questions)
whose target is ARENA's SFT-reasoning layout (arena.md §3.5: gold relevance ids, an analysis, a gold answer), the
analysis templated as "Reference [i] states that <its first sentence>." because no model writes it here (the
paper has the backbone write it). Evaluated as its own stage, so "GRPO - warm start" is what GRPO added.
``--format-warmup 0`` runs GRPO from the base model, as the paper does.

    python benchmarks/learn_arena.py            # CPU: expect well over an hour at the defaults (see docs)
    python benchmarks/learn_arena.py --smoke    # tiny random model, a few questions, 1 step

Engines. ``--engine`` runs the evaluations on ``hf`` or on a vLLM server sleuth starts on each model (``vllm``, or a
``vllm:{model}?...`` template); ``auto`` (the default) is ``vllm`` when vLLM is installed (``make vllm``), else
``hf``, and ``hf`` with ``--smoke``. ``--rollouts`` samples GRPO's groups from the live policy (``hf``) or from a
vLLM server that loads the LoRA adapter every step (``vllm``: ``rollout_server`` of
:mod:`sleuth.train.online_rl`); ``auto`` picks ``vllm`` only on a GPU with vLLM installed: on the 2-core CPU of
issue 18 vLLM with ``--enable-lora`` runs uncompiled and sampled slower than the hf runner (132 s against 96 s for 32
prompts).
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


def evaluate(
    model: Path, files: list[str], limit: int, agent: Any, options: str, out: Path, engine: str = "hf"
) -> dict[str, Any]:
    """Greedy arena on the first ``limit`` questions of each dev file; per-question metrics (cached in ``out``)."""
    from types import SimpleNamespace

    from sleuth.agents import Context
    from sleuth.data import load_examples
    from sleuth.eval.metrics import score_example
    from sleuth.llm import load_llm
    from sleuth.runner import run
    from sleuth.train.mdpo import close_llm, engine_spec

    if out.exists():
        return json.loads(out.read_text())
    started = time.perf_counter()
    examples = [e for f in files for e in load_examples(f, limit=limit)]
    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=options), model))
    try:
        traces = run("arena", examples, Context(llm=llm, retriever=None, config=agent), progress=True)
    finally:
        close_llm(llm)
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


def warmup_target(example: Any, references: list[Any]) -> str:
    """ARENA's SFT target layout (arena.md §3.5) with a templated analysis citing each gold reference."""
    import re

    gold = [i for i, p in enumerate(references, 1) if p.id in set(example.supporting_ids)]
    claims = []
    for i in gold:
        text = references[i - 1].text.replace("<", " ").strip()
        first = re.split(r"(?<=[.!?])\s+", text, maxsplit=1)[0]
        claims.append(f"Reference [{i}] states that {first}")
    analysis = " ".join(claims) + f" Therefore the answer is {example.answers[0]}."
    answer = example.answers[0]
    return f"<relevance>\n{gold}\n</relevance>\n\n<analysis>\n{analysis}\n</analysis>\n\n<answer>\n{answer}\n</answer>"


def format_warmup(base: Path, files: list[str], skip: int, count: int, agent: Any, work: Path, lr: float) -> Path:
    """Fine-tune ``base`` on ``count`` train questions (after the first ``skip`` of each file) with ARENA's prompt
    and the :func:`warmup_target` completion; returns the merged model (cached)."""
    from sleuth.agents.arena import arena_prompt
    from sleuth.data import load_examples
    from sleuth.train.sft import SFTConfig, SFTSource, train_sft

    model = work / "warmup"
    if (model / "config.json").exists():
        return model
    pools = []  # per file, the usable questions after the first ``skip`` (which the GRPO run trains on)
    for f in files:
        usable = []
        for example in load_examples(f, limit=skip + 4 * count)[skip:]:
            references = list(example.context)[: agent.max_references]
            if example.answers and any(p.id in set(example.supporting_ids) for p in references):
                usable.append((example, references))  # else no gold answer or no supporting reference shown
        pools.append(usable)
    records = []
    for i in range(count):  # round-robin over the files
        pool = pools[i % len(pools)]
        if i // len(pools) < len(pool):
            example, references = pool[i // len(pools)]
            prompt = arena_prompt(example.question, references, agent.prompt)
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": warmup_target(example, references)},
            ]
            records.append({"messages": messages})
    work.mkdir(parents=True, exist_ok=True)
    data = work / "warmup_records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = SFTConfig(
        model=str(base),
        output_dir=str(model),
        sources=[SFTSource(path=str(data), kind="released", name="arena-format")],
        val_fraction=0.0,
        max_length=2048,
        epochs=2.0,
        lr=lr,
        batch_size=8,
        per_device_batch_size=2,
        warmup_ratio=0.1,
        save_steps=1000,
        logging_steps=2,
        gradient_checkpointing=False,
    ).validate()
    return Path(train_sft(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--dev-questions", type=int, default=30, help="per dev file")
    parser.add_argument("--train-questions", type=int, default=60, help="per train file (warm start: later ones)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="G (paper: 7)")
    parser.add_argument("--max-references", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate (paper: 3e-6, full fine-tuning)")
    parser.add_argument("--format-warmup", type=int, default=32, help="warm-start questions (0: none, as the paper)")
    parser.add_argument("--warmup-lr", type=float, default=1e-4, help="full fine-tuning rate of the warm start")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        default="auto",
        help="evaluations: hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    parser.add_argument(
        "--rollouts",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="GRPO rollouts from the live policy (hf) or a vLLM server reloading the LoRA adapter each step (vllm); "
        "auto: vllm on a GPU with vLLM installed, else hf",
    )
    args = parser.parse_args()
    from sleuth.llm.vllm_server import gpu_visible
    from sleuth.train.mdpo import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    if args.rollouts == "auto":
        args.rollouts = "vllm" if not args.smoke and gpu_visible() and auto_engine() == "vllm" else "hf"
    if args.rollouts == "vllm" and args.smoke:
        raise SystemExit("--rollouts vllm needs LoRA, which --smoke turns off")
    print(f"engine: {args.engine}, rollouts: {args.rollouts}", flush=True)

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
        args.format_warmup = min(args.format_warmup, 4)
        tokens = 8
    else:
        from sleuth.assets import ensure_default_model

        base = ensure_default_model()
        tokens = 160
    dev = [str(DATA / f) for f in DEV]
    agent = ArenaConfig(sampling=Sampling(max_new_tokens=tokens), max_references=args.max_references)
    train = [str(DATA / f) for f in TRAIN]
    evals = {
        "base": evaluate(
            base, dev, args.dev_questions, agent, args.llm_options, work / "eval" / "base.json", args.engine
        )
    }
    start, warmup_seconds = base, 0.0
    if args.format_warmup:
        start = format_warmup(base, train, args.train_questions, args.format_warmup, agent, work, args.warmup_lr)
        sft_log = [json.loads(line) for line in (start / "log.jsonl").read_text().splitlines()]
        warmup_seconds = next((r["train_runtime"] for r in reversed(sft_log) if "train_runtime" in r), 0.0)
        evals["warm start"] = evaluate(
            start, dev, args.dev_questions, agent, args.llm_options, work / "eval" / "warm.json", args.engine
        )
    before = evals["warm start" if args.format_warmup else "base"]
    config = ArenaRLConfig(
        model=str(start),
        output_dir=str(work / "grpo"),
        train_files=train,
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
    if args.rollouts == "vllm":  # the adapter trains on top of `start`, so the server serves `start`
        config.rollout_server = f"vllm:{start}?enable_lora=1&max_lora_rank={config.lora_r}"
    t = time.perf_counter()
    summary = train_arena(config)
    train_seconds = time.perf_counter() - t
    after = evaluate(
        work / "grpo" / "model",
        dev,
        args.dev_questions,
        agent,
        args.llm_options,
        work / "eval" / "grpo.json",
        args.engine,
    )
    evals["GRPO"] = after

    stages = {
        name: {m: bootstrap_ci(e["per_example"][m], seed=args.seed) for m in METRICS} for name, e in evals.items()
    }
    pairs = [("GRPO", "warm start" if args.format_warmup else "base")]
    if args.format_warmup:
        pairs += [("warm start", "base"), ("GRPO", "base")]
    differences = {
        f"{a} - {b}": {
            m: paired_difference_ci(evals[b]["per_example"][m], evals[a]["per_example"][m], seed=args.seed)
            for m in METRICS
        }
        for a, b in pairs
    }
    log = [json.loads(line) for line in (work / "grpo" / "log.jsonl").read_text().splitlines()]
    step_seconds = sum(r.get("seconds", 0.0) for r in log)  # the steps' own times, also across resumed runs
    out = {
        "smoke": args.smoke,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "dev_questions": before["n"],
        "settings": {**vars(args), "work": str(work), "results": str(results), "agent": dataclasses.asdict(agent)},
        "metrics": stages,
        "differences": differences,
        "seconds": {
            "evals": {name: e["seconds"] for name, e in evals.items()},
            "format_warmup": warmup_seconds,
            "grpo_steps": step_seconds,
            "this_run": time.perf_counter() - started,
        },
        "training": {"summary": summary, "seconds": train_seconds},
        "log": log,
    }
    (results / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    seconds = out["seconds"]
    lines = [
        "# Learning benchmark: ARENA GRPO (LoRA) on the multi-hop train files",
        "",
        f"`{' '.join(['python', 'benchmarks/learn_arena.py', *sys.argv[1:]])}` on {out['machine']} (last invocation). "
        f"{before['n']} dev questions ({args.dev_questions} per file), {len(log)} GRPO steps x {args.prompts} "
        f"questions x G={args.group}. Seconds: evals "
        + ", ".join(f"{k} {v:.0f}" for k, v in seconds["evals"].items())
        + f"; format warm start {seconds['format_warmup']:.0f}; GRPO steps {step_seconds:.0f}.",
        "",
        "| metric | " + " | ".join(stages) + " |",
        "|---|" + "---|" * len(stages),
    ]
    for metric in METRICS:
        cells = [
            f"{100 * s[metric]['mean']:.1f} [{100 * s[metric]['lo']:.1f}, {100 * s[metric]['hi']:.1f}]"
            for s in stages.values()
        ]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    lines += ["", "| metric | " + " | ".join(differences) + " |", "|---|" + "---|" * len(differences)]
    for metric in METRICS:
        cells = []
        for d in (diff[metric] for diff in differences.values()):
            cells.append(
                f"{100 * d['mean']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] p {d['p_not_better']:.3f}"
            )
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    lines += ["", "Means with 95% bootstrap CIs; differences paired (same questions), p = share of resamples <= 0."]
    lines += ["", "Training curves: `curves.png` (reward components, KL, entropy, response length per step).", ""]
    (results / "results.md").write_text("\n".join(lines))
    curves = work / "grpo" / "curves.png"
    if curves.exists():
        (results / "curves.png").write_bytes(curves.read_bytes())
    print(f"results in {results}")


if __name__ == "__main__":
    main()
