"""Does ExSearch's generalized EM teach a small model to search? EM on held-out synthetic questions, stage by stage,
with the paper's "w/o w(z)" ablation (uniform weights) in the same run.

A synthetic multi-hop world (2-3 hops, invented entities: nothing is answerable from pre-training) is generated;
SmolLM2-135M-Instruct on CPU then goes through ExSearch's recipe and the same questions are answered greedily by the
``exsearch`` agent (BM25 over the world) after each stage:

1. ``base``: the model as shipped;
2. ``warm-up``: SFT on seed trajectories in the ExSearch format (FireAct ReAct trajectories from ../shared/data
   when present + gold trajectories from the world's training decompositions), observation tokens masked;
3. ``em-t``: after EM iteration t with the paper's weights w(z) = p(gold | x, z) (Algorithm 1);
4. ``uniform-t``: the same iterations with every weight 1 (naive self-training, the paper's ablation). Iteration 0
   of both arms trains on the *same* sampled trajectories (the E-step is shared: ``reuse_estep`` gives the uniform
   arm the em arm's scored records with every weight 1), so the two differ only in the weighting. The paper's
   direction is EM > uniform. ``--arms em`` leaves the ablation out (each later iteration of it samples its own
   E-step, the costliest part on a CPU); ``--arms uniform`` alone reuses a finished em stage's E-step.

Every stage is evaluated on two splits of the world, whose entities are disjoint from training and from each other:
``dev`` (the first ``--dev-questions`` of the world's dev split), on which settings are compared and every setting
tried is listed (``trials.json`` in the results directory), and ``test`` (the first ``--test-questions`` of its
test split), which is reported and never used to choose anything. Reported per stage: EM and F1 with bootstrap 95%
CIs, paired bootstrap CIs of the differences, the E-step weight distribution with its effective sample size, and
the searches per trajectory. Results go to ``docs/results/learn_exsearch/``; stages, caching and the report come
from ``benchmarks/harness.py``: a rerun resumes; each EM setting (``--em-questions``, ``--iterations``, ``--em-lr``)
trains into its own directory next to the others on the same warm-up, while a changed setting of the world or the
warm-up is an error naming the files to remove (results of two settings are never mixed).

M-step settings (``--em-lr``, ``--em-epochs``, ``--min-weight``) are swept on dev as a group: each run with
``--group NAME`` evaluates its EM stages on dev and records a trial in ``trials.json`` (``--dev-only`` stops there);
``--choose`` records the group's choice (the best dev EM of the last EM stage) before this run's test evaluation, and
the test split of a group's stage is refused until then. Iteration 0's E-step depends on none of these settings, so
a new setting copies it from a sibling EM stage that sampled the same questions from the same policy
(:func:`reuse_estep`): a sweep samples once. ``--min-weight`` leaves trajectories with w(z) at or below it out of
the M-step; the report gives how many were trained on and their share of the iteration's weight.

    python benchmarks/learn_exsearch.py --arms em --em-questions 96 --samples 4 --best-of 1 --fresh-questions \
        --iterations 1 --test-questions 200 --min-weight 0.01 --group mstep --dev-only  # then --em-lr 1e-4 --choose

The scale is tiny next to the paper's (tens of E-step questions instead of 10^4-10^5, a 135M model, k=2 documents
per search, one EM iteration by default), so learning rates are raised; the point is the direction and whether
the weighting matters, not the paper's numbers.

    python benchmarks/learn_exsearch.py              # about an hour on 2 CPU cores
    python benchmarks/learn_exsearch.py --smoke      # tiny random model, a handful of questions, 1 step
    python benchmarks/learn_exsearch.py --full       # sized for a GPU (FULL below; runs/learn-exsearch-full)
    python benchmarks/learn_exsearch.py --engine vllm   # evaluations and E-step sampling on vLLM servers

``--engine`` runs the evaluations and the E-step sampling on ``hf`` or on a vLLM server sleuth starts on each model
(``vllm``, or a ``vllm:{model}?...`` template; the E-step's scoring stays on hf, see
:mod:`sleuth.train.exsearch_em`). The default, ``auto``, is ``vllm`` when vLLM is installed (``make vllm``), else
``hf``; ``--smoke`` defaults to ``hf`` (its tiny random model would make vLLM compile a new model for minutes). The
engine and ``--llm-options`` say how a stage is computed, not what: they are not part of the stages' keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402  (the benchmarks directory is not a package)
    REPO,
    Experiment,
    add_sweep_arguments,
    base_model,
    difference_table,
    key_hash,
    parse_sized,
    plot,
    run_dirs,
    settings_block,
    short,
    stage_table,
    trials_table,
)

RESULTS = REPO / "docs" / "results" / "learn_exsearch"
FIREACT = REPO.parent / "shared" / "data" / "fireact" / "hotpotqa_react_trajectories.jsonl"
METRICS = ("em", "f1")


# The claims this benchmark is run to test, on the test split: harness.claims gives each the one-sided exact test
# (results.json "claims", results.md "Claims"; benchmarks/recompute_claims.py redoes them from committed results)
def claims_for(iterations: int) -> list[dict[str, str]]:
    """The claims of a run with ``iterations`` EM iterations: its last EM stage against the warm-up and against the
    same iteration of the uniform ablation (claims whose stages a run lacks, e.g. ``--arms em``, are left out)."""
    last = iterations - 1
    return [
        {"name": "warm-up > base", "metric": "em", "before": "base", "after": "warm-up"},
        {"name": f"EM-{iterations} > warm-up", "metric": "em", "before": "warm-up", "after": f"em-{last}"},
        {
            "name": f"EM-{iterations} > uniform-{iterations}",
            "metric": "em",
            "before": f"uniform-{last}",
            "after": f"em-{last}",
        },
    ]


CLAIMS = claims_for(2)  # the reported run's (docs/results/learn_exsearch: two iterations)
# --full, for a GPU: 1,000 E-step questions x K = 4 trajectories (best-of-8 each) per iteration, three iterations
# (4,000 trajectories an iteration, 42x the CPU run's 96; the paper samples 10^4-10^5), a warm-up on 200 gold and
# 100 FireAct trajectories, 200 test and 200 dev questions
FULL = {
    "test_questions": 200,
    "dev_questions": 200,
    "warmup_questions": 200,
    "fireact": 100,
    "em_questions": 1000,
    "samples": 4,
    "iterations": 3,
}


def lr(given: float | None, default: float) -> float:
    return default if given is None else given


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, grouped by the stage that reads it (a group is that stage's part of its key).
    ``--smoke`` fixes the sizes but keeps ``--iterations`` and the learning rates given (to try resumption)."""
    if args.smoke:
        world = {"train_entities": 60, "dev_entities": 30, "test_entities": 30, "train_questions": 12}
        world.update(dev_questions=2, test_questions=4)
        return {
            "world": {"seed": args.seed, "min_hops": 2, "max_hops": 3, **world},
            "eval": {"dev_questions": 2, "test_questions": 4, "tokens": {"turn": 8, "answer": 6}, "k": 2},
            "warmup": {
                "synth": 4,
                "fireact_limit": 2,
                "epochs": 1,
                "lr": lr(args.warmup_lr, 1e-3),
                "batch": 2,
                "max_steps": 1,
            },
            "em": {
                "questions": 3,
                "samples": 2,
                "iterations": args.iterations,
                "lr": lr(args.em_lr, 1e-3),
                "epochs": 1,
                "batch": 2,
                "max_steps": 1,
                **({"best_of": args.best_of} if args.best_of != 8 else {}),
                **({"fresh_questions": True} if args.fresh_questions else {}),
            },
        }
    return {
        "world": {
            "seed": args.seed,
            "min_hops": 2,
            "max_hops": 3,
            "train_questions": 2000,
            # pools the evaluations take their first questions from: --dev/--test-questions up to 200 keep the world
            "dev_questions": max(200, args.dev_questions),
            "test_questions": max(200, args.test_questions),
        },
        "eval": {
            "dev_questions": args.dev_questions,
            "test_questions": args.test_questions,
            "tokens": {"turn": 48, "answer": 16},
            "k": 2,
        },
        "warmup": {
            "synth": args.warmup_questions,
            "fireact_limit": args.fireact,
            "epochs": 2,
            "lr": lr(args.warmup_lr, 1e-4),
            "batch": 8,
            "max_steps": -1,
        },
        "em": {
            "questions": args.em_questions,
            "samples": args.samples,
            "iterations": args.iterations,
            "lr": lr(args.em_lr, 3e-5),
            "epochs": args.em_epochs,
            "batch": 8,
            "max_steps": -1,
            # keyed only when set, so the runs before the options keep their keys
            **({"best_of": args.best_of} if args.best_of != 8 else {}),
            **({"fresh_questions": True} if args.fresh_questions else {}),
            **({"min_weight": args.min_weight} if args.min_weight else {}),
        },
    }


def em_config(s: dict[str, Any], args: argparse.Namespace, agent: Any, **fields: Any) -> Any:
    from sleuth.train.exsearch_em import EMConfig

    warm, em = s["warmup"], s["em"]
    return EMConfig(
        llm_options=args.llm_options,
        engine=args.engine,
        agent=agent,
        fireact=str(FIREACT) if FIREACT.exists() and warm["fireact_limit"] else "",
        fireact_limit=warm["fireact_limit"],
        warmup_synth=warm["synth"],
        warmup_epochs=warm["epochs"],
        warmup_lr=warm["lr"],
        train_limit=em["questions"],
        fresh_questions=em.get("fresh_questions", False),
        best_of=em.get("best_of", 8),
        min_weight=em.get("min_weight", 0.0),
        dev_limit=0,  # the benchmark evaluates dev itself, for every stage
        samples=em["samples"],
        iterations=em["iterations"],
        patience=em["iterations"],
        learning_rate=em["lr"],
        epochs=em["epochs"],
        batch_size=em["batch"],
        per_device_batch_size=2,
        warmup_ratio=0.0 if args.smoke else 0.1,
        max_length=2048,
        max_steps=em["max_steps"],
        save_steps=25,
        seed=args.seed,
        **fields,
    )


def evaluate(
    model_dir: Path, examples: list[Any], index: str, agent: Any, options: str, traces: Path, engine: str
) -> dict[str, Any]:
    """Greedy exsearch of one model on ``examples``: per-question EM and F1 (SQuAD), searches per question."""
    from types import SimpleNamespace

    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.train.common import close_llm, engine_spec
    from sleuth.train.exsearch_em import evaluate as run_eval

    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=options), model_dir))
    try:
        result = run_eval(examples, llm, load_retriever(index), agent, traces, 64)
    finally:
        close_llm(llm)
    return {
        "per_example": {"em": result["per_example_em"], "f1": result["per_example_f1"]},
        "searches": result["searches"],
        "errors": result["errors"],
        "engine": engine,
        "model": str(model_dir),
    }


def reuse_estep(exp: Experiment, arm_key: dict[str, Any], out: Path) -> str | None:
    """Copy iteration 0's E-step (rollouts, weights, ``estep.json``) into ``out`` from a sibling stage that sampled
    it with the same policy, questions, samples, best-of, agent and seed: the E-step depends on none of the M-step's
    settings (learning rate, epochs, ``min_weight``), and on a 2-core CPU it is the costliest part, so a sweep of
    M-step settings samples it once. The donor has the same weighting, or ``out`` is the uniform ablation: its
    records are the donor's (the same trajectories, the same scored log p(y | x, z)) with every weight set to 1,
    exactly what its own E-step would have produced from those rollouts, so "EM > uniform" compares the weights
    alone. Returns the donor's directory (None: nothing to reuse, or ``out`` has its own)."""
    estep_fields = ("questions", "samples", "best_of", "fresh_questions")

    def estep(key: dict[str, Any]) -> Any:
        em = key.get("em") or {}
        same = {k: key.get(k) for k in ("model", "agent", "seed")}
        return json.dumps([same, {f: em.get(f) for f in estep_fields}], sort_keys=True, default=str)

    target = out / "iter0"
    if (target / "weighted.jsonl").exists():
        return None
    wanted = json.loads(json.dumps(arm_key, default=str))
    weighting = wanted.get("weighting")
    donors = {**exp.stage_keys("em", unfinished=True), **exp.stage_keys("uniform", unfinished=True)}
    for name, key in donors.items():
        donor = exp.work / name / "iter0"
        if donor == target or estep(key) != estep(wanted):
            continue
        if key.get("weighting") != weighting and weighting != "uniform":
            continue
        if (donor / "weighted.jsonl").exists() and (donor / "estep.json").exists():
            target.mkdir(parents=True, exist_ok=True)
            if (donor / "rollouts").exists() and not (target / "rollouts").exists():
                shutil.copytree(donor / "rollouts", target / "rollouts")
            shutil.copy2(donor / "estep.json", target / "estep.json")
            # weights last: their presence means the E-step is done
            if key.get("weighting") == weighting:
                shutil.copy2(donor / "weighted.jsonl", target / "weighted.jsonl")
            else:  # the uniform ablation from another weighting's E-step: w(z) = 1
                info = json.loads((target / "estep.json").read_text())
                info["weights_from"] = f"{name}, every weight set to 1"
                (target / "estep.json").write_text(json.dumps(info, indent=1))
                lines = (donor / "weighted.jsonl").read_text().splitlines()
                records = [{**json.loads(line), "weight": 1.0} for line in lines if line.strip()]
                (target / "weighted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            print(f"[{exp.name}] {out.name}: iteration 0's E-step reused from {name}", flush=True)
            return str(donor.parent)
    return None


def effective_sample_size(weighted: Path) -> float | None:
    """Kish's effective sample size (sum w)^2 / sum w^2 over all trajectories of one M-step: the number of equally
    weighted trajectories whose loss would carry the same information. The M-step sums w * NLL over trajectories with
    the raw weights (not normalised per question), so this is the number it effectively trains on: 96 uniform
    weights give 96, eight weights near 1 among 88 near 0 give ~8 (a per-question mean would count four weights of
    1e-12 as four equal trajectories). 0 when every weight is 0."""
    weights = [float(json.loads(line)["weight"]) for line in weighted.read_text().splitlines() if line.strip()]
    if not weights:
        return None
    squares = sum(w * w for w in weights)
    return sum(weights) ** 2 / squares if squares > 0 else 0.0


def mass_trained(weighted: Path, min_weight: float) -> float | None:
    """The share of an iteration's total weight sum(w) that the M-step trains on: the trajectories with
    w > ``min_weight`` (1.0 with the default 0 unless weights are 0). None when the weights sum to 0."""
    weights = [float(json.loads(line)["weight"]) for line in weighted.read_text().splitlines() if line.strip()]
    total = sum(weights)
    return sum(w for w in weights if w > min_weight) / total if total > 0 else None


def weight_table(arms: dict[str, dict[str, Any]]) -> list[str]:
    """The E-step trajectories of each EM iteration: weights (as the M-step saw them), ESS, searches, M-step loss."""
    lines = [
        "E-step trajectories per iteration (training questions, sampled at T=0.8; weights before training; ESS = "
        "Kish's effective sample size over the iteration's trajectories, the number the M-step in effect trains on):",
        "",
        "| arm | iteration | trajectories | sampled EM | mean w | median w | w > 0.5 | ESS | trained (share of sum w) "
        "| searches | M-step loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, record in arms.items():
        for it in record["iterations"]:
            traj, m = it.get("trajectories") or {}, it.get("m_step") or {}
            w = traj.get("weight") or {}
            first, last, ess = m.get("first_loss"), m.get("last_loss"), it.get("ess")
            sampled = traj.get("sampled_em")
            share = it.get("mass_trained")
            trained = f"{m.get('trained', traj.get('n'))}" + ("" if share is None else f" ({100 * share:.1f}%)")
            lines.append(
                f"| {arm} | {it['iteration']} | {traj.get('n')} | {'-' if sampled is None else f'{100 * sampled:.1f}'}"
                f" | {w.get('mean', 0):.3f} | {w.get('median', 0):.3f} | {w.get('above_0.5')} | "
                f"{'-' if ess is None else f'{ess:.2f}'} | {trained} | {traj.get('searches_per_trajectory', 0):.2f} | "
                f"{'-' if first is None else f'{first:.3f}'} -> {'-' if last is None else f'{last:.3f}'} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few questions, 1 step")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default $SLEUTH_HOME/runs/learn-exsearch)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-questions", type=int, default=100, help="held-out questions reported (test split)")
    parser.add_argument("--dev-questions", type=int, default=100, help="questions settings are compared on")
    parser.add_argument("--warmup-questions", type=int, default=40, help="gold synthetic warm-up trajectories")
    parser.add_argument("--fireact", type=int, default=20, help="FireAct warm-up trajectories (0: none)")
    parser.add_argument("--em-questions", type=int, default=24, help="training questions per E-step")
    parser.add_argument("--samples", type=int, default=2, help="trajectories sampled per E-step question (K)")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument(
        "--best-of",
        type=int,
        default=8,
        help="E-step: each model call keeps the most likely of this many samples (the reference code's vLLM best_of "
        "8; the paper states none; 1 = plain sampling, ~8x cheaper per trajectory)",
    )
    parser.add_argument(
        "--fresh-questions",
        action="store_true",
        help="E-step: iteration t samples the t-th block of --em-questions training questions (default: the same "
        "first ones every iteration)",
    )
    parser.add_argument(
        "--arms",
        type=lambda text: [a.strip() for a in text.split(",") if a.strip()],
        default=["em", "uniform"],
        help="comma-separated: em (the paper's weights), uniform (the ablation); default both",
    )
    parser.add_argument(
        "--warmup-lr", type=float, default=None, help="default 1e-4, 1e-3 with --smoke (paper: 2e-6 for 3B-24B)"
    )
    parser.add_argument("--em-lr", type=float, default=None, help="default 3e-5, 1e-3 with --smoke (paper: 2e-6)")
    parser.add_argument("--em-epochs", type=int, default=1, help="M-step epochs over an iteration's trajectories")
    parser.add_argument(
        "--min-weight",
        type=float,
        default=0.0,
        help="M-step: leave out trajectories with w(z) <= this (default 0: all; the paper's weights are mostly "
        "~1e-14, whose records cost a full forward and backward pass each and move nothing)",
    )
    add_sweep_arguments(parser, "the best dev EM of the last EM stage")
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument(
        "--engine",
        default="auto",
        help="hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed (hf with --smoke)",
    )
    args = parse_sized(parser, FULL)
    if not args.arms or not set(args.arms) <= {"em", "uniform"}:
        parser.error(f"--arms takes em and/or uniform, not {args.arms}")
    if (args.dev_only or args.choose) and not args.group:
        parser.error("--dev-only and --choose belong to a sweep: name it with --group")
    from sleuth.train.common import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)

    from sleuth.agents.exsearch import ExSearchConfig
    from sleuth.data.synth import load_synth
    from sleuth.llm import Sampling
    from sleuth.retrieval import load_retriever
    from sleuth.train.exsearch_em import train_exsearch, train_weighted, warmup_records

    s = settings(args)
    work, results = run_dirs("learn_exsearch", args, RESULTS)
    exp = Experiment("learn_exsearch", work, results, args.seed, claims=claims_for(s["em"]["iterations"]))
    agent = ExSearchConfig(
        k=s["eval"]["k"],
        max_steps=4,
        sampling=Sampling(temperature=0.0, max_new_tokens=s["eval"]["tokens"]["turn"]),
        answer_max_new_tokens=s["eval"]["tokens"]["answer"],
    )
    agent_key = dataclasses.asdict(agent)

    world, index = exp.synthetic_world(s["world"])
    splits = {
        split: list(load_synth(world / f"{split}.jsonl"))[: s["eval"][f"{split}_questions"]]
        for split in ("dev", "test")
    }
    train = list(load_synth(world / "train.jsonl"))
    evaluations: dict[str, dict[str, dict[str, Any]]] = {"dev": {}, "test": {}}

    def measure(stage: str, model: Path, names: tuple[str, ...] = ("dev", "test")) -> None:
        """Evaluate ``model`` on the splits ``names``. With ``--group`` an EM stage's test evaluation belongs to the
        group: the harness refuses it before the group's dev choice."""
        group = args.group if stage.split("-")[0] in ("em", "uniform") else None
        for split in names:
            examples = splits[split]
            key = {"model": str(model), "questions": len(examples), "agent": agent_key}
            traces = exp.work / "eval" / split / f"{stage}-{key_hash(key)}.traces.jsonl"
            evaluations[split][stage] = exp.evaluate(
                stage,
                split,
                key,
                lambda examples=examples, traces=traces: evaluate(
                    model, examples, index, agent, args.llm_options, traces, args.engine
                ),
                group=group,
            )

    base = base_model(args.smoke, exp.work)
    measure("base", base)

    # warm-up: the same records and trainer `sleuth train exsearch` uses
    # a stage's key names its input by path, and the path of a stage's output holds the hash of that stage's key
    warm_key = {"world": str(world), "base": str(base), "warmup": s["warmup"], "agent": agent_key, "seed": args.seed}

    def warm_up() -> dict[str, Any]:
        out = exp.stage_dir("warmup", warm_key)
        out.mkdir(parents=True, exist_ok=True)
        config = em_config(s, args, agent, model=str(base), output_dir=str(out), data_dir=str(world))
        data = out / "data.jsonl"
        if not data.exists():
            # warm-up questions from the second half of the training split: the E-step samples the first ones
            records, report = warmup_records(config, train[len(train) // 2 :], load_retriever(index))
            (out / "data_summary.json").write_text(json.dumps(report, indent=2) + "\n")
            data.write_text("".join(json.dumps(r) + "\n" for r in records))
        records = [json.loads(line) for line in data.read_text().splitlines()]
        training = train_weighted(records, base, out, config, s["warmup"]["lr"], s["warmup"]["epochs"])
        data_summary = json.loads((out / "data_summary.json").read_text())
        return {"model": str(out / "model"), "training": training, "data": data_summary}

    warm = exp.stage("warmup", warm_key, warm_up)
    measure("warm-up", Path(warm["model"]))

    # EM with the paper's weights, then the uniform ablation on the same iteration-0 rollouts
    arms: dict[str, dict[str, Any]] = {}
    for arm, weighting in (("em", "likelihood"), ("uniform", "uniform")):
        if arm not in args.arms:
            continue
        arm_key = {
            "model": warm["model"],
            "em": s["em"],
            "agent": agent_key,
            "seed": args.seed,
            "weighting": weighting,
        }

        def run_arm(arm: str = arm, arm_key: dict[str, Any] = arm_key, weighting: str = weighting) -> dict[str, Any]:
            out = exp.stage_dir(arm, arm_key)
            reuse_estep(exp, arm_key, out)  # the uniform arm: the em arm's trajectories, every weight 1
            config = em_config(
                s,
                args,
                agent,
                model=warm["model"],
                output_dir=str(out),
                data_dir=str(world),
                index=index,
                warmup=False,
                weighting=weighting,
            )
            summary = train_exsearch(config)
            iterations = []
            for it in summary["iterations"]:
                folder = out / f"iter{it['iteration']}"
                stats = json.loads((folder / "stats.json").read_text())
                iterations.append({**stats, "ess": effective_sample_size(folder / "weighted.jsonl")})
            return {"dir": str(out), "summary": summary, "iterations": iterations}

        # one stage and directory per EM setting: settings tried on dev sit side by side on the same warm-up
        arms[arm] = exp.stage(exp.stage_dir(arm, arm_key).name, arm_key, run_arm)
        for it in arms[arm]["iterations"]:  # recomputed: a stage cached before the ESS definition changed
            weighted = Path(arms[arm]["dir"]) / f"iter{it['iteration']}" / "weighted.jsonl"
            if weighted.exists():
                it["ess"] = effective_sample_size(weighted)
                it["mass_trained"] = mass_trained(weighted, s["em"].get("min_weight", 0.0))
        for it in arms[arm]["iterations"]:  # with --group, dev first: the test split waits for the group's choice
            measure(f"{arm}-{it['iteration']}", Path(it["model"]), ("dev",) if args.group else ("dev", "test"))

    trial_settings = {**s, "agent": agent_key, "engine": args.engine, "arms": sorted(args.arms)}
    last = f"em-{s['em']['iterations'] - 1}" if "em" in arms else f"uniform-{s['em']['iterations'] - 1}"
    if args.group:  # the setting is a trial of the group: its dev values are recorded before any test evaluation
        exp.record_trial(trial_settings, evaluations["dev"], "em", group=args.group, reference="warm-up")
        if args.dev_only:
            print(f"[{exp.name}] trial of {args.group!r} recorded on dev: {exp.results / 'trials.json'}", flush=True)
            return
        if args.choose:
            exp.choose(args.group, last)
        for arm in arms:
            for it in arms[arm]["iterations"]:
                measure(f"{arm}-{it['iteration']}", Path(it["model"]), ("test",))
    tested = {k: v for k, v in evaluations["test"].items() if k.split("-")[0] in ("em", "uniform")}

    pairs = [("warm-up", "base")]
    for i in range(s["em"]["iterations"]):  # a pair with an arm not run is skipped (exp.differences)
        pairs += [(f"em-{i}", "warm-up"), (f"uniform-{i}", "warm-up"), (f"em-{i}", f"uniform-{i}")]
    differences = {split: exp.differences(evaluations[split], pairs, METRICS) for split in evaluations}
    trials = exp.record_trial(
        trial_settings, evaluations["dev"], "em", group=args.group, test=tested, reference="warm-up"
    )

    test = evaluations["test"]
    curve = {
        label: [
            (name, test[stage]["ci"]["em"])
            for stage, name in [("base", "base"), ("warm-up", "warm-up")]
            + [(f"{arm}-{i}", f"EM iter {i}") for i in range(s["em"]["iterations"])]
            if stage in test
        ]
        for arm, label in (("em", "EM, w(z) = p(y | x, z)"), ("uniform", "w/o w(z) (uniform)"))
    }
    plot(curve, exp.results / "curve.png", "test EM (%)", "ExSearch EM on the synthetic world (95% bootstrap CI)")

    models = {stage: short(e["model"]) for stage, e in test.items()}
    searches = ", ".join(f"{stage} {e['searches']:.2f}" for stage, e in test.items())
    warm_data = warm["data"]
    lines = exp.header(
        "Learning benchmark: ExSearch warm-up + generalized EM on the synthetic world",
        f"Test: the first {len(splits['test'])} questions of the world's test split, dev: the first "
        f"{len(splits['dev'])} of its dev split (2-3 hops, entities disjoint from training and from each other). "
        f"Greedy decoding, BM25 top-{agent.k} per sub-query, engine {args.engine}. EM / F1 (SQuAD normalisation) "
        "with 95% bootstrap CIs over questions (1000 resamples). Settings are compared on dev only.",
    )
    lines += ["## Test (held out)", "", *stage_table(test, METRICS, models), "", f"Searches per question: {searches}."]
    lines += ["", *difference_table(differences["test"], METRICS), ""]
    lines += [
        "## Dev",
        "",
        *stage_table(evaluations["dev"], METRICS),
        "",
        *difference_table(differences["dev"], METRICS),
    ]
    lines += ["", "## E-step", "", *weight_table(arms), ""]
    lines += [
        f"Warm-up data: {warm_data.get('records')} trajectories "
        + ", ".join(f"{r['source']}: {r['records']} (skipped {r['skipped']})" for r in warm_data.get("sources", [])),
        "",
        "## Settings tried",
        "",
        *trials_table(trials),
        "",
        exp.seconds_line(),
        "",
        *settings_block(trial_settings),
    ]
    exp.write(
        {
            "smoke": args.smoke,
            "settings": trial_settings,
            "evaluations": evaluations,
            "differences": differences,
            "warmup": warm,
            "arms": arms,
            "trials": trials,
        },
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
