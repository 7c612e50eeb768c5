"""What every agent shares: the per-run :class:`Context`, the agent registry, prompt files, passage formatting.

An agent is a plain ``async def agent(example, ctx, trace) -> Trace`` over ONE example that reads like its paper's
algorithm. It talks to the model and the index only through ``ctx.chat`` / ``ctx.generate`` / ``ctx.search``, which
record a :class:`~sleuth.records.Step` for every call, so the Trace always holds the whole run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from sleuth.llm import LLM, Generation, Request, Sampling
from sleuth.llm.base import COMMON_SPECIAL_TOKENS
from sleuth.records import Example, Passage, Step, Trace
from sleuth.retrieval import RetrievalError, Retriever

AgentFn = Callable[[Example, "Context", Trace], Awaitable[Trace]]


def call_seed(sampling: Sampling, trace: Trace, kind: str) -> Sampling:
    """``sampling`` with its seed made this call's own: a hash of the run's seed, the example (its id and, for the
    copies an RL step makes of one question, ``metadata["rl"]``'s group and sample), the calls the trace already
    holds and the call's kind. Unseeded or greedy sampling is returned as it is.

    A seed fixes a request's draw (vLLM seeds each request's generator with it alone), so the G copies of one question
    in a GRPO group, sent with the run's one seed, were G identical rollouts on a vLLM server: no spread, no
    advantage. Per call, each copy draws its own trajectory and a rerun of the same step draws the same ones."""
    if sampling.seed is None or sampling.greedy:
        return sampling
    rl = (trace.example.metadata or {}).get("rl")
    rl = rl if isinstance(rl, dict) else {}
    key = f"{sampling.seed}|{trace.example.id}|{rl.get('group', '')}|{rl.get('sample', 0)}|{len(trace.steps)}|{kind}"
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") >> 1  # 31 bits
    return dataclasses.replace(sampling, seed=seed)


@dataclass
class Context:
    """The components an agent uses and its method's config; shared by all examples of a run."""

    llm: LLM
    retriever: Retriever | None = None
    config: Any = None
    roles: dict[str, LLM] = field(default_factory=dict)
    # token-in, token-out (RL rollouts): each call of the main model records its prompt ids, sampled ids and their
    # log-probs in ``step.meta["tokens"]``, and multi-turn agents continue from ids (:func:`kept_token_ids`)
    record_tokens: bool = False
    _special: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def model(self, role: str | None = None) -> LLM:
        """The LLM playing ``role`` (e.g. s3's frozen ``generator``); the main ``llm`` when no model has that role."""
        return self.roles.get(role, self.llm) if role else self.llm

    async def generate(
        self, trace: Trace, kind: str, request: Request, sampling: Sampling, role: str | None = None
    ) -> tuple[Step, Generation]:
        """One LLM call, recorded as a Step (``output`` is the first sample; all samples go to ``meta``).

        ``role`` picks another model of the run (``roles``); the Step records it in ``meta["role"]``.
        """
        started = time.perf_counter()
        sampling = call_seed(sampling, trace, kind)
        generation = (await self.model(role).generate([request], sampling))[0]
        step = Step(
            kind=kind,
            messages=request.messages,
            prompt=request.prompt,
            output=generation.text,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=sum(generation.completion_tokens),
            seconds=time.perf_counter() - started,
            meta={"finish_reason": generation.finish_reasons[0] if generation.finish_reasons else None},
        )
        if sampling.n > 1:
            step.meta["samples"] = generation.texts
        if self.record_tokens and not role and generation.sampled_ids and generation.prompt_ids is not None:
            # the first sample's, as ``output``: {"prompt": ids given, "sampled": ids sampled, "logprobs": each's}
            step.meta["tokens"] = {
                "prompt": list(generation.prompt_ids),
                "sampled": list(generation.sampled_ids[0]),
                "logprobs": list(generation.logprobs[0]) if generation.logprobs else None,
            }
        if role and role in self.roles:
            step.meta["role"] = role
            step.meta["model"] = self.roles[role].spec
        trace.add(step)
        return step, generation

    async def chat(
        self,
        trace: Trace,
        kind: str,
        user: str,
        sampling: Sampling,
        system: str | None = None,
        role: str | None = None,
    ) -> Step:
        """Send one user message (and an optional system message); return the recorded Step."""
        step, _ = await self.generate(trace, kind, Request.chat(user, system), sampling, role=role)
        return step

    def inert(self, text: str) -> str:
        """``text`` from outside (a passage, a title, tool output) made safe to place in a prompt of this run:
        :func:`inert` with the special tokens of the run's own models."""
        return inert(text, self.special_tokens())

    def special_tokens(self) -> tuple[str, ...]:
        """The special-token strings of every model of the run (the main one and each role)."""
        if self._special is None:
            tokens: set[str] = set()
            for llm in (self.llm, *self.roles.values()):
                tokens.update(llm.special_tokens())
            self._special = tuple(sorted(tokens, key=len, reverse=True))
        return self._special

    async def search(self, trace: Trace, query: str, k: int) -> list[Passage]:
        """Top-``k`` passages for ``query``, recorded as a search Step."""
        if self.retriever is None:
            raise RetrievalError("this agent needs a retriever: pass --index (or build the default index)")
        started = time.perf_counter()
        passages = await self.retriever.asearch(query, k)
        trace.add(Step(kind="search", query=query, passages=passages, seconds=time.perf_counter() - started))
        return passages


@dataclass
class AgentSpec:
    """A registered method. ``wants_retriever``: uses one when given (e.g. ARENA without given contexts).
    ``render``: an optional method-specific terminal view of a Trace (a rich renderable), shown by ``sleuth ask``."""

    name: str
    fn: AgentFn
    config_cls: type
    needs_retriever: bool
    description: str = ""
    wants_retriever: bool = False
    render: Callable[[Trace], Any] | None = None


AGENTS: dict[str, AgentSpec] = {}

AGENT_MODULES = ("baselines", "acesearcher", "acesearcher_doc", "exsearch", "s3", "arena")


def register_agent(
    name: str,
    config: type,
    needs_retriever: bool,
    wants_retriever: bool = False,
    render: Callable[[Trace], Any] | None = None,
) -> Callable[[AgentFn], AgentFn]:
    """Register ``fn`` under ``name`` with its config dataclass (and an optional trace view)."""

    def decorate(fn: AgentFn) -> AgentFn:
        doc = (fn.__doc__ or "").strip().splitlines()
        AGENTS[name] = AgentSpec(
            name, fn, config, needs_retriever, doc[0] if doc else "", wants_retriever or needs_retriever, render
        )
        return fn

    return decorate


def get_agent(name: str) -> AgentSpec:
    import importlib

    for module in AGENT_MODULES:  # importing registers the agents
        importlib.import_module(f"sleuth.agents.{module}")

    if name not in AGENTS:
        raise KeyError(f"unknown method {name!r}; available: {sorted(AGENTS)}")
    return AGENTS[name]


@cache
def load_prompt(name: str) -> str:
    """The text of ``agents/prompts/<name>.txt`` after its ``source: ...`` header and ``---`` line."""
    raw = resources.files("sleuth.agents").joinpath("prompts", f"{name}.txt").read_text(encoding="utf-8")
    header, sep, body = raw.partition("\n---\n")
    if not sep or not header.startswith("source:"):
        raise ValueError(f"prompt file {name}.txt must start with a 'source: ...' line and a '---' line")
    return body.rstrip("\n")


def format_passages(passages: list[Passage], style: str = "title_text") -> str:
    """Passages as prompt text, joined by blank lines.

    ``title_text``: the title on its own line, then the text. ``text``: the text only (AceSearcher's released code
    sends only the text column). ``numbered``: ``Doc i (Title: t)\\ntext`` (s3's context format).
    """
    if style == "text":
        return "\n\n".join(p.text for p in passages)
    if style == "numbered":
        return "\n\n".join(f"Doc {i} (Title: {p.title})\n{p.text}" for i, p in enumerate(passages, 1))
    if style == "title_text":
        return "\n\n".join(f"{p.title}\n{p.text}" if p.title else p.text for p in passages)
    raise ValueError(f"unknown passage style {style!r}; use title_text, text or numbered")


# -- observations inserted into a model's context (search results) ------------------------------------------------

# Where a tag can start: "<" right before a letter, "_", "/", "|", "!" or "?" (or at the very end, where the next
# text could supply one). Every lenient parser of model output builds its tag pattern on TAG_OPEN, and
# escape_observation neutralises every "<" it matches: no text that went through the escape can hold a tag that any
# of them reads. "<" before a space or a digit ("a < b", "x <3") is never a tag start, for parser and escape alike.
TAG_OPEN = r"<(?=[^\W\d]|[/|!?]|\Z)"
_TAG_OPEN = re.compile(TAG_OPEN)
# Whole tag look-alikes (<answer>, </information>, <Search 2>, <USER QUERY>) are escaped on both sides, so they read
# as &lt;answer&gt;. Possessive quantifiers: no backtracking, linear time.
_TAG = re.compile(r"</?[A-Za-z_][\w-]*+(?:\s++[\w-]++)*+\s*+/?>")


def escape_observation(text: str) -> str:
    """Make retrieved text inert inside a tagged transcript: every ``<tag>``/``</tag>`` look-alike is HTML-escaped
    (``&lt;answer&gt;``), and every other ``<`` that :data:`TAG_OPEN` reads as the start of a tag (``<FINAL see``,
    ``<|im_end|>``, ``</``) becomes ``&lt;``. So a passage can never close ``<information>``, forge
    ``<important_info>``, an ``<answer>`` or an end token, and chat control tokens cannot end a turn. ``a < b`` and
    ``x > 3`` stay readable. Linear time."""
    text = _TAG.sub(lambda m: html.escape(m.group(0), quote=False), text)
    return _TAG_OPEN.sub("&lt;", text)


def neutralize_special_tokens(text: str, tokens: Iterable[str]) -> str:
    """Break every occurrence of a special-token string (``<|im_start|>``, ``</s>``, ``[INST]``) by inserting a
    zero-width space after its first character, so the tokenizer reads ordinary characters where the passage had a
    control token. One pass over the text per token (linear time); text without any of them is returned unchanged."""
    for token in tokens:
        if len(token) > 1 and token in text:
            text = text.replace(token, token[0] + "\u200b" + token[1:])
    return text


Inert = Callable[[str], str]  # text from outside -> text safe in a prompt (agents pass ``ctx.inert``)


def inert(text: str, special_tokens: Iterable[str] = COMMON_SPECIAL_TOKENS) -> str:
    """``text`` from outside made safe for a prompt: :func:`escape_observation` (no tag look-alike survives) and
    every special token broken (:func:`neutralize_special_tokens`). Without a run (SFT data builders) the common
    chat-template tokens are used; :meth:`Context.inert` passes the run's models' own."""
    return neutralize_special_tokens(escape_observation(text), special_tokens)


@dataclass
class Transcript:
    """A multi-turn generation as ordered segments: ``model`` text the policy wrote and ``observation`` text the
    environment inserted (search results). Training masks observation tokens; the Trace keeps the segments in
    ``trace.meta["transcript"]`` so that a trainer can rebuild exactly which characters the model produced."""

    segments: list[dict[str, Any]] = field(default_factory=list)

    def add(self, source: str, text: str, tokens: dict[str, Any] | None = None) -> None:
        """Append a segment; ``tokens`` (token-in, token-out runs) adds its ids: ``{"ids": [...]}`` and, for model
        text, ``"logprobs"`` (the sampler's) and ``"eos"`` (the end-of-sequence id sampled after it, or None)."""
        if source not in ("model", "observation", "prompt"):
            raise ValueError(f"unknown segment source {source!r}")
        if text:
            self.segments.append({"source": source, "text": text, **(tokens or {})})

    def model(self, text: str, tokens: dict[str, Any] | None = None) -> None:
        self.add("model", text, tokens)

    def observation(self, text: str, tokens: dict[str, Any] | None = None) -> None:
        self.add("observation", text, tokens)

    @property
    def text(self) -> str:
        return "".join(s["text"] for s in self.segments)

    def spans(self) -> list[tuple[int, int, str]]:
        """Character spans ``(start, end, source)`` of each segment in :attr:`text`."""
        out, at = [], 0
        for s in self.segments:
            out.append((at, at + len(s["text"]), s["source"]))
            at += len(s["text"])
        return out

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.segments]

    def ids(self) -> list[int]:
        """Every segment's ids in order, each model segment's ``inserted`` ids after its own (token-in runs: what
        the model's next turn continues; the end-of-sequence ids are not part of the context)."""
        return [t for s in self.segments for t in [*(s.get("ids") or []), *(s.get("inserted") or [])]]


def llm_tokenizer(llm: LLM) -> Any | None:
    """The transformers tokenizer of ``llm`` when known (``hf``: its own; ``openai``/``vllm``: the served model's,
    ``score_tokenizer``), else None."""
    tokenizer = getattr(llm, "tokenizer", None)
    if tokenizer is None and callable(getattr(llm, "score_tokenizer", None)):
        tokenizer = llm.score_tokenizer()  # type: ignore[attr-defined]
    return tokenizer if getattr(tokenizer, "decode", None) is not None else None


def kept_token_ids(
    tokenizer: Any, sampled: list[int], logprobs: list[float] | None, kept: str
) -> dict[str, Any] | None:
    """The ids of the part of a sampled reply that an agent keeps (``kept``: its text, cut or completed).

    ``sampled`` may end with an end-of-sequence id (a special token); the rest decodes to the reply. Returns
    ``{"ids", "logprobs", "eos", "eos_logprob", "inserted"}``: the sampled ids that cover ``kept`` (the shortest
    prefix whose text starts with ``kept``; a stop string cut mid-token keeps the whole token, as sampled), their
    log-probs, the end-of-sequence id (and its log-prob) when nothing was cut, and ``inserted``: the ids of text the
    agent added after everything
    the model wrote (a ``</query>`` put back after an EOS; tokenized once here, and masked in training). None when
    ``kept`` is neither a prefix nor an extension of the sampled text (the caller falls back to text)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    eos = sampled[-1] if sampled and sampled[-1] in special else None
    body = sampled[:-1] if eos is not None else list(sampled)
    values = list(logprobs[: len(body)]) if logprobs is not None else None

    def text(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    full = text(body)
    if full == kept:
        last = logprobs[len(body)] if eos is not None and logprobs is not None and len(logprobs) > len(body) else None
        return {"ids": body, "logprobs": values, "eos": eos, "eos_logprob": last, "inserted": []}
    if full.startswith(kept):
        for j in range(len(body) + 1):
            if text(body[:j]).startswith(kept):
                return {
                    "ids": body[:j],
                    "logprobs": values[:j] if values is not None else None,
                    "eos": None,
                    "eos_logprob": None,
                    "inserted": [],
                }
    if kept.startswith(full):
        extra = list(tokenizer(kept[len(full) :], add_special_tokens=False)["input_ids"])
        return {"ids": body, "logprobs": values, "eos": None, "eos_logprob": None, "inserted": extra}
    return None


# -- method options from the command line (`--set k=3 --set sampling.temperature=0.7`) ----------------------------


def _field_kind(owner: Any, name: str) -> tuple[type | None, bool]:
    """The concrete type a field holds besides None (``int | None`` -> int) and whether None is allowed, from its
    annotation."""
    import typing

    try:
        hint = typing.get_type_hints(type(owner)).get(name)
    except Exception:  # unresolvable annotations: keep the string
        return None, False
    args = typing.get_args(hint)
    optional = type(None) in args
    args = [a for a in args if a is not type(None)] or [hint]
    return next((a for a in (bool, int, float) if a in args), None), optional


def _coerce(raw: Any, current: Any, key: str, kind: type | None = None, optional: bool = False) -> Any:
    if not isinstance(raw, str):
        return raw
    if optional and raw.lower() in ("none", "null"):  # `--set max_obs_tokens=none` on an `int | None` field
        return None
    if current is None:
        if raw.lower() in ("none", "null", ""):
            return None
        if kind is not None:
            return _coerce(raw, kind(), key)
    if isinstance(current, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}: got {raw!r}, expected true or false")
    try:
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        expected = "an integer" if isinstance(current, int) else "a number"
        raise ValueError(f"{key}: got {raw!r}, expected {expected}") from None
    if isinstance(current, tuple | list):
        return type(current)(part for part in raw.split(",") if part)
    return raw


def parse_options(pairs: Iterable[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``["k=3", "sampling.temperature=0.7"]`` -> ``{"k": "3", ...}`` (a mapping passes through unchanged)."""
    if pairs is None or isinstance(pairs, dict):
        return dict(pairs or {})
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"option {pair!r} is not KEY=VALUE")
        options[key.strip()] = value
    return options


def configure(config_cls: type, options: dict[str, Any] | None = None) -> Any:
    """A ``config_cls`` instance with ``options`` applied; keys may be dotted into nested dataclasses
    (``sampling.temperature``) and string values are converted to the field's type. Unknown keys are errors, and so
    is a value of the wrong type or out of range (:mod:`sleuth.config_check`: ``KEY: got X, expected Y``)."""
    import dataclasses

    from sleuth.config_check import check_field

    config = config_cls()
    for key, raw in (options or {}).items():
        *path, leaf = key.split(".")
        owners = [config]
        for part in path:
            owner = owners[-1]
            if not dataclasses.is_dataclass(owner) or part not in {f.name for f in dataclasses.fields(owner)}:
                raise ValueError(f"unknown option {key!r} for {config_cls.__name__}")
            owners.append(getattr(owner, part))
        target = owners[-1]
        names = {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set()
        if leaf not in names:
            known = ", ".join(sorted(f.name for f in dataclasses.fields(config)))
            raise ValueError(f"unknown option {key!r} for {config_cls.__name__} (options: {known})")
        value = _coerce(raw, getattr(target, leaf), key, *_field_kind(target, leaf))
        check_field(type(target), leaf, value, key)
        # frozen dataclasses (Sampling) are rebuilt bottom-up with dataclasses.replace
        for owner, name in zip(reversed(owners), reversed([*path, leaf]), strict=True):
            if owner.__dataclass_params__.frozen:
                value = dataclasses.replace(owner, **{name: value})
            else:
                setattr(owner, name, value)
                value = owner
    return config
