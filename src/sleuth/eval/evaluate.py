"""``sleuth eval``: run a method over dataset files, score every trace, write a resumable run directory.

Run directory::

    RUN/config.json    the resolved configuration (refuses to resume into a run of a different configuration)
    RUN/traces.jsonl   one Trace per line, with trace.meta["scores"]; an example is done when its line is written
    RUN/metrics.json   overall and per-dataset means, LLM calls, tokens and seconds per question, fallbacks, errors
    RUN/report.md      the same as a markdown table
    RUN/open-index/    (open mode) a BM25 index per dataset over the paragraphs the dataset gives

A killed run re-run with the same arguments skips every example whose trace line is complete (a torn last line is
cut off), so no example is lost or duplicated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.agents import Context, get_agent
from sleuth.agents.base import configure
from sleuth.eval.metrics import score_example
from sleuth.llm import load_llm
from sleuth.records import Example, Trace
from sleuth.retrieval import Retriever, load_retriever

logger = logging.getLogger("sleuth.eval")

RESUME_KEYS = ("method", "data", "format", "limit", "llm", "generator", "index", "open", "method_config")


class EvalError(RuntimeError):
    """A run cannot start or resume (e.g. the run directory holds a different configuration)."""


@dataclass
class EvalConfig:
    """What to evaluate. ``index`` is a retriever spec (default: the bundled wiki index) unless ``open`` is set,
    in which case each dataset file is searched over the pool of its own given paragraphs."""

    method: str
    data: list[str]
    out: str
    format: str | None = None
    limit: int | None = None
    llm: str = "default"
    generator: str | None = None
    index: str | None = None
    open: bool = False
    k: int | None = None
    max_new_tokens: int | None = None
    concurrency: int = 32
    judge: str | None = None
    judge_variant: str = "paper"
    command: str | None = None
    method_config: dict[str, Any] = field(default_factory=dict)


def dataset_name(path: str | Path) -> str:
    """A short, stable dataset label: the parent folder and the file stem (``hotpotqa/hotpot``)."""
    p = Path(path)
    return f"{p.parent.name}/{p.stem}" if p.parent.name else p.stem


def retrieved_ids(trace: Trace) -> list[str]:
    """Ids of every passage the agent's searches returned, first-seen order (recall@k reads the first k)."""
    seen: dict[str, None] = {}
    for step in trace.steps:
        if step.kind == "search":
            for passage in step.passages:
                seen.setdefault(passage.id, None)
    return list(seen)


# Per-trace numbers an agent reports about itself (ARENA's citations, AceSearcher's parallel waves), averaged
# with the scores when present.
METHOD_SCORES = ("citation_precision", "citation_recall", "waves", "sequential_rounds", "searches")


def score_trace(trace: Trace) -> dict[str, float | None]:
    searched = any(s.kind == "search" for s in trace.steps)
    scores = score_example(trace.example, trace.answer, retrieved_ids(trace) if searched else None)
    for name in METHOD_SCORES:
        value = trace.meta.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            scores[name] = float(value)
    return scores


def rescore_legacy(trace: Trace) -> Trace:
    """A trace scored before the SQuAD/extended split (``em`` without ``em_ext``: its ``em`` is the extended
    normaliser's) is scored again from its answer, so a resumed run never averages the two meanings of ``em``;
    scores the split did not touch (a judge verdict) are kept."""
    scores = trace.meta.get("scores")
    if isinstance(scores, dict) and "em" in scores and "em_ext" not in scores:
        fresh = score_trace(trace)
        trace.meta["scores"] = {**scores, **fresh}
    return trace


def read_traces(path: Path, repair: bool = False) -> list[Trace]:
    """The complete trace lines of ``path``; with ``repair`` a torn last line (a killed write) is cut off.

    A line that does not parse as a Trace is skipped with a warning (logger ``sleuth.eval``), so its example
    counts as not done and a resume runs it again instead of failing.
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        if not repair:
            data = data[: data.rfind(b"\n") + 1]
        else:
            keep = data.rfind(b"\n") + 1
            with open(path, "r+b") as f:
                f.truncate(keep)
            data = data[:keep]
    traces = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            traces.append(Trace.from_json(line))
        except (ValueError, KeyError, TypeError) as exc:  # e.g. a write cut short by a full disk, then resumed
            logger.warning("%s:%d: skipped an unreadable trace line (%s); its example runs again", path, number, exc)
    return traces


def trace_line(trace: Trace) -> str:
    """``trace`` as one JSON line ending in a newline, whatever its content.

    :meth:`Trace.to_json` already replaces what UTF-8 cannot hold; a trace that still cannot be serialised (a
    reference cycle in ``meta``, nesting past the recursion limit) is written without its steps and meta, with the
    reason added to ``error``, so the example counts as an error instead of stopping the run.
    """
    try:
        return trace.to_json() + "\n"
    except (TypeError, ValueError, RecursionError) as exc:
        note = f"trace not serialisable: {type(exc).__name__}: {exc}"
        trace.error = f"{trace.error}; {note}" if trace.error else note
        bare = Trace(
            example=trace.example,
            method=trace.method,
            answer=trace.answer,
            error=trace.error,
            seconds=trace.seconds,
            started_at=trace.started_at,
            meta={"scores": trace.meta.get("scores") or {}},
        )
        return bare.to_json() + "\n"


def aggregate(traces: Iterable[Trace]) -> dict[str, Any]:
    """Means of every score (ignoring None), plus cost and robustness counts, overall and per dataset."""
    traces = list(traces)

    def summary(group: list[Trace]) -> dict[str, Any]:
        sums: dict[str, float] = {}
        counts: Counter[str] = Counter()
        for trace in group:
            for name, value in (trace.meta.get("scores") or {}).items():
                if value is not None:
                    sums[name] = sums.get(name, 0.0) + float(value)
                    counts[name] += 1
        n = len(group) or 1
        kinds = Counter(kind for t in group for kind in t.fallbacks)
        return {
            "n": len(group),
            **{name: sums[name] / counts[name] for name in sorted(sums)},
            "llm_calls": sum(t.llm_calls for t in group) / n,
            "prompt_tokens": sum(t.prompt_tokens for t in group) / n,
            "completion_tokens": sum(t.completion_tokens for t in group) / n,
            "seconds": sum(t.seconds for t in group) / n,
            "wall_seconds": _wall_seconds(group) / n,
            "fallbacks": sum(kinds.values()),
            "fallback_kinds": dict(kinds),
            "errors": sum(1 for t in group if t.error),
        }

    datasets: dict[str, list[Trace]] = {}
    for trace in traces:
        datasets.setdefault(trace.example.metadata.get("dataset", "data"), []).append(trace)
    return {
        "n": len(traces),
        "overall": summary(traces),
        "per_dataset": {name: summary(group) for name, group in datasets.items()},
    }


def _wall_seconds(group: list[Trace]) -> float:
    """Wall-clock time the group was being worked on, the throughput view of a batched run: the length of the
    union of the examples' [start, finish] intervals.

    ``seconds`` per trace is latency: with 32 examples in flight each one waits for the others' share of the
    batched calls, so latencies add up to far more than the run took. The union (rather than first start to last
    finish) leaves out the gap between a kill and the restart of a resumed run, when nothing was in flight.
    """
    total, end = 0.0, float("-inf")
    for start, finish in sorted((t.started_at, t.started_at + t.seconds) for t in group):
        if start > end:
            total += finish - start
            end = finish
        elif finish > end:
            total += finish - end
            end = finish
    return total


def _method_config(config: EvalConfig) -> Any:
    spec = get_agent(config.method)
    try:
        method_config = configure(spec.config_cls, config.method_config)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    if config.k is not None and hasattr(method_config, "k"):
        method_config.k = config.k
    if config.max_new_tokens is not None and hasattr(method_config, "sampling"):
        method_config.sampling = dataclasses.replace(method_config.sampling, max_new_tokens=config.max_new_tokens)
    return method_config


def open_retriever(examples: list[Example], out: Path, name: str) -> Retriever:
    """``--open`` mode's retriever: a BM25 index over the paragraphs ``examples`` carry, built once under
    ``OUT/open-index/NAME`` (a rerun loads it). Public so that a benchmark evaluating a slice of a file searches
    exactly what ``sleuth eval --open`` would."""
    from sleuth.data import write_open_corpus
    from sleuth.retrieval.base import INDEX_MANIFEST
    from sleuth.retrieval.bm25 import build_bm25_index

    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    index_dir = out / "open-index" / slug
    if not (index_dir / INDEX_MANIFEST).exists():
        corpus = out / "open-index" / f"{slug}.jsonl"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        if write_open_corpus(examples, corpus) == 0:
            raise EvalError(f"open mode: {name} gives no paragraphs to search; pass --index instead")
        build_bm25_index(corpus, index_dir, overwrite=True)
    return load_retriever(str(index_dir))


def unique_ids(examples: list[Example]) -> list[Example]:
    """Resume keys on example ids, so repeated ids in one file get a ``#n`` suffix (recorded in metadata)."""
    seen: Counter[str] = Counter()
    for example in examples:
        seen[example.id] += 1
        if seen[example.id] > 1:
            example.metadata["original_id"] = example.id
            example.id = f"{example.id}#{seen[example.id]}"
    return examples


def evaluate(config: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) an evaluation; return the metrics written to ``metrics.json``."""
    from sleuth.data import load_examples

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_agent(config.method)
    method_config = _method_config(config)
    resolved = {**asdict(config), "method_config": _jsonable(method_config)}
    config_path = out / "config.json"
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        changed = [key for key in RESUME_KEYS if previous.get(key) != resolved.get(key)]
        if changed:
            raise EvalError(f"{out} holds a run with different {changed}; use another --out to start a new run")
        resolved["started_at"] = previous.get("started_at")
    else:
        resolved["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    from sleuth import __version__

    resolved["sleuth_version"] = __version__
    uses_retriever = spec.needs_retriever or (spec.wants_retriever and (config.open or config.index))
    resolved["retriever"] = (
        ("open: BM25 over each dataset's own paragraphs" if config.open else (config.index or "default"))
        if uses_retriever
        else None
    )
    config_path.write_text(json.dumps(resolved, indent=2) + "\n")

    traces_path = out / "traces.jsonl"
    done = {(t.example.metadata.get("dataset"), t.example.id) for t in read_traces(traces_path, repair=True)}
    llm: Any = None  # loaded on first need: re-running a finished run only recomputes its report
    roles: dict[str, Any] = {}
    shared_retriever: Retriever | None = None
    with open(traces_path, "a", encoding="utf-8") as sink:
        for path in config.data:
            name = dataset_name(path)
            examples = unique_ids(load_examples(path, format=config.format, limit=config.limit))
            for example in examples:
                example.metadata["dataset"] = name
            todo = [e for e in examples if (name, e.id) not in done]
            if not todo:
                continue
            retriever = None
            if spec.needs_retriever or (spec.wants_retriever and (config.open or config.index)):
                if config.open:
                    retriever = open_retriever(examples, out, name)
                else:
                    # `is None`, not truthiness: Retriever defines __len__ (an HTTP call for remote ones)
                    if shared_retriever is None:
                        shared_retriever = load_retriever(config.index)
                    retriever = shared_retriever
            llm = llm or load_llm(None if config.llm == "default" else config.llm)
            if config.generator and "generator" not in roles:
                roles["generator"] = load_llm(None if config.generator == "default" else config.generator)
            ctx = Context(llm=llm, retriever=retriever, config=method_config, roles=roles)
            _run_dataset(config, ctx, todo, name, sink, progress, already=len(examples) - len(todo))

    if config.judge:
        _judge_traces(config, out, llm)
    metrics = aggregate(rescore_legacy(t) for t in read_traces(traces_path))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    from sleuth.eval.report import markdown_report

    (out / "report.md").write_text(markdown_report(out))
    return metrics


def _judge_traces(config: EvalConfig, out: Path, llm: Any | None) -> None:
    """Add s3's LLM-judge verdict (``scores["judge"]``) to every trace that lacks it.

    Verdicts are cached in ``RUN/judge-cache.jsonl``, so a killed or repeated judging pass never asks twice; the
    traces file is rewritten atomically once all verdicts are in.
    """
    import asyncio

    from sleuth.eval.metrics import JudgeCache, llm_judge

    traces_path = out / "traces.jsonl"
    traces = read_traces(traces_path)
    todo = [t for t in traces if "judge" not in (t.meta.get("scores") or {})]
    if not todo:
        return
    spec = config.llm if config.judge == "same" else config.judge
    judge = llm if llm is not None and spec == config.llm else load_llm(None if spec == "default" else spec)
    cache = JudgeCache(out / "judge-cache.jsonl")

    async def verdicts() -> list[bool]:
        return await asyncio.gather(
            *(llm_judge(judge, t.answer, t.example.answers, cache, config.judge_variant) for t in todo)
        )

    for trace, verdict in zip(todo, asyncio.run(verdicts()), strict=True):
        trace.meta.setdefault("scores", {})["judge"] = float(verdict)
    tmp = traces_path.with_name(traces_path.name + ".tmp")
    tmp.write_text("".join(t.to_json() + "\n" for t in traces), encoding="utf-8")
    os.replace(tmp, traces_path)


def _run_dataset(
    config: EvalConfig, ctx: Context, todo: list[Example], name: str, sink: Any, progress: bool, already: int
) -> None:
    import asyncio

    from sleuth.runner import arun

    running: dict[str, float] = {"n": 0, "em": 0.0}
    bar = task = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("EM {task.fields[em]}"),
            TimeElapsedColumn(),
        )
        task = bar.add_task(f"{config.method} · {name}", total=len(todo) + already, completed=already, em="–")
        bar.start()

    def write(trace: Trace) -> None:
        try:
            trace.meta["scores"] = score_trace(trace)
        except Exception as exc:  # scored as unanswered and kept: a resume would fail on it again
            note = f"scoring failed: {type(exc).__name__}: {exc}"
            trace.error = f"{trace.error}; {note}" if trace.error else note
            trace.meta["scores"] = {}
        # A failing write (disk full) reaches the runner, which records it in this trace; the line is then
        # missing, so a resume runs the example again.
        sink.write(trace_line(trace))  # one write per complete line: a kill leaves at most a torn last line
        sink.flush()
        os.fsync(sink.fileno())
        em = trace.meta["scores"].get("em")
        if em is not None:
            running["n"] += 1
            running["em"] += em
        if bar is not None and task is not None:
            shown = f"{100 * running['em'] / running['n']:.1f}" if running["n"] else "–"
            bar.update(task, advance=1, em=shown)

    try:
        asyncio.run(arun(config.method, todo, ctx, concurrency=config.concurrency, on_trace=write, progress=False))
    finally:
        if bar is not None:
            bar.stop()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(asdict(value) if dataclasses.is_dataclass(value) else value, default=str))
