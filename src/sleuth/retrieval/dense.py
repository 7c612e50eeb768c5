"""Dense retrieval: sentence-transformers embeddings in a FAISS index, built resumably, searched in batches.

Index directory layout::

    DIR/sleuth-index.json     kind "dense": encoder and prefixes, dim, index type and parameters, counts
    DIR/passages.jsonl, passages.offsets.npy      the passage store (memory-mapped)
    DIR/faiss.index           the FAISS index, inner product on L2-normalised vectors (= cosine)
    DIR/embeddings.f32        raw float32 (passages, dim) embeddings, row i = passage i (kept unless
                              keep_embeddings=False)

``embeddings.f32`` is not read by search and can be deleted after the build; it is kept so that another index type
can be built from it with :func:`build_faiss_index` without embedding the corpus again (for ``flat`` it duplicates
``faiss.index``).

The build works in ``DIR.partial/``, in stages recorded in ``build.json``: the corpus is read into the passage store
in chunks of ``chunk_size`` passages (as for BM25), then embedded ``flush_every`` passages at a time into the
``embeddings.f32`` memmap, the count of embedded passages being saved after every flushed block; then the FAISS
index is built from the memmap, adding vectors in batches. A killed build resumes at the first unfinished chunk or
block; a resumed build with the same settings writes the same embeddings byte for byte (on CPU), since every block
is encoded by one ``encode`` call over the same passages.

Index types: ``flat`` (exact, ``IndexFlatIP``), ``hnsw`` (``IndexHNSWFlat``; ``ef_search`` trades speed for recall
at query time) and ``ivfpq`` (``IndexIVFPQ``: ``pq_m`` bytes a vector at 8 bits; trained on at most ``train_size``
vectors; ``nprobe`` lists are searched). ``faiss.index`` is memory-mapped at load for all three.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sleuth.records import Passage
from sleuth.retrieval.base import (
    INDEX_MANIFEST,
    RetrievalError,
    StoredRetriever,
    check_options,
    int_option,
    read_manifest,
    register_retriever,
)
from sleuth.retrieval.building import BuildReport, corpus_identity, index_manifest, swap_in, write_atomic
from sleuth.retrieval.store import OFFSETS, PASSAGES, PassageStore, passage_line

if TYPE_CHECKING:
    import faiss

FORMAT_VERSION = 1
INDEX_TYPES = ("flat", "hnsw", "ivfpq")
EMBEDDINGS = "embeddings.f32"
FAISS_INDEX = "faiss.index"
#: Options of ``dense:DIR?...`` specs (hybrid specs pass them on to their dense half).
DENSE_OPTIONS = ("nprobe", "ef_search", "device", "encoder")

#: ``on_progress(stage, done, total)``: stage "read" (bytes of the corpus file), "embed" or "index" (passages).
Progress = Callable[[str, int | None, int | None], None]


def resolve_device(device: str | None) -> str:
    """``device`` as given, or ``"cuda"`` when a GPU is visible and ``"cpu"`` otherwise."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """A sentence-transformers bi-encoder giving float32, L2-normalised query and passage vectors.

    ``model`` is a local directory or a Hugging Face model name; ``"default"`` is the bundled all-MiniLM-L6-v2
    (``sleuth assets fetch``). Models trained with prefixes need them here: E5 models want
    ``query_prefix="query: "`` and ``passage_prefix="passage: "``, BGE models a query instruction; MiniLM wants
    none. Passages are encoded as ``f"{title}\\n{text}"`` (``with_title=False``: the text only). The model is loaded
    on first use, so an Encoder can describe itself (and a resumed build can skip it) without loading anything.
    """

    def __init__(
        self,
        model: str | Path = "default",
        device: str | None = None,
        query_prefix: str = "",
        passage_prefix: str = "",
        with_title: bool = True,
        batch_size: int = 64,
        max_length: int | None = None,
    ) -> None:
        if str(model) == "default":
            from sleuth.assets import default_embedder_dir

            model = default_embedder_dir()
            if not model.exists():
                raise RetrievalError(f"the default embedder is not at {model}; run `sleuth assets fetch`")
        path = Path(model).expanduser()
        self.name = str(path.resolve()) if path.exists() else str(model)
        self.device = device
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.with_title = with_title
        self.batch_size = batch_size
        self.max_length = max_length
        self._model: Any = None

    @property
    def model(self) -> Any:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            if Path(self.name).is_absolute() and not Path(self.name).exists():
                raise RetrievalError(
                    f"encoder {self.name} not found; pass another path (spec option encoder=PATH) if the index moved"
                )
            self.device = resolve_device(self.device)
            self._model = SentenceTransformer(self.name, device=self.device)
            if self.max_length:
                self._model.max_seq_length = self.max_length
        return self._model

    @property
    def dim(self) -> int:
        model = self.model
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get_dim() or self._encode(["x"]).shape[1])

    def identity(self) -> dict[str, Any]:
        """Everything that changes the vectors: a resumed build re-embeds when this differs."""
        return {
            "model": self.name,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "with_title": self.with_title,
            "max_length": self.max_length,
        }

    def passage_text(self, passage: Passage) -> str:
        body = f"{passage.title}\n{passage.text}" if self.with_title and passage.title else passage.text
        return self.passage_prefix + body

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + t for t in texts])

    def encode_passages(self, passages: Sequence[Passage | str]) -> np.ndarray:
        """Vectors of passages (formatted by :meth:`passage_text`) or of strings (only the prefix is added)."""
        return self._encode(
            [self.passage_text(p) if isinstance(p, Passage) else self.passage_prefix + p for p in passages]
        )

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


# ------------------------------------------------------------------------------------------------------ faiss index


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, limit) + 1) if n % d == 0)


def build_faiss_index(
    vectors: np.ndarray,
    index_type: str = "flat",
    *,
    hnsw_m: int = 32,
    ef_construction: int = 200,
    ef_search: int = 128,
    ivf_nlist: int | None = None,
    pq_m: int | None = None,
    pq_bits: int = 8,
    nprobe: int = 32,
    train_size: int = 100_000,
    add_batch: int = 65_536,
    seed: int = 0,
    on_progress: Progress | None = None,
) -> tuple[faiss.Index, dict[str, Any]]:
    """An inner-product FAISS index of ``vectors`` (an (n, dim) float32 array or memmap, rows L2-normalised).

    Vectors are read ``add_batch`` rows at a time, so a memmap larger than memory works (the index itself holds
    them for ``flat`` and ``hnsw``). Returns the index and its resolved parameters, for the manifest. ``ivfpq``
    defaults: ``ivf_nlist`` about 4 * sqrt(n) (at most n / 39, FAISS's minimum of training points per centroid),
    ``pq_m`` the largest divisor of dim not above dim / 8; ``pq_bits`` is lowered when there are fewer than
    2 ** pq_bits training vectors.
    """
    import faiss

    n, dim = vectors.shape
    if n == 0:
        raise RetrievalError("cannot build an index of zero vectors")
    params: dict[str, Any]
    if index_type == "flat":
        index = faiss.IndexFlatIP(dim)
        params = {}
    elif index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        index.hnsw.efSearch = ef_search
        params = {"hnsw_m": hnsw_m, "ef_construction": ef_construction, "ef_search": ef_search}
    elif index_type == "ivfpq":
        nlist = ivf_nlist or round(4 * math.sqrt(n))
        nlist = max(1, min(nlist, n // 39 or 1))
        m = pq_m or _largest_divisor_at_most(dim, dim // 8)
        if dim % m:
            raise RetrievalError(f"pq_m={m} must divide the embedding dimension {dim}")
        rng = np.random.default_rng(seed)
        n_train = min(n, train_size)
        rows = np.sort(rng.choice(n, n_train, replace=False)) if n_train < n else np.arange(n)
        sample = np.ascontiguousarray(vectors[rows], dtype=np.float32)
        bits = max(1, min(pq_bits, int(math.log2(n_train))))
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, bits, faiss.METRIC_INNER_PRODUCT)
        index.train(sample)
        del sample
        index.nprobe = min(nprobe, nlist)
        params = {"nlist": nlist, "pq_m": m, "pq_bits": bits, "nprobe": index.nprobe, "trained_on": n_train}
    else:
        raise RetrievalError(f"unknown index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    for start in range(0, n, add_batch):
        end = min(n, start + add_batch)
        index.add(np.ascontiguousarray(vectors[start:end], dtype=np.float32))
        if on_progress:
            on_progress("index", end, n)
    return index, params


def read_faiss_index(path: Path, index_type: str) -> faiss.Index:
    """Read ``faiss.index`` memory-mapped: the codes of flat and HNSW indexes, the inverted lists of IVF ones."""
    import faiss

    flag = getattr(faiss, "IO_FLAG_MMAP" if index_type == "ivfpq" else "IO_FLAG_MMAP_IFC", 0)
    return faiss.read_index(str(path), flag)


# ------------------------------------------------------------------------------------------------------------ build


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def build_dense_index(
    corpus: str | Path,
    out: str | Path,
    encoder: str | Path | Encoder = "default",
    index_type: str = "flat",
    format: str | None = None,
    strict: bool = False,
    batch_size: int = 64,
    device: str | None = None,
    query_prefix: str = "",
    passage_prefix: str = "",
    with_title: bool = True,
    hnsw_m: int = 32,
    ef_construction: int = 200,
    ef_search: int = 128,
    ivf_nlist: int | None = None,
    pq_m: int | None = None,
    pq_bits: int = 8,
    nprobe: int = 32,
    train_size: int = 100_000,
    chunk_size: int = 100_000,
    flush_every: int = 4096,
    keep_embeddings: bool = True,
    store_from: str | Path | None = None,
    overwrite: bool = False,
    on_progress: Progress | None = None,
) -> BuildReport:
    """Embed ``corpus`` and build a dense index into ``out``; resume an interrupted build of the same corpus.

    ``encoder`` is a model path or name (``"default"``: the bundled MiniLM) or an :class:`Encoder`, whose prefix
    and title settings then win over ``query_prefix``/``passage_prefix``/``with_title``/``batch_size``/``device``.
    ``store_from`` names an index built from the same corpus (e.g. the BM25 half of a hybrid index) whose passage
    store is hard-linked instead of reading the corpus again. ``on_progress(stage, done, total)``: see
    :data:`Progress`. See the module docstring for the stages and the index types.
    """
    started = time.time()
    corpus, out = Path(corpus), Path(out)
    if index_type not in INDEX_TYPES:
        raise RetrievalError(f"unknown index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    if flush_every < 1 or chunk_size < 1:
        raise RetrievalError("flush_every and chunk_size must be positive")
    if out.exists() and not overwrite:
        raise RetrievalError(f"{out} already exists; pass overwrite=True (--overwrite) to rebuild it")
    if not isinstance(encoder, Encoder):
        encoder = Encoder(encoder, device, query_prefix, passage_prefix, with_title, batch_size)
    work = out.with_name(out.name + ".partial")
    state_path = work / "build.json"
    source = Path(store_from).resolve() if store_from is not None else None
    identity = {
        "corpus": corpus_identity(corpus),
        "format": format,
        "chunk": chunk_size,
        "store_from": str(source) if source else None,
    }
    state: dict[str, Any] = {
        "identity": identity,
        "chunks": 0,
        "passages": 0,
        "skipped": 0,
        "errors": [],
        "corpus_format": format,
        "stored": False,
        "embed": None,
    }
    if state_path.exists() and json.loads(state_path.read_text())["identity"] == identity:
        state = json.loads(state_path.read_text())
    elif work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    resumed_chunks = state["chunks"]

    def save() -> None:
        write_atomic(state_path, json.dumps(state).encode())

    if not state["stored"]:
        if source is not None:
            source_manifest = read_manifest(source)
            for name in (PASSAGES, OFFSETS):
                (work / name).unlink(missing_ok=True)
                _link_or_copy(source / name, work / name)
            state.update(
                passages=source_manifest["passages"],
                skipped=source_manifest.get("skipped_lines", 0),
                corpus_format=source_manifest.get("corpus_format", format),
            )
        else:
            _read_passages(corpus, work, state, format, strict, chunk_size, save, on_progress)
        state["stored"] = True
        save()
        shutil.rmtree(work / "chunks", ignore_errors=True)

    n = state["passages"]
    embed = state["embed"]
    if embed is None or embed["identity"] != encoder.identity():
        embed = state["embed"] = {"identity": encoder.identity(), "dim": None, "embedded": 0}
    resumed_embeddings = embed["embedded"]
    if embed["embedded"] < n:
        _embed(work, encoder, embed, n, flush_every, save, on_progress)
    dim = embed["dim"]

    vectors = np.memmap(work / EMBEDDINGS, dtype=np.float32, mode="r", shape=(n, dim))
    index, index_params = build_faiss_index(
        vectors,
        index_type,
        hnsw_m=hnsw_m,
        ef_construction=ef_construction,
        ef_search=ef_search,
        ivf_nlist=ivf_nlist,
        pq_m=pq_m,
        pq_bits=pq_bits,
        nprobe=nprobe,
        train_size=train_size,
        on_progress=on_progress,
    )
    del vectors
    import faiss

    faiss.write_index(index, str(work / FAISS_INDEX))
    manifest = index_manifest(
        "dense",
        FORMAT_VERSION,
        n,
        state["skipped"],
        corpus,
        state["corpus_format"],
        encoder=embed["identity"],
        dim=dim,
        metric="inner_product",
        index_type=index_type,
        index_params=index_params,
        embeddings=EMBEDDINGS if keep_embeddings else None,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    (work / INDEX_MANIFEST).write_text(json.dumps(manifest, indent=2))
    state_path.unlink()  # from here on a killed build restarts from scratch rather than resume a finished dir
    if not keep_embeddings:
        (work / EMBEDDINGS).unlink()
    return swap_in(work, out, started, n, state["skipped"], resumed_chunks, state["errors"], resumed_embeddings)


def _read_passages(
    corpus: Path,
    work: Path,
    state: dict[str, Any],
    format: str | None,
    strict: bool,
    chunk_size: int,
    save: Callable[[], None],
    on_progress: Progress | None,
) -> None:
    """Stream the corpus into chunk files, saving the state after each, then concatenate them into the store."""
    from sleuth.corpus import CorpusReader

    (work / "chunks").mkdir(exist_ok=True)
    reader = CorpusReader(corpus, format=format, strict=strict)
    passages = iter(reader)
    deque(islice(passages, state["chunks"] * chunk_size), maxlen=0)  # what finished chunks already hold
    while True:
        batch = list(islice(passages, chunk_size))
        if not batch:
            break
        write_atomic(work / "chunks" / f"{state['chunks']:06d}.jsonl", b"".join(passage_line(p) for p in batch))
        state.update(
            chunks=state["chunks"] + 1,
            passages=state["passages"] + len(batch),
            skipped=reader.skipped,  # the reader re-reads finished chunks on resume, so its count is complete
            errors=reader.errors[:20],
        )
        save()
        if on_progress:
            on_progress("read", reader.bytes_read, reader.total_bytes)
        if len(batch) < chunk_size:
            break
    # A short or empty batch means the reader finished its pass, so its counts include trailing malformed lines.
    state.update(skipped=reader.skipped, errors=reader.errors[:20], corpus_format=reader.format)
    if state["passages"] == 0:
        raise RetrievalError(f"no passages read from {corpus} ({reader.summary()})")
    chunks = [work / "chunks" / f"{i:06d}.jsonl" for i in range(state["chunks"])]
    PassageStore.write(work, chunks)


def _embed(
    work: Path,
    encoder: Encoder,
    embed: dict[str, Any],
    n: int,
    flush_every: int,
    save: Callable[[], None],
    on_progress: Progress | None,
) -> None:
    """Fill ``embeddings.f32`` from row ``embed["embedded"]`` on, saving the count after every flushed block."""
    dim = encoder.dim
    path = work / EMBEDDINGS
    if embed["dim"] != dim or not path.exists() or path.stat().st_size != n * dim * 4:
        embed.update(dim=dim, embedded=0)
        path.unlink(missing_ok=True)
    vectors = np.memmap(path, dtype=np.float32, mode="r+" if path.exists() else "w+", shape=(n, dim))
    store = PassageStore(work)
    # Blocks start at multiples of flush_every, so a resumed build encodes exactly the same blocks.
    for start in range(embed["embedded"], n, flush_every):
        end = min(n, start + flush_every)
        vectors[start:end] = encoder.encode_passages([store[i] for i in range(start, end)])
        vectors.flush()
        embed["embedded"] = end
        save()
        if on_progress:
            on_progress("embed", end, n)
    del vectors


# ----------------------------------------------------------------------------------------------------------- search


class DenseRetriever(StoredRetriever):
    """Search a dense index directory: one ``encode`` call and one FAISS search per batch of queries.

    ``nprobe`` (ivfpq) and ``ef_search`` (hnsw) override the values stored at build time; ``encoder`` replaces
    the manifest's model (a path, e.g. after moving the index to another machine, or an :class:`Encoder`).
    """

    def __init__(
        self,
        index_dir: str | Path,
        device: str | None = None,
        nprobe: int | None = None,
        ef_search: int | None = None,
        encoder: str | Path | Encoder | None = None,
        batch_size: int = 64,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir)
        if self.manifest.get("kind") != "dense":
            raise RetrievalError(f"{index_dir} is a {self.manifest.get('kind')!r} index, not dense")
        self.index_type: str = self.manifest["index_type"]
        self.index_params: dict[str, Any] = dict(self.manifest["index_params"])
        self.store = PassageStore(self.index_dir)
        self.index = read_faiss_index(self.index_dir / FAISS_INDEX, self.index_type)
        if self.index_type == "hnsw":
            self.index_params["ef_search"] = ef_search or self.index_params["ef_search"]
            self.index.hnsw.efSearch = self.index_params["ef_search"]
        elif self.index_type == "ivfpq":
            self.index_params["nprobe"] = min(nprobe or self.index_params["nprobe"], self.index_params["nlist"])
            self.index.nprobe = self.index_params["nprobe"]
        if isinstance(encoder, Encoder):
            self.encoder = encoder
        else:
            settings = self.manifest["encoder"]
            self.encoder = Encoder(
                encoder or settings["model"],
                device=device,
                query_prefix=settings["query_prefix"],
                passage_prefix=settings["passage_prefix"],
                with_title=settings["with_title"],
                batch_size=batch_size,
                max_length=settings.get("max_length"),
            )

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if not queries:
            return []
        k = min(k, len(self.store))
        if k <= 0:
            return [[] for _ in queries]
        vectors = self.encoder.encode_queries(queries)
        if vectors.shape[1] != self.index.d:
            raise RetrievalError(
                f"encoder {self.encoder.name} gives {vectors.shape[1]}-d vectors; the index holds {self.index.d}-d"
            )
        scores, ids = self.index.search(vectors, k)
        return self.passages(ids.tolist(), scores.tolist())  # skips -1: an HNSW or IVF search can come up short

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "index": str(self.index_dir),
            "index_type": self.index_type,
            "index_params": self.index_params,
            "encoder": self.encoder.identity(),
        }


def dense_kwargs(options: dict[str, str]) -> dict[str, Any]:
    """DenseRetriever arguments from spec options (shared with the hybrid loader)."""
    return {
        "nprobe": int_option(options, "nprobe"),
        "ef_search": int_option(options, "ef_search"),
        "device": options.get("device") or None,
        "encoder": options.get("encoder") or None,
    }


@register_retriever("dense")
def _load_dense(target: str, options: dict[str, str]) -> DenseRetriever:
    check_options("dense", options, DENSE_OPTIONS)
    return DenseRetriever(target, **dense_kwargs(options))
