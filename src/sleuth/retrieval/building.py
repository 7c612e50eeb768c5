"""Helpers shared by the index builders: atomic small writes, corpus identity for resumes, the build report."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that a reader (or a resumed build) sees the old file or the new one, never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def corpus_identity(corpus: Path) -> dict[str, Any]:
    """What a resumed build compares to decide that the corpus file is still the one it started on."""
    stat = corpus.stat()
    return {"path": str(corpus.resolve()), "size": stat.st_size, "mtime": stat.st_mtime}


def index_manifest(
    kind: str, format_version: int, passages: int, skipped_lines: int, corpus: Path, corpus_format: str, **fields: Any
) -> dict[str, Any]:
    """An index directory's manifest: what every kind records (kind, format, passage and skipped-line counts, the
    corpus and its format), then the kind's own ``fields``."""
    return {
        "kind": kind,
        "format_version": format_version,
        "passages": passages,
        "skipped_lines": skipped_lines,
        "corpus": str(corpus.resolve()),
        "corpus_format": corpus_format,
        **fields,
    }


@dataclass
class BuildReport:
    """What a build did. ``resumed_chunks`` counts passage chunks reused from an interrupted build,
    ``resumed_embeddings`` (dense builds) the passages whose embeddings were reused."""

    passages: int
    skipped: int
    resumed_chunks: int
    seconds: float
    index_dir: Path
    skipped_messages: list[str]
    resumed_embeddings: int = 0


def swap_in(
    work: Path,
    out: Path,
    started: float,
    passages: int,
    skipped: int,
    resumed_chunks: int,
    skipped_messages: list[str],
    resumed_embeddings: int = 0,
) -> BuildReport:
    """Replace ``out`` by the finished build in ``work`` (a rename; an old index there is removed first) and report
    the build, which began at ``started`` (``time.time()``)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(work, out)
    return BuildReport(
        passages=passages,
        skipped=skipped,
        resumed_chunks=resumed_chunks,
        seconds=time.time() - started,
        index_dir=out,
        skipped_messages=skipped_messages,
        resumed_embeddings=resumed_embeddings,
    )
