"""Word-window chunking of passages and of corpus files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sleuth.corpus import CorpusReader
from sleuth.records import Passage
from sleuth.retrieval.chunking import chunk_corpus, chunk_passages


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def test_exact_windows_and_last_partial_chunk() -> None:
    chunks = list(chunk_passages([Passage("d", "Title", words(25), meta={"url": "u"})], words=10))
    assert [c.id for c in chunks] == ["d#0", "d#1", "d#2"]
    assert [c.text for c in chunks] == [words(10), words(10, 10), words(5, 20)]
    assert all(c.title == "Title" for c in chunks)
    assert [c.meta for c in chunks] == [{"url": "u", "source_id": "d", "chunk": i} for i in range(3)]


def test_exact_multiple_has_no_empty_tail() -> None:
    chunks = list(chunk_passages([Passage("d", "", words(20))], words=10))
    assert [c.text for c in chunks] == [words(10), words(10, 10)]


def test_overlap_repeats_words_and_stops_at_the_end() -> None:
    chunks = list(chunk_passages([Passage("d", "T", words(10))], words=4, overlap=2))
    assert [c.text.split() for c in chunks] == [
        ["w0", "w1", "w2", "w3"],
        ["w2", "w3", "w4", "w5"],
        ["w4", "w5", "w6", "w7"],
        ["w6", "w7", "w8", "w9"],
    ]
    assert [c.id for c in chunks] == ["d#0", "d#1", "d#2", "d#3"]
    # the window starting at w8 would lie wholly inside the last one: not emitted
    assert len(list(chunk_passages([Passage("d", "T", words(9))], words=4, overlap=2))) == 4


def test_short_passages_keep_their_id_and_whitespace_is_normalised() -> None:
    passages = [Passage("a", "A", "  one\ttwo\n\nthree  "), Passage("b", "B", words(3)), Passage("c", "C", " \n ")]
    chunks = list(chunk_passages(passages, words=3))
    assert [(c.id, c.text) for c in chunks] == [("a", "one two three"), ("b", words(3))]
    assert chunks[0].meta == {"source_id": "a", "chunk": 0}


@pytest.mark.parametrize(("n_words", "overlap"), [(10, 10), (10, 11), (10, -1), (0, 0)])
def test_invalid_settings(n_words: int, overlap: int) -> None:
    with pytest.raises(ValueError, match="overlap|words"):
        list(chunk_passages([Passage("a", "", "x y z")], words=n_words, overlap=overlap))


def test_chunk_corpus_round_trips_through_the_reader(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    rows = [
        {"id": "1", "title": 'A "quoted" title', "text": words(7)},
        {"id": "2", "title": "", "text": words(2)},
        {"id": "3", "title": "Multi\nline", "text": words(3), "url": "x"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{bad json\n")
    n = chunk_corpus(src, tmp_path / "out.jsonl", words=3, overlap=1)
    read = list(CorpusReader(tmp_path / "out.jsonl"))
    assert n == len(read) == 3 + 1 + 1
    assert [p.id for p in read] == ["1#0", "1#1", "1#2", "2", "3"]
    assert read[0].title == 'A "quoted" title' and read[2].text == "w4 w5 w6"
    assert read[3].title == "" and read[4].title == "Multi line"
    assert read[4].meta == {"url": "x", "source_id": "3", "chunk": 0}
    assert not (tmp_path / "out.jsonl.tmp").exists()


def test_chunk_corpus_gzip_output(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "1", "contents": f'"T"\n{words(5)}'}) + "\n")
    assert chunk_corpus(src, tmp_path / "out.jsonl.gz", words=2) == 3
    with gzip.open(tmp_path / "out.jsonl.gz", "rt") as f:
        assert [json.loads(line)["id"] for line in f] == ["1#0", "1#1", "1#2"]
    with pytest.raises(ValueError, match="overlap"):
        chunk_corpus(src, tmp_path / "bad.jsonl", words=2, overlap=2)
    assert not (tmp_path / "bad.jsonl").exists()
