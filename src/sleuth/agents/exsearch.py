"""ExSearch (Shi et al., arXiv 2505.20128): an agentic searcher that loops *thinking -> search -> recording*.

One growing chat, laid out as the official code trains and runs it (docs/methods.md, ExSearch)::

    user       the ExSearch prompt with the question                       (prompt)
    assistant  <THINK> sub-query 1                                          (model; generation stops at <SEARCH>)
    user       <SEARCH> [1] Title: t. Content: c\\n[2] ...                   (observation: the top-K passages)
    assistant  <RECORD> evidence 1\\n<THINK> sub-query 2                     (model)
    user       <SEARCH> ...                                                 (observation)
    assistant  <RECORD> evidence n\\n<FINAL>                                 (model: the end token)
    user       <SEARCH> end search. please give the final answer to ...     (observation: finalization turn)
    assistant  the answer                                                   (model: the p(y | x, z) turn)

The record for search i is the first part of model turn i+1. The loop ends when the model writes the end token,
when a turn yields no sub-query, or after ``max_steps`` searches: the turn after the last search may only record
(its next sub-query is cut off) and the controller writes ``<FINAL>`` itself. Every trajectory ends with an answer
turn; none is dropped.

Tags: ``tags="paper"`` (default) uses the paper's ``<THINK>/<SEARCH>/<RECORD>/<FINAL>`` and its Appendix F.1
prompt; ``tags="code"`` the official code's ``<QUERY>/<SEARCH>/<FACT>/<FINAL>`` and its prompt. The parser accepts
either set, any case, the paper's ``<FINIAL>`` misspelling and the warm-up aliases ``<Search n>`` / ``<Keyword n>``
(each recorded as a ``tag_alias`` fallback), and a missing ``>``; a tag starts at a ``<`` directly followed by its
name or ``/`` (:data:`~sleuth.agents.base.TAG_OPEN`), exactly the ``<`` that ``escape_observation`` neutralises in
passages (which enter every prompt through ``ctx.inert``, chat special tokens broken too), and a document marker
``[j] Title:`` (where the parser cuts a turn the model fills with its own documents) is broken in passages by the same
pattern (:func:`escape_document_markers`), so a passage the model copies into its turn holds nothing the parser acts
on. Every parser here is linear in its input and never raises.

Documents are numbered **1-based** everywhere: ``[1]..[K]`` in the inserted observation, in the optional selection
prompt (``select=True``, ExSearch-Zoo's select/re-rank action) and in the identifiers parsed from its output. The
official code displays 1-based numbers but indexes 0-based (an off-by-one the digest flags); here the number the
model reads is the number it writes. With selection the observation keeps each selected document's candidate number.

The Trace keeps ``meta["transcript"]`` (ordered ``prompt`` / ``model`` / ``observation`` segments; consecutive
non-model segments form one user message, see :func:`transcript_messages`), ``meta["iterations"]`` (one
``{query, doc_ids, selected, record}`` per search) and ``meta["stop"]`` (``final_token`` / ``step_cap`` /
``no_query``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sleuth.agents.base import TAG_OPEN, Context, Transcript, escape_observation, load_prompt, register_agent
from sleuth.llm import Request, Sampling
from sleuth.records import Example, Passage, Step, Trace


@dataclass(frozen=True)
class TagSet:
    """The action tags the model is asked to write, and the prompt file that asks for them."""

    think: str
    record: str
    prompt: str
    final: str = "FINAL"
    search: str = "SEARCH"


TAG_SETS: dict[str, TagSet] = {
    "paper": TagSet(think="THINK", record="RECORD", prompt="exsearch_paper"),  # paper App. F.1
    "code": TagSet(think="QUERY", record="FACT", prompt="exsearch_code"),  # official src/instruction.py
}


@dataclass
class ExSearchConfig:
    """ExSearch inference settings.

    ``k``: passages retrieved per sub-query (paper: 5; with ``select=True`` these are the candidates the model
    selects from; the official code retrieves 20). ``max_steps``: the search cap T (paper: 5; code: 8).
    ``tags``: ``"paper"`` or ``"code"`` (see the module doc). ``sampling``: every model turn (the paper states no
    decoding; the code samples T=0.8, top_p=0.95, 256 new tokens); the stop strings that end a thinking turn at
    the search tag are added to it. ``answer_max_new_tokens`` / ``select_max_new_tokens``: budgets of the final
    answer turn and the selection call (``None``: the ``sampling`` budget).
    """

    k: int = 5
    max_steps: int = 5
    tags: str = "paper"
    select: bool = False
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=256))
    answer_max_new_tokens: int | None = None
    select_max_new_tokens: int | None = None


# -- parsing model turns ----------------------------------------------------------------------------------------

_ROLE_OF = {
    "THINK": "query",
    "QUERY": "query",
    "RECORD": "record",
    "FACT": "record",
    "KEYWORD": "record",  # the code's GPT-4o warm-up format: <Keyword n>
    "FINAL": "final",
    "FINIAL": "final",  # the paper's F.1 misspelling
    "SEARCH": "observation",  # <Search n> (with a number) is the warm-up format's sub-query tag instead
    "REFERENCE": "observation",
    "INFORMATION": "observation",
    "DOCUMENT": "observation",
    "DOCUMENTS": "observation",
    "USER QUERY": "echo",  # the prompt's question marker, often echoed by small models: only a separator
}
# A tag starts where base.TAG_OPEN says one can (the "<" that escape_observation neutralises in passages, so a
# passage echoed by the model holds no tag): "<" right before the name or "/", never "< FINAL". ``>`` is optional so
# that a malformed ``<THINK what ...`` still parses; ``\b`` keeps ``<Finally`` out. Every quantified run is followed
# by a character outside it, so finditer is linear in the text.
_ACTION_TAG = re.compile(
    TAG_OPEN + r"(?P<close>/)?\s*(?P<name>THINK|QUERY|RECORD|FACT|KEYWORD|FINAL|FINIAL|SEARCH|REFERENCE|INFORMATION"
    r"|DOCUMENTS?|USER\s+QUERY)\b(?:\s*(?P<num>\d+))?\s*(?P<gt>>)?",
    re.IGNORECASE,
)
# "[j] Title:" opens a document of an observation: parse_turn cuts a model turn where the model writes one itself.
# Passages go into observations with every match of this same pattern broken (escape_document_markers, applied by
# format_documents), so a passage the model copies into its turn can never cut the turn and lose its sub-query.
_WRITTEN_DOCUMENT = re.compile(r"\[\d+\]\s*Title:", re.IGNORECASE)
_MAX_DIGITS = 18  # a document number longer than this is out of range (and int() of 4,300+ digits would raise)
SEARCH_STOPS = ("<SEARCH>", "<search>", "<Search>")  # a thinking turn ends where the model would write results


@dataclass
class _Tag:
    start: int
    end: int
    role: str  # query | record | final | observation | echo | close
    name: str
    well_formed: bool


def _tags(text: str) -> list[_Tag]:
    out = []
    for m in _ACTION_TAG.finditer(text):
        name = " ".join(m["name"].upper().split())
        role = _ROLE_OF[name]
        if name == "SEARCH" and m["num"]:
            role = "query"
        well_formed = m["gt"] is not None and m.group(0) == f"<{'/' if m['close'] else ''}{m['name']}" + (
            f" {m['num']}>" if m["num"] else ">"
        )
        out.append(_Tag(m.start(), m.end(), "close" if m["close"] else role, m["name"], well_formed))
    return out


def _strip_tags(text: str) -> str:
    return _ACTION_TAG.sub(" ", text)


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


@dataclass
class ParsedTurn:
    """What one model turn says. ``text`` is the part of the output kept in the transcript (a prefix of it);
    ``query_at`` is where the sub-query starts in it (its tag, or its untagged line)."""

    text: str
    query: str | None = None
    record: str | None = None
    final: bool = False
    final_text: str = ""
    query_at: int | None = None
    fallbacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"query": self.query, "record": self.record, "final": self.final, "final_text": self.final_text}

    def drop_query(self) -> None:
        """At the step cap: keep only the record part of the turn; the sub-query it went on to write is cut."""
        if self.query_at is not None:
            self.text = self.text[: self.query_at]
        self.query, self.query_at = None, None


def _line_spans(text: str, offset: int = 0) -> list[tuple[int, str]]:
    """``(start, collapsed line)`` of each non-empty line of ``text`` (tags blanked out), ``start`` + ``offset``."""
    out, at = [], 0
    for line in text.splitlines(keepends=True):
        if clean := " ".join(_strip_tags(line).split()):
            out.append((offset + at + len(line) - len(line.lstrip()), clean))
        at += len(line)
    return out


def parse_turn(output: str, tags: TagSet, first: bool) -> ParsedTurn:
    """Parse one thinking/recording turn leniently.

    The first turn should be ``<THINK> sub-query``; later turns ``<RECORD> evidence`` followed by ``<THINK> next
    sub-query`` or the end token. The turn is cut where the model starts writing an observation itself (a search /
    documents block, or ``[j] Title:`` lines): that text is never evidence (``hallucinated_observation`` when
    anything follows the marker; a bare ``<SEARCH>`` is just the stop string). It is also cut where a record or a
    second sub-query follows the sub-query, i.e. the model goes on without search results (``run_on``). Like the
    official code, the end token anywhere in the kept text ends the loop. Untagged text is read as the official
    code's repair reads it: a first turn is the sub-query, a later turn's first line the evidence and its next line
    the sub-query.
    """
    parsed = ParsedTurn(text=output)
    observation = next((t for t in _tags(output) if t.role == "observation"), None)
    written = _WRITTEN_DOCUMENT.search(output)
    cuts = [(t.start, t.end) for t in [observation] if t] + ([(written.start(), written.end())] if written else [])
    if cuts:
        start, end = min(cuts)
        parsed.text = output[:start]
        if output[end:].strip() or (written and start == written.start()):
            parsed.fallbacks.append("hallucinated_observation")

    found = _tags(parsed.text)
    first_query = next((i for i, t in enumerate(found) if t.role == "query"), None)
    if first_query is not None:
        later = next((t for t in found[first_query + 1 :] if t.role in ("query", "record")), None)
        if later is not None:
            parsed.text = parsed.text[: later.start]
            parsed.fallbacks.append("run_on")
            found = [t for t in found if t.start < later.start]

    canonical = {"query": tags.think, "record": tags.record, "final": tags.final}
    if any(not t.well_formed for t in found):
        parsed.fallbacks.append("malformed_tag")
    if any(t.role in canonical and t.name != canonical[t.role] for t in found):
        parsed.fallbacks.append("tag_alias")

    record_lines: list[tuple[int, str]] = []
    for i, t in enumerate(found):
        end = found[i + 1].start if i + 1 < len(found) else len(parsed.text)
        body = parsed.text[t.end : end]
        if t.role == "query" and parsed.query is None:
            parsed.query, parsed.query_at = " ".join(body.split()) or None, t.start
        elif t.role == "record" and parsed.record is None:
            parsed.record, record_lines = body.strip(), _line_spans(body, t.end)
        elif t.role == "final" and not parsed.final:
            parsed.final, parsed.final_text = True, body.strip()

    untagged = _line_spans(parsed.text[: found[0].start] if found else parsed.text)
    if first:
        if parsed.record is not None:
            parsed.record = None
            parsed.fallbacks.append("record_before_search")
        if parsed.query is None and not parsed.final and (anywhere := _line_spans(parsed.text)):
            (parsed.query_at, parsed.query), *_ = anywhere  # the official code takes a first turn as the sub-query
            parsed.fallbacks.append("untagged_query")
        return parsed
    if parsed.record is None and untagged:
        record_lines = untagged
        parsed.record = untagged[0][1]
        parsed.fallbacks.append("untagged_record")
    elif parsed.record is None:
        parsed.fallbacks.append("no_record")
    if parsed.query is None and not parsed.final and len(record_lines) > 1:
        # "<RECORD> e\nnext question" without a query tag: the code takes the first line as the fact.
        parsed.record = record_lines[0][1]
        parsed.query_at, parsed.query = record_lines[1]
        parsed.fallbacks.append("untagged_query")
    return parsed


_WHITESPACE = re.compile(r"\s*")
_MARKER_WORD = re.compile(r"(?:final\s+answer|answer|output)\s*:\s*", re.IGNORECASE)


def _last_output_marker(text: str) -> int | None:
    """Where the text after the last ``Output:`` / ``Answer:`` / ``Final answer:`` that starts a line begins (what
    ``finditer`` of ``(?:^|\\n)\\s*(?:final\\s+answer|answer|output)\\s*:\\s*`` would give as the last match's end),
    in linear time: every line start inside one whitespace run leads to the same word, so each run is read once."""
    end = None
    line_start: int | None = 0  # the ^ alternative, then the character after every "\n"
    while line_start is not None:
        spaces = _WHITESPACE.match(text, line_start)
        word = spaces.end() if spaces else line_start
        marker = _MARKER_WORD.match(text, word)
        if marker:
            end = marker.end()
        found = text.find("\n", marker.end() if marker else word)
        line_start = found + 1 if found >= 0 else None
    return end


def parse_answer(output: str) -> tuple[str, list[str]]:
    """The answer span of the final turn (trained to be a bare short answer) and the lenient rules applied.

    ``hallucinated_observation``: cut where the model starts writing a search block; ``output_marker``: the text
    after the last ``Output:`` / ``Answer:`` when there is any (the paper's F.3 case prints ``Output: four``);
    ``stripped_tags``: action tags removed; ``first_line``: the first of several lines.
    """
    fallbacks = []
    text = output
    observation = next((t for t in _tags(text) if t.role == "observation"), None)
    if observation is not None:
        text = text[: observation.start]
        fallbacks.append("hallucinated_observation")
    marker = _last_output_marker(text)
    if marker is not None and _line_spans(text[marker:]):
        text = text[marker:]
        fallbacks.append("output_marker")
    if _ACTION_TAG.search(text):
        text = _strip_tags(text)
        fallbacks.append("stripped_tags")
    lines = _lines(text)
    if len(lines) > 1:
        fallbacks.append("first_line")
    return (lines[0] if lines else ""), fallbacks


# -- observations ---------------------------------------------------------------------------------------------------


def escape_document_markers(text: str) -> str:
    """``text`` with the ``[`` of every ``[j] Title:`` document marker that :func:`parse_turn` reads (the same
    pattern) replaced by ``&#91;``: the escaped text holds no marker, so copied into a model turn it never cuts it.
    The ``[`` left alone start no marker, and the replacement brings in none. Linear time."""
    return _WRITTEN_DOCUMENT.sub(lambda m: "&#91;" + m.group(0)[1:], text)


def escape_passage(text: str, inert: Callable[[str], str] = escape_observation) -> str:
    """A passage's title or text as an observation holds it: ``inert`` (tags escaped, and with ``ctx.inert`` special
    tokens broken), then :func:`escape_document_markers`. Nothing in the result is read by :func:`parse_turn`."""
    return escape_document_markers(inert(text))


def format_documents(
    passages: list[Passage], labels: list[int], inert: Callable[[str], str] = escape_observation
) -> str:
    """``[j] Title: t. Content: c`` lines (the paper's and the code's document format), ``j`` 1-based labels.
    Titles and texts go through :func:`escape_passage` with ``inert`` (the agent passes ``ctx.inert``)."""
    return "\n".join(
        f"[{j}] Title: {escape_passage(p.title, inert)}. Content: {escape_passage(p.text, inert)}"
        for j, p in zip(labels, passages, strict=True)
    )


_SELECTION_FORMAT = re.compile(r"\s*+\[\d++\](?:\s*+>\s*+\[\d++\])*+\s*+")  # possessive: no backtracking


def parse_selection(output: str, n: int) -> tuple[list[int], list[str]]:
    """1-based document identifiers from a ``[2] > [1]`` ranking, in order, deduplicated, within ``1..n``.

    Like the official code every digit run counts; an output not in the ``[a] > [b]`` form is ``select_format``,
    identifiers outside ``1..n`` are dropped (``select_out_of_range``), and no valid identifier keeps every
    candidate (``select_none``).
    """
    fallbacks = []
    if not _SELECTION_FORMAT.fullmatch(output):
        fallbacks.append("select_format")
    digits = (d.lstrip("0") or "0" for d in re.findall(r"\d+", output))
    numbers = list(dict.fromkeys(int(d) if len(d) <= _MAX_DIGITS else -1 for d in digits))
    labels = [j for j in numbers if 1 <= j <= n]
    if len(labels) < len(numbers):
        fallbacks.append("select_out_of_range")
    if not labels:
        fallbacks.append("select_none")
        labels = list(range(1, n + 1))
    return labels, fallbacks


# -- the growing chat ------------------------------------------------------------------------------------------------


class _Dialogue:
    """The chat sent to the model, kept in step with its :class:`Transcript` (one segment per inserted text)."""

    def __init__(self, prompt: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        self.transcript = Transcript()
        self.transcript.add("prompt", prompt)

    def request(self) -> Request:
        return Request(messages=[dict(m) for m in self.messages])  # a copy: recorded Steps must not change later

    def model(self, text: str) -> None:
        if text:
            self.messages.append({"role": "assistant", "content": text})
            self.transcript.model(text)

    def observe(self, text: str) -> None:
        if self.messages[-1]["role"] == "user":  # e.g. the forced finalization after the last search (code)
            self.messages[-1] = {"role": "user", "content": self.messages[-1]["content"] + text}
        else:
            self.messages.append({"role": "user", "content": text})
        self.transcript.observation(text)


def transcript_messages(segments: list[dict[str, str]]) -> list[dict[str, str]]:
    """The chat an ExSearch transcript stands for: ``model`` segments are assistant turns and each run of
    ``prompt`` / ``observation`` segments one user turn (what a trainer feeds the chat template, masking users)."""
    messages: list[dict[str, str]] = []
    for segment in segments:
        role = "assistant" if segment["source"] == "model" else "user"
        if messages and role == "user" and messages[-1]["role"] == "user":
            messages[-1]["content"] += segment["text"]
        else:
            messages.append({"role": role, "content": segment["text"]})
    return messages


def _fallback(step: Step, names: list[str]) -> None:
    if names:
        step.fallback = ",".join(dict.fromkeys([*(step.fallback.split(",") if step.fallback else []), *names]))


# -- the agent -------------------------------------------------------------------------------------------------------


async def _search(
    ctx: Context, trace: Trace, config: ExSearchConfig, query: str, i: int
) -> tuple[str, dict[str, Any]]:
    """Search one sub-query (and let the model select documents when configured): the observation text and the
    iteration record."""
    passages = await ctx.search(trace, query, config.k)
    trace.steps[-1].meta["iteration"] = i
    labels = list(range(1, len(passages) + 1))
    if config.select and passages:
        prompt = load_prompt("exsearch_select").format(
            question=query, n_docs=len(passages), docs=format_documents(passages, labels, ctx.inert)
        )
        budget = config.select_max_new_tokens or config.sampling.max_new_tokens
        step = await ctx.chat(
            trace, "select", prompt, dataclasses.replace(config.sampling, max_new_tokens=budget, n=1)
        )
        labels, fallbacks = parse_selection(step.output or "", len(passages))
        step.parsed = labels
        step.meta.update(iteration=i, candidates=[p.id for p in passages])
        _fallback(step, fallbacks)
    chosen = [passages[j - 1] for j in labels]
    documents = format_documents(chosen, labels, ctx.inert)
    search_tag = f"<{TAG_SETS[config.tags].search}>"
    observation = f"{search_tag} {documents}" if documents else search_tag
    iteration = {
        "query": query,
        "doc_ids": [p.id for p in passages],
        "selected": [p.id for p in chosen],
        "labels": labels,
        "record": None,
    }
    return observation, iteration


@dataclass
class _Loop:
    stop: str = ""
    final_text: str = ""
    iterations: list[dict[str, Any]] = field(default_factory=list)


def render_exsearch(trace: Trace) -> Any:
    """The loop step by step: each sub-query, the documents it found (selected ones marked), the recorded
    evidence, why the loop stopped, then the answer."""
    from rich.text import Text
    from rich.tree import Tree

    tree = Tree(Text(f"ExSearch · {trace.example.question}", style="bold"))
    titles = {p.id: p.title or p.id for s in trace.steps if s.kind == "search" for p in s.passages}
    for i, it in enumerate(trace.meta.get("iterations", []), 1):
        node = tree.add(Text.assemble((f"{i}. think  ", "bold magenta"), it.get("query") or ""))
        docs = node.add(Text("search", style="bold cyan"))
        selecting = it.get("selected", []) != it.get("doc_ids", [])
        for j, doc_id in enumerate(it.get("doc_ids", []), 1):
            chosen = doc_id in it.get("selected", [])
            mark = ("✓ " if chosen else "· ") if selecting else ""
            docs.add(Text(f"{mark}[{j}] {titles.get(doc_id, doc_id)}", style="cyan" if chosen else "dim"))
        record = it.get("record")
        node.add(Text.assemble(("record  ", "bold green"), (record or "(none)", "green" if record else "dim")))
    stop = trace.meta.get("stop", "")
    reason = {
        "final_token": "model wrote the end token",
        "step_cap": f"step cap reached ({len(trace.meta.get('iterations', []))} searches): final turn forced",
        "no_query": "no sub-query in the model's turn: final turn forced",
    }.get(stop, stop or "(did not finish)")
    tree.add(Text.assemble(("stop  ", "bold yellow"), reason))
    fallbacks = trace.fallbacks
    if fallbacks:
        tree.add(Text(f"fallbacks: {', '.join(fallbacks)}", style="yellow"))
    tree.add(
        Text.assemble(("answer  ", "bold"), (trace.answer or "(no answer)", "bold green" if trace.answer else "red"))
    )
    return tree


@register_agent("exsearch", config=ExSearchConfig, needs_retriever=True, render=render_exsearch)
async def exsearch(example: Example, ctx: Context, trace: Trace) -> Trace:
    """ExSearch: think (sub-query) -> search (top-K) -> record (evidence) until the end token, then answer."""
    config: ExSearchConfig = ctx.config
    if config.tags not in TAG_SETS:
        raise ValueError(f"unknown ExSearch tag set {config.tags!r}; use one of {sorted(TAG_SETS)}")
    tags = TAG_SETS[config.tags]
    trace.answer = ""
    dialogue = _Dialogue(load_prompt(tags.prompt).format(question=example.question))
    loop = _Loop()
    trace.meta.update(tags=config.tags, iterations=loop.iterations)
    turn_sampling = dataclasses.replace(
        config.sampling, stop=tuple(dict.fromkeys([*config.sampling.stop, *SEARCH_STOPS]))
    )
    try:
        while True:
            first = not loop.iterations
            step, _ = await ctx.generate(trace, "think" if first else "record", dialogue.request(), turn_sampling)
            parsed = parse_turn(step.output or "", tags, first)
            step.meta["turn"] = len(loop.iterations)
            _fallback(step, parsed.fallbacks)
            if not first:
                loop.iterations[-1]["record"] = parsed.record
            if parsed.final:
                loop.stop, loop.final_text = "final_token", parsed.final_text
            elif len(loop.iterations) >= config.max_steps:
                parsed.drop_query()
                loop.stop = "step_cap"
                _fallback(step, ["step_cap"])
            elif not parsed.query:
                loop.stop = "no_query"
                _fallback(step, ["no_query"])
            step.parsed = parsed.as_dict()
            dialogue.model(parsed.text)
            if loop.stop:
                break
            assert parsed.query is not None
            observation, iteration = await _search(ctx, trace, config, parsed.query, len(loop.iterations))
            loop.iterations.append(iteration)
            dialogue.observe(observation)

        final = load_prompt("exsearch_final").format(question=example.question)
        # The model's own end token is already in its turn; otherwise the controller writes it, appended to the
        # last search results when the model turn after them was empty (official code).
        if loop.stop == "final_token":
            final = final.partition("\n")[2]
        dialogue.observe("\n" + final if dialogue.messages[-1]["role"] == "user" else final)
        budget = config.answer_max_new_tokens or config.sampling.max_new_tokens
        step, _ = await ctx.generate(
            trace, "answer", dialogue.request(), dataclasses.replace(config.sampling, max_new_tokens=budget)
        )
        dialogue.model(step.output or "")
        answer, fallbacks = parse_answer(step.output or "")
        if not answer and loop.final_text:  # the prompt asks for "<FINAL> followed by the final answer"
            answer, more = parse_answer(loop.final_text)
            fallbacks = [*fallbacks, "answer_from_final_tag", *more]
        if not answer:
            fallbacks.append("empty_answer")
        trace.answer = step.parsed = answer
        _fallback(step, fallbacks)
    finally:
        trace.meta.update(stop=loop.stop, transcript=dialogue.transcript.to_list())
    return trace
