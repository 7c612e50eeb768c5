"""The runner drives many agents at once: fewer model calls than requests, failures kept per example."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.agents import Context, format_passages, get_agent, load_prompt
from sleuth.agents.baselines import NaiveRAGConfig, short_answer
from sleuth.llm.hf import HFLLM
from sleuth.records import Example, Passage
from sleuth.retrieval.bm25 import BM25Retriever, build_bm25_index
from sleuth.runner import run
from tests.test_bm25 import write_corpus


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> HFLLM:
    return HFLLM(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> BM25Retriever:
    root = tmp_path_factory.mktemp("runner-index")
    build_bm25_index(write_corpus(root / "corpus.jsonl", n_filler=50), root / "idx")
    return BM25Retriever(root / "idx")


def examples(n: int) -> list[Example]:
    topics = ["radioactivity", "the Eiffel Tower", "photosynthesis", "Mount Everest", "Python"]
    return [Example(id=f"q{i}", question=f"What is known about {topics[i % 5]}?", answers=["x"]) for i in range(n)]


def test_batched_run_issues_fewer_calls(llm: HFLLM, retriever: BM25Retriever) -> None:
    ctx = Context(llm=llm, retriever=retriever, config=NaiveRAGConfig(k=2))
    before_calls, before_requests = llm.stats.calls, llm.stats.requests
    traces = run("naive_rag", examples(16), ctx, progress=False)
    requests, calls = llm.stats.requests - before_requests, llm.stats.calls - before_calls
    assert requests == 16
    assert calls <= 8, f"{calls} model calls for 16 concurrent requests"
    assert retriever.batch_stats.calls < retriever.batch_stats.items
    assert [t.example.id for t in traces] == [f"q{i}" for i in range(16)]
    for trace in traces:
        assert trace.error is None
        assert [s.kind for s in trace.steps] == ["search", "answer"]
        assert trace.steps[0].query == trace.example.question and len(trace.steps[0].passages) == 2
        assert trace.steps[1].prompt_tokens > 0 and trace.answer == trace.steps[1].parsed
        assert trace.meta["retriever"] == retriever.spec


def test_batched_and_sequential_runs_agree(llm: HFLLM, retriever: BM25Retriever) -> None:
    ctx = Context(llm=llm, retriever=retriever, config=NaiveRAGConfig(k=2))
    batched = run("naive_rag", examples(6), ctx, progress=False)
    sequential = run("naive_rag", examples(6), ctx, progress=False, concurrency=1)
    assert [t.steps[1].output for t in batched] == [t.steps[1].output for t in sequential]


def test_failures_are_recorded_not_raised(llm: HFLLM) -> None:
    ctx = Context(llm=llm, retriever=None, config=NaiveRAGConfig())
    traces = run("naive_rag", examples(3), ctx, progress=False)
    assert len(traces) == 3
    assert all(t.error and "needs a retriever" in t.error and t.answer is None for t in traces)
    assert all("traceback" in t.meta for t in traces)


def test_direct_agent_uses_zero_shot_prompt(llm: HFLLM) -> None:
    trace = run("direct", examples(1), Context(llm=llm), progress=False)[0]
    assert trace.error is None and [s.kind for s in trace.steps] == ["answer"]
    system, user = trace.steps[0].messages
    assert system == {"role": "system", "content": load_prompt("direct_zero_shot")}
    assert user["content"] == trace.example.question


def test_naive_rag_prompt_is_the_papers(llm: HFLLM, retriever: BM25Retriever) -> None:
    trace = run("naive_rag", examples(1), Context(llm=llm, retriever=retriever), progress=False)[0]
    prompt = trace.steps[1].messages[-1]["content"]
    expected = load_prompt("direct_rag_qa").format(
        context=format_passages(trace.steps[0].passages), question=trace.example.question
    )
    assert prompt == expected and prompt.startswith("You have the following context passages:")
    claim = Example(id="c", question="Paris is in France.", kind="claim")
    trace = run("naive_rag", [claim], Context(llm=llm, retriever=retriever), progress=False)[0]
    assert "SUPPORTED or NOT_SUPPORTED" in trace.steps[1].messages[-1]["content"]


def test_short_answer_and_formats() -> None:
    assert short_answer("  Paris  ") == ("Paris", None)
    assert short_answer("Paris\nIt is the capital.") == ("Paris", "first_line")
    assert short_answer("") == ("", None)
    passages = [Passage(id="1", title="A", text="alpha"), Passage(id="2", title="", text="beta")]
    assert format_passages(passages) == "A\nalpha\n\nbeta"
    assert format_passages(passages, "text") == "alpha\n\nbeta"
    assert format_passages(passages, "numbered") == "Doc 1 (Title: A)\nalpha\n\nDoc 2 (Title: )\nbeta"
    with pytest.raises(KeyError, match="unknown method"):
        get_agent("nope")
