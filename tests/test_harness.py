"""The learning benchmarks' shared harness (benchmarks/harness.py): stages run once per settings key and resume,
a stage cached with other settings is refused, evaluations are cached by their key's hash, paired differences
and the trials list."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness import (  # noqa: E402
    HASH_RULE,
    Experiment,
    claims,
    content_hash,
    difference_table,
    key_hash,
    load_artifact,
    rollout_steps,
    save_artifact,
    stage_table,
    step_table,
    trials_table,
    with_claims_table,
)


def test_stage_runs_once_per_key_and_refuses_other_settings(tmp_path: Path) -> None:
    calls: list[int] = []

    def train() -> dict:
        calls.append(1)
        return {"model": "m", "steps": 3}

    exp = Experiment("t", tmp_path / "work", tmp_path / "results")
    assert exp.stage("sft", {"lr": 1e-4}, train)["steps"] == 3
    again = Experiment("t", tmp_path / "work", tmp_path / "results")
    assert again.stage("sft", {"lr": 1e-4}, train)["model"] == "m"
    assert len(calls) == 1  # the rerun read the cached stage
    with pytest.raises(SystemExit, match="other settings"):
        again.stage("sft", {"lr": 2e-4}, train)
    other = again.stage_dir("sft", {"lr": 2e-4})
    assert other != again.stage_dir("sft", {"lr": 1e-4}) and other.parent == tmp_path / "work"


def test_a_stage_that_ran_gives_its_memory_back_and_says_how_much(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results")
    exp.stage("sft", {"lr": 1e-4}, lambda: {"model": "m"})
    assert "[t] stage sft done: resident " in capsys.readouterr().out
    Experiment("t", tmp_path / "work", tmp_path / "results").stage("sft", {"lr": 1e-4}, lambda: {"model": "m"})
    assert "done: resident" not in capsys.readouterr().out  # a cached stage ran nothing


def test_a_killed_stage_resumes_only_with_its_own_settings(tmp_path: Path) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results")

    def killed() -> dict:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        exp.stage("mdpo", {"lr": 1}, killed)
    with pytest.raises(SystemExit, match="other settings"):  # its partial output belongs to lr 1
        exp.stage("mdpo", {"lr": 2}, lambda: {"done": True})
    assert exp.stage("mdpo", {"lr": 1}, lambda: {"done": True})["done"] is True
    assert not (tmp_path / "work" / "stages" / "mdpo.key.json").exists()


def test_evaluations_are_cached_by_key_and_get_cis(tmp_path: Path) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results", seed=0)
    calls: list[str] = []

    def run(values: list[float], tag: str):
        def inner() -> dict:
            calls.append(tag)
            return {"per_example": {"em": values}}

        return inner

    before = exp.evaluate("sft", "test", {"model": "a"}, run([0, 0, 1, 0] * 10, "a"))
    after = exp.evaluate("mdpo", "test", {"model": "b"}, run([1, 0, 1, 1] * 10, "b"))
    exp.evaluate("sft", "test", {"model": "a"}, run([0] * 40, "a-again"))  # cached: not called
    exp.evaluate("sft", "test", {"model": "a2"}, run([0] * 40, "a2"))  # another key: its own file
    assert calls == ["a", "b", "a2"]
    assert before["ci"]["em"]["mean"] == pytest.approx(0.25)
    assert len(list((tmp_path / "work" / "eval" / "test").glob("sft-*.json"))) == 2
    diffs = exp.differences({"sft": before, "mdpo": after}, [("mdpo", "sft")], ["em"])
    d = diffs["mdpo - sft"]["em"]
    assert d["mean"] == pytest.approx(0.5) and d["lo"] > 0
    assert "✓" in "\n".join(difference_table(diffs, ["em"]))
    rows = stage_table({"sft": before, "mdpo": after}, ["em"])
    assert rows[2].startswith("| sft | 40 | 25.0 [")


def test_trials_accumulate_and_list_what_varied(tmp_path: Path) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results")
    dev = {"sft": {"per_example": {"em": [1.0, 0.0]}, "ci": {"em": {"mean": 0.5, "lo": 0, "hi": 1}}}}
    exp.record_trial({"lr": 1, "k": 3}, dev, "em")
    exp.record_trial({"lr": 1, "k": 3}, dev, "em")  # the same settings again: one row
    trials = exp.record_trial({"lr": 2, "k": 3}, dev, "em")
    assert [t["settings"]["lr"] for t in trials] == [1, 2]
    assert json.loads((tmp_path / "results" / "trials.json").read_text()) == trials
    table = "\n".join(trials_table(trials))
    assert "| trial | lr | dev sft |" in table and "| k |" not in table
    assert trials[0]["id"] == key_hash({"lr": 1, "k": 3})


def test_arena_citation_chance_matches_random_citations_and_reads_a_perfect_reader() -> None:
    """learn_arena's citation_chance: a reader citing at random scores its own chance columns (Monte Carlo over
    2,000 episodes, the relevance reward computed by ARENA's reward function); one citing the gold set scores 1."""
    import random

    from learn_arena import citation_chance

    from sleuth.records import Example, Passage, Trace
    from sleuth.train.rewards import arena_relevance_reward
    from sleuth.train.rollouts import Rollout

    rng = random.Random(0)

    def episode(n: int, gold: list[int], cited: list[int]) -> Rollout:
        refs = [Passage(id=f"p{i}", title="", text="") for i in range(1, n + 1)]
        example = Example(id="q", question="?", context=refs, supporting_ids=[f"p{i}" for i in gold])
        completion = f"<relevance>\n{cited}\n</relevance>"
        meta = {"reference_ids": [r.id for r in refs], "relevance": cited}
        relevance = arena_relevance_reward(completion, gold)
        return Rollout("q", "q", 0, Trace(example, "arena", meta=meta), {"components": {"relevance": relevance}})

    # n 10, 2 gold, 2 cited: recall chance 2/10, relevance 1/45 + 0.5 * (17/45 - 1/45) = 9/45
    exact = citation_chance([episode(10, [3, 7], [1, 2])])
    assert exact["recall_chance"] == pytest.approx(0.2) and exact["relevance_chance"] == pytest.approx(9 / 45)
    assert exact["precision_chance"] == pytest.approx(0.2) and exact["recall"] == 0.0
    episodes = []
    for _ in range(2000):
        n, k = rng.choice([6, 10]), rng.choice([1, 2, 3])
        gold = rng.sample(range(1, n + 1), rng.choice([1, 2]))
        episodes.append(episode(n, gold, rng.sample(range(1, n + 1), k)))
    at_random = citation_chance(episodes)
    for metric in ("recall", "precision", "relevance"):
        assert at_random[metric] == pytest.approx(at_random[f"{metric}_chance"], abs=0.03)
    perfect = citation_chance([episode(10, [3, 7], [3, 7]), episode(6, [2], [2]), episode(6, [], [1])])
    assert perfect["episodes"] == 2 and perfect["recall"] == perfect["precision"] == perfect["relevance"] == 1.0


def test_arena_preference_lists_are_distinct_random_lists_of_as_many_references_never_the_gold_one() -> None:
    import random

    from learn_arena import preference_lists

    rng = random.Random(0)
    for shown, gold in [(6, [2, 5]), (10, [1, 4]), (6, [3]), (2, [1]), (4, [1, 2, 3])]:
        picked = preference_lists(gold, shown, 4, rng)
        assert picked and all(p != gold and len(p) == len(gold) and p == sorted(p) for p in picked)
        assert all(1 <= i <= shown for p in picked for i in p) and len({tuple(p) for p in picked}) == len(picked)
    assert len(preference_lists([1], 2, 4, rng)) == 1  # the one other list
    assert preference_lists([1, 2], 2, 4, rng) == []  # every reference is gold: no other list


def test_arena_citation_preference_counts_the_random_lists_the_gold_block_beats() -> None:
    """citation_preference's accounting with a scripted scorer (the real hf path runs in the learn_arena smoke
    test): a scorer that prefers the block citing [1] gives preference 1 and first 1 where the gold list is [1];
    elsewhere the gold block loses to [1] and ties count half; a question with no supporting reference shown is
    skipped and counted."""
    import asyncio

    from learn_arena import citation_preference, preference_table

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Score
    from sleuth.records import Example, Passage

    class Scorer:
        def __init__(self, tie: bool = False) -> None:
            self.tie = tie

        async def score(self, prompt: object, completion: str) -> Score:
            await asyncio.sleep(0)
            best = "\n[1]\n" in completion or self.tie
            return Score(logprob=-1.0 if best else -5.0, token_logprobs=[], tokens=[])

    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"text {i}") for i in range(1, 5)]
    examples = [
        Example(id="a", question="q?", answers=["x"], context=refs, supporting_ids=["p1"]),
        Example(id="b", question="q?", answers=["x"], context=refs, supporting_ids=["p3"]),
        Example(id="c", question="q?", answers=["x"], context=refs, supporting_ids=["p9"]),
    ]
    agent = ArenaConfig(max_references=4)
    probe = citation_preference(Path("unused"), examples, agent, "", lists=3, llm=Scorer())
    # b: gold [3] against [1], [2], [4] (all three others of one reference): loses to [1], ties [2] and [4]
    assert probe["per_example"]["preference"] == [1.0, pytest.approx(1 / 3)]
    assert probe["per_example"]["first"] == [1.0, 0.0]
    assert probe["per_example"]["first_chance"] == [0.25, 0.25]
    assert probe["skipped"]["no supporting reference shown"] == 1
    tied = citation_preference(Path("unused"), examples, agent, "", lists=3, llm=Scorer(tie=True))
    assert tied["per_example"]["preference"] == [0.5, 0.5] and tied["per_example"]["first"] == [0.0, 0.0]
    table = "\n".join(preference_table({"test": {"warm start": probe}}))
    assert "| test | warm start | 2 | 0.667 |" in table


def test_arena_citation_preference_on_all_orders_scores_a_list_as_a_set() -> None:
    """A model that writes the gold numbers in hop order ([3, 1]) gives the ascending gold block little probability:
    scored ascending (the default) it loses to every random list; with orders="all" each list's probability is
    summed over its orders (block_orders: all of them up to PROBE_ORDERS, else the ascending one and distinct
    others) and the gold set wins."""
    import asyncio
    import math
    import random
    from itertools import permutations

    from learn_arena import PROBE_ORDERS, block_orders, citation_preference

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Score
    from sleuth.records import Example, Passage

    class HopOrderScorer:
        async def score(self, prompt: object, completion: str) -> Score:
            await asyncio.sleep(0)
            return Score(logprob=-0.5 if "\n[3, 1]\n" in completion else -3.0, token_logprobs=[], tokens=[])

    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"text {i}") for i in range(1, 5)]
    example = Example(id="a", question="q?", answers=["x"], context=refs, supporting_ids=["p1", "p3"])
    agent = ArenaConfig(max_references=4)
    ascending = citation_preference(Path("unused"), [example], agent, "", lists=4, llm=HopOrderScorer())
    as_sets = citation_preference(Path("unused"), [example], agent, "", lists=4, llm=HopOrderScorer(), orders="all")
    assert ascending["per_example"]["preference"] == [0.5]  # every block at -3: ties
    assert as_sets["per_example"]["preference"] == [1.0] and as_sets["per_example"]["first"] == [1.0]
    rng = random.Random(0)
    assert block_orders([3, 1], "sorted", rng) == [[1, 3]]
    assert sorted(block_orders([2, 1, 3], "all", rng)) == sorted(map(list, permutations([1, 2, 3])))
    four = block_orders([4, 2, 1, 3], "all", rng)
    assert len(four) == PROBE_ORDERS and four[0] == [1, 2, 3, 4] and len({tuple(o) for o in four}) == PROBE_ORDERS
    assert all(sorted(o) == [1, 2, 3, 4] for o in four) and math.factorial(4) > PROBE_ORDERS
    with pytest.raises(ValueError, match="orders"):
        block_orders([1], "hops", rng)


def test_arena_prior_free_preference_removes_a_prior_over_numbers_and_keeps_what_the_references_move() -> None:
    """A scripted reader with a strong prior (+3 on any list holding reference 1) and a weak reading (+1 on the gold
    list): raw, the gold list scores first only where it holds 1 (3 of the 6 questions, one per list of 2 of 4);
    after prior_free_scores (each list less its leave-one-out mean over the other questions) it scores first on
    all 6. The every-list probe scores all C(4, 2) = 6 lists, gold first, and keeps the raw scores; a list no
    other question scores takes its length's mean prior and is counted."""
    import asyncio
    import random
    from itertools import combinations

    from learn_arena import (
        citation_preference,
        preference_lists,
        preference_scores,
        prior_free_preference,
        prior_free_scores,
        prior_free_table,
    )

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Score
    from sleuth.records import Example, Passage

    golds = [list(c) for c in combinations(range(1, 5), 2)]
    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"text {i}") for i in range(1, 5)]
    examples = [
        Example(id=f"q{j}", question=f"q{j}?", answers=["x"], context=refs, supporting_ids=[f"p{i}" for i in gold])
        for j, gold in enumerate(golds)
    ]
    by_question = {f"q{j}?": gold for j, gold in enumerate(golds)}

    class PriorReader:
        async def score(self, prompt: object, completion: str) -> Score:
            await asyncio.sleep(0)
            text = prompt[0]["content"]  # type: ignore[index]
            gold = next(g for q, g in by_question.items() if q in text)
            numbers = [int(x) for x in completion.split("[")[1].split("]")[0].split(",")]
            value = 3.0 * (1 in numbers) + 1.0 * (numbers == gold)
            return Score(logprob=value, token_logprobs=[], tokens=[])

    assert preference_lists([2, 3], 4, None, random.Random(0)) == [[1, 2], [1, 3], [1, 4], [2, 4], [3, 4]]
    agent = ArenaConfig(max_references=4)
    probe = citation_preference(Path("unused"), examples, agent, "", lists=None, llm=PriorReader())
    assert [c[0] for c in probe["candidates"]] == golds and all(len(c) == 6 for c in probe["candidates"])
    assert probe["shown"] == [4] * 6 and len(probe["scores"]) == 6
    assert preference_scores(probe["scores"])["first"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    calibrated = prior_free_preference(probe)
    assert calibrated["per_example"]["first"] == [1.0] * 6 and calibrated["fallback"] == 0
    assert calibrated["per_example"]["first_chance"] == [pytest.approx(1 / 6)] * 6
    # gold: 1 - 0 (no other question has this gold); every other list: 0 - 1/5 (one of the 5 others has it as gold)
    shifted, _ = prior_free_scores(probe["candidates"], probe["scores"], probe["shown"])
    assert shifted[0] == [pytest.approx(1.0)] + [pytest.approx(-0.2)] * 5
    table = "\n".join(prior_free_table({"test": {"reader": probe}}))
    assert "| test | reader | 6 | 6.0 | 0.500 | 1.000 | 0.167 |" in table
    # a list only one question scores (3 shown): its prior is the mean prior of the other lists of its length
    lone, fallback = prior_free_scores([[[1, 2]], [[1, 3]], [[2, 3]]], [[-1.0], [-2.0], [-4.0]], [3, 4, 3])
    assert fallback == 3 and lone[0] == [pytest.approx(-1.0 - -4.0)] and lone[1] == [pytest.approx(-2.0)]


def test_arena_overlap_preference_scores_the_probe_lists_by_the_question_words_they_contain() -> None:
    """overlap_preference on citation_preference's own questions and lists: where the gold reference alone shares
    the question's words, the gold list beats every random list; where a distractor shares more, it loses to the
    lists citing that distractor; the lists are the probe's (same seed, same questions left out)."""
    import random

    from learn_arena import overlap_preference, preference_jobs, preference_lists

    from sleuth.agents.arena import ArenaConfig
    from sleuth.records import Example, Passage

    refs = [
        Passage(id="p1", title="Eiffel Tower", text="Gustave Eiffel designed the tower in Paris."),
        Passage(id="p2", title="Banana", text="Bananas are yellow."),
        Passage(id="p3", title="Apple", text="Apples are red."),
        Passage(id="p4", title="Lemon", text="Lemons are sour."),
    ]
    question = "Who designed the Eiffel Tower?"
    examples = [
        Example(id="a", question=question, answers=["x"], context=refs, supporting_ids=["p1"]),
        Example(id="b", question=question, answers=["x"], context=refs, supporting_ids=["p3"]),
        Example(id="c", question=question, answers=["x"], context=refs, supporting_ids=["p9"]),
    ]
    agent = ArenaConfig(max_references=4)
    probe = overlap_preference(examples, agent, lists=3, seed=0)
    # a: gold [1] shares 3 words, [2], [3], [4] none; b: gold [3] loses to [1], ties [2] and [4]
    assert probe["per_example"]["preference"] == [1.0, pytest.approx(1 / 3)]
    assert probe["per_example"]["first"] == [1.0, 0.0]
    assert probe["skipped"]["no supporting reference shown"] == 1
    jobs, _ = preference_jobs(examples, agent, lists=3, seed=0)
    assert [c[1:] for _, _, c in jobs] == [
        preference_lists(c[0], 4, 3, random.Random(f"0:{e.id}")) for e, _, c in jobs
    ]  # the random lists citation_preference draws for the same question


def test_arena_likelihood_preference_ranks_lists_by_the_question_likelihood_of_their_references() -> None:
    """likelihood_preference with a scripted scorer (the real hf path: the learn_arena probe-only smoke test): each
    reference is scored once, by UPR's prompt with the question as the completion, and a list sums its references'
    scores, so the gold [1] beats every list where only reference 1 predicts the question."""
    import asyncio

    from learn_arena import LIKELIHOOD_PROMPT, likelihood_preference

    from sleuth.agents.arena import ArenaConfig
    from sleuth.llm import Score
    from sleuth.records import Example, Passage

    seen: list[tuple[object, str]] = []

    class Scorer:
        async def score(self, prompt: object, completion: str) -> Score:
            await asyncio.sleep(0)
            seen.append((prompt, completion))
            return Score(logprob=-1.0 if "Eiffel" in str(prompt) else -9.0, token_logprobs=[], tokens=[])

    refs = [Passage(id=f"p{i}", title=f"T{i}", text="Eiffel built it." if i == 1 else "fruit") for i in range(1, 5)]
    examples = [Example(id="a", question="Who built it?", answers=["x"], context=refs, supporting_ids=["p1"])]
    probe = likelihood_preference(Path("unused"), examples, ArenaConfig(max_references=4), "", lists=3, llm=Scorer())
    assert probe["per_example"]["preference"] == [1.0] and probe["per_example"]["first"] == [1.0]
    assert len(seen) == 4 and {c for _, c in seen} == {" Who built it?"}
    assert seen[0][0] == LIKELIHOOD_PROMPT.format(passage="T1: Eiffel built it.")


def test_arena_warmup_records_with_shuffles_move_the_gold_numbers_with_their_references() -> None:
    """learn_arena.warmup_records on the real train files: shuffles=3 gives each question three orders of the same
    references, the first the given one (the records of shuffles=1), and every target's relevance list names the
    positions of the supporting references in its own order."""
    import re

    from learn_arena import DATA, TRAIN, warmup_questions, warmup_records

    from sleuth.agents.arena import ArenaConfig

    files = [str(DATA / f) for f in TRAIN]  # ../shared/data, beside every checkout (the smoke tests read it too)
    agent = ArenaConfig(max_references=6)
    plain = warmup_records(files, 60, 4, agent)
    questions = warmup_questions(files, 60, 4, agent)  # round-robin over the three files, the records' order
    assert [e.question in r["messages"][0]["content"] for (e, _), r in zip(questions, plain, strict=True)] == [
        True
    ] * 4
    shuffled = warmup_records(files, 60, 4, agent, shuffles=3)
    assert len(plain) == 4 and len(shuffled) == 12 and shuffled[::3] == plain

    def cited_texts(record: dict[str, Any]) -> set[str]:
        prompt, target = record["messages"][0]["content"], record["messages"][1]["content"]
        numbered = dict(re.findall(r"(?m)^(\d+)\. (.*)$", prompt))  # format_references: "i. text" lines
        cited = json.loads(re.search(r"<relevance>\n(.*?)\n</relevance>", target).group(1))
        return {numbered[str(i)] for i in cited}

    for q in range(4):  # one question's three orders cite the same references by their new numbers
        orders = shuffled[3 * q : 3 * q + 3]
        assert cited_texts(orders[0]) and cited_texts(orders[0]) == cited_texts(orders[1]) == cited_texts(orders[2])
    assert len({r["messages"][0]["content"] for r in shuffled}) > 4  # the orders differ


def test_arena_warmup_cites_in_hop_order_when_asked_and_ascending_by_default() -> None:
    """learn_arena.cited_numbers: ascending by default (arena.md §3.5); ``hops`` follows the gold decomposition (the
    named entity's reference first), then any supporting reference no step names; the warm-start target's relevance
    list and analysis follow it, and R_rel scores both orders alike (sets)."""
    from learn_arena import cited_numbers, warmup_target

    from sleuth.records import Example, Passage
    from sleuth.train.rewards import arena_relevance_reward

    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"Entity {i} is a thing. More.") for i in range(1, 6)]
    example = Example(
        id="q",
        question="Which country is the city of Entity 4 in?",
        answers=["Dibuskund"],
        context=refs,
        supporting_ids=["p2", "p4", "p5"],
        decomposition=[
            {"question": "Where is Entity 4?", "supporting_ids": ["p4"]},
            {"question": "Which country is #1 in?", "supporting_ids": ["p2", "p9"]},  # p9 is not shown
            {"question": "compare", "supporting_ids": []},
        ],
    )
    assert cited_numbers(example, refs) == [2, 4, 5]
    assert cited_numbers(example, refs, "hops") == [4, 2, 5]
    assert cited_numbers(example, refs[:4], "hops") == [4, 2]  # a cut-off reference is not cited
    no_steps = Example(id="r", question="?", answers=["x"], context=refs, supporting_ids=["p3", "p1"])
    assert cited_numbers(no_steps, refs, "hops") == [1, 3]  # no decomposition: ascending
    twice = [*refs[:4], refs[1]]  # p2 shown again as reference 5: cited at both places, in either order
    assert cited_numbers(example, twice) == [2, 4, 5] and cited_numbers(example, twice, "hops") == [4, 2, 5]
    target = warmup_target(example, refs, "hops")
    assert target.startswith("<relevance>\n[4, 2, 5]\n</relevance>")
    assert target.index("Reference [4]") < target.index("Reference [2]") < target.index("Reference [5]")
    assert arena_relevance_reward(target, {2, 4, 5}) == arena_relevance_reward(warmup_target(example, refs), {2, 4, 5})
    assert arena_relevance_reward(target, {2, 4, 5}) == 1.0
    with pytest.raises(ValueError, match="order"):
        cited_numbers(example, refs, "random")
    # the relevance-only lever: the same list, nothing after it
    assert warmup_target(example, refs, "hops", "relevance") == "<relevance>\n[4, 2, 5]\n</relevance>"
    assert warmup_target(example, refs, target="relevance") == "<relevance>\n[2, 4, 5]\n</relevance>"
    with pytest.raises(ValueError, match="target"):
        warmup_target(example, refs, target="analysis")


def test_arena_one_hop_world_names_its_reference_and_the_probe_levers_need_probe_only(tmp_path: Path) -> None:
    """learn_arena.world_settings: the 2-hop world's key is WORLD's; its 1-hop twin shows 4 references of which the
    one supporting reference is the one whose title the question names (the literal binding). settings() refuses
    the probe-only levers (a relevance-only target, the 1-hop world) in a run that would go on to GRPO."""
    import argparse

    from learn_arena import WORLD, settings, world_settings

    from sleuth.data.synth import load_synth, synthesize

    assert world_settings(2, 3) == {**WORLD, "seed": 3}
    one_hop = world_settings(1, 0)
    made = synthesize(tmp_path, **one_hop)  # at full size (~1 s): the world the probe runs on can be made
    assert made["counts"]["questions"]["train"]["hops"] == {"1": one_hop["train_questions"]}
    examples = list(load_synth(tmp_path / "test.jsonl"))
    assert len(examples) == one_hop["test_questions"]
    for example in examples:
        assert len(example.context) == 4 and len(example.supporting_ids) == 1
        (gold,) = [p for p in example.context if p.id in example.supporting_ids]
        assert gold.title in example.question
        assert example.answers[0] in gold.text
    with pytest.raises(ValueError, match="hops"):
        world_settings(3, 0)
    plain = world_settings(1, 0, lookalike_rate=0.0)  # no name families: the distractors share no name stem
    assert plain == {**one_hop, "lookalike_rate": 0.0}
    synthesize(tmp_path / "plain", **plain)
    for example in load_synth(tmp_path / "plain" / "test.jsonl"):
        (gold,) = [p for p in example.context if p.id in example.supporting_ids]
        assert not any(p.title.split()[0] == gold.title.split()[0] for p in example.context if p is not gold)
    with pytest.raises(ValueError, match="probability"):
        world_settings(1, 0, lookalike_rate=1.5)
    args = argparse.Namespace(
        smoke=False, world=True, world_hops=2, probe_only=True, seed=0, test_questions=34, dev_questions=34,
        test_start=0, train_questions=60, steps=4, prompts=4, group=4, lr=5e-4, accuracy="em", max_references=6,
        format_warmup=32, warmup_lr=1e-4, warmup_shuffles=1, warmup_epochs=1.0, warmup_fill=False,
        warmup_order="sorted", warmup_target="relevance", world_lookalikes=None, warmup_from=None,
        shuffle_references=False,
    )  # fmt: skip
    assert settings(args)["warmup"]["target"] == "relevance" and "from" not in settings(args)["warmup"]
    # GRPO's per-episode reference orders are keyed only when set: the runs before the option keep their keys
    assert "shuffle_references" not in settings(args)["grpo"]
    assert settings(argparse.Namespace(**{**vars(args), "shuffle_references": True}))["grpo"]["shuffle_references"]
    earlier = tmp_path / "warmup-earlier" / "model"  # a curriculum: the warm start begins at another's model
    with pytest.raises(SystemExit, match="not a model directory"):
        settings(argparse.Namespace(**{**vars(args), "warmup_from": earlier}))
    earlier.mkdir(parents=True)
    (earlier / "config.json").write_text("{}")
    assert settings(argparse.Namespace(**{**vars(args), "warmup_from": earlier}))["warmup"]["from"] == str(earlier)
    with pytest.raises(SystemExit, match="give --format-warmup"):
        settings(argparse.Namespace(**{**vars(args), "warmup_from": earlier, "format_warmup": 0}))
    args.world_hops = 1
    assert settings(args)["world"] == one_hop
    assert settings(argparse.Namespace(**{**vars(args), "world_lookalikes": 0.0}))["world"] == plain
    for field, value in (("probe_only", False), ("world", False)):
        for lookalikes in (None, 0.0):
            hops = 2 if lookalikes is not None else 1  # so that the lookalike check is the one that refuses
            wrong = argparse.Namespace(
                **{**vars(args), field: value, "world_lookalikes": lookalikes, "world_hops": hops}
            )
            with pytest.raises(SystemExit, match="probe-only"):
                settings(wrong)
    args.world_hops = 2
    args.probe_only = False
    with pytest.raises(SystemExit, match="writes no answer"):
        settings(args)


def test_arena_warmup_training_reads_the_loss_curve_against_the_entropy_of_the_targets_lists(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """learn_arena.warmup_training on a warm start's directory as format_warmup leaves it (``records.jsonl`` of chat
    records beside ``model/`` with TRL's ``log.jsonl``): the late loss is the mean over the second half of the logged
    steps, the completion length is the chat template's (prompt and completion minus prompt with its generation
    prompt), and the lists' entropy is ln 4 for four lists equally often; nothing on this machine: None, or the
    previous report's table where it was the same warm start's (reported_training)."""
    import math

    from learn_arena import reported_training, training_lines, warmup_training
    from transformers import AutoTokenizer

    model = tmp_path / "warmup" / "model"
    shutil.copytree(tiny_model_dir, model)
    assert warmup_training(model) is None  # no log, no records
    prompt = [{"role": "user", "content": "<question>\nWhere is Gokra?\n</question>"}]
    records = [
        {"messages": [*prompt, {"role": "assistant", "content": f"<relevance>\n[{1 + i % 4}]\n</relevance>"}]}
        for i in range(8)
    ]
    (model.parent / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    losses = [1.8, 0.6, 0.2, 0.1, 0.12, 0.08]
    rows = [{"step": 2 * (i + 1), "loss": x, "learning_rate": 1e-4, "grad_norm": 1.0} for i, x in enumerate(losses)]
    killed = [{**row, "loss": 9.0} for row in rows[3:5]]  # steps 8 and 10 logged, then killed; resumed from step 6
    lines = [*rows[:3], *killed, *rows[3:], {"step": 12, "train_runtime": 9}]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (model / "log.jsonl").write_text(text.replace("\n", '\n{"step": 10, "lo\n', 1))  # a line cut by a kill
    training = warmup_training(model)
    assert training is not None
    assert [row["step"] for row in training["log"]] == [2, 4, 6, 8, 10, 12]  # once each; the summary line: out
    assert training["unreadable_log_lines"] == 1
    assert training["late_loss"] == pytest.approx(0.1, abs=1e-4)
    assert training["list_entropy"] == pytest.approx(math.log(4), abs=1e-3)
    assert training["lists"] == {"[1]": 2, "[2]": 2, "[3]": 2, "[4]": 2}
    tokenizer = AutoTokenizer.from_pretrained(model)
    whole = tokenizer.apply_chat_template(records[0]["messages"], tokenize=False)
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert whole.startswith(head)
    expected = len(tokenizer(whole)["input_ids"]) - len(tokenizer(head)["input_ids"])
    assert expected > 0 and training["tokens"] == pytest.approx(expected, abs=1)
    assert training["late_nats"] == pytest.approx(0.1 * training["tokens"], rel=1e-3)
    lines = training_lines(training)
    assert sum(line.startswith("| ") and "e-04" in line for line in lines) == 6
    assert "1.386 nats (4 distinct lists)" in "\n".join(lines) and "1 unreadable log lines skipped" in "\n".join(lines)
    assert "not on this machine" in training_lines(None)[0]
    # a model trained on another machine: the previous report's table, only where that report was this warm start's
    report = tmp_path / "results.json"
    settings = {"warmup": {"questions": 8, "target": "relevance"}, "world": (1, 2)}  # a tuple: json gives a list
    report.write_text(json.dumps({"settings": settings, "warmup_training": training}))
    away = tmp_path / "elsewhere" / "model"
    assert reported_training(away, report, settings) == training
    assert reported_training(away, report, {**settings, "warmup": {"questions": 9}}) is None
    assert reported_training(away, tmp_path / "none.json", settings) is None
    assert reported_training(model, report, {}) == training  # on this machine: read from the model, not the report


def test_arena_citations_by_place_and_outcome_separate_a_first_number_guesser_from_a_reader() -> None:
    """learn_arena's diagnosis tables on a reader that always cites [1]: citation_by_place groups questions by their
    gold places, recall 1 where they hold reference 1 and 0 where not (preference aligned through the probe's
    questions, a skipped one left out); citation_chance's cites_one is 1 over the episodes lacking it; and
    citation_outcomes splits the accuracy reward by exact / partial / disjoint / no citation."""
    from learn_arena import citation_by_place, citation_chance, citation_outcomes, outcome_table

    from sleuth.agents.arena import ArenaConfig
    from sleuth.records import Example, Passage, Trace
    from sleuth.train.rollouts import Rollout

    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"text {i}") for i in range(1, 5)]
    golds = {"a": ["p1", "p2"], "b": ["p2", "p3"], "c": ["p1", "p3"], "d": ["p9"], "e": ["p3", "p4"]}
    examples = [Example(id=k, question="q?", answers=["x"], context=refs, supporting_ids=v) for k, v in golds.items()]
    agent = ArenaConfig(max_references=4)
    recall = {"warm": [0.5, 0.0, 0.5, 0.0, 0.0]}  # citing [1]: half of a, c; none of b, e; d has no gold shown
    preference = {"warm": [0.9, 0.2, 0.8, 0.4]}  # the probe's questions: a, b, c, e (d skipped)
    rows = citation_by_place(examples, agent, recall, preference, lists=4, seed=0)
    cells = {row.split(" | ")[0].strip("| *"): row.strip("| ").split(" | ")[1:] for row in rows[2:]}
    assert list(cells) == ["1, 2", "1, 3", "2, 3", "3, 4", "holds 1", "lacks 1"]
    assert cells["1, 2"] == ["1", "0.500", "0.900"] and cells["3, 4"] == ["1", "0.000", "0.400"]
    assert cells["holds 1"] == ["2", "0.500", "0.850"] and cells["lacks 1"] == ["2", "0.000", "0.300"]

    def episode(example: Example, cited: list[int], accuracy: float) -> Rollout:
        meta = {"reference_ids": [r.id for r in refs], "relevance": cited}
        extra = {"components": {"accuracy": accuracy, "relevance": 0.0}}
        return Rollout(example.id, example.id, 0, Trace(example, "arena", meta=meta), extra)

    a, b, c, d, e = examples
    rollouts = [episode(a, [1, 2], 1.0), episode(b, [1], 0.0), episode(e, [1, 3], 1.0), episode(c, [], 0.0)]
    rollouts += [episode(b, [2, 3], 1.0), episode(d, [1], 1.0)]  # d: no gold shown, counted nowhere
    assert citation_chance(rollouts)["cites_one"] == pytest.approx(2 / 3)  # b, e, b lack 1; two cite it
    assert "cites_one" not in citation_chance(rollouts[:1])
    outcomes = citation_outcomes(rollouts)
    assert outcomes == {
        "exact": {"episodes": 2, "accuracy": 1.0},
        "partial": {"episodes": 1, "accuracy": 1.0},
        "disjoint": {"episodes": 1, "accuracy": 0.0},
        "none": {"episodes": 1, "accuracy": 0.0},
    }
    assert outcome_table(outcomes)[2] == "| exact | 2 | 1.000 |"


def test_arena_citation_advantages_sum_the_push_on_each_first_cited_number_by_gold_place() -> None:
    """citation_advantages recomputes each group's GRPO advantages from the rewards (unbiased std, eps 1e-4) and sums
    them per first number written in <relevance> (in written order, out-of-range numbers and non-integers skipped),
    apart where the gold numbers hold reference 1 and where not; a group with equal rewards pushes nothing."""
    from learn_arena import advantage_table, citation_advantages

    from sleuth.records import Example, Passage, Trace
    from sleuth.train.rollouts import Rollout

    refs = [Passage(id=f"p{i}", title=f"T{i}", text=f"text {i}") for i in range(1, 5)]
    golds = {"a": ["p1", "p2"], "b": ["p2", "p3"], "d": ["p9"], "e": ["p3", "p4"]}
    examples = {k: Example(id=k, question="q", context=refs, supporting_ids=v) for k, v in golds.items()}

    def episode(group: str, sample: int, cited: list[int], reward: float) -> Rollout:
        meta = {"reference_ids": [r.id for r in refs], "relevance": cited}
        trace = Trace(examples[group], "arena", meta=meta)
        return Rollout(f"{group}#{sample}", group, sample, trace, {"reward": reward})

    rollouts = [episode("a", 0, [1, 2], 3.0), episode("b", 0, [1, 2], 1.0), episode("a", 1, [3], 1.0)]
    rollouts += [episode("b", 1, [3, 2], 3.0), episode("d", 0, [1], 5.0), episode("d", 1, [2], 0.0)]
    rollouts += [episode("e", 0, [], 0.0), episode("e", 1, [9, [1], "x", 4], 0.0)]  # junk a file may hold: skipped
    pushed = citation_advantages(rollouts, eps=1e-4)
    half = 1 / (2**0.5 + 1e-4)  # rewards 3 and 1: mean 2, unbiased std sqrt(2)
    assert pushed["groups"] == {"holds 1": {"groups": 1, "exact": 1}, "lacks 1": {"groups": 2, "exact": 1}}
    first = pushed["first"]
    assert list(first) == ["1", "3", "4", "none"]
    assert first["1"]["holds 1"] == {"episodes": 1, "advantage": pytest.approx(half)}
    assert first["1"]["lacks 1"] == {"episodes": 1, "advantage": pytest.approx(-half)}
    assert first["3"]["holds 1"]["advantage"] == pytest.approx(-half)
    assert first["3"]["lacks 1"]["advantage"] == pytest.approx(half)
    assert first["4"] == {"lacks 1": {"episodes": 1, "advantage": 0.0}} and first["none"]["lacks 1"]["episodes"] == 1
    rows = advantage_table(pushed)
    assert rows[2] == "| 1 | 1 | +0.71 | 1 | -0.71 | +0.00 |" and rows[4] == "| 4 | 0 | +0.00 | 1 | +0.00 | +0.00 |"
    assert rows[-1] == "Groups that sampled the exact gold set: holds 1: 1 of 1; lacks 1: 1 of 2."
    assert citation_advantages([], eps=1e-4) == {"groups": {}, "first": {}}


def test_arena_warmup_questions_fill_the_turns_of_a_train_file_that_runs_out() -> None:
    """On the real train files HotpotQA's and MuSiQue's usable questions after GRPO's 60 run out before 40 rounds:
    without fill 120 turns give fewer questions; with fill 2Wiki takes the empty turns, the same questions first."""
    from learn_arena import DATA, TRAIN, warmup_questions

    from sleuth.agents.arena import ArenaConfig

    files = [str(DATA / f) for f in TRAIN]
    agent = ArenaConfig(max_references=6)
    plain = [e.id for e, _ in warmup_questions(files, 60, 120, agent)]
    filled = [e.id for e, _ in warmup_questions(files, 60, 120, agent, fill=True)]
    assert len(plain) < 120 and len(filled) == 120 and len(set(filled)) == 120
    assert filled[: len(plain)] == plain  # the round robin's questions, then the fill
    wiki = {e.id for e, _ in warmup_questions(files[1:2], 60, 200, agent)}
    assert set(filled[len(plain) :]) <= wiki


def test_arena_overlap_order_ranks_references_by_the_question_words_they_share() -> None:
    from learn_arena import overlap_order

    texts = ["The Eiffel Tower is in Paris.", "Bananas are yellow.", "Gustave Eiffel designed the tower in Paris."]
    # "eiffel", "tower", "paris" shared by 1 and 3 (3: also "designed"); function words ("who", "the") never count
    assert overlap_order("Who designed the Eiffel Tower in Paris?", texts) == [3, 1, 2]
    assert overlap_order("the of who", texts) == [1, 2, 3]


def test_exsearch_report_ess_counts_the_trajectories_the_m_step_trains_on(tmp_path: Path) -> None:
    from learn_exsearch import effective_sample_size

    def ess(weights: list[float]) -> float | None:
        path = tmp_path / "weighted.jsonl"
        path.write_text(
            "".join(json.dumps({"question_id": i // 4, "weight": w}) + "\n" for i, w in enumerate(weights))
        )
        return effective_sample_size(path)

    assert ess([1.0] * 96) == pytest.approx(96)
    # Eight trajectories near 1 and 88 near 0 (whole questions of 1e-12 included): about eight, not about 30.
    assert ess([0.9] * 8 + [1e-12] * 88) == pytest.approx(8, rel=1e-6)
    assert ess([0.0] * 8) == 0.0
    assert ess([]) is None


def test_exsearch_report_says_how_much_of_the_weight_a_pruned_m_step_trains_on(tmp_path: Path) -> None:
    from learn_exsearch import mass_trained

    path = tmp_path / "weighted.jsonl"
    path.write_text("".join(json.dumps({"weight": w}) + "\n" for w in [0.9, 0.1, 0.005, 0.005, 1e-14]))
    assert mass_trained(path, 0.0) == pytest.approx(1.0)
    assert mass_trained(path, 0.01) == pytest.approx(1.0 / 1.01)
    assert mass_trained(path, 0.5) == pytest.approx(0.9 / 1.01)
    path.write_text(json.dumps({"weight": 0.0}) + "\n")
    assert mass_trained(path, 0.0) is None


def test_exsearch_m_step_settings_reuse_the_e_step_that_sampled_the_same_trajectories(tmp_path: Path) -> None:
    from learn_exsearch import reuse_estep

    exp = Experiment("t", tmp_path / "work", tmp_path / "results")
    em = {"questions": 96, "samples": 4, "lr": 3e-5, "epochs": 1, "best_of": 1, "fresh_questions": True}
    donor_key = {"model": "warm", "em": em, "agent": {"k": 2}, "seed": 0, "weighting": "likelihood"}
    donor = exp.stage_dir("em", donor_key)
    (donor / "iter0" / "rollouts").mkdir(parents=True)
    (donor / "iter0" / "rollouts" / "part.jsonl").write_text("{}\n")
    (donor / "iter0" / "estep.json").write_text("{}")
    (donor / "iter0" / "weighted.jsonl").write_text('{"weight": 0.5, "log_p_answer": -0.7}\n')
    (exp.work / "stages").mkdir()
    (exp.work / "stages" / f"{donor.name}.key.json").write_text(json.dumps({"key": donor_key}))  # killed in M-step

    def key(**changes: Any) -> dict[str, Any]:
        return {**donor_key, "em": {**em, **changes.pop("em", {})}, **changes}

    other_lr = key(em={"lr": 1e-4, "epochs": 2, "min_weight": 0.01})
    assert reuse_estep(exp, other_lr, exp.stage_dir("em", other_lr)) == str(donor)
    copied = exp.stage_dir("em", other_lr) / "iter0"
    assert (copied / "weighted.jsonl").read_text() == '{"weight": 0.5, "log_p_answer": -0.7}\n' and (
        copied / "rollouts" / "part.jsonl"
    ).exists()
    assert reuse_estep(exp, other_lr, exp.stage_dir("em", other_lr)) is None  # has its own now
    # a different E-step (samples, questions, policy, best-of) is never reused
    for changed in (key(em={"samples": 2}), key(em={"questions": 24}), key(model="other"), key(em={"best_of": 8})):
        assert reuse_estep(exp, changed, exp.stage_dir("em", changed)) is None
        assert not (exp.stage_dir("em", changed) / "iter0").exists()
    # the uniform ablation takes the same trajectories and scores with every weight 1 ...
    uniform = key(weighting="uniform", em={"lr": 1e-4, "epochs": 2})
    assert reuse_estep(exp, uniform, exp.stage_dir("uniform", uniform)) == str(donor)
    mine = exp.stage_dir("uniform", uniform) / "iter0"
    assert [json.loads(line) for line in (mine / "weighted.jsonl").read_text().splitlines()] == [
        {"weight": 1.0, "log_p_answer": -0.7}
    ]
    assert "set to 1" in json.loads((mine / "estep.json").read_text())["weights_from"]
    # ... but a weighted arm never takes the uniform arm's weights
    alone = Experiment("t", tmp_path / "alone", tmp_path / "results2")
    (alone.work / "stages").mkdir(parents=True)
    only = alone.stage_dir("uniform", uniform)
    shutil.copytree(mine, only / "iter0")
    (alone.work / "stages" / f"{only.name}.json").write_text(json.dumps({"key": uniform}))
    assert reuse_estep(alone, other_lr, alone.stage_dir("em", other_lr)) is None


@pytest.mark.slow
def test_learn_exsearch_sweep_records_dev_first_and_reuses_its_e_step(tmp_path: Path) -> None:
    """benchmarks/learn_exsearch.py --smoke end to end (tiny random model, hf): two M-step settings of one sweep; the
    second reuses the first's E-step, the test split is refused before the group's dev choice, and every trial's
    test value is listed once chosen."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learn_exsearch.py"
    results = tmp_path / "results"

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(script), "--smoke", "--work", str(tmp_path / "work"), "--results", str(results)]
        args += ["--arms", "em", "--best-of", "1", "--group", "m", *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=900)

    done = run("--dev-only")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((tmp_path / "work" / "eval" / "test").glob("em-0-*"))
    refused = run("--em-lr", "2e-3")  # test before the choice
    assert refused.returncode != 0 and "dev choice of group 'm'" in refused.stderr
    assert "E-step reused" in refused.stdout
    done = run("--em-lr", "2e-3", "--choose")
    assert done.returncode == 0, done.stderr[-3000:]
    entries = json.loads((results / "trials.json").read_text())
    trials = [t for t in entries if "settings" in t]
    assert [t["settings"]["em"]["lr"] for t in trials] == [1e-3, 2e-3] and all(t["group"] == "m" for t in trials)
    assert "test" not in trials[0] and "em-0" in trials[1]["test"]
    assert [t["choice"] for t in entries if "choice" in t] == ["m"]
    written = json.loads((results / "results.json").read_text())
    assert [c["name"] for c in written["claims"]] == ["warm-up > base", "EM-1 > warm-up"]
    # the uniform ablation of the chosen setting trains on the chosen em stage's E-step with every weight 1
    args = [sys.executable, str(script), "--smoke", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "u")]
    args += ["--arms", "em,uniform", "--best-of", "1", "--em-lr", "2e-3"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "uniform-" in done.stdout and "E-step reused" in done.stdout
    (uniform,) = (tmp_path / "work").glob("uniform-*/iter0/weighted.jsonl")
    weights = [json.loads(line)["weight"] for line in uniform.read_text().splitlines()]
    assert weights and set(weights) == {1.0}
    written = json.loads((tmp_path / "u" / "results.json").read_text())
    assert "EM-1 > uniform-1" in [c["name"] for c in written["claims"]]


@pytest.mark.parametrize("group", ["ppo", "grpo"])  # learn_s3's PPO, learn_arena's GRPO
def test_online_rl_continues_from_the_furthest_sibling_checkpoint_it_can_use(tmp_path: Path, group: str) -> None:
    """That the continued run equals one trained straight through is the loop's resumption
    (tests/test_online_rl.py::test_a_resumed_ppo_run_restores_the_critic_and_its_optimizer); here: which sibling's
    checkpoint is picked (the furthest at or below this run's steps, finished or killed) and what is copied."""
    from harness import continue_online_rl

    exp = Experiment("t", tmp_path / "work", tmp_path / "results")

    def key(steps: int, lr: float = 1e-6) -> dict:
        return {"searcher": "warm", group: {"steps": steps, "prompts": 8, "lr": lr}, "seed": 0}

    def resume(exp: Experiment, out: Path, k: dict) -> str | None:
        return continue_online_rl(exp, out, k, group)

    def finished(k: dict, done: int) -> None:
        def train() -> dict:
            out = exp.stage_dir(group, k)
            (out / "checkpoint").mkdir(parents=True)
            (out / "checkpoint" / "state.json").write_text(json.dumps({"step": done}))
            (out / "rollouts" / f"step-{done - 1:05d}").mkdir(parents=True)
            (out / "log.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(done)))
            return {}

        exp.stage(exp.stage_dir(group, k).name, k, train)

    finished(key(2), 2)
    finished(key(4), 4)
    finished(key(6, lr=1e-5), 6)  # another learning rate: never borrowed
    ten = key(10)
    out = exp.stage_dir(group, ten)
    assert resume(exp, out, ten) == str(exp.stage_dir(group, key(4)))
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4
    assert (out / "rollouts" / "step-00003").is_dir() and len((out / "log.jsonl").read_text().splitlines()) == 4
    assert resume(exp, out, ten) is None  # a checkpoint of its own: resumed by the trainer, not replaced
    assert resume(exp, exp.stage_dir(group, key(3)), key(3)) == str(exp.stage_dir(group, key(2)))
    assert resume(exp, exp.stage_dir(group, key(2)), key(2)) is None  # its own checkpoint: the trainer's
    # a 12-step run killed after its step-8 checkpoint (the log and rollouts of step 9 were written) seeds a 9-step one
    twelve = key(12)
    killed = exp.stage_dir(group, twelve)

    def killed_after_step_8() -> dict:
        (killed / "checkpoint").mkdir(parents=True)
        (killed / "checkpoint" / "state.json").write_text(json.dumps({"step": 8}))
        for step in range(9):
            (killed / "rollouts" / f"step-{step:05d}").mkdir(parents=True)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        exp.stage(killed.name, twelve, killed_after_step_8)
    nine = key(9)
    out = exp.stage_dir(group, nine)
    assert resume(exp, out, nine) == str(killed)
    assert sorted(p.name for p in (out / "rollouts").iterdir())[-1] == "step-00007"
    assert resume(exp, exp.stage_dir(group, key(7)), key(7)) == str(exp.stage_dir(group, key(4)))


def test_acesearcher_mdpo_with_more_iterations_copies_the_finished_ones(tmp_path: Path) -> None:
    from learn_acesearcher import reuse_iterations

    exp = Experiment("t", tmp_path / "work", tmp_path / "results")
    one = {"dpo_lr": 2e-5, "nll_weight": 0.2, "iterations": 1}

    def trained_one() -> dict:
        (exp.stage_dir("mdpo", one) / "iter1" / "model").mkdir(parents=True)
        (exp.stage_dir("mdpo", one) / "iter1" / "stats.json").write_text("{}")
        return {}

    exp.stage(exp.stage_dir("mdpo", one).name, one, trained_one)
    two = {**one, "iterations": 2}
    out = exp.stage_dir("mdpo", two)
    assert reuse_iterations(exp, out, two) == {"1": str(exp.stage_dir("mdpo", one) / "iter1")}
    assert (out / "iter1" / "model").is_dir() and not (out / "iter2").exists()
    assert reuse_iterations(exp, out, two) == {}  # already there: nothing copied twice
    other = {**two, "nll_weight": 0.0}  # another setting never borrows an iteration
    assert reuse_iterations(exp, exp.stage_dir("mdpo", other), other) == {}
    # fresh questions act from iteration 2 on: iteration 1 is the plain run's, iteration 2 is not
    fresh = {**two, "fresh_questions": True}
    assert list(reuse_iterations(exp, exp.stage_dir("mdpo", fresh), fresh)) == ["1"]
    later = {**two, "later_dpo_lr": 5e-6}  # so does a later rate
    assert list(reuse_iterations(exp, exp.stage_dir("mdpo", later), later)) == ["1"]


def test_acesearcher_chosen_likelihood_skips_the_step_before_any_update() -> None:
    from learn_acesearcher import chosen_likelihood

    log = [
        {"loss": 0.69, "rewards/chosen": 0.0, "logps/chosen": -3.0},  # logged before the first update
        {"rewards/chosen": -0.2, "logps/chosen": -4.0},
        {"learning_rate": 1e-5},  # a line without DPO rewards
        {"rewards/chosen": 0.1, "logps/chosen": -3.5},
        {"rewards/chosen": -0.5, "logps/chosen": -9.0},
    ]
    got = chosen_likelihood(log)
    assert got is not None
    assert (got["steps"], got["negative"], got["logps_first"], got["logps_last"]) == (3, 2, -4.0, -9.0)
    assert got["mean"] == pytest.approx(-0.2)
    assert chosen_likelihood(log[:1]) is None and chosen_likelihood([]) is None


def test_acesearcher_on_policy_column_counts_the_pairs_the_greedy_policy_already_gets() -> None:
    from learn_acesearcher import PAIR_SETS, _on_policy

    from sleuth.train import mdpo

    assert PAIR_SETS == mdpo.PAIR_SETS  # --pair-sets offers the trainer's sets

    it = {
        "on_policy": {"subq_greedy_is_chosen": 49, "final_greedy_is_chosen": 42, "subq_greedy_rejected": 17},
        "pairs_sampled": {"total": 140},
        "pairs": {"total": 41},
    }
    assert _on_policy(it) == "65% (41 / 140)"
    assert _on_policy({"pairs": {"total": 3}}) == "–"  # a run with the paper's sampled rejected sides


def test_acesearcher_steps_column_reads_the_decomposition_pairs_lengths() -> None:
    from learn_acesearcher import _steps

    from sleuth.train.mdpo import decompose_steps

    pairs = [
        {"set": "decompose", "chosen_steps": 3, "rejected_steps": 2},
        {"set": "decompose", "chosen_steps": 3, "rejected_steps": 3},
        {"set": "decompose", "chosen_steps": 2, "rejected_steps": 3},
        {"set": "final"},
    ]
    assert _steps({"decompose_steps": decompose_steps(pairs)}) == "2: 1, 3: 2; 1 / 1 / 1"
    assert _steps({}) == "–"  # an iteration trained before the lengths were recorded


def test_rollout_steps_count_mixed_groups_and_average_components(tmp_path: Path) -> None:
    from sleuth.records import Example, Trace
    from sleuth.train.rollouts import Rollout, RolloutStore

    def step(index: int, rewards: dict[str, list[float]]) -> None:
        store = RolloutStore(tmp_path / "rollouts" / f"step-{index:05d}", producer={"method": "arena", "step": index})
        rows = []
        for group, values in rewards.items():
            for sample, reward in enumerate(values):
                trace = Trace(example=Example(id=group, question="q?", answers=["a"]), method="arena")
                extra = {"reward": reward, "components": {"format": 1.0, "relevance": reward - 1.0}}
                rows.append(Rollout(f"{group}#{sample}", group, sample, trace, extra))
        store.append(rows)

    step(0, {"g1": [1.0, 1.0], "g2": [1.0, 2.5]})  # g1 tied: no advantage; g2 mixed
    step(1, {"g1": [0.0, 0.0], "g2": [0.0, 0.0]})
    log = [{"step": 0, "kl": 0.0, "seconds": 12.0}, {"step": 1, "kl": 0.25, "seconds": 10.0}]
    rows = rollout_steps(tmp_path, log)
    assert [(r["step"], r["episodes"], r["groups"], r["mixed_groups"]) for r in rows] == [(0, 4, 2, 1), (1, 4, 2, 0)]
    assert rows[0]["mean"] == pytest.approx(1.375) and rows[0]["std"] == pytest.approx(0.649519, abs=1e-6)
    assert rows[0]["nonzero"] == 1.0 and rows[1]["nonzero"] == 0.0 and rows[1]["positive"] == 0.0
    assert rows[0]["components"] == {"format": 1.0, "relevance": pytest.approx(0.375)}
    table = step_table(rows, [("relevance", "relevance"), ("bonus", "bonus")], groups=True)
    assert table[0].startswith("| step | episodes | reward mean") and "groups with non-zero advantage" in table[0]
    assert table[2] == "| 0 | 4 | +1.375 | 0.650 | 100% | 100% | 0.375 | – | 1 / 2 | 0.0000 | 12 |"
    assert table[3].endswith("| 0 / 2 | 0.2500 | 10 |")
    assert "groups with" not in step_table(rows, [], groups=False)[0]


def test_full_sets_the_gpu_sizes_as_defaults_and_a_given_flag_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from harness import parse_sized, run_dirs

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        parser.add_argument("--smoke", action="store_true")
        parser.add_argument("--work", type=Path, default=None)
        parser.add_argument("--results", type=Path, default=None)
        parser.add_argument("--steps", type=int, default=4)
        parser.add_argument("--group", type=int, default=4)
        monkeypatch.setattr("sys.argv", ["learn_x.py", *argv])
        return parse_sized(parser, {"steps": 30, "group": 7})

    results = Path("/committed/learn_x")
    monkeypatch.delenv("SLEUTH_RUNS", raising=False)
    monkeypatch.setenv("SLEUTH_HOME", "/home-of-sleuth")  # work directories live outside the checkout
    runs = Path("/home-of-sleuth/runs")
    plain = parse()
    assert (plain.steps, plain.group, plain.full) == (4, 4, False)
    assert run_dirs("learn_x", plain, results) == (runs / "learn-x", results)
    full = parse("--full", "--steps", "12")
    assert (full.steps, full.group) == (12, 7)  # the flag given wins over the GPU size
    assert run_dirs("learn_x", full, results) == (runs / "learn-x-full", results / "full")
    smoke = parse("--smoke")
    assert run_dirs("learn_x", smoke, results) == (runs / "learn-x-smoke", runs / "learn-x-smoke" / "results")
    monkeypatch.setenv("SLEUTH_RUNS", "/elsewhere")
    assert run_dirs("learn_x", plain, results) == (Path("/elsewhere/learn-x"), results)
    assert run_dirs("learn_x", parse("--full", "--work", "/w"), results) == (Path("/w"), results / "full")
    with pytest.raises(SystemExit):
        parse("--smoke", "--full")
    world = argparse.Namespace(smoke=False, full=True, world=True, work=None, results=None)  # learn_arena --world
    assert run_dirs("learn_x", world, results) == (Path("/elsewhere/learn-x-full-world"), results / "full-world")
    named = argparse.Namespace(smoke=False, world="pilot", work=None, results=None)  # learn_s3's --world NAME
    assert run_dirs("learn_x", named, results) == (Path("/elsewhere/learn-x"), results)


def _model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_committed_evaluation_is_read_back_by_model_content_and_settings(tmp_path: Path) -> None:
    calls: list[str] = []

    def run(tag: str, values: list[float]):
        def inner() -> dict:
            calls.append(tag)
            return {"per_example": {"em": values}}

        return inner

    results = tmp_path / "docs" / "learn_t"
    model = _model(tmp_path / "one" / "sft", b"weights")
    first = Experiment("t", tmp_path / "work-1", results)
    first.stage("world", {"seed": 0}, lambda: {})
    sft = first.evaluate("sft", "test", {"model": str(model), "k": 3}, run("first", [1, 0, 1]))
    assert sft["eval_key"]["settings"]["model"] == "sha256:" + content_hash(model)
    assert sft["eval_key"]["data"] == {"world": {"seed": 0}}
    first.write({"evaluations": {"test": {"sft": sft}}}, "# t\n")
    assert json.loads((results / "results.json").read_text())["evaluations"]["test"]["sft"]["eval_key"]

    # a fresh work directory, the same weights elsewhere (another checkout): read back, not computed
    copy = _model(tmp_path / "two" / "model", b"weights")
    second = Experiment("t", tmp_path / "work-2", results)
    second.stage("world", {"seed": 0}, lambda: {})
    again = second.evaluate("sft", "test", {"model": str(copy), "k": 3}, run("second", [0, 0, 0]))
    assert calls == ["first"] and again["per_example"]["em"] == [1, 0, 1] and again["from_committed"]
    assert second.evaluate("sft", "test", {"model": str(copy), "k": 3}, run("third", [0, 0, 0]))  # work cache now
    assert calls == ["first"]
    # other weights, another setting or another world: computed
    other = _model(tmp_path / "three" / "model", b"other weights")
    second.evaluate("sft", "test", {"model": str(other), "k": 3}, run("weights", [0, 0, 0]))
    second.evaluate("sft", "test", {"model": str(copy), "k": 5}, run("setting", [0, 0, 0]))
    third = Experiment("t", tmp_path / "work-3", results)
    third.stage("world", {"seed": 1}, lambda: {})
    third.evaluate("sft", "test", {"model": str(copy), "k": 3}, run("world", [0, 0, 0]))
    assert calls == ["first", "weights", "setting", "world"]


def test_a_committed_evaluation_is_found_in_any_run_of_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness

    monkeypatch.setattr(harness, "COMMITTED_RESULTS", tmp_path / "docs")
    model = _model(tmp_path / "sft", b"weights")
    diagnosis = Experiment("learn_t", tmp_path / "work-1", tmp_path / "docs" / "learn_t" / "diagnosis")
    diagnosis.stage("world", {"seed": 0}, lambda: {})
    sft = diagnosis.evaluate("sft", "test", {"model": str(model)}, lambda: {"per_example": {"em": [1.0, 0.0]}})
    diagnosis.write({"evaluations": {"test": {"sft": sft}}}, "# t\n")

    def not_again() -> dict:
        raise AssertionError("evaluated again")

    sweep = Experiment("learn_t", tmp_path / "work-2", tmp_path / "docs" / "learn_t" / "sweep")  # a sibling run
    sweep.stage("world", {"seed": 0}, lambda: {})
    again = sweep.evaluate("sft", "test", {"model": str(model)}, not_again)
    assert again["per_example"]["em"] == [1.0, 0.0] and again["from_committed"].endswith("diagnosis/results.json")
    other = Experiment("learn_u", tmp_path / "work-3", tmp_path / "docs" / "learn_u")  # another benchmark's runs
    other.stage("world", {"seed": 0}, lambda: {})
    assert other.evaluate("sft", "test", {"model": str(model)}, lambda: {"per_example": {"em": [0.0, 0.0]}})[
        "per_example"
    ]["em"] == [0.0, 0.0]


def test_content_hash_is_cached_by_size_and_mtime_and_follows_the_bytes(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", b"abc")
    value = content_hash(model)
    assert json.loads((model / ".sleuth-sha256.json").read_text())["sha256"] == value
    assert content_hash(model) == value and content_hash(_model(tmp_path / "n", b"abc")) == value
    (model / "model.safetensors").write_bytes(b"abcd")
    assert content_hash(model) != value
    (model / "training_args.bin").write_bytes(b"names the output directory")
    for record in ("sft_config.json", "data_summary.json", "log.jsonl", "README.md"):  # a trainer's own records
        (model / record).write_text(json.dumps({"output_dir": str(model)}))
    assert content_hash(model) == content_hash(_model(tmp_path / "o", b"abcd"))
    (model / "tokenizer.json").write_text("{}")  # what a loader reads counts
    assert content_hash(model) != content_hash(tmp_path / "o")


def test_two_builds_of_one_corpus_hash_alike_wherever_and_whenever_they_were_built(tmp_path: Path) -> None:
    import time

    from sleuth.retrieval.bm25 import build_bm25_index

    def corpus(where: Path, text: str) -> Path:
        where.mkdir(parents=True)
        lines = [{"id": str(i), "contents": f'"Title {i}"\n{text} {i}'} for i in range(5)]
        (where / "corpus.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return where / "corpus.jsonl"

    build_bm25_index(corpus(tmp_path / "a", "a passage"), tmp_path / "a" / "index")
    time.sleep(1.1)  # another build time in the manifest
    build_bm25_index(corpus(tmp_path / "b", "a passage"), tmp_path / "b" / "index")
    build_bm25_index(corpus(tmp_path / "c", "another passage"), tmp_path / "c" / "index")
    manifests = [json.loads((tmp_path / d / "index" / "sleuth-index.json").read_text()) for d in "ab"]
    assert manifests[0]["corpus"] != manifests[1]["corpus"] and manifests[0]["built_at"] != manifests[1]["built_at"]
    a, b, c = (content_hash(tmp_path / d / "index") for d in "abc")
    assert a == b and a != c
    cache = json.loads((tmp_path / "a" / "index" / ".sleuth-sha256.json").read_text())
    assert cache["rule"] == HASH_RULE
    cache["sha256"], cache["rule"] = "0" * 64, 1  # a hash cached under the earlier rule is computed again
    (tmp_path / "a" / "index" / ".sleuth-sha256.json").write_text(json.dumps(cache))
    assert content_hash(tmp_path / "a" / "index") == a
    for broken in ("{not json", "[1, 2]", "\udcff"):  # a malformed manifest is hashed as bytes, never a crash
        (tmp_path / "c" / "index" / "sleuth-index.json").write_text(broken, errors="surrogateescape")
        assert content_hash(tmp_path / "c" / "index") not in (a, c)


def test_a_model_saved_offline_hashes_as_the_one_saved_online(tmp_path: Path) -> None:
    """transformers writes HF_HUB_OFFLINE into a saved tokenizer_config.json as local_files_only: the same model
    saved on a machine without a network hashed differently before, and its committed evaluations were missed."""
    text = '{\n  "model_max_length": 8192,\n  "local_files_only": %s,\n  "pad_token": "<pad>"\n}\n'
    online, offline = _model(tmp_path / "on", b"w"), _model(tmp_path / "off", b"w")
    (online / "tokenizer_config.json").write_text(text % "false")
    (offline / "tokenizer_config.json").write_text(text % "true")
    assert content_hash(online) == content_hash(offline)
    other = _model(tmp_path / "other", b"w")
    (other / "tokenizer_config.json").write_text((text % "false").replace("<pad>", "<eos>"))
    assert content_hash(other) != content_hash(online)  # the rest of the file is content


def test_artifacts_are_committed_with_their_hash_and_a_mismatch_is_refused(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    results = tmp_path / "results"
    assert load_artifact(results, "warmup") is None
    value = save_artifact(results, "warmup", adapter)
    assert value == content_hash(adapter)
    loaded = load_artifact(results, "warmup", value)
    assert loaded == results / "artifacts" / "warmup" and (loaded / "adapter_model.safetensors").exists()
    with pytest.raises(ValueError, match="mismatch"):
        load_artifact(results, "warmup", "0" * 64)  # another setting's adapter
    (loaded / "adapter_model.safetensors").write_bytes(b"edited")
    with pytest.raises(ValueError, match="mismatch"):
        load_artifact(results, "warmup")
    with pytest.raises(ValueError, match="over the"):
        save_artifact(results, "big", adapter, max_bytes=3)


def test_claims_carry_exact_tests_and_holm_and_replace_their_table(tmp_path: Path) -> None:
    results = {
        "evaluations": {
            "test": {
                "base": {"per_example": {"em": [0] * 100, "f1": [0.0] * 100}},
                "sft": {"per_example": {"em": [1] * 47 + [0] * 53, "f1": [0.5] * 100}},
                "rl": {"per_example": {"em": [1] * 51 + [0] * 49, "f1": [0.5] * 100}},
            }
        }
    }
    specs = [
        {"name": "SFT > base", "metric": "em", "before": "base", "after": "sft"},
        {"name": "RL > SFT", "metric": "em", "before": "sft", "after": "rl"},
        {"name": "RL > SFT F1", "metric": "f1", "before": "sft", "after": "rl"},
        {"name": "not run", "metric": "em", "before": "sft", "after": "missing"},
    ]
    found = claims(results, specs)
    assert [c["name"] for c in found] == ["SFT > base", "RL > SFT", "RL > SFT F1"]
    sft, rl, f1 = found
    assert (sft["better"], sft["worse"], sft["n"], sft["p_exact"], sft["shown"]) == (47, 0, 100, 2.0**-47, True)
    assert (rl["better"], rl["worse"], rl["p_exact"], rl["shown"]) == (4, 0, 0.0625, False)
    assert rl["p_holm"] == pytest.approx(0.125) and sft["p_holm"] == pytest.approx(3 * 2.0**-47)
    assert f1["p_exact"] == 1.0 and f1["test"] == "sign-flip" and not f1["shown_holm"]
    # power: 4 of 100 changed is too few for 80% power at any split; the observed rates would need more questions
    assert rl["detectable"] is None and rl["needed"] is not None and rl["needed"] > 100
    assert sft["detectable"] is not None and sft["detectable"] < 0.47 and "power_target" not in f1
    markdown = with_claims_table("# report\n", found)
    assert f"| not at this rate / {rl['needed']:,} |" in markdown
    assert "| SFT > base (sft vs base) | em | 100 | 47 / 0 |" in markdown
    assert with_claims_table(markdown, found[:1]).count("## Claims") == 1
    assert "RL > SFT" not in with_claims_table(markdown, found[:1])
    exp = Experiment("t", tmp_path / "work", tmp_path / "results", claims=specs)
    exp.write(results, "# report\n")
    written = json.loads((tmp_path / "results" / "results.json").read_text())
    assert [c["name"] for c in written["claims"]] == ["SFT > base", "RL > SFT", "RL > SFT F1"]
    assert "## Claims" in (tmp_path / "results" / "results.md").read_text()


def test_test_evaluations_of_a_group_wait_for_its_recorded_dev_choice(tmp_path: Path) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results")

    def ev(values: list[float]):
        return lambda: {"per_example": {"em": values}}

    dev_a = exp.evaluate("rl-a", "dev", {"m": "a"}, ev([0, 1, 1, 0]), group="rl")
    dev_b = exp.evaluate("rl-b", "dev", {"m": "b"}, ev([1, 1, 1, 0]), group="rl")
    with pytest.raises(SystemExit, match="dev choice"):
        exp.evaluate("rl-a", "test", {"m": "a"}, ev([1, 0]), group="rl")
    exp.record_trial({"lr": 1}, {"rl": dev_a}, "em", group="rl")
    trials = exp.record_trial({"lr": 2}, {"rl": dev_b}, "em", group="rl")
    with pytest.raises(SystemExit, match="no trial"):
        exp.choose("other", "rl")
    choice = exp.choose("rl", "rl")
    assert choice["id"] == key_hash({"lr": 2}) and choice["among"] == [key_hash({"lr": 1}), key_hash({"lr": 2})]
    assert choice["at"] and exp.choose("rl", "rl") == choice  # recorded once
    entries = json.loads((tmp_path / "results" / "trials.json").read_text())
    assert [e.get("choice") for e in entries] == [None, None, "rl"]
    # every tried setting is evaluated on test once the choice is recorded, the chosen one marked in the report
    test_a = exp.evaluate("rl-a", "test", {"m": "a"}, ev([1, 0]), group="rl")
    assert test_a["group"] == "rl"
    trials = exp.record_trial({"lr": 1}, {"rl": dev_a}, "em", group="rl", test={"rl": test_a})
    assert trials[0]["test"] == {"rl": 50.0} and trials[0]["test_n"] == 2
    trials = exp.record_trial({"lr": 1}, {"rl": dev_a}, "em", group="rl")  # a dev-only rerun keeps the test value
    assert trials[0]["test"] == {"rl": 50.0}
    trials = [t for t in trials if "settings" in t]
    table = "\n".join(trials_table([*trials, choice]))
    assert "chosen" in table and table.count("| " + key_hash({"lr": 2}) + " (chosen") == 1
    assert "| test rl |" in table and "| 50.0 |" in table and "chosen or not" in table
    assert exp.choose("rl", "rl", higher_is_better=False)["id"] == key_hash({"lr": 1})


def test_a_dev_tie_goes_to_the_smallest_update_when_that_rule_is_named(tmp_path: Path) -> None:
    exp = Experiment("t", tmp_path / "work", tmp_path / "results")

    def ev(stage: str, values: list[int]) -> dict:
        return exp.evaluate(stage, "dev", {"m": stage}, lambda: {"per_example": {"em": values}})

    sft = ev("sft", [1, 1, 0, 0, 1, 0])
    big = ev("big", [0, 0, 1, 1, 1, 0])  # 3 of 6 right, 4 questions changed from SFT
    small = ev("small", [1, 1, 0, 0, 0, 1])  # 3 of 6 right too, 2 changed
    exp.record_trial({"lr": 20}, {"sft": sft, "mdpo": big}, "em", group="lr", reference="sft")
    trials = exp.record_trial({"lr": 2}, {"sft": sft, "mdpo": small}, "em", group="lr", reference="sft")
    assert [t["dev_changed"] for t in trials] == [{"mdpo": 4}, {"mdpo": 2}]
    assert exp.choose("lr", "mdpo")["id"] == key_hash({"lr": 20})  # the default: the earliest of the tie
    choice = exp.choose("lr", "mdpo", tie_break="fewest_changed")
    assert choice["id"] == key_hash({"lr": 2}) and choice["tie_break"] == "fewest_changed"
    assert exp.choose("lr", "mdpo", tie_break="fewest_changed") == choice  # recorded once
    with pytest.raises(ValueError, match="tie_break"):
        exp.choose("lr", "mdpo", tie_break="smallest")
    exp.record_trial({"lr": 5}, {"sft": sft, "mdpo": small}, "em", group="lr")  # no reference: no dev_changed
    with pytest.raises(SystemExit, match="dev_changed"):
        exp.choose("lr", "mdpo", tie_break="fewest_changed")


def test_noise_floor_perturbs_each_tensor_by_the_update_s_norm(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from noise_floor import WEIGHTS, perturbed, update_norms, versus
    from safetensors.torch import load_file, save_file

    base = load_file(str(tiny_model_dir / WEIGHTS))
    trained = tmp_path / "trained"
    trained.mkdir()
    moved = {name: t + 1e-3 if name.endswith("weight") else t.clone() for name, t in base.items()}
    save_file(moved, str(trained / WEIGHTS))
    norms = update_norms(tiny_model_dir, trained)
    assert norms and all(v >= 0 for v in norms.values()) and any(v > 0 for v in norms.values())

    first = perturbed(tiny_model_dir, norms, 0, tmp_path / "seed0")
    noisy = load_file(str(first / WEIGHTS))
    for name, tensor in base.items():  # the same norm per tensor, in another (random) direction
        change = noisy[name].double() - tensor.double()
        assert float(change.norm()) == pytest.approx(norms[name], rel=1e-3, abs=1e-9)
    assert (first / "config.json").exists()
    again = load_file(str(perturbed(tiny_model_dir, norms, 0, tmp_path / "seed0-again") / WEIGHTS))
    other = load_file(str(perturbed(tiny_model_dir, norms, 1, tmp_path / "seed1") / WEIGHTS))
    name = next(n for n, v in norms.items() if v > 0)
    assert torch.equal(again[name], noisy[name]) and not torch.equal(other[name], noisy[name])

    got = versus([1, 1, 0, 0, 1], [1, 0, 1, 1, 1])
    assert (got["better"], got["worse"]) == (2, 1) and got["difference"] == pytest.approx(20.0)
    assert got["p_two_sided"] == 1.0  # 2 of 3 changed questions better: nothing
    assert versus([0] * 10, [1] * 10)["p_two_sided"] == pytest.approx(2 / 2**10)


def test_trl_dpo_control_trains_the_iteration_s_training_pairs_at_trl_defaults(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from noise_floor import update_norms
    from trl_dpo import train_plain_dpo, training_rows

    from sleuth.train.mdpo import split_heldout, write_pairs

    pairs = [
        {
            "prompt": [{"role": "user", "content": f"Question {i}?"}],
            "chosen": [{"role": "assistant", "content": f"<answer>yes {i}</answer>"}],
            "rejected": [{"role": "assistant", "content": "I do not know"}],
            "set": "final",
            "question_id": f"q{i // 2}",
            "chosen_reward": 1.0,
            "rejected_reward": 0.0,
        }
        for i in range(8)
    ]
    iteration = tmp_path / "iter1"
    iteration.mkdir()
    write_pairs(iteration / "pairs.jsonl", pairs)
    rows = training_rows(iteration, 0.25, seed=0)
    kept, _ = split_heldout(pairs, 0.25, 0)
    assert len(rows) == len(kept) == 6  # one of four questions held out whole, as the mDPO run split it
    assert rows[0] == {k: kept[0][k] for k in ("prompt", "chosen", "rejected")}  # TRL's columns only

    out = tmp_path / "trl"
    metrics = train_plain_dpo(tiny_model_dir, rows, out, seed=0)
    assert metrics["pairs"] == 6 and metrics["steps"] == 3  # 3 epochs of one batch of 8 (6 pairs)
    assert metrics["config"]["learning_rate"] == "1e-06" and metrics["config"]["beta"] == "0.1"
    assert any(v > 0 for v in update_norms(tiny_model_dir, out).values())
    assert not (tmp_path / "trl.partial").exists()
    assert train_plain_dpo(tiny_model_dir, rows, out, seed=0) == metrics  # done: read back, not trained again


def test_world_pilot_choice_rule_and_group_statistics() -> None:
    from world_pilot import choose_world, group_statistics

    stats = group_statistics([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0], [1.0]])  # the single run is no group
    assert stats == {"groups": 2, "variance": pytest.approx(0.125), "spread": 0.5}
    assert group_statistics([[1.0]]) == {"groups": 0, "variance": None, "spread": None}

    rows = {
        "easy": {"accuracy": 0.8, "variance": 0.2},
        "mid": {"accuracy": 0.3, "variance": 0.1},
        "mid_noisier": {"accuracy": 0.5, "variance": 0.15},
        "hard": {"accuracy": 0.05, "variance": 0.01},
    }
    assert choose_world(rows)["world"] == "mid_noisier" and choose_world(rows)["in_range"]
    none_in_range = {"easy": {"accuracy": 0.8, "variance": 0.2}, "hard": {"accuracy": 0.1, "variance": 0.01}}
    assert choose_world(none_in_range) == {
        "world": "hard",  # 0.1 below the range beats 0.2 above it
        "in_range": False,
        "rule": "accuracy in [0.2, 0.6], then the highest variance",
    }
    with pytest.raises(ValueError):
        choose_world({})


def test_world_pilot_reads_mdpo_groups_from_sampled_runs() -> None:
    from world_pilot import acesearcher_signal

    from tests.test_mdpo import BAD, D_ALT, D_BAD, D_GOOD, GOOD, HALF, WRONG, runs

    rollouts = (
        runs("q1", 0, D_GOOD, [GOOD, BAD, GOOD, HALF])  # rewards 1 0 1 0
        + runs("q1", 1, D_ALT, [GOOD, GOOD, GOOD, GOOD])
        + runs("q1", 2, D_BAD, [(["Ann is a person"], WRONG)] * 4)
    )
    signal = acesearcher_signal(rollouts)
    assert signal["questions"] == 1 and signal["runs"] == 12
    assert signal["accuracy"] == pytest.approx(6 / 12)
    assert signal["solver_groups"] == 3 and signal["solver_spread"] == pytest.approx(1 / 3)
    assert signal["variance"] == signal["solver_variance"] == pytest.approx(0.25 / 3)
    assert signal["decomposition_groups"] == 1 and signal["decomposition_spread"] == 1.0
    assert signal["pairs"]["total"] == 3 and signal["pairs_per_question"] == 3.0


def test_world_pilot_s3_signal_counts_rewarded_episodes_and_the_spread_within_a_question() -> None:
    from world_pilot import s3_signal

    def episode(question: str, reward: float, searches: int = 1, written: bool = True) -> dict[str, Any]:
        return {"question": question, "reward": reward, "searches": searches, "written": written}

    signal = s3_signal([episode("a", 1.0), episode("a", 0.0, 0), episode("b", 0.0), episode("b", 0.0, 2, False)])
    assert signal["questions"] == 2 and signal["episodes"] == 4
    assert signal["accuracy"] == 0.25 and signal["questions_rewarded"] == 0.5
    assert signal["variance"] == pytest.approx(0.125) and signal["spread"] == 0.5
    assert signal["searches"] == 1.0 and signal["no_search"] == 0.25 and signal["nothing_written"] == 0.25
    assert s3_signal([])["episodes"] == 0
    assert signal["gold_given"] is None  # episodes sampled before the field was recorded
    gold = [{**episode("a", 1.0), "gold_given": 1.0}, {**episode("a", 0.0), "gold_given": 1.0}]
    gold += [{**episode("b", 0.0), "gold_given": 0.5}]
    assert s3_signal(gold)["gold_given"] == pytest.approx(2.5 / 3)
    assert s3_signal(gold)["all_gold_given"] == pytest.approx(2 / 3)
    assert s3_signal(gold)["rewarded_with_all_gold"] == 0.5
    gold = [{**e, "selected": n} for e, n in zip(gold, (3, 4, 4), strict=True)]
    assert s3_signal(gold)["all_gold_by_documents"] == {"3": [0, 1], "4": [1, 0]}


def test_world_pilot_keeps_no_world_whose_episodes_failed(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine failure (a dead server) is not a zero reward: the s3 pilot stops and keeps nothing for that world."""
    import argparse

    import world_pilot

    def failing(*_: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rows = [{"question": "q", "sample": 0, "reward": 0.0, "searches": 0, "written": False, "error": "LLMError"}]
        return rows, {"questions": 1, "kept": 1, "dropped": {}, "naive_rag_accuracy": 0.0}

    monkeypatch.setattr(world_pilot, "s3_episodes", failing)
    args = argparse.Namespace(
        work=str(tmp_path / "work"),
        results=str(tmp_path / "results"),
        searcher=str(tiny_model_dir),
        generator=str(tiny_model_dir),
        engine="hf",
        llm_options="threads=1",
        samples=1,
        seed=0,
        temperature=None,
        top_p=None,
        questions=2,
        worlds=["two_hop"],
        low=0.2,
        high=0.6,
        max_turns=2,
        max_selected=3,
        context_order="chronological",
    )
    with pytest.raises(SystemExit, match="1 of 1 episodes failed"):
        world_pilot.s3_pilot(args)
    assert list((tmp_path / "work" / "pilot").glob("*/s3-episodes-*.json")) == []
    assert not (tmp_path / "results" / "results.json").exists()


def test_learn_s3_world_knobs_come_from_the_pilots_worlds_and_its_committed_choice() -> None:
    import argparse

    from learn_s3 import resolve_world, settings, world_knobs
    from world_pilot import RESULTS, WORLDS

    assert world_knobs("") == {} and world_knobs("two_hop") == WORLDS["two_hop"]
    with pytest.raises(SystemExit, match="expected pilot or one of"):
        world_knobs("no_such_world")
    if (RESULTS / "s3" / "results.json").exists():  # the committed pilot's choice, as the benchmark reads it
        assert resolve_world("pilot") == json.loads((RESULTS / "s3" / "results.json").read_text())["choice"]["world"]
    assert resolve_world("base") == "base"
    args = argparse.Namespace(
        seed=0,
        world="two_hop_no_lookalikes",
        rl=[],
        lr=1e-5,
        critic_lr=1e-4,
        smoke=False,
        train_questions=400,
        dev_questions=100,
        test_questions=100,
        steps=2,
        prompts=16,
        searcher_warmup=0,
    )
    world = settings(args)["world"]
    assert world["max_hops"] == 2 and world["lookalike_rate"] == 0.0 and world["min_hops"] == 2
    args.world = ""
    assert "lookalike_rate" not in settings(args)["world"]  # the default world's key is unchanged


def test_world_pilot_samples_s3_episodes_per_world_as_ppo_does_and_reads_them_back(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """benchmarks/world_pilot.py --method s3 end to end on the tiny model (searcher and frozen generator, hf engine):
    real worlds, BM25 indexes, s3's filter and PPO's sampling; each world's episodes are kept and read back."""
    import shutil
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "world_pilot.py"
    generator = shutil.copytree(tiny_model_dir, tmp_path / "generator")
    args = [sys.executable, str(script), "--method", "s3", "--questions", "3", "--samples", "2"]
    args += ["--worlds", "base", "two_hop", "--searcher", str(tiny_model_dir), "--generator", str(generator)]
    args += ["--work", str(tmp_path / "work"), "--results", str(tmp_path / "results"), "--engine", "hf"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / "results" / "results.json").read_text())
    assert set(written["worlds"]) == {"base", "two_hop"} and written["choice"]["world"] in written["worlds"]
    for name, row in written["worlds"].items():
        assert row["data"]["questions"] == 3 and row["episodes"] == 2 * row["data"]["kept"], name
    (kept,) = (tmp_path / "work" / "pilot").glob("base-*/s3-episodes-*.json")
    episodes = json.loads(kept.read_text())["episodes"]
    assert [e["sample"] for e in episodes] == [0, 1] * written["worlds"]["base"]["data"]["kept"]
    assert all(0.0 <= e["gold_given"] <= 1.0 for e in episodes)  # the synthetic questions have gold passages
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "results" / "results.json").read_text())["worlds"] == written["worlds"]
    assert json.loads(kept.read_text())["episodes"] == episodes  # read back, not sampled again


def test_fresh_worlds_declares_first_then_evaluates_each_world_and_refuses_another_declaration(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """benchmarks/fresh_worlds.py end to end on the tiny model (hf engine): real worlds, BM25 indexes and
    generation; the declaration is written before any evaluation and a changed one is refused."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fresh_worlds.py"
    source = Path(__file__).resolve().parents[1] / "docs" / "results" / "learn_acesearcher" / "lr_sweep"
    results = tmp_path / "results"

    def run(claim: str, *extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(script), "--source", str(source), "--before", f"sft={tiny_model_dir}"]
        args += ["--after", f"mdpo-1={tiny_model_dir}", "--claim", claim, "--results", str(results)]
        args += ["--work", str(tmp_path / "work"), "--seeds", "1", "2", "--questions", "2", "--engine", "hf", *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=600)

    done = run("trained > start", "--declare-only")
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads((results / "declaration.json").read_text())
    assert [w["seed"] for w in declared["worlds"]] == [1, 2] and declared["questions_per_world"] == 2
    assert not (results / "results.json").exists() and not (tmp_path / "work" / "eval").exists()
    done = run("trained > start")
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((results / "results.json").read_text())
    assert written["test_questions"] == 4 and set(written["worlds"]) == {"sft@1", "sft@2", "mdpo-1@1", "mdpo-1@2"}
    assert [c["name"] for c in written["claims"]] == ["trained > start"] and written["claims"][0]["n"] == 4
    corpora = {(tmp_path / "work" / f"world-{s}" / "corpus.jsonl").read_text() for s in (1, 2)}
    assert len(corpora) == 2  # two worlds, not one twice
    refused = run("another claim")
    assert refused.returncode != 0 and "declares another test" in refused.stderr
    import shutil

    moved = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")  # the same model in another place: same test
    args = [sys.executable, str(script), "--source", str(source), "--before", f"sft={moved}"]
    args += ["--after", f"mdpo-1={moved}", "--claim", "trained > start", "--results", str(results), "--declare-only"]
    args += ["--work", str(tmp_path / "work"), "--seeds", "1", "2", "--questions", "2", "--engine", "hf"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fresh_worlds_tests_exsearch_models_with_learn_exsearch_s_agent(tmp_path: Path, tiny_model_dir: Path) -> None:
    """fresh_worlds.py on a learn_exsearch source (the committed E-step x4 sweep; tiny model, hf engine): its world
    settings with another seed, its greedy exsearch agent, EM and F1 per question, the claim judged on them."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fresh_worlds.py"
    source = Path(__file__).resolve().parents[1] / "docs" / "results" / "learn_exsearch" / "estep96"
    results = tmp_path / "results"
    args = [sys.executable, str(script), "--source", str(source), "--before", f"warm-up={tiny_model_dir}"]
    args += ["--after", f"em-0={tiny_model_dir}", "--claim", "EM-1 > warm-up", "--results", str(results)]
    args += ["--work", str(tmp_path / "work"), "--seeds", "7", "--questions", "3", "--engine", "hf"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads((results / "declaration.json").read_text())
    assert declared["benchmark"] == "learn_exsearch" and declared["worlds"][0]["train_questions"] == 2000
    assert declared["agent"]["max_steps"] == 4 and declared["claim"]["metric"] == "em"
    written = json.loads((results / "results.json").read_text())
    assert set(written["worlds"]) == {"warm-up@7", "em-0@7"}
    assert set(written["worlds"]["em-0@7"]["per_example"]) == {"em", "f1"}
    assert [(c["name"], c["n"]) for c in written["claims"]] == [("EM-1 > warm-up", 3)]
    assert list((tmp_path / "work" / "eval" / "world-7").glob("em-0-*.traces.jsonl"))  # the agent's traces


def test_fresh_worlds_tests_s3_searchers_with_the_declared_generator_and_adds_gain_beyond_rag(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """fresh_worlds.py on a learn_s3 source (tiny model as both searchers and the frozen generator, hf engine): the
    generator is declared by content hash, each world's evaluation records the searcher's and naive RAG's GenAcc, and
    the declaration adds s3's Gain Beyond RAG claim to the one asked for."""
    import shutil
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fresh_worlds.py"
    source = Path(__file__).resolve().parents[1] / "docs" / "results" / "learn_s3"
    results = tmp_path / "results"
    generator = shutil.copytree(tiny_model_dir, tmp_path / "generator")

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(script), "--source", str(source), "--before", f"warm start={tiny_model_dir}"]
        args += ["--after", f"ppo={tiny_model_dir}", "--claim", "after PPO > warm start", "--results", str(results)]
        args += ["--work", str(tmp_path / "work"), "--seeds", "3", "--questions", "2", "--engine", "hf", *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=600)

    done = run("--generator", str(generator), "--declare-only")
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads((results / "declaration.json").read_text())
    assert declared["benchmark"] == "learn_s3" and declared["claim"]["metric"] == "genacc"
    assert declared["generator"]["path"] == str(generator) and len(declared["generator"]["sha256"]) == 64
    assert declared["also"][0]["before_metric"] == "genacc_naive"
    done = run("--generator", str(generator))
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((results / "results.json").read_text())
    assert set(written["worlds"]) == {"warm start@3", "ppo@3"}
    assert set(written["worlds"]["ppo@3"]["per_example"]) >= {"genacc", "genacc_naive"}
    assert [c["name"] for c in written["claims"]] == ["after PPO > warm start", "ppo > naive RAG"]
    assert all(c["n"] == 2 for c in written["claims"])
    other = tmp_path / "other-generator"
    shutil.copytree(tiny_model_dir, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")  # other bytes, same model
    refused = run("--generator", str(other))  # another generator is another test
    assert refused.returncode != 0 and "declares another test" in refused.stderr
    ace = Path(__file__).resolve().parents[1] / "docs" / "results" / "learn_acesearcher" / "lr_sweep"
    args = [sys.executable, str(script), "--source", str(ace), "--before", f"sft={tiny_model_dir}", "--after"]
    args += [f"mdpo-1={tiny_model_dir}", "--claim", "x", "--results", str(tmp_path / "ace"), "--engine", "hf"]
    args += ["--work", str(tmp_path / "work"), "--seeds", "3", "--questions", "2"]  # world-3 there is s3's
    refused = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "world-3" in refused.stderr  # refused, not evaluated on s3's world


@pytest.mark.slow
def test_learn_arena_confirmation_is_declared_first_and_tests_only_the_declared_run(tmp_path: Path) -> None:
    """benchmarks/learn_arena.py --smoke end to end (tiny random model, hf): a confirmation on a later test slice with
    no dev split and no base evaluation, declared before anything is evaluated; other settings are refused."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learn_arena.py"
    results = tmp_path / "results"

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(script), "--smoke", "--work", str(tmp_path / "work"), "--results", str(results)]
        args += ["--test-start", "3", "--dev-questions", "0", "--skip-base", *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=900)

    done = run("--declare-only")
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads((results / "declaration.json").read_text())
    assert declared["settings"]["eval"]["test_start"] == 3 and declared["settings"]["eval"]["dev_per_file"] == 0
    assert [c["metric"] for c in declared["claims"]] == ["em", "citation_recall", "format_ok"]
    assert not (tmp_path / "work" / "eval").exists() and not (results / "results.json").exists()
    done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((results / "results.json").read_text())
    assert set(written["evaluations"]) == {"test"}  # no dev split
    assert set(written["evaluations"]["test"]) == {"warm start", "GRPO"}  # no base evaluation
    assert written["evaluations"]["test"]["GRPO"]["key"]["start"] == 3
    assert written["declaration"]["declared_at"] == declared["declared_at"]
    assert [c["n"] for c in written["claims"]] == [6, 6, 6]  # 2 questions of each of the three dev files
    preference = written["citation_preference"]["test"]  # the teacher-forced probe of each stage, on the real model
    assert (
        set(preference) == {"word overlap", "warm start", "GRPO"} and preference["GRPO"]["per_example"]["preference"]
    )
    report = (results / "results.md").read_text()
    assert "## Citation preference (teacher-forced)" in report and "| **lacks 1** |" in report
    every = written["every_list"]["test"]  # every list scored, with raw scores, and its prior-free reading
    assert set(every) == {"word overlap", "warm start", "GRPO"} and every["GRPO"]["scores"]
    assert all(len(c) == len(s) for c, s in zip(every["GRPO"]["candidates"], every["GRPO"]["scores"], strict=True))
    assert "| gold first, calibrated |" in report and "GRPO, prior-free: preference" in report
    assert sum(row["episodes"] for row in written["citation_outcomes"].values()) > 0  # the steps' episodes, by match
    pushed = written["citation_advantages"]  # the same episodes' advantages by first cited number
    assert sum(g["groups"] for g in pushed["groups"].values()) > 0 and "| first number cited |" in report
    assert written["warmup_training"]["log"] and "## The warm start's training" in report  # its loss curve, read back
    refused = run("--probe-only")  # would overwrite the full run's report
    assert refused.returncode != 0 and "would overwrite" in refused.stderr
    args = [sys.executable, str(script), "--smoke", "--work", str(tmp_path / "work"), "--probe-only"]
    args += ["--results", str(tmp_path / "probe"), "--test-start", "3", "--dev-questions", "0", "--skip-base"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    probed = json.loads((tmp_path / "probe" / "results.json").read_text())
    tested = probed["citation_preference"]["test"]
    assert probed["probe_only"] and set(tested) == {"word overlap", "base: question likelihood", "warm start"}
    own = probed["citation_preference"]["warm start's own train questions"]  # 4 smoke warm-start questions
    assert set(own) == {"word overlap", "warm start"} and len(own["warm start"]["per_example"]["preference"]) == 4
    assert "**warm start's own train questions**" in (tmp_path / "probe" / "results.md").read_text()  # by place
    assert set(probed["every_list"]["warm start's own train questions"]) == {"word overlap", "warm start"}
    assert probed["every_list"]["test"]["warm start"]["scores"] == every["warm start"]["scores"]  # read back
    read_back = probed["citation_preference"]["test"]["warm start"]  # the full run's probe, found by its key
    assert read_back["per_example"] == preference["warm start"]["per_example"]
    assert "questions 4-5 of each dev file" in (results / "results.md").read_text()
    refused = run("--seed", "1")
    assert refused.returncode != 0 and "declares another test" in refused.stderr


@pytest.mark.slow
def test_learn_arena_world_trains_and_evaluates_on_the_synthetic_world(tmp_path: Path) -> None:
    """benchmarks/learn_arena.py --smoke --world end to end (tiny random model, hf): the warm start, GRPO and the
    evaluations read the synthetic world's splits, never the dev files; --probe-only adds the dev files' slices;
    --warmup-from begins a second warm start at the first one's model (a curriculum)."""
    import subprocess

    from sleuth.data import load_examples

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learn_arena.py"
    work, results = tmp_path / "work", tmp_path / "results"
    args = [sys.executable, str(script), "--smoke", "--world", "--work", str(work), "--skip-base"]
    done = subprocess.run([*args, "--results", str(results)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((results / "results.json").read_text())
    trained = load_examples(next(work.glob("world-*")) / "train.jsonl", limit=8)
    test = written["evaluations"]["test"]["GRPO"]
    assert test["key"]["files"]["file"] == "test" and len(test["per_example"]["em"]) == 6  # 2 x 3, as the files
    assert test["key"]["files"]["world"]["context"] and written["evaluations"]["dev"]["GRPO"]["key"]["start"] == 0
    records = next(work.glob("warmup-*/records.jsonl")).read_text().splitlines()
    asked = [json.loads(r)["messages"][0]["content"] for r in records]  # the world's train questions after GRPO's 4
    assert len(asked) == 4 and all(e.question in a for e, a in zip(trained[4:], asked, strict=True))
    assert "synthetic world's test split" in (results / "results.md").read_text()
    probe = tmp_path / "probe"
    args += ["--probe-only", "--results", str(probe)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    probed = json.loads((probe / "results.json").read_text())["citation_preference"]
    assert set(probed) == {"test", "dev", "real test", "real dev", "warm start's own train questions"}
    assert (
        probed["test"]["warm start"]["per_example"]
        == written["citation_preference"]["test"]["warm start"]["per_example"]
    )  # the full run's probe, read back by its key
    assert len(probed["real test"]["warm start"]["per_example"]["preference"]) > 0
    earlier = next(work.glob("warmup-*/model"))  # a curriculum: a second warm start fine-tunes the first's model
    args = [sys.executable, str(script), "--smoke", "--world", "--skip-base", "--probe-only", "--warmup-from"]
    args += [str(earlier), "--work", str(tmp_path / "next"), "--results", str(tmp_path / "next-probe")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    settings = json.loads((tmp_path / "next-probe" / "results.json").read_text())["settings"]
    assert settings["warmup"]["from"] == str(earlier.resolve())
    trained = json.loads(next((tmp_path / "next").glob("warmup-*/model/sft_config.json")).read_text())
    assert trained["model"] == str(earlier.resolve())  # the SFT began at the earlier warm start, not the base
