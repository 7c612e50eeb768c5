"""Loaders for yes/no tasks: HOVER, FEVER / EX-FEVER (fact verification) and StrategyQA.

All three give ``kind="claim"`` examples whose ``answers`` are ``["yes"]`` or ``["no"]``, scored by
:func:`sleuth.eval.metrics.claim_accuracy` (the label a reply names, "SUPPORTED"/"true"/"yes" or
"NOT_SUPPORTED"/"false"/"no", against the gold label). Fact-verification labels follow AceSearcher's code
(digest §6.2, §10 item 9): SUPPORTS / SUPPORTED / SUPPORT -> ``"yes"``, everything else -> ``"no"``. That includes
FEVER's and EX-FEVER's NOT ENOUGH INFO, so a three-way label becomes two-way: a claim the evidence neither
supports nor refutes counts as "no" (not supported). The dataset's own label stays in ``metadata["label"]``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from sleuth.data._rows import PathLike, Row, extras, make_passage, read_records, text_field, unique
from sleuth.records import Example, Passage

_YES = frozenset({"SUPPORTS", "SUPPORTED", "SUPPORT"})
_NO = frozenset({"REFUTES", "REFUTED", "REFUTE", "NOT SUPPORTED", "NOT ENOUGH INFO", "NEI"})


def claim_answer(row: Row, key: str = "label") -> str:
    """``"yes"`` or ``"no"`` for a fact-verification label (see the module docstring).

    Strings are compared case-insensitively with ``_`` read as a space. Integer labels follow the Hugging Face
    class-label convention of HOVER (``0`` NOT_SUPPORTED, ``1`` SUPPORTED). Any other label is an error.
    """
    label = row.need(key, str, int, bool)
    if isinstance(label, bool | int):
        if label in (0, 1):
            return "yes" if label == 1 else "no"
    else:
        norm = " ".join(label.replace("_", " ").upper().split())
        if norm in _YES:
            return "yes"
        if norm in _NO:
            return "no"
    raise row.error(f"unknown label {label!r}; expected one of {sorted(_YES | _NO)}", key)


def load_hover(path: PathLike) -> Iterator[Example]:
    """HOVER (Jiang et al. 2020), a JSON array (the release files) or JSON lines.

    Record: ``{"uid", "claim", "supporting_facts": [[title, sent_id]], "label": "SUPPORTED"|"NOT_SUPPORTED",
    "num_hops", "hpqa_id"?}``. ``question`` = the claim; ``answers`` = ``["yes"]``/``["no"]``; no context is given,
    so ``supporting_ids`` is empty and the supporting Wikipedia titles are in ``metadata["supporting_titles"]``
    (``label``, ``num_hops``, ``supporting_facts`` stay in ``metadata`` too).
    """
    for row in read_records(path):
        claim = text_field(row, "claim")
        answer = claim_answer(row)
        titles = []
        for i, fact in enumerate(row.get("supporting_facts", [], list)):
            if not (isinstance(fact, list) and fact and isinstance(fact[0], str)):
                raise row.error(f"supporting_facts[{i}] should be [title, sent_id]", "supporting_facts")
            titles.append(fact[0].strip())
        metadata = extras(row.data, ("uid", "id", "claim"))
        metadata["supporting_titles"] = unique(titles)
        metadata["format"] = "hover"
        yield Example(id=row.id("uid", "id"), question=claim, answers=[answer], kind="claim", metadata=metadata)


_FEVER_BRACKETS = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}", "-COLON-": ":"}


def _wiki_title(page: str) -> str:
    """A FEVER/EX-FEVER page name as a title: ``Nikolaj_Coster-Waldau`` -> ``Nikolaj Coster-Waldau``."""
    for token, char in _FEVER_BRACKETS.items():
        page = page.replace(token, char)
    return page.replace("_", " ").strip()


def _evidence_pages(evidence: Any) -> list[str]:
    """Page names in FEVER ``evidence``: sets of ``[annotation_id, evidence_id, page, sentence_id]``."""
    pages = []
    for group in evidence if isinstance(evidence, list) else []:
        for item in group if isinstance(group, list) else []:
            if isinstance(item, list) and len(item) >= 3 and isinstance(item[2], str):
                pages.append(item[2])
    return pages


def _literal_list(text: Any) -> list[str]:
    """EX-FEVER's csv cells hold Python list literals (``"['Sindh', 'Pakistan']"``); [] when not one."""
    if not isinstance(text, str) or not text.strip().startswith("["):
        return []
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return []
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def load_fever(path: PathLike) -> Iterator[Example]:
    """FEVER, EX-FEVER and other ``{"claim", "label"}`` files (AceSearcher's ExFEVER/HOVER evaluation jsonl).

    FEVER (JSON lines): ``{"id", "verifiable", "label": "SUPPORTS"|"REFUTES"|"NOT ENOUGH INFO", "claim",
    "evidence": [[[annotation_id, evidence_id, page, sentence_id]]]}``. EX-FEVER (the release's ``.csv``): columns
    ``claim, explanation, label (SUPPORT|REFUTE|NOT ENOUGH INFO), golden entity, mention, result entity, discard
    number``. ``answers`` = ``["yes"]``/``["no"]`` with NOT ENOUGH INFO -> ``"no"`` (AceSearcher's rule, see the
    module docstring). Evidence pages (FEVER ``evidence``, EX-FEVER ``golden entity``) become
    ``metadata["supporting_titles"]``; all other fields (``explanation``, ``evidence``, ``label``...) stay in
    ``metadata``. Rows without an ``id`` are named ``"{file stem}-{row index}"``.
    """
    for row in read_records(path):
        claim = text_field(row, "claim")
        answer = claim_answer(row)
        pages = _evidence_pages(row.data.get("evidence")) + _literal_list(row.data.get("golden entity"))
        metadata = extras(row.data, ("id", "claim"))
        metadata["supporting_titles"] = unique(_wiki_title(p) for p in pages)
        metadata["format"] = "fever"
        yield Example(id=row.id("id", "uid"), question=claim, answers=[answer], kind="claim", metadata=metadata)


# ------------------------------------------------------------------------------------------------------ StrategyQA


def _evidence_keys(value: Any) -> list[str]:
    """Paragraph keys (``"Title-3"``) anywhere inside one step's evidence; ``operation``/``no_evidence`` skipped."""
    if isinstance(value, str):
        return [] if value in ("operation", "no_evidence") else [value]
    if isinstance(value, list):
        return [k for item in value for k in _evidence_keys(item)]
    return []


def strategyqa_paragraphs(path: PathLike) -> dict[str, Passage]:
    """StrategyQA evidence paragraphs by key ``"{title}-{para_index}"`` (the ids that ``evidence`` uses).

    Accepts MIGRES's ``strategyQA_aug_context.jsonl`` (``{"title", "section", "headers", "para_index",
    "contents", "id"}``) and the official ``strategyqa_train_paragraphs.json`` (``{key: {"title", "section",
    "headers", "para_index", "content"}}``). The key is the passage id; the file's own ``id`` goes to
    ``meta["source_id"]``.
    """
    table: dict[str, Passage] = {}
    for row in read_records(path):
        title = row.need("title", str)
        text = row.need("contents", str) if "contents" in row.data else row.need("content", str)
        key = row.key if row.key is not None else f"{title}-{row.need('para_index', int)}"
        meta = {k: row.data[k] for k in ("section", "headers", "para_index") if k in row.data}
        if "id" in row.data:
            meta["source_id"] = row.data["id"]
        table[key] = make_passage(title, text, pid=key, **meta)
    return table


def load_strategyqa(path: PathLike, paragraphs: PathLike | dict[str, Passage] | None = None) -> Iterator[Example]:
    """StrategyQA, JSON lines or a JSON array.

    Record: ``{"qid", "term", "description", "question", "answer": bool, "facts": [...], "decomposition":
    [sub-question, ...], "evidence": [per annotator: [per step: [[paragraph keys] | "operation" | "no_evidence"]]]}``.
    StrategyQA is yes/no QA; it is loaded as ``kind="claim"`` so that "yes"/"true"/"no"/"false" replies are all
    scored by label (:func:`sleuth.eval.metrics.claim_accuracy`): ``answers = ["yes"]`` or ``["no"]``, the boolean
    in ``metadata["answer"]``. Prompts should still present it as a question. ``decomposition`` = the
    sub-questions (they use ``#k`` references) with ``answer`` None (StrategyQA has no sub-answers) and, per step,
    the union over annotators of its evidence paragraph keys; ``supporting_ids`` = the union over steps.
    Paragraph keys are ``"{title}-{para_index}"``, used as passage ids. With ``paragraphs`` (a file for
    :func:`strategyqa_paragraphs`, or its result) the context holds the evidence paragraphs found there;
    without it the context is empty.
    """
    table = paragraphs if paragraphs is None or isinstance(paragraphs, dict) else strategyqa_paragraphs(paragraphs)
    for row in read_records(path):
        question = text_field(row, "question")
        answer = row.need("answer", bool)
        steps = row.strings("decomposition", required=False)
        per_step: list[list[str]] = [[] for _ in steps]
        for a, annotation in enumerate(row.get("evidence", [], list)):
            if not isinstance(annotation, list):
                raise row.error(f"evidence[{a}] should be a list (one entry per step)", "evidence")
            for i, step in enumerate(annotation[: len(steps)]):
                per_step[i].extend(_evidence_keys(step))
        step_ids = [unique(ids) for ids in per_step]
        supporting = unique(k for ids in step_ids for k in ids)
        context = []
        if table is not None:
            context = [_copy(table[k]) for k in supporting if k in table]
        decomposition = [
            {"question": q.strip(), "answer": None, "supporting_ids": ids}
            for q, ids in zip(steps, step_ids, strict=True)
        ]
        metadata = extras(row.data, ("qid", "id", "question", "decomposition"))
        metadata["format"] = "strategyqa"
        yield Example(
            id=row.id("qid", "id"),
            question=question,
            answers=["yes" if answer else "no"],
            kind="claim",
            context=context,
            supporting_ids=supporting,
            decomposition=decomposition or None,
            metadata=metadata,
        )


def _copy(p: Passage) -> Passage:
    return Passage(p.id, p.title, p.text, meta=dict(p.meta))
