"""BM25 with bm25s: a resumable, streaming index build and a memory-mapped, batched searcher.

Index directory layout::

    DIR/sleuth-index.json          kind, corpus, counts, BM25 and tokenizer parameters
    DIR/passages.jsonl, passages.offsets.npy      the passage store (memory-mapped)
    DIR/bm25/                      bm25s files (loaded with mmap=True)
    DIR/vocab.json                 stem -> token id

The build streams the corpus in chunks of ``chunk_size`` passages. Each finished chunk (its passages, its token ids
and the new vocabulary entries) is written to ``DIR.partial/`` before the next starts, so a killed build resumes at
the first unfinished chunk. Only the final bm25s scoring needs all token ids at once, held as compact int32 arrays.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.records import Passage
from sleuth.retrieval.base import (
    INDEX_MANIFEST,
    RetrievalError,
    StoredRetriever,
    check_options,
    read_manifest,
    register_retriever,
)
from sleuth.retrieval.building import BuildReport, corpus_identity, index_manifest, swap_in, write_atomic
from sleuth.retrieval.store import PassageStore, passage_line

FORMAT_VERSION = 1


@dataclass(frozen=True)
class BM25Params:
    """Scoring and tokenization settings (bm25s's defaults; English stopwords and Snowball stemming)."""

    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    stopwords: str = "en"
    stemmer: str | None = "english"
    index_title: bool = True


class BM25Tokenizer:
    """Lower-case word tokens (``\\w\\w+``), English stopwords removed, Snowball-stemmed; stems map to ids.

    Id 0 is the empty token, used for documents and queries with no other token.
    """

    pattern = re.compile(r"(?u)\b\w\w+\b")

    def __init__(self, params: BM25Params, vocab: dict[str, int] | None = None) -> None:
        from bm25s.stopwords import STOPWORDS_EN

        self.stopwords = frozenset(STOPWORDS_EN) if params.stopwords == "en" else frozenset()
        self._stem_many: Callable[[list[str]], list[str]] = lambda words: words
        if params.stemmer:
            import Stemmer

            self._stem_many = Stemmer.Stemmer(params.stemmer).stemWords
        self.vocab: dict[str, int] = vocab if vocab is not None else {"": 0}
        self._stem_cache: dict[str, str] = {}

    def stems(self, text: str) -> list[str]:
        words = [w for w in self.pattern.findall(text.lower()) if w not in self.stopwords]
        new = [w for w in set(words) if w not in self._stem_cache]
        if new:
            self._stem_cache.update(zip(new, self._stem_many(new), strict=True))
            if len(self._stem_cache) > 2_000_000:
                self._stem_cache.clear()
        return [self._stem_cache[w] for w in words]

    def document_ids(self, text: str) -> list[int]:
        """Token ids of a document, adding unseen stems to the vocabulary."""
        ids = [self.vocab.setdefault(stem, len(self.vocab)) for stem in self.stems(text)]
        return ids or [0]

    def query_tokens(self, text: str) -> list[str]:
        """Known stems of a query (unknown ones cannot match anything), or the empty token."""
        return [s for s in self.stems(text) if s in self.vocab] or [""]


class _TokenLists(Sequence[list[int]]):
    """All documents' token ids as one int32 array plus offsets; yields plain lists for bm25s."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        self.flat = flat
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        return self.flat[self.starts[i] : self.starts[i + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(len(self)):
            yield self[i]


def build_bm25_index(
    corpus: str | Path,
    out: str | Path,
    format: str | None = None,
    strict: bool = False,
    params: BM25Params | None = None,
    chunk_size: int = 100_000,
    overwrite: bool = False,
    on_progress: Callable[[int, int | None, int], None] | None = None,
) -> BuildReport:
    """Build a BM25 index of ``corpus`` into ``out``; resume an interrupted build of the same corpus.

    ``on_progress(bytes_read, total_bytes, passages)`` is called as chunks are read (for a progress bar).
    """
    from sleuth.corpus import CorpusReader

    started = time.time()
    corpus, out = Path(corpus), Path(out)
    params = params or BM25Params()
    if out.exists() and not overwrite:
        raise RetrievalError(f"{out} already exists; pass overwrite=True (--overwrite) to rebuild it")
    work = out.with_name(out.name + ".partial")
    state_path = work / "build.json"
    identity = {"corpus": corpus_identity(corpus), "format": format, "params": asdict(params), "chunk": chunk_size}
    state: dict[str, Any] = {"identity": identity, "chunks": 0, "vocab": 1, "passages": 0, "skipped": 0, "errors": []}
    if state_path.exists() and json.loads(state_path.read_text())["identity"] == identity:
        state = json.loads(state_path.read_text())
    elif work.exists():
        shutil.rmtree(work)
    resumed = state["chunks"]
    (work / "chunks").mkdir(parents=True, exist_ok=True)

    # The vocabulary is append-only: ids are assigned in first-seen order, so the first state["vocab"] lines of
    # vocab.txt are exactly the vocabulary after the last finished chunk.
    vocab_path = work / "vocab.txt"
    vocab: dict[str, int] = {"": 0}
    if vocab_path.exists():
        for line in vocab_path.read_text(encoding="utf-8").split("\n")[: state["vocab"] - 1]:
            vocab[line] = len(vocab)
    with open(vocab_path, "w", encoding="utf-8") as f:  # drop lines of a chunk that did not finish
        f.write("".join(f"{stem}\n" for stem in list(vocab)[1:]))
    tokenizer = BM25Tokenizer(params, vocab)

    reader = CorpusReader(corpus, format=format, strict=strict)
    passages = iter(reader)
    # skip what finished chunks already hold (islice: the last finished chunk may be short)
    deque(islice(passages, state["chunks"] * chunk_size), maxlen=0)
    chunk_index = state["chunks"]
    while True:
        batch: list[Passage] = [p for _, p in zip(range(chunk_size), passages, strict=False)]
        if not batch:
            break
        vocab_before = len(tokenizer.vocab)
        token_ids = [tokenizer.document_ids(f"{p.title}\n{p.text}" if params.index_title else p.text) for p in batch]
        stem = work / "chunks" / f"{chunk_index:06d}"
        write_atomic(stem.with_suffix(".jsonl"), b"".join(passage_line(p) for p in batch))
        np.save(stem.with_suffix(".lens.npy"), np.array([len(t) for t in token_ids], dtype=np.int32))
        np.save(stem.with_suffix(".ids.npy"), np.fromiter((i for t in token_ids for i in t), dtype=np.int32))
        with open(vocab_path, "a", encoding="utf-8") as f:
            f.write("".join(f"{s}\n" for s in list(tokenizer.vocab)[vocab_before:]))
        chunk_index += 1
        state.update(
            chunks=chunk_index,
            vocab=len(tokenizer.vocab),
            passages=state["passages"] + len(batch),
            skipped=reader.skipped,  # the reader re-reads finished chunks on resume, so its count is complete
            errors=reader.errors[:20],
        )
        write_atomic(state_path, json.dumps(state).encode())
        if on_progress:
            on_progress(reader.bytes_read, reader.total_bytes, state["passages"])
        if len(batch) < chunk_size:
            break

    state.update(skipped=reader.skipped, errors=reader.errors[:20])  # malformed lines after the last passage
    if state["passages"] == 0:
        raise RetrievalError(f"no passages read from {corpus} ({reader.summary()})")
    _finalize(work, chunk_index, tokenizer.vocab, params, corpus, reader.format, state)
    return swap_in(work, out, started, state["passages"], state["skipped"], resumed, state["errors"])


def _finalize(
    work: Path,
    n_chunks: int,
    vocab: dict[str, int],
    params: BM25Params,
    corpus: Path,
    corpus_format: str | None,
    state: dict[str, Any],
) -> None:
    import bm25s

    chunks = [work / "chunks" / f"{i:06d}" for i in range(n_chunks)]
    n = PassageStore.write(work, (c.with_suffix(".jsonl") for c in chunks))
    flat = np.concatenate([np.load(c.with_suffix(".ids.npy")) for c in chunks])
    lengths = np.concatenate([np.load(c.with_suffix(".lens.npy")) for c in chunks])
    model = bm25s.BM25(k1=params.k1, b=params.b, method=params.method)
    # bm25s accepts any object with `ids` (iterable of token-id lists) and `vocab`; ours stays int32 until iterated.
    model.index(bm25s.tokenization.Tokenized(ids=_TokenLists(flat, lengths), vocab=vocab), show_progress=False)
    model.save(str(work / "bm25"))
    (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    manifest = index_manifest(
        "bm25",
        FORMAT_VERSION,
        n,
        state["skipped"],
        corpus,
        corpus_format,
        params=asdict(params),
        vocab_size=len(vocab),
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    (work / INDEX_MANIFEST).write_text(json.dumps(manifest, indent=2))
    # build.json goes first: from here on a killed build restarts from scratch instead of resuming into
    # chunks that are being deleted.
    (work / "build.json").unlink()
    shutil.rmtree(work / "chunks")
    (work / "vocab.txt").unlink()


class BM25Retriever(StoredRetriever):
    """Search a BM25 index directory; the score matrix and the passages are memory-mapped."""

    def __init__(self, index_dir: str | Path) -> None:
        import bm25s

        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir)
        if self.manifest.get("kind") != "bm25":
            raise RetrievalError(f"{index_dir} is a {self.manifest.get('kind')!r} index, not bm25")
        self.params = BM25Params(**self.manifest["params"])
        vocab = json.loads((self.index_dir / "vocab.json").read_text(encoding="utf-8"))
        self.tokenizer = BM25Tokenizer(self.params, vocab)
        self.model = bm25s.BM25.load(str(self.index_dir / "bm25"), mmap=True, load_corpus=False)
        self.store = PassageStore(self.index_dir)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if not queries:
            return []
        k = min(k, len(self.store))
        tokens = [self.tokenizer.query_tokens(q) for q in queries]
        docs, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=0)
        return self.passages(docs.tolist(), scores.tolist())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "index": str(self.index_dir), "params": asdict(self.params)}


@register_retriever("bm25")
def _load_bm25(target: str, options: dict[str, str]) -> BM25Retriever:
    check_options("bm25", options, ())
    return BM25Retriever(target)
