"""ARENA (Ren et al., arXiv 2505.13258): a reader that answers from numbered references and says which it used.

One structured generation over the references: ``<relevance>[1, 5]</relevance>`` (the reference numbers it relies
on), ``<analysis>`` (reasoning that cites them) and ``<answer>`` (a short answer). The cited numbers map back to
Passage ids, so every answer comes with machine-checkable evidence (``trace.meta["cited_ids"]``).

The references are the example's given paragraphs in their original order (as in the paper), or, when an example
has none, the top-k passages a retriever returns. :func:`parse_arena`, :func:`arena_format_ok`,
:func:`arena_prompt` and :func:`citation_precision_recall` are pure functions that ARENA's trainer reuses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sleuth.agents.base import (
    Context,
    inert,
    load_prompt,
    register_agent,
)
from sleuth.llm import Sampling
from sleuth.records import Example, Passage, Trace

PROMPT_VARIANTS = ("code", "paper")

# --------------------------------------------------------------------------------------------------- parsing

# The official format check (ARENA src/evaluate.py; docs/methods.md, ARENA). VERBOSE drops the pattern's spaces;
# MULTILINE lets ``$`` match before any newline, so "</answer>\ntrailing text" passes and "</answer> x" does not.
_FORMAT = re.compile(
    r"""
    ^
    <relevance>    [^<]*  </relevance>
    \s*
    <analysis>     [^<]*  </analysis>
    \s*
    <answer>       [^<]*  </answer>
    $
    """,
    re.DOTALL | re.VERBOSE | re.MULTILINE,
)
_TAGS = ("relevance", "analysis", "answer")
_KNOWN_TAG = re.compile(r"</?(?:relevance|analysis|answer)>")
_ANY_TAG = re.compile(r"</?\s*[A-Za-z_][\w-]*\s*/?>")
_INT = re.compile(r"\d+")
# "[1]", "[1, 5]", "Reference 2", "references 3 and 4" inside an analysis
_ANALYSIS_CITE = re.compile(r"\[(\d+(?:\s*,\s*\d+)*)\]|\breferences?\s+(\d+(?:\s*(?:,|and)\s*\d+)*)", re.IGNORECASE)
_ANSWER_LABEL = re.compile(r"\banswer(?:\s+is\s*:?|\s*:)\s*(.*)", re.IGNORECASE)  # "Answer: x", "the answer is x"


@dataclass
class ArenaOutput:
    """What an ARENA completion says: the reference numbers it selected (deduplicated, in the model's order), its
    analysis, its answer, whether it passed the official format check, and the lenient rules used (``+``-joined,
    ``None`` when none was needed)."""

    relevance: list[int]
    analysis: str
    answer: str
    format_ok: bool
    fallback: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arena_format_ok(text: str) -> bool:
    """The official format reward: exactly ``<relevance>``, ``<analysis>``, ``<answer>`` in order from the first
    character, only whitespace between them and no ``<`` inside any section."""
    return _FORMAT.match(text) is not None


def section(text: str, tag: str) -> str | None:
    r"""The official extraction (``re.search(r"<tag>\s*(.*?)\s*</tag>", DOTALL)``, the released code) without
    its cubic backtracking: the content between the first ``<tag>`` and the first ``</tag>`` after it, stripped of
    surrounding whitespace (``str.strip`` and the regex's ``\s`` agree on every code point); None without a pair.
    (When the first ``<tag>`` has no closing tag after it, no later one has either.)"""
    opening, closing = f"<{tag}>", f"</{tag}>"
    start = text.find(opening)
    if start < 0:
        return None
    start += len(opening)
    end = text.find(closing, start)
    return None if end < 0 else text[start:end].strip()


def _json(content: str) -> Any:
    """``json.loads`` that never raises: None for invalid JSON, numbers past Python's 4,300-digit int limit
    (ValueError) and nesting past the recursion limit."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


def reference_relevance(text: str) -> list[Any] | None:
    """The reference code's relevance selection (ARENA ``src/rewards.py``): the first
    ``<relevance>`` pair's content parsed as JSON and turned into ``sorted(set(value))`` with the elements as they
    are, so ``[1.5, 1]`` stays ``[1, 1.5]`` and ``true`` stays ``True`` (which equals 1). None wherever the
    reference's code raises and scores 0: no pair, invalid JSON, a value ``set()`` rejects (a bare number,
    ``null``) or elements ``sorted()`` cannot order (``[1, "a"]``, ``[[1]]``). A JSON string or object iterates
    as its characters or keys, as ``set()`` does in the reference."""
    content = section(text, "relevance")
    if content is None:
        return None
    value = _json(content)
    try:
        return sorted(set(value))
    except TypeError:
        return None


def _strict_relevance(content: str) -> list[int] | None:
    """The official rule: the section must be a JSON list of numbers (``[1,5]``, ``[1.0, 5]``, ``[true]`` which the
    reference counts as 1); anything else (``1,5``, ``["1"]``, a bare ``3``) selects nothing. Non-integral numbers
    can never equal an index and are dropped from the citations (:func:`reference_relevance` keeps them, for the
    reward)."""
    value = _json(content)
    if not isinstance(value, list) or not all(isinstance(v, int | float) for v in value):
        return None
    return _unique(int(v) for v in value if isinstance(v, int) or v.is_integer())


def _unique(numbers: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(numbers))


# Reference numbers are small; a longer digit run is no reference and would meet Python's int-string limit.
_MAX_DIGITS = 9


def _numbers(texts: Iterable[str], fallbacks: list[str]) -> list[int]:
    """Every digit run in ``texts`` as an int; runs over ``_MAX_DIGITS`` digits are skipped (``number_too_long``)."""
    out: list[int] = []
    for text in texts:
        for run in _INT.findall(text):
            if len(run) > _MAX_DIGITS:
                if "number_too_long" not in fallbacks:
                    fallbacks.append("number_too_long")
                continue
            out.append(int(run))
    return out


def _unclosed(text: str, tag: str) -> str | None:
    """The text after an opening ``<tag>`` that is never closed, up to the next known tag (a truncated section)."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    rest = text[start + len(tag) + 2 :]
    cut = _KNOWN_TAG.search(rest)
    return (rest[: cut.start()] if cut else rest).strip()


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def parse_arena(text: str, strict: bool = False) -> ArenaOutput:
    """Parse an ARENA completion (linear time in ``len(text)``; never raises).

    ``strict``: the official evaluate.py rules only: the first complete tag pair of each section (``""`` when a
    tag is missing) and the JSON relevance rule. What they could not read is still recorded in ``fallback``, so
    that every malformed reply is counted: ``no_relevance`` (no complete pair) or ``relevance_not_json`` (a pair
    that is not a JSON list of numbers), nothing selected either way; ``no_analysis``; ``no_answer`` (no complete
    pair: the answer is ``""``); ``bad_format`` when the format check failed although every section was found.
    A strict ``fallback`` is None exactly when the reply is well-formed (``format_ok`` and JSON relevance).

    Otherwise lenient (the default), so that an answer is extracted whenever the text holds one, recording each
    rule used in ``fallback``: ``relevance_ints`` (numbers read from a non-JSON section), ``relevance_unclosed``,
    ``relevance_from_analysis`` (no section: the numbers the analysis cites), ``no_relevance``, ``number_too_long``
    (a digit run too long to be a reference number, skipped), ``analysis_unclosed``, ``no_analysis``,
    ``answer_unclosed`` (truncated answer), ``answer_label`` / ``answer_untagged`` (untagged text outside the
    sections), ``no_answer``, and ``bad_format`` when the format check failed although every section was found.
    ``format_ok`` is always the official check.
    """
    format_ok = arena_format_ok(text)
    found = {tag: section(text, tag) for tag in _TAGS}
    answer = found["answer"] or ""
    analysis = found["analysis"] or ""
    strict_rel = _strict_relevance(found["relevance"]) if found["relevance"] is not None else None
    if strict:
        return ArenaOutput(
            strict_rel or [], analysis, answer, format_ok, _strict_fallback(found, strict_rel, format_ok)
        )

    fallbacks: list[str] = []
    relevance = strict_rel
    if relevance is None:
        if found["relevance"] is not None:
            relevance, rule = _numbers([found["relevance"]], fallbacks), "relevance_ints"
        elif (content := _unclosed(text, "relevance")) is not None:
            relevance, rule = _numbers([content], fallbacks), "relevance_unclosed"
        else:
            cites = _ANALYSIS_CITE.findall(analysis or text)
            relevance = _numbers((group for groups in cites for group in groups), fallbacks)
            rule = "relevance_from_analysis"
        relevance = _unique(relevance)
        fallbacks.append(rule if relevance else "no_relevance")

    if found["analysis"] is None:
        unclosed = _unclosed(text, "analysis")
        analysis = unclosed or ""
        fallbacks.append("analysis_unclosed" if unclosed is not None else "no_analysis")

    if found["answer"] is None:
        answer, rule = _lenient_answer(text)
        fallbacks.append(rule)

    if not fallbacks and not format_ok:
        fallbacks.append("bad_format")
    return ArenaOutput(relevance, analysis, answer, format_ok, "+".join(fallbacks) or None)


def _strict_fallback(found: dict[str, str | None], strict_rel: list[int] | None, format_ok: bool) -> str | None:
    """What the official rules could not read in a reply (``+``-joined), None for a well-formed one."""
    fallbacks: list[str] = []
    if found["relevance"] is None:
        fallbacks.append("no_relevance")
    elif strict_rel is None:
        fallbacks.append("relevance_not_json")
    fallbacks += [f"no_{tag}" for tag in ("analysis", "answer") if found[tag] is None]
    if not fallbacks and not format_ok:
        fallbacks.append("bad_format")
    return "+".join(fallbacks) or None


def _drop_sections(text: str, tag: str) -> str:
    r"""``re.sub(r"<tag>.*?</tag>", "\n", text, flags=re.DOTALL)`` by scanning (the regex is quadratic on many
    unclosed ``<tag>``s): each complete pair, leftmost first and not overlapping, becomes a newline."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    parts: list[str] = []
    at = 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        parts += [text[at:start], "\n"]
        at = end + len(closing)
    return "".join(parts) + text[at:]


def _lenient_answer(text: str) -> tuple[str, str]:
    """An answer when no complete ``<answer>`` pair exists, and the rule that found it."""
    unclosed = _unclosed(text, "answer")
    if unclosed:
        return _first_line(unclosed), "answer_unclosed"
    rest = text
    for tag in ("relevance", "analysis"):  # drop the complete sections, then any section cut off by truncation
        rest = _drop_sections(rest, tag)
    cuts = [i for i in (rest.find("<relevance>"), rest.find("<analysis>")) if i >= 0]
    if cuts:
        rest = rest[: min(cuts)] + "\n"
    rest = _ANY_TAG.sub("\n", rest)  # stray tags of any name (``<ref>``) are not an answer
    lines = [line.strip() for line in rest.splitlines()]
    for i, line in enumerate(lines):
        if label := _ANSWER_LABEL.search(line):  # the label's own line, else the next non-empty one
            found = label.group(1).strip() or next((later for later in lines[i + 1 :] if later), "")
            if found:
                return found.rstrip("."), "answer_label"
    line = next((line for line in lines if line), "")
    return (line, "answer_untagged") if line else ("", "no_answer")


def citation_precision_recall(
    cited_ids: Iterable[Hashable], supporting_ids: Iterable[Hashable]
) -> tuple[float, float]:
    """Precision and recall of the cited references against the supporting ones (as sets; duplicates count once).

    Precision is 0 when nothing is cited, recall 0 when nothing supports (undefined cases scored as failures)."""
    cited, supporting = set(cited_ids), set(supporting_ids)
    hits = len(cited & supporting)
    return (hits / len(cited) if cited else 0.0, hits / len(supporting) if supporting else 0.0)


# --------------------------------------------------------------------------------------------------- prompt


def format_references(passages: list[Passage], inert: Callable[[str], str] = inert) -> str:
    """The official ``{references}``: ``"1. text\\n2. text"`` in the given order, texts only (no titles), each made
    inert (the agent passes :meth:`Context.inert`: tags escaped, so that a reference cannot close
    ``</references>`` or forge ``<relevance>``/``<answer>`` tags, and the run's special tokens broken, so that it
    cannot open a chat turn).

    The official code leaves a single reference unnumbered; here it is numbered too (``1. text``) so that the
    model can always cite it."""
    return "\n".join(f"{i}. {inert(p.text)}" for i, p in enumerate(passages, 1))


def arena_prompt(
    question: str, passages: list[Passage], variant: str = "code", inert: Callable[[str], str] = inert
) -> str:
    """The user message: ``code`` = the official training/inference prompt of the released checkpoints (it ends
    with a newline, as the official string does); ``paper`` = Table 1 of the paper. ``inert`` makes each
    reference's text safe (:func:`format_references`)."""
    if variant not in PROMPT_VARIANTS:
        raise ValueError(f"unknown ARENA prompt {variant!r}; use one of {PROMPT_VARIANTS}")
    references = format_references(passages, inert)
    prompt = load_prompt(f"arena_{variant}").format(question=question, references=references)
    return prompt + "\n" if variant == "code" else prompt


# --------------------------------------------------------------------------------------------------- agent


@dataclass
class ArenaConfig:
    """``k``: passages retrieved when an example has no given context. ``sampling``: greedy at eval (the paper
    samples once at T=0.9); 1024 new tokens is the official eval budget. ``strict``: the official parsing rules
    only (see :func:`parse_arena`). ``prompt``: ``code`` (default, the released models' prompt) or ``paper``.
    ``max_references``: keep at most this many given/retrieved references (``None``: all, as in the paper)."""

    k: int = 10
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=1024))
    strict: bool = False
    prompt: str = "code"
    max_references: int | None = None

    def __post_init__(self) -> None:
        if self.prompt not in PROMPT_VARIANTS:
            raise ValueError(f"ArenaConfig.prompt must be one of {PROMPT_VARIANTS}, not {self.prompt!r}")
        if self.k < 1 or (self.max_references is not None and self.max_references < 1):
            raise ValueError("ArenaConfig.k and max_references must be >= 1")


async def _references(example: Example, ctx: Context, trace: Trace, config: ArenaConfig) -> tuple[list[Passage], str]:
    if example.context:
        references, source = list(example.context), "context"
    elif ctx.retriever is not None:
        references, source = await ctx.search(trace, example.question, config.k), "retrieved"
    else:
        return [], "none"
    if config.max_references is not None and len(references) > config.max_references:
        trace.meta["references_dropped"] = len(references) - config.max_references
        references = references[: config.max_references]
    return references, source


def render_arena(trace: Trace) -> RenderableType:
    """The answer with the references it cites (number, title, first words; gold marks when known), the
    analysis, and whether the output passed ARENA's format check."""
    meta = trace.meta
    if "reference_ids" not in meta:
        return Text("no ARENA output (the run stopped before the answer)", style="red")
    by_id = {p.id: p for p in trace.example.context}
    for step in trace.steps:
        by_id.update((p.id, p) for p in step.passages)
    ids: list[str] = meta["reference_ids"]
    supporting = set(trace.example.supporting_ids)

    head = Text()
    head.append("answer: ", style="bold")
    head.append(trace.answer or "(none)", style="bold green" if trace.answer else "bold red")
    head.append("\nformat: ")
    head.append("valid" if meta.get("format_ok") else "invalid", style="green" if meta.get("format_ok") else "red")
    head.append(f" · {len(ids)} references ({meta.get('references_source', '?')})")
    if "citation_precision" in meta:
        head.append(f" · citation P {meta['citation_precision']:.2f} R {meta['citation_recall']:.2f}")

    table = Table(title="cited references", title_justify="left", expand=True)
    table.add_column("#", justify="right", width=3)
    table.add_column("title", ratio=1)
    table.add_column("first words", ratio=3)
    if supporting:
        table.add_column("gold", width=4)
    for n in meta.get("relevance", []):
        if not 1 <= n <= len(ids):
            table.add_row(str(n), Text("(no such reference)", style="red"), "", *([""] if supporting else []))
            continue
        passage = by_id.get(ids[n - 1])
        words = (passage.text if passage else "").split()
        first = " ".join(words[:14]) + (" …" if len(words) > 14 else "")
        gold = ["✓" if ids[n - 1] in supporting else "✗"] if supporting else []
        table.add_row(str(n), passage.title if passage else ids[n - 1], first, *gold)
    if not meta.get("relevance"):
        table.add_row("", "", Text("(no reference cited)", style="dim"), *([""] if supporting else []))
    parts: list[RenderableType] = [head, table]
    analysis = meta.get("analysis") or ""
    parts.append(Text.assemble(("analysis: ", "bold"), (analysis or "(none)", "" if analysis else "dim")))
    return Group(*parts)


@register_agent("arena", config=ArenaConfig, needs_retriever=False, wants_retriever=True, render=render_arena)
async def arena(example: Example, ctx: Context, trace: Trace) -> Trace:
    """ARENA: answer from numbered references, naming the ones used (relevance, analysis, answer)."""
    config: ArenaConfig = ctx.config
    references, source = await _references(example, ctx, trace, config)
    prompt = arena_prompt(example.question, references, config.prompt, ctx.inert)
    step = await ctx.chat(trace, "answer", prompt, config.sampling)
    out = parse_arena(step.output or "", strict=config.strict)

    reference_ids = [p.id for p in references]
    cited_ids = [reference_ids[n - 1] for n in out.relevance if 1 <= n <= len(reference_ids)]
    out_of_range = [n for n in out.relevance if not 1 <= n <= len(reference_ids)]
    fallbacks = ["no_references"] if source == "none" else []
    fallbacks += [out.fallback] if out.fallback else []
    if out_of_range:
        fallbacks.append("out_of_range_ids")
        step.meta["out_of_range"] = out_of_range
    step.parsed = out.to_dict()
    step.fallback = "+".join(fallbacks) or None

    trace.answer = out.answer
    trace.meta.update(
        references_source=source,
        reference_ids=reference_ids,
        relevance=out.relevance,
        cited_ids=cited_ids,
        analysis=out.analysis,
        format_ok=out.format_ok,
    )
    if example.supporting_ids:
        precision, recall = citation_precision_recall(cited_ids, example.supporting_ids)
        trace.meta.update(citation_precision=precision, citation_recall=recall)
    return trace
