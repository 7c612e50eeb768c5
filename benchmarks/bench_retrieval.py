"""Retrieval throughput: sleuth's BM25 (bm25s) vs rank_bm25, HNSW vs flat FAISS, the server batched vs unbatched.

Three parts, each measured against its baseline in the same run so the ratios hold on a noisy shared machine:

1. **bm25** -- sleuth's BM25 index (``build_bm25_index`` + ``BM25Retriever``, i.e. bm25s) against ``rank_bm25``'s
   ``BM25Okapi`` fed the very same tokens (``BM25Tokenizer.stems`` of title + text) and given Lucene's idf (the one
   sleuth's bm25s uses), so the comparison is about the engines and their rankings must agree. (a) The bundled
   10,033 wiki summaries with questions made from random titles and first sentences; (b) a synthetic corpus
   generated here (Zipf-distributed made-up vocabulary, ~50 words a passage, Search-R1 jsonl in a temp dir,
   deterministic per seed; ``--synthetic-passages``, default 1,000,000) with queries of a few words drawn from
   random passages. rank_bm25 scores every document in Python for every query, so it answers at most
   ``--rank-bm25-max-queries`` queries / ``--rank-bm25-max-seconds`` per corpus; bm25s answers all of them in one
   batched call (and, for comparison with part 3, one call per query). Each engine runs in a spawned child process
   of its own, so build time, peak RSS growth (``getrusage``) and memory are its own; top-1 agreement between the
   two is reported.
2. **hnsw** -- FAISS HNSW (sleuth's defaults: M=32, efConstruction=200, via ``build_faiss_index``) against exact
   flat inner product, on clustered synthetic unit vectors (a Gaussian mixture in a ``--latent-dim`` subspace
   mapped to ``--dim`` dimensions plus isotropic noise; the bundled MiniLM embeds ~34 passages/s on this CPU, so
   real embeddings of 200k passages are out of reach here). Flat is the ground truth; efSearch is swept and
   recall@10 and QPS are reported for one batched search call of ``--vector-queries`` held-out queries, with one
   thread and with FAISS's default thread count. Figure of merit: QPS(HNSW)/QPS(flat) at the smallest efSearch
   reaching recall@10 >= ``--target-recall``.
3. **server** -- ``sleuth.serve.create_app`` over the BM25 index of the wiki summaries, run by uvicorn in a
   background thread on 127.0.0.1 (ephemeral port), with ``batching=True`` and ``batching=False``; ``--clients``
   concurrent clients send single-query ``POST /retrieve`` (topk 5) for ``--server-seconds`` each. Requests/s and
   p50/p95 latency per mode, for each load generator in ``--server-clients``: ``httpx`` (asyncio httpx clients in
   this process, one ``AsyncClient`` each), ``httpx-shared`` (one ``AsyncClient`` for all) and ``raw`` (pre-encoded
   HTTP/1.1 over asyncio streams in a separate process: cheap enough that the server is what is measured). To show
   where the time goes, the same load also runs against a server whose retriever does no work (the HTTP ceiling),
   and per-thread CPU time (client, server event loop, search worker threads) and the time spent inside ``search``
   are recorded.

    python benchmarks/bench_retrieval.py --out docs/results/bench_retrieval.json    # all three parts (~12 min)
    python benchmarks/bench_retrieval.py --parts bm25 --synthetic-passages 100000     # a quick look at part 1
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import os
import platform
import random
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.records import Passage
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.bm25 import BM25Params, BM25Retriever, BM25Tokenizer, build_bm25_index

T0 = time.perf_counter()
PAGE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------------- helpers


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


@contextmanager
def rss_peak(every_s: float = 0.05) -> Iterator[dict[str, float]]:
    """Sample this process's RSS in a thread; yields a dict filled on exit with the peak growth over the start."""
    result: dict[str, float] = {}
    start = rss_bytes()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()
        end = rss_bytes()
        peak[0] = max(peak[0], end)
        result.update(peak_growth_mb=round((peak[0] - start) / 2**20, 1), retained_mb=round((end - start) / 2**20, 1))


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine_info() -> dict[str, Any]:
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "amx_tile") if f in flags]
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {'/'.join(simd) or 'no AVX2'}",
        "cpu": model,
        "memory_gb": round(os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30, 1),
        "python": platform.python_version(),
        "versions": {
            p: version(p)
            for p in ("bm25s", "rank-bm25", "faiss-cpu", "numpy", "PyStemmer", "fastapi", "uvicorn", "httpx")
        },
    }


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print rows as a fixed-width table; columns are (key, header, format spec)."""
    cells = [[("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print(
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths, strict=True))
        )
    )
    for c in cells:
        print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths, strict=True))))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


# -------------------------------------------------------------------------------------------- part 1: BM25 engines


def wiki_questions(corpus: Path, n: int, seed: int) -> list[str]:
    """n questions about random wiki summaries: half from the title, half from words of the first sentence."""
    from sleuth.corpus import CorpusReader

    passages = list(CorpusReader(corpus))
    rng = random.Random(seed)
    questions = []
    for j, i in enumerate(rng.sample(range(len(passages)), min(n, len(passages)))):
        p = passages[i]
        if j % 2 == 0:
            questions.append(f"What is {p.title} known for?")
        else:
            title_words = set(p.title.lower().split())
            words = [w for w in p.text.split(".")[0].split() if w.lower() not in title_words]
            questions.append("Which subject " + " ".join(words[2:11]).strip(",;:") + "?")
    return questions


_CONSONANTS = "bdfgklmnprtvz"
_VOWELS = "aiou"  # no e/y: Snowball's endings (-e, -y, -ies, -ion, ...) cannot occur in consonant-vowel words


def synthetic_vocabulary(size: int, seed: int) -> list[str]:
    """``size`` distinct made-up words of 2-4 consonant-vowel syllables (none is an English stopword)."""
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words: dict[str, None] = {}
    while len(words) < size:
        words["".join(rng.choices(syllables, k=rng.choice((2, 3, 3, 4))))] = None
    return list(words)


def write_synthetic_corpus(
    path: Path, n: int, vocab_size: int, zipf_s: float, words: int, seed: int, chunk: int = 50_000
) -> dict[str, Any]:
    """Write n Search-R1 passages (``{"id", "contents": "\\"title\\"\\ntext"}``): a 2-word title and 0.8-1.2x
    ``words`` words drawn from a Zipf(s) law over a made-up vocabulary. Deterministic per seed."""
    started = time.perf_counter()
    vocab = np.array(synthetic_vocabulary(vocab_size, seed), dtype=object)
    probs = 1.0 / np.arange(1, vocab_size + 1) ** zipf_s
    cdf = np.cumsum(probs / probs.sum())
    rng = np.random.default_rng(seed)
    lo, hi = int(words * 0.8), int(words * 1.2)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            lengths = rng.integers(lo, hi + 1, size=m) + 2
            ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), vocab_size - 1)
            tokens = vocab[ids]
            ends = np.cumsum(lengths)
            lines = []
            for i in range(m):
                doc = tokens[ends[i] - lengths[i] : ends[i]]
                lines.append(f'{{"id": "{start + i}", "contents": "\\"{doc[0]} {doc[1]}\\"\\n{" ".join(doc[2:])}"}}\n')
            f.write("".join(lines))
            if (start // chunk) % 4 == 3 or start + m == n:
                log(f"  synthetic corpus: {start + m:,}/{n:,} passages")
    return {
        "passages": n,
        "vocabulary": vocab_size,
        "zipf_s": zipf_s,
        "words_per_passage": words,
        "bytes": path.stat().st_size,
        "seconds": round(time.perf_counter() - started, 1),
    }


def synthetic_queries(path: Path, n: int, seed: int, n_passages: int) -> list[str]:
    """n queries of 3-6 words taken from random passages of the synthetic corpus (read by line number)."""
    rng = random.Random(seed + 1)
    wanted = {i: None for i in rng.sample(range(n_passages), min(n, n_passages))}
    texts: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if lineno in wanted:
                texts[lineno] = json.loads(line)["contents"].split("\n", 1)[1]
                if len(texts) == len(wanted):
                    break
    queries = []
    for i in wanted:
        words = texts[i].split()
        queries.append(" ".join(rng.sample(words, rng.randint(3, min(6, len(words))))))
    return queries


@contextmanager
def spawn_pool() -> Iterator[Any]:
    """A pool of one fresh (spawned) interpreter, closed and joined on exit (not terminated)."""
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def in_child(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """Run ``fn(**kwargs)`` in a fresh (spawned) interpreter: its peak RSS is its own, and its memory is given
    back to the machine when it returns."""
    with spawn_pool() as pool:
        return pool.apply(fn, kwds=kwargs)


def sleuth_bm25_child(corpus: str, index_dir: str, queries: list[str], k: int, single: int) -> dict[str, Any]:
    """Build sleuth's BM25 index, load it, answer ``queries`` in one call and the first ``single`` one per call."""
    base = rss_bytes()
    started = time.perf_counter()
    report = build_bm25_index(corpus, index_dir, overwrite=True)
    out: dict[str, Any] = {"passages": report.passages, "sleuth_build_s": round(time.perf_counter() - started, 2)}
    out["sleuth_build_peak_rss_mb"] = round(max_rss_mb() - base / 2**20, 1)
    out["sleuth_index_disk_mb"] = round(sum(f.stat().st_size for f in Path(index_dir).rglob("*")) / 2**20, 1)
    started = time.perf_counter()
    retriever = BM25Retriever(index_dir)
    out["sleuth_load_s"] = round(time.perf_counter() - started, 2)
    retriever.search(queries[:2], k)  # warm-up: first-call allocations, page faults of the mmapped matrices
    started, cpu = time.perf_counter(), time.process_time()
    hits = retriever.search(queries, k)
    out["sleuth_batch_qps"] = round(len(queries) / (time.perf_counter() - started), 1)
    out["sleuth_batch_qps_per_cpu_s"] = round(len(queries) / (time.process_time() - cpu), 1)
    started = time.perf_counter()
    for q in queries[:single]:
        retriever.search([q], k)
    out["sleuth_single_call_qps"] = round(min(single, len(queries)) / (time.perf_counter() - started), 1)
    out["sleuth_search_rss_mb"] = round((rss_bytes() - base) / 2**20, 1)
    out["ids"] = [[p.id for p in row] for row in hits]
    return out


def lucene_bm25_okapi(documents: Iterator[list[str]], k1: float, b: float) -> Any:
    """rank_bm25's BM25Okapi with Lucene's idf, log(1 + (N - df + 0.5) / (df + 0.5)).

    BM25Okapi's own idf (ATIRE's, negative ones floored) ranks differently from bm25s's ``method="lucene"``, which
    sleuth uses; with the same idf the two score functions differ by the constant factor (k1 + 1) only, so the
    rankings must agree up to ties and float32 rounding. Only the one-off idf table changes: query cost is the same.
    """
    import math

    import rank_bm25

    class LuceneOkapi(rank_bm25.BM25Okapi):
        def _calc_idf(self, nd: dict[str, int]) -> None:
            n = self.corpus_size
            self.idf = {word: math.log(1 + (n - df + 0.5) / (df + 0.5)) for word, df in nd.items()}

    return LuceneOkapi(documents, k1=k1, b=b)


def rank_bm25_child(corpus: str, queries: list[str], k: int, max_queries: int, max_seconds: float) -> dict[str, Any]:
    """Tokenize ``corpus`` with sleuth's tokenizer into rank_bm25; answer queries until a count or time bound."""
    from sleuth.corpus import CorpusReader

    base = rss_bytes()
    params = BM25Params()
    tokenizer = BM25Tokenizer(params)
    ids: list[str] = []

    def documents() -> Iterator[list[str]]:
        for p in CorpusReader(corpus):
            ids.append(p.id)
            yield tokenizer.stems(f"{p.title}\n{p.text}" if params.index_title else p.text)

    started = time.perf_counter()
    engine = lucene_bm25_okapi(documents(), k1=params.k1, b=params.b)
    out: dict[str, Any] = {"rank_bm25_build_s": round(time.perf_counter() - started, 2)}
    out["rank_bm25_build_peak_rss_mb"] = round(max_rss_mb() - base / 2**20, 1)
    out["rank_bm25_index_rss_mb"] = round((rss_bytes() - base) / 2**20, 1)
    answered: list[list[str]] = []
    deadline = time.perf_counter() + max_seconds
    started, cpu = time.perf_counter(), time.process_time()
    for q in queries[:max_queries]:
        scores = engine.get_scores(tokenizer.stems(q))
        top = np.argpartition(scores, -k)[-k:]
        answered.append([ids[i] for i in top[np.argsort(-scores[top], kind="stable")]])
        if time.perf_counter() > deadline:
            break
    out["rank_bm25_queries"] = len(answered)
    out["rank_bm25_qps"] = round(len(answered) / (time.perf_counter() - started), 2)
    out["rank_bm25_qps_per_cpu_s"] = round(len(answered) / (time.process_time() - cpu), 2)
    out["ids"] = answered
    return out


def bench_bm25(
    label: str, corpus: Path, queries: list[str], work: Path, args: argparse.Namespace, k: int = 10
) -> dict[str, Any]:
    """sleuth's BM25 and rank_bm25 over the same corpus and tokens, each in a child process of its own."""
    out: dict[str, Any] = {"corpus": label, "queries": len(queries), "k": k}
    index_dir = work / f"bm25-{label}"
    log(f"[bm25/{label}] sleuth: build_bm25_index, then {len(queries)} queries in one call ...")
    sleuth = in_child(
        sleuth_bm25_child,
        corpus=str(corpus),
        index_dir=str(index_dir),
        queries=queries,
        k=k,
        single=args.single_call_queries,
    )
    shutil.rmtree(index_dir, ignore_errors=True)
    sleuth_ids = sleuth.pop("ids")
    out.update(sleuth)
    log(f"[bm25/{label}] sleuth: built in {out['sleuth_build_s']}s, {out['sleuth_batch_qps']} q/s batched")
    log(
        f"[bm25/{label}] rank_bm25: build, then at most {args.rank_bm25_max_queries} queries / "
        f"{args.rank_bm25_max_seconds:g}s ..."
    )
    rank = in_child(
        rank_bm25_child,
        corpus=str(corpus),
        queries=queries,
        k=k,
        max_queries=args.rank_bm25_max_queries,
        max_seconds=args.rank_bm25_max_seconds,
    )
    answered = rank.pop("ids")
    out.update(rank)
    pairs = list(zip(answered, sleuth_ids[: len(answered)], strict=True))
    out["top1_agreement"] = f"{sum(a[0] == b[0] for a, b in pairs)}/{len(pairs)}"
    out["top10_overlap"] = round(float(np.mean([len(set(a) & set(b)) / k for a, b in pairs])), 3)
    out["qps_ratio_batch"] = ratio(out["sleuth_batch_qps"], out["rank_bm25_qps"])
    out["qps_ratio_single_call"] = ratio(out["sleuth_single_call_qps"], out["rank_bm25_qps"])
    out["build_time_ratio_rank_bm25_vs_sleuth"] = ratio(out["rank_bm25_build_s"], out["sleuth_build_s"])
    log(
        f"[bm25/{label}] rank_bm25: built in {out['rank_bm25_build_s']}s, {out['rank_bm25_qps']} q/s "
        f"({out['rank_bm25_queries']} queries) -> bm25s/rank_bm25 {out['qps_ratio_batch']}x; "
        f"top-1 agreement {out['top1_agreement']}, top-10 overlap {out['top10_overlap']}"
    )
    return out


def part_bm25(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from sleuth.assets import ensure_default_corpus

    corpus = ensure_default_corpus()
    rows = [bench_bm25("wiki-10k", corpus, wiki_questions(corpus, args.queries, args.seed), work, args)]
    n = args.synthetic_passages
    if n > 0:
        path = work / "synthetic.jsonl"
        log(f"[bm25] generating a synthetic corpus of {n:,} passages in {work} ...")
        synthetic = write_synthetic_corpus(path, n, args.synthetic_vocab, args.zipf_s, args.synthetic_words, args.seed)
        label = f"synthetic-{n // 1000}k" if n < 1_000_000 else f"synthetic-{n / 1e6:g}M"
        queries = synthetic_queries(path, args.queries, args.seed, n)
        row = bench_bm25(label, path, queries, work, args)
        row["generated"] = synthetic
        rows.append(row)
        path.unlink()
    print()
    table(
        rows,
        [
            ("corpus", "corpus", ""),
            ("passages", "passages", ","),
            ("sleuth_batch_qps", "bm25s q/s (batch)", ".1f"),
            ("sleuth_single_call_qps", "bm25s q/s (1/call)", ".1f"),
            ("rank_bm25_qps", "rank_bm25 q/s", ".2f"),
            ("rank_bm25_queries", "(queries)", "d"),
            ("qps_ratio_batch", "ratio", ".1f"),
            ("sleuth_build_s", "bm25s build s", ".1f"),
            ("rank_bm25_build_s", "rank_bm25 build s", ".1f"),
            ("sleuth_build_peak_rss_mb", "bm25s build MB", ".0f"),
            ("rank_bm25_build_peak_rss_mb", "rank_bm25 build MB", ".0f"),
            ("top1_agreement", "top-1 agree", ""),
        ],
    )
    print()
    return {"rows": rows}


# ------------------------------------------------------------------------------------------ part 2: HNSW vs flat


def mixture_vectors(
    n: int, dim: int, latent_dim: int, clusters: int, spread: float, noise: float, seed: int, chunk: int = 50_000
) -> np.ndarray:
    """n unit float32 vectors: Gaussian-mixture points in a latent_dim space (centres N(0, I), within-cluster
    std ``spread``), mapped linearly to dim dimensions, plus isotropic noise of std ``noise`` per latent unit."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, latent_dim)).astype(np.float32)
    projection = (rng.standard_normal((latent_dim, dim)) / np.sqrt(latent_dim)).astype(np.float32)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        latent = centres[rng.integers(clusters, size=m)] + spread * rng.standard_normal((m, latent_dim), np.float32)
        x = latent @ projection + noise * rng.standard_normal((m, dim), np.float32)
        out[start : start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def timed_search(index: Any, queries: np.ndarray, k: int, repeats: int) -> tuple[float, np.ndarray]:
    """Best wall time of ``repeats`` batched searches (one call for all queries), and the ids."""
    best = float("inf")
    ids = None
    for _ in range(repeats):
        started = time.perf_counter()
        _, ids = index.search(queries, k)
        best = min(best, time.perf_counter() - started)
    return best, ids


def part_hnsw(args: argparse.Namespace) -> dict[str, Any]:
    import faiss

    from sleuth.retrieval.dense import build_faiss_index

    default_threads = faiss.omp_get_max_threads()
    n, nq, k = args.vectors, args.vector_queries, 10
    log(f"[hnsw] {n:,} + {nq:,} clustered vectors, dim {args.dim} (latent {args.latent_dim}) ...")
    data = mixture_vectors(
        n + nq, args.dim, args.latent_dim, args.clusters, args.cluster_spread, args.noise, args.seed
    )
    base, queries = data[:n], np.ascontiguousarray(data[n:])
    del data
    faiss.omp_set_num_threads(default_threads)
    started = time.perf_counter()
    flat, _ = build_faiss_index(base, "flat")
    flat_build = time.perf_counter() - started
    thread_settings = sorted({1, default_threads})
    flat_qps: dict[int, float] = {}
    truth = None
    for threads in thread_settings:
        faiss.omp_set_num_threads(threads)
        seconds, truth = timed_search(flat, queries, k, args.repeats)
        flat_qps[threads] = nq / seconds
        log(f"[hnsw] flat, {threads} thread(s): {flat_qps[threads]:.0f} q/s")
    assert truth is not None
    scores = base[truth[:, :k]] @ queries[:, :, None]  # (nq, k, 1): cosine of the true neighbours
    random_pairs = np.einsum("ij,ij->i", base[: min(n, 10_000)], base[-min(n, 10_000) :][::-1])
    data_stats = {
        "mean_cos_top1": round(float(scores[:, 0].mean()), 3),
        "mean_cos_top10": round(float(scores[:, k - 1].mean()), 3),
        "mean_cos_random_pair": round(float(random_pairs.mean()), 3),
    }
    log(f"[hnsw] data: {data_stats}")

    faiss.omp_set_num_threads(default_threads)
    log(f"[hnsw] building HNSW (M={args.hnsw_m}, efConstruction={args.ef_construction}) ...")
    with rss_peak() as mem:
        started = time.perf_counter()
        hnsw, params = build_faiss_index(base, "hnsw", hnsw_m=args.hnsw_m, ef_construction=args.ef_construction)
        hnsw_build = time.perf_counter() - started
    log(f"[hnsw] built in {hnsw_build:.1f}s")
    rows = []
    for threads in thread_settings:
        faiss.omp_set_num_threads(threads)
        rows.append(
            {"index": "flat", "threads": threads, "ef_search": None, "recall_at_10": 1.0, "qps": flat_qps[threads]}
        )
        for ef in args.ef_search:
            hnsw.hnsw.efSearch = ef
            seconds, ids = timed_search(hnsw, queries, k, args.repeats)
            recall = float(
                np.mean([len(set(a) & set(b)) / k for a, b in zip(ids.tolist(), truth.tolist(), strict=True)])
            )
            rows.append(
                {"index": "hnsw", "threads": threads, "ef_search": ef, "recall_at_10": recall, "qps": nq / seconds}
            )
            log(f"[hnsw] efSearch {ef}, {threads} thread(s): recall@10 {recall:.3f}, {nq / seconds:.0f} q/s")
    faiss.omp_set_num_threads(default_threads)
    for row in rows:
        row["speedup_vs_flat"] = round(row["qps"] / flat_qps[row["threads"]], 2)
        row["qps"] = round(row["qps"], 1)
        row["recall_at_10"] = round(row["recall_at_10"], 4)

    merit = {}
    for threads in thread_settings:
        ok = [
            r
            for r in rows
            if r["index"] == "hnsw" and r["threads"] == threads and r["recall_at_10"] >= args.target_recall
        ]
        best = min(ok, key=lambda r: r["ef_search"]) if ok else None
        merit[f"{threads}_thread{'s' if threads > 1 else ''}"] = (
            {
                "ef_search": best["ef_search"],
                "recall_at_10": best["recall_at_10"],
                "speedup_vs_flat": best["speedup_vs_flat"],
            }
            if best
            else None
        )
    print()
    table(
        rows,
        [
            ("index", "index", ""),
            ("threads", "threads", "d"),
            ("ef_search", "efSearch", "d"),
            ("recall_at_10", "recall@10", ".3f"),
            ("qps", "q/s", ".0f"),
            ("speedup_vs_flat", "x flat", ".2f"),
        ],
    )
    for name, m in merit.items():
        if m:
            print(
                f"HNSW/flat at the smallest efSearch with recall@10 >= {args.target_recall} ({name}): "
                f"{m['speedup_vs_flat']}x (efSearch {m['ef_search']}, recall {m['recall_at_10']:.3f})"
            )
        else:
            print(f"HNSW never reached recall@10 >= {args.target_recall} ({name})")
    print()
    del hnsw, flat, base
    gc.collect()
    return {
        "vectors": n,
        "queries": nq,
        "dim": args.dim,
        "latent_dim": args.latent_dim,
        "clusters": args.clusters,
        "cluster_spread": args.cluster_spread,
        "noise": args.noise,
        "data": data_stats,
        "default_threads": default_threads,
        "flat_build_s": round(flat_build, 2),
        "hnsw_params": params,
        "hnsw_build_s": round(hnsw_build, 1),
        "hnsw_build_peak_rss_mb": mem["peak_growth_mb"],
        "rows": rows,
        "target_recall": args.target_recall,
        "figure_of_merit": merit,
    }


# ------------------------------------------------------------------------------------- part 3: server batching


class TimedRetriever(Retriever):
    """Delegates ``search`` and records calls, queries and seconds spent inside it (thread-safe)."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.calls, self.queries, self.seconds = 0, 0, 0.0

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        started = time.perf_counter()
        result = self.inner.search(queries, k)
        elapsed = time.perf_counter() - started
        with self.lock:
            self.calls += 1
            self.queries += len(queries)
            self.seconds += elapsed
        return result

    def __len__(self) -> int:
        return len(self.inner)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class NullRetriever(Retriever):
    """Answers every query at once with the same precomputed passages: the server with no search cost."""

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [self.passages[:k] for _ in queries]

    def __len__(self) -> int:
        return len(self.passages)


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native thread id."""
    cpu = {}
    for task in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu[int(task)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return cpu


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread on 127.0.0.1 and an ephemeral port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto is TCP (accepted sockets
        # inherit it). `sleuth serve` (uvicorn.run(host=, port=)) gets such sockets from getaddrinfo; a socket made
        # with proto 0 would leave Nagle on, and Nagle + delayed ACKs put a ~40 ms floor under every response.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", backlog=256)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start within 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


MAX_REQUESTS_PER_CLIENT = 1_000_000
REQUEST_TIMEOUT_S = 60.0


async def drive(request: Callable[[int, int], Any], clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """``clients`` coroutines, each awaiting ``request(client, i)`` (True if the answer was right) back to back.

    Requests started in the ``seconds`` after the warm-up are measured; the window runs to the last one's answer.
    """
    latencies: list[float] = []
    errors = 0
    measure_from = time.perf_counter() + warmup
    stop_at = measure_from + seconds
    last_done = measure_from
    cpu0 = None

    async def one(c: int) -> None:
        nonlocal errors, last_done, cpu0
        for i in range(MAX_REQUESTS_PER_CLIENT):
            sent = time.perf_counter()
            if sent >= stop_at:
                return
            if sent >= measure_from and cpu0 is None:
                cpu0 = time.process_time()
            ok = await asyncio.wait_for(request(c, i), REQUEST_TIMEOUT_S)
            done = time.perf_counter()
            if sent >= measure_from:
                errors += not ok
                latencies.append(done - sent)
                last_done = max(last_done, done)

    await asyncio.gather(*(one(c) for c in range(clients)))
    return {
        "requests": len(latencies),
        "errors": errors,
        "window_s": max(1e-9, last_done - measure_from),
        "latencies": latencies,
        "client_process_cpu_s": time.process_time() - (cpu0 or 0.0),
    }


async def httpx_load(
    url: str, queries: list[str], clients: int, seconds: float, warmup: float, topk: int, shared: bool = False
) -> dict[str, Any]:
    """asyncio httpx clients, each sending one single-query POST /retrieve at a time: one ``AsyncClient`` (one
    keep-alive connection) per client, or with ``shared`` one ``AsyncClient`` with a pool of ``clients``
    connections for all of them."""
    import httpx

    if shared:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        pool = [httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S)]
    else:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        pool = [httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) for _ in range(clients)]

    async def request(c: int, i: int) -> bool:
        query = queries[(c * 7919 + i) % len(queries)]
        response = await pool[c % len(pool)].post("/retrieve", json={"queries": [query], "topk": topk})
        return response.status_code == 200 and len(response.json()["result"][0]) == topk

    try:
        return await drive(request, clients, seconds, warmup)
    finally:
        for client in pool:
            await client.aclose()


async def raw_load(url: str, queries: list[str], clients: int, seconds: float, warmup: float, topk: int) -> dict:
    """The same requests, pre-encoded, over one keep-alive HTTP/1.1 connection per client with asyncio streams:
    a load generator that costs far less CPU than the server it measures."""
    host, port = url.removeprefix("http://").split(":")
    requests = []
    for q in queries:
        body = json.dumps({"queries": [q], "topk": topk}).encode()
        head = f"POST /retrieve HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        requests.append(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    connections = [await asyncio.open_connection(host, int(port)) for _ in range(clients)]

    async def request(c: int, i: int) -> bool:
        reader, writer = connections[c]
        writer.write(requests[(c * 7919 + i) % len(requests)])
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        body = await reader.readexactly(length)
        return head.startswith(b"HTTP/1.1 200") and body.count(b'"contents"') == topk

    try:
        return await drive(request, clients, seconds, warmup)
    finally:
        for _, writer in connections:
            writer.close()


def raw_load_child(**kwargs: Any) -> dict[str, Any]:
    return asyncio.run(raw_load(**kwargs))


def noop() -> dict[str, Any]:
    return {}


def serve_once(
    label: str,
    retriever: Retriever,
    batching: bool,
    queries: list[str],
    args: argparse.Namespace,
    client: str,
    pool: Any,
) -> dict[str, Any]:
    """Serve ``retriever`` and load it with the ``client`` load ("httpx": in this process; "raw": in ``pool``)."""
    from sleuth.serve import create_app

    timed = TimedRetriever(retriever)
    app = create_app(timed, batching=batching)
    log(
        f"[server] {client}, {label}: {args.clients} clients, {args.server_seconds:g}s "
        f"(+{args.server_warmup:g}s warm-up) ..."
    )
    snap: dict[str, Any] = {}

    def snapshot() -> None:  # when the measured window opens
        timed.reset()
        snap.update(cpu=thread_cpu_s(), t=time.perf_counter(), p=time.process_time())

    load_args = {
        "queries": queries,
        "clients": args.clients,
        "seconds": args.server_seconds,
        "warmup": args.server_warmup,
        "topk": args.topk,
    }
    with ServerThread(app) as server:
        timer = threading.Timer(args.server_warmup, snapshot)
        timer.start()
        if client.startswith("httpx"):
            result = asyncio.run(httpx_load(server.url, **load_args, shared=client == "httpx-shared"))
        else:
            result = pool.apply(raw_load_child, kwds={"url": server.url, **load_args})
        cpu1, t1, p1 = thread_cpu_s(), time.perf_counter(), time.process_time()
        timer.join()
        loop_tid = server.thread.native_id
    wall = t1 - snap["t"]
    delta = {tid: cpu1.get(tid, 0.0) - snap["cpu"].get(tid, 0.0) for tid in cpu1}
    main_cpu = delta.get(threading.main_thread().native_id, 0.0)
    loop_cpu = delta.get(loop_tid, 0.0)
    other_cpu = sum(delta.values()) - main_cpu - loop_cpu
    client_cpu = main_cpu if client.startswith("httpx") else result["client_process_cpu_s"]
    n = result["requests"]
    lat = np.array(result["latencies"]) * 1000
    per_request = 1000 / max(n, 1)
    row = {
        "client": client,
        "mode": label,
        "batching": batching,
        "requests": n,
        "errors": result["errors"],
        "rps": round(n / result["window_s"], 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1) if n else None,
        "p95_ms": round(float(np.percentile(lat, 95)), 1) if n else None,
        "search_calls": timed.calls,
        "mean_batch": round(timed.queries / timed.calls, 2) if timed.calls else None,
        "search_ms_per_query": round(1000 * timed.seconds / timed.queries, 3) if timed.queries else None,
        "search_wall_share": round(timed.seconds / wall, 3),
        "cpu_ms_per_request": {
            "client": round(client_cpu * per_request, 3),
            "server_event_loop": round(loop_cpu * per_request, 3),
            "server_worker_threads": round(other_cpu * per_request, 3),
        },
        "server_process_cpu_share": round(
            (p1 - snap["p"] - (main_cpu if client.startswith("httpx") else 0)) / wall, 2
        ),
    }
    log(
        f"[server] {client}, {label}: {row['rps']} req/s, p50 {row['p50_ms']} ms, p95 {row['p95_ms']} ms, "
        f"{row['search_calls']} search calls (mean batch {row['mean_batch']}), errors {row['errors']}"
    )
    return row


def part_server(args: argparse.Namespace, work: Path) -> dict[str, Any]:

    from sleuth.assets import default_index_dir, ensure_default_corpus

    corpus = ensure_default_corpus()
    index_dir = default_index_dir()
    if not (index_dir / "sleuth-index.json").exists():
        index_dir = work / "wiki-bm25"
        log(f"[server] no default index; building one in {index_dir} ...")
        build_bm25_index(corpus, index_dir, overwrite=True)
    retriever = BM25Retriever(index_dir)
    queries = wiki_questions(corpus, args.queries, args.seed)
    retriever.search(queries, args.topk)  # warm the page cache and the stem cache

    # In-process: what batching buys the engine itself, without HTTP.
    sample = [queries[i % len(queries)] for i in range(args.clients * 16)]
    started = time.perf_counter()
    for q in sample:
        retriever.search([q], args.topk)
    single_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(0, len(sample), args.clients):
        retriever.search(sample[i : i + args.clients], args.topk)
    batch_s = time.perf_counter() - started
    engine = {
        "queries": len(sample),
        "one_per_call_qps": round(len(sample) / single_s, 1),
        "batched_qps": round(len(sample) / batch_s, 1),
        "batch_size": args.clients,
        "ratio": ratio(single_s, batch_s),
    }
    log(f"[server] in-process BM25 search (no HTTP): {engine}")

    null = NullRetriever(retriever.search([queries[0]], args.topk)[0])
    modes = [("batching=True", retriever, True), ("batching=False", retriever, False), ("no-op retriever", null, True)]
    rows = []
    with spawn_pool() as pool:
        pool.apply(noop)  # the load process is up and has imported everything before any timing starts
        for client in args.server_clients:
            for label, target, batching in modes:
                rows.append(serve_once(label, target, batching, queries, args, client, pool))
    result: dict[str, Any] = {
        "index": str(index_dir),
        "clients": args.clients,
        "topk": args.topk,
        "seconds": args.server_seconds,
        "warmup_s": args.server_warmup,
        "engine_in_process": engine,
        "rows": rows,
        "ratios": {},
    }
    print()
    flat_rows = [{**r, **{f"cpu_{k}": v for k, v in r["cpu_ms_per_request"].items()}} for r in rows]
    table(
        flat_rows,
        [
            ("client", "client", ""),
            ("mode", "server", ""),
            ("rps", "req/s", ".1f"),
            ("p50_ms", "p50 ms", ".1f"),
            ("p95_ms", "p95 ms", ".1f"),
            ("mean_batch", "batch", ".2f"),
            ("search_ms_per_query", "search ms/q", ".2f"),
            ("cpu_client", "client cpu ms/req", ".2f"),
            ("cpu_server_event_loop", "server loop ms/req", ".2f"),
            ("cpu_server_worker_threads", "workers ms/req", ".2f"),
            ("server_process_cpu_share", "server cores", ".2f"),
        ],
    )
    for client in args.server_clients:
        by_mode = {r["mode"]: r for r in rows if r["client"] == client}
        ratios = {
            "batched_vs_unbatched": ratio(by_mode["batching=True"]["rps"], by_mode["batching=False"]["rps"]),
            "noop_vs_unbatched": ratio(by_mode["no-op retriever"]["rps"], by_mode["batching=False"]["rps"]),
        }
        result["ratios"][client] = ratios
        print(
            f"{client} clients: batched/unbatched {ratios['batched_vs_unbatched']}x; no-op retriever/unbatched "
            f"(ceiling with free search) {ratios['noop_vs_unbatched']}x"
        )
    print(f"engine alone, batches of {args.clients} vs one query per call: {engine['ratio']}x")
    print()
    return result


# -------------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="bm25,hnsw,server", help="comma-separated subset of bm25,hnsw,server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=200, help="BM25 queries per corpus (and server query pool)")
    g = parser.add_argument_group("part 1: BM25")
    g.add_argument("--synthetic-passages", type=int, default=1_000_000, help="0 skips the synthetic corpus")
    g.add_argument("--synthetic-words", type=int, default=50, help="mean words per synthetic passage")
    g.add_argument("--synthetic-vocab", type=int, default=200_000, help="made-up vocabulary size")
    g.add_argument("--zipf-s", type=float, default=1.07, help="Zipf exponent of word frequencies")
    g.add_argument("--rank-bm25-max-queries", type=int, default=200, help="rank_bm25 answers at most this many")
    g.add_argument("--rank-bm25-max-seconds", type=float, default=45.0, help="... or stops after this long")
    g.add_argument("--single-call-queries", type=int, default=200, help="bm25s queries timed one per call")
    g.add_argument("--workdir", type=Path, default=None, help="temp files here (default: a fresh temp dir)")
    g = parser.add_argument_group("part 2: HNSW vs flat")
    g.add_argument("--vectors", type=int, default=200_000)
    g.add_argument("--vector-queries", type=int, default=1000)
    g.add_argument("--dim", type=int, default=384)
    g.add_argument("--latent-dim", type=int, default=64, help="dimension of the mixture before the projection")
    g.add_argument("--clusters", type=int, default=1000)
    g.add_argument("--cluster-spread", type=float, default=1.0, help="within-cluster std (centres have std 1)")
    g.add_argument("--noise", type=float, default=0.3, help="isotropic noise std added after the projection")
    g.add_argument("--hnsw-m", type=int, default=32)
    g.add_argument("--ef-construction", type=int, default=200)
    g.add_argument("--ef-search", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    g.add_argument("--target-recall", type=float, default=0.95)
    g.add_argument("--repeats", type=int, default=3, help="timed searches per setting (best is kept)")
    g = parser.add_argument_group("part 3: server")
    g.add_argument("--clients", type=int, default=32)
    g.add_argument("--topk", type=int, default=5)
    g.add_argument("--server-seconds", type=float, default=15.0)
    g.add_argument("--server-warmup", type=float, default=2.0)
    g.add_argument(
        "--server-clients",
        nargs="+",
        default=["httpx", "httpx-shared", "raw"],
        choices=["httpx", "httpx-shared", "raw"],
        help="httpx: asyncio httpx clients in this process, one AsyncClient each; httpx-shared: the same sharing one "
        "AsyncClient (a pool of --clients connections); raw: pre-encoded HTTP/1.1 over asyncio streams in a "
        "separate process (a cheap load generator, so the server is what is measured)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"bm25", "hnsw", "server"}
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}")

    result: dict[str, Any] = {
        "command": "python benchmarks/bench_retrieval.py " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **machine_info(),
        "date": time.strftime("%Y-%m-%d"),
    }
    log(f"{result['machine']}; parts: {', '.join(parts)}; load average {os.getloadavg()[0]:.2f}")
    work = Path(tempfile.mkdtemp(prefix="sleuth-bench-", dir=args.workdir))
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "bm25": lambda: part_bm25(args, work),
        "hnsw": lambda: part_hnsw(args),
        "server": lambda: part_server(args, work),
    }
    try:
        for part in parts:
            started = time.perf_counter()
            load_before = os.getloadavg()[0]
            result[part] = runners[part]()
            result[part]["part_seconds"] = round(time.perf_counter() - started, 1)
            # other users of this shared machine show up here (a load above the core count means contention)
            result[part]["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["total_seconds"] = round(time.perf_counter() - T0, 1)
    result["max_rss_mb"] = round(max_rss_mb(), 1)
    log(f"done in {result['total_seconds']}s (process peak RSS {result['max_rss_mb']:.0f} MB)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
