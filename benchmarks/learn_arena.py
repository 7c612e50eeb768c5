"""Does ARENA's GRPO teach a small reader to answer and cite? EM / F1 and citation precision / recall on held-out
questions of the dev files, before and after training, with bootstrap CIs.

Training questions come from the HotpotQA / 2Wiki / MuSiQue train files in ../shared/data (given paragraphs as the
numbered references, supporting paragraphs as the relevance ground truth). SmolLM2-135M-Instruct with LoRA (the
reference is the base with the adapter disabled), ARENA's rewards (format + EM + relevance + bonus 10), ARENA's KL
estimator. Evaluation is greedy ``arena`` with the questions' given paragraphs, on two disjoint slices of the three
dev files (200 questions each):

* ``test`` (held out, reported, never used to choose anything): the first ``--test-questions`` of each dev file
  (34 x 3 = 102 by default, at most 100 per file);
* ``dev`` (settings are compared on it, and every setting tried is listed: ``trials.json`` in the results
  directory): ``--dev-questions`` of each dev file from its 101st question on (34 x 3 = 102 by default), so the
  two slices never overlap whatever their sizes. The train files are not used for it: their first
  ``--train-questions`` train GRPO and the following ones the warm start.

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
``--format-warmup 0`` runs GRPO from the base model, as the paper does. ``--warmup-shuffles N`` shows each warm-start
question in its given order and N - 1 random orders of its references (the gold numbers move with them);
``--warmup-epochs`` sets its passes (default 2); ``--warmup-fill`` lets the train files that still have questions
take the turns of one that runs out (HotpotQA's and MuSiQue's train files hold ~35 and ~27 usable questions after
GRPO's, 2Wiki's ~390). ``--warmup-order hops`` cites the gold references in the decomposition's hop order instead of
ascending (:func:`cited_numbers`): sorted, the first number is the lowest relevant place, which the 2,000-question
world warm start guesses as 1 (greedy recall 0.97-0.99 where the gold pair holds reference 1, 0.48-0.51 where not).

``--world`` (a deviation: the paper trains on the real files) runs the same stages on a synthetic world whose questions
carry their references (:mod:`sleuth.data.synth`, ``WORLD``: 2-hop questions, the two supporting documents and two
lookalike distractors, ~430 prompt tokens): thousands of train questions at about half a real one's cost each, for
warm starts of a size the train files cannot give (the real ones fit their own questions' relevance lists and cite
held-out ones at chance: ``docs/training.md``). Test and dev are the world's (as many questions as the dev files
give); with ``--probe-only`` the dev files' test and dev slices are probed as well (``real test``, ``real dev``:
does what the world taught carry over?).

Does a reader read? Citation recall rises only if the model's citations beat chance, and a reader citing at chance
gives GRPO's relevance term luck to reinforce. Two checks, in every report: the sampled citations of each GRPO step
against as many references drawn at random (:func:`citation_chance`), and, without sampling, the teacher-forced
preference of each stage for the gold ``<relevance>`` block over random lists of as many shown references
(:func:`citation_preference`: one forward pass a question, exact tests against chance). ``--probe-only`` runs the
second on the base and warm-start models alone (no evaluation, no GRPO: minutes, not hours), so a warm start can be
checked before GRPO is spent on it, and also on the warm start's own train questions (split ``train-preference``:
has it fit the relevance lists it was trained on, or only the rest of the target?). Two reference rows go with it
on the same questions and lists: a reader of words alone (:func:`overlap_preference`, no model) and, with
``--probe-only``, the base model's own question likelihood (:func:`likelihood_preference`: whether it knows which
references bear on the question without citing them). A preference can come from a prior over numbers (writing 1
first whatever the question) rather than from reading, so every stage is also probed on every list of as many shown
references, raw scores kept, and read without that prior (:func:`prior_free_preference`: each list's score less its
mean over the split's other questions): does the gold list come first more often than 1 in 6 (a world question)?
Why GRPO moves citations where it does, from its rollouts:
:func:`citation_by_place` (recall and preference by the gold references' places), :func:`citation_outcomes` (accuracy
by how the citations meet the gold ones) and :func:`citation_advantages` (the summed advantage on each first cited
number: what GRPO teaches a policy whose first number ignores the references).

Stages, caching and the report come from ``benchmarks/harness.py``: a rerun resumes; each GRPO setting (``--steps``,
``--prompts``, ``--group``, ``--lr``, ``--accuracy``) trains into its own directory next to the others (a setting that
differs from another only in ``--steps`` continues that run's furthest checkpoint at or below its own step count:
``--steps 10`` after ``--steps 4`` trains 6 new steps, :func:`harness.continue_online_rl`), while a changed setting of
the warm start (``--format-warmup``, ``--warmup-lr``, ``--warmup-shuffles``, ``--warmup-epochs``, ``--warmup-fill``,
``--warmup-order``, ``--warmup-from`` and ``--train-questions``: the warm start takes the questions after GRPO's) is
an error naming the files to remove (results of two settings are never mixed): give each warm start its own
``--work``.

    python benchmarks/learn_arena.py            # 4 steps: about 2 hours on 2 CPU cores from the base model (see docs)
    python benchmarks/learn_arena.py --smoke    # tiny random model, a few questions, 1 step
    python benchmarks/learn_arena.py --probe-only --results docs/results/learn_arena/probe   # does it read?
    python benchmarks/learn_arena.py --full     # sized for a GPU (FULL below; runs/learn-arena-full, results/full)
    python benchmarks/learn_arena.py --world --probe-only --format-warmup 500 --warmup-epochs 1   # the world's
    python benchmarks/learn_arena.py --world --probe-only --skip-base --format-warmup 2000 --warmup-epochs 1 \
        --warmup-order hops --work $SLEUTH_HOME/runs/learn-arena-world2000-hops   # hop-order citations (~2 h)
    python benchmarks/learn_arena.py --world --world-hops 1 --probe-only --skip-base --format-warmup 500 \
        --warmup-epochs 1 --warmup-target relevance --work $SLEUTH_HOME/runs/learn-arena-world1hop500-relevance
        # the literal binding: 1-hop questions that name their reference's title (chance 1/4)
    python benchmarks/learn_arena.py --world --probe-only --skip-base --format-warmup 500 --warmup-epochs 1 \
        --warmup-from $SLEUTH_HOME/runs/learn-arena-world1hop2000-relevance/warmup-4714e51965e3/model \
        --work $SLEUTH_HOME/runs/learn-arena-world500-from1hop   # a curriculum: 2-hop records after the 1-hop ones

Engines. ``--engine`` runs the evaluations on ``hf`` or on a vLLM server sleuth starts on each model (``vllm``, or a
``vllm:{model}?...`` template); ``auto`` (the default) is ``vllm`` when vLLM is installed (``make vllm``), else
``hf``, and ``hf`` with ``--smoke``. ``--rollouts`` samples GRPO's groups from the live policy (``hf``) or from a
vLLM server that loads the LoRA adapter every step (``vllm``: ``rollout_server`` of
:mod:`sleuth.train.online_rl`); ``auto`` picks ``vllm`` only on a GPU with vLLM installed: on the 2-core CPU of
issue 18 vLLM with ``--enable-lora`` runs uncompiled and sampled slower than the hf runner (132 s against 96 s for 32
prompts). Engines, rollouts and ``--llm-options`` say how a stage is computed, not what: they are not part of the
stages' keys.
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
    base_model,
    compare,
    continue_online_rl,
    declare,
    difference_table,
    online_rl_result,
    parse_sized,
    plot,
    rollout_steps,
    run_dirs,
    settings_block,
    short,
    stage_table,
    step_table,
    trials_table,
)

RESULTS = REPO / "docs" / "results" / "learn_arena"
TRAIN = ["hotpotqa/hotpotqa_train.json", "2wikimultihopqa/wikihop_train_preprocess.json", "musique/musique_train.json"]
DEV = ["hotpotqa/hotpot.json", "2wikimultihopqa/wikihop.json", "musique/musique.json"]
WARMUP_EPOCHS = 2.0  # the warm start's passes over its records (keyed only when another is given)
WARMUP_SAVE_STEPS = 25  # a checkpoint every 200 records (~15 min of a world warm start): warm starts span sessions
OWN_PROBE_MAX = 240  # the own-train-questions probe reads at most this many (every warm start before --world had <=)
# --world: a synthetic world with the references given (sleuth.data.synth, context=True): 2-hop questions, two
# lookalike distractors each (4 references, 2 gold), no filler sentences: ~430 prompt tokens against 2Wiki's ~700
# and HotpotQA's ~1,000, so a warm-start question costs about half; the splits' sizes are fixed (a run takes slices)
WORLD = {
    "min_hops": 2,
    "max_hops": 2,
    "distractors": 2,
    "filler_sentences": 0,
    "context": True,
    "train_questions": 5000,
    "dev_questions": 500,
    "test_questions": 500,
}
DEV_OFFSET = 100  # per dev file: the test slice is below, the dev slice from here on
METRICS = ("em", "f1", "citation_precision", "citation_recall", "format_ok")
# The claims this benchmark is run to test, on the test split: harness.claims gives each the one-sided exact test
# (results.json "claims", results.md "Claims"; benchmarks/recompute_claims.py redoes them from committed results)
CLAIMS = [
    {"name": "GRPO > warm start", "metric": "em", "before": "warm start", "after": "GRPO"},
    {"name": "GRPO > warm start", "metric": "citation_recall", "before": "warm start", "after": "GRPO"},
    {"name": "GRPO > warm start", "metric": "format_ok", "before": "warm start", "after": "GRPO"},
]
# --full, for a GPU: every dev-file question the two slices can hold (300 each), the train files as far as the warm
# start leaves them (hotpotqa_train and musique_train have 100 questions), all 10 given paragraphs of HotpotQA and
# 2Wiki, the paper's G = 7, and 30 steps x 16 questions x 7 = 3,360 episodes (21x the CPU run's 160)
FULL = {
    "test_questions": 100,
    "dev_questions": 100,
    "train_questions": 80,
    "format_warmup": 48,
    "max_references": 10,
    "steps": 30,
    "prompts": 16,
    "group": 7,
}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, grouped by the stage that reads it (a group is that stage's part of its key).
    ``--smoke`` fixes the sizes but keeps the learning rates and the seed given (to try resumption)."""
    if args.smoke:
        sizes = {
            "test": 2,
            "dev": min(args.dev_questions, 2),
            "train": 4,
            "steps": 1,
            "prompts": 2,
            "group": 2,
            "tokens": 8,
        }
        sizes["warmup"] = min(args.format_warmup, 4)
    else:
        sizes = {"test": args.test_questions, "dev": args.dev_questions, "train": args.train_questions}
        sizes.update(steps=args.steps, prompts=args.prompts, group=args.group, tokens=160)
        sizes["warmup"] = args.format_warmup
    if args.warmup_shuffles < 1:
        raise SystemExit("--warmup-shuffles is a count of orders: at least 1 (the given order)")
    if args.warmup_epochs <= 0:
        raise SystemExit("--warmup-epochs must be positive")
    if args.world_hops != 2 and not (args.world and args.probe_only):
        raise SystemExit(
            "--world-hops 1 is a probe world (its questions name their one reference): use it with "
            "--world --probe-only"
        )
    if args.world_lookalikes is not None and not (args.world and args.probe_only):
        raise SystemExit("--world-lookalikes makes a probe world: use it with --world --probe-only")
    if args.warmup_from is not None:
        if not (args.warmup_from / "config.json").exists():
            raise SystemExit(f"--warmup-from {args.warmup_from}: not a model directory (no config.json)")
        if not sizes["warmup"]:
            raise SystemExit("--warmup-from is where the warm start begins: give --format-warmup too")
    if args.warmup_target != "full" and not args.probe_only:
        raise SystemExit("--warmup-target relevance trains a model that writes no answer: use it with --probe-only")
    if args.test_start < 0 or min(sizes["test"], sizes["dev"]) < 0:
        raise SystemExit("--test-start, --test-questions and --dev-questions are counts: not negative")
    if args.test_start + sizes["test"] > DEV_OFFSET or sizes["dev"] > 200 - DEV_OFFSET:
        raise SystemExit(
            f"the test slice (--test-start + --test-questions) ends at question {DEV_OFFSET} of each dev file and "
            f"--dev-questions is at most {200 - DEV_OFFSET} (the dev files hold 200 questions each)"
        )
    return {
        **({"world": world_settings(args.world_hops, args.seed, args.world_lookalikes)} if args.world else {}),
        "eval": {
            "test_per_file": sizes["test"],
            "dev_per_file": sizes["dev"],
            "dev_offset": DEV_OFFSET,
            # keyed only when set, so the runs before the option keep their keys
            **({"test_start": args.test_start} if args.test_start else {}),
        },
        "agent": {"max_new_tokens": sizes["tokens"], "max_references": args.max_references},
        "warmup": {
            "questions": sizes["warmup"],
            "lr": args.warmup_lr,
            "after": sizes["train"],
            # keyed only when set, so the warm starts before the option keep their keys
            **({"shuffles": args.warmup_shuffles} if args.warmup_shuffles > 1 else {}),
            **({"epochs": args.warmup_epochs} if args.warmup_epochs != WARMUP_EPOCHS else {}),
            **({"fill": True} if args.warmup_fill else {}),
            **({"order": args.warmup_order} if args.warmup_order != "sorted" else {}),
            **({"target": args.warmup_target} if args.warmup_target != "full" else {}),
            **({"from": str(args.warmup_from.resolve())} if args.warmup_from is not None else {}),
        },
        "grpo": {
            "train_per_file": sizes["train"],
            "steps": sizes["steps"],
            "prompts": sizes["prompts"],
            "group": sizes["group"],
            "lr": args.lr,
            "lora": not args.smoke,
            "micro_batch": 2,
            "save_steps": 2,
            # keyed only when set, so the runs before the option keep their keys
            **({"accuracy": args.accuracy} if args.accuracy != "em" else {}),
            **({"shuffle_references": True} if args.shuffle_references else {}),
        },
    }


def world_settings(hops: int, seed: int, lookalike_rate: float | None = None) -> dict[str, Any]:
    """The synthetic world's knobs: :data:`WORLD` (2-hop questions, 4 references) or, ``hops=1``, its 1-hop twin for
    the probes: a bridge question of one hop names its gold reference's title (``In which country is Gokra
    located?``, the reference ``Gokra`` among 3 distractors, lookalike names included), so the binding of a number to
    a reference is literal; no comparisons (they need 2 hops). The 2-hop world's key is unchanged.
    ``lookalike_rate`` (keyed only when given; the synthesizer's default 0.5): 0 leaves no name family, so the
    distractors are entities of the gold one's type with names of their own and the binding is a match of names."""
    if lookalike_rate is not None:
        if not 0.0 <= lookalike_rate <= 1.0:
            raise ValueError(f"lookalike_rate={lookalike_rate}: a probability")
        return {**world_settings(hops, seed), "lookalike_rate": lookalike_rate}
    if hops == 2:
        return {**WORLD, "seed": seed}
    if hops != 1:
        raise ValueError(f"hops={hops}: 1 or 2")
    return {
        **WORLD,
        "min_hops": 1,
        "max_hops": 1,
        "distractors": 3,
        "comparison_fraction": 0.0,
        "train_questions": 3000,  # 1,000 entities make ~3,300 distinct 1-hop questions
        "seed": seed,
    }


def declaration(settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a confirmation run fixes before it evaluates anything: the claims, the rule and every setting."""
    return {
        "claims": CLAIMS,
        "rule": "harness.claims: one-sided exact test on the test split's questions where the two stages differ, "
        "shown at p < 0.05 on >= 100 questions",
        "settings": settings,
        "seed": seed,
    }


def fixed_part(declared: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in declared.items() if k not in ("declared_at", "commit")}


def format_split(start: dict[str, list[float]], after: dict[str, list[float]], name: str) -> str:
    """EM changes split by whether ``start``'s answer had ARENA's format: a gain on the questions it left unformatted
    (scored by the lenient extractor) is the format's, one on those it formatted is the answer's."""
    line = f"EM changes by the {name}'s format:"
    for formatted, label in ((0.0, "unformatted"), (1.0, "formatted")):
        ids = [i for i, f in enumerate(start["format_ok"]) if f == formatted]
        better = sum(after["em"][i] > start["em"][i] for i in ids)
        worse = sum(after["em"][i] < start["em"][i] for i in ids)
        em = (sum(start["em"][i] for i in ids), sum(after["em"][i] for i in ids))
        line += f" on the {len(ids)} it left {label}, EM {em[0]:.0f} -> {em[1]:.0f} correct"
        line += f" ({better} better / {worse} worse);"
    return line[:-1] + "."


def slice_questions(files: list[str], start: int, count: int) -> list[Any]:
    """Questions ``start`` to ``start + count`` of each file, file after file."""
    from sleuth.data import load_examples

    return [e for f in files for e in load_examples(f, limit=start + count)[start:]]


def evaluate(model: Path, examples: list[Any], agent: Any, options: str, engine: str) -> dict[str, Any]:
    """Greedy arena on ``examples`` with their given paragraphs: per-question metrics."""
    from types import SimpleNamespace
    from urllib.parse import parse_qs

    from sleuth.agents import Context
    from sleuth.eval.metrics import score_example
    from sleuth.llm import load_llm
    from sleuth.runner import run
    from sleuth.train.common import close_llm, engine_spec

    llm = load_llm(engine_spec(SimpleNamespace(engine=engine, llm_options=options), model))
    try:
        # as many questions in flight as the engine batches (a GPU's --llm-options max_batch=160: one generate call)
        batch = int(parse_qs(options).get("max_batch", ["64"])[0])
        ctx = Context(llm=llm, retriever=None, config=agent)
        traces = run("arena", examples, ctx, progress=True, concurrency=max(64, batch))
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
    return {"per_example": per, "model": str(model), "engine": engine}


def episode_citations(rollout: Any) -> tuple[list[str], set[int], set[int]] | None:
    """An ARENA episode's citations: the ids of the references shown, the gold numbers among them and the valid
    numbers it cited (integers in range; anything else the model wrote is ignored); None when no supporting
    reference was shown."""
    meta, example = rollout.trace.meta, rollout.trace.example
    shown = list(meta.get("reference_ids") or [])
    support = set(example.supporting_ids)
    gold = {i for i, ref in enumerate(shown, 1) if ref in support}
    if not gold:
        return None
    picked = {i for i in meta.get("relevance") or [] if isinstance(i, int) and 1 <= i <= len(shown)}
    return shown, gold, picked


def citation_chance(rollouts: list[Any]) -> dict[str, float]:
    """The sampled citations of one GRPO step against chance: per episode with supporting references among the
    ones shown, citation recall and precision and ARENA's relevance reward, each beside its expected value for the
    same number of distinct valid references drawn at random from the ``n`` shown (recall k/n, precision g/n,
    relevance P(exact set) + 0.5 P(other overlap)); means over those episodes. A reader whose citations sit at
    chance gives GRPO's relevance term luck to reinforce, not a reading of the references. ``recall_overlap``: the
    recall of as many references picked by :func:`overlap_order` (shared words with the question), what a reader
    that only matches words would cite. ``cites_one``: over the episodes whose gold numbers lack reference 1, the
    share that cite it (a reader guessing the first number cites it whatever the question; absent when every
    episode's gold numbers hold 1)."""
    from math import comb

    sums = dict.fromkeys(
        (
            "recall",
            "recall_chance",
            "recall_overlap",
            "precision",
            "precision_chance",
            "relevance",
            "relevance_chance",
        ),
        0.0,
    )
    episodes = cited = lacking = citing_one = 0
    for rollout in rollouts:
        citations = episode_citations(rollout)
        if citations is None:
            continue
        shown, gold, picked = citations
        n, g, k = len(shown), len(gold), len(picked)
        example = rollout.trace.example
        episodes += 1
        if 1 not in gold:
            lacking += 1
            citing_one += 1 in picked
        sums["recall"] += len(picked & gold) / g
        sums["recall_chance"] += k / n
        passages = {p.id: p for p in example.context}
        texts = [f"{passages[r].title} {passages[r].text}" if r in passages else "" for r in shown]
        sums["recall_overlap"] += len(set(overlap_order(example.question, texts)[:k]) & gold) / g
        exact = 1 / comb(n, k) if k == g else 0.0
        overlap = 1 - comb(n - g, k) / comb(n, k)
        sums["relevance"] += float((rollout.extra.get("components") or {}).get("relevance", 0.0))
        sums["relevance_chance"] += exact + 0.5 * (overlap - exact)
        if k:
            cited += 1
            sums["precision"] += len(picked & gold) / k
            sums["precision_chance"] += g / n
    if not episodes:
        return {"episodes": 0}
    means = {key: value / episodes for key, value in sums.items() if not key.startswith("precision")}
    means.update({key: sums[key] / cited if cited else 0.0 for key in ("precision", "precision_chance")})
    if lacking:
        means["cites_one"] = citing_one / lacking
    return {"episodes": episodes, "cited": cited, **means}


_FUNCTION_WORDS = (
    "a an the of in on at to for from by with and or is was were are be been who what which when where "
    "how whose whom that this these those did does do as it its his her their he she they"
)
STOPWORDS = frozenset(_FUNCTION_WORDS.split())


def overlap_order(question: str, texts: list[str]) -> list[int]:
    """1-based reference numbers ordered by how many distinct content words of ``question`` each text contains
    (lower-cased word tokens minus a few function words), ties by position."""
    counts = overlap_counts(question, texts)
    return sorted(range(1, len(texts) + 1), key=lambda i: (-counts[i - 1], i))


def overlap_counts(question: str, texts: list[str]) -> list[int]:
    """Per text, how many distinct content words of ``question`` it contains (lower-cased word tokens minus a few
    function words)."""
    import re

    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"\w+", text.lower()) if w not in STOPWORDS}

    asked = words(question)
    return [len(asked & words(text)) for text in texts]


def citation_table(steps: list[dict[str, Any]]) -> list[str]:
    """Markdown rows of each step's :func:`citation_chance`."""
    head = "| step | episodes | citing | recall | chance | word overlap | precision | chance | relevance reward | "
    head += "chance | cites 1 where not gold |"
    lines = [head, "|---" * 11 + "|"]
    for row in steps:
        c = row["citations"]
        if not c.get("episodes"):
            continue
        cells = [str(row["step"]), str(c["episodes"]), str(c["cited"])]
        keys = ("recall", "recall_chance", "recall_overlap", "precision", "precision_chance")
        cells += [f"{c[k]:.3f}" if k in c else "–" for k in keys]
        cells += [f"{c[k]:.3f}" if k in c else "–" for k in ("relevance", "relevance_chance", "cites_one")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PREFERENCE_LISTS = 4  # random relevance lists each gold one is compared with


def citation_outcomes(rollouts: list[Any]) -> dict[str, dict[str, float]]:
    """A GRPO run's episodes with a supporting reference shown, by how their cited numbers meet the gold ones:
    ``exact`` (the same set), ``partial`` (some gold among them), ``disjoint`` (none), ``none`` (nothing cited);
    per class the episodes and their mean accuracy reward. A reward that rises with the match is what GRPO's
    accuracy term and relevance term reinforce together; a flat one, citations GRPO cannot learn from accuracy."""
    classes: dict[str, list[float]] = {"exact": [], "partial": [], "disjoint": [], "none": []}
    for rollout in rollouts:
        citations = episode_citations(rollout)
        if citations is None:
            continue
        _, gold, picked = citations
        match = "none" if not picked else "exact" if picked == gold else "partial" if picked & gold else "disjoint"
        classes[match].append(float((rollout.extra.get("components") or {}).get("accuracy", 0.0)))
    return {
        match: {"episodes": len(values), "accuracy": sum(values) / len(values) if values else 0.0}
        for match, values in classes.items()
    }


def outcome_table(outcomes: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows of :func:`citation_outcomes`."""
    lines = ["| cited numbers against the gold ones | episodes | mean accuracy reward |", "|---|---|---|"]
    for match, row in outcomes.items():
        accuracy = f"{row['accuracy']:.3f}" if row["episodes"] else "–"
        lines.append(f"| {match} | {row['episodes']:.0f} | {accuracy} |")
    return lines


def citation_advantages(rollouts: list[Any], eps: float) -> dict[str, Any]:
    """Where GRPO's advantages push the first number a policy cites. Each episode's advantage as the trainer computed
    it (:func:`sleuth.train.rl.grpo_advantages` over its group, the run's ``eps``), then, over the groups with a
    supporting reference shown, split by whether the gold numbers hold reference 1: per first number written in
    ``<relevance>`` the episodes and their summed advantage, and how many groups sampled the exact gold set at all.
    Advantages sum to 0 in a group, so for a policy whose first number does not depend on the references the
    gradient on writing ``n`` first is proportional to the summed advantage of the episodes that did: a positive sum
    over all groups on 1 makes that policy cite 1 more wherever 1 is gold or not (the reward-optimal guess of a
    reader that cannot read); a reader is pushed only through the split by gold. With shuffled references (each
    episode its own order) the split is per episode, so a group can count on both sides."""
    import torch

    from sleuth.train.rl import grpo_advantages

    if not rollouts:
        return {"groups": {}, "first": {}}
    rewards = torch.tensor([float(r.extra.get("reward", 0.0)) for r in rollouts], dtype=torch.float64)
    advantages = grpo_advantages(rewards, [r.group for r in rollouts], eps=eps).tolist()
    groups: dict[str, dict[str, set[str]]] = {"holds 1": {"all": set(), "exact": set()}}
    groups["lacks 1"] = {"all": set(), "exact": set()}
    first: dict[str, dict[str, dict[str, float]]] = {}
    for rollout, advantage in zip(rollouts, advantages, strict=True):
        citations = episode_citations(rollout)
        if citations is None:
            continue
        _, gold, picked = citations
        kind = "holds 1" if 1 in gold else "lacks 1"
        groups[kind]["all"].add(rollout.group)
        if picked == gold:
            groups[kind]["exact"].add(rollout.group)
        written = [i for i in rollout.trace.meta.get("relevance") or [] if isinstance(i, int) and i in picked]
        number = str(written[0]) if written else "none"
        cell = first.setdefault(number, {}).setdefault(kind, {"episodes": 0, "advantage": 0.0})
        cell["episodes"] += 1
        cell["advantage"] += advantage
    order = sorted(first, key=lambda n: (n == "none", int(n) if n.isdigit() else 0))
    return {
        "groups": {kind: {"groups": len(g["all"]), "exact": len(g["exact"])} for kind, g in groups.items()},
        "first": {n: first[n] for n in order},
    }


def advantage_table(pushed: dict[str, Any]) -> list[str]:
    """Markdown rows of :func:`citation_advantages`: per first cited number, episodes and summed advantage where the
    gold numbers hold reference 1, where they lack it, and over both."""
    head = "| first number cited | holds 1: episodes | holds 1: summed advantage | lacks 1: episodes | "
    head += "lacks 1: summed advantage | all: summed advantage |"
    lines = [head, "|---" * 6 + "|"]
    for number, kinds in pushed["first"].items():
        cells = [number]
        for kind in ("holds 1", "lacks 1"):
            cell = kinds.get(kind, {"episodes": 0, "advantage": 0.0})
            cells += [str(cell["episodes"]), f"{cell['advantage']:+.2f}"]
        cells.append(f"{sum(c['advantage'] for c in kinds.values()):+.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    groups = pushed["groups"]
    if groups:
        lines += [
            "",
            "Groups that sampled the exact gold set: "
            + "; ".join(f"{kind}: {g['exact']} of {g['groups']}" for kind, g in groups.items())
            + ".",
        ]
    return lines


def citation_by_place(
    examples: list[Any],
    agent: Any,
    recall: dict[str, list[float]],
    preference: dict[str, list[float]],
    lists: int | None = PREFERENCE_LISTS,
    seed: int = 0,
) -> list[str]:
    """Markdown rows: per set of places the supporting references hold among those shown (the gold numbers, as
    :func:`cited_numbers` sorts them: ``1, 3`` for references 1 and 3), the questions and each stage's mean citation
    recall (``recall``: stage -> per-question values in ``examples``' order, a greedy evaluation) and teacher-forced
    preference (``preference``: stage -> per-question values of :func:`preference_jobs`' questions, a
    :func:`citation_preference`); then the same over the questions whose gold numbers hold reference 1 and those
    whose do not. A reader that reads is as good where reference 1 is not gold as where it is; one that guesses
    the first number as 1 is good only where it is."""
    jobs, _ = preference_jobs(examples, agent, lists, seed)
    probed = {example.id: i for i, (example, _, _) in enumerate(jobs)}
    places: list[tuple[int, ...]] = []
    for example in examples:
        references = list(example.context)[: agent.max_references]
        places.append(tuple(cited_numbers(example, references)))
    groups: dict[str, list[int]] = {}
    for i, place in enumerate(places):
        if place:
            groups.setdefault(", ".join(map(str, place)), []).append(i)
    ordered = sorted(groups.items(), key=lambda item: (len(places[item[1][0]]), places[item[1][0]]))
    ordered += [
        (label, [i for i, place in enumerate(places) if place and (1 in place) == holds])
        for label, holds in (("holds 1", True), ("lacks 1", False))
    ]
    head = ["gold places", "questions"] + [f"{stage}: recall" for stage in recall]
    head += [f"{stage}: preference" for stage in preference]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.3f}" if values else "–"

    for label, members in ordered:
        cells = [f"**{label}**" if label.startswith(("holds", "lacks")) else label, str(len(members))]
        cells += [mean([values[i] for i in members]) for values in recall.values()]
        jobs_in = [probed[examples[i].id] for i in members if examples[i].id in probed]
        cells += [mean([values[j] for j in jobs_in]) for values in preference.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def preference_lists(gold: list[int], shown: int, lists: int | None, rng: Any) -> list[list[int]]:
    """Up to ``lists`` distinct random relevance lists of ``len(gold)`` of the ``shown`` references (sorted, as
    :func:`warmup_target` writes them), never the gold list; ``[]`` when there is no other list. ``lists=None``:
    every other list, in lexicographic order (``rng`` unused)."""
    from itertools import combinations
    from math import comb

    others = comb(shown, len(gold)) - 1
    if others <= 0:
        return []
    if lists is None:
        return [list(c) for c in combinations(range(1, shown + 1), len(gold)) if list(c) != gold]
    if others <= 4 * lists:  # few: draw from all of them
        pool = [list(c) for c in combinations(range(1, shown + 1), len(gold)) if list(c) != gold]
        return rng.sample(pool, min(lists, len(pool)))
    picked: list[list[int]] = []
    while len(picked) < lists:
        pick = sorted(rng.sample(range(1, shown + 1), len(gold)))
        if pick != gold and pick not in picked:
            picked.append(pick)
    return picked


def relevance_block(numbers: list[int]) -> str:
    return f"<relevance>\n{numbers}\n</relevance>"


PROBE_ORDERS = 6  # at most this many orders of a list are scored with orders="all"


def block_orders(numbers: list[int], orders: str, rng: Any) -> list[list[int]]:
    """The orders in which :func:`citation_preference` scores a relevance list: ``sorted``, the ascending one (how
    the default warm start writes it); ``all``, every order when there are at most :data:`PROBE_ORDERS`, else the
    ascending one and ``PROBE_ORDERS - 1`` others drawn with ``rng`` (a list of 4 or more), so that a model that
    writes its lists in another order (``--warmup-order hops``) is scored on the set, not on one order of it."""
    from itertools import permutations
    from math import factorial

    if orders == "sorted":
        return [sorted(numbers)]
    if orders != "all":
        raise ValueError(f"orders={orders!r}; expected 'sorted' or 'all'")
    if factorial(len(numbers)) <= PROBE_ORDERS:
        return [list(p) for p in permutations(sorted(numbers))]
    picked = [sorted(numbers)]
    while len(picked) < PROBE_ORDERS:
        order = rng.sample(numbers, len(numbers))
        if order not in picked:
            picked.append(order)
    return picked


def logsumexp(values: list[float]) -> float:
    from math import exp, log

    top = max(values)
    if top == float("-inf"):  # every order impossible
        return top
    return top + log(sum(exp(v - top) for v in values))


def preference_jobs(
    examples: list[Any], agent: Any, lists: int | None, seed: int
) -> tuple[list[tuple[Any, list[Any], list[list[int]]]], dict[str, int]]:
    """The questions :func:`citation_preference` compares: per question whose shown references include a supporting
    one, ``(example, shown references, [gold list, *random lists])`` (:func:`preference_lists`, seeded by the
    question; ``lists=None``: every other list), and the questions left out, counted by reason."""
    import random

    jobs = []
    skipped = {"no supporting reference shown": 0, "no other list of as many references": 0}
    for example in examples:
        references = list(example.context)[: agent.max_references]
        support = set(example.supporting_ids)
        gold = [i for i, p in enumerate(references, 1) if p.id in support]
        if not gold:
            skipped["no supporting reference shown"] += 1
            continue
        others = preference_lists(gold, len(references), lists, random.Random(f"{seed}:{example.id}"))
        if not others:
            skipped["no other list of as many references"] += 1
            continue
        jobs.append((example, references, [gold, *others]))
    return jobs, skipped


def prior_free_scores(
    candidates: list[list[list[int]]], scored: list[list[float]], shown: list[int]
) -> tuple[list[list[float]], int]:
    """Each list's score less its prior: the mean score the same list (as a set) gets on the other questions that
    show as many references (leave-one-out, so a question's own references never enter its prior). A model whose
    blocks follow a fixed preference for some numbers (writing 1 first whatever the question) has it in every
    question's scores; what is left is what this question's references move. The prior of a list no other question
    scores is the mean of the priors of the lists of its length and shown count (counted: the second value).
    Contextual calibration (Zhao et al. 2021, "Calibrate Before Use") with the split's own questions in place of a
    content-free input."""
    from collections import defaultdict

    total: dict[tuple[int, tuple[int, ...]], float] = defaultdict(float)
    count: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
    for lists, scores, n in zip(candidates, scored, shown, strict=True):
        for numbers, score in zip(lists, scores, strict=True):
            total[n, tuple(sorted(numbers))] += score
            count[n, tuple(sorted(numbers))] += 1
    means = {key: total[key] / count[key] for key in count}
    fallback = 0
    out = []
    for lists, scores, n in zip(candidates, scored, shown, strict=True):
        row = []
        for numbers, score in zip(lists, scores, strict=True):
            key = (n, tuple(sorted(numbers)))
            if count[key] > 1:
                prior = (total[key] - score) / (count[key] - 1)
            else:  # no other question scores this list
                same = [m for k, m in means.items() if k != key and k[0] == n and len(k[1]) == len(numbers)]
                prior = sum(same) / len(same) if same else 0.0
                fallback += 1
            row.append(score - prior)
        out.append(row)
    return out, fallback


def prior_free_preference(probe: dict[str, Any]) -> dict[str, Any]:
    """:func:`citation_preference` (or :func:`overlap_preference`) with every list scored (``lists=None``) read after
    :func:`prior_free_scores`: ``per_example`` as :func:`preference_scores` gives it, from the calibrated scores;
    ``fallback``: the lists whose prior came from other lists. ``first`` against ``first_chance`` (1 / the lists
    of a question, 1/6 in the world) is then whether the references, not a prior over numbers, rank the gold list
    first."""
    calibrated, fallback = prior_free_scores(probe["candidates"], probe["scores"], probe["shown"])
    return {**probe, "per_example": preference_scores(calibrated), "fallback": fallback}


def preference_scores(scored: list[list[float]]) -> dict[str, list[float]]:
    """Per question, from the scores of its gold list (first) and its random lists: ``preference``, the share of the
    random lists the gold one beats (ties half), ``first``, 1 when it beats them all, and that event's chance."""
    per: dict[str, list[float]] = {"preference": [], "first": [], "first_chance": []}
    for gold, *others in scored:
        beaten = sum(o < gold for o in others) + 0.5 * sum(o == gold for o in others)
        per["preference"].append(beaten / len(others))
        per["first"].append(float(all(o < gold for o in others)))
        per["first_chance"].append(1 / (len(others) + 1))
    return per


def citation_preference(
    model: Path,
    examples: list[Any],
    agent: Any,
    options: str,
    lists: int | None = 4,
    seed: int = 0,
    llm: Any = None,
    orders: str = "sorted",
) -> dict[str, Any]:
    """Does the model prefer the gold ``<relevance>`` block to random ones? Teacher-forced, nothing sampled: for
    each question whose shown references include a supporting one, the log-probability the model gives, after
    ARENA's prompt, to :func:`relevance_block` of the gold reference numbers and of up to ``lists`` random lists of
    as many shown references (:func:`preference_jobs`). Per question ``preference``: the share of the random lists
    the gold block beats (ties half; chance 0.5), ``first``: 1 when it beats them all (chance ``first_chance``,
    1 / (lists + 1)). A reader that reads the references prefers the gold block; one that cites at chance (the
    sampled-citation table of a GRPO run) does not, and this says so from one forward pass per question, without a
    GRPO step. Questions left out are counted in ``skipped`` by reason. ``llm``: score with this LLM instead of
    loading ``model`` on the hf engine with ``options``. ``orders``: a list's block scored in ascending order
    (``sorted``) or its probability summed over the orders of :func:`block_orders` (``all``: the set's, for a model
    that writes lists in another order). ``lists=None`` scores every list of as many shown references (the
    prior-free reading, :func:`prior_free_preference`, needs them all). Besides the shares, the raw scores
    (:func:`raw_scores`)."""
    import asyncio
    import random

    from sleuth.agents.arena import arena_prompt
    from sleuth.llm import load_llm
    from sleuth.train.common import close_llm

    jobs, skipped = preference_jobs(examples, agent, lists, seed)
    scorer = llm or load_llm(f"hf:{model}?{options}")

    async def score_list(messages: list[dict[str, str]], numbers: list[int], rng: Any) -> float:
        blocks = [relevance_block(order) for order in block_orders(numbers, orders, rng)]
        scores = await asyncio.gather(*(scorer.score(messages, block) for block in blocks))
        return logsumexp([s.logprob for s in scores])

    async def score_all() -> list[list[float]]:
        rows = []
        for example, references, candidates in jobs:
            messages = [{"role": "user", "content": arena_prompt(example.question, references, agent.prompt)}]
            rng = random.Random(f"{seed}:orders:{example.id}")
            rows.append(asyncio.gather(*(score_list(messages, c, rng) for c in candidates)))
        return list(await asyncio.gather(*rows))

    try:
        scored = asyncio.run(score_all())
    finally:
        if llm is None:
            close_llm(scorer)
    return {
        "per_example": preference_scores(scored),
        "model": str(model),
        "lists": lists,
        "skipped": skipped,
        **raw_scores(jobs, scored),
    }


def raw_scores(jobs: list[tuple[Any, list[Any], list[list[int]]]], scored: list[list[float]]) -> dict[str, Any]:
    """What a probe keeps besides its per-question shares, so another reading (:func:`prior_free_preference`) needs
    no model: per question its lists (gold first), their scores and the number of references shown."""
    return {
        "candidates": [candidates for _, _, candidates in jobs],
        "scores": scored,
        "shown": [len(references) for _, references, _ in jobs],
    }


def overlap_preference(examples: list[Any], agent: Any, lists: int | None = 4, seed: int = 0) -> dict[str, Any]:
    """:func:`citation_preference`'s comparison, on the same questions and lists, for a reader that only matches
    words: a list scores the question words its references contain (:func:`overlap_counts`, summed). What reading
    the words alone earns on this probe, so a model's row has a reference besides chance; no model."""
    jobs, skipped = preference_jobs(examples, agent, lists, seed)
    scored = []
    for example, references, candidates in jobs:
        counts = overlap_counts(example.question, [f"{p.title} {p.text}" for p in references])
        scored.append([float(sum(counts[i - 1] for i in c)) for c in candidates])
    return {
        "per_example": preference_scores(scored),
        "model": "",
        "lists": lists,
        "skipped": skipped,
        **raw_scores(jobs, scored),
    }


# after UPR's question-likelihood ranking (Sachan et al. 2022, "Improving Passage Retrieval with Zero-Shot Question
# Generation": a passage ranks by log p(question | "Passage: {p}. Please write a question based on this passage.")),
# here with line breaks between the parts
LIKELIHOOD_PROMPT = "Passage: {passage}\nPlease write a question based on this passage.\nQuestion:"


def likelihood_preference(
    model: Path, examples: list[Any], agent: Any, options: str, lists: int = 4, seed: int = 0, llm: Any = None
) -> dict[str, Any]:
    """:func:`citation_preference`'s comparison, on the same questions and lists, with the model ranking the
    references by how well each predicts the question (:data:`LIKELIHOOD_PROMPT`, log p(question | reference),
    a list scoring the sum over its references): does the model know which references bear on the question, in a
    form that needs no citation numbers? A model whose row here beats chance while its ``<relevance>`` row does not
    knows the references but does not cite them. ``llm``: score with this LLM instead of loading ``model``."""
    import asyncio

    from sleuth.llm import load_llm
    from sleuth.train.common import close_llm

    jobs, skipped = preference_jobs(examples, agent, lists, seed)
    scorer = llm or load_llm(f"hf:{model}?{options}")

    async def score_all() -> list[list[float]]:
        rows = []
        for example, references, _ in jobs:
            prompts = [LIKELIHOOD_PROMPT.format(passage=f"{p.title}: {p.text}") for p in references]
            rows.append(asyncio.gather(*(scorer.score(prompt, " " + example.question) for prompt in prompts)))
        return [[s.logprob for s in scores] for scores in await asyncio.gather(*rows)]

    try:
        per_reference = asyncio.run(score_all())
    finally:
        if llm is None:
            close_llm(scorer)
    scored = [
        [sum(values[i - 1] for i in c) for c in candidates]
        for values, (_, _, candidates) in zip(per_reference, jobs, strict=True)
    ]
    return {"per_example": preference_scores(scored), "model": str(model), "lists": lists, "skipped": skipped}


def preference_table(probes: dict[str, dict[str, dict[str, Any]]], seed: int = 0) -> list[str]:
    """Markdown rows of :func:`citation_preference` by split and stage, each with its one-sided exact test against
    chance (sign-flip permutation, :func:`harness.compare`)."""
    lines = [
        "| split | stage | questions | gold block preferred to a random one | p (> 0.5) | gold block first | chance | "
        "p (> chance) |",
        "|---" * 8 + "|",
    ]
    for split, stages in probes.items():
        for stage, probe in stages.items():
            per = probe["per_example"]
            n = len(per["preference"])
            if not n:
                lines.append(f"| {split} | {stage} | 0 | – | – | – | – | – |")
                continue
            c = preference_cells(per, seed)
            lines.append(
                f"| {split} | {stage} | {n} | {c['preference']} | {c['p_half']} | {c['first']} | {c['chance']} | "
                f"{c['p_chance']} |"
            )
    return lines


def preference_cells(per: dict[str, list[float]], seed: int) -> dict[str, str]:
    """A preference probe's per-question results as table cells: the mean ``preference`` and its one-sided exact
    test against 0.5 (``p_half``), the mean ``first`` and its ``chance`` and its test against that (``p_chance``)."""
    n = len(per["preference"])
    vs_half = compare([0.5] * n, per["preference"], seed)
    vs_first = compare(per["first_chance"], per["first"], seed)
    return {
        "preference": f"{sum(per['preference']) / n:.3f}",
        "p_half": f"{vs_half['p_exact']:.3g}",
        "first": f"{sum(per['first']) / n:.3f}",
        "chance": f"{sum(per['first_chance']) / n:.3f}",
        "p_chance": f"{vs_first['p_exact']:.3g}",
    }


# the hf engine scores; a batch holds 8 prompts' 5 blocks each, so a prompt's blocks share one pass over it
# (HFLLM._score_shared); batches of 8 rows would split a prompt's blocks over two passes
PROBE_OPTIONS = f"threads=2&max_batch={8 * (PREFERENCE_LISTS + 1)}"
# every list: 6 a world question (2 of 4), at most C(6, 3) = 20 a dev-file one (max_references 6); 8 prompts a batch
EVERY_LIST_OPTIONS = "threads=2&max_batch=160"
PREFERENCE_TEXT = (
    "Does each model prefer the gold `<relevance>` block to random ones (`citation_preference`)? Per question with "
    "a supporting reference shown: the log-probability of the gold reference numbers' block after ARENA's prompt "
    f"against {PREFERENCE_LISTS} random lists of as many shown references; the share it beats (chance 0.5) and how "
    "often it beats them all; p: one-sided exact sign-flip tests over the questions. The word overlap row scores "
    "the same lists by the question words their references contain (`overlap_preference`, no model): what a reader "
    "that matches words alone would show. `--probe-only` adds the base model's question likelihood "
    "(`likelihood_preference`, after UPR): the same lists scored by log p(question | reference), whether the model "
    "knows the relevant references without having to cite them. A warm start that writes its lists in hop order "
    "(`--warmup-order hops`) is scored on each list's set: its probability summed over the list's orders "
    "(`block_orders`), not the ascending block alone."
)


PRIOR_FREE_TEXT = (
    "Without the prior over numbers (`prior_free_preference`): every list of as many shown references scored (6 "
    "per world question: 2 of 4), and each list's score less its mean over the split's other questions that show "
    "as many references (leave-one-out; contextual calibration after Zhao et al. 2021, with the split's questions "
    "for the content-free input). A model that writes 1 first whatever the question carries that preference in "
    "every question's scores and loses it here; what is left is what the question's references move. Gold first: "
    "the share of questions whose gold list scores above every other, raw and calibrated, against chance (1 / the "
    "lists); p: one-sided exact sign-flip tests of the calibrated columns against chance. The calibrated scores of "
    "a question depend on the split's other questions (through the priors), so the tests are approximate."
)


TRAINING_TEXT = (
    "The warm start's training (`warmup_training`, from its model's `log.jsonl` where the model is on this machine): "
    "TRL's loss per completion token at evenly spaced logged steps."
)
PLACE_TEXT = (
    "By gold places (`citation_by_place`): the questions grouped by the places their supporting references hold "
    "among those shown, then by whether those hold reference 1; per stage the mean citation recall and the "
    "teacher-forced preference above. A reader that reads does as well where reference 1 is not gold as where it is."
)


def prior_free_table(probes: dict[str, dict[str, dict[str, Any]]], seed: int = 0) -> list[str]:
    """Markdown rows of the every-list probes (split -> stage -> :func:`citation_preference` with ``lists=None``) by
    split and stage: the gold list first raw and after :func:`prior_free_preference`, with its exact test against
    chance, and the calibrated preference against 0.5."""
    lines = [
        "| split | stage | questions | lists per question | gold first, raw | gold first, calibrated | chance | "
        "p (> chance) | calibrated preference | p (> 0.5) |",
        "|---" * 10 + "|",
    ]
    for split, stages in probes.items():
        for stage, probe in stages.items():
            n = len(probe["scores"])
            if not n:
                lines.append(f"| {split} | {stage} | 0 |" + " – |" * 7)
                continue
            raw = preference_scores(probe["scores"])
            c = preference_cells(prior_free_preference(probe)["per_example"], seed)
            lines.append(
                f"| {split} | {stage} | {n} | {sum(map(len, probe['scores'])) / n:.1f} | "
                f"{sum(raw['first']) / n:.3f} | {c['first']} | {c['chance']} | {c['p_chance']} | "
                f"{c['preference']} | {c['p_half']} |"
            )
    return lines


def place_tables(
    probes: dict[str, dict[str, dict[str, Any]]],
    examples: dict[str, list[Any]],
    agent: Any,
    seed: int,
    evaluations: dict[str, dict[str, dict[str, Any]]] | None = None,
    every_list: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> list[str]:
    """:func:`citation_by_place` of each split in ``examples``: its ``evaluations``' citation recall (when given), its
    ``probes``' preference and the prior-free preference of its ``every_list`` probes (when given), each split under
    a heading."""
    lines: list[str] = []
    for split, questions in examples.items():
        recall = {
            stage: ev["per_example"]["citation_recall"] for stage, ev in (evaluations or {}).get(split, {}).items()
        }
        preference = {stage: probe["per_example"]["preference"] for stage, probe in probes.get(split, {}).items()}
        preference |= {  # the same questions in the same order (preference_jobs skips the same ones)
            f"{stage}, prior-free": prior_free_preference(probe)["per_example"]["preference"]
            for stage, probe in (every_list or {}).get(split, {}).items()
        }
        lines += [f"**{split}**", "", *citation_by_place(questions, agent, recall, preference, PREFERENCE_LISTS, seed)]
        lines.append("")
    return lines


def write_probe(
    exp: Any,
    probes: dict[str, dict[str, dict[str, Any]]],
    settings: dict[str, Any],
    seed: int,
    examples: dict[str, list[Any]],
    agent: Any,
    every_list: dict[str, dict[str, dict[str, Any]]],
    training: dict[str, Any] | None = None,
) -> None:
    """``--probe-only``'s report: ``results.md`` and ``results.json`` (``probe_only``: true) in the results directory,
    where later runs find its evaluations by key like any committed ones; ``examples``: each split's questions, for
    the by-place tables (:func:`place_tables`); ``every_list``: the every-list probes (:func:`prior_free_table`);
    ``training``: the warm start's loss curve (:func:`warmup_training`, ``warmup_training`` in results.json)."""
    table = preference_table(probes, seed)
    prior_free = prior_free_table(every_list, seed)
    skipped = [
        f"- {split} {stage}: skipped {probe['skipped']}, model `{short(probe['model']) or 'none'}`"
        for split, stages in probes.items()
        for stage, probe in stages.items()
    ]
    lines = exp.header("ARENA: teacher-forced citation preference", PREFERENCE_TEXT)
    lines += [*table, "", *skipped, "", PRIOR_FREE_TEXT, "", *prior_free, ""]
    lines += [PLACE_TEXT, "", *place_tables(probes, examples, agent, seed, every_list=every_list)]
    if settings.get("warmup", {}).get("questions"):
        lines += [TRAINING_TEXT, "", *training_lines(training)]
    lines += [exp.seconds_line(), "", *settings_block(settings)]
    report = {"probe_only": True, "settings": settings, "citation_preference": probes, "every_list": every_list}
    if training:
        report["warmup_training"] = training
    exp.write(report, "\n".join(lines) + "\n")
    print("\n".join([*table, "", *prior_free]), flush=True)


def cited_numbers(example: Any, references: list[Any], order: str = "sorted") -> list[int]:
    """The numbers of the shown supporting references as the warm start cites them. ``sorted``: ascending (arena.md
    §3.5's ``sorted_gt_ids``). ``hops``: in the order of the gold decomposition's steps (the reference of the entity
    the question names first, then the one its answer leads to), the rest ascending; R_rel compares sets, so both
    score alike. Sorted, the first number asks for the lowest relevant place, which a reader can only guess (1 is
    the likeliest); in hop order it is the reference whose words the question shares."""
    if order not in ("sorted", "hops"):
        raise ValueError(f"order={order!r}; expected 'sorted' or 'hops'")
    supporting = set(example.supporting_ids)
    gold = [i for i, p in enumerate(references, 1) if p.id in supporting]  # a passage shown twice: both places
    if order == "sorted":
        return gold
    places: dict[str, list[int]] = {}
    for i, p in enumerate(references, 1):
        places.setdefault(p.id, []).append(i)
    steps = [pid for step in example.decomposition or [] for pid in step.get("supporting_ids") or []]
    first = list(dict.fromkeys(i for pid in steps for i in places.get(pid, []) if i in gold))
    return first + [i for i in gold if i not in first]


WARMUP_TARGETS = ("full", "relevance")


def warmup_target(example: Any, references: list[Any], order: str = "sorted", target: str = "full") -> str:
    """ARENA's SFT target layout (arena.md §3.5) with a templated analysis citing each gold reference, in
    :func:`cited_numbers` order. ``target="relevance"``: the relevance block alone (a lever, not the paper's
    layout: the loss falls on the list that binds the question to its references, ~10 tokens, instead of ~2 of
    the full target's ~60; the model then stops after it, so such a warm start is for the probes, not GRPO)."""
    import re

    if target not in WARMUP_TARGETS:
        raise ValueError(f"warm-start target {target!r}: one of {WARMUP_TARGETS}")
    gold = cited_numbers(example, references, order)
    if target == "relevance":
        return relevance_block(gold)
    claims = []
    for i in gold:
        text = references[i - 1].text.replace("<", " ").strip()
        first = re.split(r"(?<=[.!?])\s+", text, maxsplit=1)[0]
        claims.append(f"Reference [{i}] states that {first}")
    analysis = " ".join(claims) + f" Therefore the answer is {example.answers[0]}."
    answer = example.answers[0]
    return f"<relevance>\n{gold}\n</relevance>\n\n<analysis>\n{analysis}\n</analysis>\n\n<answer>\n{answer}\n</answer>"


def warmup_questions(
    files: list[str], skip: int, count: int, agent: Any, fill: bool = False
) -> list[tuple[Any, list[Any]]]:
    """The warm start's questions with their shown references: ``count`` train questions, round-robin over ``files``
    after the first ``skip`` of each (which GRPO trains on), that have a gold answer and a supporting reference
    among the first ``agent.max_references``. A file that runs out leaves its turns empty (fewer than ``count``);
    ``fill``: the files that still have questions take its turns, until ``count`` or all run out."""
    from sleuth.data import load_examples

    pools = []  # per file, the usable questions after the first ``skip``
    for f in files:
        usable = []
        for example in load_examples(f, limit=skip + 4 * count)[skip:]:
            references = list(example.context)[: agent.max_references]
            if example.answers and any(p.id in set(example.supporting_ids) for p in references):
                usable.append((example, references))  # else no gold answer or no supporting reference shown
        pools.append(usable)
    # round r gives each file's r-th question; a file that has run out leaves an empty turn (None)
    turns = [pool[r] if r < len(pool) else None for r in range(max(map(len, pools), default=0)) for pool in pools]
    return [q for q in (turns if fill else turns[:count]) if q is not None][:count]


def warmup_records(
    files: list[str],
    skip: int,
    count: int,
    agent: Any,
    shuffles: int = 1,
    seed: int = 0,
    fill: bool = False,
    order: str = "sorted",
    target: str = "full",
) -> list[dict[str, Any]]:
    """The warm start's chat records: :func:`warmup_questions` with ARENA's prompt and the :func:`warmup_target`
    completion (``target``). ``shuffles`` > 1: each question that many times, in its given order and then in
    ``shuffles - 1`` random orders of its references (the gold numbers move with them), so a gold list goes with the
    references' words, not their places, and the warm start sees more relevance lists. ``order``:
    :func:`cited_numbers`."""
    import random

    from sleuth.agents.arena import arena_prompt

    records = []
    for example, references in warmup_questions(files, skip, count, agent, fill):
        orders = [references]
        rng = random.Random(f"{seed}:{example.id}")
        for _ in range(shuffles - 1):
            shuffled = list(references)
            rng.shuffle(shuffled)
            orders.append(shuffled)
        for shown in orders:
            prompt = arena_prompt(example.question, shown, agent.prompt)
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": warmup_target(example, shown, order, target)},
            ]
            records.append({"messages": messages})
    return records


def token_ids(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids: a list before transformers 5, a BatchEncoding since."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def warmup_training(model: Path) -> dict[str, Any] | None:
    """The warm start's training log read back beside what a reader of its targets' spread alone would score:
    ``log`` (TRL's mean completion-token loss every ``logging_steps``, from ``model/log.jsonl``), ``tokens`` (the
    completions' mean length in tokens as TRL masks them: the chat template of prompt and completion minus that of
    the prompt with its generation prompt), ``late_loss`` (the mean logged loss over the second half of the steps)
    and ``late_nats`` (that x ``tokens``: nats per completion), and ``list_entropy`` (nats: the entropy of the
    records' relevance lists, what a model that learns their spread but not which list a question asks for pays on
    a completion whose other tokens it copies). None when the log or the records are not on this machine."""
    import math
    import re

    log_path, records_path = model / "log.jsonl", model.parent / "records.jsonl"
    if not (log_path.exists() and records_path.exists()):
        return None
    by_step: dict[
        int, dict[str, Any]
    ] = {}  # a resumed warm start logs the steps after its checkpoint again: later wins
    unreadable = 0  # a run killed mid-write leaves a partial line; counted, not fatal
    for line in log_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            unreadable += 1
            continue
        if isinstance(row, dict) and "loss" in row and "step" in row:
            by_step[row["step"]] = {
                k: row[k] for k in ("step", "loss", "learning_rate", "mean_token_accuracy") if k in row
            }
    log = [by_step[step] for step in sorted(by_step)]
    if not log:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    if not records:
        return None
    lists: dict[str, int] = {}
    lengths = []
    for record in records:
        if "messages" in record:  # the warm start writes chat records; SFT splits them at the last turn
            record = {"prompt": record["messages"][:-1], "completion": record["messages"][-1:]}
        completion = record["completion"]
        text = completion[-1]["content"]
        found = re.search(r"<relevance>\s*(\[[^\]]*\])", text)
        key = found.group(1) if found else "none"
        lists[key] = lists.get(key, 0) + 1
        prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True)
        whole = tokenizer.apply_chat_template(record["prompt"] + completion, tokenize=True)
        lengths.append(len(token_ids(whole)) - len(token_ids(prompt)))
    tokens = sum(lengths) / len(lengths)
    late = [row["loss"] for row in log[len(log) // 2 :]]
    late_loss = sum(late) / len(late)
    entropy = -sum(n / len(records) * math.log(n / len(records)) for n in lists.values())
    return {
        "log": log,
        "unreadable_log_lines": unreadable,
        "records": len(records),
        "tokens": round(tokens, 2),
        "late_loss": round(late_loss, 4),
        "late_nats": round(late_loss * tokens, 3),
        "list_entropy": round(entropy, 3),
        "lists": dict(sorted(lists.items(), key=lambda kv: -kv[1])),
    }


def reported_training(model: Path, report: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`warmup_training` of ``model``, or, where the model was trained on another machine, the table the
    previous ``report`` (a results.json) read, kept only when that report's settings are ``settings`` (the same warm
    start; a different one's curve is never carried over)."""
    training = warmup_training(model)
    if training is None and report.exists():
        previous = json.loads(report.read_text())
        same = previous.get("settings") == json.loads(json.dumps(settings))  # as results.json round-trips them
        training = previous.get("warmup_training") if same else None
    return training


def training_lines(training: dict[str, Any] | None) -> list[str]:
    """The warm start's loss curve (:func:`warmup_training`) as the probe report shows it: at most 8 logged steps."""
    if not training:
        return ["The warm start's training log is not on this machine (its model was not trained or kept here).", ""]
    log = training["log"]
    shown = sorted({round(i * (len(log) - 1) / 7) for i in range(8)}) if len(log) > 8 else range(len(log))
    return [
        "| step | loss / token | learning rate |",
        "|---:|---:|---:|",
        *(f"| {log[i]['step']} | {log[i]['loss']:.4f} | {log[i].get('learning_rate', 0):.2e} |" for i in shown),
        "",
        f"Over the second half of the steps the loss is {training['late_loss']:.4f} per token, "
        f"x {training['tokens']:.1f} completion tokens = {training['late_nats']:.3f} nats per completion; the "
        f"entropy of the {training['records']} records' relevance lists is {training['list_entropy']:.3f} nats "
        f"({len(training['lists'])} distinct lists): a model that learns their spread but not which list a question "
        "asks for pays about that."
        + (
            f" {training['unreadable_log_lines']} unreadable log lines skipped."
            if training.get("unreadable_log_lines")
            else ""
        ),
        "",
    ]


def format_warmup(
    base: Path, records: list[dict[str, Any]], out: Path, lr: float, epochs: float = WARMUP_EPOCHS
) -> Path:
    """Fine-tune ``base`` on the chat ``records`` (:func:`warmup_records`) for ``epochs``; returns the merged model,
    ``out/model`` (a killed run resumes from its last checkpoint, every ``WARMUP_SAVE_STEPS`` optimizer steps)."""
    from sleuth.train.sft import SFTConfig, SFTSource, train_sft

    model = out / "model"
    if (model / "config.json").exists():
        return model
    out.mkdir(parents=True, exist_ok=True)
    data = out / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = SFTConfig(
        model=str(base),
        output_dir=str(model),
        sources=[SFTSource(path=str(data), kind="released", name="arena-format")],
        val_fraction=0.0,
        max_length=2048,
        epochs=epochs,
        learning_rate=lr,
        batch_size=8,
        per_device_batch_size=2,
        warmup_ratio=0.1,
        save_steps=WARMUP_SAVE_STEPS,
        logging_steps=2,
        gradient_checkpointing=False,
    ).validate()
    return Path(train_sft(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default $SLEUTH_HOME/runs/learn-arena)")
    parser.add_argument("--results", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--test-questions", type=int, default=34, help="held-out questions per dev file (reported)")
    parser.add_argument(
        "--test-start", type=int, default=0, help="the test slice starts at this question of each dev file"
    )
    parser.add_argument(
        "--dev-questions", type=int, default=34, help="per dev file, from its 101st question (0: no dev split)"
    )
    parser.add_argument(
        "--skip-base", action="store_true", help="do not evaluate the base model (no claim compares with it)"
    )
    parser.add_argument(
        "--declare-only",
        action="store_true",
        help="write the results directory's declaration.json (claims and settings) and stop; every later run into "
        "that directory must have the declared settings",
    )
    parser.add_argument("--train-questions", type=int, default=60, help="per train file (warm start: later ones)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="G (paper: 7)")
    parser.add_argument("--max-references", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-4, help="LoRA learning rate (paper: 3e-6, full fine-tuning)")
    parser.add_argument(
        "--accuracy",
        choices=("em", "f1"),
        default="em",
        help="accuracy reward: EM (the paper's default) or token F1 (the paper's Table 6 variant, denser)",
    )
    parser.add_argument(
        "--shuffle-references",
        action="store_true",
        help="GRPO: each episode of a group sees the references in its own random order (ArenaRLConfig."
        "shuffle_references, a deviation against a position prior; the evaluations keep the given order)",
    )
    parser.add_argument("--format-warmup", type=int, default=32, help="warm-start questions (0: none, as the paper)")
    parser.add_argument("--warmup-lr", type=float, default=1e-4, help="full fine-tuning rate of the warm start")
    parser.add_argument(
        "--warmup-shuffles",
        type=int,
        default=1,
        help="each warm-start question in its given order and in N-1 random orders of its references",
    )
    parser.add_argument(
        "--warmup-epochs", type=float, default=WARMUP_EPOCHS, help="passes of the warm start over its records"
    )
    parser.add_argument(
        "--warmup-fill",
        action="store_true",
        help="when a train file runs out of warm-start questions, the others take its turns (2Wiki's train file has "
        "~390 usable beyond GRPO's, HotpotQA's and MuSiQue's ~35 and ~27)",
    )
    parser.add_argument(
        "--warmup-order",
        choices=("sorted", "hops"),
        default="sorted",
        help="the order of the warm start's cited numbers (relevance list and analysis): ascending (arena.md §3.5) "
        "or the gold decomposition's hop order (a deviation; R_rel compares sets)",
    )
    parser.add_argument(
        "--warmup-target",
        choices=WARMUP_TARGETS,
        default="full",
        help="the warm start's completion: ARENA's full layout (relevance, analysis, answer) or the relevance block "
        "alone (a probe lever: the loss on the binding tokens only; needs --probe-only, the model writes no answer)",
    )
    parser.add_argument(
        "--warmup-from",
        type=Path,
        default=None,
        help="the model the warm start fine-tunes instead of the base (a curriculum: another warm start's "
        "`warmup-*/model`); the base is still the one evaluated and probed as 'base'",
    )
    parser.add_argument(
        "--probe-only",
        action="store_true",
        help="no evaluation and no GRPO: the teacher-forced citation preference (citation_preference) of the base "
        "(unless --skip-base) and warm-start models on the splits, the results directory's results.md/.json",
    )
    parser.add_argument(
        "--world",
        action="store_true",
        help="train and evaluate on a synthetic world with given references (WORLD: 2-hop questions, 4 references, "
        "~430 prompt tokens) instead of the dev and train files; --test/--dev-questions x 3 of its test and dev "
        "questions (as many as the dev files give); with --probe-only also the dev files' slices (transfer). "
        "Default work and results: runs/learn-arena-world, results/world",
    )
    parser.add_argument(
        "--world-hops",
        type=int,
        choices=(1, 2),
        default=2,
        help="with --world --probe-only: 1, the world's 1-hop twin (each question names its one gold reference's "
        "title among 4: the literal binding, chance 1/4; world_settings); default 2",
    )
    parser.add_argument(
        "--world-lookalikes",
        type=float,
        default=None,
        help="with --world --probe-only: the world's lookalike rate (default: the synthesizer's 0.5); 0: every "
        "distractor has a name of its own (world_settings)",
    )
    parser.add_argument("--llm-options", default="threads=2&max_batch=32")
    parser.add_argument(
        "--rollout-batch",
        type=int,
        default=0,
        help="rows per generate call of the hf rollouts (0: automatic, a GPU: a step's prompts x G, the CPU: 32); "
        "how, not what: not keyed",
    )
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
    args = parse_sized(parser, FULL)
    from sleuth.llm.vllm_server import gpu_visible
    from sleuth.train.common import auto_engine

    args.engine = "hf" if args.smoke and args.engine == "auto" else auto_engine(args.engine)
    if args.rollouts == "auto":
        args.rollouts = "vllm" if not args.smoke and gpu_visible() and auto_engine() == "vllm" else "hf"
    if args.rollouts == "vllm" and args.smoke:
        raise SystemExit("--rollouts vllm needs LoRA, which --smoke turns off")
    print(f"engine: {args.engine}, rollouts: {args.rollouts}", flush=True)

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Sampling
    from sleuth.train.arena_rl import ArenaRLConfig, train_arena
    from sleuth.train.rollouts import RolloutStore

    s = settings(args)
    work, results = run_dirs("learn_arena", args, RESULTS)
    # --probe-only evaluates no stage a claim compares: its report carries no claims table
    exp = Experiment("learn_arena", work, results, args.seed, claims=[] if args.probe_only else CLAIMS)
    agent = ArenaConfig(
        sampling=Sampling(max_new_tokens=s["agent"]["max_new_tokens"]), max_references=s["agent"]["max_references"]
    )
    agent_key = dataclasses.asdict(agent)
    dev_files = [str(DATA / f) for f in DEV]
    train_files = [str(DATA / f) for f in TRAIN]
    train_names: Any = TRAIN  # what the stage keys name as the training data
    e = s["eval"]
    slices = {"test": (e.get("test_start", 0), e["test_per_file"]), "dev": (e["dev_offset"], e["dev_per_file"])}
    slices = {split: (start, count) for split, (start, count) in slices.items() if count}
    splits = {split: slice_questions(dev_files, start, count) for split, (start, count) in slices.items()}
    split_keys = {split: {"files": DEV, "start": start, "per_file": count} for split, (start, count) in slices.items()}
    if args.world:
        world, _ = exp.synthetic_world(s["world"])  # its BM25 index is built and unused: the references are given
        train_files, train_names = [str(world / "train.jsonl")], {"world": s["world"], "file": "train"}
        real = {f"real {split}": (splits[split], split_keys[split]) for split in splits if args.probe_only}
        splits, split_keys = {}, {}
        for split, (start, count) in slices.items():  # the same number of questions as the dev files would give
            first, n = (start if split == "test" else 0) * len(DEV), count * len(DEV)
            splits[split] = slice_questions([str(world / f"{split}.jsonl")], first, n)
            split_keys[split] = {"files": {"world": s["world"], "file": split}, "start": first, "per_file": n}
        for split, (examples, key) in real.items():  # does what the world taught carry over to the dev files?
            splits[split], split_keys[split] = examples, key
    evaluations: dict[str, dict[str, dict[str, Any]]] = {split: {} for split in slices}
    trial_settings = {**s, "agent": agent_key, "engine": args.engine, "rollouts": args.rollouts}
    declared = None
    if args.declare_only or (exp.results / "declaration.json").exists():
        declared = declare(exp.results / "declaration.json", declaration(trial_settings, args.seed), fixed_part)
        print(f"declared ({declared['declared_at']}): {[c['name'] for c in CLAIMS]}", flush=True)
        if args.declare_only:
            return
    written = exp.results / "results.json"
    if args.probe_only and written.exists() and not json.loads(written.read_text()).get("probe_only"):
        raise SystemExit(f"--probe-only would overwrite {written}, a full run's report: pass --results DIR")
    base = base_model(args.smoke, exp.work)

    probes: dict[str, dict[str, dict[str, Any]]] = {split: {} for split in splits}
    every_list: dict[str, dict[str, dict[str, Any]]] = {split: {} for split in splits}
    probed = dict(splits)  # each probed split's questions

    def eval_key(model: Path, split: str) -> dict[str, Any]:
        return {"model": str(model), **split_keys[split], "agent": agent_key}

    # a warm start that writes its lists in hop order is probed on the set (every order); the ascending one on the
    # ascending block, as before (its keys unchanged)
    orders = "all" if s["warmup"].get("order", "sorted") == "hops" else "sorted"
    probe_key = {"lists": PREFERENCE_LISTS, "seed": args.seed, **({"orders": orders} if orders != "sorted" else {})}

    def measure(stage: str, model: Path) -> None:
        for split, examples in splits.items():
            key = eval_key(model, split)
            probes[split][stage] = exp.evaluate(
                stage,
                f"{split.replace(' ', '-')}-preference",
                {**key, "probe": probe_key},
                lambda examples=examples: citation_preference(
                    model, examples, agent, PROBE_OPTIONS, PREFERENCE_LISTS, args.seed, orders=orders
                ),
            )
            every_list[split][stage] = exp.evaluate(
                stage,
                f"{split.replace(' ', '-')}-every-list",
                {**key, "probe": {**probe_key, "lists": "all"}},
                lambda examples=examples: citation_preference(
                    model, examples, agent, EVERY_LIST_OPTIONS, None, args.seed, orders=orders
                ),
            )
            if args.probe_only:
                continue
            evaluations[split][stage] = exp.evaluate(
                stage,
                split,
                key,
                lambda examples=examples: evaluate(model, examples, agent, args.llm_options, args.engine),
            )

    for split, examples in splits.items():  # the same comparison for a reader of words alone: no model, not cached
        probes[split]["word overlap"] = overlap_preference(examples, agent, PREFERENCE_LISTS, args.seed)
        every_list[split]["word overlap"] = overlap_preference(examples, agent, None, args.seed)
        if not args.probe_only:
            continue
        probes[split]["base: question likelihood"] = exp.evaluate(  # does the base know the references? (probe-only)
            "base",
            f"{split.replace(' ', '-')}-likelihood",
            {
                **eval_key(base, split),
                "probe": {"lists": PREFERENCE_LISTS, "seed": args.seed, "prompt": LIKELIHOOD_PROMPT},
            },
            lambda examples=examples: likelihood_preference(
                base, examples, agent, PROBE_OPTIONS, PREFERENCE_LISTS, args.seed
            ),
        )
    if not args.skip_base:
        measure("base", base)
    start = base
    warm: dict[str, Any] | None = None
    if s["warmup"]["questions"]:
        w = s["warmup"]
        warm_key = {"base": str(base), "files": train_names, "warmup": w, "agent": agent_key, "seed": args.seed}

        def warm_start() -> dict[str, Any]:
            out = exp.stage_dir("warmup", warm_key)
            shuffles = w.get("shuffles", 1)
            records = warmup_records(
                train_files,
                w["after"],
                w["questions"],
                agent,
                shuffles,
                args.seed,
                w.get("fill", False),
                w.get("order", "sorted"),
                w.get("target", "full"),
            )
            begins = Path(w["from"]) if "from" in w else base  # --warmup-from: a curriculum's earlier warm start
            model = format_warmup(begins, records, out, w["lr"], w.get("epochs", WARMUP_EPOCHS))
            return {"model": str(model), "records": len(records), "questions": len(records) // shuffles}

        warm = exp.stage("warmup", warm_key, warm_start)
        start = Path(warm["model"])
        measure("warm start", start)
        if args.probe_only:  # does the warm start prefer the gold block on the questions it was trained on?
            trained = [
                e for e, _ in warmup_questions(train_files, w["after"], w["questions"], agent, w.get("fill", False))
            ][:OWN_PROBE_MAX]
            split = "warm start's own train questions"
            probed[split] = trained
            probes[split] = {"word overlap": overlap_preference(trained, agent, PREFERENCE_LISTS, args.seed)}
            every_list[split] = {"word overlap": overlap_preference(trained, agent, None, args.seed)}
            for stage, model in ([] if args.skip_base else [("base", base)]) + [("warm start", start)]:
                own_key = {
                    "model": str(model),
                    "files": train_names,
                    "after": w["after"],
                    "questions": w["questions"],
                    **({"first": OWN_PROBE_MAX} if w["questions"] > OWN_PROBE_MAX else {}),
                    **({"fill": True} if w.get("fill") else {}),
                    "agent": agent_key,
                }
                probes[split][stage] = exp.evaluate(
                    stage,
                    "train-preference",
                    {**own_key, "probe": probe_key},
                    lambda model=model: citation_preference(
                        model, trained, agent, PROBE_OPTIONS, PREFERENCE_LISTS, args.seed, orders=orders
                    ),
                )
                every_list[split][stage] = exp.evaluate(
                    stage,
                    "train-every-list",
                    {**own_key, "probe": {**probe_key, "lists": "all"}},
                    lambda model=model: citation_preference(
                        model, trained, agent, EVERY_LIST_OPTIONS, None, args.seed, orders=orders
                    ),
                )
    training = reported_training(start, written, trial_settings) if warm else None
    if args.probe_only:
        write_probe(exp, probes, trial_settings, args.seed, probed, agent, every_list, training)
        return

    grpo_key = {"model": str(start), "files": train_names, "grpo": s["grpo"], "agent": agent_key, "seed": args.seed}

    def train() -> dict[str, Any]:
        out = exp.stage_dir("grpo", grpo_key)
        g = s["grpo"]
        continued = continue_online_rl(exp, out, grpo_key, "grpo")
        config = ArenaRLConfig(
            model=str(start),
            output_dir=str(out),
            train_files=train_files,
            train_limit=g["train_per_file"],
            steps=g["steps"],
            prompts_per_step=g["prompts"],
            group_size=g["group"],
            learning_rate=g["lr"],
            warmup_steps=0,
            micro_batch=g["micro_batch"],
            lora=g["lora"],
            save_steps=g["save_steps"],
            seed=args.seed,
            agent=agent,
            accuracy=g.get("accuracy", "em"),
            shuffle_references=g.get("shuffle_references", False),
            rollout_batch=args.rollout_batch,  # 0: RLConfig.rows_per_generate (episodes in flight follow)
        )
        if args.rollouts == "vllm":  # the adapter trains on top of `start`, so the server serves `start`
            config.rollout_server = f"vllm:{start}?enable_lora=1&max_lora_rank={config.lora_r}"
        summary = train_arena(config)
        return online_rl_result(out, summary, continued)

    # one stage and directory per GRPO setting: settings tried on dev sit side by side on the same warm start
    grpo = exp.stage(exp.stage_dir("grpo", grpo_key).name, grpo_key, train)
    measure("GRPO", Path(grpo["model"]))

    before = "warm start" if warm else "base"
    pairs = [("GRPO", before)] + ([("warm start", "base"), ("GRPO", "base")] if warm else [])
    differences = {split: exp.differences(evaluations[split], pairs, METRICS) for split in evaluations}
    trials = exp.record_trial(trial_settings, evaluations["dev"], "f1") if "dev" in evaluations else []

    test = evaluations["test"]
    curve = {m: [(stage, ev["ci"][m]) for stage, ev in test.items()] for m in METRICS if m != "format_ok"}
    where = "the world's test questions" if args.world else "the dev files' held-out questions"
    plot(curve, exp.results / "curve.png", "test (%)", f"ARENA GRPO on {where} (95% CI)")
    curves = Path(grpo["dir"]) / "curves.png"
    if curves.exists():
        (exp.results / "curves.png").write_bytes(curves.read_bytes())

    log = grpo["log"]
    step_seconds = sum(r.get("seconds", 0.0) for r in log)  # the steps' own times, also across resumed runs
    steps = rollout_steps(Path(grpo["dir"]), log)
    episodes = []
    for row in steps:
        sampled = list(RolloutStore(Path(grpo["dir"]) / "rollouts" / f"step-{row['step']:05d}"))
        row["citations"] = citation_chance(sampled)
        episodes += sampled
    outcomes = citation_outcomes(episodes)
    trained = json.loads((Path(grpo["dir"]) / "config.json").read_text())
    pushed = citation_advantages(episodes, eps=trained["adv_eps"])
    models = {stage: short(ev["model"]) for stage, ev in test.items()}
    g = s["grpo"]
    if args.world:
        held_out = (
            f"Test (held out): questions {split_keys['test']['start'] + 1}-"
            f"{split_keys['test']['start'] + len(splits['test'])} of the synthetic world's test split (`--world`, "
            f"entities disjoint from train's); "
            + (f"dev: the first {len(splits['dev'])} of its dev split. " if "dev" in splits else "no dev split. ")
        )
    else:
        held_out = (
            f"Test (held out): questions {slices['test'][0] + 1}-{sum(slices['test'])} of each dev file "
            f"({len(splits['test'])} in all); "
            + (
                f"dev: {e['dev_per_file']} per dev file from question {e['dev_offset'] + 1} on "
                f"({len(splits['dev'])}). "
                if "dev" in splits
                else "no dev split. "
            )
        )
    lines = exp.header(
        "Learning benchmark: ARENA GRPO (LoRA) on "
        + ("a synthetic world with given references" if args.world else "the multi-hop train files"),
        held_out
        + ("The base model is not evaluated (--skip-base). " if args.skip_base else "")
        + (
            f"Declared in `declaration.json` ({declared['declared_at']}, commit {declared['commit'][:10]}) before "
            "any evaluation. "
            if declared
            else ""
        )
        + f"{len(log)} GRPO steps x {g['prompts']} questions x G={g['group']} ({step_seconds:.0f} s of steps); format "
        f"warm start on {warm.get('questions', warm['records']) if warm else 0} questions. "
        f"Engine {args.engine}, rollouts {args.rollouts}. "
        "Means with 95% bootstrap CIs over questions (1000 resamples). Settings are compared on dev (F1) only."
        + (
            f" The first steps were trained by the run {short(grpo['continued_from'])} and continued here "
            "(the same settings but the step count; its steps' times are counted)."
            if grpo.get("continued_from")
            else ""
        ),
    )
    lines += ["## Test (held out)", "", *stage_table(test, METRICS, models), ""]
    lines += [*difference_table(differences["test"], METRICS), ""]
    if before in test:
        lines += [format_split(test[before]["per_example"], test["GRPO"]["per_example"], before), ""]
    lines += [
        "## GRPO steps",
        "",
        "Reward over each step's episodes, from the rollouts the step trained on, and the mean of each component "
        "(format, accuracy, relevance, bonus: arena.md §4.1). A group's advantages are non-zero only when its G "
        "rewards differ; a component earned by no episode of a mixed group gives that component no direction.",
        "",
        *step_table(steps, [(c, c) for c in ("format", "accuracy", "relevance", "bonus")], groups=True),
        "",
        "Sampled citations against chance (`citation_chance`): per episode whose shown references include a "
        "supporting one, the means of citation recall, precision (over episodes citing any) and the relevance "
        "reward, each beside its expectation for as many references drawn at random from those shown; word overlap: "
        "the recall of as many references ranked by the question words they contain (`overlap_order`); cites 1 "
        "where not gold: the share of the episodes whose supporting references lack reference 1 that cite it.",
        "",
        *citation_table(steps),
        "",
        "Accuracy by citation (`citation_outcomes`): all steps' episodes with a supporting reference shown, by how "
        "their cited numbers meet the gold ones.",
        "",
        *outcome_table(outcomes),
        "",
        "Where the advantages push the first cited number (`citation_advantages`): all steps' episodes with a "
        "supporting reference shown, by the first number written in `<relevance>`, with their summed GRPO advantage "
        "(recomputed from the rewards the steps trained on, per group), where the gold numbers hold reference 1 and "
        "where they lack it. A group's advantages sum to 0, so for a policy whose first number ignores the "
        'references the push on writing a number first is its "all" sum: positive on 1, GRPO teaches that '
        "policy to cite 1 whatever the question, the best guess of a reader that cannot read; only the split by "
        "gold reaches one that reads.",
        "",
        *advantage_table(pushed),
        "",
        *(["## The warm start's training", "", TRAINING_TEXT, "", *training_lines(training)] if warm else []),
        "## Citation preference (teacher-forced)",
        "",
        PREFERENCE_TEXT,
        "",
        *preference_table(probes, args.seed),
        "",
        PRIOR_FREE_TEXT,
        "",
        *prior_free_table(every_list, args.seed),
        "",
        PLACE_TEXT,
        "",
        *place_tables(probes, splits, agent, args.seed, evaluations, every_list),
    ]
    if "dev" in evaluations:
        lines += ["## Dev", "", *stage_table(evaluations["dev"], METRICS), ""]
        lines += [*difference_table(differences["dev"], METRICS), ""]
        lines += ["## Settings tried", "", *trials_table(trials), ""]
    lines += [exp.seconds_line(), ""]
    lines += ["Training curves: `curves.png` (reward components, KL, entropy, response length per step).", ""]
    lines += settings_block(trial_settings)
    exp.write(
        {
            "smoke": args.smoke,
            "settings": trial_settings,
            "evaluations": evaluations,
            "differences": differences,
            "warmup": warm,
            "training": grpo,
            "steps": steps,
            "citation_outcomes": outcomes,
            "citation_advantages": pushed,
            "citation_preference": probes,
            "every_list": every_list,
            **({"warmup_training": training} if training else {}),
            "trials": trials,
            **({"declaration": declared} if declared else {}),
        },
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
