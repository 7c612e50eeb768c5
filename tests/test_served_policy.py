"""ServedPolicy against a vLLM-like server over a real socket: adapter names are unique per run, a long-lived server
that still holds an earlier run's adapters does not stop a new run, and errors carry the server's own message; a full
fine-tune's weights are reloaded through vLLM's development routes, and the prefix cache dropped after each reload."""

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
    unloading an unknown name 404; ``lora_routes=False`` is a server started without runtime LoRA (no such route).

    ``dev_routes``: also vLLM's development routes (VLLM_SERVER_DEV_MODE=1) at the root: ``/collective_rpc`` records
    the call and, for ``reload_weights``, the weights file it would read; ``/reset_prefix_cache`` answers
    ``success: false`` ``busy_resets`` times first (vLLM does while running requests hold blocks)."""

    def __init__(self, lora_routes: bool = True, dev_routes: bool = False, busy_resets: int = 0) -> None:
        self.loaded: dict[str, str] = {}
        self.events: list[tuple[str, str, int]] = []
        self.dev_routes = dev_routes
        self.busy_resets = busy_resets
        self.weights: list[str] = []  # what each reload_weights read
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
        if self.dev_routes and path == "/collective_rpc":
            kwargs = body.get("kwargs", {})
            self.events.append(("rpc", f"{body['method']} {json.dumps(kwargs, sort_keys=True)}", 200))
            if body["method"] == "reload_weights":
                self.weights.append((Path(kwargs["weights_path"]) / "weights.json").read_text())
            return 200, {"results": [None]}
        if self.dev_routes and path == "/reset_prefix_cache":
            success = self.busy_resets <= 0
            self.busy_resets -= 1
            self.events.append(("reset", "", 200))
            return 200, {"success": success}
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


class FullModel:
    """What ServedPolicy needs of a transformers model: ``save_pretrained`` (here a stand-in weights file)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def save_pretrained(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "weights.json").write_text(json.dumps({"tag": self.tag}))

    def get_input_embeddings(self) -> None:
        return None

    def get_output_embeddings(self) -> None:
        return None


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


def test_a_full_fine_tune_is_reloaded_from_a_saved_copy_and_the_prefix_cache_dropped(tmp_path: Path) -> None:
    dev = LoraServer(lora_routes=False, dev_routes=True)
    try:
        served = ServedPolicy(spec(dev.url), tmp_path / "served", OneProcess(), mode="full")
        assert [e[0] for e in dev.events] == ["reset"]  # the routes are checked when the object is made
        first = served.publish(FullModel("w0"), 0)
        path0 = (tmp_path / "served" / "step-00000").resolve()
        assert first.model == "base" and first.base_url == dev.url  # the server keeps the model's name
        assert dev.events[1:] == [("rpc", f'reload_weights {{"weights_path": "{path0}"}}', 200), ("reset", "", 200)]
        assert json.loads(dev.weights[0]) == {"tag": "w0"} and set(served.seconds) == {"save", "reload", "reset"}
        second = served.publish(FullModel("w1"), 1)
        assert second.model == "base" and json.loads(dev.weights[1]) == {"tag": "w1"}
        assert [e[0] for e in dev.events[3:]] == ["rpc", "reset"]
        assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["step-00001"]  # the old copy went
        served.close()
        assert list((tmp_path / "served").iterdir()) == []
        assert not any(kind in ("load", "unload") for kind, _, _ in dev.events)  # no LoRA route is ever called
    finally:
        dev.close()


def test_a_prefix_cache_reset_refused_while_requests_run_is_asked_again(tmp_path: Path) -> None:
    dev = LoraServer(lora_routes=False, dev_routes=True, busy_resets=3)
    try:
        served = ServedPolicy(spec(dev.url), tmp_path / "served", OneProcess(), mode="full")
        served.publish(FullModel("w0"), 0)
        assert [e[0] for e in dev.events] == ["reset"] * 4 + ["rpc", "reset"]
    finally:
        dev.close()


def test_a_server_without_the_development_routes_is_refused_with_the_setting_to_use(tmp_path: Path) -> None:
    plain = LoraServer(lora_routes=True)  # runtime LoRA, but no VLLM_SERVER_DEV_MODE
    try:
        with pytest.raises(ServedPolicyError) as caught:
            ServedPolicy(spec(plain.url), tmp_path / "served", OneProcess(), mode="full")
    finally:
        plain.close()
    message = str(caught.value)
    assert "/reset_prefix_cache answered HTTP 404" in message and "VLLM_SERVER_DEV_MODE=1" in message
    assert "vllm:BASE" in message and "enable_lora" not in message


def test_a_vllm_spec_for_a_full_fine_tune_starts_its_server_in_dev_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sleuth.llm
    from sleuth.llm import vllm_server
    from sleuth.llm.openai_compat import OpenAICompatLLM

    dev = LoraServer(lora_routes=False, dev_routes=True)
    specs: list[str] = []

    def started(spec: str) -> OpenAICompatLLM:
        specs.append(spec)
        return OpenAICompatLLM("base", dev.url, max_retries=0)

    monkeypatch.setattr(sleuth.llm, "load_llm", started)
    try:
        ServedPolicy("vllm:/m?max_model_len=512", tmp_path / "a", OneProcess(), mode="full")
        ServedPolicy("vllm:/m", tmp_path / "b", OneProcess(), mode="full")
        ServedPolicy("vllm:/m?enable_lora=1", tmp_path / "c", OneProcess())  # LoRA: no dev mode
        ServedPolicy(f"vllm:?url={dev.url}", tmp_path / "d", OneProcess(), mode="full")  # attached: not its to set
    finally:
        dev.close()
    assert specs == ["vllm:/m?max_model_len=512&dev_mode=1", "vllm:/m?dev_mode=1", "vllm:/m?enable_lora=1"] + [
        f"vllm:?url={dev.url}"
    ]
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")  # an inherited setting loses to the spec's option only
    for option, value in (("1", "1"), ("0", "0")):
        config = vllm_server.server_config("/m", {"dev_mode": option}, python="python")
        assert config.environment()["VLLM_SERVER_DEV_MODE"] == value
    with pytest.raises(ValueError, match="mode"):
        ServedPolicy(spec(dev.url), tmp_path / "e", OneProcess(), mode="merged")
