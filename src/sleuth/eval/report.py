"""Reports of ``sleuth eval`` run directories: a markdown summary, a side-by-side comparison, a bar chart, and a
self-contained HTML trace browser.

Size: one module on purpose (about 1,000 lines): the markdown report, the comparison, the chart and the
self-contained HTML trace browser (its page template inline) all read the same run directory format.

A run directory holds ``config.json`` (what was run), ``traces.jsonl`` (one :class:`~sleuth.records.Trace` per line,
its per-example scores in ``trace.meta["scores"]`` and its dataset in ``trace.example.metadata["dataset"]``) and
``metrics.json`` (means per dataset and overall). When ``metrics.json`` is missing it is recomputed from the traces
with :func:`sleuth.eval.aggregate.aggregate`.

- :func:`markdown_report`: the run's ``report.md``: config header and a per-dataset table with an overall row.
- :func:`compare_runs` / :func:`bar_chart`: several runs side by side, as markdown and as a grouped bar chart (PNG).
- :func:`html_report`: ONE HTML file (inline CSS and JS, nothing fetched) to browse every trace: a summary table,
  filters, one collapsible card per trace whose steps, prompts, outputs and passages are rendered on expand.

Metric values (EM, F1, Acc, recall@k, ...) are fractions in ``metrics.json`` and shown as percentages with one
decimal; a missing or None value is shown as "–". EM, F1 and Acc are the papers' (SQuAD normalisation); "EM ext",
"F1 ext", ... (keys ``em_ext``, ...) are the same under sleuth's extended normalisation. A ``metrics.json`` written
before that split holds only ``em``/``f1``/``acc``/``acc_either``, computed with the extended normalisation: it is
read as such (:func:`upgrade_metrics`), its headline cells are "–" and its report says so.
"""

from __future__ import annotations

import html
import json
import re
import shlex
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sleuth.eval.aggregate import aggregate
from sleuth.eval.metrics import EXT_SUFFIX, HEADLINE_METRICS
from sleuth.records import Passage, Step, Trace

DASH = "–"
OVERALL = "overall"

# The headline metrics (the papers' SQuAD normalisation) and their twins under sleuth's extended normalisation.
HEADLINE_COLUMNS: list[tuple[str, str]] = [("em", "EM"), ("f1", "F1"), ("acc", "Acc"), ("acc_either", "Acc(either)")]
EXT_COLUMNS: list[tuple[str, str]] = [(f"{key}{EXT_SUFFIX}", f"{label} ext") for key, label in HEADLINE_COLUMNS]
# Scored metrics shown in the one-run table, in order; the optional ones only when some row has a value.
METRIC_COLUMNS: list[tuple[str, str]] = [
    *HEADLINE_COLUMNS,
    *EXT_COLUMNS,
    ("recall@5", "R@5"),
    ("recall@10", "R@10"),
]
_OPTIONAL_COLUMNS = {"recall@5", "recall@10", *(key for key, _ in EXT_COLUMNS)}
# Per-question counts an agent reports (evaluate.METHOD_SCORES): shown as means, not percentages.
COUNT_METRICS = {"waves": "waves", "sequential_rounds": "seq. rounds", "searches": "searches"}
# Keys of a metrics row that are not mean-of-fraction metrics.
_COST_KEYS = {
    "n",
    "llm_calls",
    "prompt_tokens",
    "completion_tokens",
    "seconds",
    "wall_seconds",
    "fallbacks",
    "fallback_kinds",
    "errors",
    "tokens",
}
METRIC_LABELS: dict[str, str] = {
    "em": "EM",
    "f1": "F1",
    "acc": "Acc",
    "acc_either": "Acc (either)",
    **{key: f"{label} (extended normalisation)" for key, label in EXT_COLUMNS},
    "llm_calls": "LLM calls / question",
    "prompt_tokens": "prompt tokens / question",
    "completion_tokens": "completion tokens / question",
    "tokens": "tokens / question",
    "seconds": "seconds / question",
    "fallbacks": "fallbacks",
    "errors": "errors",
}
# Keys of Step.parsed (when a dict) and Step.meta whose values name passage ids.
CITE_KEYS = (
    "cites",
    "citations",
    "cited",
    "relevance",
    "relevant",
    "selected",
    "selected_ids",
    "passage_ids",
    "doc_ids",
    "evidence",
    "supporting",
)


# ---------------------------------------------------------------------------------------------------------------
# Loading a run directory
# ---------------------------------------------------------------------------------------------------------------


def _metric_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [metrics.get("overall") or {}, *(metrics.get("per_dataset") or {}).values()]
    return [row for row in rows if isinstance(row, dict)]


def is_legacy_scores(scores: dict[str, Any]) -> bool:
    """True for scores (of a trace, or a metrics row) written before the headline/extended split: some headline key
    (``em``, ``f1``, ``acc``, ``acc_either``) and no ``*_ext`` key. Their values came from the extended normaliser."""
    return any(key in scores for key in HEADLINE_METRICS) and not any(key.endswith(EXT_SUFFIX) for key in scores)


def upgrade_scores(scores: dict[str, Any]) -> dict[str, Any]:
    """``scores`` with legacy headline keys renamed to their ``_ext`` twins (a copy); current scores unchanged."""
    if not is_legacy_scores(scores):
        return scores
    return {(f"{key}{EXT_SUFFIX}" if key in HEADLINE_METRICS else key): value for key, value in scores.items()}


def is_legacy_metrics(metrics: dict[str, Any]) -> bool:
    """True for a ``metrics.json`` from before the split: no row has any ``*_ext`` key, and some row has a headline
    key (then computed with the extended normaliser, sleuth's default at the time)."""
    rows = _metric_rows(metrics)
    no_ext = not any(key.endswith(EXT_SUFFIX) for row in rows for key in row)
    return no_ext and any(key in row for row in rows for key in HEADLINE_METRICS)


def upgrade_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A legacy ``metrics.json`` read as what it is: every row's ``em``/``f1``/``acc``/``acc_either`` moved to
    ``em_ext``/... (a copy); a current one is returned as it is."""
    if not is_legacy_metrics(metrics):
        return metrics
    out = dict(metrics)
    if isinstance(metrics.get("overall"), dict):
        out["overall"] = upgrade_scores(metrics["overall"])
    if isinstance(metrics.get("per_dataset"), dict):
        out["per_dataset"] = {name: upgrade_scores(row) for name, row in metrics["per_dataset"].items()}
    return out


@dataclass
class Run:
    """A run directory's ``config.json`` and ``metrics.json`` (recomputed from the traces when absent), legacy
    layouts read through :func:`upgrade_metrics` (``legacy`` tells)."""

    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    legacy: bool = False

    @property
    def method(self) -> str:
        return str(self.config.get("method") or "?")

    @property
    def llm(self) -> str:
        return _spec_str(self.config.get("llm"))

    @property
    def datasets(self) -> list[str]:
        return list((self.metrics.get("per_dataset") or {}).keys())

    def row(self, dataset: str) -> dict[str, Any] | None:
        """The metrics row of ``dataset`` (or :data:`OVERALL`), None when the run has no such dataset."""
        if dataset == OVERALL:
            row = dict(self.metrics.get("overall") or {})
            row.setdefault("n", self.metrics.get("n"))
            return row
        return (self.metrics.get("per_dataset") or {}).get(dataset)


def iter_traces(run_dir: str | Path) -> Iterator[Trace]:
    """The traces of a run directory, read one line at a time (blank lines skipped)."""
    path = Path(run_dir) / "traces.jsonl"
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield Trace.from_json(line)


def load_run(run_dir: str | Path) -> Run:
    """Read ``config.json`` and ``metrics.json`` of ``run_dir``; metrics are recomputed from the traces if missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a run directory")
    config_path, metrics_path = path / "config.json", path / "metrics.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
    else:
        metrics = aggregate(iter_traces(path))
    legacy = is_legacy_metrics(metrics)
    return Run(path=path, config=config, metrics=upgrade_metrics(metrics), legacy=legacy)


def trace_dataset(trace: Trace) -> str:
    """The dataset a trace's example came from (``example.metadata["dataset"]``), "?" when unknown."""
    return str(trace.example.metadata.get("dataset") or "?")


# ---------------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------------


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN is not shown


def fmt_pct(value: Any) -> str:
    """A fraction as a percentage with one decimal (``0.12 -> "12.0"``); None or missing -> "–"."""
    return f"{100 * value:.1f}" if _is_num(value) else DASH


def fmt_num(value: Any, digits: int = 2) -> str:
    """A number with ``digits`` decimals and thousands separators; None or missing -> "–"."""
    return f"{value:,.{digits}f}" if _is_num(value) else DASH


def fmt_int(value: Any) -> str:
    """A count; None or missing -> "–"."""
    return f"{int(value):,d}" if _is_num(value) else DASH


def _tokens(row: dict[str, Any]) -> float | None:
    p, c = row.get("prompt_tokens"), row.get("completion_tokens")
    if not _is_num(p) and not _is_num(c):
        return row.get("tokens") if _is_num(row.get("tokens")) else None
    return (p if _is_num(p) else 0) + (c if _is_num(c) else 0)


def _spec_str(spec: Any) -> str:
    if spec is None:
        return DASH
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        return ", ".join(f"{k}={v}" for k, v in spec.items())
    return str(spec)


def _date_str(value: Any) -> str:
    if _is_num(value):
        return datetime.fromtimestamp(value, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
    return str(value)


def _command_str(value: Any) -> str:
    if isinstance(value, list | tuple):
        return shlex.join(str(v) for v in value)
    return str(value)


def _md_cell(value: Any) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _md_code(value: Any) -> str:
    text = " ".join(str(value).split())
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _extra_metrics(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Scored metrics beyond the standard columns (e.g. an LLM judge), in first-seen order."""
    known = {k for k, _ in METRIC_COLUMNS} | _COST_KEYS
    extra: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key in known or key.startswith(("recall@", "all_supporting@")):
                continue
            if value is None or _is_num(value):
                extra[key] = None
    return list(extra)


@dataclass
class _Table:
    headers: list[str]
    align: list[str]
    rows: list[tuple[str, list[str]]]  # (dataset or OVERALL, cells after the dataset cell)


def summary_table(metrics: dict[str, Any]) -> _Table:
    """The per-dataset table of a ``metrics.json``: one row per dataset then the overall row, cells formatted."""
    metrics = upgrade_metrics(metrics)
    per_dataset: dict[str, dict[str, Any]] = dict(metrics.get("per_dataset") or {})
    overall = dict(metrics.get("overall") or {})
    overall.setdefault("n", metrics.get("n"))
    all_rows = [*per_dataset.values(), overall]
    columns = [
        (key, label)
        for key, label in METRIC_COLUMNS
        if key not in _OPTIONAL_COLUMNS or any(_is_num(r.get(key)) for r in all_rows)
    ]
    columns += [(key, key) for key in _extra_metrics(all_rows) if key not in COUNT_METRICS]
    counts = [key for key in COUNT_METRICS if any(_is_num(r.get(key)) for r in all_rows)]
    headers = ["dataset", "n", *(label for _, label in columns)]
    headers += [f"{COUNT_METRICS[key]}/q" for key in counts]
    headers += ["LLM calls/q", "tokens/q", "latency s/q", "wall s/q", "fallbacks", "errors"]
    align = ["l"] + ["r"] * (len(headers) - 1)

    def cells(row: dict[str, Any]) -> list[str]:
        out = [fmt_int(row.get("n"))]
        out += [fmt_pct(row.get(key)) for key, _ in columns]
        out += [fmt_num(row.get(key)) for key in counts]
        out += [fmt_num(row.get("llm_calls")), fmt_num(_tokens(row), 0), fmt_num(row.get("seconds"))]
        out.append(fmt_num(row.get("wall_seconds")))
        out += [fmt_int(row.get("fallbacks")), fmt_int(row.get("errors"))]
        return out

    rows = [(name, cells(row)) for name, row in per_dataset.items()]
    rows.append((OVERALL, cells(overall)))
    return _Table(headers=headers, align=align, rows=rows)


def _config_items(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) pairs of the config fields worth a header line, in a fixed order."""
    items: list[tuple[str, str]] = []
    if "method" in config:
        items.append(("method", str(config["method"])))
    if "llm" in config:
        items.append(("llm", _spec_str(config["llm"])))
    if "retriever" in config:
        items.append(("retriever", _spec_str(config["retriever"])))
    if config.get("data"):
        data = config["data"]
        items.append(("data", ", ".join(map(str, data)) if isinstance(data, list | tuple) else str(data)))
    if config.get("limit") is not None:
        items.append(("limit", str(config["limit"])))
    if config.get("started_at") is not None:
        items.append(("date", _date_str(config["started_at"])))
    if config.get("command"):
        items.append(("command", _command_str(config["command"])))
    if config.get("method_config"):
        items.append(("method config", json.dumps(config["method_config"], ensure_ascii=False, default=str)))
    if config.get("sleuth_version"):
        items.append(("sleuth", str(config["sleuth_version"])))
    return items


_CODE_ITEMS = ("command", "method config")


def _fallback_kinds(metrics: dict[str, Any]) -> dict[str, int]:
    kinds = (metrics.get("overall") or {}).get("fallback_kinds") or {}
    return {str(k): v for k, v in sorted(kinds.items(), key=lambda kv: (-(kv[1] or 0), str(kv[0])))}


# ---------------------------------------------------------------------------------------------------------------
# Markdown: one run, several runs
# ---------------------------------------------------------------------------------------------------------------


def markdown_report(run_dir: str | Path) -> str:
    """The markdown report of one run: its config, then a per-dataset table with an overall row.

    Columns: n, EM, F1, Acc, Acc(either) (SQuAD normalisation, as the papers report), the same under sleuth's
    extended normalisation ("EM ext", ...), R@5 and R@10 (when the run has retrieval scores), further scored metrics
    (e.g. a judge), LLM calls, tokens (prompt + completion) and seconds per question, fallback steps and errors.
    Metrics are percentages with one decimal; "–" marks a metric that is None or absent. A legacy ``metrics.json``
    (before the split) gets a line saying that its numbers are in the ext columns.
    """
    run = load_run(run_dir)
    lines = [f"# sleuth eval: {run.method}", ""]
    for label, text in _config_items(run.config):
        lines.append(f"- **{label}**: {_md_code(text) if label in _CODE_ITEMS else _md_cell(text)}")
    lines.append("")
    table = summary_table(run.metrics)
    rows = [[("**overall**" if name == OVERALL else _md_cell(name)), *cells] for name, cells in table.rows]
    lines.append(_md_table(table.headers, rows, table.align))
    lines.append("")
    if run.legacy:
        lines.append(
            "**Note:** this run's `metrics.json` predates the split of the headline metrics: its EM, F1, Acc and "
            "Acc(either) were computed with sleuth's extended normalisation and are shown in the *ext* columns; the "
            "SQuAD-normalised headline cannot be recomputed without the traces."
        )
        lines.append("")
    lines.append(
        "EM, F1, Acc, R@k in %; EM/F1/Acc use the SQuAD normalisation the papers report (lower-case, no "
        "punctuation, no articles a/an/the, single spaces); the *ext* columns use sleuth's extended normalisation "
        "(also NFKC Unicode folding, Unicode punctuation, number words 0-10), which usually scores higher; "
        "Acc = gold contained in the answer, Acc(either) = two-way containment; "
        "LLM calls and tokens (prompt + completion) are means per question; latency s/q = mean time from an "
        "example's start to its answer (with many examples in flight each waits for the batched calls); wall s/q = "
        "the run's wall-clock time divided by its questions (throughput); fallbacks = steps that used a lenient "
        "parsing rule; errors = examples with no result because their last attempt raised (not in n or the means; "
        "a re-run retries them)."
    )
    kinds = _fallback_kinds(run.metrics)
    if kinds:
        lines.append("")
        lines.append("Fallbacks by kind: " + ", ".join(f"{_md_code(k)} {fmt_int(v)}" for k, v in kinds.items()) + ".")
    return "\n".join(lines) + "\n"


def _run_labels(runs: Sequence[Run]) -> list[str]:
    """Column-group labels: the method, plus the llm when runs differ in it, plus the directory when still equal."""
    labels = [r.method for r in runs]
    if len({r.llm for r in runs}) > 1:
        labels = [f"{label} ({r.llm})" for label, r in zip(labels, runs, strict=True)]
    counts = Counter(labels)
    if any(c > 1 for c in counts.values()):
        labels = [
            f"{label} [{r.path.name}]" if counts[label] > 1 else label for label, r in zip(labels, runs, strict=True)
        ]
    return labels


def _dataset_union(runs: Sequence[Run]) -> list[str]:
    names: dict[str, None] = {}
    for run in runs:
        names.update(dict.fromkeys(run.datasets))
    return [*names, OVERALL]


_COMPARE_COLUMNS: list[tuple[str, str]] = [("em", "EM"), ("f1", "F1"), ("acc", "Acc"), ("em_ext", "EM ext")]


def compare_runs(run_dirs: Sequence[str | Path]) -> str:
    """Several runs side by side in markdown: one row per dataset (then overall), per run EM, F1, Acc and LLM calls
    per question; the best value of each metric in a row is bold. A run without a dataset shows "–"."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    labels = _run_labels(runs)
    names = _dataset_union(runs)
    per_run_n = any(len({fmt_int((r.row(name) or {}).get("n")) for r in runs}) > 1 for name in names)
    headers = ["dataset"] + ([] if per_run_n else ["n"])
    for label in labels:
        headers += ([f"{label} n"] if per_run_n else []) + [f"{label} {col}" for _, col in _COMPARE_COLUMNS]
        headers.append(f"{label} calls/q")
    rows: list[list[str]] = []
    for name in names:
        row_metrics = [r.row(name) or {} for r in runs]
        best = {
            key: max((v for m in row_metrics if _is_num(v := m.get(key))), default=None) for key, _ in _COMPARE_COLUMNS
        }
        cells = ["**overall**" if name == OVERALL else _md_cell(name)]
        if not per_run_n:
            cells.append(fmt_int(next((m.get("n") for m in row_metrics if m.get("n") is not None), None)))
        for m in row_metrics:
            if per_run_n:
                cells.append(fmt_int(m.get("n")))
            for key, _ in _COMPARE_COLUMNS:
                text = fmt_pct(m.get(key))
                bold = len(runs) > 1 and best[key] is not None and m.get(key) == best[key]
                cells.append(f"**{text}**" if bold else text)
            cells.append(fmt_num(m.get("llm_calls")))
        rows.append(cells)
    lines = ["# sleuth eval: comparison", ""]
    for label, run in zip(labels, runs, strict=True):
        retriever = _spec_str(run.config.get("retriever")) if "retriever" in run.config else DASH
        lines.append(
            f"- **{_md_cell(label)}**: {_md_code(run.path)} · llm {_md_cell(run.llm)} · retriever "
            f"{_md_cell(retriever)} · n {fmt_int(run.metrics.get('n'))}"
        )
    lines.append("")
    lines.append(_md_table(headers, rows, ["l"] + ["r"] * (len(headers) - 1)))
    lines.append("")
    lines.append(
        "EM, F1, Acc in % (SQuAD normalisation, as the papers report); EM ext = EM under sleuth's extended "
        "normalisation; calls/q = LLM calls per question; bold = best in the row."
    )
    legacy = [label for label, run in zip(labels, runs, strict=True) if run.legacy]
    if legacy:
        lines.append(
            f"Runs whose metrics.json predates the headline split ({', '.join(map(_md_cell, legacy))}) have only "
            'the extended numbers: their EM, F1 and Acc are "–".'
        )
    return "\n".join(lines) + "\n"


def _metric_value(row: dict[str, Any], metric: str) -> float | None:
    value = _tokens(row) if metric == "tokens" else row.get(metric)
    if not _is_num(value):
        return None
    return float(value) if metric in _COST_KEYS else 100.0 * float(value)


def bar_chart(run_dirs: Sequence[str | Path], out_png: str | Path, metric: str = "em") -> Path:
    """A grouped bar chart (PNG) of ``metric`` per dataset (and overall), one bar per run.

    Score metrics are drawn as percentages; cost keys (``llm_calls``, ``tokens``, ``seconds``, ...) as they are.
    matplotlib is imported here, with the Agg backend, so the rest of sleuth does not need it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("bar_chart needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    labels = _run_labels(runs)
    names = _dataset_union(runs)
    percent = metric not in _COST_KEYS
    label = METRIC_LABELS.get(metric, metric)
    n_runs = len(runs)
    width = 0.8 / n_runs
    fig_w = min(max(6.4, 1.5 + len(names) * (0.6 + 0.45 * n_runs)), 24)
    fig, ax = plt.subplots(figsize=(fig_w, 4.6))
    top = 0.0
    for j, (run, run_label) in enumerate(zip(runs, labels, strict=True)):
        values = [_metric_value(run.row(name) or {}, metric) for name in names]
        xs = [i + (j - (n_runs - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, [v or 0.0 for v in values], width=width * 0.95, label=run_label)
        fmt = "{:.1f}" if percent else "{:,.2f}"
        ax.bar_label(bars, labels=[fmt.format(v) if v is not None else DASH for v in values], fontsize=8, padding=2)
        top = max([top, *(v for v in values if v is not None)])
    ax.set_xticks(range(len(names)))
    rotate = any(len(n) > 12 for n in names) and len(names) > 2
    ax.set_xticklabels(names, rotation=20 if rotate else 0, ha="right" if rotate else "center")
    ax.set_ylabel(f"{label} (%)" if percent else label)
    ax.set_ylim(0, (min(100.0, top) if percent else top) * 1.15 + (1 if top == 0 else 0))
    ax.set_title(f"{label} by dataset" + (f", {n_runs} runs" if n_runs > 1 else f": {labels[0]}"))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------------------
# HTML trace browser
# ---------------------------------------------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def passage_anchor(trace_index: int, passage_id: Any) -> str:
    """The element id of a passage in a trace card: ``t{trace_index}-p{passage_id}``.

    Characters other than letters, digits, ``_`` and ``.`` are written as ``-{hex}-`` so every id is a valid,
    unique fragment (``"12" -> "t0-p12"``, ``"a b" -> "t0-pa-20-b"``).
    """
    slug = re.sub(r"[^A-Za-z0-9_.]", lambda m: f"-{ord(m.group()):x}-", str(passage_id))
    return f"t{trace_index}-p{slug}"


def _cited_ids(value: Any) -> list[str]:
    """Passage ids named by a cite-like value: a list of ids, a dict keyed by id, one id, or dicts with an "id"."""
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, str | int):
        return [str(value)]
    if isinstance(value, dict):
        if "id" in value and not isinstance(value["id"], dict | list):
            return [str(value["id"])]
        return [str(k) for k in value]
    if isinstance(value, list | tuple):
        return [i for v in value if not isinstance(v, list | tuple) for i in _cited_ids(v)]
    return []


def step_citations(step: Step) -> list[str]:
    """The passage ids a step names: in ``parsed`` (a dict) and ``meta`` under :data:`CITE_KEYS`, in order, unique."""
    found: dict[str, None] = {}
    for source in (step.parsed, step.meta):
        if isinstance(source, dict):
            for key in CITE_KEYS:
                if key in source:
                    found.update(dict.fromkeys(_cited_ids(source[key])))
    return list(found)


def _primary_score(scores: dict[str, Any]) -> float | None:
    for key in ("em", "acc", "em_ext", "acc_ext"):
        if _is_num(scores.get(key)):
            return float(scores[key])
    return None


def _short_score(value: Any) -> str:
    if not _is_num(value):
        return DASH
    return f"{value:g}" if float(value).is_integer() else f"{value:.2f}"


def _shorten(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _json_text(value: Any) -> str:
    """JSON on one line when short, indented otherwise."""
    flat = json.dumps(value, ensure_ascii=False, default=str)
    return flat if len(flat) <= 110 else json.dumps(value, ensure_ascii=False, indent=1, default=str)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _badge(text: str, cls: str, title: str = "") -> str:
    t = f' title="{_e(title)}"' if title else ""
    return f'<span class="badge {cls}"{t}>{_e(text)}</span>'


class _TraceRenderer:
    """Renders one trace's card body; assigns passage anchors in render order (the first occurrence gets the id)."""

    def __init__(self, trace: Trace, index: int) -> None:
        self.trace = trace
        self.index = index
        self.gold = {str(s) for s in trace.example.supporting_ids}
        self.anchored: set[str] = set()
        self.present = {str(p.id) for s in trace.steps for p in s.passages} | {
            str(p.id) for p in trace.example.context
        }

    def link(self, pid: str) -> str:
        gold = " gold" if pid in self.gold else ""
        if pid in self.present:
            href = "#" + passage_anchor(self.index, pid)
            return f'<a class="cite{gold}" href="{_e(href)}">{_e(pid)}</a>'
        return f'<span class="cite missing{gold}" title="not among this trace\'s passages">{_e(pid)}</span>'

    def passage(self, rank: int, p: Passage) -> str:
        pid = str(p.id)
        attrs = ""
        if pid not in self.anchored:
            self.anchored.add(pid)
            attrs = f' id="{_e(passage_anchor(self.index, pid))}"'
        gold = pid in self.gold
        score = f'<span class="muted">score {fmt_num(p.score, 3)}</span>' if p.score is not None else ""
        head = (
            f'<span class="rank">{rank}.</span> <b>{_e(p.title or "(untitled)")}</b> '
            f'<code class="pid">{_e(pid)}</code> {score}' + (" " + _badge("gold", "gold") if gold else "")
        )
        text = p.text or ""
        if len(text) <= 180 and "\n" not in text.strip():
            body = f'<div class="ptext short">{_e(text)}</div>'
        else:
            body = (
                f'<details class="ptext"><summary>{_e(_shorten(text, 180))}</summary>'
                f'<div class="pre">{_e(text)}</div></details>'
            )
        if p.meta:
            meta = _e(_json_text(p.meta))
            body += f'<details class="ptext"><summary>meta</summary><div class="pre">{meta}</div></details>'
        return f'<div class="passage{" gold" if gold else ""}"{attrs}><div class="phead">{head}</div>{body}</div>'

    def prompt(self, step: Step) -> str:
        if step.messages is not None:
            n_chars = sum(len(str(m.get("content", ""))) for m in step.messages)
            inner = "".join(
                f'<div class="msg"><div class="role">{_e(m.get("role", "?"))}</div>'
                f'<div class="pre">{_e(m.get("content", ""))}</div></div>'
                for m in step.messages
            )
            what = f"{len(step.messages)} message{'s' if len(step.messages) != 1 else ''}, {n_chars:,} chars"
        else:
            inner = f'<div class="pre">{_e(step.prompt)}</div>'
            what = f"raw prompt, {len(step.prompt or ''):,} chars"
        return (
            f'<details class="prompt"><summary>prompt <span class="muted">({what})</span></summary>{inner}</details>'
        )

    def step(self, n: int, step: Step) -> str:
        is_llm = step.messages is not None or step.prompt is not None
        facts = []
        if step.passages:
            facts.append(f"{len(step.passages)} passages")
        if is_llm or step.prompt_tokens or step.completion_tokens:
            facts.append(f"{step.prompt_tokens:,}+{step.completion_tokens:,} tok")
        facts.append(f"{step.seconds:.2f} s")
        badges = ""
        if step.fallback:
            badges += _badge(f"fallback: {step.fallback}", "fallback")
        if step.error:
            badges += _badge("error", "error")
        preview = ""
        if step.query is not None:
            preview = f'<span class="q">{_e(_shorten(step.query, 120))}</span>'
        elif step.parsed is not None:
            parsed = step.parsed if isinstance(step.parsed, str) else json.dumps(step.parsed, default=str)
            preview = f'<span class="q">→ {_e(_shorten(parsed, 120))}</span>'
        summary = (
            f'<span class="sn">#{n}</span> <span class="kind">{_e(step.kind)}</span> {preview} '
            f'<span class="muted">{_e(" · ".join(facts))}</span> {badges}'
        )
        rows: list[tuple[str, str]] = []
        if step.query is not None:
            rows.append(("query", f'<div class="pre">{_e(step.query)}</div>'))
        if is_llm:
            rows.append(("prompt", self.prompt(step)))
        if step.output is not None:
            rows.append(("output", f'<div class="pre out">{_e(step.output)}</div>'))
        if step.parsed is not None:
            if isinstance(step.parsed, str) and step.parsed == step.output:
                rows.append(("parsed", '<span class="muted">(the output as is)</span>'))
            else:
                text = step.parsed if isinstance(step.parsed, str) else _json_text(step.parsed)
                rows.append(("parsed", f'<div class="pre parsed">{_e(text)}</div>'))
        cites = step_citations(step)
        if cites:
            rows.append(("cites", " ".join(self.link(c) for c in cites)))
        if step.fallback:
            rows.append(("fallback", _badge(step.fallback, "fallback")))
        if step.error:
            rows.append(("error", f'<div class="pre err">{_e(step.error)}</div>'))
        meta = {k: v for k, v in step.meta.items() if v is not None}
        if meta:
            rows.append(("meta", f'<div class="pre small">{_e(_json_text(meta))}</div>'))
        if step.passages:
            rows.append(("passages", "".join(self.passage(i, p) for i, p in enumerate(step.passages, 1))))
        body = "".join(
            f'<div class="row"><div class="lbl">{lbl}</div><div class="val">{v}</div></div>' for lbl, v in rows
        )
        return f'<details class="step" open><summary>{summary}</summary><div class="sbody">{body}</div></details>'

    def body(self) -> str:
        t, ex = self.trace, self.trace.example
        scores = t.meta.get("scores") or {}
        parts = ['<div class="facts">']
        parts.append(f'<div><span class="lbl">question</span><div class="pre">{_e(ex.question)}</div></div>')
        golds = " ".join(f'<span class="gans">{_e(a)}</span>' for a in ex.answers) or DASH
        parts.append(f'<div><span class="lbl">gold</span> {golds}</div>')
        answer = _e(t.answer) if t.answer is not None else '<span class="muted">(no answer)</span>'
        parts.append(f'<div><span class="lbl">predicted</span> <span class="pans">{answer}</span></div>')
        if scores:
            cells = " ".join(f"<span><b>{_e(k)}</b> {_short_score(v)}</span>" for k, v in scores.items())
            parts.append(f'<div class="scores"><span class="lbl">scores</span> {cells}</div>')
        if ex.supporting_ids:
            parts.append(
                '<div><span class="lbl">supporting</span> '
                + " ".join(self.link(str(s)) for s in ex.supporting_ids)
                + ' <span class="muted">(gold evidence; linked where retrieved)</span></div>'
            )
        parts.append(
            f'<div class="muted">{_e(t.method)} · example <code>{_e(ex.id)}</code> · {ex.kind} · '
            f"{_plural(len(t.steps), 'step')} · {_plural(t.llm_calls, 'LLM call')} · "
            f"{t.prompt_tokens:,}+{t.completion_tokens:,} tokens · "
            f"{t.seconds:.2f} s</div>"
        )
        if t.error:
            parts.append(f'<div><span class="lbl">error</span><div class="pre err">{_e(t.error)}</div></div>')
        parts.append("</div>")
        parts += [self.step(i, s) for i, s in enumerate(t.steps, 1)]
        if ex.context:
            inner = "".join(self.passage(i, p) for i, p in enumerate(ex.context, 1))
            parts.append(
                f'<details class="step"><summary><span class="kind">context</span> <span class="muted">'
                f"{len(ex.context)} passages given with the question</span></summary>"
                f'<div class="sbody">{inner}</div></details>'
            )
        meta = {k: v for k, v in t.meta.items() if k != "scores"}
        extra = {**meta, **({"example.metadata": ex.metadata} if ex.metadata else {})}
        if ex.decomposition:
            extra["example.decomposition"] = ex.decomposition
        if extra:
            parts.append(
                '<details class="step"><summary><span class="kind">meta</span></summary>'
                f'<div class="sbody"><div class="pre small">{_e(_json_text(extra))}</div></div></details>'
            )
        return "".join(parts)


def render_trace_body(trace: Trace, index: int) -> str:
    """The HTML of one trace card's body (escaped): facts, scores, every step, passages with anchors."""
    return _TraceRenderer(trace, index).body()


def _trace_status(trace: Trace) -> tuple[str, bool, bool]:
    """(correct | wrong | unscored, has a fallback, has an error) of a trace."""
    primary = _primary_score(upgrade_scores(trace.meta.get("scores") or {}))
    status = "unscored" if primary is None else ("correct" if primary >= 1.0 else "wrong")
    error = bool(trace.error) or any(s.error for s in trace.steps)
    return status, bool(trace.fallbacks), error


def _card(trace: Trace, index: int) -> tuple[str, str, bool, bool]:
    status, fallback, error = _trace_status(trace)
    scores = upgrade_scores(trace.meta.get("scores") or {})
    dataset = trace_dataset(trace)
    badges = _badge(status, status)
    if fallback:
        badges += _badge("fallback", "fallback", ", ".join(trace.fallbacks))
    if error:
        badges += _badge("error", "error", trace.error or "a step raised")
    answer = _e(_shorten(trace.answer, 100)) if trace.answer is not None else '<span class="muted">(none)</span>'
    gold = _e(_shorten(" / ".join(map(str, trace.example.answers)), 100)) or DASH
    score_text = " ".join(
        f"{label} {_short_score(scores.get(k))}"
        for k, label in (("em", "EM"), ("f1", "F1"), ("acc", "Acc"), ("em_ext", "EM ext"))
        if k in scores
    )
    summary = (
        f'<span class="idx">#{index}</span><span class="ds">{_e(dataset)}</span>'
        f'<span class="question">{_e(trace.example.question)}</span><span class="badges">{badges}</span>'
        f'<div class="line2"><span class="muted">answer</span> <span class="pans">{answer}</span> '
        f'<span class="muted">gold</span> <span class="gans1">{gold}</span> <span class="muted">{_e(score_text)} · '
        f"{_plural(len(trace.steps), 'step')} · {_plural(trace.llm_calls, 'call')} · "
        f"{trace.seconds:.1f} s</span></div>"
    )
    card = (
        f'<details class="card {status}" id="t{index}" data-i="{index}" data-status="{status}" '
        f'data-fb="{int(fallback)}" data-err="{int(error)}" data-ds="{_e(dataset)}">'
        f'<summary>{summary}</summary><div class="body"></div></details>'
    )
    return card, status, fallback, error


def _script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element.

    Script text ends only at ``</script`` and turns odd after ``<!--``, so every ``</`` is written ``<\\/`` and every
    ``<!`` as ``\\u003c!`` (both valid JSON escapes); other ``<`` stay as they are, which keeps embedded HTML small.
    """
    return json.dumps(value, ensure_ascii=False).replace("</", "<\\/").replace("<!", "\\u003c!")


_CSS = """
:root{--fg:#1d2330;--muted:#6b7385;--line:#dfe3ea;--bg:#f6f7f9;--card:#fff;--ok:#1a7f37;--okbg:#e6f4ea;
--bad:#c62828;--badbg:#fdecec;--warn:#9a6700;--warnbg:#fff4d6;--err:#7b2cbf;--errbg:#f2e8fb;--gold:#b7791f;
--goldbg:#fffbea;--link:#0b5cad}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
color:var(--fg);background:var(--bg)}
header{padding:14px 22px 6px}
h1{font-size:20px;margin:0 0 4px}h1 .sub{font-weight:400;font-size:14px}
.cfg{color:var(--muted);font-size:13px}.cfg b{color:var(--fg);font-weight:600}
.cfg>span{display:inline-block;margin-right:14px}
code,.pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:12.5px}
main{padding:0 22px 40px}
table.summary{border-collapse:collapse;background:var(--card);margin:8px 0 4px;font-size:13px;
box-shadow:0 1px 2px rgba(0,0,0,.06)}
table.summary th,table.summary td{padding:4px 10px;border-bottom:1px solid var(--line);text-align:right;
white-space:nowrap}
table.summary th{background:#eef1f5;font-weight:600}
table.summary th:first-child,table.summary td:first-child{text-align:left}
table.summary tr.overall td{font-weight:700;border-top:2px solid #c9ced8}
.note{color:var(--muted);font-size:12px;margin:2px 0 10px}
.filters{position:sticky;top:0;z-index:5;background:var(--bg);padding:8px 0;display:flex;flex-wrap:wrap;gap:8px;
align-items:center;border-bottom:1px solid var(--line);margin-bottom:10px}
.filters button{border:1px solid var(--line);background:var(--card);border-radius:14px;padding:3px 11px;
cursor:pointer;font:inherit;font-size:13px}
.filters button.on{background:var(--fg);color:#fff;border-color:var(--fg)}
.filters select,.filters input{font:inherit;font-size:13px;padding:3px 8px;border:1px solid var(--line);
border-radius:6px;background:var(--card)}
.filters input{min-width:280px}
#count{color:var(--muted);font-size:13px;margin-left:auto}
details.card{background:var(--card);border:1px solid var(--line);border-left:4px solid #aab1bf;border-radius:6px;
margin:0 0 8px;content-visibility:auto;contain-intrinsic-size:auto 58px}
details.card.correct{border-left-color:var(--ok)}details.card.wrong{border-left-color:var(--bad)}
details.card[hidden]{display:none}
details.card>summary{cursor:pointer;padding:7px 12px;list-style:none}
details.card>summary::-webkit-details-marker{display:none}
details.card>summary:hover{background:#fafbfc}
.idx{color:var(--muted);font-size:12px;margin-right:8px}
.ds{font-size:11px;background:#eef1f5;border-radius:4px;padding:1px 6px;margin-right:8px;color:#4a5264}
.question{font-weight:600}
.badges{margin-left:8px}
.line2{font-size:13px;margin-top:2px}
.badge{display:inline-block;font-size:11px;font-weight:600;border-radius:10px;padding:0 7px;margin-left:4px;
vertical-align:1px}
.badge.correct{background:var(--okbg);color:var(--ok)}.badge.wrong{background:var(--badbg);color:var(--bad)}
.badge.unscored{background:#eef1f5;color:var(--muted)}
.badge.fallback{background:var(--warnbg);color:var(--warn)}.badge.error{background:var(--errbg);color:var(--err)}
.badge.gold{background:#fdf0c2;color:var(--gold)}
.pans{font-weight:600}.gans1{color:var(--ok)}
.gans{display:inline-block;background:var(--okbg);color:var(--ok);border-radius:4px;padding:0 6px;margin-right:4px}
.muted{color:var(--muted)}
.body{padding:4px 12px 10px;border-top:1px solid var(--line)}
.facts>div{margin:3px 0}
.lbl{display:inline-block;min-width:78px;color:var(--muted);font-size:12px;font-weight:600;text-transform:uppercase;
letter-spacing:.03em}
.scores span{margin-right:12px}
.pre{white-space:pre-wrap;word-break:break-word;background:#f7f8fa;border:1px solid #eceff3;border-radius:4px;
padding:5px 8px;margin:2px 0;max-height:420px;overflow:auto}
.pre.out{background:#f2f7ff;border-color:#dbe6f7}.pre.parsed{background:#eef8f0;border-color:#d4ecd9}
.pre.err{background:var(--errbg);border-color:#e0cdf3;color:var(--err)}.pre.small{font-size:11.5px}
details.step{border:1px solid var(--line);border-radius:5px;margin:7px 0;background:#fcfcfd}
details.step>summary{cursor:pointer;padding:4px 8px;font-size:13px}
.sn{color:var(--muted)}.kind{font-weight:700;color:#2d4a7c}.q{color:#333}
.sbody{padding:2px 10px 8px}
.row{display:flex;gap:10px;margin:4px 0}.row>.lbl{flex:0 0 78px;padding-top:4px}.row>.val{flex:1;min-width:0}
details.prompt>summary,details.ptext>summary{cursor:pointer;font-size:13px}
details.ptext>summary,.ptext.short{color:#4a5264;font-size:13px}
.msg .role{font-size:11px;font-weight:700;color:var(--muted);margin-top:4px}
.passage{border:1px solid #eceff3;border-radius:5px;padding:4px 8px;margin:4px 0;background:#fff}
.passage.gold{background:var(--goldbg);border-color:#f0d98c}
.passage.flash{outline:3px solid #f5b400;transition:outline .2s}
.rank{color:var(--muted)}.pid{color:#4a5264;background:#eef1f5;border-radius:3px;padding:0 4px}
a.cite{display:inline-block;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;color:var(--link);
background:#e8f0fb;border-radius:4px;padding:0 6px;margin:1px 2px;text-decoration:none}
a.cite:hover{text-decoration:underline}a.cite.gold{background:#fdf0c2;color:var(--gold)}
span.cite.missing{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;color:var(--muted);
border:1px dashed #c9ced8;border-radius:4px;padding:0 5px;margin:1px 2px}
"""

_JS = """
(function(){
  var bodies=null;
  function body(i){if(bodies===null){bodies=JSON.parse(document.getElementById('trace-bodies').textContent);}
    return bodies[i];}
  function fill(card){var b=card.querySelector(':scope>.body');
    if(b&&!b.hasAttribute('data-done')){b.innerHTML=body(+card.getAttribute('data-i'));b.setAttribute('data-done','');}}
  document.addEventListener('toggle',function(e){var d=e.target;
    if(d.classList&&d.classList.contains('card')&&d.open){fill(d);}},true);
  document.querySelectorAll('details.card[open]').forEach(fill);
  function openTo(el){for(var p=el;p;p=p.parentElement){if(p.tagName==='DETAILS'&&!p.open){
    if(p.classList.contains('card')){fill(p);}p.open=true;}}}
  function showHash(){var h=decodeURIComponent(location.hash.slice(1));if(!h)return;
    var m=/^t(\\d+)/.exec(h);var card=m&&document.getElementById('t'+m[1]);
    if(card){card.hidden=false;fill(card);card.open=true;}
    var el=document.getElementById(h);if(el){openTo(el);el.scrollIntoView({block:'start'});}}
  window.addEventListener('hashchange',showHash);showHash();
  document.addEventListener('click',function(e){var a=e.target.closest&&e.target.closest('a.cite');if(!a)return;
    var el=document.getElementById(a.getAttribute('href').slice(1));if(!el)return;e.preventDefault();
    openTo(el);el.querySelectorAll('details').forEach(function(d){d.open=true;});
    el.scrollIntoView({block:'center'});el.classList.remove('flash');void el.offsetWidth;el.classList.add('flash');});
  var cards=Array.prototype.slice.call(document.querySelectorAll('details.card'));
  var texts=cards.map(function(c){return c.querySelector('summary').textContent.toLowerCase();});
  var status='all',ds=document.getElementById('ds'),q=document.getElementById('q');
  var count=document.getElementById('count');
  function keep(c){if(status==='correct'||status==='wrong'){if(c.getAttribute('data-status')!==status)return false;}
    else if(status==='fallback'){if(c.getAttribute('data-fb')!=='1')return false;}
    else if(status==='error'){if(c.getAttribute('data-err')!=='1')return false;}
    return !ds.value||c.getAttribute('data-ds')===ds.value;}
  function apply(){var s=q.value.trim().toLowerCase(),n=0;
    cards.forEach(function(c,i){var show=keep(c)&&(!s||texts[i].indexOf(s)>=0);c.hidden=!show;if(show)n++;});
    count.textContent='showing '+n+' of '+cards.length;}
  document.querySelectorAll('.filters button[data-f]').forEach(function(b){b.addEventListener('click',function(){
    status=b.getAttribute('data-f');document.querySelectorAll('.filters button[data-f]').forEach(function(x){
    x.classList.toggle('on',x===b);});apply();});});
  ds.addEventListener('change',apply);q.addEventListener('input',apply);
  document.getElementById('expand').addEventListener('click',function(){var k=0;
    cards.forEach(function(c){if(!c.hidden&&k<50){fill(c);c.open=true;k++;}});});
  document.getElementById('collapse').addEventListener('click',function(){cards.forEach(function(c){c.open=false;});});
  apply();
})();
"""


def _summary_html(metrics: dict[str, Any]) -> str:
    table = summary_table(metrics)
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    rows = "".join(
        f'<tr class="{"overall" if name == OVERALL else ""}"><td>{_e(name)}</td>'
        + "".join(f"<td>{_e(c)}</td>" for c in cells)
        + "</tr>"
        for name, cells in table.rows
    )
    kinds = _fallback_kinds(metrics)
    note = (
        "Metrics in %; EM/F1/Acc use the papers' SQuAD normalisation, the ext columns sleuth's extended one; calls, "
        "tokens (prompt + completion) and seconds are means per question."
    )
    if kinds:
        note += " Fallbacks by kind: " + ", ".join(f"{_e(k)} {fmt_int(v)}" for k, v in kinds.items()) + "."
    table_html = f'<table class="summary"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    return f'{table_html}<div class="note">{note}</div>'


def html_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ONE self-contained HTML file browsing the run's traces; returns its path (default ``RUN/report.html``).

    The page has the run's summary table, filters (all / correct / wrong / fallback / error, dataset, text search
    over the question, answer and gold), and one collapsible card per trace. Card bodies are rendered here, with
    every string HTML-escaped, and embedded as a JSON list in a ``<script type="application/json">`` block (``</``
    and ``<!`` escaped, see :func:`_script_json`); a few lines of inline JavaScript insert a body when its card is
    first opened, so thousands of traces stay light. Steps show kind, query, prompt, raw output, parsed value, cited
    passage ids (links to the passage elements, ids ``t{i}-p{passage_id}``), fallback, error, tokens, seconds and
    passages (title, id, score, text collapsed); gold supporting passages are highlighted. "correct" means EM = 1
    (Acc = 1 for examples without EM). A URL fragment ``#t{i}`` opens trace ``i``.
    """
    run = load_run(run_dir)
    out = Path(out_path) if out_path is not None else run.path / "report.html"
    cards: list[str] = []
    bodies: list[str] = []
    counts: Counter[str] = Counter()
    datasets: Counter[str] = Counter()
    for i, trace in enumerate(iter_traces(run.path)):
        card, status, fallback, error = _card(trace, i)
        cards.append(card)
        bodies.append(render_trace_body(trace, i))
        counts[status] += 1
        counts["fallback"] += fallback
        counts["error"] += error
        datasets[trace_dataset(trace)] += 1
    total = len(cards)
    cfg = "".join(
        f"<span><b>{_e(label)}</b> {f'<code>{_e(text)}</code>' if label in _CODE_ITEMS else _e(text)}</span>"
        for label, text in _config_items(run.config)
        if label != "method"
    )
    buttons = "".join(
        f'<button data-f="{f}" class="{"on" if f == "all" else ""}">{f} ({n})</button>'
        for f, n in (
            ("all", total),
            ("correct", counts["correct"]),
            ("wrong", counts["wrong"]),
            ("fallback", counts["fallback"]),
            ("error", counts["error"]),
        )
    )
    options = '<option value="">all datasets</option>' + "".join(
        f'<option value="{_e(name)}">{_e(name)} ({n})</option>' for name, n in datasets.items()
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sleuth · {_e(run.method)} · {_e(run.path.name)}</title>
<style>{_CSS}</style></head>
<body><header><h1>sleuth eval: {_e(run.method)} <span class="muted sub">{_e(run.path.name)}</span></h1>
<div class="cfg">{cfg}</div></header>
<main>{_summary_html(run.metrics)}
<div class="filters">{buttons}
<select id="ds" aria-label="dataset">{options}</select>
<input id="q" type="search" placeholder="search questions, answers, gold…" aria-label="search">
<button id="expand" title="open the first 50 shown">expand</button><button id="collapse">collapse all</button>
<span id="count">{total} traces</span></div>
<noscript><p class="note">Trace details need JavaScript (inline, nothing is fetched).</p></noscript>
<div id="cards">{"".join(cards)}</div></main>
<script type="application/json" id="trace-bodies">{_script_json(bodies)}</script>
<script>{_JS}</script>
</body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
