"""The sleuth command end to end: index build / info / search on a written corpus; ask on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.records import Trace
from tests.test_bm25 import write_corpus

runner = CliRunner()


def test_index_build_info_search(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", n_filler=30, bad_lines=True)
    result = runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx")])
    assert result.exit_code == 0, result.output
    assert "indexed 35 passages" in result.output and "skipped 2 malformed lines" in result.output
    info = runner.invoke(app, ["index", "info", str(tmp_path / "idx")])
    assert json.loads(info.stdout)["passages"] == 35
    hits = runner.invoke(app, ["search", "research on radioactivity", "--index", str(tmp_path / "idx"), "--json"])
    assert hits.exit_code == 0
    assert json.loads(hits.stdout.splitlines()[0])["id"] == "t0"


def test_strict_build_fails_with_file_and_line(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", n_filler=5, bad_lines=True)
    result = runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "i"), "--strict"])
    assert result.exit_code == 1
    assert f"{corpus}:4:" in " ".join(result.output.split())


def test_ask_with_tiny_model_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    build = runner.invoke(
        app,
        ["index", "build", "--corpus", str(write_corpus(tmp_path / "c.jsonl", 20)), "--out", str(tmp_path / "idx")],
    )
    assert build.exit_code == 0
    args = [
        "ask",
        "Who researched radioactivity?",
        "--llm",
        f"hf:{tiny_model_dir}",
        "--index",
        str(tmp_path / "idx"),
        "--k",
        "2",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    trace = Trace.from_json(result.stdout.strip().splitlines()[-1])
    assert trace.method == "naive_rag" and trace.steps[0].passages[0].id == "t0"
    assert trace.steps[1].completion_tokens <= 8


def test_bad_specs_give_clear_errors(tmp_path: Path) -> None:
    result = runner.invoke(app, ["ask", "q", "--index", str(tmp_path), "--llm", "hf:/nope"])
    assert result.exit_code == 1 and "not a sleuth index" in " ".join(result.output.split())
    result = runner.invoke(app, ["ask", "q", "--method", "nope"])
    assert result.exit_code == 1 and "unknown method" in " ".join(result.output.split())


@pytest.mark.integration
def test_sleuth_ask_json_with_smollm2() -> None:
    """The real thing: the installed `sleuth` command, the embedded SmolLM2 and the wiki summaries index."""
    from sleuth.assets import default_index_dir, ensure_default_model

    ensure_default_model()
    sleuth = Path(sys.executable).with_name("sleuth")
    if not (default_index_dir() / "sleuth-index.json").exists():
        subprocess.run([str(sleuth), "index", "build"], check=True, capture_output=True, timeout=300)
    out = subprocess.run(
        [str(sleuth), "ask", "Who directed the film 2001: A Space Odyssey?", "--json", "--max-new-tokens", "48"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    trace = Trace.from_json(out.stdout)
    assert trace.error is None
    search, answer = trace.steps
    assert search.passages[0].title == "2001: A Space Odyssey"
    assert "Kubrick" in answer.output and trace.answer
    assert answer.prompt_tokens > 300 and 0 < answer.completion_tokens <= 48


def test_render_trace_shows_steps_titles_and_fallbacks() -> None:
    from rich.console import Console

    from sleuth.display import render_trace
    from sleuth.records import Example, Passage, Step

    trace = Trace(example=Example(id="e", question="Who painted it?"), method="naive_rag", answer="Seurat")
    trace.add(Step(kind="search", query="painted it", passages=[Passage(id="1", title="La Grande Jatte", text="t")]))
    trace.add(
        Step(
            kind="answer",
            messages=[{"role": "user", "content": "You have the following context passages"}],
            output="Seurat\nGeorges Seurat painted it.",
            parsed="Seurat",
            prompt_tokens=120,
            completion_tokens=9,
            fallback="first_line",
        )
    )
    console = Console(record=True, width=120)
    render_trace(trace, console)
    text = console.export_text()
    for expected in ("Who painted it?", "Seurat", "La Grande Jatte", "painted it", "120+9", "fallback: first_line"):
        assert expected in text


def test_dense_index_build_and_search(tmp_path: Path) -> None:
    from sleuth.assets import default_embedder_dir

    if not (default_embedder_dir() / "modules.json").exists():
        pytest.skip("bundled MiniLM not fetched (run `sleuth assets fetch`)")
    corpus = write_corpus(tmp_path / "corpus.jsonl", n_filler=20)
    args = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "dense"), "--kind", "dense"]
    result = runner.invoke(app, [*args, "--index-type", "hnsw"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "dense" / "sleuth-index.json").read_text())["index_type"] == "hnsw"
    hits = runner.invoke(app, ["search", "the tallest mountain", "--index", str(tmp_path / "dense"), "--json"])
    assert json.loads(hits.stdout.splitlines()[0])["id"] == "t3"


def test_serve_retriever_subprocess_and_remote_search(tmp_path: Path) -> None:
    """`sleuth serve retriever` in its own process, queried through the `remote:` spec of `sleuth search`."""
    import socket
    import time

    import httpx

    build = runner.invoke(
        app,
        ["index", "build", "--corpus", str(write_corpus(tmp_path / "c.jsonl", 10)), "--out", str(tmp_path / "idx")],
    )
    assert build.exit_code == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleuth = Path(sys.executable).with_name("sleuth")
    server = subprocess.Popen(
        [str(sleuth), "serve", "retriever", "--index", str(tmp_path / "idx"), "--port", str(port)]
        + ["--head-timeout", "1", "--max-connections", "8"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read().decode()
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        hits = runner.invoke(
            app, ["search", "Himalayas mountain", "--index", f"remote:http://127.0.0.1:{port}", "--json", "--k", "2"]
        )
        assert hits.exit_code == 0, hits.output
        rows = [json.loads(line) for line in hits.stdout.splitlines()]
        assert [r["id"] for r in rows][0] == "t3" and rows[0]["title"] == "Mount Everest" and len(rows) == 2
        # --head-timeout reaches the server: a request head that never finishes is cut off (default: 10 s)
        with socket.create_connection(("127.0.0.1", port), timeout=15) as stalled:
            stalled.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            opened = time.monotonic()
            while stalled.recv(4096):
                pass
            assert time.monotonic() - opened < 8
    finally:
        server.terminate()
        server.wait(timeout=30)
