"""The retrieval server (sleuth.serve) and its client (RemoteRetriever), over real HTTP on 127.0.0.1.

Servers are real uvicorn servers in background threads on ephemeral ports, serving a small BM25 index built in a
temporary directory. Search-R1-style answers, scripted failures (503, 429, slow answers) and a server without
``/health`` come from a tiny stdlib HTTP server (``ScriptedServer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from sleuth.records import Passage  # noqa: E402
from sleuth.retrieval.base import RetrievalError, Retriever  # noqa: E402
from sleuth.retrieval.bm25 import BM25Retriever, build_bm25_index  # noqa: E402
from sleuth.retrieval.remote import RemoteRetriever, load_remote  # noqa: E402
from sleuth.serve import create_app, guarded_protocol, uvicorn_options  # noqa: E402
from tests.test_bm25 import TOPICS, write_corpus  # noqa: E402

TOKEN = "test-token-not-a-secret"
QUERIES = ["Who researched radioactivity?", "tallest mountain in the Himalayas", "readable programming language"]
EXPECTED_TOP = ["t0", "t3", "t4"]
TOPIC_QUERIES = [  # (query, id of the passage that must come first)
    ("Who researched radioactivity?", "t0"),
    ("wrought-iron lattice tower in Paris", "t1"),
    ("plants convert light energy", "t2"),
    ("tallest mountain in the Himalayas", "t3"),
    ("readable programming language", "t4"),
]
MAX_BODY = 4096
MAX_QUERIES = 8
MAX_TOPK = 20


# ------------------------------------------------------------------------------------------------ helpers


class CountingRetriever(Retriever):
    """The real BM25 retriever, with every ``search`` call recorded (and optionally held back)."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.hold_first_until: Callable[[], bool] | None = None  # a condition the first call waits for (<= 10 s)
        self.calls: list[list[str]] = []
        self.gate: threading.Event | None = None  # when set, search waits for it (at most 10 s)
        self.entered = threading.Event()
        self._lock = threading.Lock()

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        with self._lock:
            self.calls.append(list(queries))
            first = len(self.calls) == 1
        self.entered.set()
        if first and self.hold_first_until is not None:
            deadline = time.monotonic() + 10
            while not self.hold_first_until() and time.monotonic() < deadline:
                time.sleep(0.005)
        if self.gate is not None and not self.gate.wait(10):
            raise RuntimeError("the test never opened the gate")
        if "boom" in queries:
            raise RetrievalError("index exploded on 'boom'")
        return self.inner.search(queries, k)

    def __len__(self) -> int:
        return len(self.inner)


class CountRequests:
    """ASGI wrapper recording the path of every HTTP request the app receives."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)

    def count(self, path: str = "/retrieve") -> int:
        return sum(1 for p in self.paths if p == path)


@contextlib.contextmanager
def serving(app: Any, **limits: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 and an ephemeral port in a thread; yield its base URL.

    The server has the options ``run_server`` gives uvicorn (its guarded protocol); ``limits`` go to
    :func:`sleuth.serve.uvicorn_options` (``head_timeout``, ``max_connections``).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=2,
        **uvicorn_options(**limits),
    )
    server = uvicorn.Server(config)  # signal handlers are only installed from the main thread: none here
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            if not thread.is_alive():
                raise RuntimeError("the server thread died while starting")
            if server.started:
                try:
                    if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health within 15 s")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class Live:
    url: str
    retriever: CountingRetriever
    requests: CountRequests


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    build_bm25_index(write_corpus(root / "corpus.jsonl", n_filler=60), root / "idx")
    return root / "idx"


@pytest.fixture(scope="module")
def bm25(index_dir: Path) -> BM25Retriever:
    return BM25Retriever(index_dir)


@pytest.fixture(scope="module")
def live(bm25: BM25Retriever) -> Iterator[Live]:
    counting = CountingRetriever(bm25)
    app = CountRequests(
        create_app(counting, max_topk=MAX_TOPK, max_queries=MAX_QUERIES, max_body_bytes=MAX_BODY, batching=True)
    )
    with serving(app) as url:
        yield Live(url, counting, app)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        yield c


def good_request_works(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> None:
    r = client.post(f"{url}/retrieve", json={"queries": QUERIES[:1], "topk": 2}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["result"][0][0]["id"] == "t0"


# ------------------------------------------------------------------------------------------------ response shape


def test_retrieve_with_scores_has_search_r1_shape(live: Live, client: httpx.Client, bm25: BM25Retriever) -> None:
    r = client.post(f"{live.url}/retrieve", json={"queries": QUERIES, "topk": 4, "return_scores": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    data = r.json()
    assert list(data) == ["result"]
    assert isinstance(data["result"], list) and len(data["result"]) == len(QUERIES)
    local = bm25.search(QUERIES, 4)
    for hits, local_hits in zip(data["result"], local, strict=True):
        assert len(hits) == 4
        for hit, passage in zip(hits, local_hits, strict=True):
            assert set(hit) == {"document", "score"}
            assert set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["document"]["id"], str) and isinstance(hit["document"]["contents"], str)
            assert isinstance(hit["score"], float)
            assert hit["document"]["id"] == passage.id and hit["score"] == pytest.approx(passage.score)
        scores = [h["score"] for h in hits]
        assert scores == sorted(scores, reverse=True)
    assert [hits[0]["document"]["id"] for hits in data["result"]] == EXPECTED_TOP
    title, text = TOPICS[0]
    assert data["result"][0][0]["document"]["contents"] == f'"{title}"\n{text}'


def test_retrieve_without_scores_returns_plain_documents(live: Live, client: httpx.Client) -> None:
    reordered = list(reversed(QUERIES))
    r = client.post(f"{live.url}/retrieve", json={"queries": reordered})  # topk defaults to 3, scores to false
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 3 and all(len(hits) == 3 for hits in result)
    assert all(set(hit) == {"id", "contents"} for hits in result for hit in hits)
    assert [hits[0]["id"] for hits in result] == list(reversed(EXPECTED_TOP))
    title, text = TOPICS[4]
    assert result[0][0]["contents"] == f'"{title}"\n{text}'
    r = client.post(f"{live.url}/retrieve", json={"queries": QUERIES[:1], "topk": 1, "return_scores": False})
    assert r.json() == {"result": [[{"id": "t0", "contents": f'"{TOPICS[0][0]}"\n{TOPICS[0][1]}'}]]}


def test_health(live: Live, client: httpx.Client, bm25: BM25Retriever) -> None:
    r = client.get(f"{live.url}/health")
    assert r.status_code == 200
    data = r.json()
    assert data["status"] == "ok" and data["passages"] == len(bm25) == len(TOPICS) + 60
    assert data["retriever"]["retriever"] == "CountingRetriever" and data["retriever"]["passages"] == len(bm25)


# ------------------------------------------------------------------------------------------------ bad requests


def _chunked_oversized_body() -> Iterator[bytes]:
    # Valid JSON: without the check on the bytes actually read it would be searched and answered with 200.
    yield b'{"queries": ["'
    for _ in range(4 * MAX_BODY // 1024):
        yield b"a" * 1024
    yield b'"]}'


BAD_REQUESTS = {
    "missing queries": ({"json": {"topk": 3}}, 422, "queries: Field required"),
    "topk too large": ({"json": {"queries": ["x"], "topk": MAX_TOPK + 1}}, 422, f"less than or equal to {MAX_TOPK}"),
    "topk zero": ({"json": {"queries": ["x"], "topk": 0}}, 422, "topk: Input should be greater than or equal to 1"),
    "topk not int": ({"json": {"queries": ["x"], "topk": "3"}}, 422, "topk: Input should be a valid integer"),
    "too many queries": ({"json": {"queries": ["x"] * (MAX_QUERIES + 1)}}, 422, f"at most {MAX_QUERIES} items"),
    "empty queries": ({"json": {"queries": []}}, 422, "queries: List should have at least 1 item"),
    "non-string query": ({"json": {"queries": ["ok", 5]}}, 422, "queries.1: Input should be a valid string"),
    "queries not a list": ({"json": {"queries": "abc"}}, 422, "queries: Input should be a valid list"),
    "return_scores not bool": ({"json": {"queries": ["x"], "return_scores": "yes"}}, 422, "return_scores"),
    "not json": ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
    "json array": ({"content": b"[1, 2]"}, 422, "must be a JSON object, not list"),
    "nested too deeply": ({"content": b"[" * (MAX_BODY - 1)}, 400, "not valid JSON: nested too deeply"),
    "oversized with content-length": (
        {"json": {"queries": ["a" * MAX_BODY]}},
        413,
        f"bytes exceeds the limit of {MAX_BODY}",
    ),
    "oversized chunked": ({"content": "chunked"}, 413, f"exceeds the limit of {MAX_BODY} bytes"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_server_keeps_serving(live: Live, client: httpx.Client, case: str) -> None:
    kwargs, status, message = BAD_REQUESTS[case]
    if kwargs.get("content") == "chunked":
        kwargs = {"content": _chunked_oversized_body()}
    request = client.build_request("POST", f"{live.url}/retrieve", **kwargs)
    if case == "oversized chunked":
        assert "content-length" not in request.headers and request.headers["transfer-encoding"] == "chunked"
    if case == "oversized with content-length":
        assert int(request.headers["content-length"]) > MAX_BODY
    calls_before = len(live.retriever.calls)
    r = client.send(request)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and message in detail
    if case == "oversized with content-length":  # refused from the header, before reading the body
        assert str(int(request.headers["content-length"])) in detail
    assert len(live.retriever.calls) == calls_before  # nothing was searched
    good_request_works(client, live.url)


def test_search_failure_is_a_500_and_server_keeps_serving(live: Live, client: httpx.Client) -> None:
    r = client.post(f"{live.url}/retrieve", json={"queries": ["boom"]})
    assert r.status_code == 500 and "index exploded on 'boom'" in r.json()["detail"]
    good_request_works(client, live.url)


def test_nested_json_repro_is_a_400_with_detail_on_default_limits(bm25: BM25Retriever, client: httpx.Client) -> None:
    with serving(create_app(bm25)) as url:
        r = client.post(f"{url}/retrieve", content=b"[" * 100_000)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert r.json() == {"detail": "request body is not valid JSON: nested too deeply"}
        good_request_works(client, url)


def _read_response(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``limit_s`` passes)."""
    sock.settimeout(0.2)
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    return data


def test_a_stalled_body_is_a_408_and_the_connection_is_closed(bm25: BM25Retriever, client: httpx.Client) -> None:
    with serving(create_app(bm25, body_timeout=1.0)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            start = time.monotonic()
            head = (
                b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n"
            )
            sock.sendall(head + b'{"queries": ["res')  # ... and nothing more
            data = _read_response(sock, limit_s=15)
            elapsed = time.monotonic() - start
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1]) == {
            "detail": "request body not received within 1 s (17 bytes arrived)"
        }
        assert 0.8 < elapsed < 6.0, elapsed  # closed by the server soon after the timeout, not held open
        good_request_works(client, url)
    with pytest.raises(ValueError, match="body_timeout"):
        create_app(bm25, body_timeout=0)


def _until_closed(socks: list[socket.socket], limit_s: float, trickle: socket.socket | None = None) -> list[Closed]:
    """Read every socket until the server closes it (or ``limit_s`` passes); meanwhile send ``trickle`` one byte of a
    never-ending header every 0.2 s. A reset counts as closed (a server closing with unread bytes sends RST)."""
    start = time.monotonic()
    results = [Closed() for _ in socks]
    pending = dict(enumerate(socks))
    trickled = 0
    while pending and time.monotonic() - start < limit_s:
        if trickle is not None and trickle in pending.values():
            with contextlib.suppress(OSError):
                trickle.send(b"X-Slow: abcdefgh\r\n"[trickled % 18 : trickled % 18 + 1])
                trickled += 1
        readable, _, _ = select.select(list(pending.values()), [], [], 0.2)
        for sock in readable:
            i = socks.index(sock)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
                results[i].reset = True
            if chunk:
                results[i].data += chunk
            else:
                results[i].after = time.monotonic() - start
                del pending[i]
    return results


@dataclass
class Closed:
    data: bytes = b""
    after: float | None = None  # seconds until the server closed the connection; None: still open
    reset: bool = False

    @property
    def status(self) -> int | None:
        return int(self.data.split(b" ", 2)[1]) if self.data.startswith(b"HTTP/1.1 ") else None

    def detail(self) -> str:
        head, _, body = self.data.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head.lower(), self.data
        detail = json.loads(body)["detail"]
        assert isinstance(detail, str)
        return detail


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


PARTIAL_HEAD = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Len"


def test_a_stalled_or_trickling_request_head_is_cut_off(bm25: BM25Retriever, client: httpx.Client) -> None:
    # The reproduction: without a head timeout, a silent connection was still open at 40 s and one sending a byte
    # every 2 s at 44 s. With head_timeout=1 every one of these is closed soon after 1 s.
    with serving(create_app(bm25), head_timeout=1.0) as url:
        port = _port(url)
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        partial = socket.create_connection(("127.0.0.1", port), timeout=5)
        trickling = socket.create_connection(("127.0.0.1", port), timeout=5)
        kept_alive = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks = [silent, partial, trickling, kept_alive]
        try:
            partial.sendall(PARTIAL_HEAD)
            trickling.sendall(b"GET /health HTTP/1.1\r\n")
            # A first request completes on the kept-alive connection; the head of its second never does.
            kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while b"}" not in first:  # the /health body is one JSON object
                chunk = kept_alive.recv(65536)
                assert chunk, first
                first += chunk
            assert first.startswith(b"HTTP/1.1 200 "), first
            kept_alive.sendall(b"GET /hea")
            results = _until_closed(socks, limit_s=10, trickle=trickling)
        finally:
            for sock in socks:
                sock.close()
        for name, result in zip(["silent", "partial", "trickling", "kept-alive"], results, strict=True):
            assert result.after is not None, f"{name}: still open after 10 s"
            assert 0.5 < result.after < 8.0, (name, result.after)
        assert results[0].data == b""  # nothing was asked: closed without an answer
        for result, sent in [(results[1], len(PARTIAL_HEAD)), (results[3], len(b"GET /hea"))]:
            assert result.status == 408
            assert result.detail() == f"request head not complete within 1 s ({sent} bytes arrived)"
        assert results[2].status == 408 and "request head not complete within 1 s" in results[2].detail()
        good_request_works(client, url)  # the server itself is unharmed
    with pytest.raises(ValueError, match="head_timeout"):
        guarded_protocol(0, 10)
    with pytest.raises(ValueError, match="max_connections"):
        guarded_protocol(1.0, 0)


def test_stalled_connections_beyond_the_cap_cannot_lock_clients_out(bm25: BM25Retriever) -> None:
    # The reproduction, scaled down: 300 stalled connections against 256 descriptors locked every client out. Here 40
    # stall against a cap of 32: no more than 32 are ever held, all are cut off, then a fresh client is served.
    with serving(create_app(bm25), head_timeout=1.0, max_connections=32) as url:
        port = _port(url)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        try:
            for sock in socks:
                with contextlib.suppress(OSError):  # a refused connection may already be closed
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            results = _until_closed(socks, limit_s=10)
        finally:
            for sock in socks:
                sock.close()
        assert all(r.after is not None and r.after < 8.0 for r in results), [r.after for r in results]
        timed_out = [r for r in results if r.status == 408]
        assert 1 <= len(timed_out) <= 32  # beyond the cap nothing is held until the head timeout
        assert all(r.status in (None, 503) for r in results if r not in timed_out)
        with httpx.Client(timeout=5, trust_env=False) as fresh:
            r = fresh.get(f"{url}/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_connection_beyond_the_cap_is_a_503_with_detail(bm25: BM25Retriever) -> None:
    with serving(create_app(bm25), head_timeout=30.0, max_connections=2) as url:
        port = _port(url)
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.2)  # let the server accept both before the third arrives (acceptance is asynchronous)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
                (result,) = _until_closed([third], limit_s=10)
            assert result.after is not None and result.after < 8.0
            assert result.status == 503
            assert result.detail() == "server busy: 2 connections are open; retry later"
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 10  # the server sees the two closes asynchronously
        with httpx.Client(timeout=5, trust_env=False) as fresh:
            while True:
                r = fresh.get(f"{url}/health")
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("length", [b"-1", str(10**30).encode(), b"12abc"])
def test_a_malformed_content_length_is_a_400_with_detail(
    bm25: BM25Retriever, client: httpx.Client, length: bytes
) -> None:
    with serving(create_app(bm25)) as url:
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=5) as sock:
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}")
            (result,) = _until_closed([sock], limit_s=10)
        assert result.after is not None
        assert result.status == 400, result.data
        assert result.detail() == "invalid HTTP request: bad Content-Length"
        good_request_works(client, url)


def test_lone_surrogates_in_queries_and_passages_are_served_as_utf8(client: httpx.Client) -> None:
    from tests.scripted import ListRetriever

    seen = ListRetriever([Passage("1", "T\ud800", "text \udfff here", score=1.0)])
    with serving(create_app(seen)) as url:
        r = client.post(f"{url}/retrieve", content=b'{"queries": ["who \\ud800"], "return_scores": true}')
        assert r.status_code == 200, r.text
        r.content.decode("utf-8")
        assert r.json()["result"][0][0]["document"]["contents"] == '"T\ufffd"\ntext \ufffd here'
        assert seen.queries == ["who \ufffd"]


# ------------------------------------------------------------------------------------------------ bearer token


def test_bearer_token(bm25: BM25Retriever, client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    app = CountRequests(create_app(bm25, token=TOKEN))
    with serving(app) as url:
        body = {"queries": QUERIES[:1]}
        r = client.post(f"{url}/retrieve", json=body)
        assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
        r = client.post(f"{url}/retrieve", json=body, headers={"Authorization": f"Bearer {TOKEN}x"})
        assert r.status_code == 401 and "wrong bearer token" in r.json()["detail"]
        r = client.post(f"{url}/retrieve", json=body, headers={"Authorization": TOKEN})  # no "Bearer "
        assert r.status_code == 401
        good_request_works(client, url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert client.get(f"{url}/health").status_code == 200

        # The client fails fast on 401 (no retries despite max_retries and a long backoff) with a clear message.
        before = app.count()
        started = time.monotonic()
        with pytest.raises(RetrievalError, match=r"HTTP 401.*missing bearer token") as info:
            RemoteRetriever(url, max_retries=3, backoff=5).search(QUERIES[:1], 2)
        assert time.monotonic() - started < 3 and app.count() == before + 1
        assert f"{url}/retrieve" in str(info.value)

        monkeypatch.setenv("SLEUTH_TEST_TOKEN", TOKEN)
        with load_remote(url, {"token_env": "SLEUTH_TEST_TOKEN"}) as remote:
            assert [h.id for h in remote.search(QUERIES[:1], 2)[0]][0] == "t0"
            assert TOKEN not in json.dumps(remote.describe())
        monkeypatch.delenv("SLEUTH_TEST_TOKEN")
        with pytest.raises(RetrievalError, match="SLEUTH_TEST_TOKEN is unset"):
            RemoteRetriever(url, token_env="SLEUTH_TEST_TOKEN")


# ------------------------------------------------------------------------------------------------ coalescing


async def _concurrent_requests(url: str, queries: list[str]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(queries))
    async with httpx.AsyncClient(timeout=20, trust_env=False, limits=limits) as client:
        return await asyncio.gather(
            *(client.post(f"{url}/retrieve", json={"queries": [q], "topk": 3}) for q in queries)
        )


@pytest.mark.parametrize("batching", [True, False])
def test_concurrent_requests_are_coalesced_only_with_batching(bm25: BM25Retriever, batching: bool) -> None:
    counting = CountingRetriever(bm25)
    if batching:
        # The first search is held until all 16 queries reached the server's batcher, so the other requests queue
        # up behind a running search however slowly this (shared) machine delivers them.
        counting.hold_first_until = lambda: counting.batch_stats.items >= 16
    cases = [TOPIC_QUERIES[i % len(TOPIC_QUERIES)] for i in range(16)]
    queries = [f"{q} #{i}" for i, (q, _) in enumerate(cases)]  # all distinct
    with serving(create_app(counting, batching=batching)) as url:
        responses = asyncio.run(_concurrent_requests(url, queries))
    assert [r.status_code for r in responses] == [200] * 16
    # Every request got the answer to its own query, not another request's.
    assert [r.json()["result"][0][0]["id"] for r in responses] == [top for _, top in cases]
    assert sorted(q for call in counting.calls for q in call) == sorted(queries)
    stats = counting.batch_stats
    if batching:
        # The first call took what had arrived when it started; everything else waited for one more call.
        assert len(counting.calls) <= 2 and max(len(call) for call in counting.calls) > 1
        assert stats.items == 16 and stats.calls == len(counting.calls)
    else:
        assert len(counting.calls) == 16 and all(len(call) == 1 for call in counting.calls)
        assert stats.items == 0


@pytest.mark.parametrize("batching", [True, False])
def test_search_never_blocks_the_event_loop(bm25: BM25Retriever, client: httpx.Client, batching: bool) -> None:
    counting = CountingRetriever(bm25)
    counting.gate = threading.Event()
    with serving(create_app(counting, batching=batching)) as url:
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{url}/retrieve", json={"queries": QUERIES[:1]}, timeout=15, trust_env=False)
            )
        )
        thread.start()
        try:
            assert counting.entered.wait(10), "the search never started"
            # The search is held inside search(); the loop must still answer other requests.
            assert client.get(f"{url}/health", timeout=3).json()["status"] == "ok"
            assert not answers
        finally:
            counting.gate.set()
            thread.join(15)
        assert answers and answers[0].status_code == 200 and answers[0].json()["result"][0][0]["id"] == "t0"


# ------------------------------------------------------------------------------------------------ RemoteRetriever


def test_remote_matches_local(live: Live, bm25: BM25Retriever) -> None:
    queries = [q for q, _ in TOPIC_QUERIES] + ["river stone market"]
    local = bm25.search(queries, 5)
    for url in (live.url, f"{live.url}/retrieve/"):
        with RemoteRetriever(url, max_retries=0) as remote:
            got = remote.search(queries, 5)
            assert len(got) == len(queries)
            for hits, local_hits in zip(got, local, strict=True):
                assert [(h.id, h.title, h.text) for h in hits] == [(p.id, p.title, p.text) for p in local_hits]
                assert [h.score for h in hits] == pytest.approx([p.score for p in local_hits])
            assert [hits[0].id for hits in got[:5]] == [top for _, top in TOPIC_QUERIES]
            assert len(remote) == len(bm25)
            assert remote.describe()["url"] == f"{live.url}/retrieve"
            assert remote.search([], 3) == []


def test_remote_asearch_goes_through_the_batcher(live: Live) -> None:
    remote = RemoteRetriever(live.url, max_retries=0)
    before = live.requests.count()

    async def main() -> list[list[Passage]]:
        return list(await asyncio.gather(*(remote.asearch(q, 2) for q, _ in TOPIC_QUERIES)))

    got = asyncio.run(main())
    assert [hits[0].id for hits in got] == [top for _, top in TOPIC_QUERIES]
    assert remote.batch_stats.calls == 1 and live.requests.count() == before + 1
    remote.close()


def test_remote_sends_chunks_of_batch_size(live: Live, bm25: BM25Retriever) -> None:
    queries = [q for q, _ in TOPIC_QUERIES]
    before = live.requests.count()
    remote = RemoteRetriever(live.url, batch_size=2, max_retries=0)
    got = remote.search(queries, 3)
    assert live.requests.count() == before + 3 and remote.stats.requests == 3
    assert [[h.id for h in hits] for hits in got] == [[p.id for p in hits] for hits in bm25.search(queries, 3)]
    remote.close()


# ------------------------------------------------------------------------------------------------ scripted server


@dataclass
class ScriptedServer:
    """A stdlib HTTP server answering POST /retrieve from a script of (status, body, headers, delay) entries."""

    url: str = ""
    script: deque[tuple[int, Any, dict[str, str], float]] = field(default_factory=deque)
    default: Any = None
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def queue(self, status: int, body: Any, headers: dict[str, str] | None = None, delay: float = 0.0) -> None:
        self.script.append((status, body, headers or {}, delay))


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    state = ScriptedServer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: Any, headers: dict[str, str]) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - like Search-R1's server: no /health
            self._answer(404, {"detail": "Not Found"}, {})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.received.append((self.path, body))
                entry = state.script.popleft() if state.script else (200, state.default, {}, 0.0)
            status, answer, headers, delay = entry
            if delay:
                time.sleep(delay)
            with contextlib.suppress(OSError):  # the client may have given up (timeout test)
                self._answer(status, answer, headers)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_remote_parses_search_r1_plain_documents(live: Live, scripted: ScriptedServer, bm25: BM25Retriever) -> None:
    # A real return_scores=false answer of the sleuth server, plus one document in the title/text form.
    plain = httpx.post(
        f"{live.url}/retrieve", json={"queries": QUERIES[:2], "topk": 3, "return_scores": False}, trust_env=False
    ).json()
    assert set(plain["result"][0][0]) == {"id", "contents"}
    plain["result"][1][2] = {"id": 42, "title": "Forty Two", "text": "The answer.", "source": "wiki"}
    scripted.default = plain
    remote = RemoteRetriever(f"{scripted.url}/retrieve", max_retries=0)
    got = remote.search(QUERIES[:2], 3)
    local = bm25.search(QUERIES[:2], 3)
    assert [(h.id, h.title, h.text) for h in got[0]] == [(p.id, p.title, p.text) for p in local[0]]
    assert [(h.id, h.title) for h in got[1][:2]] == [(p.id, p.title) for p in local[1][:2]]
    assert got[1][2] == Passage(id="42", title="Forty Two", text="The answer.", score=None, meta={"source": "wiki"})
    assert all(h.score is None for hits in got for h in hits)
    assert scripted.received == [("/retrieve", {"queries": QUERIES[:2], "topk": 3, "return_scores": True})]
    assert len(remote) == 0  # no /health on a Search-R1 server


def _ok(n_queries: int) -> dict[str, Any]:
    doc = {"document": {"id": "7", "contents": '"Seven"\nThe number seven.'}, "score": 1.5}
    return {"result": [[doc] for _ in range(n_queries)]}


def test_remote_retries_transient_failures(scripted: ScriptedServer) -> None:
    scripted.queue(503, {"detail": "warming up"})
    scripted.queue(429, {"detail": "slow down"}, {"Retry-After": "0"})
    scripted.queue(200, _ok(1), delay=1.0)  # past the client's timeout: retried
    scripted.default = _ok(1)
    remote = RemoteRetriever(scripted.url, max_retries=3, backoff=0.01, timeout=0.3)
    got = remote.search(["seven"], 1)
    assert got == [[Passage(id="7", title="Seven", text="The number seven.", score=1.5)]]
    assert len(scripted.received) == 4 and remote.stats.requests == 4 and remote.stats.retries == 3


def test_remote_gives_up_after_max_retries(scripted: ScriptedServer) -> None:
    scripted.default = {"detail": "warming up"}
    for _ in range(5):
        scripted.queue(503, {"detail": "warming up"})
    remote = RemoteRetriever(scripted.url, max_retries=2, backoff=0.01)
    with pytest.raises(RetrievalError, match=r"after 3 attempts \(2 retries\); last failure: HTTP 503: warming up"):
        remote.search(["q"], 1)
    assert len(scripted.received) == 3


def test_remote_fails_fast_on_client_errors_and_bad_answers(scripted: ScriptedServer) -> None:
    scripted.queue(422, {"detail": "topk: Input should be less than or equal to 100"})
    remote = RemoteRetriever(scripted.url, max_retries=3, backoff=5)
    with pytest.raises(RetrievalError, match=r"HTTP 422.*less than or equal to 100"):
        remote.search(["q"], 1000)
    assert len(scripted.received) == 1
    scripted.queue(200, _ok(1))
    with pytest.raises(RetrievalError, match="1 result lists for 2 queries"):
        remote.search(["a", "b"], 1)
    scripted.queue(200, b"<html>not json</html>")
    with pytest.raises(RetrievalError, match="not JSON"):
        remote.search(["a"], 1)
    scripted.queue(200, {"result": [[{"id": "1"}]]})
    with pytest.raises(RetrievalError, match="neither 'contents' nor 'text'"):
        remote.search(["a"], 1)
    assert len(scripted.received) == 4


def test_remote_raises_after_retries_on_a_closed_port() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    remote = RemoteRetriever(f"http://127.0.0.1:{port}", max_retries=2, backoff=0.01, timeout=2)
    with pytest.raises(RetrievalError) as info:
        remote.search(["q"], 1)
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/retrieve" in message and "3 attempts" in message and "ConnectError" in message
    assert remote.stats.requests == 3
    assert len(remote) == 0


# ------------------------------------------------------------------------------------------------ load_remote


def test_load_remote_options() -> None:
    remote = load_remote(
        "http://127.0.0.1:9/retrieve", {"timeout": "2.5", "max_retries": "1", "batch_size": "7", "backoff": "0"}
    )
    assert (remote.timeout, remote.max_retries, remote.batch_size, remote.backoff) == (2.5, 1, 7, 0.0)
    assert remote.retrieve_url == "http://127.0.0.1:9/retrieve" and remote.spec == "remote:http://127.0.0.1:9"
    assert load_remote("127.0.0.1:9", {}).retrieve_url == "http://127.0.0.1:9/retrieve"
    assert load_remote("127.0.0.1:9", {}).batch_size == 256
    with pytest.raises(RetrievalError, match="unknown remote retriever option"):
        load_remote("http://127.0.0.1:9", {"timout": "3"})
    with pytest.raises(RetrievalError, match="look like a credential"):
        load_remote("http://127.0.0.1:9", {"token": "abc"})
    with pytest.raises(RetrievalError, match="batch_size='x' is not a valid int"):
        load_remote("http://127.0.0.1:9", {"batch_size": "x"})
    with pytest.raises(RetrievalError, match="batch_size must be >= 1"):
        load_remote("http://127.0.0.1:9", {"batch_size": "0"})
    with pytest.raises(RetrievalError, match="not an http"):
        RemoteRetriever("ftp://127.0.0.1:9")


def test_server_token_comes_only_from_the_environment(bm25: BM25Retriever, monkeypatch: pytest.MonkeyPatch) -> None:
    from sleuth.serve import run_server, token_from_env

    monkeypatch.delenv("SLEUTH_TEST_TOKEN", raising=False)
    with pytest.raises(RetrievalError, match="SLEUTH_TEST_TOKEN .* is unset or empty"):
        run_server(bm25, port=1, token_env="SLEUTH_TEST_TOKEN")  # refused before uvicorn starts
    monkeypatch.setenv("SLEUTH_TEST_TOKEN", TOKEN)
    assert token_from_env("SLEUTH_TEST_TOKEN") == TOKEN
    with pytest.raises(ValueError, match="either token or token_env"):
        run_server(bm25, port=1, token_env="SLEUTH_TEST_TOKEN", token="other")
    with pytest.raises(ValueError, match="token is empty"):
        create_app(bm25, token="")


def test_remote_makes_passages_and_queries_encodable(scripted: ScriptedServer) -> None:
    doc = {"id": "7\ud800", "contents": '"T\ud800"\ntext \udfff'}  # json.dumps writes them as \ud800 escapes
    scripted.default = {"result": [[{"document": doc, "score": 1.5}]]}
    remote = RemoteRetriever(f"{scripted.url}/retrieve", max_retries=0)
    (hits,) = remote.search(["who \ud800"], 1)  # httpx's json= would raise UnicodeEncodeError on the query
    assert hits == [Passage(id="7\ufffd", title="T\ufffd", text="text \ufffd", score=1.5)]
    assert scripted.received[0][1]["queries"] == ["who \ufffd"]


def test_a_trickling_server_cannot_hold_a_remote_search_past_its_timeout() -> None:
    from tests.test_openai_backend import StallingServer

    server = StallingServer(trickle=True, interval=0.3)  # one byte every 0.3 s: every read succeeds on its own
    try:
        remote = RemoteRetriever(server.url.removesuffix("/v1"), timeout=1, max_retries=0)
        started = time.monotonic()
        with pytest.raises(RetrievalError, match="timed out after 1 s"):
            remote.search(["q"], 2)
        assert time.monotonic() - started < 4
        remote.close()
    finally:
        server.close()
