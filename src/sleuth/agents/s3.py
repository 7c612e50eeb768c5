"""s3 (Jiang et al. 2025, arXiv 2505.14146): a searcher LLM gathers evidence that a FROZEN generator answers from.

The loop follows the official rollout (docs/methods.md, s3), in which the whole trajectory is ONE assistant message
that the searcher keeps continuing::

    user       searcher prompt (§3.2) with <question> and the initial top-3 <information> (q0 = the question)
    assistant  [<important_info>[ids]</important_info>] <search_complete>False</search_complete> <query>{..}</query>
               \\n\\n<information>Doc 1(Title: ..) ..</information>\\n\\n          (observation: top-8 for the query)
               <important_info>[ids]</important_info> <search_complete>True</search_complete>

``<important_info>`` picks documents of the most recent ``<information>`` block (the initial one included) by
their number in that block, served in ascending number as the code does; a block the searcher never tags is kept
whole (§2.3). Tags are read as the code reads them (exact lower case, closed; ``tag_parsing="lenient"`` is the
option that reads any case and unclosed tags, each recorded as a fallback). A reply with neither a query
nor ``<search_complete>True`` gets the code's invalid-action feedback, which ends in ``<query>\\n`` so that the next
reply continues the query. ``max_turns`` search-capable replies are followed by one final reply whose query is
ignored (the code's ``max_turns + 1`` rounds and its ``do_search=False`` round). The documents kept (deduplicated
by text) are served to the generator (``ctx.chat(..., role="generator")``, any backend) with the paper's prompt.

Every retrieved title and text goes through ``ctx.inert`` (:func:`~sleuth.agents.base.escape_observation` plus
the run's chat special tokens broken up) before it enters the tagged transcript or the generator's prompt, and a
reply that writes its own ``<information>`` block is cut there, so neither a passage nor the model can forge
evidence, a selection or a stop decision. The trajectory is kept as a :class:`~sleuth.agents.base.Transcript`
(``trace.meta["transcript"]``: model vs observation text) for RL training, which masks observations; the
naive-RAG baseline (the same top-3) is kept for the Gain-Beyond-RAG reward.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from rich.console import RenderableType
from rich.text import Text
from rich.tree import Tree

from sleuth.agents.base import (
    TAG_OPEN,
    Context,
    Inert,
    Transcript,
    inert,
    kept_token_ids,
    llm_tokenizer,
    load_prompt,
    register_agent,
)
from sleuth.llm import LLM, Request, Sampling
from sleuth.records import Example, Passage, Step, Trace

GENERATOR_PROMPTS = ("paper", "code_chat", "code_claude")
CONTEXT_ORDERS = ("chronological", "selected_first")
TAG_PARSINGS = ("strict", "lenient")
SELECTION_ORDERS = ("ascending", "model")
COMPLETE_VALUES = frozenset({"true", "yes", "1", "y"})  # the code's truthy set for <search_complete>
NOT_COMPLETE_VALUES = frozenset({"false", "no", "0", "n"})
QUERY_END = "</query>"
REFERENCE_CONTEXT_TOKENS = 8000  # the code's max_prompt_length: its rolling context keeps the most recent tokens
# The BM25 note goes right before the blank line that precedes this sentence (official make_prefix).
_BM25_NOTE_ANCHOR = "\n\nFor a question and initial searched results:"


@dataclass
class S3Config:
    """Settings of the s3 loop (defaults: the paper's headline 8-3-3 configuration; docs/methods.md, s3).

    ``k_initial``: documents retrieved for the question itself (naive RAG, "Begin with Search"; k=3). ``k``:
    documents per searcher query (8). ``max_turns``: search-capable searcher replies (paper A.1: "maximum number
    of turns to 4"; the code's ``max_turns=3`` runs 3+1 = 4), always followed by one final no-search reply: the
    reference's 8-3-3 run (its CLI ``max_turns=3``) is ``max_turns=4`` here, up to 4 searches and 5 replies.
    ``max_selected``: documents kept per ``<important_info>`` (the prompt's "up to 3", enforced; 0 keeps all valid
    ids as the code does). Ids number the documents of the most recent ``<information>`` block (1..its
    size); other ids are dropped and recorded as a fallback.

    ``sampling``: the searcher (greedy at eval as in the code; training samples at T=0.6, top_p=0.95); 500 new
    tokens per reply as in the code; generation stops at ``</query>``, which the code cuts at afterwards (same text,
    fewer tokens). ``generator_sampling``: the frozen generator, temperature 0 (the code sets no token limit for
    vLLM and 500 for Claude). ``generator_prompt``: ``paper`` (Fig. 12, one user message), ``code_chat`` (the
    code's vLLM format: contexts in a system message, the question as the user message) or ``code_claude``.
    ``context_order``: ``chronological`` (the paper's Table 7 and A.5) or ``selected_first`` (the code: documents
    of tagged blocks first, then untagged blocks whole). ``selection_order``: the order of a block's selected
    documents: ``ascending`` document number (the code, which filters the block's documents by the selected ids:
    ``<important_info>[8, 1]`` serves Doc 1 then Doc 8) or ``model`` (the order the searcher wrote them).

    ``tag_parsing``: ``strict`` (default; the code's parse, for training and eval alike): tags match only in
    lower case as the prompt writes them, a tag without its closing tag is no tag (an unclosed
    ``<important_info>[6]`` leaves its block untagged, so all its documents are served; an unclosed
    ``<search_complete>True`` does not stop), and a ``<query>`` that is not JSON is searched as its raw text. Each
    such case is still recorded as a fallback (``*_ignored``, ``tag_case_ignored``, ``query_not_json``).
    ``lenient``: tags in any case, unclosed ``<important_info>`` / ``<search_complete>`` read up to the first
    character that cannot belong to them, and the ``"query"`` field pulled out of broken JSON, each recorded as a
    fallback; a deviation that serves different documents on some replies (3 of 21 audited transcripts).
    In both modes a reply that writes ``<information>`` itself (any case) is cut there.

    Document lines follow the code: ``Doc i (Title: "t") text`` in the initial block and ``Doc i(Title: "t") text``
    (no space) in search observations; ``quote_titles`` keeps the wiki-18 corpus quotes around titles and
    ``observation_title_space`` adds the space back. ``bm25_query_note``: the code's extra prompt line for a BM25
    retriever. ``question_mark``: append "?" to QA questions that lack one (the code's preprocessing).

    ``max_obs_tokens``: the code's ``max_obs_length`` (1400). Each observation the loop inserts (the whole
    ``\n\n<information>..</information>\n\n`` string, or the invalid-action feedback), tokenized without special
    tokens by the searcher's own tokenizer, keeps only its first ``max_obs_tokens`` tokens, so a cut block loses
    its closing ``</information>`` as in the code. The block then holds only the documents the searcher saw (a
    document cut inside its text keeps the visible part of it; one cut before its text is gone, so selecting it
    is out of range), and the generator is served from those. Each cut is recorded on the searcher step
    (``observation_truncated``, tokens removed). A backend without a local tokenizer (an OpenAI-compatible
    server) cannot count tokens: nothing is cut and ``trace.meta["observation_cap"]`` says so. ``None``: no cap.
    The code's other two limits are not applied: its rolling context (``max_prompt_length``, 8000, keeping the
    most recent tokens) would cut the instruction first, and sleuth sends the whole conversation instead; its
    stored-prompt cut (``max_start_length``) is the trainer's business (``max_episode_tokens``). The record counts
    the searcher contexts (prompt tokens, as the backend reports them) longer than the code's window
    (``beyond_reference_context``; ``longest_context``), where the reference's searcher would have read less.
    """

    k_initial: int = 3
    k: int = 8
    max_turns: int = 4
    max_selected: int = 3
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=500, stop=(QUERY_END,)))
    generator_sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.0, max_new_tokens=500))
    generator_prompt: str = "paper"
    context_order: str = "chronological"
    quote_titles: bool = True
    observation_title_space: bool = False
    bm25_query_note: bool = False
    question_mark: bool = True
    tag_parsing: str = "strict"
    selection_order: str = "ascending"
    max_obs_tokens: int | None = 1400

    def __post_init__(self) -> None:
        if self.generator_prompt not in GENERATOR_PROMPTS:
            raise ValueError(
                f"S3Config.generator_prompt must be one of {GENERATOR_PROMPTS}, not {self.generator_prompt!r}"
            )
        if self.context_order not in CONTEXT_ORDERS:
            raise ValueError(f"S3Config.context_order must be one of {CONTEXT_ORDERS}, not {self.context_order!r}")
        if self.tag_parsing not in TAG_PARSINGS:
            raise ValueError(f"S3Config.tag_parsing must be one of {TAG_PARSINGS}, not {self.tag_parsing!r}")
        if self.selection_order not in SELECTION_ORDERS:
            raise ValueError(
                f"S3Config.selection_order must be one of {SELECTION_ORDERS}, not {self.selection_order!r}"
            )
        if self.k_initial < 1 or self.k < 1 or self.max_turns < 0:
            raise ValueError("S3Config.k_initial and k must be >= 1 and max_turns >= 0")
        if self.max_selected < 0:
            raise ValueError("S3Config.max_selected must be >= 0 (0: no cap)")
        if self.max_obs_tokens is not None and self.max_obs_tokens < 1:
            raise ValueError("S3Config.max_obs_tokens must be >= 1 (None: no cap)")


# ---------------------------------------------------------------------------------------------------------------
# Text formats
# ---------------------------------------------------------------------------------------------------------------


def format_docs(
    passages: list[Passage], title_space: bool = True, quote_titles: bool = True, inert: Inert = inert
) -> str:
    """Documents as the searcher sees them, one line each: ``Doc i (Title: "t") text\\n`` (titles and texts
    through ``inert``)."""
    lines = (_doc_line(i, p, title_space, quote_titles, inert) for i, p in enumerate(passages, 1))
    return "".join(f"{head}{body}\n" for head, body in lines)


def _doc_line(i: int, p: Passage, title_space: bool, quote_titles: bool, inert: Inert) -> tuple[str, str]:
    """Document ``i``'s line without its newline, as ``(head, body)``: ``Doc i (Title: "t") `` and the text."""
    space = " " if title_space else ""
    title = f'"{p.title}"' if quote_titles else p.title
    return f"Doc {i}{space}(Title: {inert(title)}) ", inert(p.text)


OBSERVATION_HEAD = "\n\n<information>"


def observation_text(passages: list[Passage], config: S3Config, inert: Inert = inert) -> str:
    """The observation inserted after a query (the code's ``\\n\\n<information>{docs}</information>\\n\\n``)."""
    docs = format_docs(passages, config.observation_title_space, config.quote_titles, inert)
    return f"{OBSERVATION_HEAD}{docs}</information>\n\n"


def cap_observation(text: str, tokenizer: Any, max_tokens: int) -> tuple[str, int]:
    """``text`` cut to its first ``max_tokens`` tokens, and the number of tokens removed: the code's
    ``max_obs_length`` cut (the string tokenized without special tokens, the head kept, so a cut block has no
    ``</information>``). The cut falls between characters of ``text``: the kept text is a prefix of it (a
    character whose bytes straddle the cut is dropped whole), so it never re-tokenizes to more than
    ``max_tokens``."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:  # a slow tokenizer has no offsets: keep what the first tokens decode to
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text, 0
        return tokenizer.decode(ids[:max_tokens], clean_up_tokenization_spaces=False), len(ids) - max_tokens
    if len(offsets) <= max_tokens:
        return text, 0
    start, end = offsets[max_tokens - 1]
    following = offsets[max_tokens][0]
    if start <= following < end:  # the next token starts inside this one's character: drop that character
        end = following
    kept = sum(1 for _, stop in offsets[:max_tokens] if stop <= end)
    return text[:end], len(offsets) - kept


def visible_passages(passages: list[Passage], shown: int, config: S3Config, inert: Inert = inert) -> list[Passage]:
    """The documents of an observation whose first ``shown`` characters were inserted, as the searcher saw them:
    whole lines kept, the document cut inside its text kept with the visible part of its text
    (``meta["observation_truncated"]``), the rest (and a document cut before its text) dropped."""
    at = len(OBSERVATION_HEAD)
    visible: list[Passage] = []
    for i, p in enumerate(passages, 1):
        head, body = _doc_line(i, p, config.observation_title_space, config.quote_titles, inert)
        room = shown - at - len(head)
        if room <= 0:
            break
        if room >= len(body):
            visible.append(p)
        else:
            text = _raw_prefix(p.text, body, room, inert)
            visible.append(replace(p, text=text, meta={**p.meta, "observation_truncated": True}))
            break
        at += len(head) + len(body) + 1
    return visible


def _raw_prefix(raw: str, shown: str, room: int, inert: Inert) -> str:
    """The longest prefix of ``raw`` whose inert form fits in ``room`` characters (``shown`` = inert(raw))."""
    if shown == raw:
        return raw[:room]
    low, high = 0, len(raw)
    while low < high:  # inert lengthens text (escapes), never shortens it: a binary search on the prefix length
        middle = (low + high + 1) // 2
        if len(inert(raw[:middle])) <= room:
            low = middle
        else:
            high = middle - 1
    return raw[:low]


def invalid_action_feedback() -> str:
    """The code's feedback after a reply with no valid action; it reopens a query for the next reply."""
    return "\n\n" + load_prompt("s3_invalid_action") + "\n"


def generator_context(passages: list[Passage], inert: Inert = inert) -> str:
    """The generator's context string, as the code builds it: ``Doc n (Title: t)\\ntext\\n\\n`` per document
    (titles and texts through ``inert``: no passage can open a chat turn in the generator's prompt)."""
    return "".join(f"Doc {n} (Title: {inert(p.title)})\n{inert(p.text)}\n\n" for n, p in enumerate(passages, 1))


def task_question(example: Example, config: S3Config) -> str:
    """The question the searcher and the generator read: "?"-terminated for QA (the code's preprocessing); a
    multiple-choice item gets its options as ``\\nOptions:\\nA: ..\\n`` (the code's MIRAGE format)."""
    question = example.question.strip()
    if config.question_mark and example.kind == "qa" and question and not question.endswith("?"):
        question += "?"
    options = example.metadata.get("options") if example.kind == "mcq" else None
    if isinstance(options, dict) and options:
        question += "\nOptions:\n" + "".join(f"{key}: {text}\n" for key, text in options.items())
    return question


def searcher_prompt(question: str, initial: list[Passage], config: S3Config, inert: Inert = inert) -> str:
    """The searcher's user message (§3.2) with the initial documents pasted in."""
    template = load_prompt("s3_searcher")
    if config.bm25_query_note:
        note = load_prompt("s3_searcher_bm25_note")
        template = template.replace(_BM25_NOTE_ANCHOR, "\n" + note + _BM25_NOTE_ANCHOR, 1)
    docs = format_docs(initial, title_space=True, quote_titles=config.quote_titles, inert=inert).strip()
    # The official string ends with one newline after </information>; load_prompt strips it.
    return template.format(question=question, initial_searched_results=docs) + "\n"


def searcher_request(llm: LLM, prompt: str, assistant_text: str) -> tuple[Request, str]:
    """The request that continues the searcher's single assistant message.

    A backend that exposes its chat template (the local ``hf`` backend) gets the rendered prompt plus the
    trajectory as a raw prompt: exactly the code's rolling context. Other backends get the trajectory as a final
    assistant message, which servers that continue a final assistant message (vLLM's ``continue_final_message``)
    extend in place and others answer as a new assistant turn. Returns the request and the mode used.
    """
    user = {"role": "user", "content": prompt}
    tokenizer = getattr(llm, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        bos = getattr(tokenizer, "bos_token", None)
        if bos and head.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
            head = head[len(bos) :]  # the backend tokenizes raw prompts with special tokens: BOS is added once
        return Request(prompt=head + assistant_text), "raw_prompt"
    messages = [user, {"role": "assistant", "content": assistant_text}] if assistant_text else [user]
    return Request(messages=messages), "assistant_message"


# ---------------------------------------------------------------------------------------------------------------
# Parsing a searcher reply: strict (the code's) by default, lenient as an option; every rule that was needed or
# every tag that was ignored is named in ``fallbacks``. Each scan is str.find, a case-insensitive literal search or a
# pattern whose runs end at a character outside them, so parsing is linear in the reply, whatever the model wrote.
# ---------------------------------------------------------------------------------------------------------------

QUERY_OPEN = "<query>"
_EXACT_TAGS = frozenset(f"<{c}{n}>" for n in ("query", "search_complete", "important_info") for c in ("", "/"))
_ANY_CASE_TAG = re.compile(r"</?(?:query|search_complete|important_info)>", re.I)
_COMPLETE_UNCLOSED = re.compile(r"<search_complete>\s*([A-Za-z0-9]+)", re.I)
_SELECTION_RUN = re.compile(r"[\s\d,\[\]]*")
_DIGITS = re.compile(r"\d+")
_SELECTION_JUNK = re.compile(r"[^\s\[\],]")
# Cut where the model writes an evidence block itself (any case, in both modes); built on TAG_OPEN like every tag.
_MODEL_INFORMATION = re.compile(TAG_OPEN + r"information\s*>", re.I)
_ANY_TAG = re.compile(r"</?[A-Za-z_][\w-]*>")
_QUERY_FIELD = re.compile(r'"query"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)
_MAX_DIGITS = 18  # a longer document number is out of range (and int() of 4,300+ digits would raise)


@cache
def _any_case(literal: str) -> re.Pattern[str]:
    return re.compile(re.escape(literal), re.I)


class _Tags:
    """Finds s3's tags in a reply: exactly as written in the prompt (strict) or in any case (lenient)."""

    def __init__(self, text: str, lenient: bool) -> None:
        self.text = text
        self.lenient = lenient

    def find(self, literal: str, start: int = 0) -> int:
        if not self.lenient:
            return self.text.find(literal, start)
        found = _any_case(literal).search(self.text, start)
        return found.start() if found else -1

    def rfind(self, literal: str) -> int:
        if not self.lenient:
            return self.text.rfind(literal)
        last = -1
        for found in _any_case(literal).finditer(self.text):
            last = found.start()
        return last

    def element(self, name: str, start: int = 0) -> tuple[str, int] | None:
        """The content of the first ``<name>...</name>`` at or after ``start`` and where it ends; None when there is
        none (``<name>`` without a ``</name>`` after it is no element: the code's non-greedy regex)."""
        opened = self.find(f"<{name}>", start)
        if opened < 0:
            return None
        body = opened + len(name) + 2
        closed = self.find(f"</{name}>", body)
        return None if closed < 0 else (self.text[body:closed], closed + len(name) + 3)


@dataclass
class SearcherTurn:
    """What one searcher reply says: the query (None: none), ``<search_complete>``, and the raw selected doc
    numbers (None: no ``<important_info>``), with the rules that were needed or the tags ignored."""

    query: str | None = None
    complete: bool = False
    selection: list[int] | None = None
    fallbacks: list[str] = field(default_factory=list)


def clean_reply(raw: str, query_open: bool, stopped: bool, lenient: bool = False) -> tuple[str, list[str]]:
    """The part of a searcher reply that enters the trajectory.

    The code cuts a reply right after its first ``</query>``. A reply that writes ``<information>`` itself is cut
    before it (fallback ``model_information``): only the environment inserts evidence. When the backend stopped
    at the ``</query>`` stop string (``stopped``) the string is not in ``raw``; it is put back when a query is open
    (``query_open``: the previous observation was the feedback, which ends inside ``<query>``) and its body has no
    tags. ``lenient``: ``</query>`` and ``<query>`` in any case.
    """
    tags = _Tags(raw, lenient)
    end = tags.find(QUERY_END)
    forged = _MODEL_INFORMATION.search(raw)
    if end >= 0 and (forged is None or end < forged.start()):
        return raw[: end + len(QUERY_END)], []
    if forged is not None:
        return raw[: forged.start()], ["model_information"]
    opened = tags.rfind(QUERY_OPEN)
    content = raw[opened + len(QUERY_OPEN) :] if opened >= 0 else raw if query_open else None
    # An EOS inside an open query also reads as "stop": only a tag-free query body is taken as cut at </query>.
    if stopped and content is not None and not _ANY_TAG.search(content):
        return raw + QUERY_END, []
    return raw, []


def parse_query(content: str, lenient: bool = False) -> tuple[str | None, str | None]:
    """The search query inside ``<query>``: JSON ``{"query": ..}`` (a list: its first item); otherwise the raw
    text (``query_not_json``, the code), or with ``lenient`` the ``"query"`` field of broken JSON
    (``query_json_repaired``). Never raises (deep nesting, 4,300+ digit numbers: not JSON)."""
    content = content.strip()
    try:
        value: Any = json.loads(content)
        fallback = None
        if isinstance(value, dict) and "query" in value:
            value = value["query"]
        elif not isinstance(value, str):
            value, fallback = content, "query_not_json"
        if isinstance(value, list):
            value = value[0] if value else ""
        query = str(value).strip()
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so is int()'s digit limit
        match = _QUERY_FIELD.search(content) if lenient else None
        if match:
            try:
                value = json.loads(f'"{match.group(1)}"')
            except ValueError:
                value = match.group(1)
            return (value.strip() or None), "query_json_repaired"
        return (content or None), ("query_not_json" if content else "empty_query")
    return (query or None), (fallback if query else "empty_query")


def selection_numbers(content: str) -> tuple[list[int], bool]:
    """Every integer in ``<important_info>`` content (the code's ``re.findall(r"\\d+")``), and whether one was too
    long to be a document number (dropped: it is out of range anyway)."""
    numbers: list[int] = []
    too_long = False
    for digits in _DIGITS.findall(content):
        digits = digits.lstrip("0") or "0"
        if len(digits) > _MAX_DIGITS:
            too_long = True
        else:
            numbers.append(int(digits))
    return numbers, too_long


def parse_reply(text: str, query_open: bool, lenient: bool = False) -> SearcherTurn:
    """Read a cleaned reply (§2.2): ``<search_complete>`` (true for true/yes/1/y), ``<query>`` and the first
    ``<important_info>`` (all integers in it). A ``</query>`` without ``<query>`` gets ``<query>`` prepended as in
    the code (the expected form right after the feedback).

    Strict (default, the code): tags as the prompt writes them, closed; an unclosed ``<important_info>`` or
    ``<search_complete>`` is ignored (``important_info_unclosed_ignored`` / ``search_complete_unclosed_ignored``),
    so its block stays untagged and is served whole, and a tag in another case is no tag (``tag_case_ignored``).
    ``lenient``: any case, and unclosed tags are read (``important_info_unclosed``, ``search_complete_unclosed``)
    when ids / a value follow them.
    """
    turn = SearcherTurn()
    tags = _Tags(text, lenient)
    if tags.find(QUERY_END) >= 0 and tags.find(QUERY_OPEN) < 0:
        text = QUERY_OPEN + "\n" + text
        tags = _Tags(text, lenient)
        if not query_open:
            turn.fallbacks.append("query_open_tag_missing")

    element = tags.element("search_complete")
    value = element[0] if element else None
    if element is None and (opened := tags.find("<search_complete>")) >= 0:
        unclosed = _COMPLETE_UNCLOSED.search(text, opened) if lenient else None
        if unclosed:
            value = unclosed.group(1)
            turn.fallbacks.append("search_complete_unclosed")
        else:
            turn.fallbacks.append("search_complete_unclosed_ignored")
    if value is not None:
        value = value.strip().lower()
        turn.complete = value in COMPLETE_VALUES
        if not turn.complete and value not in NOT_COMPLETE_VALUES:
            turn.fallbacks.append("search_complete_unreadable")

    first = tags.element("important_info")
    content = first[0] if first else None
    if first is not None and tags.element("important_info", first[1]) is not None:
        turn.fallbacks.append("extra_important_info")
    if first is None and (opened := tags.find("<important_info>")) >= 0:
        run = _SELECTION_RUN.match(text, opened + len("<important_info>")) if lenient else None
        ids = run.group() if run else ""
        if _DIGITS.search(ids):
            content = ids
            turn.fallbacks.append("important_info_unclosed")
        else:  # strict, or without ids: no tag, as in the code, so the block stays whole
            turn.fallbacks.append("important_info_unclosed_ignored")
    if content is not None:
        turn.selection, too_long = selection_numbers(content)
        if too_long:
            turn.fallbacks.append("selection_number_too_long")
        elif not turn.selection and _SELECTION_JUNK.search(content):
            turn.fallbacks.append("selection_unparsable")

    if query := tags.element("query"):
        turn.query, fallback = parse_query(query[0], lenient)
        if fallback:
            turn.fallbacks.append(fallback)
    if not lenient and any(m.group() not in _EXACT_TAGS for m in _ANY_CASE_TAG.finditer(text)):
        turn.fallbacks.append("tag_case_ignored")
    return turn


def resolve_selection(numbers: list[int], n_docs: int, cap: int) -> tuple[list[int], list[str]]:
    """Doc numbers of the block kept: in 1..``n_docs``, first occurrence, at most ``cap`` (0: any number)."""
    kept: dict[int, None] = {}
    fallbacks: list[str] = []
    for n in numbers:
        if not 1 <= n <= n_docs:
            if "selection_out_of_range" not in fallbacks:
                fallbacks.append("selection_out_of_range")
        else:
            kept.setdefault(n)
    ordered = list(kept)
    if cap and len(ordered) > cap:
        ordered = ordered[:cap]
        fallbacks.append("selection_capped")
    return ordered, fallbacks


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Block:
    """One ``<information>`` block: the query that retrieved it (round 0: the question), its documents, the doc
    numbers the searcher kept in serving order (``None``: never tagged, so all are kept) and whether the searcher
    stopped after it. ``visible``: the documents the searcher saw when ``max_obs_tokens`` cut the block (``None``:
    not cut); numbers, selection and serving then refer to them."""

    query: str
    passages: list[Passage]
    selection: list[int] | None = None
    important_info: list[int] | None = None
    complete: bool = False
    error: str | None = None
    visible: list[Passage] | None = None
    tokens_removed: int = 0

    @property
    def shown(self) -> list[Passage]:
        return self.passages if self.visible is None else self.visible

    def kept(self) -> list[Passage]:
        if self.selection is None:
            return list(self.shown)
        return [self.shown[n - 1] for n in self.selection]


def served_documents(blocks: list[Block], order: str) -> tuple[list[Passage], int]:
    """D_s3: the kept documents of all blocks, deduplicated by text (§2.3); returns them and the duplicates
    dropped. ``order="selected_first"`` is the code's order (tagged blocks' picks, then untagged blocks whole)."""
    if order == "selected_first":
        sequence = [p for b in blocks if b.selection is not None for p in b.kept()]
        sequence += [p for b in blocks if b.selection is None for p in b.shown]
    else:
        sequence = [p for b in blocks for p in b.kept()]
    seen: set[str] = set()
    served: list[Passage] = []
    for p in sequence:
        key = " ".join(p.text.split())
        if key not in seen:
            seen.add(key)
            served.append(p)
    return served, len(sequence) - len(served)


def _passage_dict(p: Passage) -> dict[str, Any]:
    return {"id": p.id, "title": p.title, "text": p.text}


async def _search_round(ctx: Context, trace: Trace, query: str, config: S3Config) -> tuple[list[Passage], str | None]:
    """The documents for a searcher query; a failed search gives an empty block (the code inserts "Error")."""
    try:
        return await ctx.search(trace, query, config.k), None
    except Exception as exc:  # a broken retriever must not lose the example; the Step keeps the error
        error = f"{type(exc).__name__}: {exc}"
        trace.add(Step(kind="search", query=query, error=error, fallback="retrieval_error"))
        return [], error


class ObservationCap:
    """``S3Config.max_obs_tokens`` applied with the searcher's own tokenizer, and its record in
    ``trace.meta["observation_cap"]``: whether it could be applied, how many observations were cut and by how many
    tokens in all."""

    def __init__(self, llm: LLM, trace: Trace, max_tokens: int | None) -> None:
        tokenizer = getattr(llm, "tokenizer", None)
        self.tokenizer = tokenizer if callable(tokenizer) else None
        self.max_tokens = max_tokens if self.tokenizer is not None else None
        self.record: dict[str, Any] = {"max_obs_tokens": max_tokens, "applied": self.max_tokens is not None}
        if max_tokens is not None and self.tokenizer is None:
            self.record["reason"] = (
                f"the searcher backend ({getattr(llm, 'spec', type(llm).__name__)}) has no local tokenizer "
                "to count tokens with: observations were not capped"
            )
        else:
            self.record.update(truncated=0, tokens_removed=0)
        self.record.update(longest_context=0, beyond_reference_context=0)
        trace.meta["observation_cap"] = self.record

    def context(self, step: Step) -> None:
        """Count the searcher contexts longer than the reference's rolling window, which sleuth sends whole."""
        self.record["longest_context"] = max(self.record["longest_context"], step.prompt_tokens)
        if step.prompt_tokens > REFERENCE_CONTEXT_TOKENS:
            self.record["beyond_reference_context"] += 1
            step.meta["beyond_reference_context"] = True

    def apply(self, text: str) -> tuple[str, int, str | None]:
        """``text`` as inserted, the tokens cut from it and a fallback name (``observation_truncated``, or
        ``observation_cap_failed`` when the tokenizer raised and the text was kept whole)."""
        if self.max_tokens is None:
            return text, 0, None
        try:
            kept, removed = cap_observation(text, self.tokenizer, self.max_tokens)
        except Exception as exc:  # an observation must reach the searcher, capped or not
            self.record["error"] = f"{type(exc).__name__}: {exc}"
            return text, 0, "observation_cap_failed"
        if not removed:
            return text, 0, None
        self.record["truncated"] += 1
        self.record["tokens_removed"] += removed
        return kept, removed, "observation_truncated"


async def run_searcher(
    ctx: Context, trace: Trace, prompt: str, blocks: list[Block], transcript: Transcript, config: S3Config
) -> bool:
    """The searcher's rounds over one growing assistant message; returns whether it said the search is complete."""
    llm = ctx.model()
    cap = ObservationCap(llm, trace, config.max_obs_tokens)
    lenient = config.tag_parsing == "lenient"
    query_open = False
    complete = False
    stop_at_query_end = QUERY_END in config.sampling.stop
    step: Step | None = None
    # token-in, token-out (RL rollouts, ctx.record_tokens): from the second reply on the model continues the ids of
    # the first prompt and of every kept reply and observation, each tokenized once (module doc of train/tokens.py)
    tokenizer = llm_tokenizer(llm) if ctx.record_tokens else None
    head_ids: list[int] | None = None
    for turn_index in range(config.max_turns + 1):
        final = turn_index == config.max_turns
        request, mode = searcher_request(llm, prompt, transcript.text)
        if tokenizer is not None and head_ids is not None:
            request.prompt_ids = head_ids + transcript.ids()
        step, _ = await ctx.generate(trace, "searcher", request, config.sampling)
        cap.context(step)
        stopped = stop_at_query_end and step.meta.get("finish_reason") == "stop"
        text, fallbacks = clean_reply(step.output or "", query_open, stopped, lenient)
        tokens = _reply_tokens(tokenizer, step, text) if tokenizer is not None else None
        if tokenizer is not None and tokens is None:  # back to text for the rest (training re-tokenizes it)
            tokenizer = None
            trace.meta["tokens_off"] = f"turn {turn_index}: the kept reply does not match the sampled ids"
        elif tokens is not None and head_ids is None:
            head_ids = step.meta["tokens"]["prompt"]
            trace.meta["searcher_prompt_ids"] = head_ids
        transcript.model(text, tokens)
        turn = parse_reply(text, query_open, lenient)
        fallbacks += turn.fallbacks

        block_index = len(blocks) - 1
        block = blocks[block_index]
        applied = False
        if turn.selection is not None:
            if block.important_info is not None:  # the code pairs one tag with one block; later tags are unused
                fallbacks.append("selection_repeated")
            else:
                block.important_info = turn.selection
                selection, selection_fallbacks = resolve_selection(
                    turn.selection, len(block.shown), config.max_selected
                )
                block.selection = sorted(selection) if config.selection_order == "ascending" else selection
                fallbacks += selection_fallbacks
                applied = True
        complete = block.complete = turn.complete

        query_open = False
        if complete:
            action = "complete"  # wins over a query in the same reply (code)
        elif final:
            action = "stop"
            if turn.query:
                step.meta["ignored_query"] = turn.query
        elif turn.query:
            action = "search"
            passages, error = await _search_round(ctx, trace, turn.query, config)
            observation, removed, cap_fallback = cap.apply(observation_text(passages, config, ctx.inert))
            transcript.observation(observation, _observation_tokens(tokenizer, observation))
            blocks.append(Block(query=turn.query, passages=passages, error=error, tokens_removed=removed))
            if removed:
                blocks[-1].visible = visible_passages(passages, len(observation), config, ctx.inert)
                step.meta["observation_tokens_removed"] = removed
            if cap_fallback:
                fallbacks.append(cap_fallback)
        else:
            action = "invalid"
            fallbacks.append("invalid_action")
            feedback, removed, cap_fallback = cap.apply(invalid_action_feedback())
            transcript.observation(feedback, _observation_tokens(tokenizer, feedback))
            if removed:
                step.meta["observation_tokens_removed"] = removed
            if cap_fallback:
                fallbacks.append(cap_fallback)
            query_open = True

        step.parsed = {
            "action": action,
            "query": turn.query,
            "search_complete": turn.complete,
            "important_info": turn.selection,
            "selected_ids": [p.id for p in block.kept()] if applied else [],
        }
        step.meta.update(turn=turn_index, block=block_index, continuation=mode)
        if text != (step.output or ""):
            step.meta["kept_text"] = text
        step.fallback = "+".join(dict.fromkeys(fallbacks)) or None
        if complete or final:
            break
    if not complete and step is not None:  # turn limit: the context is still built from what was selected
        step.fallback = "+".join(filter(None, [step.fallback, "turn_limit"]))
    return complete


def _reply_tokens(tokenizer: Any, step: Step, text: str) -> dict[str, Any] | None:
    """The ids of the kept reply ``text`` from the step's sampled ids (:func:`kept_token_ids`); None when the
    backend returned no ids or they do not match."""
    record = step.meta.get("tokens")
    if not record:
        return None
    kept = kept_token_ids(tokenizer, record["sampled"], record.get("logprobs"), text)
    if kept is None:
        return None
    out = {"ids": kept["ids"], "logprobs": kept["logprobs"], "eos": kept["eos"], "eos_logprob": kept["eos_logprob"]}
    if kept["inserted"]:
        out["inserted"] = kept["inserted"]
    return out


def _observation_tokens(tokenizer: Any, text: str) -> dict[str, Any] | None:
    """An inserted observation's ids, tokenized once, where it is inserted (token-in runs)."""
    if tokenizer is None:
        return None
    return {"ids": list(tokenizer(text, add_special_tokens=False)["input_ids"])}


async def answer_with_generator(
    ctx: Context, trace: Trace, question: str, served: list[Passage], config: S3Config
) -> None:
    """Â = G(Q, D_s3): one call to the frozen generator (role ``generator``); its reply is the answer, used raw
    as in the paper. With nothing to serve, no call is made (the code scores an empty context as wrong)."""
    if not served:
        trace.add(Step(kind="answer", output="", parsed="", fallback="empty_context", meta={"role": "generator"}))
        trace.answer = ""
        return
    context = generator_context(served, ctx.inert)
    sampling = config.generator_sampling
    if config.generator_prompt == "code_chat":
        system = load_prompt("s3_generator_code_chat").format(context=context)
        step = await ctx.chat(trace, "answer", question, sampling, system=system, role="generator")
    else:
        # The paper's prompt has "Contexts: {context}" on one line; the code's variants keep the trailing blank line.
        text = context.rstrip("\n") if config.generator_prompt == "paper" else context
        prompt = load_prompt(f"s3_generator_{config.generator_prompt}").format(context=text, question=question)
        step = await ctx.chat(trace, "answer", prompt, sampling, role="generator")
    step.meta.setdefault("role", "generator")
    step.meta["doc_ids"] = [p.id for p in served]
    trace.answer = (step.output or "").strip()
    step.parsed = trace.answer
    if not trace.answer:
        step.fallback = "empty_answer"


# ---------------------------------------------------------------------------------------------------------------
# Terminal view
# ---------------------------------------------------------------------------------------------------------------


def render_s3(trace: Trace) -> RenderableType:
    """The rounds (query, titles of the documents kept, stop decision), the generator's context and the answer."""
    rounds = trace.meta.get("rounds")
    if rounds is None:
        return Text("no s3 search (the run stopped before the searcher started)", style="red")
    titles = {p["id"]: p["title"] for p in trace.meta.get("naive_rag_passages", [])}
    for step in trace.steps:
        titles.update((p.id, p.title) for p in step.passages)
    tree = Tree(Text("s3 search", style="bold"), guide_style="dim")
    for r in rounds:
        label = Text(f"round {r['round']}  ", style="bold")
        label.append("question (naive-RAG top-k)" if r["round"] == 0 else f"query: {r['query']}", style="cyan")
        node = tree.add(label)
        kept = set(r["selected_ids"])
        how = "no <important_info>: all kept" if r["selection"] == "all" else f"<important_info> {r['important_info']}"
        node.add(Text(f"{len(r['retrieved_ids'])} retrieved, {len(kept)} kept ({how})", style="dim"))
        if r.get("error"):
            node.add(Text(f"search error: {r['error']}", style="red"))
        if "visible_ids" in r:
            seen = len(r["visible_ids"])
            node.add(Text(f"observation cut by {r['tokens_removed']} tokens: {seen} documents seen", style="yellow"))
        for i, pid in enumerate(r["retrieved_ids"], 1):
            if pid in kept:
                node.add(Text(f"Doc {i}: {titles.get(pid) or pid}", style="green"))
        node.add(Text(f"search_complete: {r['search_complete']}", style="bold" if r["search_complete"] else "dim"))
    if not trace.meta.get("search_complete", False):
        tree.add(Text("turn limit reached without <search_complete>True", style="yellow"))
    served = trace.meta.get("selected_passages", [])
    context = tree.add(Text(f"generator context: {len(served)} documents", style="bold"))
    for i, p in enumerate(served, 1):
        context.add(Text(f"Doc {i}: {p['title'] or p['id']}"))
    answer = trace.answer or "(no answer)"
    tree.add(Text(f"answer: {answer}", style="bold green" if trace.answer else "bold red"))
    return tree


# ---------------------------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------------------------


@register_agent("s3", config=S3Config, needs_retriever=True, render=render_s3)
async def s3(example: Example, ctx: Context, trace: Trace) -> Trace:
    """s3: a searcher queries, selects documents and decides when to stop; a frozen generator answers from them."""
    config: S3Config = ctx.config
    trace.answer = ""
    question = task_question(example, config)
    # q0 = Q: the same top-k as naive RAG ("Begin with Search"); a multiple-choice item searches its stem only.
    initial = await ctx.search(trace, example.question.strip(), config.k_initial)
    trace.meta["naive_rag_ids"] = [p.id for p in initial]
    trace.meta["naive_rag_passages"] = [_passage_dict(p) for p in initial]
    trace.meta["naive_rag_context"] = generator_context(initial, ctx.inert)
    trace.meta["generator_question"] = question  # with naive_rag_context: G(Q, D_RAG) for Gain Beyond RAG
    prompt = searcher_prompt(question, initial, config, ctx.inert)
    trace.meta["searcher_prompt"] = prompt

    blocks = [Block(query=example.question.strip(), passages=initial)]
    transcript = Transcript()
    try:
        complete = await run_searcher(ctx, trace, prompt, blocks, transcript, config)
    finally:  # whatever happened, the trace shows the trajectory so far
        trace.meta["transcript"] = transcript.to_list()
        trace.meta["rounds"] = [
            {
                "round": i,
                "query": b.query,
                "retrieved_ids": [p.id for p in b.passages],
                "important_info": b.important_info,
                "selected_ids": [p.id for p in b.kept()],
                "selection": "all" if b.selection is None else "tagged",
                "search_complete": b.complete,
                **({"error": b.error} if b.error else {}),
                **(
                    {"visible_ids": [p.id for p in b.visible], "tokens_removed": b.tokens_removed}
                    if b.visible is not None
                    else {}
                ),
            }
            for i, b in enumerate(blocks)
        ]
    served, duplicates = served_documents(blocks, config.context_order)
    trace.meta["search_complete"] = complete
    trace.meta["selected_ids"] = [p.id for p in served]
    trace.meta["selected_passages"] = [_passage_dict(p) for p in served]
    trace.meta["duplicates_dropped"] = duplicates
    await answer_with_generator(ctx, trace, question, served, config)
    return trace
