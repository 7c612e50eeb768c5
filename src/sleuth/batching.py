"""Coalesce concurrent awaits into batched calls.

Agents are written one example at a time (``await llm.generate([request])``); the runner runs many of them on one
event loop. A :class:`MicroBatcher` sits in front of a blocking batch function (a padded ``model.generate``, a BM25
search over many queries): every item submitted while the previous batch was running, or during the same event-loop
turn, goes into the next call. The blocking call runs in a worker thread so the loop keeps scheduling other agents.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class BatchStats:
    """How many items were submitted and how many blocking calls served them."""

    items: int = 0
    calls: int = 0
    largest: int = 0
    sizes: list[int] = field(default_factory=list)

    def record(self, size: int) -> None:
        self.calls += 1
        self.largest = max(self.largest, size)
        self.sizes.append(size)


class MicroBatcher(Generic[T, R]):
    """Collect items from concurrent coroutines and serve them with one blocking ``fn(batch)`` call per group.

    ``key(item)`` splits a batch into groups that must not share a call (different sampling settings); each group
    is one call of ``fn``. ``fn`` must return one result per item, in order. Exceptions raised by ``fn`` are
    delivered to every waiter of that call.

    >>> async def demo():
    ...     batcher = MicroBatcher(lambda xs: [x * 2 for x in xs], max_batch=8)
    ...     return await asyncio.gather(*(batcher.submit(i) for i in range(5))), batcher.stats.calls
    >>> asyncio.run(demo())
    ([0, 2, 4, 6, 8], 1)
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Sequence[R]],
        max_batch: int = 32,
        key: Callable[[T], Hashable] | None = None,
        settle_turns: int = 2,
    ) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.key = key or (lambda _item: None)
        self.settle_turns = settle_turns
        self.stats = BatchStats()
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (asyncio.run called again): start afresh
            self._loop, self._worker, self._pending = loop, None, []
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        self.stats.items += 1
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            # Let coroutines that became ready in this turn add their items before the batch is cut.
            for _ in range(self.settle_turns):
                await asyncio.sleep(0)
            taken, self._pending = self._pending, []
            groups: dict[Hashable, list[tuple[T, asyncio.Future[R]]]] = {}
            for entry in taken:
                groups.setdefault(self.key(entry[0]), []).append(entry)
            for group in groups.values():
                for start in range(0, len(group), self.max_batch):
                    await self._call(group[start : start + self.max_batch])

    async def _call(self, chunk: list[tuple[T, asyncio.Future[R]]]) -> None:
        items = [item for item, _ in chunk]
        self.stats.record(len(items))
        try:
            results = await asyncio.to_thread(self.fn, items)
            if len(results) != len(items):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
        except BaseException as exc:  # delivered to the waiters, never lost in the worker task
            for _, future in chunk:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(chunk, results, strict=True):
            if not future.done():
                future.set_result(result)
