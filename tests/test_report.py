"""Run reports: the markdown table, run comparison, the bar chart and the self-contained HTML trace browser."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from sleuth.eval.evaluate import aggregate
from sleuth.eval.report import (
    bar_chart,
    compare_runs,
    html_report,
    is_legacy_metrics,
    is_legacy_scores,
    load_run,
    markdown_report,
    passage_anchor,
    render_trace_body,
    step_citations,
    upgrade_metrics,
    upgrade_scores,
)
from sleuth.records import Example, Passage, Step, Trace

XSS = "</script><img src=x onerror=alert(1)>"

# ---------------------------------------------------------------------------------------------------------------
# A hand-made run directory: naive_rag on two datasets, four traces (correct, wrong, fallback, error)
# ---------------------------------------------------------------------------------------------------------------

RAG_PROMPT = (
    "Answer the question using the passages below. Reply with a short answer only.\n\n{context}\n\n"
    "Question: {question}\nAnswer:"
)


def _context(passages: list[Passage]) -> str:
    return "\n".join(f"Doc {i} (Title: {p.title}) {p.text}" for i, p in enumerate(passages, 1))


HEADLINE = ("em", "f1", "acc", "acc_either")


def _ext(scores: dict) -> dict:
    """Trace scores as score_example writes them: every headline metric with its ``_ext`` twin (same value here)."""
    return {**scores, **{f"{k}_ext": scores[k] for k in HEADLINE if k in scores}}


def _rag_trace(
    ex: Example, passages: list[Passage], output: str, scores: dict, fallback: str | None = None, **step_extra
) -> Trace:
    trace = Trace(example=ex, method="naive_rag", started_at=1767225600.0)
    scores = _ext(scores)
    trace.add(Step(kind="search", query=ex.question, passages=passages, seconds=0.031))
    prompt = RAG_PROMPT.format(context=_context(passages), question=ex.question)
    answer = output.strip().splitlines()[0].strip()
    trace.add(
        Step(
            kind="answer",
            messages=[{"role": "user", "content": prompt}],
            output=output,
            parsed=answer,
            prompt_tokens=612,
            completion_tokens=9,
            seconds=0.84,
            fallback=fallback,
            meta={"finish_reason": "stop"},
            **step_extra,
        )
    )
    trace.answer = answer
    trace.seconds = 0.9
    trace.meta["scores"] = scores
    return trace


def make_traces() -> list[Trace]:
    """Four realistic traces: correct, wrong (its passage holds HTML), fallback + citations, error."""
    p1 = [
        Passage(
            "hp-101",
            "Gustave Eiffel",
            "Gustave Eiffel was a French civil engineer whose company designed and "
            "built the Eiffel Tower for the 1889 Exposition Universelle in Paris.",
            14.2,
        ),
        Passage(
            "hp-102",
            "Eiffel Tower",
            "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in "
            "Paris, France. It is named after the engineer Gustave Eiffel.",
            13.7,
        ),
        Passage(
            "hp-103",
            "Statue of Liberty",
            "The internal structure of the Statue of Liberty was designed by Gustave Eiffel's firm.",
            9.1,
        ),
        Passage("hp-104", "Garabit viaduct", "The Garabit viaduct is a railway arch bridge built by Eiffel.", 8.4),
        Passage(
            "hp-105",
            "Exposition Universelle (1889)",
            "A world's fair held in Paris from 6 May to 31 October "
            "1889, marking the centennial of the storming of the Bastille.",
            7.9,
        ),
    ]
    ex1 = Example(
        "hp-q1",
        "In which city was the tower designed by Gustave Eiffel's company for the 1889 fair built?",
        ["Paris"],
        supporting_ids=["hp-101", "hp-102"],
        metadata={"dataset": "hotpotqa-dev"},
    )
    t1 = _rag_trace(
        ex1,
        p1,
        "Paris",
        {"em": 1.0, "f1": 1.0, "acc": 1.0, "acc_either": 1.0, "recall@1": 1.0, "recall@5": 1.0, "recall@10": 1.0},
    )

    p2 = [
        Passage("hp-201", "Kafka on the Shore", "Kafka on the Shore is a 2002 novel by Haruki Murakami.", 12.0),
        Passage(
            "hp-202",
            "Web scraping",
            f"A scraped page fragment: {XSS} and a stray <answer>Tokyo</answer> tag. <!-- <script>x()</script>",
            6.1,
        ),
        Passage("hp-203", "Haruki Murakami", "Murakami was born in Kyoto, Japan, in 1949.", 11.5),
        Passage("hp-204", "Norwegian Wood (novel)", "Norwegian Wood is a 1987 novel by Haruki Murakami.", 10.2),
        Passage("hp-205", "Kobe", "Murakami grew up in Nishinomiya, Ashiya and Kobe.", 9.8),
    ]
    ex2 = Example(
        "hp-q2",
        "Where was the author of Kafka on the Shore born?",
        ["Kyoto", "Kyoto, Japan"],
        supporting_ids=["hp-201", "hp-203"],
        metadata={"dataset": "hotpotqa-dev"},
    )
    t2 = _rag_trace(
        ex2,
        p2,
        "Tokyo",
        {"em": 0.0, "f1": 0.0, "acc": 0.0, "acc_either": 0.0, "recall@1": 0.5, "recall@5": 1.0, "recall@10": 1.0},
    )

    p3 = [
        Passage("nq-31", "Hamlet", "Hamlet is a tragedy written by William Shakespeare between 1599 and 1601.", 15.0),
        Passage("nq-32", "Globe Theatre", "The Globe Theatre was built in 1599 by Shakespeare's company.", 9.0),
        Passage("nq-33", "Elsinore", "Kronborg castle at Helsingør is the Elsinore of Hamlet.", 8.0),
    ]
    ex3 = Example(
        "nq-q3",
        "Who wrote the tragedy Hamlet?",
        ["William Shakespeare", "Shakespeare"],
        supporting_ids=["nq-31"],
        metadata={"dataset": "nq-dev"},
    )
    t3 = _rag_trace(
        ex3,
        p3,
        "William Shakespeare\nHe wrote it around 1600 [nq-31].",
        {"em": 1.0, "f1": 1.0, "acc": 1.0, "acc_either": 1.0, "recall@1": 1.0, "recall@5": 1.0, "recall@10": 1.0},
        fallback="first_line",
    )
    t3.steps[1].meta["cites"] = ["nq-31"]
    t3.steps.insert(
        1,
        Step(
            kind="select",
            messages=[{"role": "system", "content": "Pick the useful passages."}, {"role": "user", "content": "..."}],
            output='{"relevance": ["nq-31", "nq-33"], "selected": ["nq-31"]}',
            parsed={"relevance": ["nq-31", "nq-33"], "selected": ["nq-31", "nq-99"]},
            prompt_tokens=240,
            completion_tokens=22,
            seconds=0.4,
        ),
    )

    ex4 = Example(
        "nq-q4",
        "What is the boiling point of water at sea level in Fahrenheit?",
        ["212", "212 °F"],
        metadata={"dataset": "nq-dev"},
    )
    t4 = Trace(example=ex4, method="naive_rag", started_at=1767225600.0)
    t4.add(Step(kind="search", query=ex4.question, error="RetrievalError: index server timed out after 30 s"))
    t4.error = "RetrievalError: index server timed out after 30 s"
    t4.seconds = 30.0
    t4.meta["scores"] = _ext({"em": 0.0, "f1": 0.0, "acc": 0.0, "acc_either": 0.0, "recall@1": None, "recall@5": None})
    return [t1, t2, t3, t4]


METRICS = {
    "n": 4,
    "overall": {
        "em": 0.5,
        "f1": 0.52345,
        "acc": 0.5,
        "acc_either": 0.5,
        "em_ext": 0.75,
        "f1_ext": 0.77345,
        "acc_ext": 0.75,
        "acc_either_ext": 0.75,
        "recall@5": 1.0,
        "recall@10": 1.0,
        "llm_calls": 1.25,
        "prompt_tokens": 519.0,
        "completion_tokens": 12.0,
        "seconds": 8.175,
        "fallbacks": 1,
        "fallback_kinds": {"first_line": 1},
        "errors": 1,
    },
    "per_dataset": {
        "hotpotqa-dev": {
            "n": 2,
            "em": 0.5,
            "f1": 0.5,
            "acc": 0.5,
            "acc_either": 0.5,
            "em_ext": 0.5,
            "f1_ext": 0.5,
            "acc_ext": 0.5,
            "acc_either_ext": 0.5,
            "recall@5": 1.0,
            "recall@10": 1.0,
            "llm_calls": 1.0,
            "prompt_tokens": 612.0,
            "completion_tokens": 9.0,
            "seconds": 0.9,
            "fallbacks": 0,
            "fallback_kinds": {},
            "errors": 0,
        },
        "nq-dev": {
            "n": 2,
            "em": 0.5,
            "f1": 0.5469,
            "acc": 0.5,
            "acc_either": None,
            "em_ext": 1.0,
            "f1_ext": 1.0,
            "acc_ext": 1.0,
            "acc_either_ext": None,
            "recall@5": 1.0,
            "recall@10": None,
            "llm_calls": 1.5,
            "prompt_tokens": 426.0,
            "completion_tokens": 15.5,
            "seconds": 15.45,
            "fallbacks": 1,
            "fallback_kinds": {"first_line": 1},
            "errors": 1,
        },
    },
}

CONFIG = {
    "method": "naive_rag",
    "data": ["data/hotpotqa-dev.jsonl", "data/nq-dev.jsonl"],
    "llm": "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
    "retriever": "bm25:indexes/wiki",
    "limit": 2,
    "method_config": {"k": 5, "passage_style": "title_text"},
    "sleuth_version": "0.1.0",
    "started_at": "2026-01-01T00:00:00Z",
    "command": ["sleuth", "eval", "naive_rag", "--data", "hotpotqa-dev", "--data", "nq-dev", "--limit", "2"],
}


def write_run(run_dir: Path, traces: list[Trace], config: dict | None = None, metrics: dict | None = None) -> Path:
    """A run directory as ``sleuth eval`` writes it (``metrics=None`` leaves metrics.json out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config if config is not None else CONFIG))
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
    (run_dir / "traces.jsonl").write_text("".join(t.to_json() + "\n" for t in traces), encoding="utf-8")
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run-rag", make_traces(), metrics=METRICS)


def _table_rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| dataset"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------


def test_markdown_report_header_and_table(run_dir: Path) -> None:
    md = markdown_report(run_dir)
    assert md.startswith("# sleuth eval: naive_rag\n")
    assert "- **llm**: hf:HuggingFaceTB/SmolLM2-135M-Instruct" in md
    assert "- **retriever**: bm25:indexes/wiki" in md
    assert "- **date**: 2026-01-01T00:00:00Z" in md
    assert "`sleuth eval naive_rag --data hotpotqa-dev --data nq-dev --limit 2`" in md
    header = next(line for line in md.splitlines() if line.startswith("| dataset"))
    assert header == (
        "| dataset | n | EM | F1 | Acc | Acc(either) | EM ext | F1 ext | Acc ext | Acc(either) ext | R@5 | R@10 "
        "| LLM calls/q | tokens/q | latency s/q | wall s/q | fallbacks | errors |"
    )
    rows = _table_rows(md)
    assert rows["hotpotqa-dev"] == [
        "2",
        "50.0",
        "50.0",
        "50.0",
        "50.0",
        "50.0",
        "50.0",
        "50.0",
        "50.0",
        "100.0",
        "100.0",
        "1.00",
        "621",
        "0.90",
        "–",
        "0",
        "0",
    ]
    # None -> "–", one decimal (0.5469 -> 54.7), tokens = prompt + completion
    assert rows["nq-dev"] == [
        *["2", "50.0", "54.7", "50.0", "–"],
        *["100.0", "100.0", "100.0", "–"],
        *["100.0", "–", "1.50", "442", "15.45", "–", "1", "1"],
    ]
    assert rows["**overall**"] == [
        "4",
        "50.0",
        "52.3",
        "50.0",
        "50.0",
        "75.0",
        "77.3",
        "75.0",
        "75.0",
        "100.0",
        "100.0",
        "1.25",
        "531",
        "8.18",
        "–",
        "1",
        "1",
    ]
    assert list(rows)[-1] == "**overall**"
    assert "Fallbacks by kind: `first_line` 1." in md


def test_markdown_report_recall_columns_only_when_present(tmp_path: Path) -> None:
    metrics = json.loads(json.dumps(METRICS))
    for row in [metrics["overall"], *metrics["per_dataset"].values()]:
        row.pop("recall@5")
        row["recall@10"] = None
    run = write_run(tmp_path / "direct", make_traces(), {"method": "direct", "retriever": "open"}, metrics)
    md = markdown_report(run)
    assert "R@5" not in md and "R@10" not in md
    assert "- **retriever**: open" in md
    assert "date" not in md and "command" not in md
    assert _table_rows(md)["**overall**"][:3] == ["4", "50.0", "52.3"]


def test_markdown_report_without_metrics_json_recomputes(tmp_path: Path) -> None:
    run = write_run(tmp_path / "nometrics", make_traces(), metrics=None)
    rows = _table_rows(markdown_report(run))
    assert rows["hotpotqa-dev"][:3] == ["2", "50.0", "50.0"]
    # the failed trace is no result: out of n and the means, counted in errors
    assert rows["nq-dev"][0] == "1" and rows["nq-dev"][-2:] == ["1", "1"]
    assert rows["**overall**"][0] == "3"


def _legacy(metrics: dict) -> dict:
    """A metrics.json as sleuth wrote it before the headline split: no *_ext keys, em/f1/acc from the extended
    normaliser."""
    out = json.loads(json.dumps(metrics))
    for row in [out["overall"], *out["per_dataset"].values()]:
        for key in [k for k in row if k.endswith("_ext")]:
            row.pop(key)
    return out


def test_legacy_metrics_json_is_shown_as_extended(tmp_path: Path) -> None:
    legacy = _legacy(METRICS)
    assert is_legacy_metrics(legacy) and not is_legacy_metrics(METRICS)
    run = load_run(write_run(tmp_path / "old", make_traces(), metrics=legacy))
    assert run.legacy and run.metrics["overall"]["em_ext"] == 0.5 and "em" not in run.metrics["overall"]
    assert run.metrics["per_dataset"]["nq-dev"]["f1_ext"] == 0.5469 and run.metrics["overall"]["recall@5"] == 1.0
    md = markdown_report(run.path)
    assert "predates the split of the headline metrics" in md
    # headline EM/F1/Acc/Acc(either) unknown ("–"), the old numbers under the ext columns
    assert _table_rows(md)["**overall**"][:9] == ["4", "–", "–", "–", "–", "50.0", "52.3", "50.0", "50.0"]
    assert "predates" not in markdown_report(write_run(tmp_path / "new", make_traces(), metrics=METRICS))
    assert upgrade_metrics(METRICS) is METRICS  # a current file is read as it is


def test_compare_runs_names_legacy_runs(run_dir: Path, tmp_path: Path) -> None:
    old = write_run(tmp_path / "old", make_traces(), {**CONFIG, "method": "old_rag"}, _legacy(METRICS))
    md = compare_runs([run_dir, old])
    overall = _table_rows(md)["**overall**"]
    assert overall[6:10] == ["–", "–", "–", "50.0"]  # old_rag: EM F1 Acc unknown, EM ext = the old EM
    assert "predates the headline split (old_rag)" in md


def test_legacy_trace_scores_are_read_as_extended(tmp_path: Path) -> None:
    assert upgrade_scores({"em": 1.0, "recall@5": 0.5}) == {"em_ext": 1.0, "recall@5": 0.5}
    assert upgrade_scores({"em": 1.0, "em_ext": 1.0}) == {"em": 1.0, "em_ext": 1.0}
    assert upgrade_scores({"judge": 1.0}) == {"judge": 1.0} and not is_legacy_scores({"recall@5": 1.0})
    traces = make_traces()
    for trace in traces:
        trace.meta["scores"] = {k: v for k, v in trace.meta["scores"].items() if not k.endswith("_ext")}
    page = html_report(write_run(tmp_path / "old", traces, metrics=None)).read_text(encoding="utf-8")
    assert 'data-status="correct"' in page and "EM ext 1" in page  # judged by the extended EM it was scored with


def test_committed_results_are_readable(tmp_path: Path) -> None:
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    runs = sorted(p.parent for p in results.glob("*/metrics.json"))
    if not runs:
        pytest.skip("no committed eval runs")
    for run_dir in runs:
        raw = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
        run = load_run(run_dir)
        md = markdown_report(run_dir)
        if run.legacy:  # written with the extended normaliser: the old EM is the EM ext column, the headline "–"
            assert run.metrics["overall"].get("em_ext") == raw["overall"].get("em")
            assert "em" not in run.metrics["overall"]
            assert "predates the split" in md
        else:
            assert run.metrics == raw


def test_aggregate_counts_and_means() -> None:
    summary = aggregate(make_traces())
    assert summary["n"] == 3  # the failed trace is no result: counted in errors, not in n or the means
    overall = summary["overall"]
    assert overall["em"] == pytest.approx(2 / 3) and overall["recall@1"] == pytest.approx(2.5 / 3)
    assert overall["llm_calls"] == pytest.approx((1 + 1 + 2) / 3)
    assert overall["fallback_kinds"] == {"first_line": 1} and overall["errors"] == 1
    assert set(summary["per_dataset"]) == {"hotpotqa-dev", "nq-dev"}


# ---------------------------------------------------------------------------------------------------------------
# Comparison and chart
# ---------------------------------------------------------------------------------------------------------------


def _direct_run(tmp_path: Path) -> Path:
    metrics = {
        "n": 3,
        "overall": {"em": 0.25, "f1": 0.3, "acc": 0.75, "em_ext": 0.5, "llm_calls": 1.0},
        "per_dataset": {
            "hotpotqa-dev": {"n": 2, "em": 0.0, "f1": 0.2, "acc": 1.0, "em_ext": 0.5, "llm_calls": 1.0},
            "2wiki-dev": {"n": 1, "em": 1.0, "f1": 1.0, "acc": 1.0, "em_ext": 1.0, "llm_calls": 1.0},
        },
    }
    config = {"method": "direct", "llm": CONFIG["llm"], "retriever": "open"}
    return write_run(tmp_path / "run-direct", make_traces()[:1], config, metrics)


def test_compare_runs_side_by_side(run_dir: Path, tmp_path: Path) -> None:
    md = compare_runs([run_dir, _direct_run(tmp_path)])
    header = next(line for line in md.splitlines() if line.startswith("| dataset"))
    assert header == (
        "| dataset | naive_rag n | naive_rag EM | naive_rag F1 | naive_rag Acc | naive_rag EM ext | naive_rag calls/q "
        "| direct n | direct EM | direct F1 | direct Acc | direct EM ext | direct calls/q |"
    )
    rows = _table_rows(md)
    assert list(rows) == ["hotpotqa-dev", "nq-dev", "2wiki-dev", "**overall**"]
    assert rows["hotpotqa-dev"] == [
        *["2", "**50.0**", "**50.0**", "50.0", "**50.0**", "1.00"],
        *["2", "0.0", "20.0", "**100.0**", "**50.0**", "1.00"],
    ]
    assert rows["nq-dev"][6:] == ["–"] * 6  # dataset absent from the direct run
    assert rows["**overall**"][:3] == ["4", "**50.0**", "**52.3**"]
    assert "- **naive_rag**:" in md and "retriever open" in md


def test_compare_runs_labels_runs_apart(run_dir: Path, tmp_path: Path) -> None:
    other = write_run(tmp_path / "run-rag-qwen", make_traces(), {**CONFIG, "llm": "openai:qwen2.5-7b"}, METRICS)
    md = compare_runs([run_dir, other])
    assert "naive_rag (openai:qwen2.5-7b) EM" in md and "naive_rag (hf:HuggingFaceTB/SmolLM2-135M-Instruct) EM" in md
    # same n everywhere: one n column
    assert next(line for line in md.splitlines() if line.startswith("| dataset")).startswith("| dataset | n | ")
    same = compare_runs([run_dir, write_run(tmp_path / "again", make_traces(), CONFIG, METRICS)])
    assert "naive_rag [run-rag] EM" in same and "naive_rag [again] EM" in same


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bar_chart_writes_png(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = bar_chart([run_dir, _direct_run(tmp_path)], tmp_path / "charts" / "em.png")
    assert out == tmp_path / "charts" / "em.png"
    width, height = _png_size(out)
    assert width >= 640 and height >= 400
    assert out.stat().st_size > 10_000
    calls = bar_chart([run_dir], tmp_path / "calls.png", metric="llm_calls")
    assert _png_size(calls)[0] >= 640


# ---------------------------------------------------------------------------------------------------------------
# HTML trace browser
# ---------------------------------------------------------------------------------------------------------------


def _bodies(page: str) -> list[str]:
    m = re.search(r'<script type="application/json" id="trace-bodies">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_html_report_is_one_self_contained_file(run_dir: Path, tmp_path: Path) -> None:
    out = html_report(run_dir, tmp_path / "out" / "browse.html")
    assert out == tmp_path / "out" / "browse.html"
    assert sorted(p.name for p in out.parent.iterdir()) == ["browse.html"]
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<link\b|@import|url\(|<script[^>]*\bsrc=|<img\b", page)
    assert "<style>" in page and "<script>" in page
    for trace in make_traces():
        assert html.escape(trace.example.question) in page
    assert len(_bodies(page)) == 4
    # default output path is RUN/report.html; summary table from metrics.json at the top
    default = html_report(run_dir)
    assert default == run_dir / "report.html"
    summary = default.read_text(encoding="utf-8").split('<div class="filters">')[0]
    assert '<table class="summary">' in summary and "<td>54.7</td>" in summary and "<td>–</td>" in summary


def test_html_report_escapes_passages(run_dir: Path) -> None:
    page = html_report(run_dir).read_text(encoding="utf-8")
    assert "<img src=x onerror" not in page
    assert "<answer>" not in page
    # exactly two script elements: the JSON data and the renderer; the passage cannot close either
    assert page.count("</script>") == 2 and page.count("<script") == 2
    bodies = _bodies(page)
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in bodies[1]
    assert "&lt;answer&gt;Tokyo&lt;/answer&gt;" in bodies[1]
    assert "&lt;!-- &lt;script&gt;x()&lt;/script&gt;" in bodies[1]
    # inside the JSON block no "</" or "<!" can end the script or open a comment
    data = page.split('id="trace-bodies">')[1].split("</script>")[0]
    assert "</" not in data and "<!" not in data
    assert "<img" not in bodies[1]


def test_html_report_escapes_questions_and_answers(tmp_path: Path) -> None:
    trace = make_traces()[0]
    trace.example.question = 'Is <b>bold</b> & "quoted" fine?'
    trace.answer = "<i>Paris</i>"
    page = html_report(write_run(tmp_path / "esc", [trace], metrics=METRICS)).read_text(encoding="utf-8")
    assert "Is &lt;b&gt;bold&lt;/b&gt; &amp; &quot;quoted&quot; fine?" in page
    assert "<b>bold</b>" not in page and "<i>Paris</i>" not in page


def test_html_report_filters_and_badges(run_dir: Path) -> None:
    page = html_report(run_dir).read_text(encoding="utf-8")
    for f, n in (("all", 4), ("correct", 2), ("wrong", 2), ("fallback", 1), ("error", 1)):
        assert f'<button data-f="{f}"' in page and f">{f} ({n})</button>" in page
    assert '<select id="ds"' in page and '<option value="nq-dev">nq-dev (2)</option>' in page
    assert '<input id="q" type="search"' in page
    cards = re.findall(
        r'<details class="card (\w+)" id="t(\d)" data-i="\d" data-status="\w+" data-fb="(\d)" '
        r'data-err="(\d)" data-ds="([\w-]+)">',
        page,
    )
    assert cards == [
        ("correct", "0", "0", "0", "hotpotqa-dev"),
        ("wrong", "1", "0", "0", "hotpotqa-dev"),
        ("correct", "2", "1", "0", "nq-dev"),
        ("wrong", "3", "0", "1", "nq-dev"),
    ]


def test_html_report_links_citations_to_passages(run_dir: Path) -> None:
    bodies = _bodies(html_report(run_dir).read_text(encoding="utf-8"))
    third = bodies[2]
    # every rendered passage has an anchor; cited ids link to it (gold ones marked), unknown ids are not links
    for pid in ("nq-31", "nq-32", "nq-33"):
        assert f'id="{passage_anchor(2, pid)}"' in third
    assert '<a class="cite gold" href="#t2-pnq-2d-31">nq-31</a>' in third
    assert '<a class="cite" href="#t2-pnq-2d-33">nq-33</a>' in third
    assert 'href="#t2-pnq-2d-99"' not in third and ">nq-99</span>" in third
    # gold supporting passages highlighted where they appear, not the others
    assert '<div class="passage gold" id="t2-pnq-2d-31">' in third
    assert '<div class="passage" id="t2-pnq-2d-32">' in third
    assert bodies[0].count('class="passage gold"') == 2
    # ids are per trace: trace 0's passages never use trace 2's prefix
    assert "t2-p" not in bodies[0] and 'id="t0-php-2d-101"' in bodies[0]


def test_html_report_shows_step_details(run_dir: Path) -> None:
    bodies = _bodies(html_report(run_dir).read_text(encoding="utf-8"))
    third, fourth = bodies[2], bodies[3]
    assert third.index('class="kind">search') < third.index('class="kind">select') < third.index('class="kind">answer')
    assert "Pick the useful passages." in third  # the prompt's messages
    assert "He wrote it around 1600 [nq-31]." in third  # the raw output
    assert "fallback: first_line" in third
    assert "240+22 tok" in third and "0.40 s" in third
    assert "RetrievalError: index server timed out after 30 s" in fourth
    assert "(no answer)" in fourth


def test_passage_anchor_is_a_safe_unique_fragment() -> None:
    assert passage_anchor(0, "12") == "t0-p12"
    ids = ["a b", "a-b", "a_b", 'x"><script>', "a-20-b", "Zürich#1"]
    anchors = [passage_anchor(3, i) for i in ids]
    assert len(set(anchors)) == len(ids)
    assert all(re.fullmatch(r"t3-p[A-Za-z0-9_.-]+", a) for a in anchors)


def test_step_citations_reads_parsed_and_meta() -> None:
    step = Step(
        kind="select", parsed={"relevance": {"7": True, "9": False}, "selected": [3, "7"]}, meta={"cites": "12"}
    )
    assert step_citations(step) == ["7", "9", "3", "12"]
    assert step_citations(Step(kind="answer", parsed="Paris", meta={"finish_reason": "stop"})) == []
    assert step_citations(Step(kind="x", parsed={"selected": [{"id": "p1"}, True, None]})) == ["p1"]


def test_render_trace_body_duplicate_passages_get_one_anchor() -> None:
    ex = Example("q", "Q?", ["A"], supporting_ids=["d1"])
    trace = Trace(ex, "iter")
    for _ in range(2):
        trace.add(Step(kind="search", query="q", passages=[Passage("d1", "T", "text")]))
    body = render_trace_body(trace, 5)
    assert body.count('id="t5-pd1"') == 1 and body.count('class="passage gold"') == 2


def test_html_report_many_traces(tmp_path: Path) -> None:
    traces = [t for _ in range(250) for t in make_traces()]
    page = html_report(write_run(tmp_path / "big", traces, metrics=METRICS)).read_text(encoding="utf-8")
    assert page.count('<details class="card ') == 1000
    assert len(_bodies(page)) == 1000
    assert '<div class="body"></div>' in page  # bodies are inserted on expand, not in the initial DOM


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")), reason="needs chromium")
def test_html_report_renders_in_a_browser(run_dir: Path) -> None:
    """Headless Chromium runs the page's script: the card named in the URL fragment is filled and the hostile
    passage is text, not an element. (Optional: chromium is not a dependency of sleuth.)"""
    out = html_report(run_dir)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-sync",
                "--disable-background-networking",
                "--disable-component-update",
                f"--user-data-dir={profile}",
                "--dump-dom",
                f"{out.as_uri()}#t1-php-2d-202",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    assert 'id="t1-php-2d-202"' in dom  # body of trace 1 inserted by the script
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom
    assert "<img" not in dom
    assert "showing 4 of 4" in dom
