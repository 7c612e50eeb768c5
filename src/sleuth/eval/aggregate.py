"""Run metrics from traces: the means of every score, cost and robustness counts, overall and per dataset.

Its own module so that both :mod:`sleuth.eval.evaluate` (which writes ``metrics.json``) and
:mod:`sleuth.eval.report` (which recomputes it for a run without one) import it, and neither imports the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from sleuth.records import Trace

__all__ = ["aggregate"]


def aggregate(traces: Iterable[Trace], errors: Iterable[Trace] = ()) -> dict[str, Any]:
    """Means of every score (ignoring None), plus cost and robustness counts, overall and per dataset.

    Only results count: a trace with ``error`` (among ``traces``, or in ``errors``, the failed attempts of examples
    that have no result) is left out of ``n`` and the means and counted in ``errors``.
    """
    given = list(traces)
    traces = [t for t in given if not t.error]
    failed = [t for t in given if t.error] + list(errors)

    def summary(group: list[Trace], failures: list[Trace]) -> dict[str, Any]:
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
            "errors": len(failures),
        }

    datasets: dict[str, tuple[list[Trace], list[Trace]]] = {}
    for trace in traces:
        datasets.setdefault(trace.example.metadata.get("dataset", "data"), ([], []))[0].append(trace)
    for trace in failed:
        datasets.setdefault(trace.example.metadata.get("dataset", "data"), ([], []))[1].append(trace)
    return {
        "n": len(traces),
        "errors": len(failed),
        "overall": summary(traces, failed),
        "per_dataset": {name: summary(*groups) for name, groups in datasets.items()},
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
