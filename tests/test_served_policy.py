"""ServedPolicy against a vLLM-like server over a real socket: adapter names are unique per run, a long-lived server
that still holds an earlier run's adapters does not stop a new run, and errors carry the server's own message."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sleuth.train.served_policy import ServedPolicy, ServedPolicyError


class OneProcess:
    world, rank, main = 1, 0, True

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


class Adapter:
    """What ServedPolicy needs of a PEFT model: ``save_pretrained``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def save_pretrained(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({"tag": self.tag}))


class LoraServer:
    """vLLM's runtime LoRA routes as vLLM 0.32 answers them: loading a name it holds is HTTP 400 with vLLM's message,
    unloading an unknown name 404; ``lora_routes=False`` is a server started without runtime LoRA (no such route)."""

    def __init__(self, lora_routes: bool = True) -> None:
        self.loaded: dict[str, str] = {}
        self.events: list[tuple[str, str, int]] = []
        state = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                status, payload = state.handle(self.path, body, lora_routes)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def handle(self, path: str, body: dict[str, Any], lora_routes: bool) -> tuple[int, dict[str, Any]]:
        name = str(body.get("lora_name"))
        if not lora_routes:
            return 404, {"detail": "Not Found"}
        if path.endswith("/load_lora_adapter"):
            if name in self.loaded:
                message = (
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True."
                )
                self.events.append(("load", name, 400))
                return 400, {"error": {"message": message, "type": "InvalidUserInput", "code": 400}}
            self.loaded[name] = body["lora_path"]
            self.events.append(("load", name, 200))
            return 200, {"message": "ok"}
        if path.endswith("/unload_lora_adapter"):
            status = 200 if self.loaded.pop(name, None) is not None else 404
            self.events.append(("unload", name, status))
            return status, {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": status}}
        return 404, {"detail": "Not Found"}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = LoraServer()
    yield running
    running.close()


def spec(url: str) -> str:
    return f"openai:base@{url}?timeout=5&max_retries=0&backoff=0.01"


def test_a_second_run_on_a_server_that_still_holds_the_first_runs_adapters(server: LoraServer, tmp_path: Path) -> None:
    first = ServedPolicy(spec(server.url), tmp_path / "a", OneProcess())
    llm = first.publish(Adapter("a0"), 0)
    # the first run ends without cleaning up (killed, or its adapter left for inspection)
    second = ServedPolicy(spec(server.url), tmp_path / "b", OneProcess())
    assert second.run_id != first.run_id
    llm2 = second.publish(Adapter("b0"), 0)  # the same step number: vLLM would answer 400 to a reused name
    assert llm.model != llm2.model and llm2.model == f"policy-{second.run_id}-step-00000"
    assert set(server.loaded) == {llm.model, llm2.model}
    assert all(status == 200 for _, _, status in server.events)
    second.publish(Adapter("b1"), 1)
    assert set(server.loaded) == {llm.model, f"policy-{second.run_id}-step-00001"}  # only its own previous one went


def test_a_resumed_run_unloads_what_the_run_before_it_left_loaded(server: LoraServer, tmp_path: Path) -> None:
    first = ServedPolicy(spec(server.url), tmp_path / "served", OneProcess())
    left = first.publish(Adapter("a"), 3).model
    assert json.loads((tmp_path / "served" / "step-00003" / "served.json").read_text()) == {"lora_name": left}
    resumed = ServedPolicy(spec(server.url), tmp_path / "served", OneProcess())
    assert ("unload", left, 200) in server.events and server.loaded == {}
    assert not (tmp_path / "served" / "step-00003").exists()
    resumed.publish(Adapter("b"), 4)
    resumed.close()
    assert server.loaded == {} and server.events[-1] == ("unload", f"policy-{resumed.run_id}-step-00004", 200)


def test_an_adapter_directory_from_before_run_ids_is_unloaded_by_its_old_name(
    server: LoraServer, tmp_path: Path
) -> None:
    old = tmp_path / "served" / "step-00007"
    old.mkdir(parents=True)
    server.loaded["policy-step-00007"] = str(old)
    ServedPolicy(spec(server.url), tmp_path / "served", OneProcess())
    assert ("unload", "policy-step-00007", 200) in server.events and server.loaded == {}


def test_a_refused_load_reports_the_servers_own_message(server: LoraServer, tmp_path: Path) -> None:
    served = ServedPolicy(spec(server.url), tmp_path / "served", OneProcess(), run_id="fixed")
    server.loaded["policy-fixed-step-00000"] = "/elsewhere"  # e.g. two runs given the same run_id by hand
    with pytest.raises(ServedPolicyError) as caught:
        served.publish(Adapter("a"), 0)
    message = str(caught.value)
    assert "HTTP 400" in message and "has already been loaded" in message and "load_inplace" in message
    assert "enable_lora" not in message  # the runtime-LoRA hint would mislead here: the server has it


def test_a_server_without_runtime_lora_gets_the_hint(tmp_path: Path) -> None:
    plain = LoraServer(lora_routes=False)
    try:
        served = ServedPolicy(spec(plain.url), tmp_path / "served", OneProcess())
        with pytest.raises(ServedPolicyError) as caught:
            served.publish(Adapter("a"), 0)
    finally:
        plain.close()
    message = str(caught.value)
    assert "HTTP 404" in message and "Not Found" in message
    assert "vllm:BASE?enable_lora=1" in message and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in message


def test_an_unreachable_server_gets_the_hint(tmp_path: Path) -> None:
    served = ServedPolicy("openai:base@http://127.0.0.1:9/v1?timeout=1&max_retries=0", tmp_path, OneProcess())
    with pytest.raises(ServedPolicyError, match=r"enable_lora=1"):
        served.publish(Adapter("a"), 0)
