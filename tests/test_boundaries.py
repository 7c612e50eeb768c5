"""Text that crosses into sleuth (model replies, passages, dataset rows) can never stop a run.

A lone surrogate (``"\\ud800"``: a JSON escape the OpenAI client decodes as it is) used to raise UnicodeEncodeError
in the trace writer, escape the runner and crash every resume at the same example.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import sleuth.eval.evaluate as evaluate_module
from sleuth.agents import Context
from sleuth.eval.evaluate import EvalConfig, evaluate, read_traces, trace_line
from sleuth.llm.base import _BACKENDS, register_backend
from sleuth.records import Example, Passage, Trace, encodable, encodable_json
from sleuth.runner import run
from tests.scripted import ScriptedLLM

LONE = "ANS-7 \ud800"


def _reply(prompt: str) -> str:
    return LONE if "item1" in prompt or "item3" in prompt else "colour0"


@pytest.fixture
def scripted_backend() -> Iterator[str]:
    """An LLM spec that `sleuth eval` loads as a ScriptedLLM replying with a lone surrogate to two questions."""
    register_backend("scripted-surrogate")(lambda target, options: ScriptedLLM(_reply))
    yield "scripted-surrogate:x"
    _BACKENDS.pop("scripted-surrogate", None)


def _dataset(path: Path, n: int) -> Path:
    rows = [{"id": f"q{i}", "question": f"What colour is item{i}?", "golden_answers": ["colour0"]} for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ the helper


def test_encodable_replaces_lone_surrogates_and_keeps_everything_else() -> None:
    assert encodable(LONE) == "ANS-7 \ufffd"
    assert encodable("\udc80x") == "\ufffdx" and encodable("x\ud800") == "x\ufffd"
    assert encodable("\ud83d\ude00") == "\U0001f600"  # a pair is one character, not two replacements
    text = "café \U0001f600 東京"
    assert encodable(text) is text
    assert encodable_json({"a\ud800": [LONE, 1, None], "b": {"c": LONE}}) == {
        "a\ufffd": ["ANS-7 \ufffd", 1, None],
        "b": {"c": "ANS-7 \ufffd"},
    }


def test_trace_json_always_encodes_and_round_trips() -> None:
    trace = Trace(example=Example(id="a", question="q \ud800"), method="direct", answer=LONE)
    trace.meta["odd"] = {1, 2}  # not JSON: written as its repr rather than raising
    line = trace.to_json()
    line.encode("utf-8")
    back = Trace.from_json(line)
    assert back.answer == "ANS-7 \ufffd" and back.example.question == "q \ufffd" and back.meta["odd"] == "{1, 2}"


def test_a_trace_that_cannot_be_serialised_is_written_as_an_error() -> None:
    trace = Trace(example=Example(id="a", question="q"), method="direct", answer="x")
    cycle: list[object] = []
    cycle.append(cycle)
    trace.meta["cycle"] = cycle
    trace.meta["scores"] = {"em": 0.0}
    back = Trace.from_json(trace_line(trace))
    assert back.answer == "x" and "not serialisable" in (back.error or "") and back.meta["scores"] == {"em": 0.0}


# ------------------------------------------------------------------------------------------------ eval


def test_eval_with_a_lone_surrogate_reply_completes_and_resumes(tmp_path: Path, scripted_backend: str) -> None:
    data = _dataset(tmp_path / "toy" / "dev.jsonl", 6)
    config = EvalConfig(method="direct", data=[str(data)], out=str(tmp_path / "run"), llm=scripted_backend)
    metrics = evaluate(config, progress=False)
    assert metrics["n"] == 6 and metrics["overall"]["errors"] == 0
    raw = (tmp_path / "run" / "traces.jsonl").read_bytes()
    lines = raw.decode("utf-8").splitlines()  # strict: valid UTF-8
    answers = {json.loads(line)["example"]["id"]: json.loads(line)["answer"] for line in lines}
    assert len(lines) == 6 and answers["q1"] == answers["q3"] == "ANS-7 \ufffd" and answers["q0"] == "colour0"

    again = evaluate(config, progress=False)  # resume: nothing left to run, nothing crashes
    assert again["n"] == 6 and (tmp_path / "run" / "traces.jsonl").read_bytes() == raw


def test_eval_records_a_failing_score_in_the_example_and_a_failing_write_is_rerun(
    tmp_path: Path, scripted_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _dataset(tmp_path / "toy" / "dev.jsonl", 4)
    config = EvalConfig(method="direct", data=[str(data)], out=str(tmp_path / "run"), llm=scripted_backend)
    real_score, real_line = evaluate_module.score_trace, evaluate_module.trace_line

    def score(trace: Trace) -> dict[str, float | None]:
        if trace.example.id == "q2":
            raise ZeroDivisionError("bad gold")
        return real_score(trace)

    def line(trace: Trace) -> str:
        if trace.example.id == "q0":
            raise OSError(28, "No space left on device")
        return real_line(trace)

    monkeypatch.setattr(evaluate_module, "score_trace", score)
    monkeypatch.setattr(evaluate_module, "trace_line", line)
    metrics = evaluate(config, progress=False)
    traces = {t.example.id: t for t in read_traces(tmp_path / "run" / "traces.jsonl")}
    assert set(traces) == {"q1", "q2", "q3"} and metrics["overall"]["errors"] == 1
    assert "scoring failed: ZeroDivisionError" in (traces["q2"].error or "")

    monkeypatch.setattr(evaluate_module, "trace_line", real_line)
    metrics = evaluate(config, progress=False)  # the resume runs q0, whose line was never written
    ids = [t.example.id for t in read_traces(tmp_path / "run" / "traces.jsonl")]
    assert sorted(ids) == ["q0", "q1", "q2", "q3"] and metrics["n"] == 4


def test_a_corrupt_trace_line_is_skipped_and_its_example_runs_again(tmp_path: Path, scripted_backend: str) -> None:
    data = _dataset(tmp_path / "toy" / "dev.jsonl", 3)
    config = EvalConfig(method="direct", data=[str(data)], out=str(tmp_path / "run"), llm=scripted_backend)
    evaluate(config, progress=False)
    path = tmp_path / "run" / "traces.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_bytes(lines[0][:40].encode() + b"\xff" + "".join(lines[1:]).encode())  # a torn line mid-file
    metrics = evaluate(config, progress=False)
    assert metrics["n"] == 3 and sorted(t.example.id for t in read_traces(path)) == ["q0", "q1", "q2"]


# ------------------------------------------------------------------------------------------------ runner


def test_an_on_trace_failure_is_an_error_of_that_example_only() -> None:
    examples = [Example(id=f"q{i}", question=f"question {i}") for i in range(5)]
    written: list[str] = []

    def on_trace(trace: Trace) -> None:
        if trace.example.id == "q2":
            raise UnicodeEncodeError("utf-8", LONE, 6, 7, "surrogates not allowed")
        written.append(trace.example.id)

    ctx = Context(llm=ScriptedLLM(lambda _: "colour0"))
    traces = run("direct", examples, ctx, on_trace=on_trace, progress=False)
    assert [t.example.id for t in traces] == [e.id for e in examples]
    assert sorted(written) == ["q0", "q1", "q3", "q4"]
    assert [bool(t.error) for t in traces] == [False, False, True, False, False]
    assert traces[2].error.startswith("on_trace failed: UnicodeEncodeError") and traces[2].answer == "colour0"


def test_passage_with_surrogate_is_made_encodable_by_the_corpus_reader(tmp_path: Path) -> None:
    from sleuth.corpus import read_corpus

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "1", "title": "T\ud800", "text": "x \udfff y"}) + "\n")  # ASCII \u escapes
    (passage,) = list(read_corpus(path))
    assert passage == Passage("1", "T\ufffd", "x \ufffd y")
