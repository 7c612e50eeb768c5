"""Benchmark loaders: one function per file format, format detection by content, and open-mode corpora.

Every loader is ``(path) -> Iterator[Example]`` (JSON lines are streamed; JSON arrays are loaded whole) and is
registered in :data:`LOADERS` under its format name:

==============  ========================================================================================  =======
format          file (schema in the loader's docstring)                                                    kind
==============  ========================================================================================  =======
``hotpotqa``    HotpotQA original (``_id, question, answer, supporting_facts, context``); also questions  qa
                only (``question, answer, type``)
``2wiki``       2WikiMultiHopQA original (HotpotQA schema + ``evidences``, ``entity_ids``)                 qa
``musique``     MuSiQue original (``paragraphs``, ``question_decomposition``), with or without paragraphs  qa
``flashrag``    FlashRAG jsonl (``id, question, golden_answers, metadata``): NQ, TriviaQA, PopQA, ...      qa/mcq
``ircot``       IRCoT jsonl (``question_text, answers_objects, contexts``), AceSearcher's eval files        qa
``bamboogle``   Bamboogle ``.csv`` (``Question,Answer``) or JSON with ``Q1/A1/...`` decomposition         qa
``strategyqa``  StrategyQA (``qid, question, answer: bool, decomposition, evidence``)                     claim
``hover``       HOVER (``uid, claim, supporting_facts, label, num_hops``)                                 claim
``fever``       FEVER jsonl, EX-FEVER ``.csv``, any ``{claim, label}`` file                              claim
``gsm8k``       GSM8K (``question, answer`` ending ``#### N``)                                            math
``tatqa``       TAT-QA documents (``table, paragraphs, questions``), one Example per question             math/qa
``docmath``     DocMath-Eval (``question_id, question, paragraphs, ..., ground_truth``)                    math
``pubmedqa``    PubMedQA (``{pmid: {QUESTION, CONTEXTS, final_decision}}``), yes/no/maybe as options      mcq
``medqa``       MedQA-USMLE (``question, options, answer_idx``)                                           mcq
``synth``       sleuth's own ``Example.to_dict()`` jsonl: the synthetic world's splits (no detection)     qa
==============  ========================================================================================  =======

:func:`detect_format` reads the first record's keys; :func:`iter_examples`/:func:`load_examples` use it unless a
format is given. A record that does not fit raises :class:`DatasetError` naming the file, the row (``FILE:LINE``
for JSON lines and csv, ``FILE[INDEX]`` for JSON arrays) and the key: ``musique.json:17: missing key
'paragraphs'``.

Ids are the dataset's own (``_id``, ``id``, ``qid``, ``uid``, ``question_id``, PubMed id) or else
``"{file stem}-{row index}"``. Paragraph ids are stable: derived from title and text
(:func:`~sleuth.data._rows.passage_id`) or the dataset's own paragraph ids (TAT-QA uids, StrategyQA keys).

Open mode: :func:`open_corpus` pools the given paragraphs of many examples into one deduplicated corpus (so every
``supporting_ids`` entry stays a valid retrieval target) and :func:`write_open_corpus` writes it as Search-R1
jsonl for ``sleuth``'s index builder.

>>> examples = load_examples("../shared/data/hotpotqa/hotpot.json", limit=2)  # doctest: +SKIP
>>> write_open_corpus(examples, "hotpot-open.jsonl")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sleuth.corpus import encoding_error
from sleuth.data._rows import DatasetError, PathLike, first_record, is_csv
from sleuth.data.claims import load_fever, load_hover, load_strategyqa
from sleuth.data.medical import load_medqa, load_pubmedqa
from sleuth.data.multihop import (
    load_2wiki,
    load_bamboogle,
    load_flashrag,
    load_hotpotqa,
    load_ircot,
    load_musique,
)
from sleuth.data.numeric import load_docmath, load_gsm8k, load_tatqa
from sleuth.data.synth import load_synth
from sleuth.records import Example, Passage

__all__ = [
    "LOADERS",
    "DatasetError",
    "check_encoding",
    "detect_format",
    "iter_examples",
    "load_examples",
    "open_corpus",
    "write_open_corpus",
]

logger = logging.getLogger("sleuth.data")

Loader = Callable[..., Iterator[Example]]

LOADERS: dict[str, Loader] = {
    "hotpotqa": load_hotpotqa,
    "2wiki": load_2wiki,
    "musique": load_musique,
    "flashrag": load_flashrag,
    "ircot": load_ircot,
    "bamboogle": load_bamboogle,
    "strategyqa": load_strategyqa,
    "hover": load_hover,
    "fever": load_fever,
    "gsm8k": load_gsm8k,
    "tatqa": load_tatqa,
    "docmath": load_docmath,
    "pubmedqa": load_pubmedqa,
    "medqa": load_medqa,
    "synth": load_synth,
}

_STEP_KEY = re.compile(r"[QA]\d+", re.IGNORECASE)


def format_of_record(record: dict[str, Any], from_csv: bool = False) -> str | None:
    """The format a record's keys identify, or None. The rules, first match wins:

    ``id`` + ``question`` + ``answers`` + ``kind`` + ``supporting_ids`` (``Example.to_dict()``, as written by
    ``sleuth data synth``) -> synth; ``question_text`` + ``answers_objects`` -> ircot; ``golden_answers`` ->
    flashrag; ``table`` + ``questions``
    -> tatqa; ``QUESTION`` + ``CONTEXTS`` or ``pubid`` + ``final_decision`` -> pubmedqa; ``options`` +
    ``answer_idx`` -> medqa; a ``claim`` key -> hover when it also has ``num_hops`` or ``uid`` +
    ``supporting_facts``, else fever; ``question_decomposition`` -> musique; ``evidences`` or ``entity_ids`` ->
    2wiki; ``supporting_facts`` or ``_id`` + ``context`` -> hotpotqa; ``decomposition`` with ``qid``, ``facts`` or
    a boolean ``answer`` -> strategyqa; ``question_id`` + ``paragraphs`` -> docmath; capitalised
    ``Question``/``Answer``, ``Q1``-style keys, or a csv with question and answer columns -> bamboogle; an
    ``answer`` containing ``####`` -> gsm8k; ``question`` + ``answer`` + ``type`` -> hotpotqa (questions only).
    """
    keys = set(record)
    lower = {k.strip().lower() for k in keys}
    if {"id", "question", "answers", "kind", "supporting_ids"} <= keys:  # Example.to_dict(): sleuth's own files
        return "synth"
    if {"question_text", "answers_objects"} <= keys:
        return "ircot"
    if "golden_answers" in keys:
        return "flashrag"
    if {"table", "questions"} <= keys:
        return "tatqa"
    if {"QUESTION", "CONTEXTS"} <= keys or {"pubid", "final_decision"} <= keys:
        return "pubmedqa"
    if {"options", "answer_idx"} <= keys:
        return "medqa"
    if "claim" in lower:
        return "hover" if "num_hops" in keys or {"uid", "supporting_facts"} <= keys else "fever"
    if "question_decomposition" in keys:
        return "musique"
    if "evidences" in keys or "entity_ids" in keys:
        return "2wiki"
    if "supporting_facts" in keys or {"_id", "context"} <= keys:
        return "hotpotqa"
    if "decomposition" in keys and ("qid" in keys or "facts" in keys or isinstance(record.get("answer"), bool)):
        return "strategyqa"
    if {"question_id", "paragraphs"} <= keys:
        return "docmath"
    if {"question", "answer"} <= lower and (
        from_csv or "question" not in keys or any(_STEP_KEY.fullmatch(k.strip()) for k in keys)
    ):
        return "bamboogle"
    if "question" in keys and isinstance(record.get("answer"), str) and "####" in record["answer"]:
        return "gsm8k"
    if {"question", "answer", "type"} <= keys:
        return "hotpotqa"
    return None


def check_encoding(path: PathLike) -> None:
    """Raise :class:`DatasetError` ``"FILE: not UTF-8 (looks like UTF-16-LE: ...); convert it with iconv ..."`` when
    the file is UTF-16/32 (a byte-order mark, or NUL bytes between ASCII characters) or holds NUL bytes, instead of
    the JSON or csv error its first bytes would cause (:func:`sleuth.corpus.encoding_error`). Invalid UTF-8 further
    in is reported by the reader with its line and byte."""
    problem = encoding_error(path)
    if problem is not None:
        raise DatasetError(problem, path=os.fspath(path))


def detect_format(path: PathLike) -> str:
    """The format of a dataset file, from the keys of its first record (see :func:`format_of_record`).

    Raises :class:`DatasetError` listing the known formats when the keys fit none or naming the encoding when the
    file is not UTF-8 (:func:`check_encoding`), and FileNotFoundError when the file does not exist.
    """
    name = os.fspath(path)
    if not os.path.exists(name):
        raise FileNotFoundError(f"dataset file not found: {name}")
    check_encoding(name)
    record = first_record(name)
    if record is None:
        raise DatasetError(f"{name}: no records, cannot tell the dataset format", path=name)
    found = format_of_record(record, from_csv=is_csv(name))
    if found is None:
        raise DatasetError(
            f"{name}: cannot tell the dataset format from the first record's keys {sorted(record)[:20]}; "
            f"pass format= one of: {', '.join(LOADERS)}",
            path=name,
        )
    return found


def iter_examples(
    path: PathLike, format: str | None = None, limit: int | None = None, **options: Any
) -> Iterator[Example]:
    """Yield the examples of a dataset file, detecting its format unless ``format`` is given.

    ``limit`` stops after that many examples (JSON lines files are then read only that far). ``options`` go to
    the loader (``paragraphs=`` for ``strategyqa``). Unknown formats raise :class:`DatasetError` at once;
    malformed rows raise it when reached.
    """
    if format is None:
        format = detect_format(path)
    loader = LOADERS.get(format)
    if loader is None:
        raise DatasetError(f"unknown dataset format {format!r}; known: {', '.join(LOADERS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    check_encoding(path)  # detect_format checked already; a given format skips it
    examples = loader(path, **options)
    return examples if limit is None else itertools.islice(examples, limit)


def load_examples(
    path: PathLike, format: str | None = None, limit: int | None = None, **options: Any
) -> list[Example]:
    """All examples of a dataset file (at most ``limit``) as a list; see :func:`iter_examples`."""
    return list(iter_examples(path, format=format, limit=limit, **options))


# ------------------------------------------------------------------------------------------------------ open mode


def open_corpus(examples: Iterable[Example]) -> list[Passage]:
    """Pool the given passages of many examples into one corpus, deduplicated by passage id, first-seen order.

    Passage ids are stable (the same paragraph has the same id in every question), so every example's
    ``supporting_ids`` that pointed into its context point into the corpus. Scores are dropped. Two different
    passages under one id raise :class:`DatasetError`. Supporting ids missing from the pool (StrategyQA loaded
    without its paragraphs file, say) are counted in a warning on logger ``sleuth.data``.
    """
    pool: dict[str, Passage] = {}
    wanted: set[str] = set()
    for ex in examples:
        wanted.update(ex.supporting_ids)
        for p in ex.context:
            seen = pool.get(p.id)
            if seen is None:
                pool[p.id] = Passage(p.id, p.title, p.text, meta=dict(p.meta))
            elif (seen.title, seen.text) != (p.title, p.text):
                raise DatasetError(
                    f"passage id {p.id!r} names two different passages ({seen.title!r} and {p.title!r}, "
                    f"in example {ex.id!r})"
                )
    missing = wanted - pool.keys()
    if missing:
        logger.warning("%d supporting id(s) are not among the pooled passages, e.g. %r", len(missing), min(missing))
    return list(pool.values())


def write_open_corpus(examples: Iterable[Example], path: PathLike) -> int:
    """Write :func:`open_corpus` of ``examples`` as Search-R1 jsonl, ``{"id", "contents": "\\"Title\\"\\ntext"}``.

    This is the ``searchr1`` format of :class:`sleuth.corpus.CorpusReader` and ``sleuth``'s index builder.
    Passages with empty text are skipped (the reader rejects them). Returns the number of lines written.
    """
    name = os.fspath(path)
    parent = os.path.dirname(name)
    if parent:
        os.makedirs(parent, exist_ok=True)
    written = 0
    with open(name, "w", encoding="utf-8") as f:
        for p in open_corpus(examples):
            if not p.text.strip():
                continue
            f.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
            written += 1
    return written
