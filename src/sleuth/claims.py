"""Fact-verification labels: read "yes" (supported) or "no" from an answer or a gold label.

A leaf module (standard library only), so that the agents and the trainers can read a claim label without importing
the evaluation package; :mod:`sleuth.eval.metrics` re-exports :func:`claim_label` and :data:`CLAIM_LABELS`.
"""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Literal

__all__ = ["CLAIM_LABELS", "claim_label"]

_ASCII_PUNCT = frozenset(string.punctuation)


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


CLAIM_LABELS: dict[str, str] = {
    **dict.fromkeys(
        ["yes", "true", "supported", "supports", "support", "correct", "entailed", "entailment", "entails"], "yes"
    ),
    **dict.fromkeys(
        [
            "no",
            "false",
            "refuted",
            "refutes",
            "refute",
            "not supported",
            "not support",
            "not supports",
            "unsupported",
            "not true",
            "incorrect",
            "not correct",
            "contradiction",
            "contradicted",
            "contradicts",
            "not enough info",
            "not enough information",
            "nei",
        ],
        "no",
    ),
}
_CLAIM_RE = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(CLAIM_LABELS, key=len, reverse=True)) + r")\b")


def _claim_text(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower().replace("_", " ").replace("-", " ")
    return " ".join("".join(" " if _is_punct(ch) else ch for ch in text).split())


def claim_label(text: str | None) -> Literal["yes", "no"] | None:
    """Map a fact-verification answer or gold label to "yes" (supported) or "no"; None when it names neither.

    Words and phrases: :data:`CLAIM_LABELS` (yes/true/supported/supports/... and no/false/refuted/not supported/
    NOT_SUPPORTED/not enough info/...). A reply that *starts* with a label phrase takes it ("No, because ...");
    otherwise the label phrases anywhere in the reply must all agree, or the reply is unparseable (None). Multi-word
    phrases win over their parts, so "not supported" is "no". AceSearcher (digest §6.2, §10 item 9) maps gold
    SUPPORTS/SUPPORTED/SUPPORT to Yes and every other label (NOT_SUPPORTED, REFUTES, NOT ENOUGH INFO) to No; this
    table does the same for the labels it knows.

    >>> claim_label("SUPPORTED"), claim_label("NOT_SUPPORTED"), claim_label("The claim is not supported.")
    ('yes', 'no', 'no')
    >>> claim_label("It is true that X, but the claim is false"), claim_label("maybe")
    (None, None)
    """
    t = _claim_text(text or "")
    if not t:
        return None
    first = _CLAIM_RE.match(t)
    if first:
        return CLAIM_LABELS[first.group(1)]
    found = {CLAIM_LABELS[m] for m in _CLAIM_RE.findall(t)}
    return found.pop() if len(found) == 1 else None
