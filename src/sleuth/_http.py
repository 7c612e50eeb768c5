"""HTTP helpers shared by the clients (the OpenAI-compatible LLM backend, the remote retriever).

One retry policy for every client: retry timeouts, transport errors (connection refused or reset), HTTP 408, 429
and 5xx; wait ``backoff * 2**attempt`` plus up to 10 % jitter, at most :data:`BACKOFF_CAP_S`, or a numeric
``Retry-After`` (capped the same way); fail at once on any other 4xx, with the server's own message.
"""

from __future__ import annotations

import ipaddress
import json
import random
from typing import Any
from urllib.parse import urlsplit

import httpx

from sleuth.records import encodable

BACKOFF_CAP_S = 30.0
RETRY_STATUSES = frozenset({408, 429})
ERROR_SNIPPET_CHARS = 500


def is_retryable_status(status: int) -> bool:
    """HTTP 408, 429 and every 5xx are worth another try; other 4xx are the caller's fault."""
    return status in RETRY_STATUSES or status >= 500


def backoff_delay(attempt: int, backoff: float, retry_after: str | None = None, cap: float = BACKOFF_CAP_S) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0).

    >>> backoff_delay(0, 0.5, "2")
    2.0
    >>> 1.0 <= backoff_delay(1, 0.5) <= 1.1
    True
    >>> backoff_delay(20, 0.5)
    30.0
    """
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:  # an HTTP date: fall back to the exponential backoff
            pass
        else:
            if seconds >= 0:
                return min(seconds, cap)
    base = backoff * 2**attempt
    return min(base + random.uniform(0, 0.1 * base), cap)


def json_body(value: Any, allow_nan: bool = False) -> bytes:
    """``value`` as a UTF-8 JSON body; lone surrogates in its strings become U+FFFD instead of raising (httpx's own
    ``json=`` encoding raises UnicodeEncodeError on them)."""
    return encodable(json.dumps(value, ensure_ascii=False, allow_nan=allow_nan)).encode("utf-8")


JSON_HEADERS = {"Content-Type": "application/json"}


def snippet(value: Any) -> str:
    """``value`` as text (JSON unless a string), cut to :data:`ERROR_SNIPPET_CHARS` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= ERROR_SNIPPET_CHARS else text[:ERROR_SNIPPET_CHARS] + "..."


def error_message(response: httpx.Response) -> str:
    """The server's error message: JSON ``error.message`` (or a similar field) if present, else the body text."""
    try:
        data = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return snippet(error["message"])
        for candidate in (error, data.get("message"), data.get("detail")):
            if isinstance(candidate, str) and candidate:
                return snippet(candidate)
    text = response.text.strip()
    return snippet(text) if text else f"(empty body, reason {response.reason_phrase!r})"


def is_loopback(url: str) -> bool:
    """True for ``localhost`` and loopback addresses: such a server never needs the environment's proxy."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


CREDENTIAL_OPTIONS = ("key", "api_key", "apikey", "token", "api_token", "bearer", "secret", "password")


def refuse_credentials(options: dict[str, str], error: type[Exception], where: str, hint: str) -> None:
    """Refuse spec options that look like credentials: secrets are read from the environment only."""
    found = sorted(k for k in options if k.lower() in CREDENTIAL_OPTIONS)
    if found:
        raise error(f"{where} option(s) {found} look like a credential; {hint}")


def bool_option(options: dict[str, str], name: str, error: type[Exception], where: str) -> bool:
    """``options[name]`` as a boolean (1/0, true/false, yes/no; absent or empty: False); ``error`` names a bad one."""
    value = options.get(name, "0").strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", ""):
        raise error(f"{where} option {name}={value!r} is not a boolean (1/0, true/false)")
    return value in ("1", "true", "yes")


def number_option(
    options: dict[str, str],
    name: str,
    kind: type[int] | type[float],
    default: float,
    error: type[Exception],
    where: str,
) -> Any:
    """``options[name]`` converted by ``kind``, ``default`` when absent or empty; ``error`` names a bad value."""
    raw = options.get(name)
    if raw is None or raw == "":
        return kind(default)
    try:
        return kind(raw)
    except ValueError:
        raise error(f"{where} option {name}={raw!r} is not a valid {kind.__name__}") from None
