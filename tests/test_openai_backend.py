"""The OpenAI-compatible backend against a real, scripted HTTP server on 127.0.0.1.

The server (``ScriptedServer``) answers like vLLM's ``/v1/chat/completions`` and ``/v1/completions``; each test
queues behaviours (sleep past the client timeout, answer 500/429/400/503, drop to one choice per call, ...) and
reads back the requests the server received.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sleuth.llm.base import _BACKENDS, LLMError, Request, Sampling, Score, parse_spec
from sleuth.llm.openai_compat import OpenAICompatLLM

SUFFIX = " STOP and more <s5> tail"  # every normal answer ends with this, so stop strings have something to cut


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class ScriptedServer:
    """State shared with the handler threads: scripted behaviours in, received requests out."""

    url: str = ""
    script: deque[tuple[Any, ...]] = field(default_factory=deque)
    default: tuple[Any, ...] = ("ok",)
    max_choices: int | None = None  # None: honour n; 1: like llama.cpp, which ignores n
    delay: float = 0.0
    delays: dict[str, float] = field(default_factory=dict)  # per last user message / prompt
    logprobs: bool = True
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def queue(self, *behaviours: tuple[Any, ...]) -> None:
        self.script.extend(behaviours)


def _last_input(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body.get("prompt", ""))


def _toy_tokens(text: str) -> list[str]:
    """Words with their leading whitespace: 'The capital of' -> ['The', ' capital', ' of']."""
    return re.findall(r"\s*\S+", text)


def _ok_reply(server: ScriptedServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("echo"):
        return _echo_reply(server, body)
    if body.get("prompt_logprobs") is not None and server.logprobs:
        return _prompt_logprobs_reply(body)
    n = int(body.get("n", 1))
    count = n if server.max_choices is None else min(n, server.max_choices)
    chat = path.endswith("/chat/completions")
    choices = []
    for i in range(count):
        text = f"answer to {_last_input(body)}" + (f" #{i} seed={body.get('seed')}" if n > 1 else "") + SUFFIX
        choice: dict[str, Any] = {"index": i, "finish_reason": "length" if i == 0 else "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.get("return_token_ids") and server.logprobs:  # vLLM: the sampled ids and (logprobs=0) their values
            choice["token_ids"] = [ord(c) for c in text[:6]]
            choice["logprobs"] = {"token_logprobs": [-ord(c) / 1000 for c in text[:6]], "tokens": list(text[:6])}
        choices.append(choice)
    return {
        "id": "x",
        "object": "chat.completion" if chat else "text_completion",
        "model": body.get("model"),
        "choices": choices,
        "usage": {"prompt_tokens": 11, "completion_tokens": 7 * count, "total_tokens": 11 + 7 * count},
    }


def _echo_reply(server: ScriptedServer, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style echo: logprobs for every prompt token (the first is None) plus one generated token."""
    tokens = [*_toy_tokens(body["prompt"]), " GEN"]
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    # Distinct values so including a prompt token or the generated token changes the sum.
    values: list[float | None] = [None] + [-0.5 * i for i in range(1, len(tokens) - 1)] + [-100.0]
    choice: dict[str, Any] = {"index": 0, "text": body["prompt"] + " GEN", "finish_reason": "length"}
    choice["logprobs"] = (
        {"tokens": tokens, "token_logprobs": values, "text_offset": offsets, "top_logprobs": None}
        if server.logprobs
        else None
    )
    return {"choices": [choice], "usage": {"prompt_tokens": len(tokens) - 1, "completion_tokens": 1}}


def _prompt_logprobs_reply(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style ``prompt_logprobs`` for a token-id prompt: None for the first id, then ``{str(id): {logprob,
    rank, decoded_token}}`` with the toy value ``-id / 100`` for each id."""
    ids = body["prompt"]
    entries: list[Any] = [None]
    entries += [{str(i): {"logprob": -i / 100, "rank": 1, "decoded_token": chr(i)}} for i in ids[1:]]
    choice = {"index": 0, "text": "G", "finish_reason": "length", "logprobs": None, "prompt_logprobs": entries}
    return {"choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}


def _make_handler(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
            pass

        def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                pass

        def do_POST(self) -> None:  # noqa: N802 - the http.server naming
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw or b"{}")
            with server.lock:
                server.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                behaviour = server.script.popleft() if server.script else server.default
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
            try:
                time.sleep(server.delay + server.delays.get(_last_input(body), 0.0))
                kind = behaviour[0]
                if kind == "sleep":
                    time.sleep(behaviour[1])
                    self._send(200, json.dumps(_ok_reply(server, self.path, body)).encode())
                elif kind == "status":
                    _, status, payload, *rest = behaviour
                    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                    self._send(status, data, rest[0] if rest else None)
                elif kind == "raw":
                    self._send(200, behaviour[1])
                else:
                    self._send(200, json.dumps(_ok_reply(server, self.path, body)).encode())
            finally:
                with server.lock:
                    server.in_flight -= 1

    return Handler


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    state = ScriptedServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    httpd.daemon_threads = True
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def make_llm(base_url: str, model: str = "test-model", **options: Any) -> OpenAICompatLLM:
    """Build the backend through the spec-string registry, as ``load_llm`` does."""
    opts = {"timeout": 2, "max_retries": 3, "backoff": 0.01, **options}
    spec = f"openai:{model}@{base_url}?" + "&".join(f"{k}={v}" for k, v in opts.items())
    prefix, target, parsed = parse_spec(spec)
    llm = _BACKENDS[prefix](target, parsed)
    llm.spec = spec
    assert isinstance(llm, OpenAICompatLLM)
    return llm


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _generate_and_close(llm: OpenAICompatLLM, requests: list[Request], sampling: Sampling) -> list[Any]:
    try:
        return await llm.generate(requests, sampling)
    finally:
        await llm.aclose()


# ------------------------------------------------------------------------------------------------ generate


def test_chat_generate_keeps_order_sends_fields_and_truncates_stops(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    # The first request is answered last, so completion order differs from request order.
    server.delays = {"q0": 0.3, "q1": 0.15}
    requests = [Request.chat(f"q{i}", system="be brief") for i in range(4)]
    stops = ("<s1>", "<s2>", "<s3>", "<s4>", "<s5>")  # five: only four may be sent, the fifth is cut client-side
    sampling = Sampling(temperature=0.7, top_p=0.9, max_new_tokens=32, stop=stops, seed=3)

    gens = run(_generate_and_close(llm, requests, sampling))

    assert [g.texts for g in gens] == [[f"answer to q{i} STOP and more "] for i in range(4)]
    assert [g.finish_reasons for g in gens] == [["stop"]] * 4  # the server said "length" but a stop string cut it
    assert all(g.prompt_tokens == 11 and g.completion_tokens == [7] for g in gens)
    assert len(server.received) == 4
    body = next(r.body for r in server.received if r.body["messages"][-1]["content"] == "q2")
    assert server.received[0].path == "/v1/chat/completions"
    assert body["model"] == "test-model"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"}]
    assert body["max_tokens"] == 32 and body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["n"] == 1 and body["seed"] == 3
    assert body["stop"] == ["<s1>", "<s2>", "<s3>", "<s4>"]
    assert "repetition_penalty" not in body  # OpenAI itself would reject it
    assert llm.stats.requests == 4 and llm.stats.calls == 4 and llm.stats.retries == 0
    assert llm.stats.prompt_tokens == 44 and llm.stats.completion_tokens == 28


def test_a_client_that_does_not_send_seeds_leaves_them_out_of_every_request(server: ScriptedServer) -> None:
    """``send_seed=False`` (a ``vllm:`` CPU server's default: vLLM's CPU build dies on some seeded requests)."""
    from sleuth.llm.openai_compat import OpenAICompatLLM

    llm = OpenAICompatLLM("test-model", server.url, send_seed=False)
    run(_generate_and_close(llm, [Request.chat("q")], Sampling(n=2, temperature=1.0, seed=7)))
    assert server.received and all("seed" not in r.body for r in server.received)
    assert llm.describe()["send_seed"] is False
    assert make_llm(server.url, seeds="drop").send_seed is False and make_llm(server.url).send_seed is True
    with pytest.raises(LLMError, match="seeds"):
        make_llm(server.url, seeds="never")


def test_server_returned_stop_string_is_cut_and_finish_reason_mapped(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    gens = run(_generate_and_close(llm, [Request.chat("hi")], Sampling(stop=(" STOP",), repetition_penalty=1.2)))
    assert gens[0].texts == ["answer to hi"]
    assert gens[0].finish_reasons == ["stop"]
    assert server.received[0].body["repetition_penalty"] == 1.2
    # Without a matching stop string the server's finish_reason passes through.
    gens = run(_generate_and_close(llm, [Request.chat("hi")], Sampling()))
    assert gens[0].texts == ["answer to hi" + SUFFIX]
    assert gens[0].finish_reasons == ["length"]
    assert "stop" not in server.received[1].body


def test_raw_prompt_goes_to_completions(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    gens = run(_generate_and_close(llm, [Request(prompt="Q: 2+2?\nA:")], Sampling(stop=("STOP",))))
    assert gens[0].texts == ["answer to Q: 2+2?\nA: "]
    assert [r.path for r in server.received] == ["/v1/completions"]
    assert server.received[0].body["prompt"] == "Q: 2+2?\nA:"
    assert "messages" not in server.received[0].body


def test_n_samples_from_a_server_that_ignores_n(server: ScriptedServer) -> None:
    server.max_choices = 1
    llm = make_llm(server.url)
    gens = run(_generate_and_close(llm, [Request.chat("q")], Sampling(n=3, temperature=1.0, seed=7, stop=(" STOP",))))
    assert len(gens) == 1 and len(gens[0].texts) == 3
    assert len(set(gens[0].texts)) == 3  # the seed advances, so the extra samples differ
    assert [r.body["n"] for r in server.received] == [3, 2, 1]
    assert [r.body["seed"] for r in server.received] == [7, 8, 9]
    assert gens[0].completion_tokens == [7, 7, 7]
    assert llm.stats.requests == 1 and llm.stats.calls == 3


def test_n_samples_in_one_call_when_the_server_honours_n(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    gens = run(_generate_and_close(llm, [Request.chat("q")], Sampling(n=3, temperature=1.0)))
    assert len(gens[0].texts) == 3 and len(server.received) == 1
    assert gens[0].completion_tokens == [7, 7, 7]  # usage.completion_tokens split evenly over the choices


# ------------------------------------------------------------------------------------------------ retries


def test_timeout_and_500s_are_retried_then_succeed(server: ScriptedServer) -> None:
    server.queue(("sleep", 1.0), ("status", 500, {"error": {"message": "boom"}}), ("status", 500, b"oops"))
    llm = make_llm(server.url, timeout=0.3, max_retries=3)
    start = time.monotonic()
    gens = run(_generate_and_close(llm, [Request.chat("q")], Sampling(stop=(" STOP",))))
    assert gens[0].texts == ["answer to q"]
    assert llm.stats.retries == 3 and llm.stats.calls == 4 and llm.stats.requests == 1
    assert len(server.received) == 4
    assert time.monotonic() - start < 2.0


def test_429_with_retry_after_is_retried(server: ScriptedServer) -> None:
    server.queue(("status", 429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}))
    llm = make_llm(server.url, backoff=5)  # Retry-After: 0 overrides the (long) exponential backoff
    start = time.monotonic()
    gens = run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert gens[0].texts == ["answer to q" + SUFFIX]
    assert llm.stats.retries == 1 and len(server.received) == 2
    assert time.monotonic() - start < 2.0


def test_400_fails_at_once_with_the_server_message(server: ScriptedServer) -> None:
    server.default = ("status", 400, {"error": {"message": "bad model", "type": "invalid_request_error"}})
    llm = make_llm(server.url)
    with pytest.raises(LLMError, match="400") as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert "bad model" in str(info.value)
    assert len(server.received) == 1
    assert llm.stats.calls == 1 and llm.stats.retries == 0


def test_4xx_with_plain_text_body_reports_the_text(server: ScriptedServer) -> None:
    server.default = ("status", 404, b"no such route " + b"x" * 2000)
    llm = make_llm(server.url)
    with pytest.raises(LLMError, match="404") as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert "no such route" in str(info.value) and len(str(info.value)) < 800
    assert len(server.received) == 1


def test_exhausted_retries_name_the_attempts(server: ScriptedServer) -> None:
    server.default = ("status", 503, {"error": {"message": "overloaded"}})
    llm = make_llm(server.url, max_retries=2)
    with pytest.raises(LLMError) as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    message = str(info.value)
    assert "3 attempts" in message and "503" in message and "overloaded" in message
    assert f"{server.url}/chat/completions" in message
    assert len(server.received) == 3
    assert llm.stats.calls == 3 and llm.stats.retries == 2


def test_connection_refused_is_retried_then_fails() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    llm = make_llm(f"http://127.0.0.1:{port}/v1", max_retries=2)
    with pytest.raises(LLMError, match="3 attempts") as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert "ConnectError" in str(info.value)
    assert llm.stats.calls == 3 and llm.stats.retries == 2


def test_non_json_200_is_a_clear_error(server: ScriptedServer) -> None:
    server.default = ("raw", b"<html>proxy page</html>")
    llm = make_llm(server.url)
    with pytest.raises(LLMError, match="not JSON"):
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    server.default = ("raw", b'{"id": "x"}')
    with pytest.raises(LLMError, match="choices"):
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))


# ------------------------------------------------------------------------------------------------ auth, spec


def test_api_key_from_env_is_sent_as_bearer_and_absent_when_unset(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLEUTH_TEST_KEY", "sk-secret-123")
    llm = make_llm(server.url, key_env="SLEUTH_TEST_KEY")
    run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert server.received[0].headers["authorization"] == "Bearer sk-secret-123"
    assert "sk-secret-123" not in json.dumps(llm.describe())

    monkeypatch.delenv("SLEUTH_TEST_KEY")
    llm = make_llm(server.url, key_env="SLEUTH_TEST_KEY")
    run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert "authorization" not in server.received[1].headers


def test_spec_parsing_and_describe() -> None:
    llm = make_llm("http://127.0.0.1:9/v1/", model="org/model@rev", concurrency=3)
    assert (llm.model, llm.base_url, llm.concurrency) == ("org/model@rev", "http://127.0.0.1:9/v1", 3)
    info = llm.describe()
    assert info["model"] == "org/model@rev" and info["base_url"] == "http://127.0.0.1:9/v1"
    assert info["backend"] == "OpenAICompatLLM" and info["spec"].startswith("openai:org/model@rev@")
    default = _BACKENDS["openai"]("gpt-4o-mini", {})
    assert default.base_url == "https://api.openai.com/v1" and default.model == "gpt-4o-mini"
    with pytest.raises(LLMError, match="environment"):
        _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"api_key": "sk-nope"})
    with pytest.raises(LLMError, match="unknown"):
        _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"concurrncy": "2"})
    with pytest.raises(LLMError, match="timeout"):
        _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"timeout": "soon"})
    assert _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"token_out": "1"}).describe()["token_out"] is True
    assert default.token_out is False
    with pytest.raises(LLMError, match="token_out"):
        _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"token_out": "maybe"})


# ------------------------------------------------------------------------------------------------ concurrency


def test_concurrency_is_bounded(server: ScriptedServer) -> None:
    server.delay = 0.1
    llm = make_llm(server.url, concurrency=2)
    gens = run(_generate_and_close(llm, [Request.chat(f"q{i}") for i in range(6)], Sampling()))
    assert len(gens) == 6 and len(server.received) == 6
    assert server.max_in_flight == 2  # concurrent, but never more than two at once


def test_backend_survives_several_event_loops(server: ScriptedServer) -> None:
    llm = make_llm(server.url, concurrency=2)
    first = asyncio.run(llm.generate([Request.chat("a")], Sampling()))  # no aclose: the next loop builds its own
    second = run(_generate_and_close(llm, [Request.chat("b")], Sampling()))
    assert first[0].texts[0].startswith("answer to a") and second[0].texts[0].startswith("answer to b")


# ------------------------------------------------------------------------------------------------ score


async def _score_and_close(llm: OpenAICompatLLM, prompt: Any, completion: str) -> Any:
    try:
        return await llm.score(prompt, completion)
    finally:
        await llm.aclose()


def test_score_sums_only_the_completion_tokens(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    prompt, completion = "The capital of France is", " Paris indeed"
    score = run(_score_and_close(llm, prompt, completion))
    # Toy tokens: The(None) capital(-0.5) of(-1.0) France(-1.5) is(-2.0) Paris(-2.5) indeed(-3.0) GEN(-100)
    assert score.tokens == [" Paris", " indeed"]
    assert score.token_logprobs == [-2.5, -3.0]
    assert score.logprob == pytest.approx(-5.5)
    sent = server.received[0]
    assert sent.path == "/v1/completions"
    assert sent.body["prompt"] == prompt + completion
    assert sent.body["echo"] is True and sent.body["logprobs"] == 1 and sent.body["max_tokens"] == 1
    assert sent.body["temperature"] == 0


def test_score_errors(server: ScriptedServer) -> None:
    llm = make_llm(server.url)
    with pytest.raises(LLMError, match="chat messages"):
        run(_score_and_close(llm, [{"role": "user", "content": "hi"}], " there"))
    assert server.received == []
    server.logprobs = False
    with pytest.raises(LLMError, match="does not support echo logprobs"):
        run(_score_and_close(llm, "hi", " there"))


class ToyTokenizer:
    """One token per character (its code point), a ``<role>content`` chat template, BOS id 1."""

    chat_template = "toy"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


def test_score_with_the_tokenizer_sends_token_ids_and_sums_the_completion_ids(server: ScriptedServer) -> None:
    llm = OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer())
    messages = [{"role": "user", "content": "hi"}]
    score = run(_score_and_close(llm, messages, "ok"))
    assert score.tokens == ["o", "k"]
    assert score.token_logprobs == [-ord("o") / 100, -ord("k") / 100]
    assert score.logprob == pytest.approx(-(ord("o") + ord("k")) / 100)
    sent = server.received[0]
    assert sent.path == "/v1/completions"
    # the prompt tokenized as the hf backend does (chat template + generation prompt, no special tokens added),
    # the completion tokenized apart: the boundary is exact whatever a BPE would merge across it
    assert sent.body["prompt"] == [ord(c) for c in "<user>hi<assistant>"] + [ord("o"), ord("k")]
    assert sent.body["prompt_logprobs"] == 0 and sent.body["max_tokens"] == 1 and "echo" not in sent.body
    score = run(_score_and_close(llm, "ab", "c"))  # a string prompt keeps the tokenizer's special tokens
    assert server.received[1].body["prompt"] == [1, ord("a"), ord("b"), ord("c")]
    assert score.token_logprobs == [-ord("c") / 100]
    assert run(_score_and_close(llm, messages, "")).token_logprobs == []
    assert len(server.received) == 2


def test_score_with_the_tokenizer_on_a_server_without_prompt_logprobs(server: ScriptedServer) -> None:
    server.logprobs = False
    llm = OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer())
    with pytest.raises(LLMError, match="does not support prompt_logprobs"):
        run(_score_and_close(llm, [{"role": "user", "content": "hi"}], "ok"))


class _HFStandIn(OpenAICompatLLM):
    """Counts the scores the hf fallback was asked for."""

    def __init__(self) -> None:
        super().__init__("hf-stand-in", "http://127.0.0.1:9/v1")
        self.scored = 0

    async def score(self, prompt: Any, completion: str) -> Any:
        self.scored += 1
        return Score(logprob=-1.0, token_logprobs=[-1.0], tokens=["x"])


def test_exsearch_scores_on_an_engine_that_can_else_on_hf(server: ScriptedServer) -> None:
    from sleuth.train.exsearch_em import EngineAndScorer

    def both(engine: OpenAICompatLLM, on_engine: bool = True) -> tuple[EngineAndScorer, _HFStandIn]:
        hf = _HFStandIn()
        return EngineAndScorer(engine, lambda: hf, on_engine), hf

    messages = [{"role": "user", "content": "hi"}]
    llm, hf = both(OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer()))
    assert llm.scores_on_engine and llm.scorer_name() == "engine"
    assert run(llm.score(messages, "ok")).tokens == ["o", "k"] and hf.scored == 0 and llm.scorer is None
    probes = len(server.received)
    llm, hf = both(OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer()), on_engine=False)
    assert llm.scorer_name() == "hf" and run(llm.score(messages, "ok")).logprob == -1.0 and hf.scored == 1
    llm, hf = both(OpenAICompatLLM("test-model", server.url))  # no tokenizer: chat prompts cannot be scored
    assert llm.scorer_name() == "hf" and run(llm.score(messages, "ok")).logprob == -1.0
    assert len(server.received) == probes  # neither asked the server
    server.logprobs = False  # a tokenizer, but a server without prompt_logprobs: refused once, then hf
    llm, hf = both(OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer()))
    assert not llm.scores_on_engine and "prompt_logprobs" in (llm.engine_refused or "")
    assert llm.scorer_name().startswith("hf (the engine cannot score")
    assert run(llm.score(messages, "ok")).logprob == -1.0 and hf.scored == 1


# ------------------------------------------------------------------------------------------------ deadlines


class StallingServer:
    """A raw socket server on 127.0.0.1 that reads a request's headers, then either trickles a response one byte
    every ``interval`` seconds or sends nothing at all. Every loop is bounded, and ``close`` ends them."""

    def __init__(self, trickle: bool, interval: float = 0.5, max_seconds: float = 60.0) -> None:
        self.trickle, self.interval, self.max_seconds = trickle, interval, max_seconds
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn, deadline), daemon=True).start()

    def _handle(self, conn: socket.socket, deadline: float) -> None:
        with conn:
            conn.settimeout(0.1)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 1 << 16 and time.monotonic() < deadline:
                try:
                    chunk = conn.recv(4096)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                head += chunk
            body = b'{"choices": [{"index": 0, "message": {"content": "' + b"x" * 200 + b'"}}]}'
            pending = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            pending += b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.trickle and pending:
                    try:
                        conn.sendall(pending[:1])
                    except OSError:
                        return  # the client gave up
                    pending = pending[1:]
                self.stop.wait(self.interval)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def trickling() -> Iterator[StallingServer]:
    server = StallingServer(trickle=True)
    yield server
    server.close()


@pytest.fixture
def silent() -> Iterator[StallingServer]:
    server = StallingServer(trickle=False)
    yield server
    server.close()


def test_a_trickling_server_cannot_stretch_an_attempt_past_its_timeout(trickling: StallingServer) -> None:
    llm = make_llm(trickling.url, timeout=2, max_retries=0)
    start = time.monotonic()
    with pytest.raises(LLMError, match="timed out after 2 s") as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    elapsed = time.monotonic() - start
    assert 1.5 < elapsed < 6.0, elapsed  # one byte every 0.5 s would keep it open for 30 s+
    assert "1 attempt" in str(info.value)


def test_a_silent_server_is_given_up_on_at_the_calls_deadline(silent: StallingServer) -> None:
    llm = make_llm(silent.url, timeout=1, max_retries=20, backoff=0.01, deadline=2.5)
    start = time.monotonic()
    with pytest.raises(LLMError, match="deadline of 2.5 s passed") as info:
        run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    elapsed = time.monotonic() - start
    assert 2.0 < elapsed < 7.0, elapsed  # 21 attempts of 1 s each would take 21 s
    assert 2 <= llm.stats.calls <= 4 and silent.connections == llm.stats.calls
    assert "timed out" in str(info.value)


def test_deadline_is_a_spec_option(server: ScriptedServer) -> None:
    llm = make_llm(server.url, deadline=7)
    assert llm.deadline == 7.0 and llm.describe()["deadline"] == 7.0
    assert _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {}).deadline == 300.0
    with pytest.raises(LLMError, match="deadline"):
        _BACKENDS["openai"]("m@http://127.0.0.1:9/v1", {"deadline": "0"})


def test_a_lone_surrogate_in_a_reply_or_a_prompt_is_made_encodable(server: ScriptedServer) -> None:
    reply = b'{"choices": [{"index": 0, "message": {"content": "ANS-7 \\ud800"}}], "usage": {}}'
    server.queue(("raw", reply))
    llm = make_llm(server.url)
    gens = run(_generate_and_close(llm, [Request.chat("q")], Sampling()))
    assert gens[0].texts == ["ANS-7 \ufffd"]
    gens[0].texts[0].encode("utf-8")
    gens = run(_generate_and_close(llm, [Request.chat("echo \ud800")], Sampling()))  # httpx's json= would raise
    assert server.received[-1].body["messages"][-1]["content"] == "echo \ufffd"
    assert gens[0].texts[0].startswith("answer to echo \ufffd")


def test_token_out_sends_the_formatted_prompt_as_ids_and_returns_the_sampled_ids_and_log_probs(
    server: ScriptedServer,
) -> None:
    llm = OpenAICompatLLM("test-model", server.url, score_tokenizer=ToyTokenizer(), token_out=True)
    messages = [{"role": "user", "content": "hi"}]
    (gen,) = run(_generate_and_close(llm, [Request(messages=messages)], Sampling(n=2, stop=("STOP",))))
    sent = server.received[0]
    assert sent.path == "/v1/completions" and "messages" not in sent.body
    assert sent.body["prompt"] == [ord(c) for c in "<user>hi<assistant>"]  # as the hf backend formats it
    assert sent.body["return_token_ids"] is True and sent.body["logprobs"] == 0
    assert gen.prompt_ids == sent.body["prompt"]
    assert gen.sampled_ids == [[ord(c) for c in "answer"]] * 2
    assert gen.logprobs == [[-ord(c) / 1000 for c in "answer"]] * 2
    assert all("STOP" not in t for t in gen.texts)


def test_request_ids_are_sent_as_ids_and_a_server_without_ids_gives_none(server: ScriptedServer) -> None:
    llm = OpenAICompatLLM("test-model", server.url)
    request = Request(messages=[{"role": "user", "content": "hi"}], prompt_ids=[5, 6, 7])
    (gen,) = run(_generate_and_close(llm, [request], Sampling()))
    assert server.received[0].path == "/v1/completions" and server.received[0].body["prompt"] == [5, 6, 7]
    assert "return_token_ids" not in server.received[0].body and gen.sampled_ids is None
    server.logprobs = False  # a server that ignores return_token_ids: no ids, the text still comes back
    llm = OpenAICompatLLM("test-model", server.url, token_out=True)  # no tokenizer: chat stays chat
    (gen,) = run(_generate_and_close(llm, [Request(messages=[{"role": "user", "content": "hi"}])], Sampling()))
    assert server.received[1].path == "/v1/chat/completions" and server.received[1].body["return_token_ids"]
    assert gen.text.startswith("answer to hi") and gen.sampled_ids is None and gen.prompt_ids is None
