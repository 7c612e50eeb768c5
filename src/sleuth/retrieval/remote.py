"""A :class:`~sleuth.retrieval.base.Retriever` that queries a retrieval server over HTTP.

It speaks Search-R1's retrieval contract, so it works against ``sleuth serve retriever`` and against an existing
Search-R1 / FlashRAG ``retrieval_server.py`` alike::

    POST {base}/retrieve  {"queries": [...], "topk": k, "return_scores": true}
    ->  {"result": [[{"document": {"id": "7", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...], ...]}

A server that ignores ``return_scores`` and answers plain documents (``[[{"id": ..., "contents": ...}, ...]]``) is
accepted too (the passages then have ``score=None``), and so are documents with ``title``/``text`` keys instead of
``contents``. Other document keys go into ``Passage.meta``.

Spec (the options are parsed by :func:`load_remote`)::

    remote:http://127.0.0.1:8000?timeout=30&max_retries=5&backoff=0.5&batch_size=256&token_env=SLEUTH_TOKEN

``url`` is the server's base URL or its full ``/retrieve`` URL. Queries are sent in chunks of ``batch_size``.
``timeout`` bounds each attempt as a whole, from connecting to the last byte (a server trickling bytes cannot
stretch it). Timeouts, connection errors, HTTP 408, 429 and 5xx are retried ``max_retries`` times with
exponential backoff plus jitter (at most 30 s a wait); other 4xx fail at once with the server's message. A bearer
token is read from the environment variable named by ``token_env``; it is never accepted in the spec itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from sleuth._http import (
    JSON_HEADERS,
    backoff_delay,
    error_message,
    is_loopback,
    is_retryable_status,
    json_body,
    number_option,
    refuse_credentials,
    snippet,
)
from sleuth.corpus import split_contents
from sleuth.records import Passage, encodable
from sleuth.retrieval.base import RetrievalError, Retriever, register_retriever

_OPTIONS = ("timeout", "max_retries", "backoff", "batch_size", "token_env")
HEALTH_TIMEOUT_S = 5.0


@dataclass
class RemoteStats:
    """HTTP requests made (every attempt counts), retries among them, and queries sent."""

    requests: int = 0
    retries: int = 0
    queries: int = 0


class RemoteRetriever(Retriever):
    """Client for a Search-R1-compatible ``/retrieve`` endpoint (sleuth's own server or Search-R1's)."""

    def __init__(
        self,
        url: str,
        timeout: float = 30,
        max_retries: int = 5,
        backoff: float = 0.5,
        batch_size: int = 256,
        token_env: str | None = None,
    ) -> None:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RetrievalError(f"retriever URL {url!r} is not an http(s) URL like 'http://127.0.0.1:8000'")
        if timeout <= 0:
            raise RetrievalError(f"timeout must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise RetrievalError(f"max_retries must be >= 0, got {max_retries}")
        if backoff < 0:
            raise RetrievalError(f"backoff must be >= 0 seconds, got {backoff}")
        if batch_size < 1:
            raise RetrievalError(f"batch_size must be >= 1, got {batch_size}")
        self.base_url = url[: -len("/retrieve")] if parts.path.endswith("/retrieve") else url
        self.retrieve_url = f"{self.base_url}/retrieve"
        self.health_url = f"{self.base_url}/health"
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.backoff = backoff
        self.batch_size = batch_size
        self.token_env = token_env or None
        self.spec = f"remote:{self.base_url}"
        self.stats = RemoteStats()
        self._headers = {"Accept": "application/json"}
        if self.token_env:
            token = os.environ.get(self.token_env)
            if not token:
                raise RetrievalError(
                    f"token_env={self.token_env!r} but the environment variable {self.token_env} is unset or empty"
                )
            self._headers["Authorization"] = f"Bearer {token}"
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()
        self._passages: int | None = None

    # ---------------------------------------------------------------- Retriever interface

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if not queries:
            return []
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.batch_size):
            chunk = list(queries[start : start + self.batch_size])
            data = self._post({"queries": chunk, "topk": k, "return_scores": True})
            results.extend(self._parse(data, len(chunk)))
            self.stats.queries += len(chunk)
        return results

    def __len__(self) -> int:
        """The server's passage count from ``GET /health`` (0 when the server does not report one)."""
        if self._passages is not None:
            return self._passages
        try:
            response = self._http().get(self.health_url, timeout=min(self.timeout, HEALTH_TIMEOUT_S))
        except httpx.HTTPError:
            return 0  # not cached: the server may come up later
        passages = 0
        if response.status_code == 200:
            try:
                data = response.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                data = None
            value = data.get("passages") if isinstance(data, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                passages = value
        self._passages = passages  # a server without /health (Search-R1's) answers 404: remember the 0
        return passages

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "url": self.retrieve_url,
            "batch_size": self.batch_size,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "token_env": self.token_env,  # the name only, never the token
        }

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> RemoteRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- HTTP

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    timeout=httpx.Timeout(self.timeout),
                    headers=self._headers,
                    # A server on the loopback interface never needs the proxy set in the environment.
                    trust_env=not is_loopback(self.base_url),
                )
            return self._client

    def _post(self, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``/retrieve``, retrying transient failures; return the decoded JSON."""
        url = self.retrieve_url
        attempts = self.max_retries + 1
        last_failure = ""
        for attempt in range(attempts):
            retry_after: str | None = None
            self.stats.requests += 1
            try:
                response = self._attempt(self._http(), url, json_body(body))
            except httpx.TimeoutException as exc:
                last_failure = f"timed out after {self.timeout:g} s ({type(exc).__name__})"
            except httpx.TransportError as exc:
                last_failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                status = response.status_code
                if 200 <= status < 300:
                    try:
                        return response.json()
                    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                        raise RetrievalError(
                            f"POST {url}: HTTP {status} response is not JSON ({exc}); body: {snippet(response.text)}"
                        ) from exc
                message = error_message(response)
                if not is_retryable_status(status):
                    raise RetrievalError(f"POST {url} failed with HTTP {status} (attempt {attempt + 1}): {message}")
                last_failure = f"HTTP {status}: {message}"
                retry_after = response.headers.get("retry-after")
            if attempt + 1 < attempts:
                self.stats.retries += 1
                time.sleep(backoff_delay(attempt, self.backoff, retry_after))
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''} ({self.max_retries} retries)"
        raise RetrievalError(f"POST {url} failed after {tries}; last failure: {last_failure}")

    def _attempt(self, client: httpx.Client, url: str, content: bytes) -> httpx.Response:
        """One POST, bounded as a whole by ``timeout``: httpx's timeouts bound each read, so a server that trickles
        a byte at a time could otherwise hold the call open indefinitely. The request runs in its own daemon
        thread; when time is up it is abandoned with its client (closed once it ends) and a fresh client serves
        the next attempt."""
        outcome: list[Any] = []
        done = threading.Event()

        def post() -> None:
            try:
                outcome.append(client.post(url, content=content, headers=JSON_HEADERS))
            except BaseException as exc:  # handed to the caller's thread
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=post, name="sleuth-remote-attempt", daemon=True).start()
        if not done.wait(self.timeout):
            with self._lock:
                if self._client is client:
                    self._client = None

            def close_when_done() -> None:
                done.wait()
                client.close()

            threading.Thread(target=close_when_done, daemon=True).start()
            raise httpx.ReadTimeout(f"no complete response within {self.timeout:g} s")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    # ---------------------------------------------------------------- parsing

    def _parse(self, data: Any, n_queries: int) -> list[list[Passage]]:
        url = self.retrieve_url
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            raise RetrievalError(f"{url}: malformed response: expected {{'result': [...]}}, got {snippet(data)}")
        if len(result) != n_queries:
            raise RetrievalError(f"{url}: malformed response: {len(result)} result lists for {n_queries} queries")
        parsed: list[list[Passage]] = []
        for hits in result:
            if not isinstance(hits, list):
                raise RetrievalError(f"{url}: malformed response: a result is not a list: {snippet(hits)}")
            parsed.append([self._passage(hit) for hit in hits])
        return parsed

    def _passage(self, hit: Any) -> Passage:
        url = self.retrieve_url
        if not isinstance(hit, dict):
            raise RetrievalError(f"{url}: malformed response: a hit is not an object: {snippet(hit)}")
        score: float | None = None
        doc = hit
        if isinstance(hit.get("document"), dict):  # the return_scores form
            doc = hit["document"]
            value = hit.get("score")
            if isinstance(value, int | float) and not isinstance(value, bool):
                score = float(value)
        pid = doc.get("id", doc.get("_id", ""))
        if isinstance(doc.get("contents"), str):
            title, text = split_contents(doc["contents"])
            used = {"id", "_id", "contents"}
        elif isinstance(doc.get("text"), str):
            title, text = str(doc.get("title") or ""), doc["text"]
            used = {"id", "_id", "title", "text"}
        else:
            raise RetrievalError(
                f"{url}: malformed response: a document has neither 'contents' nor 'text': {snippet(doc)}"
            )
        meta = {key: value for key, value in doc.items() if key not in used}
        pid = "" if pid is None else encodable(str(pid))
        return Passage(id=pid, title=encodable(title), text=encodable(text), score=score, meta=meta)


def load_remote(target: str, options: dict[str, str]) -> Retriever:
    """Loader for ``remote:URL`` specs; ``options`` are the spec's ``?key=value`` pairs (see the module docstring).

    ``remote:URL1,URL2,...`` names the shards of one corpus: each is searched and the hits are merged by score
    (:class:`~sleuth.retrieval.sharded.ShardedRetriever`).
    """
    refuse_credentials(
        options, RetrievalError, "remote retriever", "a bearer token is read only from the variable named by token_env"
    )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise RetrievalError(f"unknown remote retriever option(s) {unknown}; known: {list(_OPTIONS)}")
    clients = [
        RemoteRetriever(
            url if "://" in url else f"http://{url}",
            timeout=number_option(options, "timeout", float, 30.0, RetrievalError, "remote retriever"),
            max_retries=number_option(options, "max_retries", int, 5, RetrievalError, "remote retriever"),
            backoff=number_option(options, "backoff", float, 0.5, RetrievalError, "remote retriever"),
            batch_size=number_option(options, "batch_size", int, 256, RetrievalError, "remote retriever"),
            token_env=options.get("token_env") or None,
        )
        for url in (part.strip() for part in target.split(","))
        if url
    ]
    if len(clients) == 1:
        return clients[0]
    from sleuth.retrieval.sharded import ShardedRetriever

    return ShardedRetriever(clients)


register_retriever("remote")(load_remote)
