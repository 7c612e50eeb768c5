"""Readable terminal views of a Trace (rich): the answer, then every step with its query, titles and timings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sleuth.records import Step, Trace


def _shorten(text: str | None, width: int = 160) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _step_detail(step: Step) -> Text:
    detail = Text()
    if step.kind == "search" or step.query is not None:
        detail.append("query: ", style="bold")
        detail.append(_shorten(step.query, 120) + "\n")
        for i, p in enumerate(step.passages, 1):
            score = f" ({p.score:.2f})" if p.score is not None else ""
            detail.append(f"  {i}. {p.title or p.id}{score}\n", style="cyan")
    if step.messages is not None or step.prompt is not None:
        prompt = step.messages[-1]["content"] if step.messages else step.prompt
        detail.append("prompt: ", style="bold")
        detail.append(_shorten(prompt) + "\n", style="dim")
        detail.append("output: ", style="bold")
        detail.append(_shorten(step.output, 400) + "\n")
    if step.parsed is not None and step.parsed != step.output:
        detail.append("parsed: ", style="bold")
        detail.append(_shorten(str(step.parsed), 200) + "\n", style="green")
    if step.fallback:
        detail.append(f"fallback: {step.fallback}\n", style="yellow")
    if step.error:
        detail.append(f"error: {step.error}\n", style="red")
    detail.rstrip()
    return detail


def render_trace(trace: Trace, console: Console | None = None, view: Callable[[Trace], Any] | None = None) -> None:
    """Print the answer panel, the method's own view of the trace (``view``, e.g. AceSearcher's decomposition
    tree) when it has one, and a table of the trace's steps."""
    console = console or Console()
    table = Table(show_lines=True, expand=True, title=f"{trace.method} trace", title_justify="left")
    table.add_column("#", justify="right", width=3)
    table.add_column("step", width=10)
    table.add_column("detail", ratio=1)
    table.add_column("tokens", justify="right", width=11)
    table.add_column("s", justify="right", width=6)
    for i, step in enumerate(trace.steps, 1):
        tokens = f"{step.prompt_tokens}+{step.completion_tokens}" if step.prompt_tokens else ""
        table.add_row(str(i), step.kind, _step_detail(step), tokens, f"{step.seconds:.2f}")
    summary = (
        f"{len(trace.steps)} steps · {trace.llm_calls} LLM calls · "
        f"{trace.prompt_tokens}+{trace.completion_tokens} tokens · {trace.seconds:.2f} s"
    )
    if trace.fallbacks:
        summary += f" · fallbacks: {', '.join(trace.fallbacks)}"
    answer = Text(trace.answer or "(no answer)", style="bold green" if trace.answer else "bold red")
    body: list[Text] = [Text(trace.example.question, style="bold"), answer]
    if trace.error:
        body.append(Text(f"error: {trace.error}", style="red"))
    console.print(Panel(Group(*body), title="answer", subtitle=summary, expand=True))
    if view is not None:
        try:
            console.print(view(trace))
        except Exception as exc:  # a broken view must not hide the trace itself
            console.print(Text(f"(method view failed: {type(exc).__name__}: {exc})", style="red"))
    console.print(table)
