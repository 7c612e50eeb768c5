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

    python benchmarks/learn_acesearcher.py            # about 2 hours on 2 CPU cores with vLLM (docs/results)
    python benchmarks/learn_acesearcher.py --smoke    # tiny random model, a handful of questions, 1-2 steps
    python benchmarks/learn_acesearcher.py --full     # 10x the data and the paper's k / N: sized for a GPU (FULL)
    python benchmarks/learn_acesearcher.py --engine "vllm:{model}?max_num_seqs=64"   # a vLLM server per model

Every stage is cached in the working directory (``runs/learn-acesearcher``) under the settings it depends on
(:mod:`harness`): a killed run resumes, and another mDPO setting (``--dpo-lr``, ``--rft-questions``, ...) trains
beside the first on the same SFT model. Settings are compared on the world's dev questions; the test questions
only report.

``--engine`` runs every evaluation and the mDPO sampling on ``hf`` or on a vLLM server sleuth starts on each model
(``vllm``, or a ``vllm:{model}?...`` template; :mod:`sleuth.train.mdpo`). The default, ``auto``, is ``vllm`` when
vLLM is installed (``make vllm``), else ``hf``; ``--smoke`` defaults to ``hf`` (its tiny random model would make vLLM
compile a new model for minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402  (the benchmarks directory is not a package)
    REPO,
    Experiment,
    ModelServer,
    add_sweep_arguments,
    base_model,
    copy_tree_atomic,
    difference_table,
    parse_sized,
    pct,
    plot,
    run_dirs,
    settings_block,
    short,
    stage_table,
    trials_table,
)

from sleuth.train.rollouts import model_revision  # noqa: E402

RESULTS = REPO / "docs" / "results" / "learn_acesearcher"
# The claims this benchmark is run to test, on the test split: harness.claims gives each the one-sided exact test
# (results.json "claims", results.md "Claims"; benchmarks/recompute_claims.py redoes them from committed results)
CLAIMS = [
    {"name": "SFT > base", "metric": "em", "before": "base", "after": "sft"},
    {"name": "mDPO-2 > SFT", "metric": "em", "before": "sft", "after": "mdpo-2"},
]
PAIR_SETS = ("decompose", "subq", "final")  # sleuth.train.mdpo.PAIR_SETS, without importing the trainer here
DEV_OUTPUTS = ("completion_tokens_mean", "answer_chars_mean", "format_fallback_rate", "fallbacks")
# --full, for a GPU: 10x the SFT and RFT data, the paper's k = 10 and N = 15
FULL = {
    "sft_decompose_questions": 2000,
    "sft_questions": 1000,
    "rft_questions": 1000,
    "k": 10,
    "total_passages": 15,
}


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def evaluate(server: ModelServer, examples: list[Any], index: str, agent: Any) -> dict[str, Any]:
    """Greedy acesearcher EM / F1 of one model on ``examples``, per question (for the paired CIs)."""
    from sleuth.retrieval import load_retriever
    from sleuth.train.common import evaluate_dev

    result = evaluate_dev(examples, server.get(), load_retriever(index), agent, concurrency=64, progress=True)
    return {
        "per_example": {"em": result["per_example_em"], "f1": result["per_example_f1"]},
        "errors": result["errors"],
        "engine": server.engine,
        # what over-optimisation shows first (the diagnosis table's dev columns)
        "outputs": {k: result.get(k) for k in DEV_OUTPUTS},
    }


def agent_config(s: dict[str, Any]) -> Any:
    """The greedy agent every evaluation (and, with the rollout temperature, the mDPO sampling) runs."""
    from sleuth.agents.acesearcher import AceSearcherConfig
    from sleuth.llm import Sampling

    tokens = s["tokens"]
    return AceSearcherConfig(
        k=s["k"],
        total_passages=s["total_passages"],
        max_subquestions=4,
        sampling=Sampling(temperature=0.0, max_new_tokens=max(tokens.values())),
        decompose_max_new_tokens=tokens["decompose"],
        subanswer_max_new_tokens=tokens["subanswer"],
        final_max_new_tokens=tokens["final"],
    )


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
            "dpo_epochs": 1.0,
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
            "test_questions": max(args.test_questions, 150),
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
        "dpo_epochs": args.dpo_epochs,
        "dev_questions": 0,
        "k": args.k,
        "total_passages": args.total_passages,
        # the final call restates each sub-answer before <answer> (as the SFT records do): 48 tokens truncated
        # 3-hop chains before the tag in the first run, so the budget is 128
        "tokens": {"decompose": 64, "subanswer": 12, "final": 128},
    }


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
        learning_rate=s["sft_lr"],
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


#: mDPO settings that change nothing before the given iteration (``fresh_questions``: iteration 1 samples the first
#: block either way; ``later_dpo_lr``: iteration 1 trains at ``dpo_lr``)
FIRST_ITERATION_AFFECTED = {"fresh_questions": 2, "later_dpo_lr": 2}


def _iteration_key(key: dict[str, Any], t: int) -> dict[str, Any]:
    """What iterations 1..t of an mDPO stage depend on: its key without the iteration count and without the settings
    that only act from a later iteration."""
    return {k: v for k, v in key.items() if k != "iterations" and FIRST_ITERATION_AFFECTED.get(k, 1) <= t}


def reuse_iterations(exp: Experiment, out: Path, key: dict[str, Any]) -> dict[str, str]:
    """Copy into ``out`` the finished iterations of a sibling mDPO stage that equals ``key`` on every setting that
    acts up to them (:func:`_iteration_key`: a 2-iteration run whose first iteration a 1-iteration run already
    trained, or a ``--fresh-questions`` run whose first iteration is the plain run's): iteration t of mDPO depends
    only on those settings and iterations 1..t-1, so the copy is what this run would train. The trainer
    then finds ``iter{t}/model`` and ``stats.json`` and goes on from there. Returns {iteration: source directory}."""
    reused: dict[str, str] = {}
    key = json.loads(json.dumps(key, default=str))  # as the stage records store it
    for name, theirs in exp.stage_keys("mdpo").items():
        if name == out.name:
            continue
        for t in range(1, min(theirs["iterations"], key["iterations"]) + 1):
            if _iteration_key(theirs, t) != _iteration_key(key, t):
                break
            source, target = exp.work / name / f"iter{t}", out / f"iter{t}"
            if target.exists():  # trained here or copied by an earlier (killed) run
                continue
            if not ((source / "model").exists() and (source / "stats.json").exists()):
                break  # a later iteration needs this one
            print(f"[{exp.name}] iteration {t}: copied from {source} (the same settings up to this iteration)")
            copy_tree_atomic(source, target)
            reused[str(t)] = str(source)
    return reused


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
        nll_weight=s.get("nll_weight", 0.0),
        fresh_questions=s.get("fresh_questions", False),
        later_learning_rate=s.get("later_dpo_lr"),
        beta=s.get("dpo_beta", MDPOConfig.beta),
        heldout_pairs=s.get("heldout_pairs", 0.0),
        rejected=s.get("rejected", "sampled"),
        pair_sets=tuple(s.get("pair_sets", MDPOConfig.pair_sets)),
        decompose_pairs=s.get("decompose_pairs", "paper"),
        rollouts_from=tuple(s.get("rollouts_from", ())),
        batch_size=s["dpo_batch"],
        per_device_batch_size=1,
        max_steps=s["dpo_steps"],
        epochs=s["dpo_epochs"],
        max_length=s["max_length"],
        warmup_ratio=0.0 if args.smoke else 0.05,
        seed=args.seed,
        eval_initial=False,
    )
    return train_mdpo(config)


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def markdown(exp: Any, results: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    test, dev = results["test"], results["dev"]
    lines = exp.header(
        "Learning benchmark: AceSearcher SFT + mDPO on the synthetic world",
        f"Test: {results['test_questions']} held-out questions (2-3 hops, entities disjoint from training and dev), "
        f"never used for a choice; dev: {results['dev_questions']} other held-out questions, for the settings. "
        "Greedy decoding, BM25 top-k per sub-question. EM (SQuAD-normalised) with a 95% bootstrap CI over "
        "questions.",
    )
    lines += ["## Test", ""]
    lines += stage_table(test, ["em", "f1"], {k: f"`{short(v)}`" for k, v in results["models"].items()})
    lines += ["", "Paired differences on the test questions:", ""]
    lines += difference_table(results["differences"], ["em", "f1"])
    lines += ["", "## Dev", ""]
    lines += stage_table(dev, ["em", "f1"])
    lines += [""] + trials_table(trials)
    iterations = results["mdpo"].get("iterations") or []
    if iterations:
        lines += [
            "",
            "## mDPO iterations (training-question rollouts at T = 1.0)",
            "",
            "| iteration | questions | trajectories | mean reward | ties (decomposition / solver groups) | "
            "pairs (decompose / subq / final / total) | DPO steps | DPO accuracy (mean / last) | "
            "implicit-reward margin (mean / last) | chosen log-ratio < 0 (steps, mean) | logps/chosen first -> last | "
            "minutes sampling / DPO |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for it in iterations:
            pairs, ties, dpo = it.get("pairs") or {}, it.get("degenerate") or {}, it.get("dpo") or {}
            lines.append(
                f"| {it['iteration']} | {it.get('questions', '–')} | {it.get('trajectories', '–')} | "
                f"{pct(it.get('mean_reward'))} | {ties.get('decompose_tie', 0)} / {ties.get('solver_tie', 0)} | "
                f"{pairs.get('decompose', 0)} / {pairs.get('subq', 0)} / {pairs.get('final', 0)} / "
                f"{pairs.get('total', 0)} | {dpo.get('steps', '–')} | {_num(dpo.get('accuracy'))} / "
                f"{_num(dpo.get('final_accuracy'))} | {_num(dpo.get('margin'))} / {_num(dpo.get('final_margin'))} | "
                + (
                    f"{c['negative']} of {c['steps']}, {c['mean']:+.3f} | {c['logps_first']:.2f} -> "
                    f"{c['logps_last']:.2f} | "
                    if (c := it.get("chosen"))
                    else "– | – | "
                )
                + " / ".join(
                    f"{it['seconds'][k] / 60:.0f}" if it.get("seconds", {}).get(k) else "–"
                    for k in ("sampling", "training")
                )
                + " |"
            )
        lines += [
            "",
            "Mean reward: the paper's EM x format reward of the sampled trajectories. A decomposition group ties "
            "when its m decompositions have the same mean reward, a solver group when its m' runs score alike; "
            "tied groups give no pair. The implicit-reward margin is DPO's beta-scaled log-ratio gap "
            "chosen - rejected (TRL's `rewards/margins`): about 0 means DPO did not move the model. The chosen "
            "log-ratio (TRL's `rewards/chosen`, over the logged steps after the first) says whether the preferred "
            "completions gained or lost likelihood; a copied iteration keeps the minutes of the run that trained it.",
        ]
        diagnosed = [
            it
            for it in iterations
            if it.get("pair_correctness")
            or it.get("heldout")
            or (it.get("dev_outputs") or {}).get("completion_tokens_mean") is not None
            or it.get("on_policy")
        ]
        if diagnosed:
            lines += [
                "",
                "### Diagnosis (issue 36 item 4)",
                "",
                "| iteration | pairs: chosen EM / rejected EM | chosen better / equal / rejected better "
                "| held-out pairs | held-out accuracy first -> last | held-out logps chosen / rejected first -> last "
                "| dev tokens per run | dev answer chars | dev fallback rate "
                "| greedy = chosen (pairs kept / sampled) | decompose pairs: chosen steps; longer / same / shorter |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for it in diagnosed:
                c = (it.get("pair_correctness") or {}).get("all") or {}
                h = it.get("heldout") or {}
                curve = h.get("curve") or []
                d = it.get("dev_outputs") or {}
                first, last = (curve[0], curve[-1]) if curve else ({}, {})
                lines.append(
                    f"| {it['iteration']} | {pct(c.get('chosen_correct'))} / {pct(c.get('rejected_correct'))} | "
                    f"{pct(c.get('chosen_better'))} / {pct(c.get('equal'))} / {pct(c.get('rejected_better'))} | "
                    f"{h.get('pairs', '–')} | {_num(first.get('accuracy'))} -> {_num(last.get('accuracy'))} | "
                    f"{_num(first.get('logps_chosen'))} / {_num(first.get('logps_rejected'))} -> "
                    f"{_num(last.get('logps_chosen'))} / {_num(last.get('logps_rejected'))} | "
                    f"{_num(d.get('completion_tokens_mean'))} | {_num(d.get('answer_chars_mean'))} | "
                    f"{pct(d.get('format_fallback_rate'))} | {_on_policy(it)} | {_steps(it)} |"
                )
            lines += [
                "",
                "Pairs judged by the exact match of each side's final answers, whatever the reward (rejected better: "
                "pairs that teach away from the answer; equal: pairs that teach the format). Held-out pairs: whole "
                "questions kept out of DPO (`--heldout-pairs`), their implicit-reward accuracy and summed log-probs "
                "at the first and the last evaluation. Dev outputs: the iteration's model on the dev questions. "
                "Greedy = chosen (`--rejected greedy`): the share of the sampled pairs whose prompt the starting "
                "policy already answers greedily as the chosen side does (those pairs are dropped). Decompose pairs: "
                "how many chosen decompositions have k sub-questions (k: count), and how many pairs prefer the longer "
                "/ an equally long / the shorter one (`--decompose-pairs same_length` keeps only equal ones).",
            ]
        copied = results["mdpo"].get("iterations_reused_from") or {}
        for t, source in sorted(copied.items()):
            lines += [
                "",
                f"Iteration {t} was trained by the run with the same settings up to it, and copied: "
                f"`{short(source)}`.",
            ]
        for it in iterations:
            if it.get("rollouts_reused_from") and str(it["iteration"]) not in copied:
                lines += [
                    "",
                    f"Iteration {it['iteration']} trained on rollouts another setting sampled from the same model "
                    f"with the same sampler, copied: `{short(it['rollouts_reused_from'])}`.",
                ]
    lines += ["", exp.seconds_line(), "", *settings_block(results["settings"])]
    return "\n".join(lines)


def _steps(it: dict[str, Any]) -> str:
    """The diagnosis table's decomposition-length cell: chosen sides by sub-question count; longer / same / shorter."""
    steps = it.get("decompose_steps")
    if not steps:
        return "–"
    chosen = ", ".join(f"{k}: {v}" for k, v in steps["chosen"].items()) or "none"
    return f"{chosen}; {steps['chosen_longer']} / {steps['same_length']} / {steps['chosen_shorter']}"


def chosen_likelihood(log_history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the chosen completions' likelihood moved during DPO, from TRL's logged steps after the first (logged
    before any update): on how many steps ``rewards/chosen`` (beta x the chosen log-ratio to the reference) was
    negative, its mean, and ``logps/chosen`` at the first and last of those steps. The NLL term is meant to keep
    the log-ratio from falling."""
    steps = [r for r in log_history if "rewards/chosen" in r][1:]
    if not steps:
        return None
    ratios = [float(r["rewards/chosen"]) for r in steps]
    return {
        "steps": len(ratios),
        "negative": sum(x < 0 for x in ratios),
        "mean": mean(ratios),
        "logps_first": float(steps[0].get("logps/chosen", float("nan"))),
        "logps_last": float(steps[-1].get("logps/chosen", float("nan"))),
    }


def _on_policy(it: dict[str, Any]) -> str:
    counts, sampled = it.get("on_policy") or {}, (it.get("pairs_sampled") or {}).get("total")
    if not counts or not sampled:
        return "–"
    same = sum(v for k, v in counts.items() if k.endswith("_greedy_is_chosen"))
    return f"{100 * same / sampled:.0f}% ({(it.get('pairs') or {}).get('total')} / {sampled})"


def _num(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few questions, 1-2 steps")
    parser.add_argument(
        "--work", type=Path, default=None, help="work dir (default $SLEUTH_HOME/runs/learn-acesearcher)"
    )
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-questions", type=int, default=150, help="held-out test questions (>= 100)")
    parser.add_argument("--dev-questions", type=int, default=100, help="held-out dev questions, for choices")
    parser.add_argument(
        "--sft-questions", type=int, default=48, help="training questions turned into context-QA and final records"
    )
    parser.add_argument(
        "--sft-decompose-questions", type=int, default=200, help="training questions turned into decomposition records"
    )
    parser.add_argument("--rft-questions", type=int, default=100, help="training questions sampled per mDPO iteration")
    parser.add_argument("--decompositions", type=int, default=3, help="m (paper: 3)")
    parser.add_argument("--solutions", type=int, default=4, help="m' (paper: 4)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--k", type=int, default=3, help="passages per sub-question (paper: 10)")
    parser.add_argument("--total-passages", type=int, default=6, help="N, the final call's passage budget (paper: 15)")
    parser.add_argument("--sft-lr", type=float, default=1e-4, help="paper: 5e-6 (1.5B, 180K records)")
    parser.add_argument("--dpo-lr", type=float, default=2e-5, help="paper: 1e-6 (1.5B, 49K prompts)")
    parser.add_argument("--dpo-epochs", type=float, default=1.0)
    parser.add_argument(
        "--nll-weight", type=float, default=0.0, help="NLL term on the chosen completion (released configs: 0.2-0.5)"
    )
    parser.add_argument(
        "--fresh-questions",
        action="store_true",
        help="iteration t samples the t-th block of --rft-questions training questions (a deviation: the paper "
        "samples the same prompts each iteration)",
    )
    parser.add_argument(
        "--dpo-beta", type=float, default=None, help="DPO beta (paper and default: 0.1; the released 8B config: 0.5)"
    )
    parser.add_argument(
        "--later-dpo-lr",
        type=float,
        default=None,
        help="DPO learning rate of iterations 2..T (a deviation: the paper trains every iteration at one rate)",
    )
    parser.add_argument(
        "--heldout-pairs",
        type=float,
        default=0.0,
        help="diagnosis: hold out the pairs of this share of each iteration's questions and trace the implicit reward "
        "on them (MDPOConfig.heldout_pairs)",
    )
    parser.add_argument(
        "--rejected",
        choices=("sampled", "greedy"),
        default="sampled",
        help="rejected side of each pair: the worst sampled run's (the paper) or the policy's greedy output on the "
        "pair's prompt (a deviation: MDPOConfig.rejected)",
    )
    parser.add_argument(
        "--pair-sets",
        nargs="+",
        choices=PAIR_SETS,
        default=None,
        help="the preference sets DPO trains on (default: all three, as the paper; MDPOConfig.pair_sets)",
    )
    parser.add_argument(
        "--decompose-pairs",
        choices=("paper", "same_length"),
        default="paper",
        help="decomposition pairs: best vs worst (the paper) or best vs the worst of as many sub-questions (a "
        "deviation: MDPOConfig.decompose_pairs)",
    )
    parser.add_argument(
        "--sft-only",
        action="store_true",
        help="stop after the base and SFT evaluations, without a report (e.g. to check that a fresh work directory "
        "trains the same SFT model and reads its committed evaluations back)",
    )
    add_sweep_arguments(parser, "the best dev EM of the last mDPO stage")
    parser.add_argument(
        "--tie-break",
        choices=("earliest", "fewest-changed"),
        default="earliest",
        help="with --choose: a dev tie goes to the earliest recorded trial, or to the smallest update (fewest dev "
        "questions changed from SFT; declare it before the sweep's first trial)",
    )
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--index", default="", help="retriever spec (default: BM25 over the world's corpus)")
    parser.add_argument(
        "--engine",
        default="auto",
        help="hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    args = parse_sized(parser, FULL)
    if (args.dev_only or args.choose) and not args.group:
        parser.error("--dev-only and --choose belong to a sweep: name it with --group")
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.train.common import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)
    s = settings(args)
    work, results = run_dirs("learn_acesearcher", args, RESULTS)
    exp = Experiment("learn_acesearcher", work, results, args.seed, claims=CLAIMS)

    world = work / "world"

    def make_world() -> dict[str, Any]:
        if not (world / "world.json").exists():
            synthesize(world, **s["world"])
        return {"world": str(world)}

    exp.stage("world", s["world"], make_world)
    if not args.index:
        index_dir = work / "index"
        if not index_dir.exists():
            build_bm25_index(world / "corpus.jsonl", index_dir)
        args.index = str(index_dir)
    agent = agent_config(s)
    splits = {
        "test": list(load_synth(world / "test.jsonl"))[: args.test_questions],
        "dev": list(load_synth(world / "dev.jsonl"))[: args.dev_questions],
    }
    eval_key = {"agent": dataclasses.asdict(agent), "index": args.index, "options": args.llm_options}
    evaluations: dict[str, dict[str, Any]] = {"test": {}, "dev": {}}
    models: dict[str, str] = {}

    def measure(
        stage: str, model: Path, same_as: Path | None = None, names: tuple[str, ...] = ("test", "dev")
    ) -> None:
        """Evaluate ``model`` on the splits ``names``; ``same_as``: a directory holding the same weights (the
        iteration a copied one came from), whose cached evaluations stand for this model's. With ``--group`` an mDPO
        stage's test evaluation belongs to the group: the harness refuses it before the group's dev choice."""
        models[stage] = str(model)
        group = args.group if stage.startswith("mdpo") else None
        with ModelServer(model, args.engine, args.llm_options) as server:
            for split in names:
                examples = splits[split]
                key = {**eval_key, "model": str(same_as or model), "questions": len(examples)}
                run = functools.partial(evaluate, server, examples, args.index, agent)
                evaluations[split][stage] = exp.evaluate(stage, split, key, run, group=group)

    base = base_model(args.smoke, work)
    measure("base", base)
    sft_key = {
        "world": s["world"],
        **{k: s[k] for k in ("sft_questions", "sft_steps", "sft_lr", "sft_batch", "max_length", "k")},
    }
    try:
        sft = Path(
            exp.stage(
                "sft", sft_key, lambda: {"model": str(run_sft(base, world, work / "sft", s, agent, args.seed)[0])}
            )["model"]
        )
    except ImportError as exc:  # the SFT trainer needs the train extra
        raise SystemExit(f"SFT needs sleuth[train]: {exc}") from None
    # the trainer's own runtime from its log: also right when the model was trained by an earlier or interrupted run
    exp.seconds["sft"] = max(exp.seconds["sft"], _sft_runtime(sft))
    measure("sft", sft)
    if args.sft_only:
        print(f"[{exp.name}] --sft-only: base and SFT evaluated, no mDPO and no report", flush=True)
        return
    mdpo_keys = (
        "rft_questions",
        "decompositions",
        "solutions",
        "iterations",
        "dpo_steps",
        "dpo_lr",
        "dpo_batch",
        "dpo_epochs",
        "tokens",
        "total_passages",
    )
    mdpo_key = {"sft": sft_key, **{k: s[k] for k in mdpo_keys}, "engine": args.engine}
    if args.nll_weight:  # only when set, so runs from before the option keep their key
        s["nll_weight"] = mdpo_key["nll_weight"] = args.nll_weight
    if args.fresh_questions:  # likewise
        s["fresh_questions"] = mdpo_key["fresh_questions"] = True
    if args.later_dpo_lr is not None:  # likewise
        s["later_dpo_lr"] = mdpo_key["later_dpo_lr"] = args.later_dpo_lr
    if args.dpo_beta is not None:  # likewise
        s["dpo_beta"] = mdpo_key["dpo_beta"] = args.dpo_beta
    if args.heldout_pairs:  # likewise
        s["heldout_pairs"] = mdpo_key["heldout_pairs"] = args.heldout_pairs
    if args.rejected != "sampled":  # likewise
        s["rejected"] = mdpo_key["rejected"] = args.rejected
    if args.pair_sets and tuple(args.pair_sets) != PAIR_SETS:  # likewise
        s["pair_sets"] = mdpo_key["pair_sets"] = list(args.pair_sets)
    if args.decompose_pairs != "paper":  # likewise
        s["decompose_pairs"] = mdpo_key["decompose_pairs"] = args.decompose_pairs
    # one directory per mDPO setting, so settings tried on dev sit side by side on the same SFT model
    mdpo_dir = exp.stage_dir("mdpo", mdpo_key)
    # iteration 1 samples from the SFT model whatever the DPO settings, and iteration t from a model a sibling may
    # have trained with the same settings (copied by reuse_iterations): every sibling with these sampling settings is
    # a candidate, and train_mdpo takes an iteration's rollouts from the first whose store has that iteration's
    # producer (the same weights, agent, m, m', seed) and questions
    sampling = ("sft", "rft_questions", "decompositions", "solutions", "tokens", "total_passages", "engine")
    s["rollouts_from"] = [
        str(exp.work / name)
        for name, key in exp.stage_keys("mdpo", unfinished=True).items()
        if name != mdpo_dir.name and all(key.get(k) == mdpo_key[k] for k in sampling)
    ]

    def train() -> dict[str, Any]:
        reused = reuse_iterations(exp, mdpo_dir, mdpo_key)
        return {**run_mdpo(sft, world, mdpo_dir, s, agent, args), "iterations_reused_from": reused}

    summary = exp.stage(mdpo_dir.name, mdpo_key, train)
    held_back: list[tuple[str, Path, Path | None]] = []
    for it in summary["iterations"]:  # what the table needs to explain a flat curve: ties and how far DPO moved
        stats_file = mdpo_dir / f"iter{it['iteration']}" / "stats.json"
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            it["trajectories"] = stats.get("trajectories")
            it["questions"] = stats.get("questions")
            it["degenerate"] = stats.get("degenerate")
            it["rollouts_reused_from"] = stats.get("rollouts_reused_from")
            it["dpo"] = stats.get("dpo") or {}
            it["pair_correctness"] = stats.get("pair_correctness")  # is the chosen side the correct one?
            it["dev_outputs"] = {k: (stats.get("dev") or {}).get(k) for k in DEV_OUTPUTS}
            it["pairs_sampled"] = stats.get("pairs_sampled")  # rejected="greedy": before the on-policy filter
            it["on_policy"] = stats.get("on_policy")
            it["decompose_steps"] = stats.get("decompose_steps")  # sub-question counts of the decomposition pairs
            metrics = stats_file.with_name("train_metrics.json")  # the DPO trainer's log (stats.json leaves it out)
            if metrics.exists():
                trained = json.loads(metrics.read_text())
                it["chosen"] = chosen_likelihood(trained.get("log_history") or [])
                it["heldout"] = trained.get("heldout")
            it["seconds"] = stats.get("seconds") or {}
        source = (summary.get("iterations_reused_from") or {}).get(str(it["iteration"]))
        model = mdpo_dir / f"iter{it['iteration']}" / "model"
        same_as = Path(source) / "model" if source else None
        if same_as and model_revision(same_as) != model_revision(model):  # the source was trained again since
            same_as = None
        # with --group, dev first: the test split waits for the group's choice (below)
        measure(f"mdpo-{it['iteration']}", model, same_as, ("dev",) if args.group else ("test", "dev"))
        held_back.append((f"mdpo-{it['iteration']}", model, same_as))
        if all(v is None for v in (it.get("dev_outputs") or {}).values()):  # the stage had no dev set: the harness's
            it["dev_outputs"] = evaluations["dev"][f"mdpo-{it['iteration']}"].get("outputs")

    settings_record = {k: v for k, v in s.items() if k != "rollouts_from"}
    settings_record |= {"agent": dataclasses.asdict(agent), "llm_options": args.llm_options, "engine": args.engine}
    trial = {k: v for k, v in settings_record.items() if k != "agent"}
    if args.group:  # the setting is a trial of the group: its dev values are recorded before any test evaluation
        trials = exp.record_trial(trial, evaluations["dev"], "em", group=args.group, reference="sft")
        if args.dev_only:
            print(f"[{exp.name}] trial of {args.group!r} recorded on dev: {exp.results / 'trials.json'}", flush=True)
            return
        if args.choose:
            exp.choose(args.group, f"mdpo-{s['iterations']}", tie_break=args.tie_break.replace("-", "_"))
        for stage, model, same_as in held_back:
            measure(stage, model, same_as, ("test",))
        evaluations["test"] = {k: evaluations["test"][k] for k in ("base", "sft", *[h[0] for h in held_back])}
    names = list(evaluations["test"])
    comparisons = [("sft", "base"), *[(n, "sft") for n in names if n.startswith("mdpo")]]
    comparisons += [(names[i], names[i - 1]) for i in range(3, len(names))]
    # rollouts_from says where samples could be reused from, not what was trained (a stage that sampled its own, or
    # a cached one, also gets it): what each iteration reused is in its stats (``rollouts_reused_from``)
    tested = {k: v for k, v in evaluations["test"].items() if k.startswith("mdpo")}
    trials = exp.record_trial(trial, evaluations["dev"], "em", group=args.group, test=tested, reference="sft")
    results = {
        "smoke": args.smoke,
        "test_questions": len(splits["test"]),
        "dev_questions": len(splits["dev"]),
        "settings": settings_record,
        "models": models,
        "test": evaluations["test"],
        "dev": evaluations["dev"],
        "differences": exp.differences(evaluations["test"], comparisons, ["em", "f1"]),
        "mdpo": summary,
    }
    plot(
        {split: [(st, e["ci"]["em"]) for st, e in evaluations[split].items()] for split in ("test", "dev")},
        exp.results / "curve.png",
        "EM (%)",
        "AceSearcher recipe on the synthetic world (95% bootstrap CI)",
    )
    exp.write(results, markdown(exp, results, trials))


if __name__ == "__main__":
    main()
