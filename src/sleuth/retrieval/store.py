"""A passage store on disk: ``passages.jsonl`` plus an int64 offsets array, both memory-mapped.

``store[i]`` reads one line from the mapped file, so a 21M-passage store costs page cache, not Python objects.
The jsonl rows are ``{"id", "title", "text"[, "meta"]}``, so the file is itself a corpus sleuth can read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from sleuth.records import Passage, encodable

PASSAGES = "passages.jsonl"
OFFSETS = "passages.offsets.npy"


def passage_line(passage: Passage) -> bytes:
    row: dict[str, object] = {"id": passage.id, "title": passage.title, "text": passage.text}
    if passage.meta:
        row["meta"] = passage.meta
    return (encodable(json.dumps(row, ensure_ascii=False)) + "\n").encode("utf-8")


class PassageStore:
    """Read-only random access to the passages of an index directory."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.offsets = np.load(directory / OFFSETS, mmap_mode="r")
        size = int(self.offsets[-1])
        self.data = np.memmap(directory / PASSAGES, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Passage:
        if not 0 <= i < len(self):
            raise IndexError(f"passage index {i} out of range (store has {len(self)})")
        row = json.loads(bytes(self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]))
        # A store written by hand (or by an older sleuth) may hold \ud800-style escapes: made encodable here.
        pid, title, text = encodable(row["id"]), encodable(row["title"]), encodable(row["text"])
        return Passage(id=pid, title=title, text=text, meta=row.get("meta", {}))

    @staticmethod
    def write(directory: str | Path, chunks: Iterable[Path]) -> int:
        """Concatenate passage jsonl chunk files into the store of ``directory``; return the passage count."""
        directory = Path(directory)
        offsets = [0]
        with open(directory / PASSAGES, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for line in f:
                        out.write(line)
                        offsets.append(offsets[-1] + len(line))
        np.save(directory / OFFSETS, np.asarray(offsets, dtype=np.int64))
        return len(offsets) - 1
