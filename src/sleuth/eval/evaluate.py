"""``sleuth eval``: run a method over dataset files, score every trace, write a resumable run directory.

Run directory::

    RUN/config.json    the resolved configuration; a run that holds results refuses to resume with different
                       settings (one that holds none takes the new settings)
    RUN/traces.jsonl   the results: one Trace per line, with trace.meta["scores"]; an example is done when its
                       line is written
    RUN/errors.jsonl   failed attempts: the Trace of every example whose agent raised (with trace.error and its
                       traceback), one line per attempt; these examples are not done, a re-run retries them
    RUN/metrics.json   overall and per-dataset means over the results, LLM calls, tokens and seconds per question,
                       fallbacks, and ``errors``: examples with no result whose last attempt failed (not in ``n``)
    RUN/report.md      the same as a markdown table
    RUN/eval.lock      held (``fcntl.flock``) by the one ``sleuth eval`` writing the run; it holds that process's pid
    RUN/open-index/    (open mode) a BM25 index per dataset over the paragraphs the dataset gives

A killed run re-run with the same arguments skips every example whose result line is complete (a torn last line is
cut off) and retries every example that failed, so no example is lost or duplicated. A second ``sleuth eval`` on
the same directory is refused while the first holds the lock. Reading keeps one record per (dataset, example id):
the last complete one, except that a failed attempt never replaces a result; a resume rewrites a traces file that
held duplicates (two writers before the lock existed) or failed attempts (runs before errors.jsonl) accordingly.
A run whose every attempted example failed writes its metrics, then raises :class:`EvalError` with the first error.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.agents import Context, get_agent
from sleuth.agents.base import configure
from sleuth.config_check import check_field
from sleuth.eval.aggregate import aggregate
from sleuth.eval.metrics import score_example
from sleuth.llm import Sampling, load_llm
from sleuth.records import Example, Trace
from sleuth.retrieval import Retriever, load_retriever

logger = logging.getLogger("sleuth.eval")

RESUME_KEYS = ("method", "data", "format", "limit", "llm", "generator", "index", "open", "method_config")


LOCK_FILE = "eval.lock"


class EvalError(RuntimeError):
    """A run cannot start or resume (e.g. the run directory holds a different configuration), or every example
    it attempted failed."""


class EvalConfigError(EvalError):
    """A setting of the run is invalid (an unknown option, a value of the wrong type or out of range)."""


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


def trace_key(trace: Trace) -> tuple[Any, str]:
    """What identifies an example in a run: its dataset label and its id."""
    return trace.example.metadata.get("dataset"), trace.example.id


def read_traces(path: Path, repair: bool = False) -> list[Trace]:
    """The complete trace lines of ``path``, one per example; with ``repair`` a torn last line (a killed write) is
    cut off.

    Records are keyed by :func:`trace_key`: of several records of one example the last complete one wins, except
    that a failed attempt (``trace.error``) never replaces a result. A line that does not parse as a Trace is
    skipped with a warning (logger ``sleuth.eval``), so its example counts as not done and a resume runs it again
    instead of failing.
    """
    return _read_records(path, repair)[0]


def _read_records(path: Path, repair: bool = False) -> tuple[list[Trace], int]:
    """:func:`read_traces` and the number of non-blank lines read (more than the traces: duplicates, bad lines)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        if not repair:
            data = data[: data.rfind(b"\n") + 1]
        else:
            keep = data.rfind(b"\n") + 1
            with open(path, "r+b") as f:
                f.truncate(keep)
            data = data[:keep]
    traces: dict[tuple[Any, str], Trace] = {}
    lines = 0
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        try:
            trace = Trace.from_json(line)
        except (ValueError, KeyError, TypeError) as exc:  # e.g. a write cut short by a full disk, then resumed
            logger.warning("%s:%d: skipped an unreadable trace line (%s); its example runs again", path, number, exc)
            continue
        key = trace_key(trace)
        kept = traces.get(key)
        if kept is None or not trace.error or kept.error:
            traces[key] = trace
    return list(traces.values()), lines


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


def _method_config(config: EvalConfig) -> Any:
    """The method's config with ``--set`` options, ``k`` and ``max_new_tokens`` applied, every value checked;
    :class:`EvalConfigError` names the first bad one."""
    spec = get_agent(config.method)
    try:
        for name in ("limit", "k", "max_new_tokens", "concurrency"):
            check_field(EvalConfig, name, getattr(config, name))
        method_config = configure(spec.config_cls, config.method_config)
        if config.k is not None and hasattr(method_config, "k"):
            check_field(type(method_config), "k", config.k)
            method_config.k = config.k
        if config.max_new_tokens is not None and hasattr(method_config, "sampling"):
            check_field(Sampling, "max_new_tokens", config.max_new_tokens)
            method_config.sampling = dataclasses.replace(method_config.sampling, max_new_tokens=config.max_new_tokens)
        validate = getattr(method_config, "validate", None)
        if callable(validate):  # the agents' own checks (choices of string options)
            validate()
    except ValueError as exc:
        raise EvalConfigError(str(exc)) from None
    return method_config


@contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """Hold ``OUT/eval.lock`` (``fcntl.flock``, released by the OS when the process ends, killed or not) for one
    writer; a second gets :class:`EvalError` naming the holder's pid."""
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            for _ in range(20):  # the holder writes its pid right after taking the lock
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                if holder:
                    break
                time.sleep(0.05)
            raise EvalError(
                f"{out} is in use by another sleuth eval (pid {holder or 'unknown'}); wait for it to finish, or use "
                "another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


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
    """Run (or resume) an evaluation; return the metrics written to ``metrics.json``.

    Every setting is checked before the run directory is touched or a model loads (:class:`EvalConfigError`).
    Raises :class:`EvalError` when another process holds the run directory, and, after writing the metrics, when
    every example this call attempted failed (the message carries the first error).
    """
    spec = get_agent(config.method)
    method_config = _method_config(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):
        return _evaluate_locked(config, spec, method_config, out, progress)


def _evaluate_locked(config: EvalConfig, spec: Any, method_config: Any, out: Path, progress: bool) -> dict[str, Any]:
    from sleuth.data import load_examples

    traces_path, errors_path = out / "traces.jsonl", out / "errors.jsonl"
    results = _tidy_results(traces_path, errors_path)
    resolved = {**asdict(config), "method_config": _jsonable(method_config)}
    config_path = out / "config.json"
    previous = _read_json(config_path) if config_path.exists() else {}
    if previous is None and results:
        raise EvalError(f"{config_path} is not readable JSON, so the run's settings are unknown; use another --out")
    previous = previous or {}
    changed = [key for key in RESUME_KEYS if previous.get(key) != resolved.get(key)] if previous else []
    if changed and results:
        raise EvalError(f"{out} holds a run with different {changed}; use another --out to start a new run")
    if changed:  # no results yet (e.g. the model failed to load): the new settings replace the old ones
        errors_path.unlink(missing_ok=True)  # failed attempts under the old settings
    started = previous.get("started_at") if not changed else None
    resolved["started_at"] = started or time.strftime("%Y-%m-%dT%H:%M:%S")
    from sleuth import __version__

    resolved["sleuth_version"] = __version__
    uses_retriever = spec.needs_retriever or (spec.wants_retriever and (config.open or config.index))
    resolved["retriever"] = (
        ("open: BM25 over each dataset's own paragraphs" if config.open else (config.index or "default"))
        if uses_retriever
        else None
    )
    config_path.write_text(json.dumps(resolved, indent=2) + "\n")

    done = {trace_key(t) for t in results}
    llm: Any = None  # loaded on first need: re-running a finished run only recomputes its report
    roles: dict[str, Any] = {}
    shared_retriever: Retriever | None = None
    tally = _Tally()
    with open(traces_path, "a", encoding="utf-8") as sink, open(errors_path, "a", encoding="utf-8") as error_sink:
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
            sinks = (sink, error_sink)
            _run_dataset(config, ctx, todo, name, sinks, progress, already=len(examples) - len(todo), tally=tally)

    if config.judge:
        _judge_traces(config, out, llm)
    results = read_traces(traces_path)
    done = {trace_key(t) for t in results}
    failed = [t for t in read_traces(errors_path) if trace_key(t) not in done]
    metrics = aggregate((rescore_legacy(t) for t in results), errors=failed)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    from sleuth.eval.report import markdown_report

    (out / "report.md").write_text(markdown_report(out))
    if tally.attempted and tally.failed == tally.attempted:
        raise EvalError(
            f"all {tally.attempted} examples failed (written to {errors_path}; a re-run retries them); "
            f"first error: {tally.first_error}"
        )
    return metrics


@dataclass
class _Tally:
    """What one call of :func:`evaluate` attempted, and its first failure (``dataset/id: error``)."""

    attempted: int = 0
    failed: int = 0
    first_error: str | None = None


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it cannot be read or is not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _tidy_results(traces_path: Path, errors_path: Path) -> list[Trace]:
    """The results in ``traces.jsonl`` (a torn last line cut off), one per example. A file that holds more lines
    than that (duplicates from two writers, failed attempts written before ``errors.jsonl`` existed, unreadable
    lines) is rewritten atomically with the results only, its failed attempts moved to ``errors.jsonl``."""
    traces, lines = _read_records(traces_path, repair=True)
    results = [t for t in traces if not t.error]
    if lines > len(results):
        failed = [t for t in traces if t.error]
        if failed:
            with open(errors_path, "a", encoding="utf-8") as f:
                f.write("".join(trace_line(t) for t in failed))
        logger.warning(
            "%s: kept %d results of %d lines (%d failed attempts moved to %s)",
            traces_path,
            len(results),
            lines,
            len(failed),
            errors_path.name,
        )
        tmp = traces_path.with_name(traces_path.name + ".tmp")
        tmp.write_text("".join(trace_line(t) for t in results), encoding="utf-8")
        os.replace(tmp, traces_path)
    return results


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
    config: EvalConfig,
    ctx: Context,
    todo: list[Example],
    name: str,
    sinks: tuple[Any, Any],
    progress: bool,
    already: int,
    tally: _Tally,
) -> None:
    """Run ``todo``; each result line goes to ``sinks[0]`` (traces.jsonl), each failed attempt to ``sinks[1]``
    (errors.jsonl), written and fsynced as its example finishes."""
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
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
        )
        task = bar.add_task(
            f"{config.method} · {name}", total=len(todo) + already, completed=already, em="–", errors=0
        )
        bar.start()

    def write(trace: Trace) -> None:
        if not trace.error:
            try:
                trace.meta["scores"] = score_trace(trace)
            except Exception as exc:  # a failed attempt: kept in errors.jsonl, retried by a resume
                trace.error = f"scoring failed: {type(exc).__name__}: {exc}"
        line = trace_line(trace)  # may add an error (a trace that cannot be serialised)
        sink = sinks[1] if trace.error else sinks[0]
        # A failing write (disk full) reaches the runner, which records it in this trace; the line is then
        # missing, so a resume runs the example again.
        sink.write(line)  # one write per complete line: a kill leaves at most a torn last line
        sink.flush()
        os.fsync(sink.fileno())
        tally.attempted += 1
        if trace.error:
            tally.failed += 1
            if tally.first_error is None:
                tally.first_error = f"{name}/{trace.example.id}: " + " ".join(trace.error.split())
        em = (trace.meta.get("scores") or {}).get("em") if not trace.error else None
        if em is not None:
            running["n"] += 1
            running["em"] += em
        if bar is not None and task is not None:
            shown = f"{100 * running['em'] / running['n']:.1f}" if running["n"] else "–"
            bar.update(task, advance=1, em=shown, errors=tally.failed)

    try:
        asyncio.run(arun(config.method, todo, ctx, concurrency=config.concurrency, on_trace=write, progress=False))
    finally:
        if bar is not None:
            bar.stop()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(asdict(value) if dataclasses.is_dataclass(value) else value, default=str))
