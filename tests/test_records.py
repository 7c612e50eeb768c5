"""Records survive a JSON round trip unchanged, whatever they hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sleuth.records import Example, Passage, Step, Trace

text = st.text(max_size=40)
json_scalar = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | text
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
passages = st.builds(
    Passage,
    id=text,
    title=text,
    text=text,
    score=st.none() | st.floats(allow_nan=False),
    meta=st.dictionaries(text, json_value, max_size=2),
)
examples = st.builds(
    Example,
    id=text,
    question=text,
    answers=st.lists(text, max_size=3),
    kind=st.sampled_from(["qa", "claim", "mcq", "math"]),
    context=st.lists(passages, max_size=3),
    supporting_ids=st.lists(text, max_size=3),
    decomposition=st.none() | st.lists(st.dictionaries(text, json_value, max_size=3), max_size=3),
    metadata=st.dictionaries(text, json_value, max_size=3),
)
steps = st.builds(
    Step,
    kind=text,
    messages=st.none() | st.lists(st.fixed_dictionaries({"role": text, "content": text}), max_size=2),
    prompt=st.none() | text,
    output=st.none() | text,
    parsed=json_value,
    query=st.none() | text,
    passages=st.lists(passages, max_size=2),
    prompt_tokens=st.integers(0, 10**6),
    completion_tokens=st.integers(0, 10**6),
    seconds=st.floats(0, 1e6),
    fallback=st.none() | text,
    error=st.none() | text,
    meta=st.dictionaries(text, json_value, max_size=2),
)
traces = st.builds(
    Trace,
    example=examples,
    method=text,
    steps=st.lists(steps, max_size=4),
    answer=st.none() | text,
    error=st.none() | text,
    seconds=st.floats(0, 1e6),
    started_at=st.floats(0, 2e9),
    meta=st.dictionaries(text, json_value, max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(traces)
def test_trace_json_round_trip_is_lossless(trace: Trace) -> None:
    line = trace.to_json()
    assert "\n" not in line  # one trace per jsonl line
    assert Trace.from_json(line) == trace


def test_passage_contents_is_search_r1_form() -> None:
    p = Passage(id="1", title="Paris", text="Capital of France.")
    assert p.contents == '"Paris"\nCapital of France.'


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown field"):
        Passage.from_dict({"id": "1", "title": "", "text": "", "colour": "red"})


def test_trace_totals() -> None:
    trace = Trace(example=Example(id="e", question="q"), method="m")
    trace.add(Step(kind="search", query="q"))
    trace.add(Step(kind="answer", messages=[{"role": "user", "content": "q"}], prompt_tokens=10, completion_tokens=3))
    trace.add(Step(kind="parse", fallback="first_line"))
    assert trace.llm_calls == 1 and trace.prompt_tokens == 10 and trace.completion_tokens == 3
    assert trace.fallbacks == ["first_line"]
    assert json.loads(trace.to_json())["steps"][0]["kind"] == "search"
