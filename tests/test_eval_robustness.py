"""`sleuth eval` under failure: a model server that is down then up, two writers on one run directory, a
corrupted (duplicated) traces file, bad config values from YAML or `--set`, and a directory that holds no model.

The model is a real OpenAI-compatible HTTP server on 127.0.0.1 (``ScriptedServer`` of test_openai_backend) that
answers every question with a fixed text; "down" is a port with nothing listening. The two-writer case runs two
real `sleuth eval` processes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.config_check import ConfigValueError, check_dataclass, check_field
from sleuth.eval.evaluate import EvalConfig, EvalConfigError, EvalError, evaluate, read_traces
from sleuth.records import Example, Trace
from tests.test_evaluate import write_dataset
from tests.test_openai_backend import ScriptedServer, _make_handler

runner = CliRunner()
ANSWER = "colour0"  # write_dataset's gold is colour{i % 3}: q0 and q3 of six are right


def chat_reply(text: str) -> bytes:
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12},
        }
    ).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def model_server(port: int = 0, gate: threading.Event | None = None) -> Iterator[tuple[ScriptedServer, Any]]:
    """A fake OpenAI-compatible server answering ``ANSWER``; with ``gate``, each request waits for it to be set
    (``arrived`` is set as the first request comes in)."""
    state = ScriptedServer(default=("raw", chat_reply(ANSWER)))
    arrived = threading.Event()
    base = _make_handler(state)

    class Handler(base):  # type: ignore[valid-type, misc]
        def do_POST(self) -> None:  # noqa: N802 - the http.server naming
            arrived.set()
            if gate is not None:
                gate.wait(timeout=300)
            super().do_POST()

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state, arrived
    finally:
        if gate is not None:
            gate.set()
        httpd.shutdown()
        httpd.server_close()


def spec_for(url: str, timeout: float = 2) -> str:
    return f"openai:test-model@{url}?max_retries=0&timeout={timeout}&backoff=0.01"


def eval_args(data: Path, out: Path, llm: str, *extra: str) -> list[str]:
    return ["eval", "--method", "direct", "--data", str(data), "--out", str(out), "--llm", llm, *extra]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def metrics_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())


# -- failed examples are retried -----------------------------------------------------------------------------------


def test_examples_that_failed_while_the_server_was_down_are_retried_once_it_is_up(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 6)
    out, port = tmp_path / "run", free_port()
    llm = spec_for(f"http://127.0.0.1:{port}/v1")

    down = runner.invoke(app, eval_args(data, out, llm, "--concurrency", "2"))
    assert down.exit_code == 1, down.output
    assert "all 6 examples failed" in down.stderr and "first error: toy/dev/q" in down.stderr
    assert "Traceback" not in down.output
    assert lines(out / "traces.jsonl") == [] and len(lines(out / "errors.jsonl")) == 6
    assert (metrics_of(out)["n"], metrics_of(out)["overall"]["errors"]) == (0, 6)

    with model_server(port) as (server, _):
        up = runner.invoke(app, eval_args(data, out, llm, "--concurrency", "2"))
        assert up.exit_code == 0, up.output
        assert len(server.received) == 6, "every example that failed is asked again"
        metrics = metrics_of(out)
        assert metrics["n"] == 6 and metrics["overall"]["errors"] == 0
        assert metrics["overall"]["em"] == pytest.approx(2 / 6)
        again = runner.invoke(app, eval_args(data, out, llm, "--concurrency", "2"))
        assert again.exit_code == 0 and len(server.received) == 6, "a finished run makes no calls"
    ids = sorted(t.example.id for t in read_traces(out / "traces.jsonl"))
    assert ids == [f"q{i}" for i in range(6)] and len(lines(out / "traces.jsonl")) == 6


def test_a_partly_failed_run_counts_only_results_and_the_resume_retries_only_the_failures(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 6)
    out = tmp_path / "run"
    with model_server() as (server, _):
        server.queue(("status", 400, {"error": {"message": "context too long"}}))  # the first call fails, once
        first = runner.invoke(app, eval_args(data, out, spec_for(server.url), "--concurrency", "1"))
        assert first.exit_code == 0, first.output
        assert "1 examples have no result" in first.stderr
        metrics = metrics_of(out)
        assert metrics["n"] == 5 and metrics["errors"] == 1 and metrics["overall"]["errors"] == 1
        assert metrics["per_dataset"]["toy/dev"]["n"] == 5
        failed = read_traces(out / "errors.jsonl")
        assert len(failed) == 1 and "context too long" in (failed[0].error or "")
        assert failed[0].example.id not in {t.example.id for t in read_traces(out / "traces.jsonl")}

        second = runner.invoke(app, eval_args(data, out, spec_for(server.url), "--concurrency", "1"))
        assert second.exit_code == 0, second.output
        assert len(server.received) == 7, "only the failed example is asked again"
    metrics = metrics_of(out)
    assert metrics["n"] == 6 and metrics["overall"]["errors"] == 0
    assert len(lines(out / "errors.jsonl")) == 1, "the failed attempt stays in the log"


# -- one writer per run directory; duplicates are repaired -------------------------------------------------------


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 4)
    out = tmp_path / "run"
    sleuth = str(Path(sys.executable).with_name("sleuth"))
    gate = threading.Event()
    with model_server(gate=gate) as (server, arrived):
        command = [sleuth, *eval_args(data, out, spec_for(server.url, timeout=300), "--concurrency", "1")]
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert arrived.wait(timeout=300), "the first run never called the model"
            # the first run holds the lock while its call waits at the gate
            second = subprocess.run(command, capture_output=True, text=True, timeout=300)
            assert second.returncode == 1
            assert f"pid {first.pid}" in second.stderr and "in use by another sleuth eval" in second.stderr
            assert "Traceback" not in second.stderr
        finally:
            gate.set()
            _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
        assert len(server.received) == 4
    assert len(lines(out / "traces.jsonl")) == 4 and metrics_of(out)["n"] == 4
    assert (out / "eval.lock").read_text() == "", "the pid is cleared when the holder finishes"


def test_duplicate_records_read_back_once_and_a_resume_repairs_the_file(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 4)
    out = tmp_path / "run"
    with model_server() as (server, _):
        config = EvalConfig(method="direct", data=[str(data)], out=str(out), llm=spec_for(server.url))
        evaluate(config, progress=False)
        assert len(server.received) == 4
        # what two writers without a lock left behind: lines twice, a later q0 with another answer; and failed
        # attempts written by a version that kept them in traces.jsonl: q1 after its result, q3 with none
        traces = out / "traces.jsonl"
        originals = sorted(read_traces(traces), key=lambda t: t.example.id)  # written in completion order
        late = Trace.from_json(originals[0].to_json())
        late.answer = "colour0, written later"
        failed = [Trace.from_json(originals[i].to_json()) for i in (1, 3)]
        for trace in failed:
            trace.error, trace.answer = "LLMError: the server is down", ""
        corrupted = [*originals[:3], *originals[:3], late, *failed]
        traces.write_text("".join(t.to_json() + "\n" for t in corrupted))

        read = read_traces(traces)
        assert [t.example.id for t in read] == ["q0", "q1", "q2", "q3"]
        assert read[0].answer == "colour0, written later", "the last complete record wins"
        assert not read[1].error, "a failed attempt never replaces a result"
        assert read[3].error, "q3 has no result"

        metrics = evaluate(config, progress=False)
        assert len(server.received) == 5, "only q3, which has no result, runs again"
    assert metrics["n"] == 4 and metrics["overall"]["errors"] == 0
    assert len(lines(traces)) == 4 and read_traces(traces)[0].answer == "colour0, written later"
    assert [t.example.id for t in read_traces(out / "errors.jsonl")] == ["q3"], "the failed attempt is moved"


def test_a_run_with_results_and_an_unreadable_config_is_not_resumed_blindly(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 2)
    out = tmp_path / "run"
    with model_server() as (server, _):
        config = EvalConfig(method="direct", data=[str(data)], out=str(out), llm=spec_for(server.url))
        evaluate(config, progress=False)
    (out / "config.json").write_text('{"method": "dir')  # cut short
    with pytest.raises(EvalError, match="not readable JSON"):
        evaluate(config, progress=False)


# -- bad values stop the command before anything loads -----------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "extra", "message"),
    [
        ("naive_rag", ["--set", "k=-5"], "k: got -5, expected an integer >= 1"),
        (
            "direct",
            ["--set", "sampling.temperature=nan"],
            "sampling.temperature: got nan, expected a finite number >= 0",
        ),
        ("direct", ["--set", "sampling.top_p=0"], "sampling.top_p: got 0.0, expected a finite number in (0, 1]"),
        (
            "direct",
            ["--set", "sampling.max_new_tokens=ten"],
            "sampling.max_new_tokens: got 'ten', expected an integer",
        ),
        ("naive_rag", ["--k", "0"], "k: got 0, expected an integer >= 1 or none"),
        ("direct", ["--concurrency", "0"], "concurrency: got 0, expected an integer >= 1"),
        ("acesearcher", ["--set", "prompts=nope"], "prompts: got 'nope', expected one of 'paper', 'code'"),
    ],
)
def test_bad_eval_values_exit_2_with_one_line_before_the_run_starts(
    tmp_path: Path, method: str, extra: list[str], message: str
) -> None:
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 2)
    out = tmp_path / "run"
    args = ["eval", "--method", method, "--data", str(data), "--out", str(out), "--llm", "hf:/no/such/model", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {message}"]
    assert not out.exists(), "nothing is written, no model is loaded"


def test_ask_rejects_a_bad_value_with_exit_2() -> None:
    result = runner.invoke(app, ["ask", "q", "--method", "naive_rag", "--set", "k=-5", "--llm", "hf:/no/such/model"])
    assert result.exit_code == 2 and result.stderr.strip() == "error: k: got -5, expected an integer >= 1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("val_fraction: [0.1]", "val_fraction: got [0.1], expected a finite number in [0, 1)"),
        ("num_examples: {a: 1}", "num_examples: got {'a': 1}, expected an integer >= 1 or none"),
        ("seed: [4, 2]", "seed: got [4, 2], expected an integer"),
        ("epochs: [1, 2]", "epochs: got [1, 2], expected a finite number > 0"),
        ("max_length: 12.5", "max_length: got 12.5, expected an integer >= 1"),
        ("learning_rate: .nan", "learning_rate: got nan, expected a finite number > 0"),
        ("agent: {k: 0}", "agent.k: got 0, expected an integer >= 1"),
        ("sources: [{path: x.jsonl, weight: -1}]", "sources[0].weight: got -1, expected a finite number >= 0"),
    ],
)
def test_bad_sft_config_values_exit_2_naming_file_and_key_before_the_model_loads(
    tmp_path: Path, line: str, message: str
) -> None:
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: /no/such/model\noutput_dir: {tmp_path / 'out'}\n{line}\n")
    result = runner.invoke(app, ["train", "sft", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {config}: {message}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("trainer", ["sft", "acesearcher", "exsearch", "s3", "arena"])
def test_every_trainer_checks_its_config_and_set_values(tmp_path: Path, trainer: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nseed: [4, 2]\n")
    result = runner.invoke(app, ["train", trainer, "--config", str(config)])
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {config}: seed: got [4, 2], expected an integer"
    config.write_text(f"output_dir: {tmp_path / 'out'}\n")
    result = runner.invoke(app, ["train", trainer, "--config", str(config), "--set", "seed=4.5"])
    assert result.exit_code == 2 and "seed: got '4.5', expected an integer" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("model: caf\u00e9\n".encode("latin-1"))
    result = runner.invoke(app, ["train", "sft", "--config", str(config)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {config}: not UTF-8 text (byte 0xe9 at offset 10)"


def test_the_checker_accepts_every_default_and_shipped_config_and_rejects_bools_for_ints() -> None:
    """The range table must not reject a default or a shipped config (every run of it would fail)."""
    from sleuth.agents import AGENTS, get_agent
    from sleuth.train.arena_rl import ArenaRLConfig
    from sleuth.train.config import load_config
    from sleuth.train.exsearch_em import EMConfig
    from sleuth.train.mdpo import MDPOConfig
    from sleuth.train.s3_rl import S3RLConfig
    from sleuth.train.sft import SFTConfig, load_sft_config

    get_agent("direct")  # registers the agents
    trainers = {"sft": SFTConfig, "mdpo": MDPOConfig, "exsearch": EMConfig, "s3": S3RLConfig, "arena": ArenaRLConfig}
    for config_cls in [*(spec.config_cls for spec in AGENTS.values()), *trainers.values()]:
        check_dataclass(config_cls())
    check_dataclass(EvalConfig(method="direct", data=[], out="run"))
    shipped = sorted((Path(__file__).parents[1] / "configs").rglob("*.yaml"))
    assert len(shipped) >= 5
    for path in shipped:
        kind = next(name for name in trainers if name in path.stem)
        config = load_sft_config(path) if kind == "sft" else load_config(trainers[kind], path)
        check_dataclass(config)
    with pytest.raises(ConfigValueError, match=r"^concurrency: got True, expected an integer >= 1$"):
        check_field(EvalConfig, "concurrency", True)
    with pytest.raises(ConfigValueError, match=r"^limit: got inf, expected an integer >= 0 or none$"):
        check_field(EvalConfig, "limit", float("inf"))


def test_evaluate_raises_a_config_error_before_touching_the_run_dir(tmp_path: Path) -> None:
    config = EvalConfig(method="direct", data=[], out=str(tmp_path / "run"), method_config={"sampling.n": "0"})
    with pytest.raises(EvalConfigError, match=r"^sampling.n: got 0, expected an integer >= 1$"):
        evaluate(config, progress=False)
    assert not (tmp_path / "run").exists()


# -- a directory that holds no model -----------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "reason"), [(None, "no config.json"), ("{}", "names no model_type")])
def test_a_model_dir_without_a_model_is_one_line_and_a_corrected_rerun_is_accepted(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if content is not None:
        (model / "config.json").write_text(content)
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 2)
    out = tmp_path / "run"
    bad = runner.invoke(app, eval_args(data, out, f"hf:{model}"))
    assert bad.exit_code == 1
    [line] = bad.stderr.strip().splitlines()
    assert line.startswith(f"error: hf:{model}: no model found (") and reason in line
    assert lines(out / "traces.jsonl") == []
    with model_server() as (server, _):
        fixed = runner.invoke(app, eval_args(data, out, spec_for(server.url)))
        assert fixed.exit_code == 0, fixed.output
    assert json.loads((out / "config.json").read_text())["llm"] == spec_for(server.url)
    assert metrics_of(out)["n"] == 2


def test_read_traces_keys_on_dataset_and_id(tmp_path: Path) -> None:
    """The same id in two datasets is two examples, not a duplicate."""
    path = tmp_path / "traces.jsonl"
    traces = [
        Trace(example=Example(id="q0", question="q", metadata={"dataset": name}), method="direct", answer=name)
        for name in ("a/dev", "b/dev", "a/dev")
    ]
    path.write_text("".join(t.to_json() + "\n" for t in traces))
    assert [(t.example.metadata["dataset"], t.answer) for t in read_traces(path)] == [
        ("a/dev", "a/dev"),
        ("b/dev", "b/dev"),
    ]
