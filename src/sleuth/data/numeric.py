"""Loaders for numeric reasoning: GSM8K, TAT-QA and DocMath-Eval.

Numbers become answer strings with :func:`~sleuth.data._rows.format_number` (``3.0`` -> ``"3"``); ``kind="math"``
examples are scored by :func:`sleuth.eval.metrics.docmath_accuracy` (DocMath's relative tolerance).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sleuth.data._rows import (
    PathLike,
    Row,
    dedupe_passages,
    extras,
    format_number,
    make_passage,
    markdown_table,
    read_records,
    text_field,
    unique,
)
from sleuth.records import Example, Passage


def load_gsm8k(path: PathLike) -> Iterator[Example]:
    """GSM8K JSON lines: ``{"question", "answer"}`` where ``answer`` is the rationale ending in ``#### N``.

    ``answers = [N]`` with thousands separators removed (``"#### 2,125"`` -> ``"2125"``); the rationale before
    ``####`` (calculator annotations ``<<...>>`` kept) is ``metadata["rationale"]``; ``kind="math"``. Ids:
    ``"{file stem}-{row index}"`` (GSM8K has none) unless the record has an ``id``.
    """
    for row in read_records(path):
        question = text_field(row, "question")
        solution = row.need("answer", str)
        if "####" not in solution:
            raise row.error("key 'answer' has no '#### ' final answer", "answer")
        rationale, final = solution.rsplit("####", 1)
        final = final.strip().replace(",", "")
        if not final:
            raise row.error("key 'answer' has an empty final answer after '####'", "answer")
        metadata = extras(row.data, ("id", "question", "answer"))
        metadata["rationale"] = rationale.strip()
        metadata["format"] = "gsm8k"
        yield Example(id=row.id("id"), question=question, answers=[final], kind="math", metadata=metadata)


def _answer_strings(row: Row, key: str) -> list[str]:
    """A TAT-QA answer: a number, a string, or a list of spans (several spans are joined with ", ")."""
    value = row.need(key, list, str, int, float)
    if isinstance(value, list):
        spans = [s.strip() for s in row.strings(key) if s.strip()]
        return [", ".join(spans)] if len(spans) > 1 else spans
    if isinstance(value, str):
        return [value.strip()] if value.strip() else []
    return [format_number(value)]


def _copy(p: Passage) -> Passage:
    return Passage(p.id, p.title, p.text, meta=dict(p.meta))


def load_tatqa(path: PathLike) -> Iterator[Example]:
    """TAT-QA (Zhu et al. 2021): a JSON array of documents, one Example per question.

    Document: ``{"table": {"uid", "table": [[cell, ...], ...]}, "paragraphs": [{"uid", "order", "text"}],
    "questions": [{"uid", "order", "question", "answer", "derivation", "answer_type": "span"|"multi-span"|
    "arithmetic"|"count", "answer_from": "table"|"text"|"table-text", "rel_paragraphs": ["2", ...],
    "req_comparison", "scale": ""|"thousand"|"million"|"billion"|"percent"}]}``.

    ``context`` = the table as a markdown passage (id = the table's ``uid``, title ``"Table"``, first row as the
    header) then the paragraphs in ``order`` (id = the paragraph's ``uid``, title ``"Paragraph {order}"``); every
    question of a document gets the same passages. ``supporting_ids`` = the table when ``answer_from`` mentions it,
    then the paragraphs named by ``rel_paragraphs`` (their ``order``). ``answers``: a number as a string
    (arithmetic; ``scale`` is NOT applied: -12.6 with scale "million" stays ``"-12.6"``), the span, or a
    multi-span answer's spans joined with ", " (the spans themselves are in ``metadata["answer"]``).
    ``kind="math"`` for ``answer_type == "arithmetic"``, else ``"qa"``. ``metadata``: ``scale``, ``answer_type``,
    ``answer_from``, ``derivation``, ``rel_paragraphs``, ``req_comparison``, ``answer`` (raw), ``table_uid``.
    """
    for doc in read_records(path):
        table = doc.child(doc.need("table"), "table")
        rows = table.need("table", list)
        for i, r in enumerate(rows):
            if not isinstance(r, list):
                raise table.error(f"table[{i}] should be a list of cells", "table")
        table_id = str(table.need("uid", str))
        table_passage = make_passage("Table", markdown_table(rows), pid=table_id, type="table")
        paragraphs: list[tuple[int, Passage]] = []
        for i, item in enumerate(doc.need("paragraphs", list)):
            p = doc.child(item, f"paragraphs[{i}]")
            order = p.get("order", i + 1, int)
            passage = make_passage(f"Paragraph {order}", p.need("text", str), pid=p.need("uid", str), type="paragraph")
            paragraphs.append((order, passage))
        paragraphs.sort(key=lambda x: x[0])
        by_order = {str(order): p.id for order, p in paragraphs}
        context, _ = dedupe_passages([table_passage] + [p for _, p in paragraphs])
        for j, item in enumerate(doc.need("questions", list)):
            q = doc.child(item, f"questions[{j}]")
            answer_type = q.need("answer_type", str)
            answer_from = q.get("answer_from", "", str)
            supporting = [table_id] if "table" in answer_from else []
            supporting += [by_order[str(o)] for o in q.strings("rel_paragraphs", required=False) if str(o) in by_order]
            metadata = extras(q.data, ("uid", "question"))
            metadata["table_uid"] = table_id
            metadata["format"] = "tatqa"
            yield Example(
                id=q.need("uid", str),
                question=text_field(q, "question"),
                answers=_answer_strings(q, "answer"),
                kind="math" if answer_type == "arithmetic" else "qa",
                context=[_copy(p) for p in context],
                supporting_ids=unique(supporting),
                metadata=metadata,
            )


def _is_markdown_table(text: str) -> bool:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return len(lines) >= 2 and all(ln.startswith("|") for ln in lines)


def _indices(row: Row, key: str, size: int, offset: int) -> list[int]:
    out = []
    for i in row.get(key, [], list):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size:
            raise row.error(f"{key} entry {i!r} is not an index below {size}", key)
        out.append(offset + i)
    return out


def _number(row: Row, key: str) -> str | None:
    value = row.get(key, None, int, float, str)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            float(value.replace(",", ""))
        except ValueError:
            raise row.error(f"key {key!r} should be a number, got {value!r}", key) from None
        return value.strip().replace(",", "")
    return format_number(value)


def load_docmath(path: PathLike) -> Iterator[Example]:
    """DocMath-Eval (Zhao et al. 2024), a JSON array or JSON lines, ``kind="math"``.

    Record (official release): ``{"question_id", "source"?, "original_question_id"?, "question", "paragraphs":
    [text or markdown table, ...], "table_evidence": [index], "paragraph_evidence": [index], "python_solution",
    "ground_truth": number}`` (``python_solution``/``ground_truth`` are hidden in the test split: the example
    then has no answers). A record may instead keep its tables apart, ``"tables": [markdown, ...]``; then
    ``table_evidence`` indexes ``tables`` and the tables follow the paragraphs in the context.

    ``context`` = one passage per paragraph/table (no title; ``meta["type"]`` is ``"table"`` for markdown
    tables, else ``"paragraph"``; empty ones skipped), ids from the text so a document shared by several
    questions gives the same passages. ``supporting_ids`` = the evidence indices' passages (tables first).
    ``answers = [ground_truth]``; ``python_solution`` and the other keys stay in ``metadata``.
    """
    for row in read_records(path):
        question = text_field(row, "question")
        paragraphs = row.strings("paragraphs")
        tables = row.strings("tables", required=False)
        texts = [(t, "table" if _is_markdown_table(t) else "paragraph") for t in paragraphs]
        texts += [(t, "table") for t in tables]
        passages: list[Passage | None] = [make_passage("", t, type=k) if t.strip() else None for t, k in texts]
        table_offset = len(paragraphs) if "tables" in row.data else 0
        table_size = len(tables) if "tables" in row.data else len(paragraphs)
        evidence = _indices(row, "table_evidence", table_size, table_offset)
        evidence += _indices(row, "paragraph_evidence", len(paragraphs), 0)
        context, _ = dedupe_passages([p for p in passages if p is not None])
        supporting = unique(p.id for i in evidence if (p := passages[i]) is not None)
        answer = _number(row, "ground_truth")
        metadata: dict[str, Any] = extras(row.data, ("question_id", "id", "question", "paragraphs", "tables"))
        metadata["format"] = "docmath"
        yield Example(
            id=row.id("question_id", "id"),
            question=question,
            answers=[answer] if answer is not None else [],
            kind="math",
            context=context,
            supporting_ids=supporting,
            metadata=metadata,
        )
