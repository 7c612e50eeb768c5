"""Answer and retrieval metrics: EM, F1, Acc, claim labels, multiple choice, DocMath numbers, recall@k, LLM judge.

Size: one module on purpose (about 950 lines): every metric sits next to its normaliser, its source and its
doctests, so that a score in a report can be traced to one place.

Every metric, its exact definition, the source it follows and the sources it departs from are listed in one place,
``docs/metrics.md``; each function's docstring names its own source. Summary:

- ``exact_match``: normalised prediction == some normalised gold alias (SQuAD v1.1 ``exact_match_score``).
- ``f1_score``: token F1, multiset overlap, max over aliases (SQuAD v1.1 ``f1_score``).
- ``accuracy`` / ``cover_match``: a gold alias is contained in the prediction ("cover-EM": Search-R1
  ``subem_check``, ExSearch "Acc"); ``mode="either"`` adds prediction-in-gold (AceSearcher reward code),
  ``mode="span"`` is s3's token-level ``span_check``.
- ``claim_accuracy``: yes/no label of the prediction == label of the gold (AceSearcher FV "EM").
- ``mcq_accuracy``: the option the prediction names (letter, else a unique option text) is the gold letter.
- ``docmath_accuracy``: DocMath-Eval ``compare_two_numbers`` on the parsed number.
- ``recall_at_k`` / ``all_supporting_at_k``: supporting ids among the top-k retrieved (None without any).
- ``llm_judge`` / ``gen_acc``: s3's ``judge_check`` (paper Fig. 13 prompt by default) / GenAcc = span or judge.
- ``score_example``: the metrics of one example, chosen by ``example.kind``.

Two rules hold for every metric: an empty prediction (empty after normalisation: whitespace or punctuation only)
is never correct, and a gold alias that normalises to the empty string is ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.claims import CLAIM_LABELS as CLAIM_LABELS  # re-exported: claim labels live below the agents
from sleuth.claims import claim_label
from sleuth.llm.base import LLM, Request, Sampling
from sleuth.records import Example

NormStyle = Literal["unicode", "squad", "arena"]
NumberWords = Literal["tokens", "whole"] | None
AccMode = Literal["cover", "either", "span"]
Golds = str | Iterable[Any]

# ---------------------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------------------

_ASCII_PUNCT = frozenset(string.punctuation)
_ARENA_PUNCT = frozenset(string.punctuation + "\u2018\u2019\u00b4`")
_ARTICLES = re.compile(r"\b(a|an|the)\b")

NUMBER_WORDS: dict[str, str] = {
    "0": "zero",
    "1": "one",
    "2": "two",
    "3": "three",
    "4": "four",
    "5": "five",
    "6": "six",
    "7": "seven",
    "8": "eight",
    "9": "nine",
    "10": "ten",
}


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str, *, style: NormStyle = "unicode", strip_accents: bool = False) -> str:
    """Normalise an answer string before comparison.

    ``style="squad"`` is SQuAD v1.1's ``normalize_answer`` exactly (also Search-R1 ``qa_em.py``, AceSearcher, s3,
    ExSearch): lowercase, delete ``string.punctuation``, replace ``\\b(a|an|the)\\b`` by a space, collapse whitespace.
    ``style="unicode"`` (the default) is the same plus two Unicode steps: NFKC first (full-width digits and letters,
    ligatures, non-breaking spaces become their plain forms; accents stay composed) and deletion of every Unicode
    punctuation character (categories P*: curly quotes, dashes, CJK full stops) besides ``string.punctuation``. On
    ASCII text the two styles agree. ``style="arena"`` is ARENA's variant (code ``normalize_answer``): ``_`` to space,
    lowercase, punctuation and the quotes ‘ ’ ´ ` replaced by a *space* (not deleted), articles, whitespace.

    Accents are kept, as in SQuAD; ``strip_accents=True`` removes combining marks after NFD (``"Café" -> "cafe"``).

    >>> normalize_answer("The Eiffel Tower!")
    'eiffel tower'
    >>> normalize_answer("\\u201cCafé\\u201d   Müller")
    'café müller'
    >>> normalize_answer("\\uff12\\uff10\\uff12\\uff14")  # full-width digits
    '2024'
    >>> normalize_answer("U.S.A."), normalize_answer("U.S.A.", style="arena")
    ('usa', 'u s')
    """
    if style not in ("unicode", "squad", "arena"):
        raise ValueError(f"unknown normalisation style {style!r}; expected 'unicode', 'squad' or 'arena'")
    if style == "unicode":
        s = unicodedata.normalize("NFKC", s)
    if strip_accents:
        s = unicodedata.normalize("NFD", s)
        s = unicodedata.normalize("NFC", "".join(ch for ch in s if unicodedata.category(ch) != "Mn"))
    if style == "arena":
        s = s.replace("_", " ").lower()
        s = "".join(" " if ch in _ARENA_PUNCT else ch for ch in s)
    else:
        s = s.lower()
        drop = (lambda ch: ch in _ASCII_PUNCT) if style == "squad" else _is_punct
        s = "".join(ch for ch in s if not drop(ch))
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def map_number_words(normalized: str, mode: NumberWords = "tokens") -> str:
    """Write the numbers 0..10 as words in an already normalised string.

    AceSearcher's reward code maps a *prediction* that is exactly "0".."10" to "zero".."ten" and leaves the gold
    alone; its digest (§10 item 9) recommends applying the map to both sides. ``mode="whole"`` is the code's rule
    (whole string only), ``mode="tokens"`` maps every standalone token "0".."10", ``None`` maps nothing. The metric
    functions apply it to the prediction and to every gold alike.

    >>> map_number_words("3"), map_number_words("3 kids"), map_number_words("3 kids", "whole"), map_number_words("30")
    ('three', 'three kids', '3 kids', '30')
    """
    if mode is None:
        return normalized
    if mode == "whole":
        return NUMBER_WORDS.get(normalized, normalized)
    if mode == "tokens":
        return " ".join(NUMBER_WORDS.get(tok, tok) for tok in normalized.split())
    raise ValueError(f"unknown number_words mode {mode!r}; expected 'tokens', 'whole' or None")


@dataclass(frozen=True)
class Normalizer:
    """A normalisation recipe: :func:`normalize_answer` then :func:`map_number_words`, applied to both sides.

    >>> Normalizer()("Three!"), Normalizer()("3")
    ('three', 'three')
    >>> NORMALIZERS["squad"]("3")
    '3'
    """

    style: NormStyle = "unicode"
    number_words: NumberWords = "tokens"
    strip_accents: bool = False

    def __call__(self, s: Any) -> str:
        text = "" if s is None else str(s)
        return map_number_words(
            normalize_answer(text, style=self.style, strip_accents=self.strip_accents), self.number_words
        )


DEFAULT_NORMALIZER = Normalizer()
# sleuth's extended normalisation (NFKC, Unicode punctuation, number words): the default of the metric functions,
# and the ``*_ext`` columns of an evaluation.
EXTENDED_NORMALIZER = DEFAULT_NORMALIZER
# The papers' normalisation (SQuAD v1.1): the headline em/f1/acc of an evaluation, comparable with their tables.
SQUAD_NORMALIZER = Normalizer(style="squad", number_words=None)
NORMALIZERS: dict[str, Normalizer] = {
    "default": DEFAULT_NORMALIZER,
    "extended": EXTENDED_NORMALIZER,
    "squad": SQUAD_NORMALIZER,
    "acesearcher": Normalizer(style="squad", number_words="whole"),
    "arena": Normalizer(style="arena", number_words=None),
}


def _normalizer(normalizer: Normalizer | str) -> Normalizer:
    if isinstance(normalizer, Normalizer):
        return normalizer
    if normalizer not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {normalizer!r}; known: {sorted(NORMALIZERS)}")
    return NORMALIZERS[normalizer]


def _gold_list(golds: Golds) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds if g is not None]


def _norm_golds(golds: Golds, norm: Normalizer) -> list[str]:
    """The normalised gold aliases, empty ones dropped."""
    return [g for g in (norm(x) for x in _gold_list(golds)) if g]


# ---------------------------------------------------------------------------------------------------------------
# Short-answer QA: EM, F1, Acc
# ---------------------------------------------------------------------------------------------------------------


def exact_match(prediction: str | None, golds: Golds, normalizer: Normalizer | str = DEFAULT_NORMALIZER) -> float:
    """1.0 if the normalised prediction equals some normalised gold alias (SQuAD v1.1 ``exact_match_score``, max over
    aliases; Search-R1 ``em_check``; s3 ``em_check``; AceSearcher and ExSearch EM).

    >>> exact_match("The Beatles.", ["Beatles", "Fab Four"]), exact_match("Beatles, UK", ["Beatles"])
    (1.0, 0.0)
    """
    norm = _normalizer(normalizer)
    pred = norm(prediction)
    if not pred:
        return 0.0
    return float(any(pred == g for g in _norm_golds(golds, norm)))


def _f1(pred_tokens: list[str], gold_tokens: list[str], overlap: str) -> float:
    if overlap == "multiset":
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    elif overlap == "set":
        same = len(set(pred_tokens) & set(gold_tokens))
    else:
        raise ValueError(f"unknown overlap {overlap!r}; expected 'multiset' or 'set'")
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(
    prediction: str | None,
    golds: Golds,
    normalizer: Normalizer | str = DEFAULT_NORMALIZER,
    overlap: Literal["multiset", "set"] = "multiset",
) -> float:
    """Token F1 between the normalised prediction and gold, max over aliases (SQuAD v1.1 ``f1_score``).

    ``overlap="multiset"`` counts common tokens with multiplicity (SQuAD, ARENA, ExSearch); ``overlap="set"``
    counts each common token once, ``len(set(pred) & set(gold))`` (AceSearcher reward code, per its digest §6.3),
    with the token-list lengths as denominators. No HotpotQA yes/no special case.

    >>> round(f1_score("the big red fox", ["red fox jumps"]), 4)  # P=2/3, R=2/3
    0.6667
    """
    norm = _normalizer(normalizer)
    pred = norm(prediction)
    if not pred:
        return 0.0
    return max((_f1(pred.split(), g.split(), overlap) for g in _norm_golds(golds, norm)), default=0.0)


def _tokens(text: str) -> list[str]:
    """Unicode NFD, then DrQA's ``SimpleTokenizer`` (``[\\p{L}\\p{N}\\p{M}]+|[^\\p{Z}\\p{C}]``), lower-cased: the
    tokenisation of pyserini's ``has_answers``, which s3's ``span_check`` calls. A run of letters, digits and
    combining marks is one token (so ``"cafe\\u0301"`` stays one word), every other visible character is a token of
    its own, and separators and control characters split. One pass over the text.

    >>> _tokens("Café au-lait!") == ["cafe\\u0301", "au", "-", "lait", "!"]
    True
    """
    tokens: list[str] = []
    start = -1
    text = unicodedata.normalize("NFD", text)
    for i, ch in enumerate(text):
        major = unicodedata.category(ch)[0]
        if major in "LNM":
            if start < 0:
                start = i
            continue
        if start >= 0:
            tokens.append(text[start:i].lower())
            start = -1
        if major not in "ZC":
            tokens.append(ch.lower())
    if start >= 0:
        tokens.append(text[start:].lower())
    return tokens


# Tokens never hold a separator or control character, so joining with one turns a token-sequence search into a
# substring search (linear in practice, where comparing slices at every offset is not).
_SEP = "\x00"


def _contains_span(haystack: list[str], needle: list[str]) -> bool:
    return bool(needle) and (_SEP + _SEP.join(needle) + _SEP) in (_SEP + _SEP.join(haystack) + _SEP)


def accuracy(
    prediction: str | None,
    golds: Golds,
    normalizer: Normalizer | str = DEFAULT_NORMALIZER,
    mode: AccMode = "cover",
) -> float:
    """ "Acc": 1.0 if a normalised gold alias is contained in the normalised prediction.

    - ``mode="cover"`` (default): ``norm(gold) in norm(pred)``, a character substring test. This is Search-R1's
      ``subem_check`` and ExSearch's Acc ("whether the ground truth answer is included in the generated answer,
      often referred to as cover-Exact Match", paper App. D.2; code ``src/utilize/metrics.py``).
    - ``mode="either"``: ``norm(pred) in norm(gold) or norm(gold) in norm(pred)``, AceSearcher's *reward* code
      (``create_train_data.py``; the release ships no evaluation scorer). It credits a prediction that is a piece
      of the gold ("no" for "Norway", "1" for "1984"), which is why it is not the default.
    - ``mode="span"``: the gold's token list is a contiguous sub-list of the prediction's tokens, s3's
      ``span_check`` (pyserini ``has_answers`` on SQuAD-normalised text: NFD, DrQA tokens, lower-case, see
      :func:`_tokens`); "1" does not match "1984", and a precomposed "é" matches "e" + combining accent.

    >>> accuracy("He was born in Paris, France.", ["Paris"]), accuracy("Paris", ["Paris, France"])
    (1.0, 0.0)
    >>> accuracy("Paris", ["Paris, France"], mode="either")
    1.0
    """
    norm = _normalizer(normalizer)
    pred = norm(prediction)
    if not pred:
        return 0.0
    golds_n = _norm_golds(golds, norm)
    if mode == "cover":
        return float(any(g in pred for g in golds_n))
    if mode == "either":
        return float(any(g in pred or pred in g for g in golds_n))
    if mode == "span":
        pred_tokens = _tokens(pred)
        return float(any(_contains_span(pred_tokens, _tokens(g)) for g in golds_n))
    raise ValueError(f"unknown accuracy mode {mode!r}; expected 'cover', 'either' or 'span'")


def cover_match(prediction: str | None, golds: Golds, normalizer: Normalizer | str = DEFAULT_NORMALIZER) -> float:
    """Cover-EM: a normalised gold alias is a substring of the normalised prediction (``accuracy(mode="cover")``)."""
    return accuracy(prediction, golds, normalizer, mode="cover")


def span_match(prediction: str | None, golds: Golds, normalizer: Normalizer | str = DEFAULT_NORMALIZER) -> float:
    """s3's ``span_check``: a gold alias is a contiguous token span of the prediction (``accuracy(mode="span")``)."""
    return accuracy(prediction, golds, normalizer, mode="span")


# ---------------------------------------------------------------------------------------------------------------
# Claims (fact verification)
# ---------------------------------------------------------------------------------------------------------------


def claim_accuracy(prediction: str | None, golds: Golds) -> float:
    """1.0 if the prediction's claim label equals some gold's label (AceSearcher FV "EM" on Yes/No, paper §5.1).

    Gold labels follow AceSearcher's code rule: a gold that :func:`claim_label` cannot read counts as "no"
    (everything but SUPPORTED is No); empty golds are ignored. An unparseable prediction is wrong.

    >>> claim_accuracy("Yes.", ["SUPPORTED"]), claim_accuracy("true", ["NOT_SUPPORTED"]), claim_accuracy("", ["no"])
    (1.0, 0.0, 0.0)
    """
    pred = claim_label(prediction)
    if pred is None:
        return 0.0
    gold_labels = {claim_label(g) or "no" for g in _gold_list(golds) if g.strip()}
    return float(pred in gold_labels)


# ---------------------------------------------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------------------------------------------

_STRIP = " \t\n*_`'\"“”‘’"


def _key_pattern(keys: Iterable[str]) -> str:
    return "|".join(re.escape(k) for k in sorted({k.upper() for k in keys} | {k.lower() for k in keys}, key=len)[::-1])


def mcq_choice(prediction: str | None, options: Mapping[str, str]) -> str | None:
    """The option key a multiple-choice answer names, or None when it names none or is ambiguous.

    Rules, in order (sleuth's own; s3 scores MIRAGE with an LLM judge instead, digest §4):

    1. the whole answer is a key, optionally bracketed or followed by ".", ":" or ")": "B", "(B)", "[B]", "B.", "b)";
    2. an explicit statement, the last one wins: "Answer: B", "the answer is (B)", "option B", "correct choice is B"
       (a lowercase key counts only when bracketed, followed by ")" or at the end, so "the answer is a drug" does not
       name option A);
    3. a leading key followed by ")", "." or ":" then a space: "B. Paris", "(B) Paris", "A: Aspirin" (the letter
       wins over the text that follows) unless another bracketed key appears ("(A) or (B)" is ambiguous);
    4. exactly one distinct bracketed key anywhere: "I would pick (B) here";
    5. otherwise option *texts*: an option whose normalised text is a contiguous token span of the normalised answer
       is mentioned; an option whose text lies inside another mentioned option's text ("Paris" in "Paris, Texas")
       does not count separately. Exactly one mentioned option is the choice; two or more is ambiguous (None).

    >>> opts = {"A": "Lyon", "B": "Paris", "C": "Paris, Texas"}
    >>> mcq_choice("(B)", opts), mcq_choice("The answer is C.", opts), mcq_choice("paris", opts)
    ('B', 'C', 'B')
    >>> mcq_choice("Paris, Texas", opts), mcq_choice("Lyon or Paris", opts)
    ('C', None)
    """
    if not options:
        return None
    by_upper = {str(k).upper(): str(k) for k in options}
    text = unicodedata.normalize("NFKC", prediction or "").strip(_STRIP)
    if not text:
        return None
    keys = _key_pattern(by_upper)

    bare = re.fullmatch(rf"[(\[]?\s*({keys})\s*[)\]]?\s*[.:)]?", text)
    if bare:
        return by_upper[bare.group(1).upper()]

    stated = re.finditer(
        rf"(?i:answer|option|choice)\s*(?:(?i:is|:|=|-)\s*)?(?:(?i:option|choice)\s*)?(?::\s*)?"
        rf"(?P<open>[(\[])?(?P<key>{keys})(?P<close>[)\]])?(?=$|[\s.,;:!?)\]])",
        text,
    )
    found = None
    for m in stated:
        key = m.group("key")
        after = text[m.end() : m.end() + 1]
        if key.isupper() or not key.isalpha() or m.group("open") or m.group("close") or after in ("", ")"):
            found = key
    if found is not None:
        return by_upper[found.upper()]

    bracketed = {m.upper() for m in re.findall(rf"[(\[]({keys})[)\]]", text)}
    lead = re.match(rf"(?P<open>[(\[])?(?P<key>{keys})(?P<close>[)\].:])(?:\s|$)", text)
    lead_ok = lead and (lead.group("key").isupper() or lead.group("open") or lead.group("close") == ")")
    if lead and lead_ok and bracketed <= {lead.group("key").upper()}:
        return by_upper[lead.group("key").upper()]

    if len(bracketed) == 1:
        return by_upper[bracketed.pop()]

    pred_tokens = _tokens(DEFAULT_NORMALIZER(text))
    mentioned = {}
    for k, v in options.items():
        norm = DEFAULT_NORMALIZER(v)
        if norm and _contains_span(pred_tokens, _tokens(norm)):
            mentioned[str(k)] = _tokens(norm)
    kept = [
        k
        for k, toks in mentioned.items()
        if not any(o != k and len(t) > len(toks) and _contains_span(t, toks) for o, t in mentioned.items())
    ]
    return kept[0] if len(kept) == 1 else None


def mcq_accuracy(prediction: str | None, options: Mapping[str, str], gold_letter: str) -> float:
    """1.0 if :func:`mcq_choice` picks the gold option key (compared case-insensitively), else 0.0.

    >>> opts = {"A": "cat", "B": "dog"}
    >>> mcq_accuracy("Answer: b", opts, "B"), mcq_accuracy("cat and dog", opts, "A")
    (1.0, 0.0)
    """
    choice = mcq_choice(prediction, options)
    return float(choice is not None and choice.upper() == str(gold_letter).strip().strip("()").upper())


def mcq_gold_letter(example: Example) -> str | None:
    """The gold option key of an MCQ example: ``metadata["answer_idx"]``, else an answer that is a key, else the key
    of the option whose normalised text equals a normalised answer."""
    options = example.metadata.get("options") or {}
    if example.metadata.get("answer_idx") not in (None, ""):
        return str(example.metadata["answer_idx"])
    upper = {str(k).upper(): str(k) for k in options}
    for ans in example.answers:
        key = str(ans).strip().strip("()").upper()
        if key in upper:
            return upper[key]
    golds = set(_norm_golds(example.answers, DEFAULT_NORMALIZER))
    for k, v in options.items():
        if DEFAULT_NORMALIZER(v) in golds:
            return str(k)
    return None


# ---------------------------------------------------------------------------------------------------------------
# DocMath numbers
# ---------------------------------------------------------------------------------------------------------------

_SCALES = {"thousand": 1e3, "k": 1e3, "million": 1e6, "mn": 1e6, "billion": 1e9, "bn": 1e9, "trillion": 1e12}
_NUMBER_RE = re.compile(
    r"(?P<cur1>[$€£¥]\s*)?(?P<open>\(\s*)?(?<![\w.,)])(?P<sign>[-+])?(?P<cur2>[$€£¥]\s*)?(?P<sign2>[-+])?"
    r"(?<![\w.,])(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?![\d,]*\d)"
    r"(?:[eE](?P<exp>[-+]?\d+))?"
    r"(?:\s*(?:x|×|\*)\s*10\s*\^\s*(?P<pow>[-+]?\d+))?"
    r"(?P<close>\s*\))?"
    r"(?:\s*(?P<pct>%|percent\b))?"
    r"(?:\s*(?P<scale>thousand|million|billion|trillion|bn|mn|k)\b)?",
    re.IGNORECASE,
)


_ANSWER_MARKER_RE = re.compile(r"=|≈|\banswer\s*(?:is|:)", re.IGNORECASE)


def _number_value(m: re.Match[str], scale_words: bool) -> float:
    value = float(m.group("num").replace(",", ""))
    if m.group("exp"):
        value *= 10.0 ** int(m.group("exp"))
    if m.group("pow"):
        value *= 10.0 ** int(m.group("pow"))
    if scale_words and m.group("scale"):
        value *= _SCALES[m.group("scale").lower()]
    negative = "-" in (m.group("sign") or "", m.group("sign2") or "") or bool(m.group("open") and m.group("close"))
    return -value if negative else value


def parse_number(text: Any, *, scale_words: bool = True) -> float | None:
    """The number an answer states, or None.

    Accepts ints and floats as they are (not bools; NaN is None). In text: NFKC first (full-width digits), "−" as a
    minus sign; thousands commas ("1,234.5"); currency ($ € £ ¥); a trailing "%" or "percent" is *dropped*, as in
    DocMath-Eval's ``normalize`` (12.5% -> 12.5; :func:`numbers_match` accepts 0.125 against it through its x100
    rule); negatives written "-5" or "(1,234)"; "1.2e5" and "1.2 x 10^5"; scale words thousand/k, million/mn,
    billion/bn, trillion multiply (DocMath deletes them instead; the power-of-ten rule makes the two agree). When
    the text holds several numbers: the first number after the last "=", "≈", "answer is" or "answer:" (DocMath's
    ``normalize`` also keeps what follows the last "=" or "≈"), and without such a marker the *last* number (the
    usual GSM8K-style convention).

    >>> parse_number("$1,234.5"), parse_number("(1,234)"), parse_number("12.5%"), parse_number("3.5 million")
    (1234.5, -1234.0, 12.5, 3500000.0)
    >>> parse_number("Revenue grew from 10 to 12, so the answer is 20%."), parse_number("n/a")
    (20.0, None)
    """
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, int | float):
        value = float(text)
        return None if math.isnan(value) else value
    s = unicodedata.normalize("NFKC", str(text)).replace("\u2212", "-").strip()
    markers = list(_ANSWER_MARKER_RE.finditer(s))
    after = list(_NUMBER_RE.finditer(s, markers[-1].end())) if markers else []
    matches = after[:1] or list(_NUMBER_RE.finditer(s))[-1:]
    if not matches:
        return None
    value = _number_value(matches[0], scale_words)
    return None if math.isnan(value) or math.isinf(value) else value


def _within(pred: float, gt: float, rel_tol: float) -> bool:
    eps = abs(gt) * rel_tol
    return gt - eps <= pred <= gt + eps


def _round_up(x: float, decimals: int) -> float:
    factor = 10**decimals
    return math.ceil(x * factor) / factor


def numbers_match(pred: Any, gold: Any, rel_tol: float = 0.0015, *, docmath_rules: bool = True) -> bool:
    """DocMath-Eval's ``compare_two_numbers`` (``utils/evaluation_utils.py``; AceSearcher digest §1.4).

    With ``v1, v2 = max(|gold|, |pred|), min(|gold|, |pred|)`` it is true when any of these holds, in order:

    1. ``v1/v2`` is an exact power of ten (both non-zero): 0.25 vs 25, 5 vs 5000, and also -5 vs 5 (DocMath
       compares absolute values there, so the sign is ignored);
    2. ``v2 <= v1/50`` and ``v2*100`` is within tolerance of ``v1``; likewise x1000 (``v2 <= v1/500``) and
       x100000 (``v2 <= v1/50000``): a fraction vs a percentage, thousands vs units;
    3. ``ceil(v1*1000)/1000 == ceil(v2*1000)/1000`` (ceiling to 3 decimals);
    4. ``|pred - gold| <= rel_tol * |gold|`` (signed), ``rel_tol`` 0.15% as in DocMath.

    One deliberate difference: DocMath tests rule 1 with ``int(log10(r)) == log10(r)``, which floating-point error
    defeats (0.7/0.07 = 9.999999999999998, so DocMath rejects 0.07 vs 0.7); here ``log10(r)`` needs to be within
    1e-9 of an integer. ``docmath_rules=False`` keeps only rule 4. Strings are parsed with :func:`parse_number`.

    >>> numbers_match(100.15, 100), numbers_match(100.16, 100), numbers_match(0.125, 12.5), numbers_match(0.07, 0.7)
    (True, False, True, True)
    """
    p = parse_number(pred)
    gt = parse_number(gold)
    if p is None or gt is None:
        return False
    if docmath_rules:
        v1, v2 = max(abs(gt), abs(p)), min(abs(gt), abs(p))
        if v1 != 0 and v2 != 0:
            exponent = math.log10(v1 / v2)
            if abs(exponent - round(exponent)) < 1e-9:
                return True
        for factor, bound in ((100, 50), (1000, 500), (100000, 50000)):
            if v2 <= v1 / bound and _within(v2 * factor, v1, rel_tol):
                return True
        if _round_up(v1, 3) == _round_up(v2, 3):
            return True
    return _within(p, gt, rel_tol)


_BOOL_GOLDS = {"true", "false", "yes", "no"}


def docmath_accuracy(
    prediction: Any,
    golds: Golds | float | int,
    rel_tol: float = 0.0015,
    *,
    normalizer: Normalizer | str = DEFAULT_NORMALIZER,
) -> float:
    """1.0 if the prediction's number matches some gold number under :func:`numbers_match` (DocMath-Eval ``get_acc``).

    A gold that is true/false/yes/no is compared as a label (DocMath's bool answers, via :func:`claim_label`); any
    other non-numeric gold falls back to :func:`exact_match` with ``normalizer``. An empty or number-free prediction
    scores 0 (DocMath itself substitutes "0" for an empty prediction, which would match a gold of 0).

    >>> docmath_accuracy("The answer is $1,200 thousand", ["1.2 million"]), docmath_accuracy("", ["0"])
    (1.0, 0.0)
    """
    if isinstance(golds, int | float) and not isinstance(golds, bool):
        golds = [golds]
    gold_items = [golds] if isinstance(golds, str) else list(golds)
    pred_value = parse_number(prediction)
    pred_text = "" if prediction is None else str(prediction)
    for gold in gold_items:
        if isinstance(gold, str) and not gold.strip():
            continue
        if isinstance(gold, bool) or (isinstance(gold, str) and gold.strip().lower() in _BOOL_GOLDS):
            label = claim_label(str(gold).lower())
            if claim_label(pred_text) == label:
                return 1.0
            continue
        gold_value = parse_number(gold)
        if gold_value is None:
            if exact_match(pred_text, [str(gold)], normalizer):
                return 1.0
        elif pred_value is not None and numbers_match(pred_value, gold_value, rel_tol):
            return 1.0
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# Retrieval
# ---------------------------------------------------------------------------------------------------------------


def _top_k(retrieved_ids: Iterable[Any], k: int) -> set[str]:
    if k < 1:
        raise ValueError("k must be >= 1")
    top: list[str] = []
    for rid in retrieved_ids:
        if str(rid) not in top:
            top.append(str(rid))
            if len(top) == k:
                break
    return set(top)


def recall_at_k(retrieved_ids: Sequence[Any], supporting_ids: Iterable[Any], k: int) -> float | None:
    """Fraction of the (distinct) supporting ids among the first ``k`` distinct retrieved ids.

    Retrieved ids are de-duplicated in first-seen order before the cut, so a passage found by two searches takes
    one slot. Returns None when there are no supporting ids (recall is undefined, and averaging must skip it).

    >>> ranked = ["a", "x", "a", "b"]
    >>> recall_at_k(ranked, ["a", "b"], 1), recall_at_k(ranked, ["a", "b"], 3), recall_at_k(ranked, [], 5)
    (0.5, 1.0, None)
    """
    gold = {str(s) for s in supporting_ids}
    if not gold:
        return None
    return len(gold & _top_k(retrieved_ids, k)) / len(gold)


def all_supporting_at_k(retrieved_ids: Sequence[Any], supporting_ids: Iterable[Any], k: int) -> float | None:
    """1.0 if every supporting id is among the first ``k`` distinct retrieved ids, else 0.0; None without any."""
    recall = recall_at_k(retrieved_ids, supporting_ids, k)
    return None if recall is None else float(recall == 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Per-example scoring
# ---------------------------------------------------------------------------------------------------------------


# The metrics an evaluation reports twice: under the papers' SQuAD normalisation (headline) and, with this suffix,
# under sleuth's extended one.
EXT_SUFFIX = "_ext"
HEADLINE_METRICS = ("em", "f1", "acc", "acc_either")


def _answer_scores(example: Example, pred: str, norm: Normalizer, acc_mode: AccMode) -> dict[str, float | None]:
    kind = example.kind
    scores: dict[str, float | None] = {}
    has_golds = bool(_norm_golds(example.answers, norm))
    options = example.metadata.get("options") or {}
    if kind == "mcq" and not options:
        kind = "qa"
    if kind == "qa":
        for name, fn in (("em", exact_match), ("f1", f1_score)):
            scores[name] = fn(pred, example.answers, norm) if has_golds else None
        scores["acc"] = accuracy(pred, example.answers, norm, mode=acc_mode) if has_golds else None
        # AceSearcher's tables use the two-way containment of its released code; report it beside the default.
        scores["acc_either"] = accuracy(pred, example.answers, norm, mode="either") if has_golds else None
    elif kind == "claim":
        value = claim_accuracy(pred, example.answers) if has_golds else None
        scores["em"] = scores["acc"] = value
    elif kind == "mcq":
        gold = mcq_gold_letter(example)
        scores["acc"] = None if gold is None else mcq_accuracy(pred, options, gold)
    elif kind == "math":
        has_math_gold = any(str(a).strip() for a in example.answers)
        scores["acc"] = docmath_accuracy(pred, example.answers, normalizer=norm) if has_math_gold else None
    else:
        raise ValueError(f"unknown example kind {example.kind!r}; expected qa, claim, mcq or math")
    return scores


def score_example(
    example: Example,
    prediction: str | None,
    retrieved_ids: Sequence[Any] | None = None,
    *,
    normalizer: Normalizer | str = SQUAD_NORMALIZER,
    extended: Normalizer | str | None = EXTENDED_NORMALIZER,
    acc_mode: AccMode = "cover",
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float | None]:
    """The metrics of one answered example, chosen by ``example.kind``; a None prediction (a failed trace) is "".

    - ``qa``: ``em``, ``f1``, ``acc`` (:func:`exact_match`, :func:`f1_score`, :func:`accuracy` with ``acc_mode``)
      and ``acc_either`` (AceSearcher's two-way containment, to compare with its tables).
    - ``claim``: ``em`` and ``acc``, both :func:`claim_accuracy` (Yes/No label match, AceSearcher FV EM).
    - ``mcq``: ``acc`` (:func:`mcq_accuracy` with ``metadata["options"]`` and the gold from
      :func:`mcq_gold_letter`); without options the example is scored as ``qa``.
    - ``math``: ``acc`` (:func:`docmath_accuracy`).

    These headline metrics use ``normalizer``, SQuAD v1.1's by default: the normalisation of the numbers the
    papers report, so sleuth's numbers can stand beside theirs. With ``extended`` (default: sleuth's
    :data:`EXTENDED_NORMALIZER`, which also folds Unicode and number words and so scores at least as high on most
    answers) every headline metric is reported a second time under the same name plus ``_ext`` (``em_ext``,
    ``f1_ext``, ...); ``extended=None`` leaves them out. For claims and options the two agree.

    A metric is None when the example has no usable gold. With ``retrieved_ids``, ``recall@k`` and
    ``all_supporting@k`` for each k in ``ks`` (None when the example has no ``supporting_ids``).

    >>> scores = score_example(Example("q", "How many?", answers=["two"]), "2")
    >>> scores["em"], scores["em_ext"]
    (0.0, 1.0)
    """
    pred = prediction or ""
    scores = _answer_scores(example, pred, _normalizer(normalizer), acc_mode)
    if extended is not None:
        ext = _answer_scores(example, pred, _normalizer(extended), acc_mode)
        scores.update({f"{name}{EXT_SUFFIX}": value for name, value in ext.items()})
    if retrieved_ids is not None:
        for k in ks:
            scores[f"recall@{k}"] = recall_at_k(retrieved_ids, example.supporting_ids, k)
            scores[f"all_supporting@{k}"] = all_supporting_at_k(retrieved_ids, example.supporting_ids, k)
    return scores


# ---------------------------------------------------------------------------------------------------------------
# LLM judge (s3 judge_check) and its cache
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgePrompt:
    """A judge prompt: ``template`` with ``{response}`` and ``{golden_answers}``, and an optional system message."""

    template: str
    system: str | None = None
    source: str = ""


JUDGE_PROMPTS: dict[str, JudgePrompt] = {
    "paper": JudgePrompt(
        "Please check if any of the golden answers is contained in the following response: {response}\n"
        "Golden answers: {golden_answers}\n"
        "Please directly answer with \u2019yes\u2019 or \u2019no\u2019.",
        source="s3 paper, Figure 13 (verbatim, typographic quotes)",
    ),
    "paper_text": JudgePrompt(
        "Please check if any of the golden answers is contained in the following response: {response}\n"
        "Golden answers: {golden_answers}\n"
        "Directly answer with \u2019yes\u2019 or \u2019no\u2019.",
        source="s3 paper, section 4.1 / Appendix A.4 wording",
    ),
    "code": JudgePrompt(
        "Please check if any of the golden answers is contained in the following response: {response}\n\n"
        "Golden answers: {golden_answers}\n\n"
        "Please directly answer with 'yes' or 'no'.",
        source="s3 code, generator_llms/local_inst.py::check_if_response_is_correct_llm",
    ),
    "arena": JudgePrompt(
        "*************Consider a knowledge Q&A RAG task to test the capability of a testing model, the correct "
        "answer list is:*************\n{golden_answers}\n\n\n\n*************Here is the model's response:"
        "*************\n{response}\n\n\n\n*************Please check if the model's answer is correct. As long as the "
        "model's answer hits any item (or synonym) in the correct answer list, it can be considered correct. You only "
        'need to answer "yes" or "no".*************',
        system="You are an intelligent AI assistant.",
        source="ARENA code, src/gpt_eval.py::format_prompt and src/gpt_api.py",
    ),
}
JUDGE_PROMPT = JUDGE_PROMPTS["paper"].template
JUDGE_SAMPLING = Sampling(temperature=0.0, top_p=1.0, max_new_tokens=10)  # s3 code: temperature 0, max_tokens 10


def _judge_golds(golds: Golds) -> list[str]:
    return [g for g in _gold_list(golds) if g.strip()]


def format_judge_prompt(response: str, golds: Golds, variant: str = "paper") -> Request:
    """The judge request for one response; gold answers are shown as a Python list repr, as both s3 and ARENA do.

    >>> format_judge_prompt("Paris", ["Paris", "City of Paris"], "code").messages[0]["content"].splitlines()[2]
    "Golden answers: ['Paris', 'City of Paris']"
    """
    if variant not in JUDGE_PROMPTS:
        raise ValueError(f"unknown judge variant {variant!r}; known: {sorted(JUDGE_PROMPTS)}")
    prompt = JUDGE_PROMPTS[variant]
    user = prompt.template.format(response=response, golden_answers=str(_judge_golds(golds)))
    return Request.chat(user, system=prompt.system)


def parse_judge_reply(text: str | None, rule: Literal["words", "substring"] = "words") -> bool | None:
    """Read a judge's yes/no; None when it says neither (or both).

    ``rule="words"`` (default): the first word, lowercased and stripped of quotes, markup and punctuation, if it is
    "yes" or "no"; otherwise the whole-word occurrences of yes and no, if only one of them occurs. ``rule="substring"``
    is s3's code (and ARENA's): "yes" anywhere is True, else "no" anywhere is False, so "I do not know" reads as no.

    >>> parse_judge_reply("Yes."), parse_judge_reply("**No**"), parse_judge_reply("I think the answer is yes")
    (True, False, True)
    >>> parse_judge_reply("unclear"), parse_judge_reply("Is it yes or no?")
    (None, None)
    >>> parse_judge_reply("I do not know", "substring")
    False
    """
    t = (text or "").lower()
    if rule == "substring":
        return True if "yes" in t else False if "no" in t else None
    if rule != "words":
        raise ValueError(f"unknown judge parse rule {rule!r}; expected 'words' or 'substring'")
    first = re.match(r"[\W_]*(yes|no)\b", t)
    if first:
        return first.group(1) == "yes"
    words = set(re.findall(r"\b(yes|no)\b", t))
    return (words.pop() == "yes") if len(words) == 1 else None


@dataclass
class JudgeStats:
    """Counters of judge use: model calls made, answers served from the cache, verdicts that could not be read
    (None; scored as not correct), and responses skipped without a call (empty response or no gold)."""

    calls: int = 0
    cache_hits: int = 0
    unparsed: int = 0
    skipped: int = 0


def judge_key(variant: str, response: str, golds: Golds, llm_spec: str) -> str:
    """The cache key: sha256 of (variant, response, sorted non-empty golds, judge LLM spec)."""
    payload = json.dumps([variant, response, sorted(_judge_golds(golds)), llm_spec], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass
class JudgeCache:
    """Judge verdicts kept in an append-only jsonl file (``{"key", "verdict", "reply"}`` a line), so a re-run
    evaluation does not call the judge again. ``path=None`` keeps them in memory only. An unreadable line (a run
    killed mid-write) is skipped; the last line for a key wins."""

    path: str | Path | None = None
    stats: JudgeStats = field(default_factory=JudgeStats)
    _verdicts: dict[str, bool | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is None:
            return
        self.path = Path(self.path)
        if self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        self._verdicts[row["key"]] = row["verdict"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue

    def __contains__(self, key: str) -> bool:
        return key in self._verdicts

    def __getitem__(self, key: str) -> bool | None:
        return self._verdicts[key]

    def __len__(self) -> int:
        return len(self._verdicts)

    def put(self, key: str, verdict: bool | None, reply: str = "") -> None:
        self._verdicts[key] = verdict
        if self.path is not None:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "verdict": verdict, "reply": reply}, ensure_ascii=False) + "\n")


async def llm_judge(
    llm: LLM,
    response: str | None,
    golds: Golds,
    cache: JudgeCache | None = None,
    variant: str = "paper",
    *,
    stats: JudgeStats | None = None,
    parse: Literal["words", "substring"] = "words",
) -> bool:
    """s3's ``judge_check``: ask ``llm`` whether any gold answer is contained in ``response`` (temperature 0, at most
    10 new tokens, as in s3's code); True only for a readable "yes".

    ``variant`` picks the prompt in :data:`JUDGE_PROMPTS`: "paper" (s3 Fig. 13, default), "paper_text" (s3 §4.1),
    "code" (s3's released code), "arena" (ARENA's LJ prompt). An empty response or an empty gold list is False
    without a call (ARENA skips the judge the same way). An unreadable reply is recorded as None, counted in
    ``stats.unparsed`` and scored False; s3's code re-asks once instead, which with greedy decoding returns the same
    reply. ``stats`` defaults to ``cache.stats``.
    """
    if stats is None and cache is not None:
        stats = cache.stats
    stats = stats if stats is not None else JudgeStats()
    gold_list = _judge_golds(golds)
    text = response or ""
    if not text.strip() or not gold_list:
        stats.skipped += 1
        return False
    spec = getattr(llm, "spec", "") or type(llm).__name__
    key = judge_key(variant, text, gold_list, spec)
    if cache is not None and key in cache:
        stats.cache_hits += 1
        verdict = cache[key]
    else:
        generation = (await llm.generate([format_judge_prompt(text, gold_list, variant)], JUDGE_SAMPLING))[0]
        stats.calls += 1
        verdict = parse_judge_reply(generation.text, parse)
        if cache is not None:
            cache.put(key, verdict, generation.text)
    if verdict is None:
        stats.unparsed += 1
    return bool(verdict)


async def gen_acc(
    llm: LLM,
    response: str | None,
    golds: Golds,
    cache: JudgeCache | None = None,
    variant: str = "paper",
    *,
    stats: JudgeStats | None = None,
) -> float:
    """s3's Generation Accuracy: :func:`span_match` with SQuAD normalisation, and only if it fails, :func:`llm_judge`
    (s3 paper §4.1; code ``check_answer_correct``)."""
    if span_match(response, golds, NORMALIZERS["squad"]):
        return 1.0
    return float(await llm_judge(llm, response, golds, cache, variant, stats=stats))
