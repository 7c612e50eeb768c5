"""Reward functions of the RL-trained methods: ARENA's adaptive reward and s3's Gain Beyond RAG.

Plain functions over one completion or one Trace, so that any trainer can call them (``sleuth``'s own GRPO/PPO
loop: :mod:`sleuth.train.arena_rl`, :mod:`sleuth.train.s3_rl`).

ARENA (docs/training.md, "ARENA GRPO"): format (the official regex) + accuracy (EM of ``<answer>``, ARENA's
normalisation; F1 or an LLM judge as the paper's variants) + relevance (1 for exactly the supporting references,
0.5 for any other overlap, 0 otherwise) + a bonus of 10 when the three are full; weights all 1.

s3 (docs/training.md, "s3 RL"): the frozen generator answers from the searcher's documents and from the naive-RAG
top-3; GenAcc (span match, else an LLM judge) scores both; the reward is their difference (the paper's Gain Beyond
RAG) or the code's GBR + GenAcc. The naive-RAG accuracy is computed once per question and kept on disk
(:class:`NaiveRagCache`); :func:`filter_training_examples` applies the paper's training-data filter.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sleuth.agents.arena import arena_format_ok, parse_arena, reference_relevance
from sleuth.agents.base import Context
from sleuth.agents.s3 import S3Config, answer_with_generator, task_question
from sleuth.eval.metrics import (
    JUDGE_SAMPLING,
    NORMALIZERS,
    JudgeCache,
    exact_match,
    f1_score,
    format_judge_prompt,
    judge_key,
    llm_judge,
    span_match,
)
from sleuth.llm.base import LLM
from sleuth.records import Example, Passage, Trace

__all__ = [
    "ARENA_BONUS",
    "YES_NO_ANSWERS",
    "Judge",
    "NaiveRagCache",
    "arena_accuracy_reward",
    "arena_format_reward",
    "arena_judge_accuracy",
    "arena_judge_score",
    "arena_relevance_reward",
    "arena_relevant_ids",
    "arena_reward",
    "filter_training_examples",
    "gain_beyond_rag",
    "generation_accuracy",
    "generator_accuracy",
    "generator_answer",
    "precompute_naive_rag",
    "s3_reward",
]

ARENA_BONUS = 10.0
ArenaAccuracy = Literal["em", "f1"]
GenAccMetric = Literal["genacc", "span", "judge", "em"]
GbrVariant = Literal["paper", "code"]

# ---------------------------------------------------------------------------------------------------------------
# The LLM judge, as both methods use it
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Judge:
    """An LLM judge: the model, an optional verdict cache (:class:`~sleuth.eval.metrics.JudgeCache`), the prompt
    variant of :data:`~sleuth.eval.metrics.JUDGE_PROMPTS` and the reply parse rule (``words``: strict, default;
    ``substring``: s3's and ARENA's code)."""

    llm: LLM
    cache: JudgeCache | None = None
    variant: str = "paper"
    parse: Literal["words", "substring"] = "words"

    def describe(self) -> dict[str, str]:
        return {"judge": self.llm.spec or type(self.llm).__name__, "variant": self.variant, "parse": self.parse}


def _as_judge(judge: Judge | LLM | None) -> Judge | None:
    return Judge(judge) if isinstance(judge, LLM) else judge


# ---------------------------------------------------------------------------------------------------------------
# ARENA
# ---------------------------------------------------------------------------------------------------------------


def arena_format_reward(completion: str) -> float:
    """R_format (arena.md §4.1, §2.3): 1.0 when the completion passes ARENA's official format regex
    (:func:`sleuth.agents.arena.arena_format_ok`), else 0.0."""
    return 1.0 if arena_format_ok(completion) else 0.0


def _arena_answer(completion: str) -> str:
    """The official answer extraction (arena.md §2.3): the first ``<answer>`` pair, ``""`` without one."""
    return parse_arena(completion, strict=True).answer


def arena_accuracy_reward(completion: str, golds: Iterable[str], metric: ArenaAccuracy = "em") -> float:
    """R_acc (arena.md §4.1, §4.2, §9.6) of the answer in the first ``<answer>`` pair, whatever the format.

    ``em`` (ARENA's default): 1.0 if the answer equals a gold alias after ARENA's normalisation (``_`` and
    punctuation to spaces, articles dropped), max over aliases. ``f1``: token F1 with the same normalisation (the
    paper's variant; continuous in [0, 1]). The LLM-judge variant needs a model call: :func:`arena_judge_accuracy`.
    """
    answer = _arena_answer(completion)
    gold_list = list(golds)
    if metric == "em":
        return exact_match(answer, gold_list, NORMALIZERS["arena"])
    if metric == "f1":
        return f1_score(answer, gold_list, NORMALIZERS["arena"])
    if metric == "judge":
        raise ValueError("the judge accuracy calls a model: use `await arena_judge_accuracy(...)`")
    raise ValueError(f"unknown ARENA accuracy metric {metric!r}; expected 'em' or 'f1' (or arena_judge_accuracy)")


def arena_judge_score(reply: str | None) -> float:
    """ARENA's judge-reward parse (arena.md §4.3, commented-out ``get_score``): a reply starting with "yes" is 1.0,
    one starting with "no" 0.0, else "yes" anywhere 1.0, "no" anywhere 0.0, otherwise 0.5 (lower-cased, stripped)."""
    text = (reply or "").strip().lower()
    if text.startswith("yes"):
        return 1.0
    if text.startswith("no"):
        return 0.0
    if "yes" in text:
        return 1.0
    if "no" in text:
        return 0.0
    return 0.5


_JUDGE_SCORE_VERDICT: dict[float, bool | None] = {1.0: True, 0.0: False, 0.5: None}
_VERDICT_JUDGE_SCORE: dict[bool | None, float] = {True: 1.0, False: 0.0, None: 0.5}


async def arena_judge_accuracy(completion: str, golds: Iterable[str], judge: Judge | LLM) -> float:
    """R_acc with the LLM judge (arena.md §4.3, §9.6 "GPT-4o judge"): ARENA's LJ prompt (variant ``arena`` of
    :data:`~sleuth.eval.metrics.JUDGE_PROMPTS`) on the extracted answer only, scored by :func:`arena_judge_score`
    (so 0.5 when the reply says neither). An empty answer or no gold is 0.0 without a call. The judge's
    ``variant``/``parse`` settings are not used: this is ARENA's own prompt and parse. Verdicts go to
    ``judge.cache`` under their own key space."""
    j = judge if isinstance(judge, Judge) else Judge(judge)
    gold_list = [str(g) for g in golds if str(g).strip()]
    answer = _arena_answer(completion)
    if not answer.strip() or not gold_list:
        return 0.0
    key = judge_key("arena_reward", answer, gold_list, j.llm.spec or type(j.llm).__name__)
    if j.cache is not None and key in j.cache:
        j.cache.stats.cache_hits += 1
        return _VERDICT_JUDGE_SCORE[j.cache[key]]
    generation = (await j.llm.generate([format_judge_prompt(answer, gold_list, "arena")], JUDGE_SAMPLING))[0]
    score = arena_judge_score(generation.text)
    if j.cache is not None:
        j.cache.stats.calls += 1
        j.cache.put(key, _JUDGE_SCORE_VERDICT[score], generation.text)
    return score


def arena_relevance_reward(completion: str, gold_ids: Iterable[int]) -> float:
    """R_rel (arena.md §4.1, §2.3) with the reference code's set semantics: the first ``<relevance>`` section
    parsed as JSON and taken as a set of its elements as they are (:func:`sleuth.agents.arena.reference_relevance`),
    compared with the 1-based supporting reference numbers.

    1.0 when the sets are equal (``[3, 1, 1]``, ``[1.0, 3.0]`` and ``[true]`` for gold ``{1}`` included: ``True ==
    1``); 0.5 for any other non-empty overlap, supersets (``[1,5,7]`` vs ``{1,5}``), subsets and non-integral
    extras (``[1.5, 1]`` vs ``{1}``) included; 0.0 for disjoint, empty or unreadable selections (what the reference
    code's ``except`` scores). With no supporting reference (empty ``gold_ids``) ``[]`` scores 1.0 and anything
    else 0.0, as in the reference; sleuth's ARENA training data leaves such questions out
    (:func:`sleuth.train.arena_rl.load_arena_examples`)."""
    gold = sorted({int(i) for i in gold_ids})
    predicted = reference_relevance(completion)
    if predicted is None:
        return 0.0
    if predicted == gold:
        return 1.0
    return 0.5 if set(predicted) & set(gold) else 0.0


def arena_reward(
    completion: str,
    golds: Iterable[str],
    gold_ids: Iterable[int],
    bonus: float = ARENA_BONUS,
    accuracy: ArenaAccuracy = "em",
) -> dict[str, float]:
    """ARENA's adaptive reward of one completion (arena.md §4.1): ``{"format", "accuracy", "relevance", "bonus",
    "total"}`` with ``total = format + accuracy + relevance + bonus`` (weights all 1) and ``bonus`` paid only when
    format, accuracy and relevance are all exactly 1.0 (so never with a partial F1). Accuracy and relevance are
    scored whatever the format. Possible EM totals: 0, 0.5, 1, 1.5, 2, 2.5, 3 and 13."""
    gold_list = list(golds)
    fmt = arena_format_reward(completion)
    acc = arena_accuracy_reward(completion, gold_list, accuracy)
    rel = arena_relevance_reward(completion, gold_ids)
    extra = float(bonus) if fmt == 1.0 and acc == 1.0 and rel == 1.0 else 0.0
    return {"format": fmt, "accuracy": acc, "relevance": rel, "bonus": extra, "total": fmt + acc + rel + extra}


def arena_relevant_ids(example: Example, max_references: int | None = None) -> set[int]:
    """The ground truth of R_rel (arena.md §5): the 1-based numbers of the example's supporting passages, numbered
    as the ``arena`` agent numbers its references (``example.context`` in its given order, cut to
    ``max_references`` when the agent's config cuts it). An example without given context is answered from
    retrieved references, which only its Trace knows: the set is then empty
    (:func:`sleuth.train.arena_rl.relevant_numbers` reads a Trace)."""
    references = example.context if max_references is None else example.context[:max_references]
    supporting = set(example.supporting_ids)
    return {i for i, p in enumerate(references, 1) if p.id in supporting}


# ---------------------------------------------------------------------------------------------------------------
# s3
# ---------------------------------------------------------------------------------------------------------------


async def generation_accuracy(
    prediction: str | None,
    golds: Iterable[str],
    judge: Judge | LLM | None = None,
    metric: GenAccMetric = "genacc",
) -> float:
    """Acc(.) of s3's reward (s3.md §4, §5.4), in {0, 1}.

    ``genacc`` (default, GenAcc): span_check (a SQuAD-normalised gold alias is a contiguous token span of the
    prediction: :func:`~sleuth.eval.metrics.span_match`), and only when it fails, judge_check
    (:func:`~sleuth.eval.metrics.llm_judge`) if a ``judge`` is given; without one, span_check alone. ``span``:
    span_check only; ``judge``: judge_check only (the paper's "LLMJudge", and MIRAGE's rule; needs ``judge``);
    ``em``: s3's ``em_check`` (SQuAD-normalised equality). Empty predictions and empty golds score 0."""
    gold_list = [str(g) for g in golds]
    j = _as_judge(judge)
    if metric == "em":
        return exact_match(prediction, gold_list, NORMALIZERS["squad"])
    if metric not in ("genacc", "span", "judge"):
        raise ValueError(f"unknown GenAcc metric {metric!r}; expected 'genacc', 'span', 'judge' or 'em'")
    if metric == "judge" and j is None:
        raise ValueError("metric='judge' needs a judge")
    if metric != "judge" and span_match(prediction, gold_list, NORMALIZERS["squad"]):
        return 1.0
    if metric == "span" or j is None:
        return 0.0
    return float(await llm_judge(j.llm, prediction, gold_list, j.cache, j.variant, parse=j.parse))


def gain_beyond_rag(acc_s3: float, acc_naive: float, variant: GbrVariant = "paper") -> float:
    """s3's reward from the two accuracies.

    ``paper`` (s3.md §5.1, Eq. 1): GBR = Acc(G(Q, D_s3)) - Acc(G(Q, D_RAG)), in {-1, 0, 1}.
    ``code`` (s3.md §5.2, ``compute_score_rag`` with utility and generation scores on): GBR + Acc(G(Q, D_s3))
    = 2 Acc_s3 - Acc_RAG, in {-1, 0, 1, 2}; on the filtered training data (Acc_RAG = 0) exactly twice the paper's."""
    gbr = acc_s3 - acc_naive
    if variant == "paper":
        return gbr
    if variant == "code":
        return gbr + acc_s3
    raise ValueError(f"unknown GBR variant {variant!r}; expected 'paper' or 'code'")


async def generator_answer(
    question: str, passages: Sequence[Passage], generator_llm: LLM, config: S3Config | None = None
) -> str:
    """G(Q, D): the frozen generator's answer from ``passages`` with the s3 agent's own generator call
    (:func:`sleuth.agents.s3.answer_with_generator`: the prompt ``config.generator_prompt``, its sampling; no
    call and ``""`` for an empty context, as the agent does)."""
    cfg = config or S3Config()
    ctx = Context(llm=generator_llm, config=cfg, roles={"generator": generator_llm})
    scratch = Trace(example=Example(id="", question=question), method="s3_generator")
    await answer_with_generator(ctx, scratch, question, list(passages), cfg)
    return scratch.answer or ""


async def generator_accuracy(
    question: str,
    passages: Sequence[Passage],
    golds: Iterable[str],
    generator_llm: LLM,
    config: S3Config | None = None,
    judge: Judge | LLM | None = None,
    metric: GenAccMetric = "genacc",
) -> tuple[float, str]:
    """Acc(G(Q, D), A) and the answer: :func:`generator_answer` scored by :func:`generation_accuracy`."""
    answer = await generator_answer(question, passages, generator_llm, config)
    return await generation_accuracy(answer, golds, judge, metric), answer


def _fingerprint(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


NaiveCompute = Callable[[Example], Awaitable[float | tuple[float, str]]]


class NaiveRagCache:
    """Per training question, Acc(G(Q, D_RAG), A), computed once and kept in an append-only jsonl file
    (s3.md §5.3: the code precomputes a ``rag_cache.json``; here it is filled as questions come, and resumable).

    Rows are ``{"fingerprint", "id", "acc", "answer", "question"}``, one a line, each flushed and fsync'd as it is
    written. A row counts only for a cache of the same ``fingerprint``: a hash of the ``generator`` spec and the
    ``settings`` (retriever, top-k, generator prompt and sampling, accuracy metric, judge; see :meth:`for_s3`), so
    that a different generator or retrieval setting recomputes rather than reuse stale values, while other
    fingerprints' rows stay in the same file. An unreadable line (a run killed mid-write) is skipped and counted
    in ``skipped_lines``; the next row then starts on a fresh line. For one question the last row wins.

    ``hits`` counts answers given without computing (from the file, from memory, or by waiting for the same
    question's computation already in flight, as a GRPO group's rollouts do); ``misses`` the computations made.
    ``path=None`` keeps the scores in memory only. One writer per file.
    """

    def __init__(self, path: str | Path | None, generator: str, settings: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.generator = generator
        self.settings = dict(settings or {})
        self.fingerprint = _fingerprint({"generator": generator, "settings": self.settings})
        self.hits = 0
        self.misses = 0
        self.skipped_lines = 0
        self._scores: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Future[float]] = {}
        if self.path is not None and self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                        if row["fingerprint"] == self.fingerprint:
                            self._scores[str(row["id"])] = float(row["acc"])
                    except (ValueError, KeyError, TypeError):
                        self.skipped_lines += 1

    @classmethod
    def for_s3(
        cls,
        path: str | Path | None,
        generator_llm: LLM,
        config: S3Config | None = None,
        retriever: str = "",
        judge: Judge | LLM | None = None,
        metric: GenAccMetric = "genacc",
    ) -> NaiveRagCache:
        """A cache whose fingerprint covers what the naive-RAG accuracy depends on: the generator spec, its prompt
        and sampling, the retriever spec and top-k (``config.k_initial``), the question form, the metric and the
        judge (when the metric can call one)."""
        cfg = config or S3Config()
        j = _as_judge(judge)
        settings = {
            "retriever": retriever,
            "k": cfg.k_initial,
            "generator_prompt": cfg.generator_prompt,
            "generator_sampling": cfg.generator_sampling.to_dict(),
            "question_mark": cfg.question_mark,
            "metric": metric,
            "judge": j.describe() if j is not None and metric in ("genacc", "judge") else None,
        }
        return cls(path, generator_llm.spec or type(generator_llm).__name__, settings)

    def __contains__(self, example_id: object) -> bool:
        return example_id in self._scores

    def __len__(self) -> int:
        return len(self._scores)

    def get(self, example_id: str) -> float | None:
        """The stored accuracy of a question, or None (not counted as a hit or a miss)."""
        return self._scores.get(example_id)

    def scores(self) -> dict[str, float]:
        """Every stored accuracy by question id (the ``naive_acc`` of :func:`filter_training_examples`)."""
        return dict(self._scores)

    def put(self, example_id: str, acc: float, answer: str = "", question: str = "") -> None:
        """Store one accuracy (in memory, and appended to the file with fsync)."""
        if not example_id:
            raise ValueError("the naive-RAG cache is keyed by example id: the example has none")
        acc = float(acc)
        if not math.isfinite(acc):
            raise ValueError(f"naive-RAG accuracy must be finite, got {acc!r}")
        self._scores[example_id] = acc
        if self.path is None:
            return
        row = {"fingerprint": self.fingerprint, "id": example_id, "acc": acc, "answer": answer, "question": question}
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a torn last line: do not glue this row onto it
                    data = b"\n" + data
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    async def get_or_compute(self, example: Example, compute: NaiveCompute) -> tuple[float, bool]:
        """The accuracy of ``example`` and whether it was served without computing.

        On a miss ``await compute(example)`` (returning the accuracy, or ``(accuracy, answer)``) runs once, even
        when several coroutines ask for the same question at once; its result is stored. An exception in
        ``compute`` stores nothing and reaches every waiter."""
        key = example.id
        if not key:
            raise ValueError("the naive-RAG cache is keyed by example id: the example has none")
        if key in self._scores:
            self.hits += 1
            return self._scores[key], True
        pending = self._inflight.get(key)
        if pending is not None:
            self.hits += 1
            return await asyncio.shield(pending), True
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        self.misses += 1
        try:
            result = await compute(example)
            acc, answer = result if isinstance(result, tuple) else (result, "")
            self.put(key, acc, answer, example.question)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here, so an exception nobody waits for is not logged as lost
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(self._scores[key])
        return self._scores[key], False


def _passages(rows: Iterable[Mapping[str, Any]]) -> list[Passage]:
    return [Passage(id=str(r.get("id", "")), title=str(r.get("title", "")), text=str(r.get("text", ""))) for r in rows]


def _generator_step_answer(trace: Trace, generator_llm: LLM) -> str | None:
    """The answer the trace's own generator call gave, if that call was made by ``generator_llm`` (its spec is
    recorded in the step when the run gave the generator role its own model); None otherwise."""
    for step in reversed(trace.steps):
        if step.kind == "answer" and step.meta.get("role") == "generator":
            if step.fallback == "empty_context":
                return ""  # nothing was served: the agent made no call, and an empty answer is wrong
            if generator_llm.spec and step.meta.get("model") == generator_llm.spec:
                return (step.output or "").strip()
            return None
    return None


async def s3_reward(
    trace: Trace,
    generator_llm: LLM,
    cache: NaiveRagCache,
    variant: GbrVariant = "paper",
    judge: Judge | LLM | None = None,
    *,
    config: S3Config | None = None,
    metric: GenAccMetric = "genacc",
    reuse_answer: bool = True,
) -> dict[str, float | bool]:
    """s3's reward of one searcher rollout (s3.md §5): ``{"reward", "acc_s3", "acc_naive", "cached"}``.

    ``acc_s3`` = Acc(G(Q, D_s3), A) on the documents the searcher kept (``trace.meta["selected_passages"]``); the
    trace's own generator answer is used when ``reuse_answer`` and that answer came from ``generator_llm``,
    otherwise the generator is called with the s3 agent's prompt (``config``, the run's S3Config). A trace
    without kept documents (a failed search) scores 0, as the agent's empty context does. ``acc_naive`` =
    Acc(G(Q, D_RAG), A) from ``cache``; on a miss it is computed with the same prompt on the trace's naive top-k
    (``trace.meta["naive_rag_passages"]``), not with the code's zero-shot fallback (s3.md §5.2). ``cached``: the
    naive accuracy was served without a generator call. ``reward`` = :func:`gain_beyond_rag` (``variant``).

    ``cache`` must have been made for ``generator_llm`` (:meth:`NaiveRagCache.for_s3`); a cache of another
    generator raises ValueError rather than mix baselines.
    """
    generator_spec = generator_llm.spec or type(generator_llm).__name__
    if cache.generator != generator_spec:
        raise ValueError(
            f"the naive-RAG cache was made for generator {cache.generator!r}, not {generator_spec!r}: its accuracies"
            " would be stale baselines"
        )
    cfg = config or S3Config()
    example = trace.example
    question = trace.meta.get("generator_question") or task_question(example, cfg)

    async def naive(ex: Example) -> tuple[float, str]:
        if "naive_rag_passages" not in trace.meta:
            raise ValueError(f"trace of {ex.id!r} has no naive_rag_passages: not an s3 trace")
        naive_docs = _passages(trace.meta["naive_rag_passages"])
        return await generator_accuracy(question, naive_docs, ex.answers, generator_llm, cfg, judge, metric)

    async def searched() -> float:
        answer = _generator_step_answer(trace, generator_llm) if reuse_answer else None
        if answer is None:
            served = _passages(trace.meta.get("selected_passages") or [])
            answer = await generator_answer(question, served, generator_llm, cfg) if served else ""
        return await generation_accuracy(answer, example.answers, judge, metric)

    acc_s3, (acc_naive, cached) = await asyncio.gather(searched(), cache.get_or_compute(example, naive))
    return {
        "reward": gain_beyond_rag(acc_s3, acc_naive, variant),
        "acc_s3": acc_s3,
        "acc_naive": acc_naive,
        "cached": cached,
    }


async def precompute_naive_rag(
    examples: Iterable[Example],
    retriever: Any,
    generator_llm: LLM,
    cache: NaiveRagCache,
    config: S3Config | None = None,
    judge: Judge | LLM | None = None,
    metric: GenAccMetric = "genacc",
    concurrency: int = 64,
) -> dict[str, float]:
    """Fill ``cache`` with the naive-RAG accuracy of every example (s3.md §5.3): the top ``config.k_initial``
    passages that ``retriever.asearch`` returns for the question (the same search the s3 agent starts with),
    answered by the generator with the s3 prompt and scored with ``metric``. Cached questions are not recomputed,
    so a killed run resumes. Returns the accuracies of ``examples`` by id."""
    cfg = config or S3Config()
    gate = asyncio.Semaphore(max(1, concurrency))

    async def compute(example: Example) -> tuple[float, str]:
        top = await retriever.asearch(example.question.strip(), cfg.k_initial)
        question = task_question(example, cfg)
        return await generator_accuracy(question, top, example.answers, generator_llm, cfg, judge, metric)

    async def one(example: Example) -> tuple[str, float]:
        async with gate:
            acc, _ = await cache.get_or_compute(example, compute)
        return example.id, acc

    return dict(await asyncio.gather(*(one(e) for e in examples)))


YES_NO_ANSWERS = frozenset({"yes", "no", "true", "false"})


def filter_training_examples(
    examples: Iterable[Example], naive_acc: Mapping[str, float]
) -> tuple[list[Example], Counter[str]]:
    """s3's training-data filter (s3.md §6), keeping the examples' order; returns ``(kept, dropped counts)``.

    Each dropped example is counted under the first reason that applies:
    ``no_answer`` (no gold answer: nothing to score); ``yes_no_answer`` (a gold answer is yes/no/true/false: the
    code's list ``['yes','no','true','false','Yes','No','True','False']``, compared here after strip and lower-case,
    so "YES" too; span_check is unreliable under negation); ``no_naive_acc`` (the question has no naive-RAG
    accuracy in ``naive_acc``: it was not precomputed); ``naive_rag_correct`` (naive RAG already answers it:
    accuracy > 0; the paper keeps only questions whose baseline is 0)."""
    kept: list[Example] = []
    dropped: Counter[str] = Counter()
    for example in examples:
        golds = [str(a).strip() for a in example.answers if str(a).strip()]
        if not golds:
            dropped["no_answer"] += 1
        elif any(g.lower() in YES_NO_ANSWERS for g in golds):
            dropped["yes_no_answer"] += 1
        elif example.id not in naive_acc:
            dropped["no_naive_acc"] += 1
        elif naive_acc[example.id] > 0:
            dropped["naive_rag_correct"] += 1
        else:
            kept.append(example)
    return kept, dropped
