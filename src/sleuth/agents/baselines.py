"""The two baselines every method is compared with: ``direct`` (no retrieval) and ``naive_rag`` (retrieve, read).

Answers are free text; a model that rambles is not corrected here, so the metric sees what the model said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sleuth.agents.base import Context, format_passages, load_prompt, register_agent
from sleuth.llm import Sampling
from sleuth.records import Example, Step, Trace


@dataclass
class DirectConfig:
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=64))


@dataclass
class NaiveRAGConfig:
    k: int = 5
    passage_style: str = "title_text"
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=64))


def short_answer(output: str) -> tuple[str, str | None]:
    """The answer span of a free-text reply: the stripped text, or its first non-empty line when it has several.

    Returns the answer and the fallback taken (``None`` when the reply was a single line or empty; the agents record
    an empty reply as ``"empty_output"``, :func:`_read_answer`).
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if len(lines) <= 1:
        return (lines[0] if lines else ""), None
    return lines[0], "first_line"


def _read_answer(trace: Trace, step: Step) -> None:
    """The short answer of ``step`` into the trace, with its fallback (``"empty_output"`` for a reply of no text)."""
    trace.answer, step.fallback = short_answer(step.output or "")
    if not trace.answer:
        step.fallback = "empty_output"
    step.parsed = trace.answer


@register_agent("direct", config=DirectConfig, needs_retriever=False)
async def direct(example: Example, ctx: Context, trace: Trace) -> Trace:
    """Answer from the model's own knowledge (s3's zero-shot "Direct Inference" prompt)."""
    config: DirectConfig = ctx.config
    step = await ctx.chat(trace, "answer", example.question, config.sampling, system=load_prompt("direct_zero_shot"))
    _read_answer(trace, step)
    return trace


@register_agent("naive_rag", config=NaiveRAGConfig, needs_retriever=True)
async def naive_rag(example: Example, ctx: Context, trace: Trace) -> Trace:
    """Retrieve the top-k passages for the question and answer from them (AceSearcher's Direct-RAG prompt).

    Passage titles and texts are made inert (:meth:`Context.inert`), so a passage cannot forge a chat turn."""
    config: NaiveRAGConfig = ctx.config
    passages = await ctx.search(trace, example.question, config.k)
    shown = [dataclasses.replace(p, title=ctx.inert(p.title), text=ctx.inert(p.text)) for p in passages]
    template = load_prompt("direct_rag_claim" if example.kind == "claim" else "direct_rag_qa")
    prompt = template.format(context=format_passages(shown, config.passage_style), question=example.question)
    step = await ctx.chat(trace, "answer", prompt, config.sampling)
    _read_answer(trace, step)
    return trace
