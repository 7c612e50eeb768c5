"""Test doubles for agent logic: a scripted LLM and an in-memory retriever.

They isolate an agent's parsing and control flow from real models; every agent is also run end to end on real
backends elsewhere (tiny model in unit tests, SmolLM2 in integration tests).

``ScriptedLLM(respond)``: ``respond(prompt_text) -> str`` decides each reply (``prompt_text`` is the rendered
request: chat messages joined as ``role: content`` lines, or the raw prompt). Requests that arrive in the same
event-loop turn are served together and recorded as one batch in ``llm.batches``, so a test can check that
independent calls were issued concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from sleuth.llm import LLM, Generation, Request, Sampling
from sleuth.llm.base import Messages, Score
from sleuth.records import Passage
from sleuth.retrieval import Retriever


def render_request(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in request.messages or [])


class ScriptedLLM(LLM):
    """Replies from a function of the prompt, or from a list of replies consumed in order."""

    def __init__(self, respond: Callable[[str], str] | Sequence[str], settle_turns: int = 5) -> None:
        super().__init__()
        self.spec = "scripted"
        if callable(respond):
            self._respond = respond
        else:
            queue = list(respond)

            def pop(_: str) -> str:
                if not queue:
                    raise AssertionError("ScriptedLLM ran out of scripted replies")
                return queue.pop(0)

            self._respond = pop
        self.settle_turns = settle_turns
        self.prompts: list[str] = []
        self.requests: list[Request] = []
        self.samplings: list[Sampling] = []
        self.batches: list[list[str]] = []
        self._pending: list[tuple[list[Request], Sampling, asyncio.Future[list[Generation]]]] = []

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        future: asyncio.Future[list[Generation]] = asyncio.get_running_loop().create_future()
        self._pending.append((requests, sampling, future))
        if len(self._pending) == 1:  # the first caller of this turn serves everyone who arrives meanwhile
            for _ in range(self.settle_turns):
                await asyncio.sleep(0)
            pending, self._pending = self._pending, []
            batch: list[str] = []
            for reqs, samp, fut in pending:
                try:
                    fut.set_result(self._serve(reqs, samp, batch))
                except Exception as exc:  # a failing reply fails its own request, never the others
                    fut.set_exception(exc)
            self.batches.append(batch)
            self.stats.calls += 1
        self.stats.requests += len(requests)
        return await future

    def _serve(self, reqs: list[Request], samp: Sampling, batch: list[str]) -> list[Generation]:
        gens = []
        for request in reqs:
            text = render_request(request)
            batch.append(text)
            self.prompts.append(text)
            self.requests.append(request)
            self.samplings.append(samp)
            replies = [self._respond(text) for _ in range(samp.n)]
            gens.append(
                Generation(
                    texts=replies,
                    prompt_tokens=len(text.split()),
                    completion_tokens=[len(r.split()) for r in replies],
                    finish_reasons=["stop"] * samp.n,
                )
            )
        return gens

    async def score(self, prompt: Messages | str, completion: str) -> Score:
        raise NotImplementedError("ScriptedLLM does not score")


class ListRetriever(Retriever):
    """Passages from a function of the query (or the same list for every query); records every query."""

    def __init__(self, passages: Callable[[str], list[Passage]] | list[Passage]) -> None:
        self._passages = passages if callable(passages) else (lambda _q, _p=list(passages): _p)
        self.spec = "list"
        self.queries: list[str] = []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.queries.extend(queries)
        return [self._passages(q)[:k] for q in queries]

    def __len__(self) -> int:
        return 0

    async def asearch(self, query: str, k: int) -> list[Passage]:
        return self.search([query], k)[0]

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec}


def passages(*texts: str, prefix: str = "p") -> list[Passage]:
    """Quick passages ``p1, p2, ...`` titled ``T1, T2, ...`` with the given texts."""
    return [Passage(id=f"{prefix}{i}", title=f"T{i}", text=t) for i, t in enumerate(texts, 1)]
