"""Cross-encoder re-ranking on top of any retriever: ``load_retriever("DIR?rerank=MODEL&candidates=50")``.

A cross-encoder reads the query and the passage together, so it ranks better than a bi-encoder or BM25 but costs
one forward pass per (query, passage) pair; it is used on the first stage's top ``candidates`` only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.records import Passage
from sleuth.retrieval.base import RetrievalError, Retriever
from sleuth.retrieval.dense import resolve_device


def _pair_text(passage: Passage) -> str:
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


class RerankedRetriever(Retriever):
    """Search ``base`` for ``max(candidates, k)`` passages, score every (query, ``f"{title}\\n{text}"``) pair of the
    batch in one ``CrossEncoder.predict`` call, return the top ``k`` by that score.

    The returned passages are copies: ``score`` is the cross-encoder's, ``meta["first_stage_score"]`` the base
    retriever's. Equal scores keep the first stage's order.
    """

    def __init__(
        self,
        base: Retriever,
        model: str | Path,
        candidates: int = 50,
        batch_size: int = 32,
        device: str | None = None,
        max_length: int | None = None,
    ) -> None:
        from sentence_transformers import CrossEncoder

        if candidates < 1:
            raise RetrievalError(f"candidates must be at least 1, got {candidates}")
        path = Path(model).expanduser()
        self.model_name = str(path.resolve()) if path.exists() else str(model)
        self.base = base
        self.candidates = candidates
        self.batch_size = batch_size
        self.model = CrossEncoder(self.model_name, device=resolve_device(device), max_length=max_length)

    def __len__(self) -> int:
        return len(self.base)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if not queries:
            return []
        first = self.base.search(queries, max(self.candidates, k))
        pairs = [(q, _pair_text(p)) for q, hits in zip(queries, first, strict=True) for p in hits]
        scores: np.ndarray = np.zeros(0, dtype=np.float32)
        if pairs:
            scores = np.asarray(
                self.model.predict(pairs, batch_size=self.batch_size, show_progress_bar=False, convert_to_numpy=True),
                dtype=np.float32,
            ).reshape(len(pairs))
        results, offset = [], 0
        for hits in first:
            row = scores[offset : offset + len(hits)].tolist()
            offset += len(hits)
            order = sorted(range(len(hits)), key=lambda i: -row[i])  # stable: ties keep the first-stage order
            results.append(
                [
                    replace(hits[i], score=float(row[i]), meta={**hits[i].meta, "first_stage_score": hits[i].score})
                    for i in order[:k]
                ]
            )
        return results

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "reranker": self.model_name,
            "candidates": self.candidates,
            "base": self.base.describe(),
        }
