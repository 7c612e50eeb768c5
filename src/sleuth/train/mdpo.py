"""AceSearcher stage II: iterative ("multi-turn") DPO over self-sampled decompositions and solver runs.

Size: one module on purpose (about 1,100 lines): sampling, rewards, pair building and DPO share the iteration's
on-disk layout and its resumption; the plumbing shared with the other trainers is in :mod:`sleuth.train.common`.

Paper: Xu et al., *AceSearcher*, NeurIPS 2025 (arXiv 2509.24193), §4.2-§4.3 and App. F.2;
docs/training.md ("mDPO") lists where sleuth follows it and where it deviates. One iteration t, with policy θ(t):

1. **Sample** (§4.3). For every training question, ``decompositions`` (m = 3) runs of the ``acesearcher`` agent at
   temperature 1.0; each samples a decomposition z and a first solver trajectory under it. Then ``solutions - 1``
   (m' - 1 = 3) more agent runs per sampled z with z *fixed* (``Example.metadata[GIVEN_DECOMPOSITION]``): sub-answers
   and the final answer are sampled, the decomposition call is skipped. Every run is stored in the rollout store
   ``OUT/iter{t}/rollouts`` (keys ``{question}#{i}`` for the run that sampled z_i, ``{question}#{i}#{j}`` for the
   fixed-z runs), so a killed run resumes where it stopped.
2. **Score** every trajectory (Eq. 4.1): ``reward="paper"`` is EM(a', a) x format-valid, ``reward="code"`` the
   released code's EM + Acc + F1 in [0, 3] (see :func:`trajectory_reward` and :func:`format_checks`).
3. **Pairs** (§4.4), TRL conversational preference records in ``OUT/iter{t}/pairs.jsonl``:

   - ``decompose``: per question, the decomposition with the highest mean reward over its solver runs vs the one with
     the lowest (identical decompositions are merged first); prompt = the decomposition prompt.
   - ``subq``: per decomposition, the best trajectory T+ vs the worst T-; for every sub-question i whose answers
     differ, prompt = T+'s sub-question prompt (its resolved sub-question and passages), chosen/rejected = the two
     sub-answer outputs.
   - ``final``: per decomposition, prompt = T+'s final-answer prompt (its sub-answers and passage pool),
     chosen/rejected = the final outputs of T+ and T-.

   ``pair_rule="paper"`` (default): ties (best reward == worst reward) are dropped, as the paper says.
   ``pair_rule="reference"``: the released ``create_dpo_pairs.py`` gates on its 0-3 score (:func:`reference_gate`),
   and a final pair also needs T+ and T- to agree on at least 0.666 of the sub-answers. Every group that gives no
   pair is counted by reason in the iteration's stats (``degenerate``) instead of failing.
   ``rejected="greedy"`` (a deviation, off by default): each pair's rejected side is θ(t)'s greedy output on the
   pair's prompt instead (:func:`on_policy_pairs`); pairs where that output already gives the chosen answer go.
4. **DPO** (§4.5) with TRL's ``DPOTrainer``: sigmoid loss, β = 0.1, initialised from θ(t) with the frozen reference
   θ(t) (the previous iteration's model; iteration 1: the SFT model), optionally plus the released configs' chosen-NLL
   term (``nll_weight``, LLaMA-Factory ``pref_ftx``) and LoRA (merged after training). Checkpoints resume.
5. **Evaluate** the new model greedily on dev questions (EM), write ``OUT/iter{t}/stats.json``.

Sampling and evaluation run on ``engine``: ``hf`` (default; the ``hf:`` backend with ``llm_options``, loaded per
stage), ``vllm`` (a vLLM server sleuth starts on the iteration's model directory: θ(t) for sampling, θ(t+1) for the
evaluation, which then also samples iteration t+1 on the same server; the server is stopped before DPO trains, so
the trainer has the memory and the cores), or a spec template with ``{model}``
(``vllm:{model}?tensor_parallel=2&max_model_len=8192``). LoRA models are merged after training, so the server always
loads plain weights. ``stats.json`` records the engine that sampled (``sampling_engine``) and evaluated.

Output layout (an iteration whose ``model`` directory exists is skipped on a rerun)::

    OUT/config.json
    OUT/index/                   BM25 index of the corpus (when no index was given)
    OUT/iter{t}/rollouts/        rollout store (store.json + rollouts.jsonl)
    OUT/iter{t}/pairs.jsonl      preference pairs (format: docs/training.md "mDPO")
    OUT/iter{t}/greedy.jsonl     θ(t)'s greedy output on each pair prompt (rejected="greedy" only)
    OUT/iter{t}/trainer/         DPO checkpoints (removed once the model is saved, unless keep_checkpoints)
    OUT/iter{t}/model/           θ(t+1), a plain transformers directory
    OUT/iter{t}/stats.json       pairs per set, rewards, margins, DPO accuracy, dev EM
    OUT/summary.json

>>> summary = train_mdpo(load_config(MDPOConfig, "configs/mdpo_synth.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.agents.acesearcher import (
    GIVEN_DECOMPOSITION,
    AceSearcherConfig,
    clean_subanswer,
    extract_answer,
    is_fact,
    parse_decomposition,
)
from sleuth.claims import claim_label
from sleuth.eval.metrics import (
    accuracy,
    claim_accuracy,
    exact_match,
    f1_score,
    normalize_answer,
    score_example,
)
from sleuth.llm import LLM
from sleuth.llm.base import Request, Sampling
from sleuth.records import Example, Step, Trace
from sleuth.retrieval import Retriever
from sleuth.train import common
from sleuth.train.common import Engines, HFTrainConfig, WorldConfig, engine_spec, evaluate_dev, log
from sleuth.train.config import load_config, to_mapping
from sleuth.train.rollouts import STORE_MANIFEST, Rollout, RolloutStore, collect, rollout_producer
from sleuth.train.tracking import Tracker, hf_reporting

__all__ = [
    "MDPO_KEY",
    "PAIR_SETS",
    "REFERENCE_MIN_AGREEMENT",
    "MDPOConfig",
    "Trajectory",
    "build_dpo_trainer",
    "build_pairs",
    "format_checks",
    "greedy_outputs",
    "load_pairs",
    "main",
    "on_policy_pairs",
    "pending_rollouts",
    "reference_gate",
    "sample_rollouts",
    "train_dpo",
    "train_mdpo",
    "trajectories",
    "trajectory_reward",
    "write_pairs",
]

PAIR_SETS: tuple[str, ...] = ("decompose", "subq", "final")
MDPO_KEY = "mdpo"  # Example.metadata key: {"question_id", "decomposition"} of a sampled run
METHOD = "acesearcher"
REUSED_FILE = "rollouts_reused_from.json"  # in an iteration's directory: the store its rollouts were copied from


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MDPOConfig(HFTrainConfig, WorldConfig):
    """Options of ``sleuth train acesearcher``. Defaults follow the paper; comments name the released code's value.

    Data: ``train_file``/``dev_file`` (Example jsonl), ``corpus`` (passages) and ``index`` (a retriever spec). With
    ``data_dir`` set, they default to its ``train.jsonl``/``dev.jsonl``/``corpus.jsonl``, and a non-empty ``synth``
    (keyword arguments of :func:`sleuth.data.synth.synthesize`) first generates a synthetic world there if it has no
    ``world.json``. Without ``index``, a BM25 index of ``corpus`` is built in ``OUT/index``. The options every
    trainer shares (model, optimiser, LoRA, engine, ...) are :class:`~sleuth.train.common.HFTrainConfig`'s and
    :class:`~sleuth.train.common.WorldConfig`'s; here ``batch_size`` counts pairs per optimizer step.
    """

    model: str = "default"  # θ(1), the SFT model: a transformers directory, or "default" (the embedded SmolLM2)
    output_dir: str = "runs/mdpo"
    # A deviation, off by default (the paper samples the same RFT prompts every iteration, 49K of them): iteration t
    # samples the t-th block of train_limit questions, so that at a small train_limit iteration 2 does not train
    # again on the questions iteration 1 trained on. Iteration 1 is the same as without it.
    fresh_questions: bool = False
    agent: AceSearcherConfig = field(default_factory=AceSearcherConfig)  # evaluation uses it as is (greedy)
    # Sampling [paper §4.3, App. F.2]; the rollouts use `agent` with this temperature / top_p.
    decompositions: int = 3  # m
    solutions: int = 4  # m'
    temperature: float = 1.0  # code: 0.7
    top_p: float = 1.0  # code: 0.99
    # Rewards and pairs [paper Eq. 4.1, §4.4]
    reward: Literal["paper", "code"] = "paper"
    # "paper": drop ties (best == worst reward), and gaps <= min_margin; "reference": the released code's gates
    # (reference_gate, and final pairs need sub-answer agreement >= REFERENCE_MIN_AGREEMENT); needs reward="code".
    pair_rule: Literal["paper", "reference"] = "paper"
    min_margin: float = 0.0  # pair_rule "paper" only: keep a pair only if best - worst > min_margin
    # sub-answer agreement (which T- a final pair takes, and pair_rule "reference"'s 0.666 gate): "reference" (the
    # released create_train_data.py, the default as the paper defines none: lower().strip(), "0".."10" as words,
    # over the losing run's sub-questions) or "normalised" (sleuth's answer normaliser over both runs' sub-questions)
    agreement: Literal["reference", "normalised"] = "reference"
    pair_sets: tuple[str, ...] = PAIR_SETS  # the released mix has no "subq" pairs
    # A deviation, off by default. "sampled": T-'s outputs, as the paper. "greedy": on-policy rejected sides: the
    # policy's greedy output on each pair's prompt; a subq/final pair takes it as the rejected side when its answer
    # differs from the chosen one, and a pair of any set is dropped when the greedy output already gives the chosen
    # answer (decompose pairs keep the sampled rejected side: a decomposition has no reward of its own). Why: the
    # issue-36 diagnosis found the SFT model's greedy output already equal to the chosen side in 71% of the pairs,
    # so DPO pushed down sampled completions (~22 nats less likely) that greedy decoding never produces.
    rejected: Literal["sampled", "greedy"] = "sampled"
    # "every": D_subq / D_final from every sampled decomposition (as the code does); "best": only from the
    # decomposition with the highest mean reward (one set of pairs per question, as the paper's notation suggests).
    pairs_from: Literal["every", "best"] = "every"
    # D_decompose completions: "raw" = the model's output as sampled; "canonical" = re-serialised
    # "### Q<k>: text" lines, as the released create_dpo_pairs.py writes them.
    decomposition_completion: Literal["raw", "canonical"] = "raw"
    # A deviation, off by default. "paper": D_decompose pairs the best against the worst decomposition by mean reward.
    # "same_length": against the worst one with as many sub-questions as the best (no pair when there is none), so a
    # pair says which decomposition of a given length is better, not how many steps to take. Why: the issue-36
    # diagnosis traced mDPO-1's loss to its decomposition pairs: mostly from 3-hop questions, their chosen sides have
    # three sub-questions in 21 of 29, and the trained model gave 13 of the 18 test questions it lost (2-hop ones) an
    # invented third hop.
    decompose_pairs: Literal["paper", "same_length"] = "paper"
    # DPO [paper §4.5, App. F.2]
    iterations: int = 2  # T
    beta: float = 0.1  # the released 8B config: 0.5
    nll_weight: float = 0.0  # the released configs' pref_ftx: 0.2-0.5 (see build_dpo_trainer)
    learning_rate: float = 1e-6  # 1.5B: 1e-6; 8B/14B: 5e-7; 32B LoRA: 1e-6
    # A deviation, off by default (the paper trains every iteration at one rate): iterations 2..T train at this rate,
    # so that a rate large enough to move the SFT model in iteration 1 need not be the rate θ(2) trains at.
    later_learning_rate: float | None = None
    lr_scheduler: str = "linear"  # the paper states none; the released configs use cosine
    adam_beta2: float = 0.98  # paper App. F; LLaMA-Factory's default (used by the released configs) is 0.999
    max_length: int | None = 2048  # prompt + completion tokens (paper: 2048 / 2560; code cutoff 2100-2200)
    lora_r: int = 8  # paper (32B); the released config: 16 (with LoRA: lora_alpha 16 on all linear layers)
    precompute_ref_log_probs: bool = False
    keep_checkpoints: bool = False
    eval_initial: bool = True  # also evaluate θ(1) on dev (iteration 1's stats: dev_initial)
    # Earlier runs' output_dirs: each iteration starts from the first of their iter{t} rollout stores that has this
    # run's producer (same model weights, agent settings, m, m', seed) and only this iteration's questions, so
    # another DPO setting (beta, learning_rate, nll_weight, ...) on the same starting model trains on the very samples
    # of the first without drawing them again. A plain string is one directory.
    rollouts_from: tuple[str, ...] = ()
    # Diagnosis (not in the paper): hold out the pairs of this share of each iteration's questions from DPO and
    # evaluate the implicit reward on them every heldout_eval_steps optimizer steps and at the end (TRL's eval
    # rewards/accuracies, margins, chosen/rejected log-probs: train_metrics.json "heldout"). 0: train on all pairs.
    heldout_pairs: float = 0.0
    heldout_eval_steps: int = 5

    def validate(self) -> None:
        """Raise ValueError for option values train_mdpo cannot run with."""
        if self.fresh_questions and not self.train_limit:
            raise ValueError("fresh_questions needs train_limit, the number of questions per iteration")
        if self.reward not in ("paper", "code"):
            raise ValueError(f"reward={self.reward!r}; expected 'paper' or 'code'")
        if self.pair_rule not in ("paper", "reference"):
            raise ValueError(f"pair_rule={self.pair_rule!r}; expected 'paper' or 'reference'")
        if self.agreement not in ("reference", "normalised"):
            raise ValueError(f"agreement={self.agreement!r}; expected 'reference' or 'normalised'")
        if self.pair_rule == "reference" and self.reward != "code":
            raise ValueError("pair_rule='reference' gates on the released code's 0-3 score: set reward='code'")
        if self.pair_rule == "reference" and self.min_margin:
            raise ValueError("min_margin belongs to pair_rule='paper'; the reference rule has its own gates")
        if self.rejected not in ("sampled", "greedy"):
            raise ValueError(f"rejected={self.rejected!r}; expected 'sampled' or 'greedy'")
        if self.pairs_from not in ("every", "best"):
            raise ValueError(f"pairs_from={self.pairs_from!r}; expected 'every' or 'best'")
        if self.decompose_pairs not in ("paper", "same_length"):
            raise ValueError(f"decompose_pairs={self.decompose_pairs!r}; expected 'paper' or 'same_length'")
        if self.decomposition_completion not in ("raw", "canonical"):
            raise ValueError(f"decomposition_completion={self.decomposition_completion!r}; expected 'raw'/'canonical'")
        unknown = set(self.pair_sets) - set(PAIR_SETS)
        if unknown:
            raise ValueError(f"pair_sets has unknown set(s) {sorted(unknown)}; known: {PAIR_SETS}")
        for name in ("decompositions", "solutions", "iterations", "batch_size", "per_device_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError("warmup_ratio must be in [0, 1)")
        if not 0.0 <= self.heldout_pairs < 1.0:
            raise ValueError("heldout_pairs must be in [0, 1): the share of questions whose pairs are held out")
        if self.heldout_eval_steps < 1:
            raise ValueError("heldout_eval_steps must be >= 1")
        if self.later_learning_rate is not None and self.later_learning_rate <= 0:
            raise ValueError("later_learning_rate must be > 0 (None: every iteration at learning_rate)")
        engine_spec(self, Path("MODEL"))
        self.agent.validate()

    def questions_to_read(self) -> int | None:
        """``train_limit``, or with ``fresh_questions`` one block of it per iteration."""
        return common.questions_read(self.train_limit, self.iterations, self.fresh_questions)

    def rollout_agent(self) -> AceSearcherConfig:
        """The agent config of the sampled runs: ``agent`` with the rollout temperature and top_p."""
        return common.with_sampling(self.agent, self.temperature, self.top_p)


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


def _tagged(example: Example, question_id: str, decomposition: int | None, given: str | None = None) -> Example:
    copy = Example.from_dict(example.to_dict())
    copy.metadata[MDPO_KEY] = {"question_id": question_id, "decomposition": decomposition}
    if given is not None:
        copy.id = f"{question_id}#{decomposition}"
        copy.metadata[GIVEN_DECOMPOSITION] = given
    return copy


def _decompose_step(trace: Trace) -> Step | None:
    return next((s for s in trace.steps if s.kind == "decompose"), None)


def _question_of(rollout: Rollout) -> str:
    """The training question a sampled run belongs to (a fixed-decomposition run's group is ``{q}#{i}``)."""
    return (rollout.trace.example.metadata.get(MDPO_KEY) or {}).get("question_id") or rollout.group


def rollout_sources(config: MDPOConfig) -> tuple[str, ...]:
    """``config.rollouts_from`` as a tuple of directories (a plain string is one)."""
    sources = config.rollouts_from
    return tuple(d for d in ((sources,) if isinstance(sources, str) else sources) if d)


def _reuse_rollouts(
    source: Path, target: Path, producer: dict[str, Any], questions: set[str], config: MDPOConfig
) -> bool:
    """Copy the rollout store ``source`` to ``target`` when its producer is ``producer`` and it holds rollouts of
    ``questions`` only (``rollouts_from``); say why not otherwise. The store's own check still guards the copy when
    it is opened."""
    manifest = source / STORE_MANIFEST
    if not manifest.exists():
        _log(config, f"rollouts_from: {source} holds no rollouts; sampling")
        return False
    theirs = json.loads(manifest.read_text())
    ours = json.loads(json.dumps(producer, default=str))
    changed = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    # the same weights in another directory (an iteration a benchmark copied from a sibling run): the revision
    # fingerprints the weight files (names, sizes, mtimes, which a copy keeps), the path does not matter
    if changed == ["model"] and ours.get("model_revision") and theirs.get("model_revision") == ours["model_revision"]:
        changed = []
    if changed:
        _log(config, f"rollouts_from: {source} has another producer (differs in {changed}); sampling")
        return False
    others = sorted({_question_of(r) for r in RolloutStore(source)} - questions)
    if others:  # build_pairs takes every rollout of the store: another question block must not leak in
        _log(config, f"rollouts_from: {source} holds {len(others)} questions this iteration does not sample; sampling")
        return False
    # copied aside and renamed, with this run's producer, so that a kill never leaves a store a resumed run refuses
    partial = target.with_name(target.name + ".copying")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    (partial / STORE_MANIFEST).write_text(json.dumps(ours, indent=2) + "\n")
    # a resumed iteration finds the copy already there: the record of where it came from outlives this call
    common.write_json(target.parent / REUSED_FILE, {"rollouts_reused_from": str(source)})
    partial.rename(target)
    greedy = source.parent / "greedy.jsonl"  # the same policy and agent: its greedy outputs on the pair prompts too
    if config.rejected == "greedy" and greedy.exists() and not (target.parent / "greedy.jsonl").exists():
        shutil.copyfile(greedy, target.parent / "greedy.jsonl")
    _log(config, f"rollouts_from: reusing {source} ({len(RolloutStore(target))} rollouts)")
    return True


def _fixed_decomposition_runs(store: RolloutStore, wanted: set[str]) -> list[Example]:
    """The examples of the m'-1 further solver runs of every sampled decomposition of the questions ``wanted``."""
    fixed: list[Example] = []
    for rollout in store:
        info = rollout.trace.example.metadata.get(MDPO_KEY) or {}
        if info.get("decomposition") is not None or rollout.group not in wanted:
            continue
        step = _decompose_step(rollout.trace)
        if step is None or step.output is None:
            continue
        fixed.append(_tagged(rollout.trace.example, rollout.group, rollout.sample, given=step.output))
    fixed.sort(key=lambda e: e.id)
    return fixed


def pending_rollouts(examples: Iterable[Example], store: RolloutStore, decompositions: int, solutions: int) -> int:
    """How many runs :func:`sample_rollouts` would still sample into ``store``; 0 when it has nothing to do (no LLM
    is needed). While decompositions are missing it counts only them: their further runs depend on their output."""
    examples = list(examples)
    done = store.keys()
    missing = sum(f"{e.id}#{i}" not in done for e in examples for i in range(decompositions))
    if missing or solutions < 2:
        return missing
    fixed = _fixed_decomposition_runs(store, {e.id for e in examples})
    return sum(f"{e.id}#{j}" not in done for e in fixed for j in range(solutions - 1))


def sample_rollouts(
    examples: Iterable[Example],
    ctx: Context,
    store: RolloutStore,
    decompositions: int = 3,
    solutions: int = 4,
    concurrency: int = 64,
    progress: bool = False,
) -> int:
    """Sample m decompositions per question and m' solver runs per decomposition into ``store``; returns the number of
    new rollouts. ``ctx.config`` must sample (temperature > 0). Keys already in the store are not sampled again.

    Run ``{q}#{i}`` samples decomposition i of question q and its first solver run; runs ``{q}#{i}#{j}``
    (j = 0..m'-2) reuse that decomposition's output text verbatim, so their only model calls are sub-answers and the
    final answer. A run that failed before its decomposition has no fixed-z runs (counted in the pair stats).
    """
    examples = list(examples)
    wanted = {e.id for e in examples}
    first = [_tagged(e, e.id, None) for e in examples]
    new = collect(METHOD, first, ctx, store, samples=decompositions, concurrency=concurrency, progress=progress)
    if solutions < 2:
        return new
    fixed = _fixed_decomposition_runs(store, wanted)
    new += collect(METHOD, fixed, ctx, store, samples=solutions - 1, concurrency=concurrency, progress=progress)
    return new


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------

# Sub-answer fallbacks that mean the step has no usable answer (clean_subanswer / _solve in agents/acesearcher.py).
_BAD_SUBANSWER = {"empty_subanswer", "no_yes_no", "unresolved_reference"}


def format_checks(trace: Trace) -> dict[str, bool]:
    """The structure checks behind the paper's format indicator f (Eq. 4.1), which the paper leaves unspecified.

    - ``completed``: the run finished (no ``trace.error``) with a final-answer step;
    - ``decomposition``: the decomposition parsed without any fallback (``### Q<k>: text`` lines numbered 1..n, at
      most ``max_subquestions``);
    - ``subanswers``: every sub-question got a non-empty answer (claims: Yes/No) and no ``#k`` stayed unresolved;
    - ``answer_tags``: the final output holds a closed, non-empty ``<answer>...</answer>`` (claims: a Yes/No label).

    A trajectory is format-valid when all hold. Multi-line sub-answers (fallback ``first_line``) pass: their first
    line is taken without guessing.
    """
    decompose = _decompose_step(trace)
    subanswers = [s for s in trace.steps if s.kind == "subanswer"]
    final = next((s for s in reversed(trace.steps) if s.kind == "answer"), None)

    def bad(step: Step) -> bool:
        return not step.parsed or bool(set((step.fallback or "").split("+")) & _BAD_SUBANSWER)

    return {
        "completed": trace.error is None and final is not None,
        "decomposition": decompose is not None and decompose.fallback is None and bool(decompose.parsed),
        "subanswers": bool(subanswers) and not any(bad(s) for s in subanswers),
        "answer_tags": final is not None and final.fallback is None and bool(final.parsed),
    }


def _code_score(example: Example, answer: str) -> float:
    """The released ``create_train_data.py`` score: EM + Acc + F1 on SQuAD-normalised text (number words for the
    prediction), Acc as two-way containment, F1 over token sets; a yes/no gold scores Acc three times. An empty
    prediction scores 0 (the code gives it Acc = 1, a bug the digest says not to copy)."""
    if example.kind == "claim":
        return 3.0 * claim_accuracy(answer, example.answers)
    acc = accuracy(answer, example.answers, "acesearcher", mode="either")
    if any(normalize_answer(str(g), style="squad") in ("yes", "no") for g in example.answers):
        return 3.0 * acc
    em = exact_match(answer, example.answers, "acesearcher")
    return em + acc + f1_score(answer, example.answers, "acesearcher", overlap="set")


def trajectory_reward(trace: Trace, reward: str = "paper") -> tuple[float, dict[str, bool]]:
    """The reward of one solver trajectory and its :func:`format_checks`.

    ``"paper"`` (Eq. 4.1): EM(a', a) x 1[all format checks hold], EM as in evaluation (``score_example``; claims:
    the Yes/No label). ``"code"``: :func:`_code_score` when the answer was inside ``<answer>`` tags and the run
    finished, else 0 (the code reads the prediction from the tags only; it has no other format term).
    """
    checks = format_checks(trace)
    answer = trace.answer or ""
    if reward == "paper":
        em = score_example(trace.example, answer).get("em") or 0.0
        return (float(em) if all(checks.values()) else 0.0), checks
    if reward == "code":
        ok = checks["completed"] and checks["answer_tags"]
        return (_code_score(trace.example, answer) if ok else 0.0), checks
    raise ValueError(f"unknown reward {reward!r}; expected 'paper' or 'code'")


# ---------------------------------------------------------------------------------------------------------------
# Preference pairs
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """One scored solver run: decomposition ``decomposition`` of question ``question_id``, solver run ``solution``
    under it (0 = the run that sampled the decomposition)."""

    key: str
    question_id: str
    decomposition: int
    solution: int
    trace: Trace
    reward: float
    checks: dict[str, bool]

    @property
    def failed(self) -> bool:
        return self.trace.error is not None

    def subanswer_steps(self) -> dict[int, Step]:
        steps = self.trace.steps
        return {s.meta["subquestion"]: s for s in steps if s.kind == "subanswer" and "subquestion" in s.meta}

    def final_step(self) -> Step | None:
        return next((s for s in reversed(self.trace.steps) if s.kind == "answer"), None)

    @property
    def em(self) -> float:
        """Exact match of the run's final answer (as evaluation scores it), whatever the training reward."""
        return float(score_example(self.trace.example, self.trace.answer or "").get("em") or 0.0)


def trajectories(rollouts: Iterable[Rollout], reward: str = "paper") -> dict[str, list[Trajectory]]:
    """Scored trajectories by question id, each list ordered by (decomposition, solution)."""
    out: dict[str, list[Trajectory]] = {}
    for rollout in rollouts:
        info = rollout.trace.example.metadata.get(MDPO_KEY) or {}
        question = str(info.get("question_id") or rollout.group)
        if info.get("decomposition") is None:
            decomposition, solution = rollout.sample, 0
        else:
            decomposition, solution = int(info["decomposition"]), rollout.sample + 1
        value, checks = trajectory_reward(rollout.trace, reward)
        out.setdefault(question, []).append(
            Trajectory(rollout.key, question, decomposition, solution, rollout.trace, value, checks)
        )
    return {q: sorted(ts, key=lambda t: (t.decomposition, t.solution)) for q, ts in sorted(out.items())}


@dataclass
class _Decomposition:
    """A distinct decomposition of one question: sampled decompositions that parsed to the same sub-questions with
    the same fallback are merged, their solver runs pooled."""

    index: int
    text: str
    prompt: list[dict[str, str]] | None
    subquestions: list[str]
    clean: bool
    members: list[int] = field(default_factory=list)
    runs: list[Trajectory] = field(default_factory=list)

    @property
    def valid_runs(self) -> list[Trajectory]:
        return [t for t in self.runs if not t.failed]

    @property
    def mean_reward(self) -> float:
        runs = self.valid_runs
        return sum(t.reward for t in runs) / len(runs) if runs else 0.0

    @property
    def mean_em(self) -> float:
        runs = self.valid_runs
        return sum(t.em for t in runs) / len(runs) if runs else 0.0

    def completion(self, style: str) -> str:
        if style == "canonical":
            return "\n".join(f"### Q{i}: {text}" for i, text in enumerate(self.subquestions, 1))
        return self.text


def _decompositions(runs: list[Trajectory], degenerate: Counter[str]) -> list[_Decomposition]:
    by_index: dict[int, list[Trajectory]] = {}
    for t in runs:
        by_index.setdefault(t.decomposition, []).append(t)
    merged: dict[tuple[Any, ...], _Decomposition] = {}
    for index in sorted(by_index):
        members = by_index[index]
        sampled = next((t for t in members if t.solution == 0), None)
        source = next((_decompose_step(t.trace) for t in members if _decompose_step(t.trace) is not None), None)
        if source is None or source.output is None:
            degenerate["no_decomposition"] += 1  # the run failed before its decomposition was parsed
            continue
        subquestions = [str(item.get("text", "")) for item in source.parsed or [] if isinstance(item, dict)]
        clean = source.fallback is None and bool(subquestions)
        if not clean:
            degenerate["unparsed_decomposition"] += 1
        sampled_step = _decompose_step(sampled.trace) if sampled is not None else None
        prompt = sampled_step.messages if sampled_step is not None else None
        identity = (tuple(subquestions), source.fallback)
        if identity in merged:
            degenerate["duplicate_decomposition"] += 1
            group = merged[identity]
            group.prompt = group.prompt or prompt
        else:
            group = merged[identity] = _Decomposition(index, source.output, prompt, subquestions, clean)
        group.members.append(index)
        group.runs.extend(members)
    return sorted(merged.values(), key=lambda d: d.index)


def _normalised_answer(step: Step | None) -> str:
    return normalize_answer(str(step.parsed or "")) if step is not None else ""


# released create_train_data.py's word2number: a sub-answer that is exactly "0".."10" is compared as its word
NUMBER_WORDS = {
    str(i): word
    for i, word in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"])
}


def _reference_form(text: str) -> str:
    return NUMBER_WORDS.get(text.lower(), text).lower().strip()


def subanswer_agreement(
    winner: Mapping[int, str], loser: Mapping[int, str], rule: Literal["reference", "normalised"] = "reference"
) -> float:
    """Share of sub-questions whose answers agree in two runs of one decomposition (T+ ``winner``, T- ``loser``).

    ``reference`` (released ``create_train_data.py``): over the loser's sub-questions, answers equal after
    ``lower().strip()`` with "0".."10" mapped to words ("3" = "three", "Paris." != "Paris"); a sub-question the
    winner lacks disagrees; a loser without sub-answers agrees on 0.0. ``normalised``: over the sub-questions of
    either run, answers equal under sleuth's normaliser (:func:`~sleuth.eval.metrics.normalize_answer`: case,
    punctuation and articles: "The Beatles" = "Beatles", "U.S." = "US"), a missing answer being ""."""
    if rule == "reference":
        if not loser:
            return 0.0
        agree = sum(i in winner and _reference_form(winner[i]) == _reference_form(loser[i]) for i in loser)
        return agree / len(loser)
    indices = set(winner) | set(loser)
    if not indices:
        return 0.0
    same = (normalize_answer(winner.get(i, "")) == normalize_answer(loser.get(i, "")) for i in indices)
    return sum(same) / len(indices)


def _agreement(a: Trajectory, b: Trajectory, rule: Literal["reference", "normalised"] = "reference") -> float:
    """:func:`subanswer_agreement` of the parsed sub-answers of runs ``a`` (T+) and ``b`` (the T- candidate)."""
    sa, sb = a.subanswer_steps(), b.subanswer_steps()
    return subanswer_agreement(
        {i: str(s.parsed or "") for i, s in sa.items()}, {i: str(s.parsed or "") for i, s in sb.items()}, rule
    )


REFERENCE_MIN_AGREEMENT = 0.666  # released create_dpo_pairs.py: final pairs' share of identical sub-answers


def reference_gate(kind: Literal["decompose", "answer"], margin: float, loser: float) -> bool:
    """The released ``create_dpo_pairs.py`` gates on its EM + Acc + F1 score (digest §4.4), ``margin`` = best -
    worst, ``loser`` = the worst: ``decompose`` (the mean reward of each decomposition) keeps a question when
    ``margin >= 1.33 and loser <= 1``; ``answer`` (the runs of one decomposition, for sub-question and final-answer
    pairs) keeps it when ``margin > 1.33 and loser <= 1.2``."""
    if kind == "decompose":
        return margin >= 1.33 and loser <= 1.0
    if kind == "answer":
        return margin > 1.33 and loser <= 1.2
    raise ValueError(f"unknown gate {kind!r}; expected 'decompose' or 'answer'")


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


class _PairSink:
    """Collects pairs of the enabled sets, dropping (and counting) pairs whose two completions are identical."""

    def __init__(self, sets: Iterable[str], degenerate: Counter[str]) -> None:
        self.sets = set(sets)
        self.degenerate = degenerate
        self.pairs: list[dict[str, Any]] = []

    def add(
        self,
        kind: str,
        question_id: str,
        prompt: list[dict[str, str]],
        chosen: str,
        rejected: str,
        rewards: tuple[float, float],
        **meta: Any,
    ) -> None:
        if kind not in self.sets:
            return
        if chosen == rejected:
            self.degenerate[f"{kind}_identical_completions"] += 1
            return
        self.pairs.append(
            {
                "prompt": [dict(m) for m in prompt],
                "chosen": _assistant(chosen),
                "rejected": _assistant(rejected),
                "set": kind,
                "question_id": question_id,
                "chosen_reward": rewards[0],
                "rejected_reward": rewards[1],
                **meta,
            }
        )


def _decompose_pair(
    question: str, groups: list[_Decomposition], config: MDPOConfig, sink: _PairSink, degenerate: Counter[str]
) -> None:
    """D_decompose: argmax vs argmin of the mean reward over each decomposition's solver runs (first index wins a
    tie inside the argmax / argmin, as with numpy); with ``decompose_pairs="same_length"`` the argmin is taken over
    the decompositions with as many sub-questions as the argmax."""
    usable = [g for g in groups if g.valid_runs and g.prompt is not None]
    if len(usable) < 2:
        degenerate["decompose_single_decomposition"] += 1
        return
    best = max(usable, key=lambda g: g.mean_reward)
    if config.decompose_pairs == "same_length":
        usable = [g for g in usable if len(g.subquestions) == len(best.subquestions)]
        if len(usable) < 2:
            degenerate["decompose_no_same_length"] += 1
            return
    worst = min(usable, key=lambda g: g.mean_reward)
    gap = best.mean_reward - worst.mean_reward
    if gap == 0:
        degenerate["decompose_tie"] += 1
    elif config.pair_rule == "reference" and not reference_gate("decompose", gap, worst.mean_reward):
        degenerate["decompose_reference_gate"] += 1
    elif config.pair_rule == "paper" and gap <= config.min_margin:
        degenerate["decompose_below_margin"] += 1
    elif not best.clean:  # only possible with reward="code", whose score has no decomposition term
        degenerate["decompose_chosen_unparsed"] += 1
    else:
        style = config.decomposition_completion
        sink.add(
            "decompose",
            question,
            best.prompt or [],
            best.completion(style),
            worst.completion(style),
            (best.mean_reward, worst.mean_reward),
            chosen_key=f"{question}#{best.index}",
            rejected_key=f"{question}#{worst.index}",
            chosen_em=best.mean_em,
            rejected_em=worst.mean_em,
            chosen_steps=len(best.subquestions),
            rejected_steps=len(worst.subquestions),
        )


def _solver_pairs(
    question: str, group: _Decomposition, config: MDPOConfig, sink: _PairSink, degenerate: Counter[str]
) -> None:
    """D_subq and D_final of one decomposition from its best run T+ and worst run T-. Among the runs tied at the
    minimum, T- is the one whose sub-answers agree most with T+ (digest §10 item 14: the rejected final answer is then
    closest to on-policy for T+'s prompt, and a differing sub-answer is more likely the cause of the failure)."""
    runs = group.valid_runs
    if len(runs) < 2:
        degenerate["solver_too_few_runs"] += 1
        return
    plus = max(runs, key=lambda t: t.reward)
    lowest = min(t.reward for t in runs)
    gap = plus.reward - lowest
    if gap == 0:
        degenerate["solver_tie"] += 1
        return
    if config.pair_rule == "reference" and not reference_gate("answer", gap, lowest):
        degenerate["solver_reference_gate"] += 1
        return
    if config.pair_rule == "paper" and gap <= config.min_margin:
        degenerate["solver_below_margin"] += 1
        return
    minus = max((t for t in runs if t.reward == lowest), key=lambda t: _agreement(plus, t, config.agreement))
    rewards = (plus.reward, minus.reward)
    keys = {"chosen_key": plus.key, "rejected_key": minus.key, "chosen_em": plus.em, "rejected_em": minus.em}

    plus_steps, minus_steps = plus.subanswer_steps(), minus.subanswer_steps()
    differing = 0
    for index in sorted(set(plus_steps) & set(minus_steps)):
        good, bad = plus_steps[index], minus_steps[index]
        if _normalised_answer(good) == _normalised_answer(bad) or good.messages is None:
            continue
        differing += 1
        chosen, rejected = good.output or "", bad.output or ""
        sink.add("subq", question, good.messages, chosen, rejected, rewards, subquestion=index, **keys)
    if not differing and "subq" in sink.sets:
        degenerate["subq_no_difference"] += 1

    good_final, bad_final = plus.final_step(), minus.final_step()
    if good_final is None or bad_final is None or good_final.messages is None:
        degenerate["final_missing"] += 1
        return
    agreement = _agreement(plus, minus, config.agreement)
    if config.pair_rule == "reference" and "final" in sink.sets and agreement < REFERENCE_MIN_AGREEMENT:
        degenerate["final_low_agreement"] += 1
        return
    sink.add("final", question, good_final.messages, good_final.output or "", bad_final.output or "", rewards, **keys)


def build_pairs(rollouts: Iterable[Rollout], config: MDPOConfig | None = None) -> tuple[list[dict[str, Any]], dict]:
    """Score ``rollouts`` and build the enabled preference sets; returns the pairs and their statistics.

    Statistics: questions, trajectories, failed runs, mean reward / format-valid rate / EM over the finished runs,
    pairs per set, mean reward margin (chosen - rejected) per set, and ``degenerate``: how many groups gave no pair,
    by reason (``decompose_tie``: all decompositions had the same mean reward; ``solver_tie``: all runs of a
    decomposition had the same reward; ``unparsed_decomposition``; ``no_decomposition``: runs that failed before
    decomposing; ``failed_runs``; ...).
    """
    config = config or MDPOConfig()
    degenerate: Counter[str] = Counter()
    sink = _PairSink(config.pair_sets, degenerate)
    by_question = trajectories(rollouts, config.reward)
    finished: list[Trajectory] = []
    for question, runs in by_question.items():
        failed = sum(t.failed for t in runs)
        degenerate["failed_runs"] += failed
        finished += [t for t in runs if not t.failed]
        groups = _decompositions(runs, degenerate)
        if not groups:
            degenerate["question_without_decomposition"] += 1
            continue
        _decompose_pair(question, groups, config, sink, degenerate)
        targets = groups if config.pairs_from == "every" else [max(groups, key=lambda g: g.mean_reward)]
        for group in targets:
            _solver_pairs(question, group, config, sink, degenerate)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    pairs = sink.pairs
    counts = {kind: sum(p["set"] == kind for p in pairs) for kind in PAIR_SETS}
    gaps = [(p["set"], p["chosen_reward"] - p["rejected_reward"]) for p in pairs]
    margins = {kind: mean([gap for k, gap in gaps if k == kind]) for kind in PAIR_SETS}
    margins["all"] = mean([gap for _, gap in gaps])
    stats = {
        "pair_rule": config.pair_rule,
        "pair_correctness": pair_correctness(pairs),
        "questions": len(by_question),
        "trajectories": sum(len(r) for r in by_question.values()),
        "failed_runs": degenerate["failed_runs"],
        "mean_reward": mean([t.reward for t in finished]),
        "format_valid": mean([float(all(t.checks.values())) for t in finished]),
        "em": mean([float(score_example(t.trace.example, t.trace.answer or "").get("em") or 0.0) for t in finished]),
        "pairs": {**counts, "total": len(pairs)},
        "reward_margin": margins,
        "decompose_steps": decompose_steps(pairs),
        "degenerate": dict(sorted((k, v) for k, v in degenerate.items() if v)),
    }
    return pairs, stats


def decompose_steps(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The decomposition pairs' sub-question counts: per side, how many pairs have k sub-questions, and how many
    pairs prefer the longer / an equally long / the shorter decomposition (the issue-36 diagnosis: a bias to longer
    chosen sides teaches the model extra hops)."""
    found = [p for p in pairs if p.get("set") == "decompose" and p.get("chosen_steps") is not None]
    chosen, rejected = Counter(p["chosen_steps"] for p in found), Counter(p["rejected_steps"] for p in found)
    return {
        "chosen": {str(k): v for k, v in sorted(chosen.items())},
        "rejected": {str(k): v for k, v in sorted(rejected.items())},
        "chosen_longer": sum(p["chosen_steps"] > p["rejected_steps"] for p in found),
        "same_length": sum(p["chosen_steps"] == p["rejected_steps"] for p in found),
        "chosen_shorter": sum(p["chosen_steps"] < p["rejected_steps"] for p in found),
    }


def pair_correctness(pairs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Per pair set (and ``all``): is the chosen side actually the more correct one? By the exact match of the final
    answer of the runs each side comes from (a decomposition's: the mean over its solver runs), whatever the
    training reward: ``chosen_correct`` / ``rejected_correct`` the mean EM of each side, ``chosen_better`` /
    ``equal`` / ``rejected_better`` the shares of pairs where the chosen side's EM is above, equal to, below the
    rejected side's (``rejected_better`` > 0: pairs that teach away from the right answer)."""
    out: dict[str, dict[str, float | int]] = {}
    for kind in (*PAIR_SETS, "all"):
        chosen = [
            p
            for p in pairs
            if p.get("chosen_em") is not None
            and p.get("rejected_em") is not None
            and (kind == "all" or p["set"] == kind)
        ]
        if not chosen:
            continue
        n = len(chosen)
        out[kind] = {
            "pairs": n,
            "chosen_correct": round(sum(p["chosen_em"] for p in chosen) / n, 4),
            "rejected_correct": round(sum(p["rejected_em"] for p in chosen) / n, 4),
            "chosen_better": round(sum(p["chosen_em"] > p["rejected_em"] for p in chosen) / n, 4),
            "equal": round(sum(p["chosen_em"] == p["rejected_em"] for p in chosen) / n, 4),
            "rejected_better": round(sum(p["chosen_em"] < p["rejected_em"] for p in chosen) / n, 4),
        }
    return out


def prompt_key(pair: Mapping[str, Any]) -> str:
    """A pair's prompt as a short stable key (the greedy-output cache of ``rejected="greedy"``)."""
    text = json.dumps([pair["set"], pair["prompt"]], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def greedy_sampling(kind: str, agent: AceSearcherConfig) -> Sampling:
    """The agent's own greedy decoding of one pair set's call (so the output is what evaluation would produce)."""
    budget = {
        "decompose": agent.decompose_max_new_tokens,
        "subq": agent.subanswer_max_new_tokens,
        "final": agent.final_max_new_tokens,
    }[kind]
    sampling = dataclasses.replace(agent.sampling, temperature=0.0, n=1)
    return dataclasses.replace(sampling, max_new_tokens=budget) if budget else sampling


def greedy_outputs(
    pairs: Sequence[Mapping[str, Any]], llm: LLM, agent: AceSearcherConfig, path: str | Path, concurrency: int = 64
) -> dict[str, str]:
    """The policy's greedy output on every distinct pair prompt, appended to ``path`` (jsonl ``{key, set, text}``) as
    it comes, so a rerun generates only what is missing; returns key -> text for all of them."""
    path = Path(path)
    done = load_greedy(path)
    todo: dict[str, Mapping[str, Any]] = {}
    for pair in pairs:
        key = prompt_key(pair)
        if key not in done:
            todo.setdefault(key, pair)
    if not todo:
        return done
    if path.exists() and not path.read_text(encoding="utf-8").endswith("\n"):  # a torn last line: rewrite without it
        path.write_text("".join(json.dumps({"key": k, "text": v}, ensure_ascii=False) + "\n" for k, v in done.items()))

    async def run() -> None:
        items = list(todo.items())
        with open(path, "a", encoding="utf-8") as f:
            for start in range(0, len(items), concurrency):
                chunk = items[start : start + concurrency]

                async def one(pair: Mapping[str, Any]) -> str:
                    request = Request(messages=[dict(m) for m in pair["prompt"]])
                    return (await llm.generate([request], greedy_sampling(pair["set"], agent)))[0].text

                texts = await asyncio.gather(*(one(pair) for _, pair in chunk))
                for (key, pair), text in zip(chunk, texts, strict=True):
                    done[key] = text
                    f.write(json.dumps({"key": key, "set": pair["set"], "text": text}, ensure_ascii=False) + "\n")
                f.flush()

    asyncio.run(run())
    return done


def load_greedy(path: str | Path) -> dict[str, str]:
    """key -> greedy text from a :func:`greedy_outputs` file (a torn last line, from a killed run, is skipped)."""
    path = Path(path)
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[row["key"]] = row["text"]
    return out


def _answer_of(kind: str, text: str, agent: AceSearcherConfig, fact: bool) -> str:
    """What a pair compares: the parsed sub-questions, the cleaned sub-answer, or the final answer, normalised."""
    if kind == "decompose":
        subs, _ = parse_decomposition(text, agent.max_subquestions)
        return json.dumps([(s.index, normalize_answer(s.text)) for s in subs])
    if kind == "subq":
        answer = clean_subanswer(text, fact)[0] if agent.subanswer_cleanup else text.strip()
        return normalize_answer(answer)
    answer = extract_answer(text)[0]
    if fact:
        return claim_label(answer) or normalize_answer(answer)
    return normalize_answer(answer)


def on_policy_pairs(
    pairs: Sequence[dict[str, Any]],
    greedy: Mapping[str, str],
    agent: AceSearcherConfig,
    examples: Mapping[str, Example],
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``rejected="greedy"``: each pair against the policy's greedy output on its prompt (``greedy``: by
    :func:`prompt_key`). A pair whose greedy output gives the chosen answer is dropped (``{set}_greedy_is_chosen``):
    the policy already prefers it where it decodes. Otherwise a subq/final pair's rejected side becomes the greedy
    output (``rejected_source: "greedy"``; a final one with its EM against the gold answers, a subq one with no EM:
    a sub-question has no gold) and a decompose pair keeps its sampled rejected side. A prompt without a greedy
    output keeps its pair as sampled (``{set}_no_greedy``). Returns the pairs and these counts."""
    counts: Counter[str] = Counter()
    out: list[dict[str, Any]] = []
    for pair in pairs:
        kind = pair["set"]
        text = greedy.get(prompt_key(pair))
        if text is None:
            counts[f"{kind}_no_greedy"] += 1
            out.append(pair)
            continue
        example = examples.get(str(pair["question_id"]))
        fact = example is not None and is_fact(example, agent)
        if _answer_of(kind, text, agent, fact) == _answer_of(kind, pair["chosen"][0]["content"], agent, fact):
            counts[f"{kind}_greedy_is_chosen"] += 1
            continue
        if kind == "decompose":
            counts["decompose_kept_sampled"] += 1
            out.append(pair)
            continue
        counts[f"{kind}_greedy_rejected"] += 1
        rejected_em = None
        if kind == "final" and example is not None:
            rejected_em = float(score_example(example, extract_answer(text)[0]).get("em") or 0.0)
        out.append({**pair, "rejected": _assistant(text), "rejected_source": "greedy", "rejected_em": rejected_em})
    return out, dict(sorted(counts.items()))


def split_heldout(
    pairs: list[dict[str, Any]], share: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, heldout)``: the pairs of a seeded ``share`` of the questions held out whole (pairs of one question
    share prompts and runs, so splitting by pair would leak). At least one question stays in training."""
    if share <= 0 or not pairs:
        return pairs, []
    questions = sorted({str(p["question_id"]) for p in pairs})
    rng = random.Random(seed)
    rng.shuffle(questions)
    count = min(len(questions) - 1, max(1, round(share * len(questions))))
    held = set(questions[:count])
    return [p for p in pairs if str(p["question_id"]) not in held], [p for p in pairs if str(p["question_id"]) in held]


def write_pairs(path: str | Path, pairs: Iterable[dict[str, Any]]) -> Path:
    """Write pairs as jsonl (one complete file: written aside, then renamed)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path


def load_pairs(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------------------


def build_dpo_trainer(
    config: MDPOConfig,
    policy: str | Path,
    pairs: list[dict[str, Any]],
    output_dir: str | Path,
    reference: str | Path | None = None,
    heldout: list[dict[str, Any]] | None = None,
) -> Any:
    """A TRL ``DPOTrainer`` that trains ``policy`` on ``pairs`` against the frozen ``reference`` (default: a second,
    frozen copy of ``policy``, i.e. θ(t) in the mDPO loss, Eq. 4.5). ``heldout`` pairs, when given, are the
    evaluation set, evaluated every ``heldout_eval_steps`` steps.

    Loss per pair: ``-log σ(β [(log π(y+|x) - log π_ref(y+|x)) - (log π(y-|x) - log π_ref(y-|x))])`` with log-probs
    summed over the completion tokens only (TRL ``loss_type="sigmoid"``). With ``nll_weight`` γ > 0, TRL's
    ``"sft"`` term is added with weight γ: the mean negative log-likelihood over the chosen completion tokens of the
    micro-batch. LLaMA-Factory's ``pref_ftx`` (the released configs) adds γ x the per-sequence mean token NLL of the
    chosen completion, averaged over pairs; the two are the same quantity when each micro-batch holds one pair
    (``per_device_batch_size=1``, the default; gradient accumulation then averages over pairs as LLaMA-Factory's
    batch mean does). With larger micro-batches TRL weights pairs by their chosen length. TRL 1.16 has no
    ``rpo_alpha`` any more; ``"sft"`` is its replacement.

    With LoRA or ``precompute_ref_log_probs`` no second model is loaded: TRL takes the reference from the policy
    before training (adapter disabled / log-probs computed up front), which is θ(t) since training starts there.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    bf16 = config.bf16 if config.bf16 is not None else bool(cuda and torch.cuda.is_bf16_supported())
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)
    ref_model = None
    peft_config = common.peft_lora_config(config) if config.lora else None
    if (not config.lora and not config.precompute_ref_log_probs) or (
        reference is not None and Path(reference) != Path(policy)
    ):
        ref_model = AutoModelForCausalLM.from_pretrained(str(reference or policy), dtype=torch.float32)
        ref_model.requires_grad_(False)
        ref_model.eval()
    rows = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]} for p in pairs]
    held = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]} for p in heldout or []]
    evaluation: dict[str, Any] = (
        {"eval_strategy": "steps", "eval_steps": config.heldout_eval_steps, "per_device_eval_batch_size": 1}
        if held
        else {}
    )
    per_device = max(1, config.per_device_batch_size)
    accumulation = max(1, min(config.batch_size, max(len(rows), 1)) // per_device)
    losses, weights = ["sigmoid"], [1.0]
    if config.nll_weight > 0:
        losses.append("sft")
        weights.append(config.nll_weight)
    trainer_dir = Path(output_dir)  # RUN/iter{t}/trainer: the DPO curves go to RUN/tb/iter{t}
    report_to, reporting = hf_reporting(config.report_to, trainer_dir.parent.parent, trainer_dir.parent.name)
    args = DPOConfig(
        **common.training_arguments(
            config,
            output_dir,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            beta=config.beta,
            loss_type=losses,
            loss_weights=weights,
            adam_beta1=0.9,
            adam_beta2=config.adam_beta2,
            max_length=config.max_length,
            precompute_ref_log_probs=config.precompute_ref_log_probs,
            activation_checkpointing=config.gradient_checkpointing,
            bf16=bf16,
            use_cpu=not cuda,
            report_to=report_to,
            dataloader_num_workers=0,
            disable_tqdm=not config.progress,
            **evaluation,
        )
    )
    if not config.progress:
        import datasets
        from transformers.utils import logging as hf_logging

        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()
    from sleuth.train.packing import length_sorted_trainer

    trainer = (length_sorted_trainer(DPOTrainer) if config.length_sorted else DPOTrainer)(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(held) if held else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=reporting,
    )
    if not config.progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # it prints every log line when tqdm is off
    return trainer


def heldout_curve(history: list[dict[str, Any]], heldout: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out pairs' implicit-reward trajectory from TRL's eval logs: per evaluation the step, the loss, the
    accuracy (share of pairs whose implicit reward ranks chosen above rejected), the margin and the chosen /
    rejected log-probs (summed over completion tokens; both falling is the over-optimisation sign), and the
    correctness of the held-out pairs (:func:`pair_correctness`). None without held-out pairs."""
    if not heldout:
        return None
    keys = {
        "loss": "eval_loss",
        "accuracy": "eval_rewards/accuracies",
        "margin": "eval_rewards/margins",
        "chosen_reward": "eval_rewards/chosen",
        "rejected_reward": "eval_rewards/rejected",
        "logps_chosen": "eval_logps/chosen",
        "logps_rejected": "eval_logps/rejected",
    }
    by_step = {h.get("step"): h for h in history if "eval_rewards/accuracies" in h}  # the last of a step wins
    curve = [{"step": step, **{name: h[key] for name, key in keys.items() if key in h}} for step, h in by_step.items()]
    return {
        "pairs": len(heldout),
        "questions": len({str(p["question_id"]) for p in heldout}),
        "correctness": pair_correctness(heldout),
        "curve": curve,
    }


def _mean_logged(history: list[dict[str, Any]], key: str) -> float | None:
    values = [float(h[key]) for h in history if key in h]
    return sum(values) / len(values) if values else None


def iteration_config(config: MDPOConfig, t: int) -> MDPOConfig:
    """The DPO options of iteration ``t`` (1-based): ``config``, at ``later_learning_rate`` from iteration 2 on when
    that is set."""
    if t == 1 or config.later_learning_rate is None:
        return config
    return dataclasses.replace(config, learning_rate=config.later_learning_rate)


def train_dpo(config: MDPOConfig, policy: str | Path, pairs: list[dict[str, Any]], iteration_dir: str | Path) -> dict:
    """One DPO iteration: train from ``policy`` (also the reference) on ``pairs``; the model is saved to
    ``iteration_dir/model`` (written aside, then renamed, so the directory exists only when complete) and the
    training metrics to ``iteration_dir/train_metrics.json``. Resumes from the last checkpoint in
    ``iteration_dir/trainer``. Without pairs the policy is saved unchanged (``trained: false``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint

    iteration_dir = Path(iteration_dir)
    final = iteration_dir / "model"
    partial = iteration_dir / "model.partial"
    trainer_dir = iteration_dir / "trainer"
    if partial.exists():
        shutil.rmtree(partial)
    started = time.perf_counter()
    if not pairs:
        AutoModelForCausalLM.from_pretrained(str(policy)).save_pretrained(partial)
        AutoTokenizer.from_pretrained(str(policy)).save_pretrained(partial)
        metrics: dict[str, Any] = {"trained": False, "reason": "no preference pairs", "pairs": 0}
    else:
        train_pairs, heldout = split_heldout(pairs, config.heldout_pairs, config.seed)
        trainer = build_dpo_trainer(config, policy, train_pairs, trainer_dir, heldout=heldout)
        checkpoint = get_last_checkpoint(str(trainer_dir)) if trainer_dir.is_dir() else None
        trainer.train(resume_from_checkpoint=checkpoint)
        if heldout:
            trainer.evaluate()  # the end point of the held-out curve (logged into log_history)
        model = trainer.model
        if config.lora:  # the next iteration's reference is the merged θ(t+1) (digest §10 item 16)
            model = model.merge_and_unload()
        model.save_pretrained(partial)
        trainer.processing_class.save_pretrained(partial)
        history = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
        metrics = {
            "trained": True,
            "pairs": len(train_pairs),
            "heldout": heldout_curve(trainer.state.log_history, heldout),
            "steps": trainer.state.global_step,
            "learning_rate": trainer.args.learning_rate,
            "resumed_from": checkpoint,
            "loss": _mean_logged(history, "loss"),
            "accuracy": _mean_logged(history, "rewards/accuracies"),
            "margin": _mean_logged(history, "rewards/margins"),
            "final_accuracy": history[-1]["rewards/accuracies"] if history else None,
            "final_margin": history[-1]["rewards/margins"] if history else None,
            "log_history": trainer.state.log_history,
        }
        del trainer, model
        gc.collect()
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    if trainer_dir.exists() and not config.keep_checkpoints:
        shutil.rmtree(trainer_dir)
    metrics.update(policy=str(policy), reference=str(policy), model=str(final), seconds=time.perf_counter() - started)
    (iteration_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Evaluation and the iteration loop
# ---------------------------------------------------------------------------------------------------------------


def _examples(store: RolloutStore) -> dict[str, Example]:
    """question id -> its Example, from the stored runs (gold answers for the on-policy pairs' EM; no scoring)."""
    found: dict[str, Example] = {}
    for rollout in store:
        found.setdefault(str(_question_of(rollout)), rollout.trace.example)
    return found


def _log(config: MDPOConfig, message: str) -> None:
    log(config.progress, message, "mdpo")


def iteration_questions(config: MDPOConfig, train: list[Example], t: int) -> list[Example]:
    """The training questions iteration ``t`` (1-based) samples (:func:`common.question_block`)."""
    return common.question_block(train, config.train_limit, t - 1, config.fresh_questions)


def train_mdpo(
    config: MDPOConfig,
    llm_factory: Callable[[Path], LLM] | None = None,
    retriever: Retriever | None = None,
) -> dict[str, Any]:
    """Run ``config.iterations`` mDPO iterations (the module docstring has the steps and the output layout); return
    the summary also written to ``OUT/summary.json``.

    ``llm_factory(model_dir)`` makes the LLM that samples and evaluates with a model directory (default: the ``hf:``
    backend with ``llm_options``); ``retriever`` replaces the one the config names. A rerun resumes: rollouts by key,
    DPO from its last checkpoint, and iterations whose model exists are skipped.
    """
    from sleuth.retrieval import load_retriever

    config.validate()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "config.json", to_mapping(config))
    train, dev, index = common.prepare_data(config, config.output_dir, config.progress, need_index=retriever is None)
    if retriever is None:
        retriever = load_retriever(index)
    factory = llm_factory or common.default_llm_factory(config)
    policy = common.resolve_model(config.model)
    rollout_agent = config.rollout_agent()
    iterations: list[dict[str, Any]] = []
    # a server-backed engine keeps the evaluation's server on θ(t+1) for iteration t+1's sampling
    engines = Engines(factory, keep=common.serves(config) and llm_factory is None)
    try:
        return _iterate(config, train, dev, retriever, policy, rollout_agent, iterations, engines)
    finally:
        engines.close()


def _iterate(
    config: MDPOConfig,
    train: list[Example],
    dev: list[Example],
    retriever: Retriever,
    policy: Path,
    rollout_agent: AceSearcherConfig,
    iterations: list[dict[str, Any]],
    engines: Engines,
) -> dict[str, Any]:
    out = Path(config.output_dir)
    blocks = [iteration_questions(config, train, t) for t in range(1, config.iterations + 1)]  # fails before sampling
    tracker = Tracker(config.report_to, out, out.name, to_mapping(config))  # iteration statistics in OUT/tb
    for t in range(1, config.iterations + 1):
        train = blocks[t - 1]
        it = out / f"iter{t}"
        it.mkdir(exist_ok=True)
        model_dir, stats_path = it / "model", it / "stats.json"
        if model_dir.exists() and stats_path.exists():
            _log(config, f"iteration {t}: done already ({model_dir})")
            iterations.append(json.loads(stats_path.read_text()))
            policy = model_dir
            continue
        seconds: dict[str, float] = {}
        built: tuple[list[dict[str, Any]], dict] | None = None  # the pairs, when the greedy outputs needed them first
        producer = rollout_producer(
            METHOD,
            rollout_agent,
            policy,
            t,
            decompositions=config.decompositions,
            solutions=config.solutions,
            seed=config.seed,
        )
        if not (it / "rollouts").exists():
            questions = {e.id for e in train}
            for source in rollout_sources(config):
                if _reuse_rollouts(
                    Path(source) / f"iter{t}" / "rollouts", it / "rollouts", producer, questions, config
                ):
                    break
        store = RolloutStore(it / "rollouts", producer=producer)
        stats: dict[str, Any] = {"iteration": t, "policy": str(policy), "reference": str(policy)}
        if (it / REUSED_FILE).exists():
            stats.update(json.loads((it / REUSED_FILE).read_text()))
        initial_eval = t == 1 and config.eval_initial and bool(dev) and not (it / "dev_initial.json").exists()
        pending = pending_rollouts(train, store, config.decompositions, config.solutions)
        if not model_dir.exists() and not pending and not initial_eval:
            _log(config, f"iteration {t}: all {len(store)} rollouts are in the store; no sampling engine started")
            stats["new_rollouts"] = 0
        elif not model_dir.exists():
            started = time.perf_counter()
            llm = engines.open(policy)
            stats["sampling_engine"] = common.engine_record(llm)
            common.seed_all(config.seed * 1000 + t)
            _log(config, f"iteration {t}: sampling {len(train)} questions with {policy}")
            new = sample_rollouts(
                train,
                Context(llm=llm, retriever=retriever, config=rollout_agent),
                store,
                config.decompositions,
                config.solutions,
                config.concurrency,
                config.progress,
            )
            stats["new_rollouts"] = new
            seconds["sampling"] = time.perf_counter() - started
            if initial_eval:
                started = time.perf_counter()
                traces_file = it / "dev_initial_traces.jsonl"
                initial = evaluate_dev(dev, llm, retriever, config.agent, traces_file, config.concurrency)
                common.write_json(it / "dev_initial.json", initial)
                seconds["eval_initial"] = time.perf_counter() - started
            if config.rejected == "greedy":  # on the engine that is up: the policy's greedy output on the pairs
                started = time.perf_counter()
                built = build_pairs(store, config)
                greedy_outputs(built[0], llm, config.agent, it / "greedy.jsonl", config.concurrency)
                seconds["greedy"] = time.perf_counter() - started
            engines.release(policy, llm, False)  # before DPO: the trainer gets the memory and the cores
            del llm
        started = time.perf_counter()
        pairs, pair_stats = built or build_pairs(store, config)
        if config.rejected == "greedy":
            greedy = load_greedy(it / "greedy.jsonl")
            if not model_dir.exists() and any(prompt_key(p) not in greedy for p in pairs):
                llm = engines.open(policy)
                greedy = greedy_outputs(pairs, llm, config.agent, it / "greedy.jsonl", config.concurrency)
                engines.release(policy, llm, False)
                del llm
            sampled = pair_stats["pairs"]
            pairs, pair_stats["on_policy"] = on_policy_pairs(pairs, greedy, config.agent, _examples(store))
            pair_stats["pairs_sampled"] = sampled
            pair_stats["pairs"] = {**{k: sum(p["set"] == k for p in pairs) for k in PAIR_SETS}, "total": len(pairs)}
            pair_stats["pair_correctness"] = pair_correctness(pairs)
        write_pairs(it / "pairs.jsonl", pairs)
        seconds["pairs"] = time.perf_counter() - started
        counts = ", ".join(f"{k} {v}" for k, v in pair_stats["pairs"].items())
        _log(config, f"iteration {t}: pairs {counts}; mean reward {pair_stats['mean_reward']}")
        if model_dir.exists():
            train_stats = json.loads((it / "train_metrics.json").read_text())
        else:
            _log(config, f"iteration {t}: DPO on {len(pairs)} pairs (reference = {policy})")
            engines.close()  # no server holds memory or cores while DPO trains
            train_stats = train_dpo(iteration_config(config, t), policy, pairs, it)
            seconds["training"] = train_stats["seconds"]
        started = time.perf_counter()
        dev_stats: dict[str, Any] = {"n": 0, "em": None}
        if dev:
            llm = engines.open(model_dir)
            stats["eval_engine"] = common.engine_record(llm)
            dev_stats = evaluate_dev(dev, llm, retriever, config.agent, it / "dev_traces.jsonl", config.concurrency)
            engines.release(model_dir, llm, t < config.iterations)  # the next iteration samples with this model
            del llm
        seconds["eval"] = time.perf_counter() - started
        stats.update(
            model=str(model_dir),
            rollouts=len(store),
            **pair_stats,
            dpo={k: v for k, v in train_stats.items() if k != "log_history"},
            dev={k: v for k, v in dev_stats.items() if not k.startswith("per_example")},
            seconds=seconds,
        )
        if (it / "dev_initial.json").exists():
            initial = json.loads((it / "dev_initial.json").read_text())
            stats["dev_initial"] = {k: v for k, v in initial.items() if not k.startswith("per_example")}
        common.write_json(stats_path, stats)
        _log(config, f"iteration {t}: dev EM {dev_stats.get('em')}, DPO accuracy {train_stats.get('accuracy')}")
        iterations.append(stats)
        tracker.log(t, stats)  # its numbers: pairs/*, mean_reward, dpo/*, dev/*, seconds/*, ...
        policy = model_dir
    tracker.close()
    summary = {
        "final_model": str(policy),
        "iterations": [
            {
                "iteration": s["iteration"],
                "pairs": s.get("pairs"),
                "mean_reward": s.get("mean_reward"),
                "reward_margin": (s.get("reward_margin") or {}).get("all"),
                "dpo_accuracy": (s.get("dpo") or {}).get("accuracy"),
                "dev_em": (s.get("dev") or {}).get("em"),
            }
            for s in iterations
        ],
    }
    if iterations and "dev_initial" in iterations[0]:
        summary["dev_em_initial"] = iterations[0]["dev_initial"].get("em")
    common.write_json(out / "summary.json", summary)
    return summary


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """``sleuth train acesearcher --config cfg.yaml [--set key=value]``: load the config, run :func:`train_mdpo`.

    ``overrides``: a mapping or ``"key=value"`` strings; dotted keys reach nested options (``agent.k=5``).
    """
    return train_mdpo(load_config(MDPOConfig, config_path, overrides))
