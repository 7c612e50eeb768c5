"""Serve a retriever over HTTP with Search-R1's retrieval contract (needs the ``serve`` extra: fastapi, uvicorn).

Endpoints::

    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": false}
        return_scores false -> {"result": [[{"id": "7", "contents": "\\"Title\\"\\ntext"}, ...], ...]}
        return_scores true  -> {"result": [[{"document": {"id": "7", "contents": "..."}, "score": 12.3}, ...], ...]}
    GET /health     {"status": "ok", "passages": N, "retriever": {...Retriever.describe()...}}

One inner list per query, in request order, best hit first. This is exactly what Search-R1's
``retrieval_server.py`` answers, so Search-R1 / FlashRAG clients (and
:class:`~sleuth.retrieval.remote.RemoteRetriever`) can use a sleuth index unchanged.

Bad requests get a JSON ``{"detail": "<what is wrong>"}``: 400 for a body that is not JSON (or is nested too
deeply to decode, or has a malformed Content-Length), 408 for a body that does not arrive within ``body_timeout``
seconds (10 by default: a client that sends its headers and then stalls holds a connection no longer than that),
422 for a body that does not validate (missing or mistyped field, empty query list, a non-string query, ``topk``
outside ``1..max_topk``, more than ``max_queries`` queries), 413 for a body over ``max_body_bytes`` (checked
against Content-Length and against the bytes actually read, so chunked bodies are bounded too), 401 for a missing
or wrong bearer token when ``token`` is set (``/health`` stays open). Under :func:`run_server` the connection
itself is bounded too (:func:`guarded_protocol`): a request head not complete within ``head_timeout`` seconds (10 by
default) closes the connection, with a 408 if part of it arrived; a connection beyond ``max_connections`` is answered
503 and closed; a request line or header h11 refuses (a negative or 21-digit Content-Length) is a 400 (431 for
headers over the size limit), all with the same JSON ``detail``.

With ``batching=True`` every query goes through :meth:`Retriever.asearch`, so queries of concurrent requests are
coalesced by the retriever's micro-batcher into one batched ``search`` call; with ``batching=False`` each query is a
``search([q], k)`` call of its own. Searches always run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from typing import Any

import fastapi
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, create_model
from starlette.requests import ClientDisconnect

from sleuth._http import is_loopback, json_body
from sleuth.records import Passage, encodable
from sleuth.retrieval.base import RetrievalError, Retriever

logger = logging.getLogger("sleuth.serve")

DEFAULT_TOPK = 3
# Above this many hits the JSON response is encoded in a worker thread, not on the event loop.
_THREAD_ENCODE_HITS = 2000


def _request_model(max_topk: int, max_queries: int) -> type[BaseModel]:
    return create_model(
        "RetrieveRequest",
        __config__=ConfigDict(extra="ignore"),
        queries=(list[StrictStr], Field(min_length=1, max_length=max_queries)),
        topk=(StrictInt, Field(default=DEFAULT_TOPK, ge=1, le=max_topk)),
        return_scores=(StrictBool, False),
    )


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _hit(passage: Passage, with_score: bool) -> dict[str, Any]:
    document = {"id": str(passage.id), "contents": passage.contents}
    if not with_score:
        return document
    return {"document": document, "score": None if passage.score is None else float(passage.score)}


def create_app(
    retriever: Retriever,
    *,
    max_topk: int = 100,
    max_queries: int = 512,
    max_body_bytes: int = 1_000_000,
    token: str | None = None,
    batching: bool = True,
    body_timeout: float = 10.0,
) -> fastapi.FastAPI:
    """A FastAPI app serving ``retriever`` on ``POST /retrieve`` and ``GET /health`` (see the module docstring).

    ``body_timeout`` bounds, in seconds, the time from the request's headers to the last byte of its body.
    """
    if max_topk < 1 or max_queries < 1 or max_body_bytes < 1:
        raise ValueError("max_topk, max_queries and max_body_bytes must be >= 1")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    if token is not None and not token:
        raise ValueError("token is empty; pass None to serve without authentication")
    request_model = _request_model(max_topk, max_queries)
    expected_auth = f"Bearer {token}".encode() if token else None

    app = fastapi.FastAPI(
        title="sleuth retriever", docs_url=None, redoc_url=None, openapi_url=None, description=__doc__
    )
    app.state.retriever = retriever
    app.state.batching = batching

    async def search(queries: list[str], k: int) -> list[list[Passage]]:
        if batching:
            return list(await asyncio.gather(*(retriever.asearch(q, k) for q in queries)))
        results = await asyncio.gather(*(asyncio.to_thread(retriever.search, [q], k) for q in queries))
        for result in results:
            if len(result) != 1:
                raise RetrievalError(f"search returned {len(result)} result lists for 1 query")
        return [result[0] for result in results]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        def describe() -> tuple[int, dict[str, Any]]:  # len() of a remote retriever makes an HTTP call
            return len(retriever), retriever.describe()

        passages, description = await asyncio.to_thread(describe)
        return {"status": "ok", "passages": passages, "retriever": description}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        if expected_auth is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected_auth):
                reason = "missing bearer token" if not given else "wrong bearer token"
                return _error(401, f"{reason}: send 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"})

        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                declared_bytes = int(declared)
            except ValueError:
                return _error(400, f"malformed Content-Length header {declared!r}")
            if declared_bytes > max_body_bytes:
                return _error(413, f"request body of {declared_bytes} bytes exceeds the limit of {max_body_bytes}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        return _error(413, f"request body exceeds the limit of {max_body_bytes} bytes")
                    chunks.append(chunk)
        except ClientDisconnect:
            return Response(status_code=400)
        except TimeoutError:
            message = f"request body not received within {body_timeout:g} s ({size} bytes arrived)"
            return _error(408, message, {"Connection": "close"})

        try:
            payload = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        except RecursionError:
            return _error(400, "request body is not valid JSON: nested too deeply")
        if not isinstance(payload, dict):
            return _error(422, f"request body must be a JSON object, not {type(payload).__name__}")
        try:
            body = request_model.model_validate(payload)
        except ValidationError as exc:
            return _error(422, _validation_message(exc))

        queries = [encodable(q) for q in body.queries]  # type: ignore[attr-defined]
        k: int = body.topk  # type: ignore[attr-defined]
        with_scores: bool = body.return_scores  # type: ignore[attr-defined]
        try:
            results = await search(queries, k)
        except Exception as exc:  # the server keeps serving; the client sees a retryable 500
            logger.exception("search failed for %d queries (topk=%d)", len(queries), k)
            return _error(500, f"retrieval failed: {type(exc).__name__}: {exc}")

        answer = {"result": [[_hit(p, with_scores) for p in hits] for hits in results]}
        if sum(len(hits) for hits in results) > _THREAD_ENCODE_HITS:
            content = await asyncio.to_thread(json_body, answer, True)
        else:
            content = json_body(answer, allow_nan=True)
        return Response(content=content, media_type="application/json")

    return app


def token_from_env(name: str) -> str:
    """The bearer token held by the environment variable ``name`` (tokens never come from the command line)."""
    token = os.environ.get(name, "")
    if not token:
        raise RetrievalError(f"environment variable {name} (named by --token-env) is unset or empty")
    return token


def default_max_connections() -> int:
    """Open connections allowed by default: three quarters of the soft descriptor limit (the rest stays free for the
    index, logs and worker threads), at most 1024."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1024
    return max(1, min(1024, soft * 3 // 4))


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json_body({"detail": message})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def guarded_protocol(head_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the limits it lacks (uvicorn 0.54 has a keep-alive timeout but none for a
    request head, and ``limit_concurrency`` answers 503 to requests yet never closes an idle half-open connection):

    * a request head (request line and headers) must be complete within ``head_timeout`` seconds of the connection
      opening, or of its first byte on a kept-alive connection; otherwise the connection is closed (with a JSON 408
      if part of a head arrived), so a client that sends nothing, or one byte every few seconds, holds nothing long;
    * at most ``max_connections`` connections are open at once: one more is answered with a JSON 503 and closed at
      once, so stalled clients can never exhaust the descriptors (``accept`` failing with "Too many open files");
    * a request h11 refuses (a negative or 21-digit Content-Length, a malformed request line, headers over the size
      limit) gets the contract's JSON ``{"detail": ...}`` with h11's reason and status (400 or 431), not plain text.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, STATUS_PHRASES, H11Protocol

    if not head_timeout > 0:
        raise ValueError(f"head_timeout must be > 0 seconds, got {head_timeout}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")

    class _ErrorRecordingConnection(h11.Connection):
        """An h11 connection that remembers why it refused the peer's bytes (uvicorn drops the exception)."""

        refusal: h11.RemoteProtocolError | None = None

        def next_event(self) -> Any:
            try:
                return super().next_event()
            except h11.RemoteProtocolError as exc:
                self.refusal = exc
                raise

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            limit = self.config.h11_max_incomplete_event_size
            self.conn = _ErrorRecordingConnection(
                h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit
            )
            self.head_timer: asyncio.TimerHandle | None = None
            self.head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning(
                    "refused a connection: %d are open, the limit is %d", len(self.connections) - 1, max_connections
                )
                message = f"server busy: {max_connections} connections are open; retry later"
                transport.write(_raw_json_response(503, "Service Unavailable", message))
                transport.close()
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            waiting_for_head = self.conn.their_state is h11.IDLE
            if waiting_for_head:
                self.head_bytes += len(data)
                if self.head_timer is None:  # the first byte of a head on a kept-alive connection
                    self._arm_head_timer()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is complete (or refused): the app takes over
                self._cancel_head_timer()
                self.head_bytes = 0

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.head_bytes = 0  # the keep-alive timer guards the idle time until the next head's first byte

        def send_400_response(self, msg: str) -> None:
            refusal = getattr(self.conn, "refusal", None)
            status = refusal.error_status_hint if refusal is not None else 400
            reason = str(refusal) if refusal is not None and str(refusal) else msg
            output = self.conn.send(
                h11.Response(
                    status_code=status,
                    headers=[(b"content-type", b"application/json"), (b"connection", b"close")],
                    reason=STATUS_PHRASES.get(status, b""),
                )
            )
            output += self.conn.send(h11.Data(data=json_body({"detail": f"invalid HTTP request: {reason}"})))
            output += self.conn.send(h11.EndOfMessage())
            self.transport.write(output)
            self.transport.close()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self.head_timer = self.loop.call_later(head_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_timed_out(self) -> None:
            self.head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.head_bytes:
                message = f"request head not complete within {head_timeout:g} s ({self.head_bytes} bytes arrived)"
                self.transport.write(_raw_json_response(408, "Request Timeout", message))
            self._unset_keepalive_if_required()
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(*, head_timeout: float = 10.0, max_connections: int | None = None) -> dict[str, Any]:
    """The options :func:`run_server` gives ``uvicorn.run`` (and tests give ``uvicorn.Config``): the protocol of
    :func:`guarded_protocol`, bounding request heads to ``head_timeout`` seconds and open connections to
    ``max_connections`` (by default :func:`default_max_connections`)."""
    limit = default_max_connections() if max_connections is None else max_connections
    return {"http": guarded_protocol(head_timeout, limit)}


def run_server(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    token_env: str | None = None,
    log_level: str = "info",
    access_log: bool = False,
    head_timeout: float = 10.0,
    max_connections: int | None = None,
    **app_options: Any,
) -> None:
    """Serve ``retriever`` with uvicorn until interrupted; ``app_options`` go to :func:`create_app`.

    ``token_env`` names an environment variable holding the bearer token (an alternative to ``token=``);
    ``head_timeout`` and ``max_connections`` bound slow or stalled clients (see :func:`guarded_protocol`).
    """
    import uvicorn

    if token_env:
        if app_options.get("token"):
            raise ValueError("pass either token or token_env, not both")
        app_options["token"] = token_from_env(token_env)
    app = create_app(retriever, **app_options)
    if not app_options.get("token") and not is_loopback(f"http://[{host}]" if ":" in host else f"http://{host}"):
        logger.warning("serving on %s:%d without a bearer token: anyone who can reach it can query it", host, port)
    options = uvicorn_options(head_timeout=head_timeout, max_connections=max_connections)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, **options)
