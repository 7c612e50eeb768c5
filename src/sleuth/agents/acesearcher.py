"""AceSearcher (Xu et al., NeurIPS 2025, arXiv 2509.24193): decompose, answer each sub-question, then answer.

One model plays two roles, chosen by the prompt (docs/methods.md, AceSearcher):

1. **Decompose** the question (or claim) into sub-questions ``### Q1: ...`` that may refer to earlier answers as
   ``#1``, ``#2`` (one LLM call).
2. For each sub-question: substitute the earlier answers for its ``#k``, **retrieve** the top-k (k=10) passages for
   the resolved text and **answer** it with a short span (fact verification: Yes/No), one LLM call each.
3. **Final answer** (one LLM call) from the sub-questions, their answers and, for QA, a pool of the top
   ``floor(N / n)`` passages of each sub-question (N=15), with a rationale and ``<answer>...</answer>``. For claims
   the final prompt has no passages (paper Fig. 17 and the released ``main_qa.py``).

Departures from a literal sequential loop, all recorded in the Trace: sub-questions that reference no unanswered
``#k`` run concurrently in "waves" (``parallel=True``; the answers are identical to the sequential order, only the
wall-clock changes); malformed model output is parsed leniently and every such case names its rule in
``step.fallback``; an example is never dropped (the released code silently drops unparseable decompositions).

Paper vs official code (paper is the default, the code's choice a named option; see ``AceSearcherConfig``):
prompt wording (``prompts``), passage order for sub-question answering (``passage_order``), final passage budget
(``budget_rule``), passage text format (``passage_style``), decoding details (``official_code()`` preset).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sleuth.agents.base import (
    Context,
    Inert,
    format_passages,
    inert,
    load_prompt,
    register_agent,
)
from sleuth.claims import claim_label
from sleuth.llm import Sampling
from sleuth.records import Example, Passage, Step, Trace

__all__ = [
    "GIVEN_DECOMPOSITION",
    "AceSearcherConfig",
    "SubQuestion",
    "acesearcher",
    "clean_subanswer",
    "decompose",
    "decompose_prompt",
    "dependency_waves",
    "extract_answer",
    "final_prompt",
    "is_fact",
    "parse_decomposition",
    "passage_budget",
    "passages_text",
    "pool_passages",
    "render_acesearcher",
    "resolve_references",
    "subanswer_prompt",
    "zigzag",
]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


# Example.metadata key: a decomposition text the agent uses instead of calling the decomposer (see `decompose`).
GIVEN_DECOMPOSITION = "acesearcher_decomposition"


@dataclass
class AceSearcherConfig:
    """Options of the ``acesearcher`` agent. Defaults follow the paper; comments name the official code's choice.

    ``sampling`` is the decoding of every call (the paper decodes greedily; the CLI replaces its
    ``max_new_tokens``). The ``*_max_new_tokens`` fields override the budget of one call kind (None: use
    ``sampling.max_new_tokens``); the released code uses 2048 for the decomposition and 512 for the rest.
    """

    k: int = 10  # passages retrieved per sub-question [paper §5.1, code --k 10]
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.0, max_new_tokens=512))
    decompose_max_new_tokens: int | None = None
    subanswer_max_new_tokens: int | None = None
    final_max_new_tokens: int | None = None
    # "paper": Appendix E figures verbatim; "code": the strings the released checkpoints were trained with.
    prompts: Literal["paper", "code"] = "paper"
    # "auto": fact verification when example.kind == "claim"; "qa" / "fact" force one variant.
    variant: Literal["auto", "qa", "fact"] = "auto"
    # "rank": retriever order (the paper states none); "zigzag": the code's zigzag_visit (best first, 2nd best last).
    passage_order: Literal["rank", "zigzag"] = "rank"
    passage_style: str = "title_text"  # format_passages style; the code sends the passage text only ("text")
    # "paper": floor(N/n) passages per sub-question for the final call; "code": 5 each if n <= 3 else 3.
    budget_rule: Literal["paper", "code"] = "paper"
    total_passages: int = 15  # N [paper §4.2 Remark]
    max_subquestions: int = 6  # the code rejects decompositions of 7+ sub-questions as RFT "chosen" (digest §1.3)
    parallel: bool = True  # False: strictly one sub-question at a time, in order (for the wall-clock comparison)
    # True: substitute the first line of a sub-answer (trailing periods stripped) for #k and normalise sub-claim
    # answers to Yes/No (digest §10 items 3-4); False: the raw stripped output, as the code does.
    subanswer_cleanup: bool = True

    @classmethod
    def official_code(cls) -> AceSearcherConfig:
        """Every choice of the released ``inference/`` scripts: code prompts, zigzag order, the 5-or-3 budget,
        text-only passages, raw sub-answers, top_p 0.99, repetition_penalty 1.05, 2048/512 token budgets."""
        return cls(
            sampling=Sampling(temperature=0.0, top_p=0.99, repetition_penalty=1.05, max_new_tokens=512),
            decompose_max_new_tokens=2048,
            prompts="code",
            passage_order="zigzag",
            passage_style="text",
            budget_rule="code",
            subanswer_cleanup=False,
        )

    def validate(self) -> None:
        """Raise ValueError for an option value the agent does not know (``--set`` values arrive unchecked)."""
        choices = {
            "prompts": ("paper", "code"),
            "variant": ("auto", "qa", "fact"),
            "passage_order": ("rank", "zigzag"),
            "budget_rule": ("paper", "code"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"acesearcher option {name}={getattr(self, name)!r}; expected one of {allowed}")
        for name in ("k", "total_passages", "max_subquestions"):
            if getattr(self, name) < 1:
                raise ValueError(f"acesearcher option {name} must be >= 1")


def is_fact(example: Example, config: Any) -> bool:
    """Whether ``example`` runs the fact-verification variant (claim prompts, Yes/No answers, no final passages)."""
    variant = getattr(config, "variant", "auto")
    return variant == "fact" or (variant == "auto" and example.kind == "claim")


def _prompt(stage: str, fact: bool, prompts: str) -> str:
    prefix = "acesearcher_code_" if prompts == "code" else "acesearcher_"
    return load_prompt(f"{prefix}{stage}_{'claim' if fact else 'qa'}")


def _budgeted(sampling: Sampling, max_new_tokens: int | None) -> Sampling:
    return dataclasses.replace(sampling, max_new_tokens=max_new_tokens) if max_new_tokens else sampling


def _join_fallbacks(*names: str | None) -> str | None:
    return "+".join(n for n in names if n) or None


# ---------------------------------------------------------------------------------------------------------------
# Decomposition parsing and reference resolution
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SubQuestion:
    """One sub-question (or sub-claim) of a decomposition. ``index`` is 1-based; ``text`` may hold ``#k``
    references to earlier answers; ``depends_on`` lists the earlier indices it references (1 <= k < index)."""

    index: int
    text: str
    depends_on: list[int]


_REF = re.compile(r"#(\d+)")
_LABEL = r"(?:q|question|sub-?questions?|sub-?claims?|claim)\s*(\d+)\s*(?:[:.)\-]\s*|\s+)"
_CANONICAL = re.compile(r"^###\s*Q\s*(\d+)\s*:\s*(.*)$")  # the released parser's format: "### Q1: text"
_HASH_LABELLED = re.compile(rf"^#+\s*{_LABEL}(.*)$", re.IGNORECASE)
_HASH_NUMBERED = re.compile(r"^#+\s*(\d+)\s*[:.)]\s+(.*)$")  # "### 1. text"
_HASH_PLAIN = re.compile(r"^#+(?![#\d])\s*(.*)$")  # "### text"; "#1 ..." at a line start is a reference, not a mark
_LABELLED = re.compile(rf"^{_LABEL}(.*)$", re.IGNORECASE)
_NUMBERED = re.compile(r"^(\d+)\s*[.)]\s+(.*)$")
_ECHO = re.compile(r"^decomposed (question|claim)s?\s*:?$", re.IGNORECASE)  # the prompt's last line, echoed


# Sub-question numbers and #k references are small; a longer digit run would meet Python's int-string limit.
_MAX_DIGITS = 9
_HUGE = 10**_MAX_DIGITS  # what an over-long #k reads as: never a sub-question's number


def _number(digits: str) -> int:
    return int(digits) if len(digits) <= _MAX_DIGITS else _HUGE


def _references(text: str) -> list[int]:
    return [_number(m) for m in _REF.findall(text)]


def _classify(line: str) -> tuple[str, int | None, str, bool] | None:
    """(family, label, text, canonical) of one output line, or None when it is not a sub-question line."""
    line = line.strip().replace("**", "").strip()
    if m := _CANONICAL.match(line):
        return "hash", _number(m.group(1)), m.group(2).strip(), len(m.group(1)) <= _MAX_DIGITS
    if m := _HASH_LABELLED.match(line):
        return "hash", _number(m.group(1)), m.group(2).strip(), False
    if m := _HASH_NUMBERED.match(line):
        return "hash", _number(m.group(1)), m.group(2).strip(), False
    if m := _HASH_PLAIN.match(line):
        return "hash", None, m.group(1).strip(), False
    if m := _LABELLED.match(line):
        return "q", _number(m.group(1)), m.group(2).strip(), False
    if m := _NUMBERED.match(line):
        return "numbered", _number(m.group(1)), m.group(2).strip(), False
    return None


def parse_decomposition(text: str, max_subquestions: int = 6) -> tuple[list[SubQuestion], str | None]:
    """Sub-questions from a decomposition output, leniently; returns them and the fallback taken (None if clean).

    Clean means every sub-question line is ``### Q<k>: text`` numbered 1..n (the released parser's format). Also
    accepted, in order of preference (only lines of the most preferred family present are used): any ``#``-marked
    line (``### Q1.``, ``## Question 1:``, ``### text`` without a label) -> ``"hash_lines"``; ``Q1:`` lines ->
    ``"q_lines"``; numbered lines ``1.`` / ``1)`` -> ``"numbered_lines"``. Sub-questions are renumbered 1..n and,
    when every line had a distinct label that differs from its position, ``#label`` references are rewritten to
    the new numbers (``"renumbered"``). More than ``max_subquestions`` are cut to the first ones (``"capped"``).
    Nothing parseable gives ``([], "unparsed")``: callers then use the question itself.

    >>> subs, fallback = parse_decomposition("### Q1: Who directed Jaws?\\n### Q2: When was #1 born?")
    >>> [(s.index, s.text, s.depends_on) for s in subs], fallback
    ([(1, 'Who directed Jaws?', []), (2, 'When was #1 born?', [1])], None)
    """
    rows = [
        row for line in (text or "").splitlines() if (row := _classify(line)) and row[2] and not _ECHO.match(row[2])
    ]
    family = next((f for f in ("hash", "q", "numbered") if any(r[0] == f for r in rows)), None)
    if family is None:
        return [], "unparsed"
    rows = [r for r in rows if r[0] == family]
    labels = [r[1] for r in rows]
    texts = [r[2] for r in rows]
    sequential = labels == list(range(1, len(rows) + 1))
    fallbacks: list[str] = []
    if not all(r[3] for r in rows):
        fallbacks.append(f"{family}_lines")
    if not sequential and None not in labels:
        if len(set(labels)) == len(labels):
            position = {label: i for i, label in enumerate(labels, 1)}
            texts = [_REF.sub(lambda m: f"#{position.get(_number(m.group(1)), m.group(1))}", t) for t in texts]
            fallbacks.append("renumbered")
        else:  # repeated labels: #k can only mean the k-th line
            fallbacks.append("duplicate_labels")
    if len(texts) > max_subquestions:
        texts = texts[:max_subquestions]
        fallbacks.append("capped")
    subs = [SubQuestion(i, t, sorted({k for k in _references(t) if 1 <= k < i})) for i, t in enumerate(texts, 1)]
    return subs, _join_fallbacks(*fallbacks)


def resolve_references(text: str, answers: dict[int, str]) -> str:
    """Substitute ``answers[k]`` for every ``#k`` in ``text``; references without a (non-empty) answer stay.

    The whole number is matched, so ``#1`` never rewrites the start of ``#10`` (the released code's plain
    ``str.replace`` does).

    >>> resolve_references("Is #1 older than #10? (#3)", {1: "Ann", 10: "Bob"})
    'Is Ann older than Bob? (#3)'
    """
    return _REF.sub(lambda m: answers.get(_number(m.group(1))) or m.group(0), text)


def clean_subanswer(text: str, fact: bool) -> tuple[str, str | None]:
    """The answer of a sub-question call and the fallback taken.

    QA: the first non-empty line without trailing periods (``"first_line"`` when there were more lines), because
    a verbose answer substituted for ``#k`` makes a poor retrieval query (digest §10 item 3). Fact verification:
    ``"Yes"`` / ``"No"`` (``"yes_no_normalised"`` when the reply was more than the bare word; ``"no_yes_no"`` and
    the first line when it names neither). Empty output gives ``("", "empty_subanswer")``.
    """
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return "", "empty_subanswer"
    if fact:
        label = claim_label(text)
        if label is None:
            return lines[0], "no_yes_no"
        bare = len(lines) == 1 and lines[0].rstrip(".!").strip().lower() in ("yes", "no")
        return ("Yes" if label == "yes" else "No"), None if bare else "yes_no_normalised"
    answer = lines[0].rstrip(".").strip() or lines[0]
    return answer, "first_line" if len(lines) > 1 else None


def extract_answer(text: str) -> tuple[str, str | None]:
    """The final answer in ``text`` and the fallback taken (None when the reference code reads an answer).

    The reference rule (``extract_answer`` of the released code): when the text
    holds both ``<answer>`` and ``</answer>`` anywhere, the text after the LAST ``<answer>`` up to the next
    ``</answer>`` (or to the end when none follows), stripped: so ``<answer>A</answer> then <answer>B`` gives ``B``
    with no fallback. Otherwise, leniently: everything after an unclosed last ``<answer>``
    (``"unclosed_answer_tag"``; the reference reads ``""``); else the text after a last "answer is"
    (``"answer_is"``); else the last non-empty line (``"last_line"``, or ``"whole_text"`` for a one-line reply);
    ``("", "empty_output")`` for no text, ``"empty_answer_tag"`` for an empty tagged answer.

    >>> extract_answer("Jaws came out in 1975. <answer>Steven Spielberg</answer>")
    ('Steven Spielberg', None)
    >>> extract_answer("<answer>A</answer> on second thought <answer>B")
    ('B', None)
    >>> extract_answer("Reasoning...\\nSo the answer is Paris.")
    ('Paris', 'answer_is')
    """
    text = (text or "").strip()
    if not text:
        return "", "empty_output"
    opened = text.rfind("<answer>")
    if opened >= 0:
        after = text[opened + len("<answer>") :]
        end = after.find("</answer>")
        if end >= 0:
            answer = after[:end].strip()
            return answer, None if answer else "empty_answer_tag"
        answer = after.strip()
        if answer:
            return answer, None if "</answer>" in text[:opened] else "unclosed_answer_tag"
    text = text.replace("<answer>", " ").replace("</answer>", " ").strip()
    if m := list(re.finditer(r"answer is:?\s*(.+)", text, re.IGNORECASE)):
        answer = m[-1].group(1).strip().splitlines()[0].strip().rstrip(".").strip()
        if answer:
            return answer, "answer_is"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "", "empty_output"
    return lines[-1], "last_line" if len(lines) > 1 else "whole_text"


# ---------------------------------------------------------------------------------------------------------------
# Passages: order for sub-question answering, budget and pool for the final call
# ---------------------------------------------------------------------------------------------------------------


def zigzag(passages: list[Passage]) -> list[Passage]:
    """The released code's ``zigzag_visit``: ranks 1..7 become 1,3,5,7,6,4,2 (best first, second best last,
    the weakest in the middle, where long-context models attend least)."""
    return passages[0::2] + passages[1::2][::-1]


def passage_budget(n_subquestions: int, total: int = 15, rule: str = "paper") -> int:
    """Passages each sub-question contributes to the final call.

    ``"paper"`` (§4.2 Remark): ``floor(total / n)``. ``"code"`` (``main_qa.py``): 5 when n <= 3, else 3 (``total``
    is ignored, so n=6 gives 18 passages).

    >>> [passage_budget(n) for n in range(1, 8)], [passage_budget(n, rule="code") for n in range(1, 8)]
    ([15, 7, 5, 3, 3, 2, 2], [5, 5, 5, 3, 3, 3, 3])
    """
    if n_subquestions < 1:
        raise ValueError("passage_budget needs at least one sub-question")
    if rule == "paper":
        return total // n_subquestions
    if rule == "code":
        return 5 if n_subquestions <= 3 else 3
    raise ValueError(f"unknown budget rule {rule!r}; expected 'paper' or 'code'")


def pool_passages(per_subquestion: list[list[Passage]], budget: int) -> list[Passage]:
    """The top ``budget`` passages of each sub-question, in sub-question then rank order, deduplicated by id in
    first-seen order (the code's ``set()`` makes the order depend on the hash seed)."""
    seen: set[str] = set()
    pool: list[Passage] = []
    for passages in per_subquestion:
        for passage in passages[:budget]:
            if passage.id not in seen:
                seen.add(passage.id)
                pool.append(passage)
    return pool


def passages_text(passages: list[Passage], style: str = "title_text", inert: Inert = inert) -> str:
    """Passages as the agent's prompts show them: ``format_passages`` over titles and texts made inert (the agent
    passes :meth:`Context.inert`): every tag look-alike escaped, so retrieved text never carries a tag the final
    prompt asks the model to write (``<answer>``), and every special token of the run's models broken, so a passage
    cannot open or close a chat turn."""
    safe = [dataclasses.replace(p, title=inert(p.title), text=inert(p.text)) for p in passages]
    return format_passages(safe, style)


# ---------------------------------------------------------------------------------------------------------------
# Prompts: pure builders shared by the agent and the SFT data builders (sleuth.train.sft), so that a model trained
# on them meets at inference exactly the text it was trained on.
# ---------------------------------------------------------------------------------------------------------------


def decompose_prompt(question: str, fact: bool, prompts: str = "paper") -> str:
    """The decomposition prompt for ``question`` (QA: Fig. 9, claims: Fig. 10; ``prompts="code"``: the released
    strings), as sent."""
    return _prompt("decompose", fact, prompts).format(question=question, claim=question).strip()


def subanswer_prompt(
    subquestion: str,
    passages: list[Passage],
    fact: bool,
    prompts: str = "paper",
    passage_style: str = "title_text",
    passage_order: str = "rank",
    inert: Inert = inert,
) -> str:
    """The sub-question (or sub-claim) answering prompt over ``passages`` given in retriever order
    (``passage_order="zigzag"`` reorders them as the released code does), as sent. ``inert`` makes the passages
    and the resolved sub-question (which holds earlier answers, i.e. model text) safe for the prompt."""
    ordered = zigzag(passages) if passage_order == "zigzag" else passages
    template = _prompt("subanswer", fact, prompts)
    shown = passages_text(ordered, passage_style, inert)
    return template.format(passages=shown, subquestion=inert(subquestion)).strip()


def final_prompt(
    question: str,
    items: Sequence[tuple[int, str, str]],
    pool: list[Passage],
    fact: bool,
    prompts: str = "paper",
    passage_style: str = "title_text",
    inert: Inert = inert,
) -> str:
    """The final-answer prompt, as sent. ``items``: ``(index, resolved sub-question, answer)`` per sub-question;
    ``pool``: the passage pool (unused for fact verification, whose prompt has no passages: Fig. 17,
    ``main_qa.py``). ``inert`` makes the passages, sub-questions and sub-answers safe for the prompt."""
    item = load_prompt(f"acesearcher_{'code_' if prompts == 'code' else ''}final_item")
    # The paper's figures lost their line breaks in conversion (entries read space-separated); the code uses "\n".
    separator = "\n" if prompts == "code" else " "
    subanswers = separator.join(item.format(index=i, subquestion=inert(q), answer=inert(a)) for i, q, a in items)
    template = _prompt("final", fact, prompts)
    if fact:
        return template.format(subanswers=subanswers, question=question).strip()
    passages = passages_text(pool, passage_style, inert)
    return template.format(passages=passages, subanswers=subanswers, question=question).strip()


# ---------------------------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------------------------


async def decompose(example: Example, ctx: Context, trace: Trace, config: Any) -> list[SubQuestion]:
    """Make the decomposition call (QA: Fig. 9, claims: Fig. 10, or the code's strings) and parse it.

    ``config`` is an :class:`AceSearcherConfig`, or any object with a ``sampling`` field (``prompts``, ``variant``,
    ``decompose_max_new_tokens`` and ``max_subquestions`` default to "paper", "auto", None and 6 when absent).
    The step records the parsed sub-questions and the fallback; when nothing parses the question itself is the
    single sub-question (``"unparsed+question_as_subquestion"``), so the list is never empty.

    ``example.metadata[GIVEN_DECOMPOSITION]`` (a decomposition text) replaces the call: the step then has no prompt
    and ``meta["given"] = True``. mDPO uses it to sample several solver runs under one sampled decomposition.
    """
    given = example.metadata.get(GIVEN_DECOMPOSITION)
    if isinstance(given, str):  # fixed by the caller: no model call, parsed like a model output
        step = trace.add(Step(kind="decompose", output=given, meta={"given": True}))
    else:
        prompt = decompose_prompt(example.question, is_fact(example, config), getattr(config, "prompts", "paper"))
        sampling = _budgeted(config.sampling, getattr(config, "decompose_max_new_tokens", None))
        step = await ctx.chat(trace, "decompose", prompt, sampling)
    subs, fallback = parse_decomposition(step.output or "", getattr(config, "max_subquestions", 6))
    if not subs:
        subs = [SubQuestion(1, example.question, [])]
        fallback = _join_fallbacks(fallback, "question_as_subquestion")
    step.parsed = [dataclasses.asdict(s) for s in subs]
    step.fallback = fallback
    return subs


def dependency_waves(subs: list[SubQuestion]) -> dict[int, int]:
    """The 1-based wave of each sub-question: 1 without references, else one after its latest dependency."""
    wave: dict[int, int] = {}
    for sub in sorted(subs, key=lambda s: s.index):
        wave[sub.index] = 1 + max((wave.get(d, 0) for d in sub.depends_on), default=0)
    return wave


@dataclass
class _Solved:
    sub: SubQuestion
    resolved: str
    passages: list[Passage]
    answer: str
    wave: int
    unresolved: list[int]


async def _solve(
    sub: SubQuestion,
    answers: dict[int, str],
    wave: int,
    ctx: Context,
    trace: Trace,
    config: AceSearcherConfig,
    fact: bool,
) -> _Solved:
    """Resolve, retrieve and answer one sub-question."""
    resolved = resolve_references(sub.text, answers)
    unresolved = [k for k in _references(sub.text) if not answers.get(k)]
    passages = await ctx.search(trace, resolved, config.k)
    prompt = subanswer_prompt(
        resolved, passages, fact, config.prompts, config.passage_style, config.passage_order, ctx.inert
    )
    sampling = _budgeted(config.sampling, config.subanswer_max_new_tokens)
    step = await ctx.chat(trace, "subanswer", prompt, sampling)
    if config.subanswer_cleanup:
        answer, fallback = clean_subanswer(step.output or "", fact)
    else:
        answer = (step.output or "").strip()
        fallback = None if answer else "empty_subanswer"
    step.parsed = answer
    step.fallback = _join_fallbacks("unresolved_reference" if unresolved else None, fallback)
    step.meta.update(subquestion=sub.index, wave=wave, passage_ids=[p.id for p in passages])
    return _Solved(sub, resolved, passages, answer, wave, unresolved)


async def _solve_all(
    subs: list[SubQuestion], ctx: Context, trace: Trace, config: AceSearcherConfig, fact: bool
) -> list[_Solved]:
    """Answer the sub-questions wave by wave (each wave's calls concurrent), or one by one when not parallel."""
    if config.parallel:
        level = dependency_waves(subs)
        rounds = [[s for s in subs if level[s.index] == w] for w in sorted(set(level.values()))]
    else:
        rounds = [[s] for s in subs]
    answers: dict[int, str] = {}
    solved: list[_Solved] = []
    for wave, group in enumerate(rounds, 1):
        done = await asyncio.gather(*(_solve(s, answers, wave, ctx, trace, config, fact) for s in group))
        for item in done:
            solved.append(item)
            if item.answer:
                answers[item.sub.index] = item.answer
    trace.meta["waves"] = len(rounds)
    trace.meta["sequential_rounds"] = len(subs)
    trace.meta["parallel"] = config.parallel
    return sorted(solved, key=lambda s: s.sub.index)


def _record_decomposition(trace: Trace, solved: list[_Solved]) -> None:
    trace.meta["decomposition"] = [
        {
            "index": s.sub.index,
            "text": s.sub.text,
            "resolved": s.resolved,
            "depends_on": list(s.sub.depends_on),
            "answer": s.answer,
            "passage_ids": [p.id for p in s.passages],
            "titles": list(dict.fromkeys(p.title for p in s.passages if p.title)),
            "wave": s.wave,
            "unresolved": s.unresolved,
        }
        for s in solved
    ]


def render_acesearcher(trace: Trace) -> Any:
    """The question, the decomposition as a tree (resolved sub-question, answer, evidence titles), the answer."""
    from rich.console import Group
    from rich.text import Text
    from rich.tree import Tree

    tree = Tree(Text(trace.example.question, style="bold"), guide_style="dim")
    items = trace.meta.get("decomposition") or []
    if not items:
        tree.add(Text("(no decomposition recorded)", style="dim"))
    for item in items:
        label = Text.assemble((f"Q{item['index']}", "bold cyan"), f": {item['resolved']}")
        if item.get("depends_on"):
            label.append(f"  <- {', '.join(f'#{d}' for d in item['depends_on'])}", style="dim")
        label.append(f"  (wave {item.get('wave')})", style="dim")
        node = tree.add(label)
        node.add(Text.assemble(("answer: ", "bold"), (item.get("answer") or "(empty)", "green")))
        titles = item.get("titles") or []
        if titles:
            more = f" ... +{len(titles) - 5}" if len(titles) > 5 else ""
            node.add(Text.assemble(("evidence: ", "bold"), (", ".join(titles[:5]) + more, "cyan")))
    parts: list[Any] = [tree]
    if items:
        parts.append(
            Text(
                f"{len(items)} sub-question(s) in {trace.meta.get('waves')} wave(s) "
                f"(sequential: {trace.meta.get('sequential_rounds')}); final context: "
                f"{len(trace.meta.get('pool_ids', []))} passage(s)",
                style="dim",
            )
        )
    answer_style = "bold green" if trace.answer else "bold red"
    parts.append(Text.assemble(("final answer: ", "bold"), (trace.answer or "(no answer)", answer_style)))
    return Group(*parts)


@register_agent("acesearcher", config=AceSearcherConfig, needs_retriever=True, render=render_acesearcher)
async def acesearcher(example: Example, ctx: Context, trace: Trace) -> Trace:
    """AceSearcher: decompose, answer each sub-question from its own top-k passages, answer from them all."""
    config: AceSearcherConfig = ctx.config if ctx.config is not None else AceSearcherConfig()
    trace.answer = ""
    config.validate()
    fact = is_fact(example, config)
    trace.meta["variant"] = "fact" if fact else "qa"

    subs = await decompose(example, ctx, trace, config)
    solved = await _solve_all(subs, ctx, trace, config, fact)
    _record_decomposition(trace, solved)

    pool: list[Passage] = []
    if not fact:  # Fig. 17 and main_qa.py: the sub-claims and their Yes/No answers only, no passages
        budget = passage_budget(len(solved), config.total_passages, config.budget_rule)
        pool = pool_passages([s.passages for s in solved], budget)
        trace.meta["passage_budget"] = budget
    items = [(s.sub.index, s.resolved, s.answer) for s in solved]
    prompt = final_prompt(example.question, items, pool, fact, config.prompts, config.passage_style, ctx.inert)
    trace.meta["pool_ids"] = [p.id for p in pool]

    sampling = _budgeted(config.sampling, config.final_max_new_tokens)
    step = await ctx.chat(trace, "answer", prompt, sampling)
    answer, fallback = extract_answer(step.output or "")
    if fact:
        label = claim_label(answer)
        if label is None:
            fallback = _join_fallbacks(fallback, "no_yes_no")
        else:
            answer = "Yes" if label == "yes" else "No"
    step.parsed = answer
    step.fallback = fallback
    step.meta["pool_ids"] = trace.meta["pool_ids"]
    trace.answer = answer
    return trace
