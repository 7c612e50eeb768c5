"""Does s3's RL teach a small searcher to find what a frozen generator needs? Generator accuracy with the
searcher's documents vs with naive RAG (top-3 for the question), before and after training, on held-out synthetic
multi-hop questions, with bootstrap CIs.

The searcher is SmolLM2-135M-Instruct (LoRA off: full fine-tuning of the 135M model), the frozen generator is the
same base model loaded separately (it never changes). Training: ``sleuth.train.s3_rl`` (PPO with a value head, KL
in the reward, Gain Beyond RAG; the paper's filter drops questions naive RAG already answers) on the world's train
split. Accuracy is s3's GenAcc span check (normalised gold contained in the answer), no judge.

Two evaluation splits of the world, with entities disjoint from training and from each other: ``dev`` (the first
``--dev-questions`` of the world's dev split), on which settings are compared and every setting tried is listed
(``trials.json`` in the results directory), and ``test`` (the first ``--test-questions`` of its test split), which
is reported and never used to choose anything. Stages, caching and the report come from ``benchmarks/harness.py``:
a rerun resumes; each PPO setting (``--steps``, ``--prompts``, ``--lr``, ``--critic-lr``) trains into its own
directory next to the others, while a changed setting of the world is an error naming the files to remove (results
of two settings are never mixed). A PPO setting that differs from another only in ``--steps`` starts from that
run's furthest checkpoint at or below its own step count (:func:`harness.continue_online_rl`): ``--steps 8`` after
``--steps 2`` trains 6 new steps.

Searcher warm start (a deviation, off by default: ``--searcher-warmup 0`` runs PPO from the base searcher, as the
paper does). The untrained 135M searcher never finds the second hop of these 2-3-hop questions (it beat naive RAG
on 0 of 200 held-out questions, 0.12 searches per question), so every PPO episode scored Gain Beyond RAG 0 and PPO
learned nothing. With ``--searcher-warmup N`` the searcher is first fine-tuned (all weights, ``--searcher-warmup-lr``,
``--searcher-warmup-epochs``) on N gold searcher transcripts of questions from the second half of the world's train
split (:func:`sleuth.train.s3_rl.searcher_warmup_records`: the gold sub-questions, their ``#k`` resolved, as the
queries, the real retrieval results as observations, the gold passages shown as ``<important_info>``, then
``<search_complete>True``; replayed through the real agent; observations and prompt masked out of the loss), and PPO
then trains from that model on the first half only, so the two never share a question. Evaluated as its own stage,
so "s3 after - s3 warm start" is what PPO added; the report gives the transcripts built and the questions skipped
and why. Each warm-start setting trains into its own directory next to the others.

World (``--world``): the benchmark's world has 2-3 hops and the generator's other defaults; ``--world NAME`` moves
the knobs of ``benchmarks/world_pilot.py``'s world NAME, ``--world pilot`` those of the world its s3 pilot chose on
dev (``docs/results/world_pilot/s3``: the share of the warm start's PPO episodes rewarded in 20-60%, then the most
within-question spread). Such a run keeps its stages in ``RUNS/learn-s3-world-NAME`` and reports to
``docs/results/learn_s3/world-NAME``.

    python benchmarks/learn_s3.py            # CPU: expect over an hour at the defaults (see docs)
    python benchmarks/learn_s3.py --smoke    # tiny random searcher, a few questions, 1 step
    python benchmarks/learn_s3.py --full --generator MODEL   # sized for a GPU (FULL below; runs/learn-s3-full)

``--engine`` runs the frozen generator (one server for the whole run) and the searcher's evaluations on ``hf`` or on
vLLM servers sleuth starts (``vllm``, or a ``vllm:{model}?...`` template); ``auto`` (the default) is ``vllm`` when
vLLM is installed (``make vllm``), else ``hf``, and ``hf`` with ``--smoke``. The PPO rollouts sample from the live
searcher: a vLLM rollout server reloads LoRA adapters, and this benchmark fine-tunes all weights. The engine and
``--llm-options`` say how a stage is computed, not what: they are not part of the stages' keys. On a GPU the
generator's server and an evaluation's server run at once and share its memory (``SLEUTH_VLLM_GPU_SERVERS=2``
unless set: 0.45 each, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402  (the benchmarks directory is not a package)
    REPO,
    Experiment,
    base_model,
    continue_online_rl,
    difference_table,
    online_rl_result,
    parse_sized,
    plot,
    rollout_steps,
    run_dirs,
    runs_home,
    settings_block,
    short,
    stage_table,
    step_table,
    trials_table,
)

RESULTS = REPO / "docs" / "results" / "learn_s3"
# The claims this benchmark is run to test, on the test split: harness.claims gives each the one-sided exact test
# (results.json "claims", results.md "Claims"; benchmarks/recompute_claims.py redoes them from committed results)
CLAIMS = [
    {"name": "after PPO > warm start", "metric": "genacc", "before": "warm start", "after": "ppo"},
    {"name": "after PPO > base searcher", "metric": "genacc", "before": "base", "after": "ppo"},
    # Gain Beyond RAG: the same generator's accuracy on naive RAG's passages, recorded with each evaluation
    {
        "name": "after PPO > naive RAG",
        "metric": "genacc",
        "before": "ppo",
        "before_metric": "genacc_naive",
        "after": "ppo",
    },
]


# --full, for a GPU: the paper's 120 questions a step, 30 steps (3,600 episodes, 37x the CPU run's 96), a world with
# 4,000 train questions, 200 test and 200 dev questions, and the searcher warm start on 256 gold transcripts (the
# base 135M searcher scores 0 on every episode: training.md, s3 RL)
FULL = {
    "test_questions": 200,
    "dev_questions": 200,
    "train_questions": 4000,
    "steps": 30,
    "prompts": 120,
    "searcher_warmup": 256,
}


# The reported run's PPO settings, where S3RLConfig now follows veRL (f8851ad, after that run): a value head that
# starts at zero instead of N(0, 0.02), the token mean over a mini-batch instead of the mean of per-episode means, no
# weight decay instead of 0.01. With veRL's three the 135M searcher collapses to stopping at once after one update
# (docs/results/learn_s3/collapse); with these the retrained run reproduces the reported one's steps exactly.
REPORTED_RL: dict[str, Any] = {
    "micro_batch_aggregation": "mini_batch_mean",
    "value_head_init": "zeros",
    "weight_decay": 0,
}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, grouped by the stage that reads it (a group is that stage's part of its key).
    ``--smoke`` fixes the sizes but keeps the learning rates and the seed given (to try resumption)."""
    world: dict[str, Any] = {"seed": args.seed, "min_hops": 2, "max_hops": 3, **world_knobs(args.world)}
    # micro_batch 1: at 2 the first PPO update (actor, reference and separate critic, full fine-tuning, episodes of
    # 1.0-1.5k tokens) reached 17 GB resident next to the generator's server and was killed for memory (24 GiB here)
    ppo = {"lr": args.lr, "critic_lr": args.critic_lr, "mini_batches": 2, "micro_batch": 1, "save_steps": 2}
    # the benchmark's PPO settings over S3RLConfig's (REPORTED_RL), then the command line's (--rl KEY=VALUE); always
    # keyed, so a stage trained under other defaults is never read back as this one
    ppo["rl"] = dict(sorted({**REPORTED_RL, **parse_rl_overrides(args.rl or [])}.items()))
    if args.smoke:
        world.update(train_entities=60, dev_entities=30, test_entities=30)
        world.update(train_questions=12, dev_questions=2, test_questions=3)
        return {
            "world": world,
            "eval": {
                "dev_questions": min(args.dev_questions, 2),
                "test_questions": 3,
                "tokens": 12,
                "generator_tokens": 24,
            },
            "ppo": {"steps": 1, "prompts": 2, **ppo},
            **warmup_settings(args, world),
        }
    # pools the evaluations take their first questions from: --dev/--test-questions up to 200 keep the world
    world.update(train_questions=args.train_questions)
    world.update(dev_questions=max(200, args.dev_questions), test_questions=max(200, args.test_questions))
    return {
        "world": world,
        "eval": {
            "dev_questions": args.dev_questions,
            "test_questions": args.test_questions,
            "tokens": 96,
            "generator_tokens": 24,
        },
        "ppo": {"steps": args.steps, "prompts": args.prompts, **ppo},
        **warmup_settings(args, world),
    }


def world_knobs(name: str) -> dict[str, Any]:
    """The synthetic world's knobs over the benchmark's own (2-3 hops, the generator's defaults): none for ``""``,
    else those of ``benchmarks/world_pilot.py``'s world ``name`` (:func:`resolve_world` first)."""
    from world_pilot import WORLDS

    if name and name not in WORLDS:
        raise SystemExit(f"--world {name!r}: expected pilot or one of {', '.join(WORLDS)}")
    return dict(WORLDS[name]) if name else {}


def resolve_world(name: str) -> str:
    """``pilot``: the world the s3 pilot chose on dev, read from its committed results (the choice is the pilot's
    rule, in code, not this run's); any other name as given."""
    if name != "pilot":
        return name
    from world_pilot import RESULTS as PILOT

    found = PILOT / "s3" / "results.json"
    if not found.exists():
        raise SystemExit(f"--world pilot: {found} is missing; run benchmarks/world_pilot.py --method s3")
    return str(json.loads(found.read_text())["choice"]["world"])


def parse_rl_overrides(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs for S3RLConfig fields, each value read as JSON when it parses (numbers, booleans), else
    as a string; an unknown field is refused."""
    from sleuth.train.s3_rl import S3RLConfig

    fields = {f.name for f in dataclasses.fields(S3RLConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--rl {item!r}: expected KEY=VALUE with KEY a field of S3RLConfig")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def warmup_settings(args: argparse.Namespace, world: dict[str, Any]) -> dict[str, Any]:
    """The warm start's group of settings, absent without a warm start (so the other stages' keys and the trial of
    a run without one are unchanged): N transcripts (at most 4 with ``--smoke``) from the train questions after the
    first half (``after``), which PPO then trains on alone."""
    if args.searcher_warmup <= 0:
        return {}
    questions = min(args.searcher_warmup, 4) if args.smoke else args.searcher_warmup
    warmup = {"questions": questions, "lr": args.searcher_warmup_lr, "epochs": args.searcher_warmup_epochs}
    # the transcripts' first search reply is the query alone (sleuth.train.s3_rl.gold_reply): a warm start cached
    # with "<search_complete>False" before it is another setting
    warmup["first_reply"] = "query"
    warmup["token_reduction"] = "sum"  # each searcher token weighs the same (warm_start_searcher)
    if args.searcher_warmup_searching_only:  # only when set, so runs from before the option keep their key
        warmup["searching_only"] = True
    if args.searcher_warmup_initial != "whole":  # likewise
        warmup["initial"] = args.searcher_warmup_initial
    return {"warmup": {**warmup, "batch": 8, "micro_batch": 1, "after": world["train_questions"] // 2}}


def warm_start(
    base: Path, world: Path, index: str, agent: Any, w: dict[str, Any], out: Path, seed: int
) -> dict[str, Any]:
    """Gold searcher transcripts of the train questions after the first ``w["after"]`` (the first ``w["questions"]``
    that can be built), then full fine-tuning of ``base`` on them into ``out/model``; the transcripts in
    ``out/records.jsonl`` and their summary (questions examined up to the last one used, skipped by reason, hops)
    in ``out/data_summary.json``. A killed run resumes (the data is rebuilt, deterministically; training resumes
    from its checkpoints)."""
    from transformers import AutoTokenizer

    from sleuth.data.synth import load_synth
    from sleuth.retrieval import load_retriever
    from sleuth.train.s3_rl import searcher_warmup_records, warm_start_searcher

    tokenizer = AutoTokenizer.from_pretrained(base)  # the observation cap counts the searcher's tokens
    retriever = load_retriever(index)
    pool = list(load_synth(world / "train.jsonl"))[w["after"] :]
    only, initial = bool(w.get("searching_only")), w.get("initial", "whole")
    records, summary = searcher_warmup_records(pool, retriever, agent, tokenizer, only, initial)
    if len(records) > w["questions"]:  # the data is the first N transcripts: summarise the questions up to the last
        last = next(i for i, e in enumerate(pool) if e.id == records[w["questions"] - 1]["id"])
        records, summary = searcher_warmup_records(pool[: last + 1], retriever, agent, tokenizer, only, initial)
    if not records:
        raise SystemExit(f"searcher warm start: no gold transcript could be built ({summary})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "data_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    stats = warm_start_searcher(
        records,
        base,
        out,
        w["lr"],
        w["epochs"],
        batch_size=w["batch"],
        per_device_batch_size=w["micro_batch"],
        seed=seed,
        token_reduction=w.get("token_reduction", "mean"),
    )
    return {"dir": str(out), "model": str(out / "model"), "data": summary, "train": stats}


def evaluate(
    searcher: Path,
    generator: Any,
    examples: list[Any],
    index: str,
    agent: Any,
    opts: str,
    engine: str,
    llm: Any = None,
) -> dict[str, Any]:
    """Greedy s3 on ``examples``: per-question GenAcc (span) with the searcher's documents (``genacc``) and with
    naive RAG's top-k (``genacc_naive``: the same generator and prompt on the documents retrieved for the question
    itself). ``llm``: the searcher's LLM already open (kept open), else one is opened on ``searcher`` and closed."""
    import asyncio
    from types import SimpleNamespace

    from sleuth.agents import Context
    from sleuth.eval.metrics import accuracy
    from sleuth.llm import load_llm
    from sleuth.records import Passage
    from sleuth.retrieval import load_retriever
    from sleuth.runner import run
    from sleuth.train.common import close_llm, engine_spec
    from sleuth.train.rewards import generator_accuracy

    owned = llm is None
    if owned:
        llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=opts), searcher))
    ctx = Context(llm=llm, retriever=load_retriever(index), config=agent, roles={"generator": generator})
    try:
        traces = run("s3", examples, ctx, progress=True)
    finally:
        if owned:
            close_llm(llm)

    async def naive_accuracy() -> list[float]:
        async def one(trace: Any) -> float:
            docs = [Passage.from_dict(p) for p in trace.meta.get("naive_rag_passages") or []]
            question = trace.meta.get("generator_question") or trace.example.question
            acc, _ = await generator_accuracy(question, docs, trace.example.answers, generator, agent, None, "span")
            return acc

        return list(await asyncio.gather(*(one(t) for t in traces)))

    return {
        "per_example": {
            "genacc": [float(accuracy(t.answer or "", t.example.answers)) for t in traces],
            "genacc_naive": asyncio.run(naive_accuracy()),
        },
        "searches": [max(len(t.meta.get("rounds") or []) - 1, 0) for t in traces],
        "selected": [len(t.meta.get("selected_ids") or []) for t in traces],
        "model": str(searcher),
        "engine": engine,
    }


def gold_accuracy(generator: Any, examples: list[Any], world: Path, agent: Any) -> dict[str, Any]:
    """The frozen generator's GenAcc with each question's gold supporting passages: the ceiling a searcher could
    reach (as ``benchmarks/s3_signal.py`` measures it)."""
    from s3_signal import passages_by_id, score

    corpus = passages_by_id(world / "corpus.jsonl")
    gold = [[corpus[i] for i in e.supporting_ids if i in corpus] for e in examples]
    scored = score(generator, examples, gold, agent)
    return {"per_example": {"genacc": scored["per_example"]["acc"]}, "answers": scored["answers"]}


def contexts(
    before: dict[str, Any],
    after: dict[str, Any] | None,
    gold: dict[str, Any] | None = None,
    warm: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """The generator's accuracy per context, as harness evaluations of one metric ``genacc``: the gold passages
    (the ceiling), naive RAG (from the evaluation before training: it does not depend on the searcher), the
    searcher before training, after the warm start (when there is one) and after PPO."""

    def view(e: dict[str, Any], metric: str) -> dict[str, Any]:
        return {**e, "per_example": {"genacc": e["per_example"][metric]}, "ci": {"genacc": e["ci"][metric]}}

    views = {"gold passages": view(gold, "genacc")} if gold is not None else {}
    views |= {"naive RAG": view(before, "genacc_naive"), "s3 before": view(before, "genacc")}
    if warm is not None:
        views["s3 warm start"] = view(warm, "genacc")
    if after is not None:
        views["s3 after"] = view(after, "genacc")
    return views


def warm_summary(warm: dict[str, Any], w: dict[str, Any]) -> str:
    """The warm start's data (transcripts built, questions skipped and why, searches and hops) and training, as
    one paragraph of the report."""
    data, train = warm["data"], warm["train"]
    skipped = ", ".join(f"{reason} {n}" for reason, n in data["skipped"].items()) or "none"
    searches = ", ".join(
        f"{count} with {n} search{'' if n == '1' else 'es'}" for n, count in data["searches_per_record"].items()
    )
    hops = data["hops"]
    losses = f"loss {train['first_loss']:.3f} -> {train['last_loss']:.3f}" if train.get("first_loss") else "no loss"
    return (
        f"A deviation from the paper (PPO then starts from this model, on the first {w['after']} train questions "
        f"only). {data['records']} gold searcher transcripts built from train questions "
        f"{w['after'] + 1} to {w['after'] + data['questions']} (skipped: {skipped}): {searches}. Of "
        f"their {hops['hops']} retrieval hops, {hops['hops_in_initial']} were in the initial naive-RAG documents, "
        f"{hops['hops_queried']} were queried with the gold sub-question ({hops['gold_retrieved']} of these found "
        f"their gold passage) and {hops['hops_beyond_max_turns']} were left beyond the turn limit. "
        + (
            "The first reply selects the initial documents' gold ones (`--searcher-warmup-initial gold`, a deviation: "
            "the code's searchers keep them whole). "
            if w.get("initial") == "gold"
            else ""
        )
        + f"Full fine-tuning "
        f"on {train['trained']} of them: {w['epochs']:g} epochs, lr {w['lr']:g}, {train['steps']} steps, {losses}, "
        f"{train['seconds']:.0f} s."
    )


def s3_agent(
    tokens: int = 96,
    generator_tokens: int = 24,
    max_turns: int = 2,
    max_selected: int = 3,
    context_order: str = "chronological",
) -> Any:
    """The benchmark's s3 agent: three documents a search and at the start, ``max_turns`` search turns (the paper's
    code 3, here 2 for CPU time), ``tokens`` a searcher turn and ``generator_tokens`` for the generator's answer
    (both greedy; PPO sets its own sampling). ``max_selected`` (documents kept a turn, the prompt's 3) and
    ``context_order`` are S3Config's; the s3 pilot varies them."""
    from sleuth.agents.s3 import S3Config
    from sleuth.llm import Sampling

    agent = S3Config(
        k=3,
        k_initial=3,
        max_turns=max_turns,
        max_selected=max_selected,
        context_order=context_order,
        sampling=Sampling(max_new_tokens=tokens),
    )
    agent.generator_sampling = dataclasses.replace(agent.generator_sampling, max_new_tokens=generator_tokens)
    return agent


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default $SLEUTH_HOME/runs/learn-s3)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--test-questions", type=int, default=100, help="held-out questions reported (test split)")
    parser.add_argument(
        "--dev-questions", type=int, default=100, help="questions settings are compared on (0: no dev split)"
    )
    parser.add_argument("--train-questions", type=int, default=400, help="before the naive-RAG filter")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16, help="questions per step (paper: 120)")
    parser.add_argument("--lr", type=float, default=1e-5, help="actor (paper: 1e-6 for 7B)")
    parser.add_argument("--critic-lr", type=float, default=1e-4, help="value head (paper: 1e-5)")
    parser.add_argument(
        "--searcher-warmup",
        type=int,
        default=0,
        help="gold searcher transcripts to fine-tune on before PPO (0: none, as the paper)",
    )
    parser.add_argument(
        "--searcher-warmup-lr", type=float, default=1e-4, help="full fine-tuning rate of the warm start"
    )
    parser.add_argument("--searcher-warmup-epochs", type=float, default=2.0, help="epochs of the warm start")
    parser.add_argument(
        "--searcher-warmup-searching-only",
        action="store_true",
        help="warm start on transcripts that search at least once (questions whose gold passages are all in the "
        "initial documents are skipped): the searcher learns to search, PPO when to stop",
    )
    parser.add_argument(
        "--searcher-warmup-initial",
        choices=("whole", "gold"),
        default="whole",
        help="the gold transcripts' first reply: keeps the initial documents whole (the code's searchers) or selects "
        "their gold ones like any block's (a deviation: the searcher learns to drop naive RAG's other documents)",
    )
    parser.add_argument(
        "--rl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an S3RLConfig field for PPO (repeatable), over REPORTED_RL (the reported run's), e.g. "
        "value_head_init=normal; part of the PPO stage's key",
    )
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--world",
        default="",
        help="a world of benchmarks/world_pilot.py (its knobs over this benchmark's 2-3 hops), or pilot: the one its "
        "s3 pilot chose on dev; runs in RUNS/learn-s3-world-NAME, reports to docs/results/learn_s3/world-NAME",
    )
    parser.add_argument(
        "--generator",
        default="",
        help="the frozen generator's model directory (default: SmolLM2-135M-Instruct); choose it with "
        "benchmarks/s3_signal.py",
    )
    parser.add_argument(
        "--engine",
        default="auto",
        help="generator and evaluations: hf, vllm, a 'vllm:{model}?...' template, or auto: vllm when installed "
        "(hf with --smoke)",
    )
    args = parse_sized(parser, FULL)
    from sleuth.train.common import auto_engine, close_llm, engine_spec

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    print(f"engine: {args.engine}", flush=True)
    if args.engine != "hf":
        # the generator's server stays up while each searcher evaluation starts one of its own: on a GPU the two
        # share its memory (0.45 each, sleuth.llm.vllm_server) instead of the second finding vLLM's 0.9 taken
        os.environ.setdefault("SLEUTH_VLLM_GPU_SERVERS", "2")

    from sleuth.assets import ensure_default_model
    from sleuth.data.synth import load_synth
    from sleuth.llm import load_llm
    from sleuth.train.s3_rl import S3RLConfig, train_s3

    args.world = resolve_world(args.world)
    s = settings(args)
    if args.world and not args.smoke:  # another world: its own stages and report (a work dir holds one world)
        args.work = args.work or runs_home() / f"learn-s3-world-{args.world}"
        args.results = args.results or RESULTS / f"world-{args.world}"
    work, results = run_dirs("learn_s3", args, RESULTS)
    exp = Experiment("learn_s3", work, results, args.seed, claims=CLAIMS)
    searcher = base_model(args.smoke, exp.work)
    # frozen: never trained. benchmarks/s3_signal.py measures a candidate's ceiling (gold passages) - naive RAG gap
    generator_model = Path(args.generator) if args.generator else ensure_default_model()
    held: dict[str, Any] = {}
    warm: dict[str, Any] | None = None

    def generator() -> Any:
        """The frozen generator, loaded on first use (a fully cached rerun never loads it)."""
        if "llm" not in held:
            held["llm"] = load_llm(engine_spec(args, generator_model))
        return held["llm"]

    agent = s3_agent(s["eval"]["tokens"], s["eval"]["generator_tokens"])
    agent_key = dataclasses.asdict(agent)

    world, index = exp.synthetic_world(s["world"])
    splits = {}
    for split in ("dev", "test"):  # --dev-questions 0: no dev split (a run that compares no settings)
        if s["eval"][f"{split}_questions"] or split == "test":
            splits[split] = list(load_synth(world / f"{split}.jsonl"))[: s["eval"][f"{split}_questions"]]
    evaluations: dict[str, dict[str, dict[str, Any]]] = {split: {} for split in splits}
    ceilings: dict[str, dict[str, Any]] = {}

    def measure(stage: str, model: Path) -> None:
        for split, examples in splits.items():
            key = {"searcher": str(model), "generator": str(generator_model), "questions": len(examples)}
            evaluations[split][stage] = exp.evaluate(
                stage,
                split,
                {**key, "agent": agent_key},
                lambda examples=examples: evaluate(
                    model, generator(), examples, index, agent, args.llm_options, args.engine
                ),
            )

    try:
        for split, examples in splits.items():
            key = {"generator": str(generator_model), "questions": len(examples), "world": s["world"]}
            ceilings[split] = exp.evaluate(
                "gold",
                split,
                {**key, "agent": agent_key},
                lambda examples=examples: gold_accuracy(generator(), examples, world, agent),
            )
        measure("base", searcher)
        start = searcher  # PPO's initial searcher: the base model, or the warm start's
        if "warmup" in s:
            w = s["warmup"]
            warm_key = {
                "world": str(world),
                "searcher": str(searcher),
                "warmup": w,
                "agent": agent_key,
                "seed": args.seed,
            }
            warm_dir = exp.stage_dir("warmup", warm_key)
            # one stage and directory per warm-start setting, side by side like the PPO settings
            warm = exp.stage(
                warm_dir.name,
                warm_key,
                lambda: warm_start(searcher, world, index, agent, w, warm_dir, args.seed),
            )
            start = Path(warm["model"])
            measure("warm start", start)
        ppo_key = {
            "world": str(world),
            "searcher": str(start),
            "generator": str(generator_model),
            "ppo": s["ppo"],
            "agent": agent_key,
            "seed": args.seed,
        }
        if warm is not None:  # PPO keeps to the train questions before the warm start's
            ppo_key["train_limit"] = s["warmup"]["after"]

        def train() -> dict[str, Any]:
            out = exp.stage_dir("ppo", ppo_key)
            p = s["ppo"]
            continued = continue_online_rl(exp, out, ppo_key, "ppo")
            config = S3RLConfig(
                model=str(start),
                output_dir=str(out),
                data_dir=str(world),
                index=index,
                steps=p["steps"],
                prompts_per_step=p["prompts"],
                mini_batches=p["mini_batches"],
                micro_batch=p["micro_batch"],
                learning_rate=p["lr"],
                critic_learning_rate=p["critic_lr"],
                save_steps=p["save_steps"],
                seed=args.seed,
                agent=agent,
                train_limit=ppo_key.get("train_limit"),
            )
            config = dataclasses.replace(config, **p.get("rl", {}))
            summary = train_s3(config, generator=generator())
            return online_rl_result(out, summary, continued)

        # one stage and directory per PPO setting: settings tried on dev sit side by side on the same world
        ppo = exp.stage(exp.stage_dir("ppo", ppo_key).name, ppo_key, train)
        measure("ppo", Path(ppo["model"]))
    finally:
        if "llm" in held:
            close_llm(held["llm"])

    views = {
        split: contexts(e["base"], e.get("ppo"), ceilings[split], e.get("warm start"))
        for split, e in evaluations.items()
    }
    pairs = [  # the warm start's pairs are left out without one (exp.differences skips an absent stage)
        ("gold passages", "naive RAG"),
        ("s3 before", "naive RAG"),
        ("s3 warm start", "naive RAG"),
        ("s3 after", "naive RAG"),
        ("s3 warm start", "s3 before"),
        ("s3 after", "s3 before"),
        ("s3 after", "s3 warm start"),  # what PPO added to the warm start
    ]
    differences = {split: exp.differences(v, pairs, ["genacc"]) for split, v in views.items()}
    trial_settings = {**s, "generator": str(generator_model), "agent": agent_key, "engine": args.engine}
    trials = exp.record_trial(trial_settings, views.get("dev", {}), "genacc")

    test = views["test"]
    curve = {
        "s3 searcher's documents": [("before", test["s3 before"]["ci"]["genacc"])],
        "naive RAG top-3": [("before", test["naive RAG"]["ci"]["genacc"])],
    }
    for stage, point in (("s3 warm start", "after warm start"), ("s3 after", "after PPO")):
        if stage in test:
            curve["s3 searcher's documents"].append((point, test[stage]["ci"]["genacc"]))
            curve["naive RAG top-3"].append((point, test["naive RAG"]["ci"]["genacc"]))
    plot(curve, exp.results / "curve.png", "test GenAcc (%)", "s3 PPO on the synthetic world (95% bootstrap CI)")
    curves = Path(ppo["dir"]) / "curves.png"
    if curves.exists():
        (exp.results / "curves.png").write_bytes(curves.read_bytes())

    log = ppo["log"]
    step_seconds = sum(r.get("seconds", 0.0) for r in log)  # the steps' own times, also across resumed runs
    rewarded = sum(1 for r in log if r.get("reward", 0.0) > 0)
    steps = rollout_steps(Path(ppo["dir"]), log)
    models = {"gold passages": "–", "naive RAG": "–", "s3 before": short(searcher)}
    if warm is not None:
        models["s3 warm start"] = short(warm["model"])
    models["s3 after"] = short(ppo["model"])
    shape = ", ".join(
        f"{name} {mean(e['searches']):.2f} searches, {mean(e['selected']):.2f} documents selected"
        for name, stage in (("before", "base"), ("after warm start", "warm start"), ("after", "ppo"))
        if (e := evaluations["test"].get(stage)) is not None
    )
    lines = exp.header(
        f"Learning benchmark: s3 PPO on the synthetic world (frozen generator {short(generator_model)})",
        f"Test: the first {len(splits['test'])} questions of the world's test split, "
        + (f"dev: the first {len(splits['dev'])} of its dev split" if "dev" in splits else "no dev split")
        + " (2-3 hops, entities disjoint from training and from each other). "
        f"{len(log)} PPO steps x {s['ppo']['prompts']} questions ({step_seconds:.0f} s of steps; {rewarded} step(s) "
        f"with a mean reward above 0); training data after the filter: {ppo['summary']['data']}. Engine "
        f"{args.engine}. GenAcc (span) of the frozen generator with 95% bootstrap CIs over questions (1000 "
        "resamples). Settings are compared on dev only."
        + (
            f" The first steps were trained by the run {short(ppo['continued_from'])} and continued here "
            "(the same settings; its steps' times are counted)."
            if ppo.get("continued_from")
            else ""
        ),
    )
    naive = test["naive RAG"]["per_example"]["genacc"]

    def swapped(got: list[float]) -> str:
        wins = sum(a > b for a, b in zip(got, naive, strict=True))
        losses = sum(a < b for a, b in zip(got, naive, strict=True))
        return f"right where naive RAG is wrong on {wins}, wrong where it is right on {losses}"

    swaps = "; ".join(
        f"{k}: {swapped(test[k]['per_example']['genacc'])}"
        for k in ("s3 before", "s3 warm start", "s3 after")
        if k in test
    )
    lines += ["## Test (held out)", "", *stage_table(test, ["genacc"], models), ""]
    lines += [f"Per question: {shape}. The searcher's documents vs naive RAG's, {swaps}.", ""]
    lines += [*difference_table(differences["test"], ["genacc"]), ""]
    if warm is not None:
        lines += ["## Searcher warm start", "", warm_summary(warm, s["warmup"]), ""]
    lines += [
        "## PPO steps",
        "",
        "Reward (Gain Beyond RAG) over each step's episodes, from the rollouts the step trained on; PPO has no "
        "groups, so the share of episodes with a reward other than 0 is what carries signal to the advantages.",
        "",
        *step_table(steps, [("Acc(s3 docs)", "acc_s3"), ("Acc(naive)", "acc_naive")], groups=False),
        "",
    ]
    if "dev" in views:
        lines += ["## Dev", "", *stage_table(views["dev"], ["genacc"]), ""]
        lines += [*difference_table(differences["dev"], ["genacc"]), ""]
    lines += ["## Settings tried", "", *trials_table(trials), "", exp.seconds_line(), ""]
    lines += ["Training curves: `curves.png` (reward, KL, entropy, response length, searches per PPO step).", ""]
    lines += settings_block(trial_settings)
    exp.write(
        {
            "smoke": args.smoke,
            "settings": trial_settings,
            "evaluations": evaluations,
            "accuracy": {split: {k: v["ci"]["genacc"] for k, v in view.items()} for split, view in views.items()},
            "differences": differences,
            **({"warmup": warm} if warm is not None else {}),
            "training": ppo,
            "steps": steps,
            "trials": trials,
        },
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
