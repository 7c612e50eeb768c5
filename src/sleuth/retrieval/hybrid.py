"""Hybrid retrieval: BM25 and dense rankings fused by weighted reciprocal rank (RRF, Cormack et al. 2009).

RRF needs no score calibration between the two retrievers (BM25 scores are unbounded, cosines are not), only
ranks: a passage scores ``sum_i w_i / (k_rrf + rank_i)`` over the lists it appears in.

Index directory layout::

    DIR/sleuth-index.json     kind "hybrid": the sub-index dirs (relative to DIR), weights, k_rrf
    DIR/bm25/                 a BM25 index
    DIR/dense/                a dense index; its passage store is hard-linked from bm25/
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sleuth.records import Passage
from sleuth.retrieval.base import (
    INDEX_MANIFEST,
    RetrievalError,
    Retriever,
    check_options,
    float_list_option,
    int_option,
    read_manifest,
    register_retriever,
)
from sleuth.retrieval.building import BuildReport, corpus_identity, swap_in, write_atomic

if TYPE_CHECKING:
    from sleuth.retrieval.bm25 import BM25Params
    from sleuth.retrieval.dense import Progress

FORMAT_VERSION = 1
HYBRID_OPTIONS = ("weights", "k_rrf", "pool")


def rrf_fuse(
    ranked_lists: Sequence[Sequence[Passage]],
    weights: Sequence[float] | None = None,
    k_rrf: int = 60,
    top: int | None = None,
) -> list[Passage]:
    """Fuse rankings (best first) into one: score ``sum_i w_i / (k_rrf + rank_i)``, ranks from 1.

    Passages are identified by id; a repeated id within one list counts at its best rank only; lists with weight 0
    are ignored. Ties go to the passage with the best single rank, then to the smaller id. The returned passages
    are copies of the first occurrence with ``score`` set to the fused score and ``meta["rrf_ranks"]`` holding the
    rank in each list (None where absent). ``top`` limits the length (default: all).
    """
    weights = [1.0] * len(ranked_lists) if weights is None else list(weights)
    if len(weights) != len(ranked_lists):
        raise ValueError(f"{len(weights)} weights for {len(ranked_lists)} ranked lists")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must not be negative: {weights}")
    if k_rrf < 0:
        raise ValueError(f"k_rrf must not be negative: {k_rrf}")
    scores: dict[str, float] = {}
    best: dict[str, int] = {}
    first: dict[str, Passage] = {}
    ranks: dict[str, list[int | None]] = {}
    for i, (hits, weight) in enumerate(zip(ranked_lists, weights, strict=True)):
        if weight == 0:
            continue
        for rank, passage in enumerate(hits, 1):
            pid = passage.id
            if pid in ranks and ranks[pid][i] is not None:
                continue
            if pid not in first:
                first[pid], ranks[pid], scores[pid], best[pid] = passage, [None] * len(ranked_lists), 0.0, rank
            scores[pid] += weight / (k_rrf + rank)
            best[pid] = min(best[pid], rank)
            ranks[pid][i] = rank
    order = sorted(scores, key=lambda pid: (-scores[pid], best[pid], pid))
    if top is not None:
        order = order[:top]
    return [replace(first[p], score=scores[p], meta={**first[p].meta, "rrf_ranks": ranks[p]}) for p in order]


class HybridRetriever(Retriever):
    """Search both retrievers for ``candidates`` passages each (default ``max(4 * k, 50)``) and fuse with RRF."""

    def __init__(
        self,
        bm25: Retriever,
        dense: Retriever,
        weights: Sequence[float] = (1.0, 1.0),
        k_rrf: int = 60,
        candidates: int | None = None,
    ) -> None:
        if len(weights) != 2 or any(w < 0 for w in weights):
            raise RetrievalError(f"a hybrid retriever needs two non-negative weights (bm25, dense), got {weights}")
        self.bm25 = bm25
        self.dense = dense
        self.weights = [float(w) for w in weights]
        self.k_rrf = k_rrf
        self.candidates = candidates

    def __len__(self) -> int:
        return max(len(self.bm25), len(self.dense))

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if not queries:
            return []
        pool = self.candidates or max(4 * k, 50)
        lexical = self.bm25.search(queries, pool)
        semantic = self.dense.search(queries, pool)
        return [rrf_fuse([a, b], self.weights, self.k_rrf, top=k) for a, b in zip(lexical, semantic, strict=True)]

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "weights": self.weights,
            "k_rrf": self.k_rrf,
            "candidates": self.candidates,
            "bm25": self.bm25.describe(),
            "dense": self.dense.describe(),
        }


def build_hybrid_index(
    corpus: str | Path,
    out: str | Path,
    format: str | None = None,
    strict: bool = False,
    weights: Sequence[float] = (1.0, 1.0),
    k_rrf: int = 60,
    bm25_params: BM25Params | None = None,
    chunk_size: int = 100_000,
    overwrite: bool = False,
    on_progress: Progress | None = None,
    **dense_kwargs: Any,
) -> BuildReport:
    """Build ``out/bm25`` and ``out/dense`` from one corpus (read once; the dense half links BM25's passage
    store) and a hybrid manifest. Both halves resume as their own builds do. ``dense_kwargs`` go to
    :func:`~sleuth.retrieval.dense.build_dense_index`; ``on_progress(stage, done, total)`` gets stage "bm25"
    (bytes of the corpus read) and then the dense stages."""
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.retrieval.dense import build_dense_index

    started = time.time()
    corpus, out = Path(corpus), Path(out)
    if len(weights) != 2 or any(w < 0 for w in weights):
        raise RetrievalError(f"a hybrid index needs two non-negative weights (bm25, dense), got {list(weights)}")
    if out.exists() and not overwrite:
        raise RetrievalError(f"{out} already exists; pass overwrite=True (--overwrite) to rebuild it")
    work = out.with_name(out.name + ".partial")
    state_path = work / "build.json"
    identity = {"corpus": corpus_identity(corpus), "format": format, "chunk": chunk_size}
    if not (state_path.exists() and json.loads(state_path.read_text())["identity"] == identity) and work.exists():
        shutil.rmtree(work)  # a finished half from another corpus must not be reused
    work.mkdir(parents=True, exist_ok=True)
    write_atomic(state_path, json.dumps({"identity": identity}).encode())

    reading: dict[str, Any] = {"format": format, "strict": strict, "chunk_size": chunk_size}  # both halves
    resumed = 0
    messages: list[str] = []
    if not (work / "bm25" / INDEX_MANIFEST).exists():
        report = build_bm25_index(
            corpus,
            work / "bm25",
            params=bm25_params,
            **reading,
            on_progress=(lambda done, total, _n: on_progress("bm25", done, total)) if on_progress else None,
        )
        resumed, messages = report.resumed_chunks, report.skipped_messages
    resumed_embeddings = 0
    if not (work / "dense" / INDEX_MANIFEST).exists():
        report = build_dense_index(
            corpus,
            work / "dense",
            **reading,
            store_from=work / "bm25",
            on_progress=on_progress,
            **dense_kwargs,
        )
        resumed_embeddings = report.resumed_embeddings
    bm25_manifest = read_manifest(work / "bm25")
    dense_manifest = read_manifest(work / "dense")
    manifest = {
        "kind": "hybrid",
        "format_version": FORMAT_VERSION,
        "bm25": "bm25",
        "dense": "dense",
        "weights": [float(w) for w in weights],
        "k_rrf": k_rrf,
        "passages": dense_manifest["passages"],
        "skipped_lines": bm25_manifest["skipped_lines"],
        "corpus": str(corpus.resolve()),
        "corpus_format": bm25_manifest["corpus_format"],
        "encoder": dense_manifest["encoder"]["model"],
        "index_type": dense_manifest["index_type"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (work / INDEX_MANIFEST).write_text(json.dumps(manifest, indent=2))
    state_path.unlink()
    return swap_in(
        work, out, started, manifest["passages"], manifest["skipped_lines"], resumed, messages, resumed_embeddings
    )


@register_retriever("hybrid")
def _load_hybrid(target: str, options: dict[str, str]) -> HybridRetriever:
    from sleuth.retrieval.bm25 import BM25Retriever
    from sleuth.retrieval.dense import DENSE_OPTIONS, DenseRetriever, dense_kwargs

    check_options("hybrid", options, (*HYBRID_OPTIONS, *DENSE_OPTIONS))
    root = Path(target)
    manifest = read_manifest(root)
    if manifest.get("kind") != "hybrid":
        raise RetrievalError(f"{target} is a {manifest.get('kind')!r} index, not hybrid")
    weights = float_list_option(options, "weights", manifest["weights"])
    return HybridRetriever(
        BM25Retriever(root / manifest["bm25"]),
        DenseRetriever(root / manifest["dense"], **dense_kwargs(options)),
        weights=weights or manifest["weights"],
        k_rrf=int_option(options, "k_rrf", manifest["k_rrf"], minimum=0),
        candidates=int_option(options, "pool"),
    )
