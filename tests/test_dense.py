"""Dense, hybrid and re-ranked retrieval: builds, resume, FAISS recall, RRF, cross-encoder, spec options.

A tiny random BERT (wrapped by sentence-transformers with mean pooling) and a tiny random cross-encoder are built
offline once per session; the bundled all-MiniLM-L6-v2 is used for one end-to-end check when it is present.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sleuth.records import Passage
from sleuth.retrieval import RetrievalError, load_retriever
from sleuth.retrieval.base import parse_spec
from sleuth.retrieval.bm25 import BM25Retriever, build_bm25_index
from sleuth.retrieval.dense import EMBEDDINGS, DenseRetriever, Encoder, build_dense_index, build_faiss_index
from sleuth.retrieval.hybrid import HybridRetriever, build_hybrid_index, rrf_fuse
from tests.test_bm25 import TOPICS, write_corpus

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")

QUERIES = ["Who researched radioactivity?", "tallest mountain in the Himalayas", "river stone market", "Paris"]


def _vocab() -> list[str]:
    text = " ".join(f"{t} {x}" for t, x in TOPICS) + " filler river stone market garden window letter bridge winter"
    tokens = sorted(set(re.findall(r"\w+", text.lower())))
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789")
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *tokens, *chars, *(f"##{c}" for c in chars), *"?'.,()"]


def _save_tiny_bert(out: Path, classifier: bool) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(dict.fromkeys(_vocab()))})
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.5,  # spread-out random outputs: no near-ties between passages
        num_labels=1,
    )
    model = BertForSequenceClassification(config) if classifier else BertModel(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), classifier=False)


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_bert(tmp_path_factory.mktemp("tiny-ce"), classifier=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", n_filler=120)


@pytest.fixture(scope="module")
def flat_index(tmp_path_factory: pytest.TempPathFactory, corpus: Path, tiny_encoder: Path) -> Path:
    out = tmp_path_factory.mktemp("dense") / "flat"
    build_dense_index(corpus, out, encoder=tiny_encoder, device="cpu", chunk_size=50, flush_every=32)
    return out


@pytest.fixture
def one_faiss_thread() -> Iterator[None]:
    """The test machine is shared: OpenMP spinning on a busy core makes FAISS builds many times slower."""
    import faiss

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def ids(results: list[list[Passage]]) -> list[list[str]]:
    return [[p.id for p in hits] for hits in results]


# ------------------------------------------------------------------------------------------------------------ dense


def test_flat_search_matches_brute_force(flat_index: Path, corpus: Path) -> None:
    manifest = json.loads((flat_index / "sleuth-index.json").read_text())
    assert manifest["kind"] == "dense" and manifest["index_type"] == "flat" and manifest["passages"] == 125
    assert manifest["dim"] == 32 and manifest["encoder"]["query_prefix"] == "" and manifest["embeddings"] == EMBEDDINGS
    retriever = load_retriever(str(flat_index))
    assert isinstance(retriever, DenseRetriever) and len(retriever) == 125
    results = retriever.search(QUERIES, k=10)

    embeddings = np.memmap(flat_index / EMBEDDINGS, dtype=np.float32, mode="r", shape=(125, 32))
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    scores = retriever.encoder.encode_queries(QUERIES) @ np.asarray(embeddings).T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    assert ids(results) == [[retriever.store[int(i)].id for i in row] for row in top]
    got = np.array([[p.score for p in hits] for hits in results])
    assert np.allclose(got, np.take_along_axis(scores, top, axis=1), atol=1e-5)

    assert retriever.search([], k=3) == []
    assert [len(r) for r in retriever.search(["x", "y"], k=10_000)] == [125, 125]  # k clamped to the corpus


def test_killed_embedding_resumes_byte_identical(
    flat_index: Path, corpus: Path, tiny_encoder: Path, tmp_path: Path
) -> None:
    class Killed(Exception):
        pass

    stages: list[tuple[str, int | None]] = []

    def kill_on_third_batch(stage: str, done: int | None, total: int | None) -> None:
        stages.append((stage, done))
        if stage == "embed" and done == 96:
            raise Killed

    out = tmp_path / "idx"
    with pytest.raises(Killed):
        build_dense_index(
            corpus,
            out,
            encoder=tiny_encoder,
            device="cpu",
            chunk_size=50,
            flush_every=32,
            on_progress=kill_on_third_batch,
        )
    assert [s for s, _ in stages].count("read") == 3 and [d for s, d in stages if s == "embed"] == [32, 64, 96]
    state = json.loads((tmp_path / "idx.partial" / "build.json").read_text())
    assert state["stored"] and state["embed"]["embedded"] == 96 and not out.exists()
    store_inode = os.stat(tmp_path / "idx.partial" / "passages.jsonl").st_ino

    resumed_stages: list[str] = []
    report = build_dense_index(
        corpus,
        out,
        encoder=tiny_encoder,
        device="cpu",
        chunk_size=50,
        flush_every=32,
        on_progress=lambda stage, done, total: resumed_stages.append(stage),
    )
    assert report.resumed_embeddings == 96 and report.resumed_chunks == 3 and report.passages == 125
    assert "read" not in resumed_stages and resumed_stages.count("embed") == 1  # only the block 96..125 was left
    assert os.stat(out / "passages.jsonl").st_ino == store_inode  # the passage store was not rewritten
    assert (out / EMBEDDINGS).read_bytes() == (flat_index / EMBEDDINGS).read_bytes()
    a, b = DenseRetriever(flat_index), DenseRetriever(out)
    assert [[(p.id, p.score) for p in r] for r in a.search(QUERIES, 5)] == [
        [(p.id, p.score) for p in r] for r in b.search(QUERIES, 5)
    ]


def test_killed_while_reading_resumes_at_the_next_chunk(corpus: Path, tiny_encoder: Path, tmp_path: Path) -> None:
    def stop(stage: str, done: int | None, total: int | None) -> None:
        if stage == "read":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_dense_index(
            corpus, tmp_path / "idx", encoder=tiny_encoder, device="cpu", chunk_size=50, on_progress=stop
        )
    report = build_dense_index(corpus, tmp_path / "idx", encoder=tiny_encoder, device="cpu", chunk_size=50)
    assert report.resumed_chunks == 1 and report.resumed_embeddings == 0 and report.passages == 125
    store = DenseRetriever(tmp_path / "idx").store
    assert [store[i].id for i in (0, 5, 124)] == ["t0", "f0", "f119"]
    with pytest.raises(RetrievalError, match="already exists"):
        build_dense_index(corpus, tmp_path / "idx", encoder=tiny_encoder)


def test_hnsw_and_ivfpq_recall_against_exact(one_faiss_thread: None) -> None:
    # Vectors with a low intrinsic dimension (as sentence embeddings have): 16-d clusters projected to 128-d.
    rng = np.random.default_rng(0)
    n, dim = 5000, 128
    centers = rng.standard_normal((50, 16)) * 2
    latent = centers[rng.integers(0, 50, n + 200)] + rng.standard_normal((n + 200, 16))
    x = (latent @ rng.standard_normal((16, dim)) + 0.1 * rng.standard_normal((n + 200, dim))).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    base, queries = x[:n], x[n:]
    exact = np.argsort(-(queries @ base.T), axis=1)[:, :10]
    recalls = {}
    for index_type in ("flat", "hnsw", "ivfpq"):
        index, params = build_faiss_index(base, index_type, add_batch=1000)
        assert index.ntotal == n
        _, found = index.search(queries, 10)
        recalls[index_type] = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact, strict=True)]))
        print(f"recall@10 {index_type} {params}: {recalls[index_type]:.3f}")
    assert params["nlist"] == min(round(4 * n**0.5), n // 39) and params["pq_m"] == 16 and params["pq_bits"] == 8
    assert recalls["flat"] == 1.0 and recalls["hnsw"] >= 0.9 and recalls["ivfpq"] >= 0.5
    with pytest.raises(RetrievalError, match="pq_m"):
        build_faiss_index(base[:500], "ivfpq", pq_m=7)
    with pytest.raises(RetrievalError, match="unknown index type"):
        build_faiss_index(base[:10], "lsh")


def test_ann_indexes_end_to_end_with_spec_options(
    corpus: Path, tiny_encoder: Path, tmp_path: Path, one_faiss_thread: None
) -> None:
    build_dense_index(corpus, tmp_path / "hnsw", encoder=tiny_encoder, index_type="hnsw", device="cpu", ef_search=40)
    build_dense_index(
        corpus, tmp_path / "ivf", encoder=tiny_encoder, index_type="ivfpq", device="cpu", keep_embeddings=False
    )
    hnsw = load_retriever(f"dense:{tmp_path / 'hnsw'}?ef_search=77")
    assert hnsw.describe()["index_params"]["ef_search"] == 77 and hnsw.index.hnsw.efSearch == 77
    assert load_retriever(str(tmp_path / "hnsw")).index.hnsw.efSearch == 40
    ivf = load_retriever(f"{tmp_path / 'ivf'}?nprobe=2")
    manifest = json.loads((tmp_path / "ivf" / "sleuth-index.json").read_text())
    assert manifest["index_params"]["nlist"] == 125 // 39 and manifest["embeddings"] is None
    assert not (tmp_path / "ivf" / EMBEDDINGS).exists()
    assert ivf.index.nprobe == 2 and ivf.describe()["index_params"]["nprobe"] == 2
    for retriever in (hnsw, ivf):
        hits = retriever.search(QUERIES, k=5)
        assert [len(h) for h in hits] == [5] * 4 and all(h[0].score >= h[-1].score for h in hits)


def test_minilm_end_to_end(tmp_path: Path) -> None:
    from sleuth.assets import default_embedder_dir

    if not (default_embedder_dir() / "modules.json").exists():
        pytest.skip(f"bundled MiniLM not fetched at {default_embedder_dir()} (run `sleuth assets fetch`)")
    corpus = write_corpus(tmp_path / "c.jsonl", n_filler=30)
    report = build_dense_index(corpus, tmp_path / "idx", device="cpu")
    assert report.passages == 35
    retriever = load_retriever(f"dense:{tmp_path / 'idx'}")
    assert retriever.describe()["encoder"]["model"] == str(default_embedder_dir().resolve())
    queries = ["Who researched radioactivity?", "tallest mountain in the Himalayas", "readable programming language"]
    assert [hits[0].id for hits in retriever.search(queries, k=3)] == ["t0", "t3", "t4"]


def test_encoder_prefixes_and_title(tiny_encoder: Path) -> None:
    plain = Encoder(tiny_encoder, device="cpu")
    e5 = Encoder(tiny_encoder, device="cpu", query_prefix="query: ", passage_prefix="passage: ", with_title=False)
    p = Passage("1", "Paris", "capital of France")
    assert plain.passage_text(p) == "Paris\ncapital of France" and e5.passage_text(p) == "passage: capital of France"
    assert np.allclose(e5.encode_queries(["paris"]), plain.encode_passages(["query: paris"]), atol=1e-6)
    vectors = plain.encode_passages([p, "x"])
    assert vectors.dtype == np.float32 and vectors.shape == (2, 32) and plain.encode_queries([]).shape == (0, 32)


# ----------------------------------------------------------------------------------------------------------- hybrid


def P(pid: str) -> Passage:
    return Passage(pid, "", pid)


def test_rrf_fuse_scores_weights_dedup_and_ties() -> None:
    a, b = [P("a"), P("b"), P("c")], [P("c"), P("d")]
    fused = rrf_fuse([a, b], [1.0, 1.0], k_rrf=60)
    # c: 1/63 + 1/61; a: 1/61; b and d tie at 1/62 with best rank 2 each -> by id
    assert [p.id for p in fused] == ["c", "a", "b", "d"]
    assert fused[0].score == pytest.approx(1 / 63 + 1 / 61) and fused[0].meta["rrf_ranks"] == [3, 1]
    assert fused[3].meta["rrf_ranks"] == [None, 2]
    assert [p.id for p in rrf_fuse([a, b], [1.0, 3.0], k_rrf=60)] == ["c", "d", "a", "b"]
    assert [p.id for p in rrf_fuse([a, b], [1.0, 0.0], top=2)] == ["a", "b"]  # a zero weight drops the list
    # a repeated id counts once, at its best rank
    dup = rrf_fuse([[P("x"), P("x"), P("y")]], k_rrf=0)
    assert [(p.id, p.score) for p in dup] == [("x", 1.0), ("y", 1 / 3)]
    # equal fused scores (1/2 + 1/2 == 1/1 with k_rrf=0): the best single rank first, then the id
    tie = rrf_fuse([[P("z"), P("a")], [P("q"), P("a")]], [1.0, 1.0], k_rrf=0)
    assert [(p.id, p.score) for p in tie] == [("q", 1.0), ("z", 1.0), ("a", 1.0)]
    assert a[0].score is None and "rrf_ranks" not in a[0].meta  # inputs untouched
    with pytest.raises(ValueError, match="weights"):
        rrf_fuse([a, b], [1.0])


def test_hybrid_end_to_end(corpus: Path, tiny_encoder: Path, tmp_path: Path) -> None:
    report = build_hybrid_index(corpus, tmp_path / "hy", encoder=tiny_encoder, device="cpu", weights=(1.0, 0.5))
    assert report.passages == 125 and (tmp_path / "hy" / "bm25").is_dir() and (tmp_path / "hy" / "dense").is_dir()
    manifest = json.loads((tmp_path / "hy" / "sleuth-index.json").read_text())
    assert manifest["kind"] == "hybrid" and manifest["weights"] == [1.0, 0.5] and manifest["k_rrf"] == 60
    # the dense half shares the BM25 passage store instead of a second copy
    stores = [os.stat(tmp_path / "hy" / half / "passages.jsonl").st_ino for half in ("bm25", "dense")]
    assert stores[0] == stores[1]

    hybrid = load_retriever(str(tmp_path / "hy"))
    assert isinstance(hybrid, HybridRetriever) and len(hybrid) == 125 and hybrid.weights == [1.0, 0.5]
    bm25, dense = BM25Retriever(tmp_path / "hy" / "bm25"), DenseRetriever(tmp_path / "hy" / "dense")
    expected = [
        rrf_fuse([x, y], [1.0, 0.5], 60, top=4)
        for x, y in zip(bm25.search(QUERIES, 50), dense.search(QUERIES, 50), strict=True)
    ]
    got = hybrid.search(QUERIES, k=4)
    assert [[(p.id, p.score) for p in r] for r in got] == [[(p.id, p.score) for p in r] for r in expected]
    assert {p.id for r in got for p in r} - {p.id for r in bm25.search(QUERIES, 4) for p in r}  # dense adds some
    lexical_only = load_retriever(f"hybrid:{tmp_path / 'hy'}?weights=1,0&pool=20&k_rrf=10")
    assert isinstance(lexical_only, HybridRetriever) and lexical_only.candidates == 20 and lexical_only.k_rrf == 10
    assert ids(lexical_only.search(QUERIES, 5)) == ids(bm25.search(QUERIES, 5))
    assert ids(load_retriever(f"{tmp_path / 'hy'}?weights=0,2").search(QUERIES, 5)) == ids(dense.search(QUERIES, 5))
    with pytest.raises(RetrievalError, match="two non-negative weights"):
        load_retriever(f"{tmp_path / 'hy'}?weights=1")
    with pytest.raises(RetrievalError, match="comma-separated"):
        load_retriever(f"{tmp_path / 'hy'}?weights=a,b")


def test_hybrid_build_resumes_in_the_dense_half(corpus: Path, tiny_encoder: Path, tmp_path: Path) -> None:
    def stop(stage: str, done: int | None, total: int | None) -> None:
        if stage == "embed":
            raise KeyboardInterrupt

    kwargs = {"encoder": tiny_encoder, "device": "cpu", "flush_every": 50}
    with pytest.raises(KeyboardInterrupt):
        build_hybrid_index(corpus, tmp_path / "hy", on_progress=stop, **kwargs)
    assert (tmp_path / "hy.partial" / "bm25" / "sleuth-index.json").exists()
    stages: list[str] = []
    report = build_hybrid_index(corpus, tmp_path / "hy", on_progress=lambda s, d, t: stages.append(s), **kwargs)
    assert report.resumed_embeddings == 50 and report.passages == 125 and not (tmp_path / "hy.partial").exists()
    assert "bm25" not in stages and stages.count("embed") == 2  # BM25 kept, embedding went on from passage 50


# ----------------------------------------------------------------------------------------------------------- rerank


def test_reranker_orders_by_cross_encoder_scores(corpus: Path, tiny_cross_encoder: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from sleuth.retrieval.rerank import RerankedRetriever

    build_bm25_index(corpus, tmp_path / "bm25")
    base = BM25Retriever(tmp_path / "bm25")
    reranked = load_retriever(f"{tmp_path / 'bm25'}?rerank={tiny_cross_encoder}&candidates=8")
    assert isinstance(reranked, RerankedRetriever) and reranked.candidates == 8
    first = base.search(QUERIES, 8)
    got = reranked.search(QUERIES, 3)

    tokenizer = AutoTokenizer.from_pretrained(tiny_cross_encoder)
    model = BertForSequenceClassification.from_pretrained(tiny_cross_encoder).eval()
    for query, candidates, hits in zip(QUERIES, first, got, strict=True):
        texts = [f"{p.title}\n{p.text}" for p in candidates]
        with torch.no_grad():
            batch = tokenizer([query] * len(texts), texts, padding=True, truncation=True, return_tensors="pt")
            logits = model(**batch).logits[:, 0].numpy()
        order = np.argsort(-logits, kind="stable")[:3]
        assert [p.id for p in hits] == [candidates[i].id for i in order]
        assert np.allclose([p.score for p in hits], 1 / (1 + np.exp(-logits[order])), atol=1e-5)  # sigmoid
        assert [p.meta["first_stage_score"] for p in hits] == [candidates[i].score for i in order]
    assert any([p.id for p in hits] != [p.id for p in cands[:3]] for hits, cands in zip(got, first, strict=True))
    assert reranked.search([], 3) == [] and len(reranked.search(["paris"], 20)[0]) == 20  # k above candidates


# ------------------------------------------------------------------------------------------------------------ specs


def test_spec_options_parsing_and_errors(flat_index: Path, tmp_path: Path, corpus: Path) -> None:
    assert parse_spec("dense:/x/y?nprobe=4&ef_search=9") == ("dense:/x/y", {"nprobe": "4", "ef_search": "9"})
    assert parse_spec("/x/y") == ("/x/y", {})
    weird = tmp_path / "dir?with=question"
    weird.mkdir()
    assert parse_spec(str(weird)) == (str(weird), {})  # an existing path is never split
    build_bm25_index(corpus, tmp_path / "bm25")
    bm25 = str(tmp_path / "bm25")
    with pytest.raises(RetrievalError, match=r"unknown option\(s\) \['nprobe'\] for a bm25 retriever; known: \["):
        load_retriever(f"{bm25}?nprobe=3")
    with pytest.raises(RetrievalError, match=r"\['bogus'\].*known: \['candidates', 'device', 'ef_search'"):
        load_retriever(f"dense:{flat_index}?bogus=1")
    with pytest.raises(RetrievalError, match="need rerank=MODEL"):
        load_retriever(f"{bm25}?candidates=5")
    with pytest.raises(RetrievalError, match="not an integer"):
        load_retriever(f"{flat_index}?nprobe=many")
    with pytest.raises(RetrievalError, match="at least 1"):
        load_retriever(f"{flat_index}?ef_search=0")
    with pytest.raises(RetrievalError, match="given twice"):
        load_retriever(f"{flat_index}?nprobe=1&nprobe=2")
    with pytest.raises(RetrievalError, match="cannot parse"):
        load_retriever(f"{flat_index}?nprobe")
    with pytest.raises(RetrievalError, match="is a .bm25. index, not dense"):
        load_retriever(f"dense:{bm25}")
    retriever = load_retriever(f"{flat_index}?device=cpu")
    assert retriever.spec == f"{flat_index}?device=cpu" and retriever.search(["paris"], 1)[0][0].score is not None


def test_retrieval_imports_stay_light(tmp_path: Path, corpus: Path) -> None:
    build_bm25_index(corpus, tmp_path / "bm25")
    code = (
        "import sys\n"
        "from sleuth.retrieval import load_retriever\n"
        "import sleuth.retrieval.dense, sleuth.retrieval.hybrid, sleuth.retrieval.rerank, sleuth.retrieval.chunking\n"
        f"load_retriever({str(tmp_path / 'bm25')!r}).search(['paris'], 2)\n"
        "print(sorted(m for m in ('faiss', 'sentence_transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
