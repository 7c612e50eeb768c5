"""Which synthetic world gives a method's training signal? A pilot on dev (issue 36 item 2).

Preference and RL training learn only from groups whose sampled runs differ in reward: a world where the starting
policy almost never (or almost always) succeeds gives ties and no pairs, whatever the trainer. This pilot samples the
starting policy on the dev questions of several worlds, each a named setting of the generator's difficulty knobs
(``SynthConfig``: hops, comparison share, distractors, lookalike names, filler sentences per passage), and measures
per world what the trainer would get: the sampled accuracy (EM of the runs) and the within-group reward variance.
:func:`choose_world` then picks, in code, the world whose accuracy is in the informative range (20-60% by default)
with the highest within-group variance; the choice and every world's numbers go to the report.

AceSearcher's starting policy is the SFT model of ``benchmarks/learn_acesearcher.py`` (its stage under
``$SLEUTH_HOME/runs/learn-acesearcher``), sampled as mDPO's iteration 1 samples (m decompositions per question, m'
solver runs per decomposition, T = 1.0 unless ``--temperature``); the groups are mDPO's: the m' runs of one
decomposition (whose spread gives the sub-answer and final pairs) and the m decompositions of one question (by mean
reward: the decomposition pairs).

    python benchmarks/world_pilot.py --questions 24

Worlds, indexes and rollouts are cached under ``.../learn-acesearcher/pilot`` (a killed run resumes by rollout key);
the report goes to ``docs/results/world_pilot/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Experiment, ModelServer, pct  # noqa: E402
from noise_floor import default_agent, learn_arguments  # noqa: E402

RESULTS = REPO / "docs" / "results" / "world_pilot"
# the learning benchmarks' world (benchmarks/learn_acesearcher.py: 2-3 hops, the generator's other defaults)
BASE = {"seed": 0, "min_hops": 2, "max_hops": 3, "train_questions": 20, "test_questions": 20}
# one knob moved at a time from the base, each in the direction the reviews suspected of starving the reward
WORLDS: dict[str, dict[str, Any]] = {
    "base": {},
    "no_lookalikes": {"lookalike_rate": 0.0},
    "few_distractors": {"distractors": 2},
    "no_filler": {"filler_sentences": 0},
    "no_comparisons": {"comparison_fraction": 0.0},
    "two_hop": {"max_hops": 2},
}

NOTES = {
    "few_distractors": "`distractors` only lists distractor documents per question (the context of ARENA-style "
    "readers); an open-retrieval world's corpus is the same, so for AceSearcher the few_distractors world is the base "
    "world with other questions drawn: its distance from the base row is the pilot's sampling noise.",
}


def group_statistics(groups: Sequence[Sequence[float]]) -> dict[str, float | int | None]:
    """Over groups of rewards (one group: the runs a trainer compares): the mean population variance within a group,
    the share of groups whose rewards are not all equal (a tie gives no pair and no advantage), and the number of
    groups with at least two rewards."""
    usable = [list(g) for g in groups if len(g) >= 2]
    if not usable:
        return {"groups": 0, "variance": None, "spread": None}
    return {
        "groups": len(usable),
        "variance": statistics.fmean(statistics.pvariance(g) for g in usable),
        "spread": sum(max(g) > min(g) for g in usable) / len(usable),
    }


def choose_world(
    rows: dict[str, dict[str, Any]], low: float = 0.2, high: float = 0.6, key: str = "variance"
) -> dict[str, Any]:
    """The pilot's rule: among the worlds whose ``accuracy`` is in ``[low, high]``, the one with the highest ``key``
    (ties: the first listed). When none is in range, the one whose accuracy is nearest the range (then by ``key``),
    and ``in_range`` says so."""
    if not rows:
        raise ValueError("no world measured")

    def distance(row: dict[str, Any]) -> float:
        accuracy = row["accuracy"]
        return 0.0 if low <= accuracy <= high else min(abs(accuracy - low), abs(accuracy - high))

    order = list(rows)
    best = min(order, key=lambda name: (distance(rows[name]), -(rows[name].get(key) or 0.0), order.index(name)))
    return {
        "world": best,
        "in_range": distance(rows[best]) == 0.0,
        "rule": f"accuracy in [{low}, {high}], then the highest {key}",
    }


def acesearcher_signal(rollouts: Sequence[Any]) -> dict[str, Any]:
    """What mDPO would get from one world's sampled runs: sampled accuracy (mean EM of the finished runs), the
    solver groups' and the decomposition groups' reward statistics (:func:`group_statistics`), and the pairs
    ``build_pairs`` makes (per set, and per question)."""
    from sleuth.train.mdpo import MDPOConfig, build_pairs, trajectories

    by_question = trajectories(rollouts)
    solver: list[list[float]] = []
    decompositions: list[list[float]] = []
    for runs in by_question.values():
        groups: dict[int, list[float]] = {}
        for t in runs:
            if not t.failed:
                groups.setdefault(t.decomposition, []).append(t.reward)
        solver += list(groups.values())
        decompositions.append([statistics.fmean(g) for g in groups.values() if g])
    _, stats = build_pairs(rollouts, MDPOConfig())
    questions = len(by_question)
    return {
        "questions": questions,
        "runs": stats["trajectories"],
        "accuracy": stats["em"] or 0.0,
        "mean_reward": stats["mean_reward"],
        "format_valid": stats["format_valid"],
        **{f"solver_{k}": v for k, v in group_statistics(solver).items()},
        **{f"decomposition_{k}": v for k, v in group_statistics(decompositions).items()},
        "variance": group_statistics(solver)["variance"],  # the choice's key: the sub-answer / final pairs' source
        "pairs": stats["pairs"],
        "pairs_per_question": stats["pairs"]["total"] / questions if questions else 0.0,
    }


def make_world(root: Path, name: str, knobs: dict[str, Any], questions: int) -> tuple[Path, Path]:
    """The world ``name`` (``BASE`` + ``knobs``, ``questions`` dev questions) and its BM25 index, built once."""
    from sleuth.data.synth import synthesize
    from sleuth.retrieval.bm25 import build_bm25_index

    settings = {**BASE, **knobs, "dev_questions": questions}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    world = root / f"{name}-{digest}"
    if not (world / "world.json").exists():
        synthesize(world, **settings)
    index = world / "index"
    if not (index / "DONE").exists():
        build_bm25_index(world / "corpus.jsonl", index)
        (index / "DONE").write_text("")
    return world, index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=24, help="dev questions per world")
    parser.add_argument("--worlds", nargs="+", choices=list(WORLDS), default=list(WORLDS))
    parser.add_argument("--decompositions", type=int, default=3, help="m, as mDPO samples")
    parser.add_argument("--solutions", type=int, default=4, help="m', as mDPO samples")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (paper 1.0, code 0.7)")
    parser.add_argument("--top-p", type=float, default=1.0, help="rollout top-p (paper none, code 0.99)")
    parser.add_argument("--low", type=float, default=0.2)
    parser.add_argument("--high", type=float, default=0.6)
    learn_arguments(parser, RESULTS)
    args = parser.parse_args()
    from sleuth.agents import Context
    from sleuth.data.synth import load_synth
    from sleuth.retrieval import load_retriever
    from sleuth.train.common import auto_engine, with_sampling
    from sleuth.train.mdpo import METHOD, pending_rollouts, sample_rollouts
    from sleuth.train.rollouts import RolloutStore, rollout_producer

    args.engine = auto_engine(args.engine)
    work = Path(args.work)
    sft = work / "sft"
    if not (sft / "model.safetensors").exists():
        raise SystemExit(f"{work}: no SFT model; run benchmarks/learn_acesearcher.py first")
    # mDPO's rollout agent: the evaluation agent at the rollout temperature (the paper's 1.0 by default)
    agent = with_sampling(default_agent(), args.temperature, args.top_p)
    producer = rollout_producer(
        METHOD, agent, sft, 1, decompositions=args.decompositions, solutions=args.solutions, seed=0
    )
    exp = Experiment("world_pilot", work / "pilot", Path(args.results))
    rows: dict[str, dict[str, Any]] = {}
    with ModelServer(sft, args.engine, args.llm_options) as server:
        for name in args.worlds:
            world, index = make_world(work / "pilot", name, WORLDS[name], args.questions)
            dev = list(load_synth(world / "dev.jsonl"))[: args.questions]
            sampler = f"m{args.decompositions}-n{args.solutions}"
            if (args.temperature, args.top_p) != (1.0, 1.0):  # the paper's sampler keeps its first runs' name
                sampler += f"-t{args.temperature:g}-p{args.top_p:g}"
            store = RolloutStore(world / f"rollouts-{sampler}", producer=producer)
            # the sampling seconds of every run that sampled into this store (a rerun starts no engine)
            timing = store.path / "sampling_seconds.json"
            spent = json.loads(timing.read_text()) if timing.exists() else 0.0
            if pending_rollouts(dev, store, args.decompositions, args.solutions):
                started = time.perf_counter()
                context = Context(llm=server.get(), retriever=load_retriever(str(index)), config=agent)
                sample_rollouts(dev, context, store, args.decompositions, args.solutions, progress=True)
                spent += time.perf_counter() - started
                timing.write_text(json.dumps(spent))
            rows[name] = {"knobs": WORLDS[name], **acesearcher_signal(list(store))}
            exp.seconds[name] = spent
            print(f"[world_pilot] {name}: {json.dumps(rows[name], default=str)}", flush=True)
    choice = choose_world(rows, args.low, args.high)
    results = {
        "method": "acesearcher",
        "starting_policy": str(sft),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "base": BASE,
        "worlds": rows,
        "choice": choice,
    }
    lines = exp.header(
        "World pilot: the starting policy's training signal per synthetic world (dev questions)",
        f"AceSearcher's SFT model sampled as mDPO's iteration 1 samples (m = {args.decompositions}, "
        f"m' = {args.solutions}, T = {args.temperature:g}, top-p {args.top_p:g}) on {args.questions} dev questions "
        "of each world: `BASE` "
        f"{json.dumps(BASE)} with one knob moved. Chosen by `choose_world` ({choice['rule']}): "
        f"**{choice['world']}**{'' if choice['in_range'] else ' (no world in range: the nearest)'}.",
    )
    lines += [
        "| world | knobs | sampled EM | mean reward | solver groups: variance / with spread | "
        "decompositions: variance / with spread | pairs (decompose / subq / final) per question |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for name, r in rows.items():
        p = r["pairs"]
        lines.append(
            f"| {name} | `{json.dumps(r['knobs'])}` | {pct(r['accuracy'])} | {pct(r['mean_reward'])} | "
            f"{r['solver_variance'] or 0:.3f} / {pct(r['solver_spread'])} | "
            f"{r['decomposition_variance'] or 0:.3f} / {pct(r['decomposition_spread'])} | "
            f"{p['decompose']} / {p['subq']} / {p['final']} ({r['pairs_per_question']:.2f}) |"
        )
    lines += [
        "",
        "Sampled EM: the mean EM of all m x m' runs; solver groups: the m' runs of one decomposition (their spread "
        "gives the sub-answer and final pairs); decompositions: the m decompositions of one question by mean reward "
        "(the decomposition pairs); variance: the mean population variance of the rewards within a group; with "
        "spread: the share of groups whose rewards are not all equal (a tie gives no pair).",
    ]
    caveats = [NOTES[name] for name in rows if name in NOTES]
    lines += ["", "Caveats: " + " ".join(caveats)] if caveats else []
    exp.write(results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
