"""Fan a query out to several shards of one corpus and merge their hits by score.

A corpus too big for one machine (21M Wikipedia passages as a flat float index) is split into shards, each served
by its own ``sleuth serve retriever``; ``remote:URL1,URL2,...`` searches them all in parallel and keeps the global
top-k. Dense inner-product scores from the same encoder are directly comparable across shards. BM25 scores are
only approximately comparable (each shard has its own document frequencies): split the corpus at random so the
shards' statistics agree. Replicas of one shard belong behind an ordinary HTTP load balancer, not in this list.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sleuth.records import Passage
from sleuth.retrieval.base import RetrievalError, Retriever


class ShardedRetriever(Retriever):
    """Search every shard for the top ``k`` and merge: best score first, ties in shard order."""

    def __init__(self, shards: list[Retriever]) -> None:
        if not shards:
            raise RetrievalError("a sharded retriever needs at least one shard")
        self.shards = shards
        self._pool = ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="shard")

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        per_shard = list(self._pool.map(lambda shard: shard.search(queries, k), self.shards))
        merged = []
        for q in range(len(queries)):
            hits = [(p, s) for s, results in enumerate(per_shard) for p in results[q]]
            if any(p.score is None for p, _ in hits):
                raise RetrievalError("a shard returned hits without scores; sharded search needs scores to merge")
            hits.sort(key=lambda hit: (-(hit[0].score or 0.0), hit[1]))
            merged.append([p for p, _ in hits[:k]])
        return merged

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shards": [s.describe() for s in self.shards]}
