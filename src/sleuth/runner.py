"""Drive many per-example agents concurrently so that their LLM and search calls are batched.

Each example runs as its own coroutine; while one waits for the model, the others issue their calls, and the
backends' micro-batchers serve everything waiting with one batched call. A failing example is recorded in its own
Trace (``trace.error``) and never aborts the batch.

>>> from sleuth.runner import run  # doctest: +SKIP
>>> traces = run("naive_rag", examples, ctx)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from typing import Any

from sleuth.agents import Context, get_agent
from sleuth.agents.base import AgentFn
from sleuth.records import Example, Trace


def _config_dict(config: Any) -> dict[str, Any]:
    return asdict(config) if is_dataclass(config) and not isinstance(config, type) else {}


async def run_one(method: str, fn: AgentFn, example: Example, ctx: Context) -> Trace:
    """Run one agent on one example; exceptions end up in ``trace.error`` with the steps done so far."""
    trace = Trace(example=example, method=method, meta={"llm": ctx.llm.spec, "config": _config_dict(ctx.config)})
    if ctx.retriever is not None:
        trace.meta["retriever"] = ctx.retriever.spec
    started = time.perf_counter()
    try:
        await fn(example, ctx, trace)
    except Exception as exc:  # recorded, never raised: one bad example must not stop a run of thousands
        trace.error = f"{type(exc).__name__}: {exc}"
        trace.meta["traceback"] = traceback.format_exc(limit=8)
    trace.seconds = time.perf_counter() - started
    return trace


async def arun(
    method: str,
    examples: Iterable[Example],
    ctx: Context,
    concurrency: int = 64,
    on_trace: Callable[[Trace], None] | None = None,
    progress: bool = True,
    description: str | None = None,
) -> list[Trace]:
    """Run ``method`` on every example, at most ``concurrency`` at a time; traces come back in input order.

    ``on_trace`` is called as each example finishes (in completion order), e.g. to append it to a jsonl file; an
    exception it raises is recorded in that example's ``trace.error`` and the run goes on.
    A ``ctx`` without a config gets the method's default config (set on ``ctx``, so it is recorded in the traces).
    """
    spec = get_agent(method)
    if ctx.config is None:
        ctx.config = spec.config_cls()
    examples = list(examples)
    gate = asyncio.Semaphore(concurrency)
    bar = _progress(len(examples), description or method) if progress else None

    async def guarded(example: Example) -> Trace:
        async with gate:
            trace = await run_one(method, spec.fn, example, ctx)
        if on_trace is not None:
            try:
                on_trace(trace)
            except Exception as exc:  # e.g. the trace could not be written: an error of this example, not the run
                note = f"on_trace failed: {type(exc).__name__}: {exc}"
                trace.error = f"{trace.error}; {note}" if trace.error else note
                trace.meta["on_trace_traceback"] = traceback.format_exc(limit=8)
        if bar is not None:
            bar[0].advance(bar[1])
        return trace

    try:
        return list(await asyncio.gather(*(guarded(e) for e in examples)))
    finally:
        if bar is not None:
            bar[0].stop()


def run(method: str, examples: Iterable[Example], ctx: Context, **kwargs: Any) -> list[Trace]:
    """Synchronous wrapper of :func:`arun`."""
    return asyncio.run(arun(method, examples, ctx, **kwargs))


def _progress(total: int, description: str) -> tuple[Any, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False
    )
    task = bar.add_task(description, total=total)
    bar.start()
    return bar, task
