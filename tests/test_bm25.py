"""BM25 index: build, mmap load, batched search, resume after an interrupted build."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from sleuth.retrieval import RetrievalError, load_retriever
from sleuth.retrieval.bm25 import BM25Retriever, build_bm25_index
from sleuth.retrieval.store import PassageStore

TOPICS = [
    ("Marie Curie", "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity."),
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."),
    (
        "Photosynthesis",
        "Photosynthesis is the process by which green plants convert light energy into chemical energy.",
    ),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, located in the Himalayas."),
    ("Python (language)", "Python is a high-level programming language whose design emphasizes code readability."),
]


def write_corpus(path: Path, n_filler: int = 300, seed: int = 0, bad_lines: bool = False) -> Path:
    rng = random.Random(seed)
    words = ["river", "stone", "market", "garden", "window", "letter", "bridge", "winter", "number", "island"]
    rows = [{"id": f"t{i}", "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(TOPICS)]
    for i in range(n_filler):
        text = " ".join(rng.choice(words) for _ in range(30))
        rows.append({"id": f"f{i}", "contents": f'"Filler {i}"\n{text}'})
    lines = [json.dumps(r) for r in rows]
    if bad_lines:
        lines.insert(3, "{not json")
        lines.insert(10, json.dumps({"contents": "no id"}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.jsonl")


def test_known_passage_comes_first(corpus: Path, tmp_path: Path) -> None:
    report = build_bm25_index(corpus, tmp_path / "idx")
    assert report.passages == len(TOPICS) + 300 and report.skipped == 0
    retriever = load_retriever(str(tmp_path / "idx"))
    assert isinstance(retriever, BM25Retriever) and len(retriever) == report.passages
    queries = ["Who researched radioactivity?", "tallest mountain in the Himalayas", "readable programming language"]
    results = retriever.search(queries, k=3)
    assert [r[0].id for r in results] == ["t0", "t3", "t4"]
    assert results[0][0].title == "Marie Curie" and results[0][0].text.startswith("Marie Curie was")
    assert all(len(r) == 3 for r in results)
    assert results[0][0].score is not None and results[0][0].score >= results[0][1].score


def test_stemming_matches_inflections(corpus: Path, tmp_path: Path) -> None:
    build_bm25_index(corpus, tmp_path / "idx")
    retriever = BM25Retriever(tmp_path / "idx")
    assert retriever.search(["plants converting lights"], k=1)[0][0].id == "t2"


def test_spec_prefix_and_unknown_words(corpus: Path, tmp_path: Path) -> None:
    build_bm25_index(corpus, tmp_path / "idx")
    retriever = load_retriever(f"bm25:{tmp_path / 'idx'}")
    hits = retriever.search(["zzzqqq unknownword"], k=2)[0]
    assert len(hits) == 2 and all(h.score == 0.0 for h in hits)
    assert retriever.search([], k=3) == []
    assert len(retriever.search(["tower"], k=10_000)[0]) == len(retriever)


def test_malformed_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "bad.jsonl", n_filler=20, bad_lines=True)
    report = build_bm25_index(corpus, tmp_path / "idx")
    assert report.skipped == 2 and report.passages == len(TOPICS) + 20
    assert any(":4:" in m for m in report.skipped_messages)
    manifest = json.loads((tmp_path / "idx" / "sleuth-index.json").read_text())
    assert manifest["skipped_lines"] == 2 and manifest["passages"] == report.passages


def test_existing_output_needs_overwrite(corpus: Path, tmp_path: Path) -> None:
    build_bm25_index(corpus, tmp_path / "idx")
    with pytest.raises(RetrievalError, match="already exists"):
        build_bm25_index(corpus, tmp_path / "idx")
    build_bm25_index(corpus, tmp_path / "idx", overwrite=True)


def test_interrupted_build_resumes_and_matches(corpus: Path, tmp_path: Path) -> None:
    reference = build_bm25_index(corpus, tmp_path / "ref", chunk_size=50)

    class Killed(Exception):
        pass

    calls = []

    def kill_after_three(bytes_read: int, total: int | None, passages: int) -> None:
        calls.append(passages)
        if len(calls) == 3:
            raise Killed

    with pytest.raises(Killed):
        build_bm25_index(corpus, tmp_path / "idx", chunk_size=50, on_progress=kill_after_three)
    assert not (tmp_path / "idx").exists() and (tmp_path / "idx.partial" / "build.json").exists()
    resumed = build_bm25_index(corpus, tmp_path / "idx", chunk_size=50)
    assert resumed.resumed_chunks == 3 and resumed.passages == reference.passages
    a, b = BM25Retriever(tmp_path / "ref"), BM25Retriever(tmp_path / "idx")
    queries = ["radioactivity research", "river stone market", "Paris tower", "garden window winter"]
    assert [[(p.id, p.score) for p in r] for r in a.search(queries, 5)] == [
        [(p.id, p.score) for p in r] for r in b.search(queries, 5)
    ]
    assert (tmp_path / "ref" / "vocab.json").read_text() == (tmp_path / "idx" / "vocab.json").read_text()


def test_changed_corpus_restarts_instead_of_resuming(corpus: Path, tmp_path: Path) -> None:
    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_bm25_index(corpus, tmp_path / "idx", chunk_size=50, on_progress=stop)
    write_corpus(corpus, n_filler=120, seed=1)  # a different file at the same path
    report = build_bm25_index(corpus, tmp_path / "idx", chunk_size=50)
    assert report.resumed_chunks == 0 and report.passages == len(TOPICS) + 120


def test_passage_store_round_trip(corpus: Path, tmp_path: Path) -> None:
    build_bm25_index(corpus, tmp_path / "idx")
    store = PassageStore(tmp_path / "idx")
    assert store[0].id == "t0" and store[len(store) - 1].id == "f299"
    with pytest.raises(IndexError):
        store[len(store)]


def test_async_search_is_batched(corpus: Path, tmp_path: Path) -> None:
    build_bm25_index(corpus, tmp_path / "idx")
    retriever = BM25Retriever(tmp_path / "idx")
    queries = ["radioactivity", "Himalayas", "Paris", "programming", "plants"] * 4

    async def many() -> list:
        return await asyncio.gather(*(retriever.asearch(q, 2) for q in queries))

    results = asyncio.run(many())
    assert [r[0].id for r in results[:5]] == ["t0", "t3", "t1", "t4", "t2"]
    assert retriever.batch_stats.items == len(queries) and retriever.batch_stats.calls == 1


def test_not_an_index(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="not a sleuth index"):
        load_retriever(str(tmp_path))
