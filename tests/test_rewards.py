"""Reward functions: ARENA's format / accuracy / relevance / bonus (single and TRL batch forms), s3's GenAcc, Gain
Beyond RAG, the on-disk naive-RAG baseline cache and the training-data filter, with a scripted frozen generator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sleuth.agents import Context
from sleuth.agents.arena import ArenaConfig
from sleuth.agents.s3 import S3Config
from sleuth.eval.metrics import JudgeCache
from sleuth.records import Example, Passage, Step, Trace
from sleuth.runner import run
from sleuth.train.rewards import (
    Judge,
    NaiveRagCache,
    arena_accuracy_reward,
    arena_format_reward,
    arena_judge_accuracy,
    arena_judge_score,
    arena_relevance_reward,
    arena_relevant_ids,
    arena_reward,
    filter_training_examples,
    gain_beyond_rag,
    generation_accuracy,
    precompute_naive_rag,
    s3_reward,
)
from tests.scripted import ListRetriever, ScriptedLLM, passages


def arena_text(relevance: str = "[1, 3]", answer: str = "Warsaw", analysis: str = "Reference [1] says so.") -> str:
    sections = f"<relevance>\n{relevance}\n</relevance>\n\n<analysis>\n{analysis}\n</analysis>\n\n"
    return sections + f"<answer>\n{answer}\n</answer>"


GOOD = arena_text()

# ------------------------------------------------------------------------------------------------------ ARENA


def test_format_reward_is_the_strict_official_check() -> None:
    assert arena_format_reward(GOOD) == 1.0
    assert arena_format_reward(GOOD + "\n") == 1.0
    assert arena_format_reward(GOOD + "\nanything after a newline") == 1.0  # MULTILINE "$" (arena.md §2.3)
    assert arena_format_reward(GOOD + " trailing") == 0.0
    assert arena_format_reward(" " + GOOD) == 0.0  # must start exactly with <relevance>
    assert arena_format_reward("Sure! " + GOOD) == 0.0
    assert arena_format_reward(arena_text(analysis="a < b")) == 0.0  # no "<" inside a section
    missing = "<relevance>[1]</relevance>\n<answer>Warsaw</answer>"
    assert arena_format_reward(missing) == 0.0
    swapped = "<analysis>x</analysis><relevance>[1]</relevance><answer>Warsaw</answer>"
    assert arena_format_reward(swapped) == 0.0


def test_accuracy_is_em_of_the_answer_tag_with_arena_normalisation() -> None:
    assert arena_accuracy_reward(GOOD, ["warsaw"]) == 1.0
    assert arena_accuracy_reward(GOOD, ["Kraków", "Warsaw, Poland"]) == 0.0
    # ARENA turns punctuation into spaces and then drops the article "a": "U.S.A." -> "u s a" -> "u s",
    # which equals "U.S." -> "u s"; SQuAD-style deletion would give "usa" vs "us".
    assert arena_accuracy_reward(arena_text(answer="U.S.A."), ["U.S."]) == 1.0
    # The answer is read from the first <answer> pair even when the format fails; no tag means "".
    assert arena_accuracy_reward(" " + GOOD, ["Warsaw"]) == 1.0
    assert arena_accuracy_reward("Warsaw", ["Warsaw"]) == 0.0
    # F1: "the big red fox" -> [big, red, fox] vs [red, fox, jumps]: 2 common, P = R = 2/3, F1 = 2/3.
    assert arena_accuracy_reward(arena_text(answer="the big red fox"), ["red fox jumps"], "f1") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="arena_judge_accuracy"):
        arena_accuracy_reward(GOOD, ["Warsaw"], "judge")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("relevance", "expected"),
    [
        ("[1, 3]", 1.0),  # exact
        ("[3,1,1]", 1.0),  # set semantics
        ("[1.0, 3.0]", 1.0),  # JSON numbers
        ("[1, 3, 5]", 0.5),  # superset overlaps
        ("[1]", 0.5),  # subset overlaps
        ("[2]", 0.0),  # disjoint
        ("[]", 0.0),  # empty selection
        ("1, 3", 0.0),  # not a JSON list
        ('["1", "3"]', 0.0),  # strings never equal numbers
        ("3", 0.0),  # a bare number is not a list
    ],
)
def test_relevance_exact_overlap_disjoint(relevance: str, expected: float) -> None:
    assert arena_relevance_reward(arena_text(relevance=relevance), {1, 3}) == expected


@pytest.mark.parametrize(
    ("relevance", "gold", "expected"),
    [
        ("[1.5, 1]", {1}, 0.5),  # 1.5 stays in the set: {1, 1.5} != {1}, overlap {1}
        ("[true]", {1}, 1.0),  # a JSON true is Python's True, and True == 1
        ("[true, 1]", {1}, 1.0),  # {True, 1} is one element
        ("[false]", {1}, 0.0),  # False == 0: no reference 0
        ("[1, 2.0, true]", {1, 2}, 1.0),
        ("[3.5]", {3}, 0.0),  # 3.5 overlaps nothing
        ("[1, null]", {1}, 0.0),  # sorted() cannot order None and 1: the reference's except scores 0
        ('[1, "a"]', {1}, 0.0),  # int vs str: unorderable, 0 (not 0.5)
        ("[]", set(), 1.0),  # no supporting reference: the empty selection equals it, as in the reference
        ("[1]", set(), 0.0),
        ("[[1]]", {1}, 0.0),  # a list element is unhashable
        ("null", {1}, 0.0),
        ('"1"', {1}, 0.0),  # a JSON string iterates as characters, which never equal ints
        ('{"1": 1}', {1}, 0.0),  # an object iterates as its (string) keys
        ("[" + "9" * 5000 + "]", {1}, 0.0),  # past Python's int-string limit: unreadable, no crash
        ("[" * 100_000, {1}, 0.0),  # nesting past the recursion limit: unreadable, no crash
        ("[1e400, 1]", {1}, 0.5),  # JSON's 1e400 is inf: an extra element
    ],
)
def test_relevance_follows_the_reference_set_semantics(relevance: str, gold: set[int], expected: float) -> None:
    """Issue 21 item 2: the reference code takes ``set(json.loads(section))`` with the elements as they are."""
    assert arena_relevance_reward(arena_text(relevance=relevance), gold) == expected


def test_reference_totals_for_a_non_integral_id_and_a_json_true() -> None:
    """Issue 21 item 2, the issue's own inputs: format and answer right, gold [1]."""
    fractional = arena_reward(arena_text(relevance="[1.5, 1]"), ["Warsaw"], [1])
    assert fractional == {"format": 1.0, "accuracy": 1.0, "relevance": 0.5, "bonus": 0.0, "total": 2.5}
    true = arena_reward(arena_text(relevance="[true]"), ["Warsaw"], [1])
    assert true == {"format": 1.0, "accuracy": 1.0, "relevance": 1.0, "bonus": 10.0, "total": 13.0}


def test_relevance_needs_a_ground_truth_and_a_section() -> None:
    assert arena_relevance_reward(GOOD, set()) == 0.0
    assert arena_relevance_reward("<answer>Warsaw</answer>", {1}) == 0.0


def test_total_and_bonus_only_when_all_three_are_full() -> None:
    full = arena_reward(GOOD, ["Warsaw"], {1, 3})
    assert full == {"format": 1.0, "accuracy": 1.0, "relevance": 1.0, "bonus": 10.0, "total": 13.0}
    # superset relevance: 1 + 1 + 0.5, no bonus
    assert arena_reward(arena_text(relevance="[1,3,5]"), ["Warsaw"], {1, 3})["total"] == 2.5
    # wrong answer: 1 + 0 + 1, no bonus
    assert arena_reward(GOOD, ["Paris"], {1, 3})["total"] == 2.0
    # malformed (leading space) still earns accuracy and relevance: 0 + 1 + 1, never the bonus
    malformed = arena_reward(" " + GOOD, ["Warsaw"], {1, 3})
    assert (malformed["format"], malformed["bonus"], malformed["total"]) == (0.0, 0.0, 2.0)
    assert arena_reward(GOOD, ["Warsaw"], {1, 3}, bonus=5.0)["total"] == 8.0
    # F1 of 2/3 is not a full accuracy: 1 + 2/3 + 1, no bonus
    partial = arena_reward(arena_text(answer="the big red fox"), ["red fox jumps"], {1, 3}, accuracy="f1")
    assert (partial["bonus"], partial["total"]) == (0.0, pytest.approx(2 + 2 / 3))
    assert arena_reward(GOOD, ["Warsaw"], {1, 3}, accuracy="f1")["total"] == 13.0


def test_relevant_ids_are_the_agents_reference_numbers() -> None:
    context = passages("Curie studied radium.", "Paris is big.", "Curie was born in Warsaw.", "Oslo.")
    example = Example(id="e", question="Where was Curie born?", answers=["Warsaw"], context=context)
    example.supporting_ids = ["p3", "p1"]
    assert arena_relevant_ids(example) == {1, 3}
    assert arena_relevant_ids(example, max_references=2) == {1}
    assert arena_relevant_ids(Example(id="x", question="q", supporting_ids=["p1"])) == set()

    # The agent numbers the same references the same way: its citations of [1, 3] are the supporting passages.
    llm = ScriptedLLM(lambda _p: GOOD)
    trace = run("arena", [example], Context(llm=llm, config=ArenaConfig()), progress=False)[0]
    assert trace.meta["cited_ids"] == ["p1", "p3"]
    assert {i for i, pid in enumerate(trace.meta["reference_ids"], 1) if pid in {"p1", "p3"}} == {1, 3}
    assert arena_reward(trace.steps[-1].output or "", example.answers, arena_relevant_ids(example))["total"] == 13.0


def test_arena_judge_parse_and_reward() -> None:
    assert [arena_judge_score(r) for r in ["Yes.", "no", "No, yes", "I guess yes", "not sure", "hmm"]] == [
        1.0,
        0.0,
        0.0,  # starts with "no"
        1.0,  # contains "yes"
        0.0,  # contains "no" ("not")
        0.5,
    ]
    judge_llm = ScriptedLLM(lambda prompt: "yes" if "Warsaw" in prompt else "maybe")
    cache = JudgeCache()
    assert asyncio.run(arena_judge_accuracy(GOOD, ["Warszawa"], Judge(judge_llm, cache))) == 1.0
    assert asyncio.run(arena_judge_accuracy(arena_text(answer="Krakow"), ["Warszawa"], Judge(judge_llm, cache))) == 0.5
    assert asyncio.run(arena_judge_accuracy(GOOD, ["Warszawa"], Judge(judge_llm, cache))) == 1.0  # cached
    assert asyncio.run(arena_judge_accuracy("no answer tag", ["Warszawa"], judge_llm)) == 0.0  # no call
    assert len(judge_llm.prompts) == 2
    assert judge_llm.prompts[0].startswith("system: You are an intelligent AI assistant.")  # ARENA's LJ prompt
    assert "['Warszawa']" in judge_llm.prompts[0]


# ------------------------------------------------------------------------------------------------------ s3


def test_gain_beyond_rag_paper_and_code() -> None:
    # paper: acc_s3 - acc_naive; code: (acc_s3 - acc_naive) + acc_s3
    cases = [(1.0, 0.0, 1.0, 2.0), (0.0, 0.0, 0.0, 0.0), (1.0, 1.0, 0.0, 1.0), (0.0, 1.0, -1.0, -1.0)]
    for acc_s3, acc_naive, paper, code in cases:
        assert gain_beyond_rag(acc_s3, acc_naive) == paper
        assert gain_beyond_rag(acc_s3, acc_naive, variant="code") == code
    with pytest.raises(ValueError):
        gain_beyond_rag(1.0, 0.0, variant="other")  # type: ignore[arg-type]


def test_generation_accuracy_span_then_judge() -> None:
    judge = ScriptedLLM(lambda _p: "Yes")
    assert asyncio.run(generation_accuracy("She was born in Warsaw, Poland.", ["Warsaw"], judge)) == 1.0
    assert judge.prompts == []  # span_check matched: no judge call
    # token spans, not substrings: "Warsawian" does not contain the token "warsaw"
    assert asyncio.run(generation_accuracy("Warsawian", ["Warsaw"])) == 0.0
    assert asyncio.run(generation_accuracy("twenty-five", ["25"], judge)) == 1.0  # rescued by the judge
    assert len(judge.prompts) == 1 and "Golden answers: ['25']" in judge.prompts[0]
    assert asyncio.run(generation_accuracy("twenty-five", ["25"], judge, metric="span")) == 0.0
    assert asyncio.run(generation_accuracy("Warsaw", ["Warsaw"], Judge(ScriptedLLM(["no"])), metric="judge")) == 0.0
    assert asyncio.run(generation_accuracy("Warsaw.", ["warsaw"], metric="em")) == 1.0
    assert asyncio.run(generation_accuracy("in Warsaw", ["warsaw"], metric="em")) == 0.0
    with pytest.raises(ValueError, match="needs a judge"):
        asyncio.run(generation_accuracy("x", ["y"], metric="judge"))


def _example(i: str = "q1", answers: list[str] | None = None) -> Example:
    return Example(id=i, question=f"question {i}", answers=answers or ["Warsaw"])


def test_naive_cache_computes_once_and_survives_a_new_object(tmp_path: Path) -> None:
    path = tmp_path / "naive.jsonl"
    calls: list[str] = []

    async def compute(example: Example) -> tuple[float, str]:
        calls.append(example.id)
        return 1.0, "Warsaw"

    cache = NaiveRagCache(path, generator="scripted", settings={"k": 3})
    assert asyncio.run(cache.get_or_compute(_example(), compute)) == (1.0, False)
    assert asyncio.run(cache.get_or_compute(_example(), compute)) == (1.0, True)
    assert (cache.hits, cache.misses, calls) == (1, 1, ["q1"])
    row = json.loads(path.read_text().splitlines()[0])
    assert row == {
        "fingerprint": cache.fingerprint,
        "id": "q1",
        "acc": 1.0,
        "answer": "Warsaw",
        "question": "question q1",
    }

    reopened = NaiveRagCache(path, generator="scripted", settings={"k": 3})
    assert reopened.get("q1") == 1.0 and "q1" in reopened and len(reopened) == 1
    assert asyncio.run(reopened.get_or_compute(_example(), compute)) == (1.0, True)
    assert (reopened.hits, reopened.misses, calls) == (1, 0, ["q1"])


def test_naive_cache_other_generator_or_settings_miss(tmp_path: Path) -> None:
    path = tmp_path / "naive.jsonl"
    NaiveRagCache(path, generator="gen-a", settings={"k": 3}).put("q1", 1.0)
    other_generator = NaiveRagCache(path, generator="gen-b", settings={"k": 3})
    other_k = NaiveRagCache(path, generator="gen-a", settings={"k": 5})
    assert other_generator.get("q1") is None and other_k.get("q1") is None
    assert other_generator.fingerprint != other_k.fingerprint

    async def zero(_e: Example) -> float:
        return 0.0

    assert asyncio.run(other_generator.get_or_compute(_example(), zero)) == (0.0, False)
    # both fingerprints now live in the same file, each reading its own row
    assert NaiveRagCache(path, generator="gen-a", settings={"k": 3}).get("q1") == 1.0
    assert NaiveRagCache(path, generator="gen-b", settings={"k": 3}).get("q1") == 0.0

    spec_a, spec_b = ScriptedLLM(["x"]), ScriptedLLM(["x"])
    spec_b.spec = "scripted-b"
    assert NaiveRagCache.for_s3(None, spec_a).fingerprint != NaiveRagCache.for_s3(None, spec_b).fingerprint
    assert (
        NaiveRagCache.for_s3(None, spec_a, S3Config(generator_prompt="code_chat")).fingerprint
        != NaiveRagCache.for_s3(None, spec_a).fingerprint
    )


def test_naive_cache_tolerates_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "naive.jsonl"
    cache = NaiveRagCache(path, generator="g")
    cache.put("q1", 1.0)
    with path.open("a") as f:
        f.write('{"fingerprint": "' + cache.fingerprint + '", "id": "q2", "ac')  # killed mid-write
    reopened = NaiveRagCache(path, generator="g")
    assert reopened.scores() == {"q1": 1.0} and reopened.skipped_lines == 1
    reopened.put("q3", 0.0)  # starts a fresh line instead of extending the torn one
    assert NaiveRagCache(path, generator="g").scores() == {"q1": 1.0, "q3": 0.0}


def test_naive_cache_concurrent_requests_compute_once() -> None:
    calls: list[str] = []

    async def compute(example: Example) -> float:
        calls.append(example.id)
        await asyncio.sleep(0.01)
        return 0.0

    cache = NaiveRagCache(None, generator="g")

    async def group() -> list[tuple[float, bool]]:
        return list(await asyncio.gather(*(cache.get_or_compute(_example(), compute) for _ in range(4))))

    results = asyncio.run(group())
    assert calls == ["q1"] and (cache.hits, cache.misses) == (3, 1)
    assert sorted(results) == [(0.0, False), (0.0, True), (0.0, True), (0.0, True)]


# s3 traces: naive top-3 holds a misleading passage; the searcher kept only the right one.
RIGHT = Passage(id="d1", title="Curie", text="Marie Curie was born in Warsaw.")
MISLEADING = Passage(id="d2", title="Rumour", text="Misleading: Curie was born in Paris.")
OTHER = Passage(id="d3", title="France", text="Paris is in France.")


def generator_reply(prompt: str) -> str:
    return "Paris" if "Misleading" in prompt else "Warsaw"


def s3_trace(example_id: str = "q1") -> Trace:
    example = Example(id=example_id, question="Where was Curie born", answers=["Warsaw"])
    trace = Trace(example=example, method="s3")
    trace.meta["naive_rag_passages"] = [
        {"id": p.id, "title": p.title, "text": p.text} for p in (RIGHT, MISLEADING, OTHER)
    ]
    trace.meta["selected_passages"] = [{"id": RIGHT.id, "title": RIGHT.title, "text": RIGHT.text}]
    trace.meta["generator_question"] = "Where was Curie born?"
    return trace


def test_s3_reward_runs_the_generator_and_reuses_the_cached_baseline(tmp_path: Path) -> None:
    generator = ScriptedLLM(generator_reply)
    cache = NaiveRagCache.for_s3(tmp_path / "naive.jsonl", generator)
    first = asyncio.run(s3_reward(s3_trace(), generator, cache))
    # acc_s3 = 1 (only the Warsaw passage), acc_naive = 0 (the misleading top-3): GBR = 1 - 0
    assert first == {"reward": 1.0, "acc_s3": 1.0, "acc_naive": 0.0, "cached": False}
    assert len(generator.prompts) == 2
    s3_prompt = next(p for p in generator.prompts if "Misleading" not in p)
    # the paper's generator prompt (Fig. 12) with the served documents
    assert s3_prompt == (
        "user: Use the following contexts (some might be irrelevant) on demand:\n"
        "Contexts: Doc 1 (Title: Curie)\nMarie Curie was born in Warsaw.\n"
        "Question: Where was Curie born?\n"
        "Important: You MUST directly answer the question without any other text."
    )

    second = asyncio.run(s3_reward(s3_trace(), generator, cache, variant="code"))
    assert second == {"reward": 2.0, "acc_s3": 1.0, "acc_naive": 0.0, "cached": True}  # 2*1 - 0
    assert len(generator.prompts) == 3 and "Misleading" not in generator.prompts[2]  # no naive call
    assert (cache.hits, cache.misses) == (1, 1)

    # a new cache object on the same file: still no naive call
    reopened = NaiveRagCache.for_s3(tmp_path / "naive.jsonl", generator)
    assert asyncio.run(s3_reward(s3_trace(), generator, reopened))["cached"] is True
    assert sum("Misleading" in p for p in generator.prompts) == 1

    # another generator: a different fingerprint, so the baseline is computed again
    other = ScriptedLLM(lambda _p: "Warsaw")
    other.spec = "scripted-other"
    other_cache = NaiveRagCache.for_s3(tmp_path / "naive.jsonl", other)
    result = asyncio.run(s3_reward(s3_trace(), other, other_cache))
    assert result == {"reward": 0.0, "acc_s3": 1.0, "acc_naive": 1.0, "cached": False}
    assert len(other.prompts) == 2


def test_s3_reward_falls_back_to_the_judge_for_the_answer_and_the_naive_baseline() -> None:
    """The reference's check_answer_correct: span match, else the LLM judge, for the s3 answer and for the cached
    naive-RAG score alike. Neither "twenty-five" (s3) nor "XXV" (naive) contains the gold "25"."""
    generator = ScriptedLLM(lambda prompt: "XXV" if "Misleading" in prompt else "twenty-five")
    trace = s3_trace()
    trace.example.answers = ["25"]
    judge = ScriptedLLM(lambda prompt: "Yes" if "twenty-five" in prompt or "XXV" in prompt else "No")
    result = asyncio.run(s3_reward(trace, generator, NaiveRagCache.for_s3(None, generator), judge=judge))
    assert (result["acc_s3"], result["acc_naive"], result["reward"]) == (1.0, 1.0, 0.0)
    assert len(judge.prompts) == 2
    assert sum("twenty-five" in p for p in judge.prompts) == 1 and sum("XXV" in p for p in judge.prompts) == 1
    # span match only (S3RLConfig's CPU default, judge ""): both are wrong
    plain = asyncio.run(s3_reward(trace, generator, NaiveRagCache.for_s3(None, generator)))
    assert (plain["acc_s3"], plain["acc_naive"]) == (0.0, 0.0)


def test_s3_reward_refuses_a_cache_of_another_generator() -> None:
    generator = ScriptedLLM(generator_reply)
    with pytest.raises(ValueError, match="stale"):
        asyncio.run(s3_reward(s3_trace(), generator, NaiveRagCache(None, generator="someone-else")))


def test_s3_reward_uses_the_traces_own_generator_answer() -> None:
    generator = ScriptedLLM(generator_reply)
    trace = s3_trace()
    trace.add(Step(kind="answer", output="Paris", meta={"role": "generator", "model": "scripted"}))
    result = asyncio.run(s3_reward(trace, generator, NaiveRagCache.for_s3(None, generator)))
    # the recorded answer (Paris) is used, not a new call on the Warsaw passage: 0 - 0
    assert (result["acc_s3"], result["reward"]) == (0.0, 0.0)
    assert len(generator.prompts) == 1 and "Misleading" in generator.prompts[0]
    # with reuse off, or when another model answered, the generator is asked again
    again = asyncio.run(s3_reward(trace, generator, NaiveRagCache.for_s3(None, generator), reuse_answer=False))
    assert again["acc_s3"] == 1.0
    trace.steps[-1].meta["model"] = "the-policy"
    assert asyncio.run(s3_reward(trace, generator, NaiveRagCache.for_s3(None, generator)))["acc_s3"] == 1.0
    # an empty served context is wrong without a call
    empty = s3_trace("q2")
    empty.meta["selected_passages"] = []
    before = len(generator.prompts)
    assert asyncio.run(s3_reward(empty, generator, NaiveRagCache.for_s3(None, generator)))["acc_s3"] == 0.0
    assert len(generator.prompts) == before + 1  # the naive call only


def test_s3_reward_on_an_s3_agent_trace() -> None:
    question = "Where was Curie born?"
    searcher = ScriptedLLM(["<important_info>[1]</important_info>\n<search_complete>True</search_complete>"])
    generator = ScriptedLLM(generator_reply)
    retriever = ListRetriever(lambda _q: [RIGHT, MISLEADING, OTHER])
    ctx = Context(llm=searcher, retriever=retriever, config=S3Config(), roles={"generator": generator})
    example = Example(id="q1", question=question, answers=["Warsaw"])
    trace = run("s3", [example], ctx, progress=False)[0]
    assert trace.error is None and trace.answer == "Warsaw" and len(generator.prompts) == 1

    cache = NaiveRagCache.for_s3(None, generator, S3Config(), retriever="list")
    result = asyncio.run(s3_reward(trace, generator, cache))
    assert result == {"reward": 1.0, "acc_s3": 1.0, "acc_naive": 0.0, "cached": False}
    assert len(generator.prompts) == 2 and "Misleading" in generator.prompts[1]  # only the naive call was added
    assert asyncio.run(s3_reward(trace, generator, cache))["cached"] is True
    assert len(generator.prompts) == 2


def test_filter_counts_every_dropped_example_by_reason() -> None:
    examples = [
        _example("e1", ["yes"]),
        _example("e2", ["True"]),
        _example("e3", ["NO", "nope"]),
        _example("e4", ["Paris"]),
        _example("e5", ["Rome"]),
        _example("e6", ["Oslo"]),
        Example(id="e7", question="q", answers=[" "]),
        _example("e8", ["Yes Minister"]),  # a title, not a yes/no answer
    ]
    naive = {"e1": 0.0, "e4": 1.0, "e5": 0.0, "e8": 0.0}
    kept, dropped = filter_training_examples(examples, naive)
    assert [e.id for e in kept] == ["e5", "e8"]
    assert dropped == {"yes_no_answer": 3, "naive_rag_correct": 1, "no_naive_acc": 1, "no_answer": 1}
    assert len(kept) + sum(dropped.values()) == len(examples)


def test_precompute_fills_the_cache_once_then_filters() -> None:
    wiki = {"question a": [RIGHT, OTHER, MISLEADING, OTHER], "question b": [MISLEADING, RIGHT, OTHER]}
    retriever = ListRetriever(lambda q: wiki[q])
    generator = ScriptedLLM(generator_reply)
    cache = NaiveRagCache.for_s3(None, generator, retriever="list")
    examples = [_example("a"), _example("b")]
    scores = asyncio.run(precompute_naive_rag(examples, retriever, generator, cache))
    # a: top-3 includes the misleading passage (3rd) -> "Paris" -> 0; b: also -> 0. With k_initial=2, a is right.
    assert scores == {"a": 0.0, "b": 0.0}
    assert retriever.queries == ["question a", "question b"]
    assert asyncio.run(precompute_naive_rag(examples, retriever, generator, cache)) == scores
    assert len(generator.prompts) == 2  # the second pass was served from the cache

    config = S3Config(k_initial=2)
    cache_k2 = NaiveRagCache.for_s3(None, generator, config, retriever="list")
    assert asyncio.run(precompute_naive_rag(examples, retriever, generator, cache_k2, config)) == {"a": 1.0, "b": 0.0}
    kept, dropped = filter_training_examples(examples, cache_k2.scores())
    assert [e.id for e in kept] == ["b"] and dropped == {"naive_rag_correct": 1}
