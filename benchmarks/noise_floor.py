"""How far does greedy EM move when the SFT model's weights move as far as one mDPO iteration, in a random direction?

The learning benchmark's mDPO iterations change the SFT model's weights by about 1e-4 of their norm (6-30 DPO steps
at lr 2e-5), and greedy EM on 150 test questions moves by several points, mostly down. Whether that is the
preference data's doing or what any change of that size does to this model's greedy decoding is the control this
benchmark runs: for each seed, the SFT weights plus Gaussian noise scaled, tensor by tensor, to the norm of the
update ``--update`` made (so the same size per tensor, in a random direction), evaluated exactly as the learning
benchmark evaluates (the same world, index, agent and engine; harness-cached). Also: the SFT model evaluated again,
uncached, to show the evaluation itself is deterministic.

    python benchmarks/noise_floor.py --update $RUNS/learn-acesearcher/mdpo-167fb5f1240d/iter1/model --seeds 3

Reads the learn_acesearcher stages under ``$SLEUTH_HOME/runs/learn-acesearcher`` (run that benchmark first); the
perturbed models and their evaluations go to ``.../learn-acesearcher/noise``; the report to
``docs/results/learn_acesearcher/noise_floor/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Experiment, ModelServer, pct, runs_home, short  # noqa: E402
from learn_acesearcher import agent_config, evaluate, settings  # noqa: E402

from sleuth.eval.stats import binomial_tail, exact_mcnemar  # noqa: E402

RESULTS = REPO / "docs" / "results" / "learn_acesearcher" / "noise_floor"
WEIGHTS = "model.safetensors"


def default_agent() -> Any:
    """The learning benchmark's evaluation agent at its default k = 3 and N = 6 (``settings`` fixes the token
    budgets; the training sizes, which the agent does not depend on, are zero here)."""
    unused = ("sft_decompose_questions", "sft_questions", "sft_lr", "rft_questions", "decompositions", "solutions")
    sizes = {"smoke": False, "seed": 0, "test_questions": 150, "k": 3, "total_passages": 6, "iterations": 0}
    sizes |= dict.fromkeys((*unused, "dpo_lr", "dpo_epochs"), 0)
    return agent_config(settings(argparse.Namespace(**sizes)))


def learn_arguments(parser: argparse.ArgumentParser, results: Path) -> None:
    """The options of a benchmark that reads learn_acesearcher's stages and evaluates as it does."""
    parser.add_argument("--work", default=str(runs_home() / "learn-acesearcher"), help="learn_acesearcher's work dir")
    parser.add_argument("--results", default=str(results))
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--engine", default="auto")


def learn_evaluator(name: str, args: argparse.Namespace) -> tuple[Experiment, Callable[..., dict[str, Any]], dict]:
    """An Experiment ``name`` in learn_acesearcher's work directory, ``measure(stage, model, names=("test", "dev"))``
    (the model evaluated on those splits exactly as learn_acesearcher evaluates: its world, index, agent and
    evaluation keys, so its cached evaluations are read back, not recomputed) and the splits."""
    from sleuth.data.synth import load_synth

    work = Path(args.work)
    world, index = work / "world", str(work / "index")
    if not (work / "sft" / WEIGHTS).exists() or not (world / "world.json").exists():
        raise SystemExit(f"{work}: no SFT model or world; run benchmarks/learn_acesearcher.py first")
    agent = default_agent()
    exp = Experiment(name, work, Path(args.results))
    exp.data["world"] = json.loads((work / "stages" / "world.json").read_text())["key"]
    splits = {"test": list(load_synth(world / "test.jsonl"))[:150], "dev": list(load_synth(world / "dev.jsonl"))[:100]}
    eval_key = {"agent": dataclasses.asdict(agent), "index": index, "options": args.llm_options}

    def measure(stage: str, model: Path, names: tuple[str, ...] = ("test", "dev")) -> dict[str, Any]:
        out = {}
        with ModelServer(model, args.engine, args.llm_options) as server:
            for split in names:
                examples = splits[split]
                key = {**eval_key, "model": str(model), "questions": len(examples)}
                run = functools.partial(evaluate, server, examples, index, agent)
                out[split] = exp.evaluate(stage, split, key, run)
        return out

    return exp, measure, splits


def update_norms(base: Path, update: Path) -> dict[str, float]:
    """Per tensor, the norm of ``update``'s weights minus ``base``'s."""
    from safetensors.torch import load_file

    a, b = load_file(str(base / WEIGHTS)), load_file(str(update / WEIGHTS))
    if set(a) != set(b):
        raise SystemExit(f"{update} and {base} hold different tensors")
    return {k: float((b[k].double() - a[k].double()).norm()) for k in a}


def perturbed(base: Path, norms: dict[str, float], seed: int, out: Path) -> Path:
    """``base`` plus, per tensor, Gaussian noise rescaled to exactly that tensor's norm in ``norms``."""
    if (out / WEIGHTS).exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / WEIGHTS))
    generator = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        scale = norms[name] / float(noise.norm()) if float(noise.norm()) > 0 else 0.0
        noisy[name] = (tensor.double() + scale * noise).to(tensor.dtype).contiguous()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(base, partial, ignore=shutil.ignore_patterns(WEIGHTS, "checkpoint-*", "tb", "*.bin", "log.jsonl"))
    save_file(noisy, str(partial / WEIGHTS), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def versus(before: list[float], after: list[float]) -> dict[str, Any]:
    """EM difference (points), questions better / worse, and the exact two-sided McNemar p of no change."""
    test = exact_mcnemar(before, after)
    better, worse = int(test["better"]), int(test["worse"])
    tail = binomial_tail(max(better, worse), better + worse)  # one side; doubled for two-sided
    return {
        "difference": 100 * (sum(after) - sum(before)) / len(before),
        "better": better,
        "worse": worse,
        "p_two_sided": min(1.0, 2 * tail) if better + worse else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--update", required=True, help="a model trained from the SFT model: its per-tensor update norms"
    )
    parser.add_argument("--update-stage", default="mdpo-1", help="its stage name in learn_acesearcher (cache hits)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--splits", nargs="+", default=["test"], choices=("test", "dev"), help="the noise seeds'")
    learn_arguments(parser, RESULTS)
    args = parser.parse_args()
    from sleuth.train.common import auto_engine

    args.engine = auto_engine(args.engine)
    exp, measure, splits = learn_evaluator("noise_floor", args)
    work, update = Path(args.work), Path(args.update)
    sft, index, agent = work / "sft", str(work / "index"), default_agent()

    norms = update_norms(sft, update)
    total = sum(v * v for v in norms.values()) ** 0.5
    evaluations = {"sft": measure("sft", sft), args.update_stage: measure(args.update_stage, update)}
    with ModelServer(sft, args.engine, args.llm_options) as server:  # uncached: is the evaluation deterministic?
        again = evaluate(server, splits["test"], index, agent)["per_example"]["em"]
    for seed in range(args.seeds):
        model = perturbed(sft, norms, seed, work / "noise" / f"seed{seed}")
        evaluations[f"noise-{seed}"] = measure(f"noise-{seed}", model, tuple(args.splits))

    rows = {}
    for stage, by_split in evaluations.items():
        rows[stage] = {
            split: {
                "em": 100 * sum(e["per_example"]["em"]) / len(e["per_example"]["em"]),
                **(
                    versus(evaluations["sft"][split]["per_example"]["em"], e["per_example"]["em"])
                    if stage != "sft"
                    else {}
                ),
            }
            for split, e in by_split.items()
        }
        for split in ("test", "dev"):
            rows[stage].setdefault(split, None)
    sft_test = evaluations["sft"]["test"]["per_example"]["em"]
    results = {
        "update": short(update),
        "update_norm": total,
        "deterministic": again == sft_test,
        "rows": rows,
        "test": {k: v["test"] for k, v in evaluations.items() if "test" in v},
        "dev": {k: v["dev"] for k, v in evaluations.items() if "dev" in v},
    }
    lines = exp.header(
        "Noise floor: greedy EM of the SFT model under a random weight change the size of one mDPO iteration",
        f"The update measured: `{short(update)}` minus the SFT model, total norm {total:.4g}; each noise seed adds, "
        "per tensor, Gaussian noise rescaled to that tensor's update norm. The SFT model evaluated again without the "
        f"cache gives {'the same' if results['deterministic'] else 'DIFFERENT'} per-question test EM.",
    )
    lines += [
        "| model | test EM (150) | vs SFT: better / worse, exact two-sided p | dev EM (100) | vs SFT |",
        "|---|---:|---|---:|---|",
    ]
    for stage, row in rows.items():
        cells = []
        for split in ("test", "dev"):
            r = row[split]
            if r is None:
                cells += ["–", "–"]
                continue
            vs = "–" if stage == "sft" else f"{r['better']} / {r['worse']}, p = {r['p_two_sided']:.3f}"
            cells += [pct(r["em"] / 100), vs]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    exp.write(results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
