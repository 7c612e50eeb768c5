"""Text that crosses into sleuth (model replies, passages, dataset rows) can never stop a run.

A lone surrogate (``"\\ud800"``: a JSON escape the OpenAI client decodes as it is) used to raise UnicodeEncodeError
in the trace writer, escape the runner and crash every resume at the same example.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import sleuth.eval.evaluate as evaluate_module
from sleuth.agents import Context
from sleuth.corpus import CorpusError, CorpusReader, detect_format, read_corpus
from sleuth.data import DatasetError, load_examples
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
    # a failed scoring is a failed attempt (errors.jsonl, retried on resume), never a result
    assert set(traces) == {"q1", "q3"} and metrics["n"] == 2
    errors = {t.example.id: t for t in read_traces(tmp_path / "run" / "errors.jsonl")}
    assert "scoring failed: ZeroDivisionError" in (errors["q2"].error or "")

    monkeypatch.setattr(evaluate_module, "trace_line", real_line)
    monkeypatch.setattr(evaluate_module, "score_trace", real_score)
    metrics = evaluate(config, progress=False)  # the resume runs q0 (its line was never written) and q2 again
    ids = [t.example.id for t in read_traces(tmp_path / "run" / "traces.jsonl")]
    assert sorted(ids) == ["q0", "q1", "q2", "q3"] and metrics["n"] == 4 and metrics["overall"]["errors"] == 0


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
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "1", "title": "T\ud800", "text": "x \udfff y"}) + "\n")  # ASCII \u escapes
    (passage,) = list(read_corpus(path))
    assert passage == Passage("1", "T\ufffd", "x \ufffd y")


# ------------------------------------------------------------------------------------------------ files


def _gz(path: Path, data: bytes, keep: int | None = None) -> Path:
    """``data`` gzip-compressed into ``path``, cut to its first ``keep`` bytes when given."""
    packed = gzip.compress(data)
    path.write_bytes(packed if keep is None else packed[:keep])
    return path


def _lines(n: int, width: int = 0) -> bytes:
    return b"".join(
        json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i} ' + "w" * width}).encode() + b"\n" for i in range(n)
    )


def test_corpus_random_bytes_named_gz_is_a_file_line_error(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CorpusError, match=r"c\.jsonl\.gz:1: cannot read, the \.gz file is damaged \(BadGzipFile"):
        detect_format(path)
    with pytest.raises(CorpusError, match=r"c\.jsonl\.gz:1: cannot read"):
        list(read_corpus(path, format="searchr1"))


def test_corpus_gz_cut_inside_its_first_line_is_a_file_line_error(tmp_path: Path) -> None:
    path = _gz(tmp_path / "c.jsonl.gz", _lines(1, width=5000), keep=60)
    with pytest.raises(CorpusError, match=r"c\.jsonl\.gz:1: cannot read, the \.gz file is damaged \(EOFError"):
        detect_format(path)
    with pytest.raises(CorpusError, match=r"c\.jsonl\.gz:1: cannot read"):
        list(read_corpus(path, format="searchr1"))


def test_corpus_gz_cut_later_names_the_line_it_broke_at(tmp_path: Path) -> None:
    data = _lines(400, width=200)
    path = _gz(tmp_path / "c.jsonl.gz", data, keep=len(gzip.compress(data)) - 20)
    reader = CorpusReader(path)
    seen: list[str] = []
    with pytest.raises(CorpusError, match=r"c\.jsonl\.gz:(\d+): cannot read") as info:
        seen.extend(p.id for p in reader)
    line = int(re.search(r":(\d+): cannot", str(info.value)).group(1))  # type: ignore[union-attr]
    assert line == len(seen) + 1 and 0 < len(seen) < 400
    json_gz = _gz(tmp_path / "w.json.gz", b'{"Paris": {"extract": "x"}}' * 50, keep=30)
    with pytest.raises(CorpusError, match=r"w\.json\.gz: cannot read"):
        detect_format(json_gz)


def test_corpus_line_nested_too_deeply_is_a_malformed_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"[" * 100_000 + b"\n" + _lines(2))
    assert detect_format(path) == "searchr1"
    reader = CorpusReader(path)
    assert [p.id for p in reader] == ["0", "1"] and reader.errors == [f"{path}:1: invalid JSON (nested too deeply)"]


def test_dataset_in_latin1_is_a_file_line_error(tmp_path: Path) -> None:
    good = {"id": "a", "question": "Who?", "golden_answers": ["x"]}
    bad = {"id": "b", "question": "Qui est Frédéric ?", "golden_answers": ["y"]}
    lines = [json.dumps(good, ensure_ascii=False)] * 3000 + [json.dumps(bad, ensure_ascii=False)]
    path = tmp_path / "fr.jsonl"
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    with pytest.raises(DatasetError, match=r"fr\.jsonl:3001: not UTF-8 text \(byte 0xe9 at column \d+\)") as info:
        load_examples(path)
    assert info.value.row == 3001
    array = tmp_path / "fr.json"
    array.write_bytes(json.dumps([good, bad], ensure_ascii=False, indent=1).encode("latin-1"))
    line = next(i for i, text in enumerate(array.read_bytes().split(b"\n"), 1) if b"\xe9" in text)
    with pytest.raises(DatasetError, match=rf"fr\.json:{line}: not UTF-8 text"):
        load_examples(array)
    table = tmp_path / "fr.csv"
    table.write_bytes("Question,Answer\nWho?,x\nQui est Frédéric ?,y\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"fr\.csv:3: not UTF-8 text"):
        load_examples(table, format="bamboogle")


def test_dataset_broken_gz_is_a_file_line_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(DatasetError, match=r"d\.jsonl\.gz:1: cannot read, the \.gz file is damaged"):
        load_examples(path)
    row = json.dumps({"id": "a", "question": "Who?", "golden_answers": ["x"] * 300}).encode() + b"\n"
    _gz(path, row * 50, keep=len(gzip.compress(row * 50)) // 2)
    with pytest.raises(DatasetError, match=r"d\.jsonl\.gz:\d+: cannot read, the \.gz file is damaged"):
        load_examples(path, format="flashrag")


def test_dataset_row_with_a_surrogate_escape_loads_encodable(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    row = {"id": "a", "question": "Who is \ud800?", "golden_answers": ["x\udfff"]}
    path.write_text(json.dumps(row) + "\n")  # ASCII: \ud800 escapes
    (example,) = load_examples(path)
    assert example.question == "Who is \ufffd?" and example.answers == ["x\ufffd"]
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(row) + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(DatasetError, match=r"deep\.jsonl:2: JSON nested too deeply"):
        load_examples(deep)


def test_cli_prints_the_file_line_error_not_a_traceback(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    latin = tmp_path / "fr.jsonl"
    latin.write_bytes('{"id": "a", "question": "Frédéric?", "golden_answers": ["x"]}\n'.encode("latin-1"))
    result = CliRunner().invoke(
        app, ["eval", "--method", "direct", "--data", str(latin), "--out", str(tmp_path / "run"), "--llm", "hf:/nope"]
    )
    printed = "".join(result.output.split())  # the console wraps long lines
    assert result.exit_code != 0 and f"{latin}:1:notUTF-8text" in printed
    assert "Traceback" not in result.output and not isinstance(result.exception, UnicodeDecodeError)

    corpus = _gz(tmp_path / "c.jsonl.gz", _lines(1, width=5000), keep=60)
    result = CliRunner().invoke(app, ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx")])
    assert result.exit_code != 0 and f"{corpus}:1:cannotread" in "".join(result.output.split())
    assert "Aborted" not in result.output and "Traceback" not in result.output


def test_bm25_index_over_a_corpus_with_surrogate_escapes_serves_encodable_passages(tmp_path: Path) -> None:
    from sleuth.retrieval.bm25 import BM25Retriever, build_bm25_index
    from sleuth.retrieval.store import PASSAGES

    corpus = tmp_path / "c.jsonl"
    rows = [{"id": "1", "contents": '"Jaws \ud800"\nJaws is a shark film \udfff.'}, {"id": "2", "contents": "B"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_bm25_index(corpus, tmp_path / "idx")
    (hits,) = BM25Retriever(tmp_path / "idx").search(["shark film \ud800"], 1)
    assert (hits[0].title, hits[0].text) == ("Jaws \ufffd", "Jaws is a shark film \ufffd.")
    (tmp_path / "idx" / PASSAGES).read_bytes().decode("utf-8")
