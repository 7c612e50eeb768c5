"""The retrieval contract: ``Retriever.search(queries, k) -> list[list[Passage]]``, and the spec registry.

Every retriever (BM25 now; dense, hybrid and the remote HTTP client later) implements the batched, blocking
:meth:`Retriever.search`. Agents call :meth:`Retriever.asearch` for one query; concurrent calls from many agents are
coalesced into one batched ``search`` per ``k`` by a :class:`~sleuth.batching.MicroBatcher`.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sleuth.batching import BatchStats, MicroBatcher
from sleuth.records import Passage

INDEX_MANIFEST = "sleuth-index.json"


class RetrievalError(RuntimeError):
    """A retriever could not be built, loaded or queried."""


class Retriever(abc.ABC):
    """Base class: implement :meth:`search`; :meth:`asearch` batches concurrent single-query calls."""

    spec: str = ""

    @abc.abstractmethod
    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages for each query, best first, each with ``score`` set."""

    def __len__(self) -> int:
        return 0

    async def asearch(self, query: str, k: int) -> list[Passage]:
        return await self._batcher().submit((query, k))

    @property
    def batch_stats(self) -> BatchStats:
        return self._batcher().stats

    def _batcher(self) -> MicroBatcher[tuple[str, int], list[Passage]]:
        batcher = self.__dict__.get("_micro_batcher")
        if batcher is None:
            batcher = MicroBatcher(
                lambda items: self.search([q for q, _ in items], items[0][1]), max_batch=256, key=lambda it: it[1]
            )
            self.__dict__["_micro_batcher"] = batcher
        return batcher

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "retriever": type(self).__name__, "passages": len(self)}


_RETRIEVERS: dict[str, Callable[[str], Retriever]] = {}


def register_retriever(kind: str) -> Callable[[Callable[[str], Retriever]], Callable[[str], Retriever]]:
    """Register a loader ``(target) -> Retriever`` for specs ``kind:target`` and for index dirs of that kind."""

    def decorate(loader: Callable[[str], Retriever]) -> Callable[[str], Retriever]:
        _RETRIEVERS[kind] = loader
        return loader

    return decorate


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    path = Path(index_dir) / INDEX_MANIFEST
    if not path.exists():
        raise RetrievalError(
            f"{index_dir} is not a sleuth index (no {INDEX_MANIFEST}); build one with `sleuth index build`"
        )
    return json.loads(path.read_text())


def load_retriever(spec: str | None = None) -> Retriever:
    """Open a retriever from a spec: ``bm25:DIR``, a plain index ``DIR`` (kind read from its manifest), or
    ``None``/``"default"`` for the index of the bundled Wikipedia summaries built by ``sleuth index build``."""
    from sleuth.retrieval import bm25  # noqa: F401 - registers "bm25"

    if spec in (None, "", "default"):
        from sleuth.assets import default_index_dir

        spec = str(default_index_dir())
        if not Path(spec).exists():
            raise RetrievalError(f"no default index at {spec}; run `sleuth assets fetch` then `sleuth index build`")
    kind, sep, target = spec.partition(":")
    if not sep or kind not in _RETRIEVERS or Path(spec).exists():
        target = spec
        kind = read_manifest(target).get("kind", "")
    if kind not in _RETRIEVERS:
        raise RetrievalError(f"unknown retriever kind {kind!r} for {spec!r}; known: {sorted(_RETRIEVERS)}")
    retriever = _RETRIEVERS[kind](target)
    retriever.spec = spec
    return retriever
