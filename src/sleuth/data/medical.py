"""Loaders for the biomedical sets of MIRAGE: MedQA-USMLE and PubMedQA, both multiple choice (``kind="mcq"``).

``kind="mcq"`` examples carry ``metadata["options"]`` (letter -> option text) and ``metadata["answer_idx"]`` (the
gold letter), and ``answers = [gold option text, gold letter]``; :func:`sleuth.eval.metrics.mcq_accuracy` scores
the option a reply names (by letter or by its text).
"""

from __future__ import annotations

from collections.abc import Iterator

from sleuth.data._rows import PathLike, Row, dedupe_passages, extras, make_passage, read_records, text_field
from sleuth.records import Example

PUBMEDQA_OPTIONS: dict[str, str] = {"A": "yes", "B": "no", "C": "maybe"}


def load_medqa(path: PathLike) -> Iterator[Example]:
    """MedQA-USMLE JSON lines (MIRAGE / the original release): ``{"question", "answer", "options": {"A": ...,
    "B": ..., ...}, "answer_idx": "B", "meta_info", "metamap_phrases"?}``.

    ``kind="mcq"``; ``metadata["options"]`` = ``options`` (texts stripped), ``metadata["answer_idx"]`` = the
    gold letter, which must be one of the options; ``answers = [answer, answer_idx]``. Ids: ``id`` if present,
    else ``"{file stem}-{row index}"``.
    """
    for row in read_records(path):
        question = text_field(row, "question")
        options = row.need("options", dict)
        if not options or not all(isinstance(v, str) for v in options.values()):
            raise row.error("key 'options' should map letters to option texts", "options")
        options = {str(k).strip(): v.strip() for k, v in options.items()}
        letter = row.need("answer_idx", str).strip()
        if letter not in options:
            raise row.error(f"answer_idx {letter!r} is not one of the options {sorted(options)}", "answer_idx")
        answer = row.get("answer", options[letter], str).strip()
        metadata = extras(row.data, ("id", "question", "answer", "options", "answer_idx"))
        metadata.update(options=options, answer_idx=letter, format="medqa")
        yield Example(id=row.id("id"), question=question, answers=[answer, letter], kind="mcq", metadata=metadata)


def _pubmedqa_fields(row: Row) -> tuple[str, list[str], list[str], str]:
    """(question, contexts, section labels, decision) from the MIRAGE/original or the Hugging Face record form."""
    if "QUESTION" in row.data or "pubid" not in row.data:
        question = text_field(row, "QUESTION")
        contexts = row.strings("CONTEXTS")
        labels = row.strings("LABELS", required=False)
    else:
        question = text_field(row, "question")
        ctx = row.child(row.need("context"), "context")
        contexts = ctx.strings("contexts")
        labels = ctx.strings("labels", required=False)
    decision = row.need("final_decision", str).strip().lower()
    if decision not in PUBMEDQA_OPTIONS.values():
        raise row.error(f"final_decision {decision!r} is not yes, no or maybe", "final_decision")
    return question, contexts, labels, decision


def load_pubmedqa(path: PathLike) -> Iterator[Example]:
    """PubMedQA-L (Jin et al. 2019), as MIRAGE ships it: one JSON object ``{pmid: {"QUESTION", "CONTEXTS": [...],
    "LABELS": [...], "MESHES", "YEAR", "reasoning_required_pred", "reasoning_free_pred", "final_decision",
    "LONG_ANSWER"}}``; JSON lines in the Hugging Face form ``{"pubid", "question", "context": {"contexts",
    "labels", "meshes"}, "long_answer", "final_decision"}`` also load.

    The yes/no/maybe decision is loaded as multiple choice, as MIRAGE evaluates it: options ``A: yes, B: no,
    C: maybe``, ``answers = [decision, letter]``, ``kind="mcq"``. (A ``claim`` example could not express
    "maybe", and ``qa`` exact match would miss replies like "The answer is yes".) ``context`` = the abstract's
    sections (everything but the conclusion, which PubMedQA holds out as ``LONG_ANSWER``), one passage each,
    titled by its section label (``BACKGROUND``, ``METHODS``...); ``supporting_ids`` = all of them (the abstract
    is the evidence). Ids are the PubMed ids.
    """
    for row in read_records(path):
        question, contexts, labels, decision = _pubmedqa_fields(row)
        passages = [
            make_passage(labels[i] if i < len(labels) else "", text) for i, text in enumerate(contexts) if text.strip()
        ]
        context, _ = dedupe_passages(passages)
        letter = next(k for k, v in PUBMEDQA_OPTIONS.items() if v == decision)
        metadata = extras(row.data, ("QUESTION", "CONTEXTS", "question", "context", "pubid"))
        metadata.update(options=dict(PUBMEDQA_OPTIONS), answer_idx=letter, format="pubmedqa")
        yield Example(
            id=row.key if row.key is not None else row.id("pubid", "id"),
            question=question,
            answers=[decision, letter],
            kind="mcq",
            context=context,
            supporting_ids=[p.id for p in context],
            metadata=metadata,
        )
