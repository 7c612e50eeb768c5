"""The retrieval contract: ``Retriever.search(queries, k) -> list[list[Passage]]``, and the spec registry.

Every retriever (BM25, dense, hybrid, re-ranked, the remote HTTP client) implements the batched, blocking
:meth:`Retriever.search`. Agents call :meth:`Retriever.asearch` for one query; concurrent calls from many agents are
coalesced into one batched ``search`` per ``k`` by a :class:`~sleuth.batching.MicroBatcher`.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, overload
from urllib.parse import parse_qsl

from sleuth.batching import BatchStats, MicroBatcher
from sleuth.records import Passage, encodable

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
        return await self._batcher().submit((encodable(query), k))

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


class StoredRetriever(Retriever):
    """A retriever over an index directory's passage store (``self.store``, a
    :class:`~sleuth.retrieval.store.PassageStore`): its length is the store's."""

    store: Any

    def __len__(self) -> int:
        return len(self.store)

    def passages(self, ids: list[list[int]], scores: list[list[float]]) -> list[list[Passage]]:
        """Per query, the store's passages of ``ids`` with their ``scores``; a negative id (a FAISS search that
        came up short of k) is skipped."""
        results = []
        for row_ids, row_scores in zip(ids, scores, strict=True):
            hits = []
            for i, score in zip(row_ids, row_scores, strict=True):
                if i < 0:
                    continue
                passage = self.store[i]
                passage.score = float(score)
                hits.append(passage)
            results.append(hits)
        return results


Loader = Callable[[str, dict[str, str]], Retriever]
_RETRIEVERS: dict[str, Loader] = {}

#: Options every spec accepts; load_retriever consumes them, loaders never see them.
RERANK_OPTIONS = ("rerank", "candidates", "rerank_batch_size", "rerank_device")


def register_retriever(kind: str) -> Callable[[Loader], Loader]:
    """Register a loader ``(target, options) -> Retriever`` for specs ``kind:target[?options]`` and for index
    dirs of that kind. ``options`` are the spec's ``key=value`` pairs minus the generic reranking ones; a loader
    rejects keys it does not know with :func:`check_options`."""

    def decorate(loader: Loader) -> Loader:
        _RETRIEVERS[kind] = loader
        return loader

    return decorate


def check_options(kind: str, options: dict[str, str], known: Iterable[str]) -> None:
    """Raise :class:`RetrievalError` naming the unknown keys of ``options`` and the known ones."""
    known = list(known)
    unknown = sorted(set(options) - set(known))
    if unknown:
        every = sorted({*known, *RERANK_OPTIONS})
        raise RetrievalError(f"unknown option(s) {unknown} for a {kind} retriever; known: {every}")


@overload
def int_option(options: dict[str, str], key: str, default: int, minimum: int = 1) -> int: ...
@overload
def int_option(options: dict[str, str], key: str, default: None = None, minimum: int = 1) -> int | None: ...
def int_option(options: dict[str, str], key: str, default: int | None = None, minimum: int = 1) -> int | None:
    """``options[key]`` as an int of at least ``minimum``, or ``default`` when absent."""
    if key not in options:
        return default
    try:
        value = int(options[key])
    except ValueError:
        raise RetrievalError(f"option {key}={options[key]!r} is not an integer") from None
    if value < minimum:
        raise RetrievalError(f"option {key}={value} must be at least {minimum}")
    return value


def float_list_option(options: dict[str, str], key: str, default: list[float] | None = None) -> list[float] | None:
    """``options[key]`` as comma-separated floats (``weights=0.5,1``), or ``default`` when absent."""
    if key not in options:
        return default
    try:
        return [float(x) for x in options[key].split(",")]
    except ValueError:
        raise RetrievalError(f"option {key}={options[key]!r} is not a comma-separated list of numbers") from None


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    path = Path(index_dir) / INDEX_MANIFEST
    if not path.exists():
        raise RetrievalError(
            f"{index_dir} is not a sleuth index (no {INDEX_MANIFEST}); build one with `sleuth index build`"
        )
    return json.loads(path.read_text())


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"base?key=value&..."`` into the base and its options (a path that exists is never split)."""
    if "?" not in spec or Path(spec).exists():
        return spec, {}
    base, _, query = spec.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise RetrievalError(f"cannot parse the options of {spec!r}; expected ?key=value&key=value") from None
    options: dict[str, str] = {}
    for key, value in pairs:
        if key in options:
            raise RetrievalError(f"option {key!r} given twice in {spec!r}")
        options[key] = value
    return base, options


def load_retriever(spec: str | None = None) -> Retriever:
    """Open a retriever from a spec: ``bm25:DIR``, ``dense:DIR``, ``hybrid:DIR``, ``remote:URL`` (a sleuth or
    Search-R1 ``/retrieve`` server), a plain index ``DIR`` (kind read
    from its manifest), or ``None``/``"default"`` for the index of the bundled Wikipedia summaries built by
    ``sleuth index build``.

    Any spec takes options after ``?``: ``DIR?rerank=MODEL&candidates=50`` re-ranks the top ``candidates`` with a
    cross-encoder (``rerank_batch_size`` and ``rerank_device`` too). Kind-specific options: ``nprobe``,
    ``ef_search``, ``device``, ``encoder`` (dense and hybrid); ``weights=0.5,1``, ``k_rrf``, ``pool`` (hybrid).
    """
    from sleuth.retrieval import bm25, dense, hybrid, remote  # noqa: F401 - register their kinds; heavy imports are lazy

    base, options = parse_spec(spec or "default")
    if base in ("", "default"):
        from sleuth.assets import default_index_dir

        base = str(default_index_dir())
        if not Path(base).exists():
            raise RetrievalError(f"no default index at {base}; run `sleuth assets fetch` then `sleuth index build`")
        query = (spec or "").partition("?")[2]
        spec = f"{base}?{query}" if query else base
    kind, sep, target = base.partition(":")
    if not sep or kind not in _RETRIEVERS or Path(base).exists():
        target = base
        kind = read_manifest(target).get("kind", "")
    if kind not in _RETRIEVERS:
        raise RetrievalError(f"unknown retriever kind {kind!r} for {spec!r}; known: {sorted(_RETRIEVERS)}")
    rerank = {key: options.pop(key) for key in RERANK_OPTIONS if key in options}
    if rerank and "rerank" not in rerank:
        raise RetrievalError(f"option(s) {sorted(rerank)} need rerank=MODEL in {spec!r}")
    retriever = _RETRIEVERS[kind](target, options)
    if rerank:
        from sleuth.retrieval.rerank import RerankedRetriever

        retriever = RerankedRetriever(
            retriever,
            rerank["rerank"],
            candidates=int_option(rerank, "candidates", 50),
            batch_size=int_option(rerank, "rerank_batch_size", 32),
            device=rerank.get("rerank_device"),
        )
    retriever.spec = spec or base
    return retriever
