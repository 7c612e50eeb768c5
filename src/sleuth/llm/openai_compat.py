"""Backend for any OpenAI-compatible HTTP server: vLLM, llama.cpp server, Ollama, hosted APIs.

Spec string::

    openai:MODEL@BASE_URL?concurrency=16&timeout=60&deadline=300&max_retries=5&backoff=0.5&key_env=OPENAI_API_KEY

``MODEL@BASE_URL`` is split on the *last* ``@``; ``BASE_URL`` is the API root including ``/v1``, e.g.
``http://127.0.0.1:8000/v1``. Without ``@`` the base URL is ``https://api.openai.com/v1``.

Options (all optional):

``concurrency`` (16)
    How many HTTP requests one backend instance has in flight at once (an ``asyncio.Semaphore``).
``timeout`` (60)
    Seconds one attempt (one HTTP request) may take in all, from connecting to the last byte of the answer; a
    timed-out attempt is retried. A server that trickles its answer byte by byte cannot stretch it.
``deadline`` (300)
    Seconds one call may take in all: every attempt and every backoff wait included (time queued behind
    ``concurrency`` is not counted). No retry starts that could not finish in time; once it has passed the
    call fails with :class:`~sleuth.llm.base.LLMError`. Each attempt gets ``min(timeout, time left)``.
``max_retries`` (5)
    Retries after the first attempt on timeouts, transport errors (connection refused or reset), HTTP 408, 429
    and 5xx. The wait is ``backoff * 2**attempt`` plus a little jitter, at most 30 s; a numeric ``Retry-After``
    header is honoured up to the same cap. Other 4xx answers fail at once.
``backoff`` (0.5)
    Base of the exponential backoff, in seconds.
``seeds`` (``send``)
    ``drop``: a request's sampling seed is not sent (the server samples unseeded), for a vLLM CPU server, whose
    engine dies on some seeded requests (the ``vllm:`` backend drops them there by itself).
``token_out`` (0)
    Token-in, token-out, as RL rollouts need (vLLM's extensions of ``/completions``): the prompt goes to
    ``/completions`` as token ids (the request's own ``prompt_ids``, or, with the served model's tokenizer, chat
    messages formatted and tokenized client-side as the ``hf`` backend does), and ``return_token_ids`` with
    ``logprobs=0`` bring back every sampled id and its log-probability: the :class:`~sleuth.llm.base.Generation`'s
    ``prompt_ids``, ``sampled_ids`` and ``logprobs``. A server that returns no ids gives a Generation without them
    (the RL trainer then re-tokenizes the text and counts the episode). A request with ``prompt_ids`` is sent as
    ids whatever this option says.
``key_env`` (``OPENAI_API_KEY``)
    Name of the environment variable holding the API key. When it is set the key is sent as
    ``Authorization: Bearer ...``; when it is unset no Authorization header is sent (local servers need none).
    A key is never accepted in the spec string and never logged or shown by :meth:`OpenAICompatLLM.describe`.

Chat requests go to ``POST {base}/chat/completions``, raw prompts to ``POST {base}/completions``. At most four stop
strings are sent (the OpenAI limit); every stop string is also applied client-side, since some servers return the
stop string or ignore the extras. When a server returns fewer than ``n`` choices (llama.cpp ignores ``n``) more
requests are made until there are ``n`` texts; a set ``seed`` is advanced by the number of texts already held so
the extra samples differ.

:meth:`OpenAICompatLLM.score` has two ways. With the served model's tokenizer (``score_tokenizer``; a ``vllm:``
backend loads it from the model's directory) it is token-exact and takes chat messages: the prompt is formatted and
tokenized as the ``hf`` backend does (:func:`~sleuth.llm.base.encode_prompt`), the completion tokenized apart, and
the token ids go to ``/completions`` with ``prompt_logprobs=0`` (vLLM's extension), so the completion's log-prob
is summed over exactly the ids the ``hf`` backend scores. Without a tokenizer it needs a server that implements
``echo`` with ``logprobs`` on ``/completions`` (vLLM does; the OpenAI API and many others do not) and a formatted
prompt *string*: chat messages are refused, because the chat template lives on the server and the character
offsets of the completion are then unknown.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from sleuth._http import (
    BACKOFF_CAP_S,
    JSON_HEADERS,
    RETRY_STATUSES,
    backoff_delay,
    bool_option,
    json_body,
    number_option,
    refuse_credentials,
)
from sleuth._http import error_message as _error_message
from sleuth._http import is_loopback as _is_loopback
from sleuth._http import snippet as _snippet
from sleuth.llm.base import (
    LLM,
    Generation,
    LLMError,
    Messages,
    Request,
    Sampling,
    Score,
    encode_prompt,
    register_backend,
    truncate_at_stop,
)
from sleuth.records import encodable

DEFAULT_BASE_URL = "https://api.openai.com/v1"
MAX_API_STOPS = 4
_FINISH_REASONS = {
    "stop": "stop",
    "eos": "stop",
    "eos_token": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "max_tokens": "length",
}
_OPTIONS = ("concurrency", "timeout", "deadline", "max_retries", "backoff", "key_env", "token_out", "seeds")


class OpenAICompatLLM(LLM):
    """An :class:`~sleuth.llm.base.LLM` talking to an OpenAI-compatible server over HTTP with ``httpx``."""

    def __init__(
        self,
        model: str,
        base_url: str = DEFAULT_BASE_URL,
        *,
        concurrency: int = 16,
        timeout: float = 60.0,
        deadline: float = 300.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        key_env: str = "OPENAI_API_KEY",
        score_tokenizer: Any = None,
        token_out: bool = False,
        send_seed: bool = True,
    ) -> None:
        super().__init__()
        if not model:
            raise LLMError("the openai backend needs a model name: 'openai:MODEL@BASE_URL'")
        base_url = base_url.rstrip("/")
        if urlsplit(base_url).scheme not in ("http", "https") or not urlsplit(base_url).netloc:
            raise LLMError(f"base URL {base_url!r} is not an http(s) URL like 'http://127.0.0.1:8000/v1'")
        if concurrency < 1:
            raise LLMError(f"concurrency must be >= 1, got {concurrency}")
        if timeout <= 0:
            raise LLMError(f"timeout must be > 0 seconds, got {timeout}")
        if deadline <= 0:
            raise LLMError(f"deadline must be > 0 seconds, got {deadline}")
        if max_retries < 0:
            raise LLMError(f"max_retries must be >= 0, got {max_retries}")
        if backoff < 0:
            raise LLMError(f"backoff must be >= 0 seconds, got {backoff}")
        if not key_env:
            raise LLMError("key_env must name an environment variable")
        self.model = model
        self.base_url = base_url
        self.concurrency = concurrency
        self.timeout = timeout
        self.deadline = deadline
        self.max_retries = max_retries
        self.backoff = backoff
        self.key_env = key_env
        self.spec = f"openai:{model}@{base_url}"
        self._score_tokenizer = score_tokenizer
        self.token_out = token_out
        # False: a request's seed is not sent (the server samples unseeded): vLLM's CPU build dies on seeded requests
        # (sleuth.llm.vllm_server, option seeds)
        self.send_seed = send_seed
        # The client and the semaphore belong to one event loop; they are rebuilt when another loop calls us
        # (asyncio.run may be called several times in one process).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None

    # ---------------------------------------------------------------- public interface

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        """Complete each request concurrently (bounded by ``concurrency``); the result is in request order."""
        if not requests:
            return []
        tasks = [asyncio.ensure_future(self._generate_one(request, sampling)) for request in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def score_tokenizer(self) -> Any | None:
        """The served model's transformers tokenizer, when known: :meth:`score` is then token-exact and takes chat
        messages. None here unless given to the constructor (a ``vllm:`` backend loads its model's)."""
        return self._score_tokenizer

    async def score(self, prompt: Messages | str, completion: str) -> Score:
        """Log-probability of ``completion`` after ``prompt``: the sum of the completion tokens' log-probs.

        With :meth:`score_tokenizer` (see the module docstring) the prompt (chat messages get the chat template and
        the generation prompt) and the completion are tokenized separately, as the ``hf`` backend does, and the
        server returns the log-prob of every id (``prompt_logprobs``): the same quantity as ``hf``'s ``score``.

        Without it, ``POST {base}/completions`` with ``echo`` and ``logprobs``; chat messages are refused (pass the
        prompt already formatted with the model's chat template), and a server without echo logprobs raises
        :class:`LLMError`. Tokens are assigned to the completion by their character offset, so a token that
        straddles the prompt/completion boundary counts as prompt.
        """
        tokenizer = self.score_tokenizer()
        if tokenizer is not None:
            return await self._score_ids(tokenizer, prompt, completion)
        if not isinstance(prompt, str):
            raise LLMError(
                "score() with chat messages needs a local backend or a server-side chat template; "
                "pass the formatted prompt string"
            )
        self.stats.requests += 1
        if not completion:
            return Score(logprob=0.0, token_logprobs=[], tokens=[])
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt + completion,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0.0,
        }
        url, choice = await self._scoring_call(body)
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or not logprobs.get("token_logprobs"):
            raise LLMError(
                f"{url}: the server does not support echo logprobs (no choices[0].logprobs.token_logprobs in its "
                "answer to echo=true, logprobs=1); score() needs a server such as vLLM"
            )
        tokens, values, offsets = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("text_offset")
        if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(offsets, list)) or not (
            len(tokens) == len(values) == len(offsets)
        ):
            raise LLMError(
                f"{url}: malformed echo logprobs: need lists 'tokens', 'token_logprobs' and 'text_offset' "
                "of equal length"
            )
        start, end = len(prompt), len(prompt) + len(completion)
        picked_tokens: list[str] = []
        picked_values: list[float] = []
        for token, value, offset in zip(tokens, values, offsets, strict=True):
            if not isinstance(offset, int) or not start <= offset < end:
                continue
            if value is None:
                raise LLMError(f"{url}: no logprob for completion token {token!r} (is the prompt empty?)")
            picked_tokens.append(encodable(str(token)))
            picked_values.append(float(value))
        return Score(logprob=sum(picked_values), token_logprobs=picked_values, tokens=picked_tokens)

    async def _score_ids(self, tokenizer: Any, prompt: Messages | str, completion: str) -> Score:
        """:meth:`score` on token ids: ``prompt_logprobs=0`` returns, for every prompt position after the first,
        the log-prob of the id actually there (the sampled token of ``max_tokens=1`` is not used)."""
        self.stats.requests += 1
        prompt_ids = encode_prompt(tokenizer, prompt, self.model)
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if not completion_ids:
            return Score(logprob=0.0, token_logprobs=[], tokens=[])
        if not prompt_ids:
            raise LLMError("score() needs a non-empty prompt: the first token has no log-probability")
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids + completion_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        url, choice = await self._scoring_call(body)
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(prompt_ids) + len(completion_ids):
            got = f"{len(entries)} entries" if isinstance(entries, list) else _snippet(entries)
            raise LLMError(
                f"{url}: the server does not support prompt_logprobs on token ids (expected choices[0]."
                f"prompt_logprobs with {len(prompt_ids) + len(completion_ids)} entries, got {got}); token-exact "
                "score() needs a server such as vLLM"
            )
        values: list[float] = []
        for token, entry in zip(completion_ids, entries[len(prompt_ids) :], strict=True):
            found = entry.get(str(token)) if isinstance(entry, dict) else None
            value = found.get("logprob") if isinstance(found, dict) else None
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise LLMError(f"{url}: no prompt logprob for completion token id {token} in {_snippet(entry)}")
            values.append(float(value))
        tokens = [encodable(str(t)) for t in tokenizer.convert_ids_to_tokens(completion_ids)]
        return Score(logprob=sum(values), token_logprobs=values, tokens=tokens)

    async def aclose(self) -> None:
        """Close the HTTP client (a client left from a finished event loop is just dropped)."""
        client, loop = self._client, self._loop
        self._client, self._semaphore, self._loop = None, None, None
        if client is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - aclose is a coroutine, so a loop is running
            running = None
        if running is loop:
            await client.aclose()

    def describe(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "backend": type(self).__name__,
            "model": self.model,
            "base_url": self.base_url,
            "concurrency": self.concurrency,
            "timeout": self.timeout,
            "deadline": self.deadline,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
            "key_env": self.key_env,
            "token_out": self.token_out,
            "send_seed": self.send_seed,
        }

    # ---------------------------------------------------------------- generation

    def _prompt_ids(self, request: Request) -> list[int] | None:
        """The ids to send as the prompt: the request's own (token-in), or, with ``token_out`` and the served
        model's tokenizer, the request formatted and tokenized client-side as the ``hf`` backend does; else None
        (the server formats chat messages itself)."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        tokenizer = self.score_tokenizer() if self.token_out else None
        if tokenizer is None:
            return None
        prompt = request.messages if request.messages is not None else request.prompt
        assert prompt is not None
        return encode_prompt(tokenizer, prompt, self.model)

    async def _generate_one(self, request: Request, sampling: Sampling) -> Generation:
        self.stats.requests += 1
        prompt_ids = self._prompt_ids(request)
        chat = request.messages is not None and prompt_ids is None
        url = self._url("chat/completions" if chat else "completions")
        stops = tuple(s for s in sampling.stop if s)
        texts: list[str] = []
        completion_tokens: list[int] = []
        finish_reasons: list[str] = []
        # token-out (vLLM's return_token_ids with logprobs=0): per text, every sampled id and its log-prob; None
        # as soon as one choice lacks them (a server without the extension)
        sampled: list[list[int]] | None = [] if self.token_out else None
        logprobs: list[list[float]] | None = [] if self.token_out else None
        prompt_tokens = 0
        while len(texts) < sampling.n:
            need = sampling.n - len(texts)
            body: dict[str, Any] = {
                "model": self.model,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_new_tokens,
                "n": need,
            }
            if prompt_ids is not None:
                body["prompt"] = prompt_ids
            elif chat:
                body["messages"] = request.messages
                if request.messages and request.messages[-1]["role"] == "assistant":  # vLLM: continue that turn
                    body["continue_final_message"], body["add_generation_prompt"] = True, False
            else:
                body["prompt"] = request.prompt
            if self.token_out:
                body["return_token_ids"], body["logprobs"] = True, 0
            if stops:
                body["stop"] = list(stops[:MAX_API_STOPS])
            if sampling.seed is not None and self.send_seed:
                body["seed"] = sampling.seed + len(texts)
            if sampling.repetition_penalty != 1.0:
                body["repetition_penalty"] = sampling.repetition_penalty
            data = await self._post(url, body)
            choices = sorted(self._choices(data, url), key=lambda c: _int(c.get("index"), default=0))
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            prompt_tokens = prompt_tokens or _int(usage.get("prompt_tokens"))
            counts = _split_completion_tokens(choices, _int(usage.get("completion_tokens")))
            for choice, count in zip(choices[:need], counts[:need], strict=True):
                text = self._choice_text(choice, chat, url)
                text, stopped = truncate_at_stop(text, stops)
                reason = choice.get("finish_reason")
                if stopped:
                    reason = "stop"
                elif isinstance(reason, str):
                    reason = _FINISH_REASONS.get(reason, reason)
                else:
                    reason = "stop" if reason is None else str(reason)
                texts.append(text)
                completion_tokens.append(count)
                finish_reasons.append(reason)
                if sampled is not None:
                    ids, values = _sampled_tokens(choice)
                    if ids is None:
                        sampled = logprobs = None
                    else:
                        sampled.append(ids)
                        if logprobs is not None and values is not None:
                            logprobs.append(values)
                        else:
                            logprobs = None
        self.stats.prompt_tokens += prompt_tokens
        self.stats.completion_tokens += sum(completion_tokens)
        return Generation(
            texts=texts,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reasons=finish_reasons,
            prompt_ids=prompt_ids if sampled else None,
            sampled_ids=sampled or None,
            logprobs=logprobs if sampled else None,
        )

    @staticmethod
    def _choice_text(choice: dict[str, Any], chat: bool, url: str) -> str:
        if chat:
            message = choice.get("message")
            if not isinstance(message, dict):
                raise LLMError(f"{url}: malformed response: a choice has no 'message' object")
            content = message.get("content")
        else:
            if "text" not in choice:
                raise LLMError(f"{url}: malformed response: a choice has no 'text'")
            content = choice.get("text")
        if content is None:
            return ""
        if not isinstance(content, str):
            raise LLMError(f"{url}: malformed response: choice text is {type(content).__name__}, not a string")
        return encodable(content)

    async def _scoring_call(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """POST a scoring request to the completions endpoint (its prompt tokens counted): the URL and choice 0."""
        url = self._url("completions")
        data = await self._post(url, body)
        choices = self._choices(data, url)
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.stats.prompt_tokens += _int(usage.get("prompt_tokens"))
        return url, choices[0]

    @staticmethod
    def _choices(data: dict[str, Any], url: str) -> list[dict[str, Any]]:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise LLMError(f"{url}: malformed response: expected a non-empty 'choices' list, got {_snippet(data)}")
        return choices

    # ---------------------------------------------------------------- HTTP

    def _url(self, path: str) -> str:
        return f"{self.base_url}/{path}"

    def _session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The client and the semaphore of the running event loop, made on first use in that loop."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._semaphore is None or self._loop is not loop:
            headers = {"Accept": "application/json"}
            key = os.environ.get(self.key_env)
            if key:
                headers["Authorization"] = f"Bearer {key}"
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout),
                headers=headers,
                limits=httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency),
                # A server on the loopback interface never needs the proxy set in the environment.
                trust_env=not _is_loopback(self.base_url),
            )
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._loop = loop
        return self._client, self._semaphore

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` as JSON, retrying transient failures; return the decoded JSON object.

        Each attempt is bounded as a whole by ``timeout`` and the call by ``deadline`` (see the module docstring).
        """
        client, semaphore = self._session()
        content = json_body(body)
        attempts = self.max_retries + 1
        last_failure = ""
        spent = 0.0  # this call's seconds in attempts and backoff waits
        attempt = 0
        for attempt in range(attempts):  # noqa: B007 - attempt is reported after the loop
            retry_after: str | None = None
            budget = min(self.timeout, self.deadline - spent)
            async with semaphore:
                started = time.monotonic()
                try:
                    async with asyncio.timeout(budget):
                        response = await client.post(url, content=content, headers=JSON_HEADERS)
                except (httpx.TimeoutException, TimeoutError) as exc:
                    last_failure = f"timed out after {budget:g} s ({type(exc).__name__})"
                    response = None
                except httpx.TransportError as exc:
                    last_failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    response = None
                finally:
                    self.stats.calls += 1
                    spent += time.monotonic() - started
            if response is not None:
                status = response.status_code
                if 200 <= status < 300:
                    return self._decode(response, url)
                message = _error_message(response)
                if status not in RETRY_STATUSES and status < 500:
                    raise LLMError(f"POST {url} failed with HTTP {status}: {message}")
                last_failure = f"HTTP {status}: {message}"
                retry_after = response.headers.get("retry-after")
            if attempt + 1 < attempts:
                delay = self._delay(attempt, retry_after)
                if spent + delay >= self.deadline:
                    break
                self.stats.retries += 1
                await asyncio.sleep(delay)
                spent += delay
        made = attempt + 1
        tries = f"{made} attempt{'s' if made != 1 else ''} ({made - 1} retries)"
        if made < attempts:
            raise LLMError(
                f"POST {url} failed: the call's deadline of {self.deadline:g} s passed after {tries} and "
                f"{spent:.1f} s; last failure: {last_failure}"
            )
        raise LLMError(f"POST {url} failed after {tries}; last failure: {last_failure}")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        return backoff_delay(attempt, self.backoff, retry_after, BACKOFF_CAP_S)

    @staticmethod
    def _decode(response: httpx.Response, url: str) -> dict[str, Any]:
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise LLMError(
                f"{url}: HTTP {response.status_code} response is not JSON ({exc}); body: {_snippet(response.text)}"
            ) from exc
        if not isinstance(data, dict):
            raise LLMError(f"{url}: malformed response: expected a JSON object, got {_snippet(data)}")
        return data


# -------------------------------------------------------------------- helpers


def _int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return default


def _sampled_tokens(choice: dict[str, Any]) -> tuple[list[int] | None, list[float] | None]:
    """A choice's sampled ids (vLLM's ``token_ids``) and their log-probs (``logprobs.token_logprobs``, one per id),
    each None when absent or malformed."""
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        return None, None  # absent or malformed: no ids, the trainer re-tokenizes the text (counted)
    entry = choice.get("logprobs")
    values = entry.get("token_logprobs") if isinstance(entry, dict) else None
    if not isinstance(values, list) or len(values) != len(ids):
        return ids, None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return ids, None
    return ids, [float(v) for v in values]


def _split_completion_tokens(choices: list[dict[str, Any]], total: int) -> list[int]:
    """Per-choice completion token counts: the server's own when every choice has one, else ``total`` split evenly."""
    per_choice: list[int] = []
    for choice in choices:
        usage = choice.get("usage")
        value = usage.get("completion_tokens") if isinstance(usage, dict) else choice.get("completion_tokens")
        if not isinstance(value, int) or isinstance(value, bool):
            break
        per_choice.append(value)
    else:
        return per_choice
    share, extra = divmod(max(total, 0), len(choices))
    return [share + (1 if i < extra else 0) for i in range(len(choices))]


@register_backend("openai")
def make_openai_llm(target: str, options: dict[str, str]) -> OpenAICompatLLM:
    """Factory for ``openai:MODEL@BASE_URL?options`` specs (see the module docstring for the options)."""
    refuse_credentials(
        options, LLMError, "openai spec", "API keys are read only from the environment variable named by key_env"
    )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise LLMError(f"unknown openai spec option(s) {unknown}; known: {list(_OPTIONS)}")
    model, sep, base_url = target.rpartition("@")
    if not sep:
        model, base_url = target, DEFAULT_BASE_URL
    return OpenAICompatLLM(
        model,
        base_url,
        concurrency=number_option(options, "concurrency", int, 16, LLMError, "openai spec"),
        timeout=number_option(options, "timeout", float, 60.0, LLMError, "openai spec"),
        deadline=number_option(options, "deadline", float, 300.0, LLMError, "openai spec"),
        max_retries=number_option(options, "max_retries", int, 5, LLMError, "openai spec"),
        backoff=number_option(options, "backoff", float, 0.5, LLMError, "openai spec"),
        key_env=options.get("key_env") or "OPENAI_API_KEY",
        token_out=bool_option(options, "token_out", LLMError, "openai spec"),
        send_seed=_send_seed(options.get("seeds", "send")),
    )


def _send_seed(value: str) -> bool:
    if value not in ("send", "drop"):
        raise LLMError(f"openai spec option seeds={value!r}: expected send or drop")
    return value == "send"
