"""Loaders for multi-hop and open-domain QA files: HotpotQA, 2WikiMultiHopQA, MuSiQue, FlashRAG, IRCoT, Bamboogle.

Every given paragraph becomes a :class:`~sleuth.records.Passage` whose id is :func:`~sleuth.data._rows.passage_id`
(title + short SHA-1 of the text), so the same paragraph has the same id in every question that lists it and a
corpus pooled from many questions (open mode) keeps every question's ``supporting_ids`` valid. A paragraph listed
twice in one question is kept once (``metadata["duplicate_paragraphs"]`` counts the drops). Keys of a record that
do not become Example fields are kept in ``metadata``, with ``metadata["format"]`` naming the loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from sleuth.data._rows import (
    PathLike,
    Row,
    dedupe_passages,
    extras,
    format_number,
    join_sentences,
    make_passage,
    read_records,
    text_field,
    unique,
)
from sleuth.records import Example, Passage

# --------------------------------------------------------------------------------- HotpotQA-style [title, sentences]


def _sentence_pairs(row: Row, key: str) -> list[tuple[str, list[str]]]:
    """``[[title, [sentence, ...]], ...]`` or the columnar ``{"title": [...], "sentences"|"content": [[...]]}``."""
    value = row.need(key, list, dict)
    shape = f"{key} should be [[title, [sentences]], ...] or {{'title': [...], 'sentences': [[...], ...]}}"
    if isinstance(value, dict):
        titles = value.get("title")
        sentences = value.get("sentences", value.get("content"))
        if not isinstance(titles, list) or not isinstance(sentences, list) or len(titles) != len(sentences):
            raise row.error(shape, key)
        items: list[Any] = list(zip(titles, sentences, strict=True))
    else:
        items = value
    pairs = []
    for i, item in enumerate(items):
        ok = isinstance(item, list | tuple) and len(item) == 2
        if ok:
            title, sents = item
            ok = isinstance(title, str) and isinstance(sents, list) and all(isinstance(s, str) for s in sents)
        if not ok:
            raise row.error(f"{shape}; item {i} is not", key)
        pairs.append((title, sents))
    return pairs


def _fact_titles(row: Row, key: str) -> list[str]:
    """The titles of ``[[title, sent_id], ...]`` or ``{"title": [...], "sent_id": [...]}`` supporting facts."""
    value = row.need(key, list, dict)
    if isinstance(value, dict):
        titles = value.get("title")
        if not isinstance(titles, list):
            raise row.error(f"{key} should be [[title, sent_id], ...] or {{'title': [...], 'sent_id': [...]}}", key)
    else:
        titles = []
        for i, item in enumerate(value):
            if not (isinstance(item, list | tuple) and len(item) >= 1):
                raise row.error(f"{key}[{i}] should be [title, sent_id]", key)
            titles.append(item[0])
    if not all(isinstance(t, str) for t in titles):
        raise row.error(f"{key}: titles should be strings", key)
    return unique(" ".join(t.splitlines()).strip() for t in titles)


def _titled_context(row: Row, context_key: str, facts_key: str) -> tuple[list[Passage], list[str], dict[str, Any]]:
    """Passages and supporting ids from HotpotQA-style ``context`` and ``supporting_facts``.

    A paragraph's text is its sentences joined: HotpotQA's sentences carry their own leading spaces (``"".join``
    gives the original text, as HotpotQA's and PIKE-RAG's code do), 2Wiki's do not (joined with one space); the
    choice is made per question by looking for sentences (after the first) that start with whitespace.
    A paragraph supports the answer when its title is a supporting-fact title (all paragraphs of that title).
    """
    pairs = _sentence_pairs(row, context_key)
    sep = "" if any(s[:1].isspace() for _, sents in pairs for s in sents[1:]) else " "
    context, dropped = dedupe_passages([make_passage(t, join_sentences(s, sep)) for t, s in pairs])
    info: dict[str, Any] = {"duplicate_paragraphs": dropped} if dropped else {}
    supporting: list[str] = []
    if facts_key in row.data:
        by_title: dict[str, list[str]] = {}
        for p in context:
            by_title.setdefault(p.title, []).append(p.id)
        missing = []
        for title in _fact_titles(row, facts_key):
            if title in by_title:
                supporting.extend(by_title[title])
            else:
                missing.append(title)
        if missing:
            info["unresolved_supporting_titles"] = missing
    return context, unique(supporting), info


def _hotpot_like(path: PathLike, fmt: str, *, context_per_row: bool) -> Iterator[Example]:
    with_context: bool | None = None
    for row in read_records(path):
        if with_context is None:
            with_context = "context" in row.data
        question = text_field(row, "question")
        answer = row.need("answer", str).strip()
        context: list[Passage] = []
        supporting: list[str] = []
        info: dict[str, Any] = {}
        if "context" in row.data or (with_context and not context_per_row):
            context, supporting, info = _titled_context(row, "context", "supporting_facts")
        metadata = extras(row.data, ("_id", "id", "question", "answer", "context"))
        metadata.update(info)
        metadata["format"] = fmt
        yield Example(
            id=row.id("_id", "id"),
            question=question,
            answers=[answer],
            kind="qa",
            context=context,
            supporting_ids=supporting,
            metadata=metadata,
        )


def load_hotpotqa(path: PathLike) -> Iterator[Example]:
    """HotpotQA in its original schema, JSON lines or a JSON array.

    Record: ``{"_id", "question", "answer", "type", "level", "supporting_facts": [[title, sent_id]],
    "context": [[title, [sentences]]]}`` (the HF columnar forms of ``context``/``supporting_facts`` are accepted).
    ``answers = [answer]``; ``context`` = the paragraphs, text = the sentences joined as written (they carry their
    own leading spaces); ``supporting_ids`` = the paragraphs whose title is a supporting-fact title;
    ``metadata``: ``type``, ``level``, ``supporting_facts``. A file whose first record has no ``context`` (HotpotQA
    questions only, e.g. FireAct's ``{"question", "answer", "type"}``) loads with empty contexts; otherwise every
    record needs ``context``.
    """
    return _hotpot_like(path, "hotpotqa", context_per_row=False)


def load_2wiki(path: PathLike) -> Iterator[Example]:
    """2WikiMultiHopQA in its original schema, JSON lines or a JSON array.

    Record: ``{"_id", "type", "question", "answer", "context": [[title, [sentences]]],
    "supporting_facts": [[title, sent_id]], "evidences": [[subject, relation, object]], "entity_ids", ...}``.
    Built like HotpotQA (sentences joined with one space: 2Wiki's carry no leading spaces). ``evidences`` and
    every other key (``qa_pairs``, ``explanation`` where present) stay in ``metadata``; no decomposition is built
    from the evidence triples. ``context`` is optional per record: rows without it (36 in the MIGRES dev file)
    load with an empty context and no supporting ids.
    """
    return _hotpot_like(path, "2wiki", context_per_row=True)


# -------------------------------------------------------------------------------------- MuSiQue-style paragraphs


def _paragraph_dicts(row: Row, key: str) -> tuple[list[Passage], dict[int, str], list[str], int]:
    """Passages from ``[{"idx", "title", "paragraph_text", "is_supporting"}]``; returns (context, idx -> id,
    supporting ids, duplicates dropped). ``idx`` defaults to the position, ``is_supporting`` to false."""
    passages = []
    by_idx: dict[int, str] = {}
    supporting = []
    for i, item in enumerate(row.need(key, list)):
        p = row.child(item, f"{key}[{i}]")
        passage = make_passage(p.get("title", "", str), p.need("paragraph_text", str))
        by_idx[p.get("idx", i, int)] = passage.id
        if p.get("is_supporting", False, bool):
            supporting.append(passage.id)
        passages.append(passage)
    context, dropped = dedupe_passages(passages)
    return context, by_idx, unique(supporting), dropped


def _musique_steps(row: Row, key: str, by_idx: dict[int, str] | None) -> list[dict[str, Any]] | None:
    """``question_decomposition`` -> ``[{"question", "answer", "supporting_ids"}]``; ``#k`` kept as written."""
    steps = []
    for i, item in enumerate(row.get(key, [], list)):
        s = row.child(item, f"{key}[{i}]")
        support = s.get("paragraph_support_idx", None, int)
        ids: list[str] = []
        if support is not None and by_idx is not None:
            if support not in by_idx:
                raise s.error(f"paragraph_support_idx {support} names no paragraph", "paragraph_support_idx")
            ids = [by_idx[support]]
        question = text_field(s, "question")
        steps.append({"question": question, "answer": s.need("answer", str).strip(), "supporting_ids": ids})
    return steps or None


def load_musique(path: PathLike) -> Iterator[Example]:
    """MuSiQue in its original schema, JSON lines or a JSON array.

    Record: ``{"id", "question", "answer", "answer_aliases": [...], "answerable", "paragraphs": [{"idx", "title",
    "paragraph_text", "is_supporting"}], "question_decomposition": [{"id", "question", "answer",
    "paragraph_support_idx"}]}``. ``answers = [answer] + answer_aliases``; ``supporting_ids`` = the paragraphs with
    ``is_supporting``; ``decomposition`` = one ``{"question", "answer", "supporting_ids"}`` per step, the questions
    as written (MuSiQue already writes ``#1``-style references, e.g. ``"#1 >> capital"``), the step's supporting id
    from ``paragraph_support_idx``. ``answerable`` and the raw ``question_decomposition`` stay in ``metadata``.

    Files without paragraphs (``musique/dev.json``: questions with gold decompositions only, steps carrying a
    ``document_id``) load with empty contexts and steps without supporting ids. Whether a file has paragraphs is
    decided by its first record; after that every record must agree.
    """
    with_paragraphs: bool | None = None
    for row in read_records(path):
        if with_paragraphs is None:
            with_paragraphs = "paragraphs" in row.data
        question = text_field(row, "question")
        answers = unique(a.strip() for a in [row.need("answer", str), *row.strings("answer_aliases", required=False)])
        context: list[Passage] = []
        supporting: list[str] = []
        by_idx: dict[int, str] | None = None
        metadata = extras(row.data, ("id", "question", "answer", "answer_aliases", "paragraphs"))
        if with_paragraphs:
            context, by_idx, supporting, dropped = _paragraph_dicts(row, "paragraphs")
            if dropped:
                metadata["duplicate_paragraphs"] = dropped
        metadata["format"] = "musique"
        yield Example(
            id=row.id("id"),
            question=question,
            answers=[a for a in answers if a],
            kind="qa",
            context=context,
            supporting_ids=supporting,
            decomposition=_musique_steps(row, "question_decomposition", by_idx),
            metadata=metadata,
        )


# ------------------------------------------------------------------------------------------------------- FlashRAG


def _letter(i: int) -> str:
    return chr(ord("A") + i)


def load_flashrag(path: PathLike) -> Iterator[Example]:
    """FlashRAG JSON lines: ``{"id", "question", "golden_answers": [...], "metadata": {...}, "choices"?}``.

    Used for NQ, TriviaQA, PopQA, Bamboogle and the FlashRAG forms of the multi-hop sets. ``answers =
    golden_answers`` (numbers as strings); ``metadata`` is the record's own ``metadata`` (other top-level keys are
    added without overwriting it). Where that metadata carries the paragraphs, they become the context and are
    removed from ``metadata``: HotpotQA/2Wiki form ``metadata.context`` (``{"title": [...], "sentences": [[...]]}``
    or ``[[title, sentences]]``) with ``metadata.supporting_facts``, or MuSiQue form ``metadata.paragraphs`` with
    ``metadata.question_decomposition``; passage ids are the same as the original files give. Non-empty
    ``choices`` (FlashRAG's MMLU-style sets) make an ``mcq`` example: options ``A``, ``B``, ... in
    ``metadata["options"]``, the gold letter (from an index or the option text in ``golden_answers``) in
    ``metadata["answer_idx"]``, ``answers = [option text, letter]``.
    """
    for row in read_records(path):
        question = text_field(row, "question")
        golden = [g.strip() for g in row.strings("golden_answers")]
        own = row.get("metadata", {}, dict)
        metadata: dict[str, Any] = dict(own)
        for k, v in extras(row.data, ("id", "question", "golden_answers", "metadata", "choices")).items():
            metadata.setdefault(k, v)
        context: list[Passage] = []
        supporting: list[str] = []
        decomposition = None
        meta_row = row.child(own, "metadata")
        if own.get("context"):
            context, supporting, info = _titled_context(meta_row, "context", "supporting_facts")
            metadata.pop("context")
            metadata.update(info)
        elif isinstance(own.get("paragraphs"), list) and own["paragraphs"] and isinstance(own["paragraphs"][0], dict):
            context, by_idx, supporting, dropped = _paragraph_dicts(meta_row, "paragraphs")
            decomposition = _musique_steps(meta_row, "question_decomposition", by_idx)
            metadata.pop("paragraphs")
            if dropped:
                metadata["duplicate_paragraphs"] = dropped
        kind = "qa"
        answers = [g for g in golden if g]
        choices = row.get("choices", [], list)
        if choices:
            options = {_letter(i): str(c).strip() for i, c in enumerate(choices)}
            raw = row.data["golden_answers"][0] if row.data["golden_answers"] else None
            letter = None
            if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < len(options):
                letter = _letter(raw)
            elif isinstance(raw, str):
                letter = raw.strip().upper() if raw.strip().upper() in options else None
                letter = letter or next((k for k, v in options.items() if v == raw.strip()), None)
            if letter is None:
                golden_raw = row.data["golden_answers"]
                raise row.error(f"golden_answers {golden_raw!r} name none of the choices", "golden_answers")
            kind, answers = "mcq", [options[letter], letter]
            metadata["options"], metadata["answer_idx"] = options, letter
        metadata["format"] = "flashrag"
        yield Example(
            id=row.id("id"),
            question=question,
            answers=answers,
            kind=kind,
            context=context,
            supporting_ids=supporting,
            decomposition=decomposition,
            metadata=metadata,
        )


# ---------------------------------------------------------------------------------------------------------- IRCoT


def load_ircot(path: PathLike) -> Iterator[Example]:
    """IRCoT-processed JSON lines (AceSearcher's evaluation files, e.g. ``bamboogle/test_subsampled.jsonl``).

    Record: ``{"question_id", "question_text", "answers_objects": [{"number", "date": {"day", "month", "year"},
    "spans": [...]}], "contexts": [{"idx", "title", "paragraph_text", "is_supporting"}]?, "dataset"?, ...}``.
    ``answers`` = every non-empty span, then the ``number`` and the date (``"day month year"``) where given;
    ``contexts`` become the context (MuSiQue-style, ``is_supporting`` -> ``supporting_ids``).
    """
    for row in read_records(path):
        question = text_field(row, "question_text")
        answers: list[str] = []
        for i, item in enumerate(row.need("answers_objects", list)):
            obj = row.child(item, f"answers_objects[{i}]")
            answers.extend(s.strip() for s in obj.strings("spans", required=False))
            number = obj.get("number", None, str, int, float)
            if number not in (None, ""):
                answers.append(number.strip() if isinstance(number, str) else format_number(number))
            date = obj.get("date", {}, dict)
            parts = [str(date.get(k) or "").strip() for k in ("day", "month", "year")]
            if any(parts):
                answers.append(" ".join(p for p in parts if p))
        context: list[Passage] = []
        supporting: list[str] = []
        metadata = extras(row.data, ("question_id", "id", "question_text", "answers_objects", "contexts"))
        if "contexts" in row.data:
            context, _, supporting, dropped = _paragraph_dicts(row, "contexts")
            if dropped:
                metadata["duplicate_paragraphs"] = dropped
        metadata["format"] = "ircot"
        yield Example(
            id=row.id("question_id", "id"),
            question=question,
            answers=unique(a for a in answers if a),
            kind="qa",
            context=context,
            supporting_ids=supporting,
            metadata=metadata,
        )


# ------------------------------------------------------------------------------------------------------ Bamboogle

_STEP_KEY = re.compile(r"([QA])(\d+)", re.IGNORECASE)


def load_bamboogle(path: PathLike) -> Iterator[Example]:
    """Bamboogle (Press et al. 2022), as a ``.csv`` or as JSON (lines or an array).

    The published csv has the columns ``Question,Answer`` (the Hugging Face ``chiayewken/bamboogle`` copy too).
    The JSON form is assumed to be objects with ``Question``/``Answer`` and, for the gold decomposition,
    ``Q1``, ``A1``, ``Q2``, ``A2``, ... keys (sub-question k and its answer; a csv may carry the same columns).
    Key names are matched case-insensitively. ``answers = [Answer]``; ``decomposition`` = the ``Qk``/``Ak``
    pairs in order of k with no supporting ids (Bamboogle gives no paragraphs), None without them; ids are the
    record's ``id``/``qid`` when present, else ``"{file stem}-{row index}"``. The FlashRAG and IRCoT (AceSearcher)
    copies of Bamboogle load with the ``flashrag`` and ``ircot`` formats.
    """
    for row in read_records(path):
        names = {k.strip().lower(): k for k in row.data}
        question = text_field(row, names.get("question", "Question"))
        answer = text_field(row, names.get("answer", "Answer"))
        steps: dict[int, dict[str, str]] = {}
        step_keys = []
        for key, value in row.data.items():
            m = _STEP_KEY.fullmatch(key.strip())
            if m:
                step_keys.append(key)
                if isinstance(value, str | int | float) and str(value).strip():
                    steps.setdefault(int(m.group(2)), {})[m.group(1).upper()] = str(value).strip()
        decomposition = [
            {"question": s["Q"], "answer": s.get("A"), "supporting_ids": []}
            for _, s in sorted(steps.items())
            if "Q" in s
        ]
        used = [names.get("question", ""), names.get("answer", ""), names.get("id", ""), names.get("qid", "")]
        metadata = extras(row.data, used + step_keys)
        metadata["format"] = "bamboogle"
        yield Example(
            id=row.id(names.get("id", "id"), names.get("qid", "qid")),
            question=question,
            answers=[answer],
            kind="qa",
            decomposition=decomposition or None,
            metadata=metadata,
        )
