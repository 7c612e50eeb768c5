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

s3 (``--method s3``): the starting policy is ``benchmarks/learn_s3.py``'s searcher warm start (``--searcher``; the
one warm start under ``$SLEUTH_HOME/runs/learn-s3`` by default), its frozen generator the AceSearcher SFT model
(``--generator``), sampled as PPO samples (T = 0.6, top-p 0.95, the s3 benchmark's agent) on the dev questions that
s3's filter keeps (naive RAG wrong, no yes/no answer), ``--samples`` episodes each; the reward is Gain Beyond RAG
(on a kept question: the generator's span accuracy on the searcher's documents). PPO samples one episode per
question; the episodes of one question are drawn here to measure how much of the reward's spread lies within a
question (what a group or a value baseline compares). The choice: the world whose share of rewarded episodes is in
the range with the highest within-question variance. Each world's episodes are cached in the world's directory
under ``.../learn-s3/pilot``; the report goes to ``docs/results/world_pilot/s3/``.

    python benchmarks/world_pilot.py --method s3 --questions 48 --samples 4
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

from harness import REPO, Experiment, ModelServer, pct, runs_home, short  # noqa: E402
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
    "two_hop_no_lookalikes": {"max_hops": 2, "lookalike_rate": 0.0},
}
# the worlds each method's pilot samples by default (`--worlds` picks others): one knob moved at a time, and for s3
# (1-3 of 16 PPO episodes rewarded in the base world) also the two easiest together, without few_distractors (an
# open-retrieval searcher's corpus does not depend on the distractors listed per question)
DEFAULT_WORLDS = {
    "acesearcher": ["base", "no_lookalikes", "few_distractors", "no_filler", "no_comparisons", "two_hop"],  # as before
    "s3": ["base", "no_lookalikes", "no_filler", "no_comparisons", "two_hop", "two_hop_no_lookalikes"],
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


def acesearcher_pilot(args: argparse.Namespace) -> None:
    """AceSearcher's pilot (module doc)."""
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


def s3_signal(episodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What PPO would get from one world's sampled episodes (``{"question", "reward", "searches", "written"}``): the
    share of rewarded episodes (``accuracy``, the choice's range), the mean reward, the within-question reward
    statistics (:func:`group_statistics` over each question's episodes), the searching, and the share of episodes in
    which the searcher wrote nothing."""
    by_question: dict[str, list[float]] = {}
    for e in episodes:
        by_question.setdefault(e["question"], []).append(e["reward"])
    n = len(episodes)
    stats = group_statistics(list(by_question.values()))
    return {
        "questions": len(by_question),
        "episodes": n,
        "accuracy": sum(e["reward"] > 0 for e in episodes) / n if n else 0.0,
        "mean_reward": statistics.fmean(e["reward"] for e in episodes) if n else 0.0,
        "questions_rewarded": sum(max(r) > 0 for r in by_question.values()) / len(by_question) if by_question else 0.0,
        **stats,
        "searches": statistics.fmean(e["searches"] for e in episodes) if n else 0.0,
        "no_search": sum(e["searches"] == 0 for e in episodes) / n if n else 0.0,
        "nothing_written": sum(not e["written"] for e in episodes) / n if n else 0.0,
        **gold_given(episodes),
    }


def gold_share(gold: Sequence[str], given: Sequence[str]) -> float | None:
    """The share of ``gold`` passage ids among ``given`` (None without gold)."""
    return len(set(gold) & set(given)) / len(set(gold)) if gold else None


def gold_given(episodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the episodes that recorded it (sampled since the field was added): the mean share of the question's gold
    passages given to the generator, the share of episodes given all of them, and the rewarded share among those
    (the generator's accuracy where the searcher did its part)."""
    known = [e for e in episodes if e.get("gold_given") is not None]
    if not known:
        return {
            "gold_given": None,
            "all_gold_given": None,
            "rewarded_with_all_gold": None,
            "all_gold_by_documents": {},
        }
    complete = [e for e in known if e["gold_given"] == 1.0]
    by_count: dict[str, list[int]] = {}
    for e in complete:  # by the number of documents the generator read, the gold ones included
        by_count.setdefault(str(int(e.get("selected") or 0)), [0, 0])[e["reward"] > 0] += 1
    return {
        "gold_given": statistics.fmean(e["gold_given"] for e in known),
        "all_gold_given": len(complete) / len(known),
        "rewarded_with_all_gold": sum(e["reward"] > 0 for e in complete) / len(complete) if complete else None,
        # documents given -> [not rewarded, rewarded], over the episodes given every gold passage
        "all_gold_by_documents": dict(sorted(by_count.items(), key=lambda kv: int(kv[0]))),
    }


def s3_episodes(
    world: Path, index: str, examples: list[Any], searcher: Any, generator: Any, config: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """s3's training filter on ``examples`` (the naive-RAG accuracy of each cached in the world's directory), then
    ``config.group_size`` episodes of each kept question sampled and rewarded as a PPO step samples and rewards
    them (:func:`sleuth.train.online_rl.rollout_traces`, :class:`sleuth.train.s3_rl.S3Task`)."""
    import asyncio

    from sleuth.retrieval import load_retriever
    from sleuth.train.online_rl import rollout_traces
    from sleuth.train.rewards import NaiveRagCache, filter_training_examples, precompute_naive_rag
    from sleuth.train.s3_rl import S3Task

    retriever = load_retriever(index)
    cache = NaiveRagCache.for_s3(world / "naive_rag_cache.jsonl", generator, config.agent, retriever=index)
    naive = asyncio.run(precompute_naive_rag(examples, retriever, generator, cache, config.agent))
    kept, dropped = filter_training_examples(examples, naive)
    data = {
        "questions": len(examples),
        "kept": len(kept),
        "dropped": dict(dropped),
        "naive_rag_accuracy": sum(naive.values()) / max(len(naive), 1),
    }
    if not kept:
        return [], data
    task = S3Task(config, retriever, generator, cache, None)
    traces = rollout_traces(task, searcher, task.agent_config(config), kept, config, step=0)
    episodes = task.episodes(traces)
    rows = [
        {
            "question": t.example.id,
            "sample": t.example.metadata["rl"]["sample"],
            "reward": e.reward,
            "acc_s3": e.components.get("acc_s3"),
            "searches": e.searches,
            "selected": e.components.get("selected"),
            "error": t.error,
            "written": e.messages is not None,  # the searcher wrote something
            # the share of the question's gold passages among the documents the generator was given
            "gold_given": gold_share(t.example.supporting_ids, t.meta.get("selected_ids") or []),
        }
        for t, e in zip(traces, episodes, strict=True)
    ]
    return rows, data


def s3_pilot(args: argparse.Namespace) -> None:
    """s3's pilot (module doc)."""
    import dataclasses

    from learn_s3 import s3_agent

    from sleuth.data.synth import load_synth
    from sleuth.train.common import auto_engine
    from sleuth.train.s3_rl import S3RLConfig

    args.engine = auto_engine(args.engine)
    work = Path(args.work)
    searcher = Path(args.searcher) if args.searcher else None
    if searcher is None:
        found = sorted(work.glob("warmup-*/model/model.safetensors"))
        if len(found) != 1:
            raise SystemExit(f"{work}: {len(found)} searcher warm starts; name one with --searcher")
        searcher = found[0].parent
    generator_model = Path(args.generator)
    for path in (searcher, generator_model):
        if not (path / "model.safetensors").exists():
            raise SystemExit(f"{path}: no model (run benchmarks/learn_acesearcher.py and benchmarks/learn_s3.py)")
    agent = s3_agent(max_turns=args.max_turns, max_selected=args.max_selected, context_order=args.context_order)
    config = S3RLConfig(
        model=str(searcher),
        output_dir=str(work / "pilot" / "unused"),
        agent=agent,
        group_size=args.samples,
        seed=args.seed,
        episode_tokens="retokenize",  # nothing is trained: no ids recorded
        **({} if args.temperature is None else {"temperature": args.temperature}),
        **({} if args.top_p is None else {"top_p": args.top_p}),
    )
    key = {
        "searcher": str(searcher),
        "generator": str(generator_model),
        "agent": dataclasses.asdict(agent),
        "samples": args.samples,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed": args.seed,
        "questions": args.questions,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]
    exp = Experiment("world_pilot_s3", work / "pilot", Path(args.results))
    rows: dict[str, dict[str, Any]] = {}
    with (
        ModelServer(searcher, args.engine, args.llm_options) as policy,
        ModelServer(generator_model, args.engine, args.llm_options) as generator,
    ):
        for name in args.worlds:
            world, index = make_world(work / "pilot", name, WORLDS[name], args.questions)
            done = world / f"s3-episodes-{digest}.json"
            if not done.exists():  # one file per world and setting: a killed run redoes the world it was in
                dev = list(load_synth(world / "dev.jsonl"))[: args.questions]
                started = time.perf_counter()
                episodes, data = s3_episodes(world, str(index), dev, policy.get(), generator.get(), config)
                failed = [e["error"] for e in episodes if e["error"]]
                if failed:  # an engine failure is not a zero reward: nothing is kept, a rerun samples the world again
                    raise SystemExit(
                        f"s3 pilot, world {name}: {len(failed)} of {len(episodes)} episodes failed "
                        f"(first: {failed[0]}); nothing kept"
                    )
                record = {"key": key, "data": data, "episodes": episodes, "seconds": time.perf_counter() - started}
                done.write_text(json.dumps(record, indent=1) + "\n")
            record = json.loads(done.read_text())
            rows[name] = {"knobs": WORLDS[name], "data": record["data"], **s3_signal(record["episodes"])}
            exp.seconds[name] = record["seconds"]
            print(f"[world_pilot] s3 {name}: {json.dumps(rows[name], default=str)}", flush=True)
    choice = choose_world(rows, args.low, args.high)
    results = {
        "method": "s3",
        "starting_policy": str(searcher),
        "generator": str(generator_model),
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "samples": args.samples},
        "base": BASE,
        "worlds": rows,
        "choice": choice,
    }
    lines = exp.header(
        "World pilot for s3: the warm-start searcher's reward per synthetic world (dev questions)",
        f"The searcher warm start of benchmarks/learn_s3.py (`{short(searcher)}`) sampled as a PPO step samples "
        f"(T = {config.temperature:g}, top-p {config.top_p:g}, the s3 benchmark's agent), {args.samples} episodes "
        f"on each dev question (of the first {args.questions}) that s3's filter keeps, with the frozen generator "
        f"`{short(generator_model)}`; reward Gain Beyond RAG; {args.max_turns} search turns, up to "
        f"{args.max_selected} documents kept a turn, {args.context_order} order. Worlds: `BASE` "
        f"{json.dumps(BASE)} with the knobs shown. Chosen by `choose_world` ({choice['rule']}, accuracy = the "
        "share of rewarded episodes): "
        f"**{choice['world']}**{'' if choice['in_range'] else ' (no world in range: the nearest)'}.",
    )
    lines += [
        "| world | knobs | naive RAG (dev) | kept | episodes rewarded | questions with a reward | "
        "within-question variance / with spread | searches per episode (none) | gold passages given: mean share / "
        "all / rewarded when all |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | `{json.dumps(r['knobs'])}` | {pct(r['data']['naive_rag_accuracy'])} | "
            f"{r['data']['kept']} / {r['data']['questions']} | {pct(r['accuracy'])} | "
            f"{pct(r['questions_rewarded'])} | "
            f"{r['variance'] or 0:.3f} / {pct(r['spread'])} | {r['searches']:.2f} ({pct(r['no_search'])}) | "
            + (
                f"{pct(r['gold_given'])} / {pct(r['all_gold_given'])} / {pct(r['rewarded_with_all_gold'])} |"
                if r.get("gold_given") is not None
                else "not recorded |"
            )
        )
    lines += [
        "",
        "Naive RAG: the generator's span accuracy on the top-3 documents for the question (a question it answers is "
        "dropped by s3's filter, as are yes/no answers); episodes rewarded: the share with Gain Beyond RAG > 0 (on "
        "a kept question, the generator answered from the searcher's documents); within-question: the mean population "
        "variance of one question's episode rewards, and the share of questions whose episodes do not all score "
        "alike; gold passages given: of the question's supporting passages, the share among the documents the "
        "generator answered from, the share of episodes given all of them, and how often those were rewarded (the "
        "generator's part; recorded for worlds sampled after the field was added). The warm start was trained on "
        "the base world's train questions: in another world it meets other entities, as PPO's start there would "
        "after a warm start of that world.",
    ]
    counted = {name: r["all_gold_by_documents"] for name, r in rows.items() if r.get("all_gold_by_documents")}
    if counted:
        # every count seen (fewer than three once the searcher drops initial documents), at least 3 to 9
        seen = {int(n) for counts in counted.values() for n in counts}
        columns = range(min(3, *seen), max(9, *seen) + 1)
        lines += [
            "",
            "Episodes given every gold passage, by the number of documents the generator read (rewarded / all):",
            "",
            "| world | " + " | ".join(f"{n} documents" for n in columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for name, counts in counted.items():
            cells = [f"{c[1]} / {sum(c)}" if (c := counts.get(str(n))) else "–" for n in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Three documents are what the generator reads when no later document was kept beside the initial "
            "top-3 (not the only way to reach three): naive RAG's own context, which every question the filter "
            "kept was missed on; fewer than three, a searcher that dropped initial documents.",
        ]
    exp.write(results, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=sorted(DEFAULT_WORLDS), default="acesearcher")
    parser.add_argument("--questions", type=int, default=24, help="dev questions per world")
    parser.add_argument("--worlds", nargs="+", choices=list(WORLDS), default=None)
    parser.add_argument("--decompositions", type=int, default=3, help="AceSearcher: m, as mDPO samples")
    parser.add_argument("--solutions", type=int, default=4, help="AceSearcher: m', as mDPO samples")
    parser.add_argument("--samples", type=int, default=4, help="s3: episodes per kept question")
    parser.add_argument("--searcher", default="", help="s3: the starting searcher (default: learn_s3's warm start)")
    parser.add_argument(
        "--generator", default=str(runs_home() / "learn-acesearcher" / "sft"), help="s3: the frozen generator"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="s3: the sampling seed (a CPU vLLM server gets none: there it names a draw)",
    )
    parser.add_argument("--max-turns", type=int, default=2, help="s3: the agent's search turns (learn_s3's 2)")
    parser.add_argument(
        "--max-selected", type=int, default=3, help="s3: documents kept a search turn (the paper's prompt: 3)"
    )
    parser.add_argument(
        "--context-order",
        choices=("chronological", "selected_first"),
        default="chronological",
        help="s3: the generator's document order (S3Config.context_order)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="rollout temperature (AceSearcher: 1.0, s3: PPO's 0.6)"
    )
    parser.add_argument("--top-p", type=float, default=None, help="rollout top-p (AceSearcher: 1.0, s3: PPO's 0.95)")
    parser.add_argument("--low", type=float, default=0.2)
    parser.add_argument("--high", type=float, default=0.6)
    learn_arguments(parser, RESULTS)
    args = parser.parse_args()
    args.worlds = args.worlds or DEFAULT_WORLDS[args.method]
    if args.method == "s3":
        if args.work == str(runs_home() / "learn-acesearcher"):
            args.work = str(runs_home() / "learn-s3")
        if args.results == str(RESULTS):
            args.results = str(RESULTS / "s3")
        s3_pilot(args)
    else:
        args.temperature = 1.0 if args.temperature is None else args.temperature
        args.top_p = 1.0 if args.top_p is None else args.top_p
        acesearcher_pilot(args)


if __name__ == "__main__":
    main()
