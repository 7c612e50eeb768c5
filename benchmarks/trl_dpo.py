"""TRL's plain DPO, at its defaults, on the pairs an mDPO iteration trained on: a bug in sleuth's mDPO, or the method?

sleuth's mDPO builds its preference pairs itself (decomposition, sub-answer and final pairs from sampled rollouts,
paper rules) and trains them through TRL's ``DPOTrainer`` with the learning benchmark's settings (lr 2e-5, one epoch,
an NLL term, per-pair micro-batches, length-sorted batches, warm-up). This control takes the very same training pairs
(``ITER/pairs.jsonl``, with the iteration's held-out questions removed by the same seeded split) and hands them to
``trl.DPOTrainer`` with ``trl.DPOConfig``'s defaults (lr 1e-6, beta 0.1, sigmoid loss, 3 epochs, batches of 8, linear
schedule, no warm-up, max_length 1024, keep_start truncation), changing only what this machine needs (CPU, fp32, no
reporting, no checkpoints, the batch of 8 as 8 accumulated micro-batches of one) and gradient checkpointing (a
memory setting; off, which is faster here and changes no value). Both models are evaluated exactly as the learning
benchmark evaluates (same world, index, agent, engine; harness-cached, so the SFT model's and the mDPO model's
evaluations are read back) and compared per question with the exact McNemar test.

    python benchmarks/trl_dpo.py --iteration $RUNS/learn-acesearcher/mdpo-fe2bdd4278bc/iter1 --heldout-pairs 0.2

Reads the learn_acesearcher stages under ``$SLEUTH_HOME/runs/learn-acesearcher``; the model goes to
``.../learn-acesearcher/trl-dpo/<key>``, the report to ``docs/results/learn_acesearcher/trl_dpo/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, pct, short  # noqa: E402
from noise_floor import WEIGHTS, learn_arguments, learn_evaluator, versus  # noqa: E402

RESULTS = REPO / "docs" / "results" / "learn_acesearcher" / "trl_dpo"
# what this machine needs, and nothing that changes the optimisation: the default batch of 8 pairs as 8 micro-batches
# of one (the default's 8 at once, 16 sequences of up to 1024 tokens in fp32 on CPU, was killed for memory at 24 GiB;
# TRL averages the loss over the batch and the Trainer over the accumulated micro-batches: the same gradient)
MACHINE = {
    "use_cpu": True,
    "bf16": False,
    "report_to": [],
    "save_strategy": "no",
    "gradient_checkpointing": False,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
}


def training_rows(iteration: Path, heldout: float, seed: int) -> list[dict[str, Any]]:
    """The iteration's training pairs as TRL rows: ``pairs.jsonl`` minus the held-out questions' pairs."""
    from sleuth.train.mdpo import load_pairs, split_heldout

    train, _ = split_heldout(load_pairs(iteration / "pairs.jsonl"), heldout, seed)
    return [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]} for p in train]


def train_plain_dpo(policy: Path, rows: list[dict[str, Any]], out: Path, seed: int) -> dict[str, Any]:
    """``trl.DPOTrainer`` with ``DPOConfig``'s defaults (and ``MACHINE``) from ``policy`` on ``rows``; the model is
    saved to ``out`` (written aside, then renamed: a killed run trains again)."""
    metrics_file = out / "trl_metrics.json"
    if (out / WEIGHTS).exists() and metrics_file.exists():
        return json.loads(metrics_file.read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = DPOConfig(output_dir=str(partial / "trainer"), seed=seed, disable_tqdm=True, **MACHINE)
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.save_model(str(partial))
    tokenizer.save_pretrained(str(partial))
    shutil.rmtree(partial / "trainer", ignore_errors=True)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    defaults = DPOConfig(output_dir=str(partial), **MACHINE)
    metrics = {
        "pairs": len(rows),
        "steps": trainer.state.global_step,
        "seconds": seconds,
        "config": {
            k: str(getattr(defaults, k))
            for k in (
                "learning_rate",
                "beta",
                "loss_type",
                "num_train_epochs",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "lr_scheduler_type",
                "warmup_steps",
                "max_length",
                "truncation_mode",
            )
        },
        "log": logged,
        "first": logged[0] if logged else None,
        "last": logged[-1] if logged else None,
    }
    (partial / "trl_metrics.json").write_text(json.dumps(metrics, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return metrics


def described(config: dict[str, str]) -> str:
    """The recorded DPOConfig values as a sentence."""
    batch = int(config["per_device_train_batch_size"]) * int(config["gradient_accumulation_steps"])
    return (
        f"lr {config['learning_rate']}, beta {config['beta']}, loss {config['loss_type']}, "
        f"{float(config['num_train_epochs']):g} epochs, batch {batch} ({config['per_device_train_batch_size']} x "
        f"{config['gradient_accumulation_steps']} accumulated), {config['lr_scheduler_type'].split('.')[-1].lower()} "
        f"schedule, {config['warmup_steps']} warm-up steps, max_length {config['max_length']} "
        f"({config['truncation_mode']} truncation)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iteration", required=True, help="an mDPO iteration directory (pairs.jsonl, model/)")
    parser.add_argument("--heldout-pairs", type=float, default=0.0, help="that run's --heldout-pairs share")
    parser.add_argument("--stage", default="mdpo-1", help="the iteration model's stage name in learn_acesearcher")
    parser.add_argument("--seed", type=int, default=0)
    learn_arguments(parser, RESULTS)
    args = parser.parse_args()
    from sleuth.train.common import auto_engine

    args.engine = auto_engine(args.engine)
    exp, measure, _ = learn_evaluator("trl_dpo", args)
    work, iteration = Path(args.work), Path(args.iteration)
    sft = work / "sft"
    stats = json.loads((iteration / "stats.json").read_text())
    policy = Path(stats["policy"])
    if not (policy / WEIGHTS).exists() or not (iteration / "model" / WEIGHTS).exists():
        raise SystemExit(f"{iteration}: no trained iteration (run benchmarks/learn_acesearcher.py first)")
    rows = training_rows(iteration, args.heldout_pairs, args.seed)
    if stats["dpo"].get("pairs") not in (None, len(rows)):
        raise SystemExit(f"{len(rows)} training pairs, the iteration trained on {stats['dpo']['pairs']}: wrong split?")
    digest = hashlib.sha256(json.dumps([rows, str(policy), args.seed], sort_keys=True).encode()).hexdigest()[:12]
    out = work / "trl-dpo" / digest
    metrics = train_plain_dpo(policy, rows, out, args.seed)
    trained_seconds = metrics["seconds"]  # the run that trained it (a rerun reads the model back)

    exp.seconds["trl-dpo training"] = trained_seconds
    order = ("dev", "test")
    evaluations = {"sft": measure("sft", sft, order), args.stage: measure(args.stage, iteration / "model", order)}
    evaluations["trl-dpo"] = measure(f"trl-dpo-{digest}", out, order)
    rows_out: dict[str, Any] = {}
    for stage, by_split in evaluations.items():
        rows_out[stage] = {}
        for split, e in by_split.items():
            em = e["per_example"]["em"]
            rows_out[stage][split] = {"em": 100 * sum(em) / len(em)}
            if stage != "sft":
                rows_out[stage][split] |= versus(evaluations["sft"][split]["per_example"]["em"], em)
        if stage == "trl-dpo":
            for split, e in by_split.items():
                rows_out[stage][split]["vs_" + args.stage] = versus(
                    evaluations[args.stage][split]["per_example"]["em"], e["per_example"]["em"]
                )
    mdpo = stats["dpo"]
    results = {
        "iteration": short(iteration),
        "pairs": len(rows),
        "trl": {k: v for k, v in metrics.items() if k != "log"},
        "trl_log": metrics["log"],
        "sleuth_dpo": {k: mdpo.get(k) for k in ("pairs", "steps", "learning_rate", "accuracy", "margin", "seconds")},
        "rows": rows_out,
        "test": {k: v["test"] for k, v in evaluations.items()},
        "dev": {k: v["dev"] for k, v in evaluations.items()},
    }
    first, last = metrics["first"] or {}, metrics["last"] or {}
    nan = float("nan")
    accuracy = f"{first.get('rewards/accuracies', nan):.2f} -> {last.get('rewards/accuracies', nan):.2f}"
    margin = f"{first.get('rewards/margins', nan):.3f} -> {last.get('rewards/margins', nan):.3f}"
    lines = exp.header(
        "TRL's plain DPO at its defaults on the pairs of one mDPO iteration",
        f"Pairs: `{short(iteration)}/pairs.jsonl`, {len(rows)} training pairs (held-out share {args.heldout_pairs}). "
        f"`trl.DPOConfig` defaults: {described(metrics['config'])}: {metrics['steps']} steps in "
        f"{metrics['seconds'] / 60:.0f} min; logged reward "
        f"accuracy {accuracy}, margin {margin}. "
        f"sleuth's mDPO on the same pairs: {mdpo.get('steps')} steps at lr {mdpo.get('learning_rate')}.",
    )
    lines += [
        "| model | dev EM (100) | vs SFT: better / worse, exact two-sided p | test EM (150) | vs SFT |",
        "|---|---:|---|---:|---|",
    ]
    for stage, row in rows_out.items():
        cells = []
        for split in ("dev", "test"):
            r = row[split]
            vs = "–" if stage == "sft" else f"{r['better']} / {r['worse']}, p = {r['p_two_sided']:.3f}"
            cells += [pct(r["em"] / 100), vs]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    for split in ("dev", "test"):
        r = rows_out["trl-dpo"][split]["vs_" + args.stage]
        lines.append(
            f"\n{split}: TRL plain DPO vs sleuth's {args.stage}: {r['better']} better / {r['worse']} worse, "
            f"exact two-sided p = {r['p_two_sided']:.3f}."
        )
    exp.write(results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
