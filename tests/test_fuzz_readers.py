"""Hostile model output against the readers of naive_rag, AceSearcher (both variants) and ARENA (issue 20 item 2).

Two kinds of test:
- linear time: every parser on adversarial inputs of growing size (unclosed, nested and repeated tags, whitespace
  runs, long digit runs); the time ratio between sizes n and 8n must stay far below the 64 of a quadratic parser;
- fuzzing: each whole agent driven by the scripted model with random tag soup from its own vocabulary, 20k-char
  replies, unicode with lone surrogates and long digit runs: no exception, every example well under a second, and
  every malformed reply recorded as a fallback.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sleuth.agents import Context
from sleuth.agents.acesearcher import (
    AceSearcherConfig,
    clean_subanswer,
    extract_answer,
    parse_decomposition,
    resolve_references,
)
from sleuth.agents.acesearcher_doc import AceSearcherDocConfig, authored_program, clean_latex, extract_boxed
from sleuth.agents.arena import ArenaConfig, arena_format_ok, parse_arena, reference_relevance
from sleuth.agents.baselines import NaiveRAGConfig, short_answer
from sleuth.records import Example, Passage, Trace
from sleuth.runner import run
from sleuth.train.rewards import arena_reward
from tests.scripted import ListRetriever, ScriptedLLM, passages

# ------------------------------------------------------------------------------------------------ linear time


def growth(fn: Callable[[str], Any], make: Callable[[int], str], n: int = 25_000, rounds: int = 7) -> float:
    """``time(make(8n)) / time(make(n))``, three doublings: about 8 for a linear reader, 64 for a quadratic one,
    512 for a cubic one. Each time is the minimum over ``rounds`` runs, the two sizes interleaved so that a busy
    spell of the machine hits both. Three doublings rather than one, because a linear reader's time per character
    can step up once in the range (the input outgrows a cache, or the allocator switches to mmap for the larger
    copies) and that step alone can double one doubling's ratio. The sizes stay at or under 200k characters."""
    small, big = make(n), make(8 * n)
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, text in enumerate((small, big)):
            started = time.perf_counter()
            fn(text)
            best[i] = min(best[i], time.perf_counter() - started)
    return best[1] / max(best[0], 1e-7)


# Each reader with inputs that made the old regexes (or int()) super-linear, and other shapes of the same kind.
ADVERSARIAL: dict[str, list[Callable[[int], str]]] = {
    "tags": [
        lambda n: "<answer>" + " " * n,
        lambda n: "<relevance>" * (n // 11),
        lambda n: "<relevance>" + "<analysis>" * (n // 10),
        lambda n: "<answer><answer>" * (n // 16) + "</answer>",
        lambda n: "<relevance>[" + "9," * (n // 2),
        lambda n: "<relevance>" + "[" * n + "</relevance>",
        lambda n: "<analysis>[" + "1," * (n // 2),
        lambda n: "<analysis>references " + "1 and " * (n // 6),
        lambda n: "\n" * n,
        lambda n: "answer:" + " " * n,
        lambda n: "<a" + " " * n,
        lambda n: "<a" * (n // 2),
        lambda n: "<relevance>[" + "9" * n + "]</relevance>",
    ],
    "decomposition": [
        lambda n: "\n" * n,
        lambda n: "#" * n,
        lambda n: "q1" + " " * n + "x",
        lambda n: "### Q1: " + "#1 " * (n // 3),
        lambda n: "### Q" + "1" * n + ": x",
        lambda n: "1. a\n" * (n // 5),
        lambda n: "### Q1: x #" + "9" * n,
        lambda n: "**" * (n // 2) + "Q1: x",
    ],
    "answer": [
        lambda n: "<answer>" * (n // 8),
        lambda n: "</answer>" + "<answer>" * (n // 8),
        lambda n: "answer is" + " " * n + "x",
        lambda n: "answer is " * (n // 10),
        lambda n: "\n" * n + "x",
        lambda n: "yes no " * (n // 7),
    ],
    "latex": [
        lambda n: "\\boxed{" * (n // 7),
        lambda n: "\\boxed{" + "{" * n,
        lambda n: "\\text{" * (n // 6),
        lambda n: "\\frac{" * (n // 6),
        lambda n: "\\frac{1}{" + "9" * n + "}",
        lambda n: "\\boxed{\\frac{" + "9" * n + "}{3}}",
    ],
}

DOCUMENTS = ["Revenue | 2019 | 2020\n| 5 | 7 |", "The revenue rose."]
READERS: list[tuple[str, str, Callable[[str], Any]]] = [
    ("parse_arena", "tags", parse_arena),
    ("parse_arena strict", "tags", lambda t: parse_arena(t, strict=True)),
    ("arena_format_ok", "tags", arena_format_ok),
    ("reference_relevance", "tags", reference_relevance),
    ("arena_reward", "tags", lambda t: arena_reward(t, ["Warsaw"], [1, 3])),
    ("parse_decomposition", "decomposition", parse_decomposition),
    ("resolve_references", "decomposition", lambda t: resolve_references(t, {1: "Ann"})),
    ("extract_answer", "answer", extract_answer),
    ("extract_answer on tags", "tags", extract_answer),
    ("clean_subanswer qa", "answer", lambda t: clean_subanswer(t, fact=False)),
    ("clean_subanswer fact", "answer", lambda t: clean_subanswer(t, fact=True)),
    ("short_answer", "answer", short_answer),
    ("extract_boxed", "latex", extract_boxed),
    ("clean_latex", "latex", clean_latex),
    ("authored_program", "answer", lambda t: authored_program(t, "Write a Python program. " * 4, DOCUMENTS)),
    ("authored_program echo", "answer", lambda t: authored_program(t + t, t, [t])),
]


@pytest.mark.parametrize(
    ("family", "shape"), [(f, i) for f, makers in ADVERSARIAL.items() for i in range(len(makers))]
)
def test_readers_are_linear_time(family: str, shape: int) -> None:
    make = ADVERSARIAL[family][shape]
    for name, reads, fn in READERS:
        if reads != family:
            continue
        ratio = growth(fn, make)
        if ratio >= 32:  # measured again before failing: a super-linear reader fails twice, a busy moment seldom does
            ratio = min(ratio, growth(fn, make))
        assert ratio < 32, f"{name} on {make(12)!r}...: time x{ratio:.0f} for 8x the input (linear: 8, quadratic: 64)"


def test_issue_repro_is_fast_and_numbers_past_the_int_limit_are_fallbacks() -> None:
    started = time.perf_counter()
    out = parse_arena("<answer>" + " " * 3000)  # 13 s before
    assert time.perf_counter() - started < 1.0 and out.fallback is not None
    huge = parse_arena("<relevance>[" + "9" * 5000 + "]</relevance>\n<analysis>a</analysis>\n<answer>x</answer>")
    assert huge.relevance == [] and huge.fallback is not None and "number_too_long" in huge.fallback
    floaty = parse_arena("<relevance>[" + "9" * 400 + ", 1]</relevance>\n<analysis>a</analysis>\n<answer>x</answer>")
    assert floaty.relevance[-1] == 1 and floaty.fallback is None  # 400 digits: an int JSON reads, never a float
    subs, fallback = parse_decomposition("### Q" + "9" * 5000 + ": x\n### Q2: y #" + "9" * 5000)
    assert [s.text for s in subs] == ["x", "y #1"] and fallback is not None  # the over-long numbers are equal
    assert resolve_references("#" + "9" * 5000, {1: "a"}) == "#" + "9" * 5000


# ------------------------------------------------------------------------------------------------ fuzzing

VOCABULARY = {
    "naive_rag": ["Answer:", "the answer is", "<answer>", "</answer>"],
    "arena": [
        "<relevance>",
        "</relevance>",
        "<analysis>",
        "</analysis>",
        "<answer>",
        "</answer>",
        "<relevance>[1, 3]</relevance>",
        "[1,",
        "[true]",
        "[1.5, 1]",
        "null",
        "Reference [2]",
        "references 1 and 9",
        "Answer:",
        "<ref>",
    ],
    "acesearcher": [
        "### Q1:",
        "### Q2:",
        "### Q",
        "### Q2: after #",
        ": ",
        "#1",
        "#2",
        "#99",
        "Q1.",
        "1.",
        "2)",
        "**",
        "Decomposed Question:",
        "<answer>",
        "</answer>",
        "answer is",
        "Yes",
        "No",
        "not supported",
    ],
    "acesearcher_doc": [
        "### Q1:",
        "### Q2:",
        "```python\n",
        "```py\n",
        "```\n",
        "```",
        "ans = ",
        "ans = 1\n",
        "result = 2\n",
        "def solution():\n    return 3\n",
        "\\boxed{",
        "\\fbox{",
        "}",
        "{",
        "\\frac{1}{",
        "\\text{",
        "<answer>",
        "</answer>",
    ],
}
COMMON = [
    "\n",
    "\n\n",
    " ",
    "\t",
    "<",
    ">",
    "</",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "\ud800",
    "\udfff",
    "é",
    "\u2028",
    "\x00",
    "Warsaw",
    "Paris",
    "{",
    "[",
    "]",
    ",",
]


def replies(agent: str) -> st.SearchStrategy[str]:
    vocabulary = VOCABULARY[agent] + COMMON
    # short numbers, and runs past Python's 4,300-digit int-string limit (hypothesis favours small integers)
    digits = st.one_of(st.integers(1, 20), st.integers(4_300, 6_000)).map(lambda k: "9" * k)
    fragment = st.one_of(
        st.sampled_from(vocabulary),
        st.text(max_size=12),  # any code point but surrogates (those come from the vocabulary)
        digits,
        st.tuples(st.sampled_from(vocabulary), digits).map("".join),  # "### Q2: after #999..."
        st.integers(0, 30).map(lambda k: "#" * k),
    )
    line = st.lists(fragment, max_size=8).map("".join)
    soup = st.lists(line, max_size=8).map("\n".join)  # lines, so that line-start marks ("### Q1:") occur
    # 20k-character replies: random soup around one fragment repeated ("<answer>" + 20k spaces, "[9,9,9...")
    repeated = st.tuples(st.one_of(st.sampled_from(vocabulary), soup.filter(bool)), st.integers(5_000, 20_000)).map(
        lambda pair: (pair[0] * (pair[1] // len(pair[0]) + 1))[: pair[1]]
    )
    big = st.tuples(soup, repeated, soup).map("".join)
    return st.one_of(soup, soup, big)


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
CORPUS = passages("Marie Curie was born in Warsaw.", "Paris is in France.", "Curie studied radium.")


def _run(
    method: str, respond: Callable[[str], str], config: Any, example: Example | None = None
) -> tuple[Trace, float]:
    """One example through the runner; the trace and its time minus the sandbox's own (a program run is a
    subprocess: its time is bounded by the sandbox's timeout, not by the parser)."""
    llm = ScriptedLLM(respond)
    ctx = Context(llm=llm, retriever=ListRetriever(CORPUS), config=config)
    example = example or Example(id="f", question="Where was Curie born?", answers=["Warsaw"])
    started = time.perf_counter()
    trace = run(method, [example], ctx, progress=False)[0]
    seconds = time.perf_counter() - started - sum(s.seconds for s in trace.steps if s.kind == "execute")
    assert trace.error is None, trace.meta.get("traceback")
    json.dumps(trace.to_dict())  # every value in the trace can be written
    return trace, seconds


def _one_line(text: str) -> bool:
    return len([line for line in text.splitlines() if line.strip()]) == 1


@FUZZ
@given(reply=replies("naive_rag"))
def test_fuzz_naive_rag(reply: str) -> None:
    trace, seconds = _run("naive_rag", lambda _p: reply, NaiveRAGConfig(k=3))
    assert seconds < 1.0
    step = trace.steps[-1]
    if step.fallback is None:  # well-formed: one non-empty line, which is the answer
        assert _one_line(reply) and trace.answer == reply.strip()


@FUZZ
@given(reply=replies("arena"))
def test_fuzz_arena(reply: str) -> None:
    example = Example(id="f", question="Where?", answers=["Warsaw"], context=list(CORPUS), supporting_ids=["p1"])
    trace, seconds = _run("arena", lambda _p: reply, ArenaConfig(), example)
    assert seconds < 1.0
    step = trace.steps[-1]
    if step.fallback is None:  # well-formed: the official format and only existing references
        assert arena_format_ok(reply) and all(1 <= n <= len(CORPUS) for n in trace.meta["relevance"])
    started = time.perf_counter()
    arena_reward(reply, ["Warsaw"], [1])
    assert time.perf_counter() - started < 1.0


def _hash_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip().replace("**", "").strip().startswith("#"))


def _reference_answer(text: str) -> str:
    """The released code's extraction (research/acesearcher.md §1.2 step 5), as a test oracle."""
    if "<answer>" in text and "</answer>" in text:
        return text.split("<answer>")[-1].split("</answer>")[0].strip()
    return ""


@FUZZ
@given(decomposition=replies("acesearcher"), subanswer=replies("acesearcher"), final=replies("acesearcher"))
def test_fuzz_acesearcher(decomposition: str, subanswer: str, final: str) -> None:
    def respond(prompt: str) -> str:
        if "break down the" in prompt:
            return decomposition
        return final if "subquestions and their answers" in prompt else subanswer

    trace, seconds = _run("acesearcher", respond, AceSearcherConfig(k=3))
    assert seconds < 1.0
    for step in trace.steps:
        if step.fallback is not None:
            continue
        if step.kind == "decompose":  # every sub-question came from a "###" line
            assert 1 <= len(step.parsed) <= _hash_lines(decomposition)
        elif step.kind == "subanswer":
            assert _one_line(subanswer) and step.parsed
        elif step.kind == "answer":  # the reference's own reading, non-empty
            assert step.parsed and step.parsed == _reference_answer(final.strip())


@FUZZ
@given(
    decomposition=replies("acesearcher_doc"),
    answer=replies("acesearcher_doc"),
    reasoning=st.sampled_from(["pot", "cot"]),
)
def test_fuzz_acesearcher_doc(decomposition: str, answer: str, reasoning: str) -> None:
    def respond(prompt: str) -> str:
        return decomposition if "Please break down the question" in prompt else answer

    document = [Passage("t", "Table", "| year | revenue |\n| 2019 | 5 |", meta={"type": "table"})]
    example = Example(id="f", question="What was the revenue?", answers=["5"], context=document, kind="math")
    config = AceSearcherDocConfig(reasoning=reasoning, timeout_s=2.0)  # type: ignore[arg-type]
    trace, seconds = _run("acesearcher_doc", respond, config, example)
    assert seconds < 1.0
    for step in trace.steps:
        if step.fallback is not None:
            continue
        if step.kind == "decompose":
            assert 1 <= len(step.parsed) <= _hash_lines(decomposition)
        elif step.kind == "program":  # a fenced block of the model's own
            assert re.search(r"```[ \t]*(?:python3?|py)", answer, re.IGNORECASE) and step.parsed.strip()
        elif step.kind == "answer":
            assert "\\boxed" in answer or "\\fbox" in answer
