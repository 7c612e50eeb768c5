"""`sleuth eval`: scoring, aggregation, open mode, and resume after SIGKILL without lost or duplicated examples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sleuth.eval.evaluate import EvalConfig, EvalError, aggregate, evaluate, read_traces, rescore_legacy
from sleuth.records import Example, Step, Trace

FIXTURES = Path(__file__).parent / "fixtures" / "datasets"


def write_dataset(path: Path, n: int) -> Path:
    """A FlashRAG-format file with n questions, each with two given paragraphs (one supporting)."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "id": f"q{i}",
                "question": f"What colour is the gadget item{i}?",
                "golden_answers": [f"colour{i % 3}"],
                "metadata": {
                    "supporting_facts": {"title": [f"Object {i}"], "sent_id": [0]},
                    "context": {
                        "title": [f"Object {i}", f"Other {i}"],
                        "sentences": [[f"The gadget item{i} is colour{i % 3}."], [f"Other thing {i} is large."]],
                    },
                },
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_torn_last_line_is_repaired(tmp_path: Path) -> None:
    trace = Trace(example=Example(id="a", question="q"), method="direct", answer="x")
    path = tmp_path / "traces.jsonl"
    path.write_text(trace.to_json() + "\n" + trace.to_json()[:25])
    assert len(read_traces(path)) == 1 and path.read_text().count("\n") == 1 and not path.read_text().endswith("\n")
    assert len(read_traces(path, repair=True)) == 1 and path.read_text().endswith("\n")


def test_aggregate_means_costs_and_fallbacks() -> None:
    def trace(dataset: str, em: float | None, fallback: str | None = None, error: str | None = None) -> Trace:
        t = Trace(example=Example(id="x", question="q", metadata={"dataset": dataset}), method="m", error=error)
        t.add(Step(kind="answer", messages=[], prompt_tokens=10, completion_tokens=2, fallback=fallback))
        t.meta["scores"] = {"em": em}
        t.seconds = 2.0
        return t

    metrics = aggregate([trace("a", 1.0), trace("a", 0.0, "first_line"), trace("b", 1.0, error="boom")])
    assert metrics["n"] == 2 and metrics["overall"]["em"] == 0.5  # a failed attempt is no result: not in n or means
    assert metrics["per_dataset"]["a"]["n"] == 2 and metrics["per_dataset"]["b"]["n"] == 0
    assert "em" not in metrics["per_dataset"]["b"] and metrics["per_dataset"]["b"]["errors"] == 1
    assert metrics["overall"]["fallbacks"] == 1 and metrics["overall"]["fallback_kinds"] == {"first_line": 1}
    assert metrics["overall"]["errors"] == 1 and metrics["overall"]["llm_calls"] == 1.0
    assert metrics["overall"]["prompt_tokens"] == 10 and metrics["overall"]["seconds"] == 2.0


def test_wall_seconds_is_the_union_of_busy_intervals_so_a_resume_gap_is_not_counted() -> None:
    def trace(started_at: float, seconds: float) -> Trace:
        t = Trace(example=Example(id="x", question="q"), method="m")
        t.started_at, t.seconds = started_at, seconds
        return t

    # two overlapping examples (100-110, 105-120), a kill, then a restart an hour later (3700-3710) -> 20 + 10 s
    group = [trace(3700.0, 10.0), trace(100.0, 10.0), trace(105.0, 15.0), trace(101.0, 2.0)]
    assert aggregate(group)["overall"]["wall_seconds"] == pytest.approx(30.0 / 4)
    assert aggregate([])["overall"]["wall_seconds"] == 0.0


def test_open_mode_naive_rag_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 12)
    config = EvalConfig(
        method="naive_rag",
        data=[str(data)],
        out=str(tmp_path / "run"),
        llm=f"hf:{tiny_model_dir}",
        open=True,
        k=2,
        max_new_tokens=6,
    )
    metrics = evaluate(config, progress=False)
    traces = read_traces(tmp_path / "run" / "traces.jsonl")
    assert metrics["n"] == 12 == len(traces) and set(metrics["per_dataset"]) == {"toy/dev"}
    overall = metrics["overall"]
    assert overall["recall@1"] == 1.0, "BM25 over the pooled paragraphs finds each question's own paragraph first"
    assert 0.0 <= overall["em"] <= 1.0 and overall["llm_calls"] == 1.0 and overall["errors"] == 0
    first = traces[0]
    assert first.steps[0].passages[0].id in first.example.supporting_ids
    assert set(first.meta["scores"]) >= {"em", "f1", "acc", "recall@1", "recall@5"}
    for name in ("config.json", "metrics.json", "report.md"):
        assert (tmp_path / "run" / name).exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["open"] is True
    with pytest.raises(EvalError, match="different"):
        evaluate(EvalConfig(method="direct", data=[str(data)], out=str(tmp_path / "run")), progress=False)


def _eval_command(data: Path, out: Path, model: Path) -> list[str]:
    sleuth = Path(sys.executable).with_name("sleuth")
    return [
        str(sleuth),
        "eval",
        "--method",
        "direct",
        "--data",
        str(data),
        "--out",
        str(out),
        "--llm",
        f"hf:{model}",
        "--max-new-tokens",
        "12",
        "--concurrency",
        "1",
    ]


def test_sigkill_then_resume_gives_each_example_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 60)
    reference = tmp_path / "reference"
    subprocess.run(_eval_command(data, reference, tiny_model_dir), check=True, capture_output=True, timeout=600)

    run = tmp_path / "killed"
    traces = run / "traces.jsonl"
    process = subprocess.Popen(
        _eval_command(data, run, tiny_model_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (traces.exists() and traces.read_bytes().count(b"\n") >= 5):
        assert process.poll() is None, "the run finished before it could be killed; make it longer"
        assert time.time() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    written = traces.read_bytes().count(b"\n")
    assert 5 <= written < 60

    subprocess.run(_eval_command(data, run, tiny_model_dir), check=True, capture_output=True, timeout=600)
    ids = [t.example.id for t in read_traces(traces)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(60)) and len(ids) == len(set(ids))
    resumed = json.loads((run / "metrics.json").read_text())
    expected = json.loads((reference / "metrics.json").read_text())
    for key in ("n", "em", "f1", "acc", "llm_calls", "prompt_tokens", "completion_tokens", "errors"):
        got = resumed["overall"].get(key, resumed.get(key))
        want = expected["overall"].get(key, expected.get(key))
        assert got == pytest.approx(want), key
    by_id = {t.example.id: t.answer for t in read_traces(reference / "traces.jsonl")}
    assert {t.example.id: t.answer for t in read_traces(traces)} == by_id


def test_llm_judge_scores_are_added_and_cached(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 5)
    config = EvalConfig(
        method="direct",
        data=[str(data)],
        out=str(tmp_path / "run"),
        llm=f"hf:{tiny_model_dir}",
        max_new_tokens=4,
        judge="same",
    )
    metrics = evaluate(config, progress=False)
    traces = read_traces(tmp_path / "run" / "traces.jsonl")
    assert all(t.meta["scores"]["judge"] in (0.0, 1.0) for t in traces) and "judge" in metrics["overall"]
    cache = tmp_path / "run" / "judge-cache.jsonl"
    asked = cache.read_text().count("\n")
    assert 0 < asked <= 5
    for t in traces:  # forget the verdicts in the traces: the cache must answer, with no new judge call
        del t.meta["scores"]["judge"]
    (tmp_path / "run" / "traces.jsonl").write_text("".join(t.to_json() + "\n" for t in traces))
    evaluate(config, progress=False)
    assert cache.read_text().count("\n") == asked
    assert all("judge" in t.meta["scores"] for t in read_traces(tmp_path / "run" / "traces.jsonl"))


def test_fixture_loads_through_eval(tmp_path: Path, tiny_model_dir: Path) -> None:
    metrics = evaluate(
        EvalConfig(
            method="direct",
            data=[str(FIXTURES / "flashrag_hotpotqa.jsonl")],
            out=str(tmp_path / "r"),
            llm=f"hf:{tiny_model_dir}",
            max_new_tokens=4,
        ),
        progress=False,
    )
    assert metrics["n"] == 2 and "recall@1" not in metrics["overall"]  # direct does not search


def test_method_options_and_generator_role_reach_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 2)
    base = {"method": "naive_rag", "data": [str(data)], "llm": f"hf:{tiny_model_dir}", "open": True}
    config = EvalConfig(
        **base,
        out=str(tmp_path / "run"),
        generator=f"hf:{tiny_model_dir}",
        method_config={"k": "1", "sampling.max_new_tokens": "3"},
    )
    evaluate(config, progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["method_config"]["k"] == 1 and saved["method_config"]["sampling"]["max_new_tokens"] == 3
    assert saved["generator"] == f"hf:{tiny_model_dir}"
    traces = read_traces(tmp_path / "run" / "traces.jsonl")
    assert all(len(t.steps[0].passages) == 1 and t.steps[1].completion_tokens <= 3 for t in traces)
    with pytest.raises(EvalError, match="unknown option 'kk'"):
        evaluate(EvalConfig(**base, out=str(tmp_path / "bad"), method_config={"kk": "1"}), progress=False)


def test_traces_scored_before_the_squad_split_are_rescored() -> None:
    """An old trace's `em` is the extended normaliser's ("two" matched gold "2"); aggregated beside new traces it
    would mix two meanings, so it is scored again: SQuAD em 0, extended 1, and its judge verdict kept."""
    old = Trace(example=Example(id="a", question="q", answers=["2"]), method="direct", answer="two")
    old.meta["scores"] = {"em": 1.0, "f1": 1.0, "judge": 1.0}
    rescore_legacy(old)
    scores = old.meta["scores"]
    assert (scores["em"], scores["em_ext"], scores["judge"]) == (0.0, 1.0, 1.0)
    new = Trace(example=Example(id="b", question="q", answers=["2"]), method="direct", answer="2")
    new.meta["scores"] = {"em": 1.0, "em_ext": 1.0}
    assert rescore_legacy(new).meta["scores"] == {"em": 1.0, "em_ext": 1.0}  # untouched
    assert aggregate([old, new])["overall"]["em"] == 0.5
