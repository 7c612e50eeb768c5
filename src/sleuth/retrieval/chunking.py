"""Split long passages into word windows (DPR-style 100-word passages), so an embedder sees each part of a text.

Dense encoders truncate their input (MiniLM at 256 word pieces), so a long article would be embedded by its first
paragraph only; BM25 favours short passages too. Chunk the corpus file once with :func:`chunk_corpus` and build
every index (BM25, dense, hybrid) from the chunked file, so all of them share passage ids.

>>> from sleuth.records import Passage
>>> [(c.id, c.text) for c in chunk_passages([Passage("7", "T", "a b c d e")], words=2)]
[('7#0', 'a b'), ('7#1', 'c d'), ('7#2', 'e')]
>>> [c.text for c in chunk_passages([Passage("7", "T", "a b c d e")], words=3, overlap=1)]
['a b c', 'c d e']
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from sleuth.records import Passage


def chunk_passages(passages: Iterable[Passage], words: int = 100, overlap: int = 0) -> Iterator[Passage]:
    """Yield windows of ``words`` whitespace-separated words, consecutive windows sharing ``overlap`` words.

    Windows start every ``words - overlap`` words; the last one may be shorter, and no window lies wholly inside
    the previous one. A passage that fits in one window keeps its id; the windows of a longer one get the ids
    ``f"{id}#{i}"`` (``i`` from 0). Every window keeps the title and the passage's meta, plus ``meta["source_id"]``
    and ``meta["chunk"]``. Whitespace is normalised to single spaces; passages without words are dropped.
    """
    if words < 1:
        raise ValueError(f"words must be at least 1, got {words}")
    if not 0 <= overlap < words:
        raise ValueError(f"overlap must be at least 0 and less than words ({words}), got {overlap}")
    step = words - overlap
    for passage in passages:
        tokens = passage.text.split()
        if not tokens:
            continue
        if len(tokens) <= words:
            meta = {**passage.meta, "source_id": passage.id, "chunk": 0}
            yield Passage(passage.id, passage.title, " ".join(tokens), meta=meta)
            continue
        start, i = 0, 0
        while True:
            meta = {**passage.meta, "source_id": passage.id, "chunk": i}
            yield Passage(f"{passage.id}#{i}", passage.title, " ".join(tokens[start : start + words]), meta=meta)
            if start + words >= len(tokens):
                break
            start += step
            i += 1


def searchr1_line(passage: Passage) -> bytes:
    """A Search-R1 jsonl line (``id``, ``contents``, then the meta keys), which the corpus reader reads back."""
    title = " ".join(passage.title.split())  # a newline in the title would end it early on reading
    row = {k: v for k, v in passage.meta.items() if k not in ("id", "contents")}
    row = {"id": passage.id, "contents": f'"{title}"\n{passage.text}', **row}
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")


def chunk_corpus(
    in_path: str | Path,
    out_path: str | Path,
    words: int = 100,
    overlap: int = 0,
    format: str | None = None,
    strict: bool = False,
) -> int:
    """Stream ``in_path`` (any corpus format) into a chunked Search-R1 jsonl file (gzipped for ``.gz``); return
    the number of chunks written. The file appears only when complete."""
    from sleuth.corpus import CorpusReader

    if not 0 <= overlap < words:  # fail before reading anything
        raise ValueError(f"overlap must be at least 0 and less than words ({words}), got {overlap}")
    out_path = Path(out_path)
    reader = CorpusReader(in_path, format=format, strict=strict)
    tmp = out_path.with_name(out_path.name + ".tmp")
    n = 0
    try:
        out: IO[bytes] = gzip.open(tmp, "wb") if out_path.suffix == ".gz" else open(tmp, "wb")  # noqa: SIM115
        with out:
            for chunk in chunk_passages(reader, words=words, overlap=overlap):
                out.write(searchr1_line(chunk))
                n += 1
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return n
