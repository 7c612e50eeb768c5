"""What every agent shares: the per-run :class:`Context`, the agent registry, prompt files, passage formatting.

An agent is a plain ``async def agent(example, ctx, trace) -> Trace`` over ONE example that reads like its paper's
algorithm. It talks to the model and the index only through ``ctx.chat`` / ``ctx.generate`` / ``ctx.search``, which
record a :class:`~sleuth.records.Step` for every call, so the Trace always holds the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from sleuth.llm import LLM, Generation, Request, Sampling
from sleuth.records import Example, Passage, Step, Trace
from sleuth.retrieval import RetrievalError, Retriever

AgentFn = Callable[[Example, "Context", Trace], Awaitable[Trace]]


@dataclass
class Context:
    """The components an agent uses and its method's config; shared by all examples of a run."""

    llm: LLM
    retriever: Retriever | None = None
    config: Any = None

    async def generate(self, trace: Trace, kind: str, request: Request, sampling: Sampling) -> tuple[Step, Generation]:
        """One LLM call, recorded as a Step (``output`` is the first sample; all samples go to ``meta``)."""
        started = time.perf_counter()
        generation = (await self.llm.generate([request], sampling))[0]
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
        trace.add(step)
        return step, generation

    async def chat(self, trace: Trace, kind: str, user: str, sampling: Sampling, system: str | None = None) -> Step:
        """Send one user message (and an optional system message); return the recorded Step."""
        step, _ = await self.generate(trace, kind, Request.chat(user, system), sampling)
        return step

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
    name: str
    fn: AgentFn
    config_cls: type
    needs_retriever: bool
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)


AGENTS: dict[str, AgentSpec] = {}


def register_agent(name: str, config: type, needs_retriever: bool) -> Callable[[AgentFn], AgentFn]:
    """Register ``fn`` under ``name`` with its config dataclass."""

    def decorate(fn: AgentFn) -> AgentFn:
        doc = (fn.__doc__ or "").strip().splitlines()
        AGENTS[name] = AgentSpec(name, fn, config, needs_retriever, doc[0] if doc else "")
        return fn

    return decorate


def get_agent(name: str) -> AgentSpec:
    from sleuth.agents import baselines  # noqa: F401 - registers the agents

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
