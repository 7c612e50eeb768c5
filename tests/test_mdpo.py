"""AceSearcher mDPO: sampling, rewards, the three preference sets, the DPO loss, iterations, resuming."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents import Context
from sleuth.agents.acesearcher import GIVEN_DECOMPOSITION, AceSearcherConfig
from sleuth.llm import LLM
from sleuth.records import Example
from sleuth.runner import run
from sleuth.train import mdpo
from sleuth.train.common import read_examples
from sleuth.train.mdpo import (
    MDPO_KEY,
    MDPOConfig,
    build_dpo_trainer,
    build_pairs,
    load_pairs,
    reference_gate,
    sample_rollouts,
    split_heldout,
    subanswer_agreement,
    train_dpo,
    train_mdpo,
    trajectory_reward,
    write_pairs,
)
from sleuth.train.rollouts import Rollout, RolloutStore
from tests.scripted import ListRetriever, ScriptedLLM, passages

QUESTION = "In which country is the birthplace of Ann?"
D_GOOD = "### Q1: Where was Ann born?\n### Q2: In which country is #1?"
D_ALT = "### Q1: What is the birthplace of Ann?\n### Q2: Which country is #1 in?"
D_BAD = "### Q1: Who is Ann?"
D_UNPARSED = "I would rather not decompose this."
RIGHT = "Ann was born in Paris, which is in France. <answer>France</answer>"
WRONG = "Ann was born in Madrid. <answer>Spain</answer>"
UNTAGGED = "France"


def _fail(_: str) -> str:
    raise RuntimeError("backend down")


def rollout(
    qid: str,
    d: int,
    s: int,
    decomposition: str,
    subanswers: list[str],
    final: str | None,
    answers: tuple[str, ...] = ("France",),
    fail_first_call: bool = False,
) -> Rollout:
    """One trajectory exactly as sample_rollouts stores it, produced by the real agent on scripted replies.

    ``s == 0``: the run that sampled decomposition ``d`` (key ``q#d``); ``s > 0``: a fixed-decomposition run
    (key ``q#d#(s-1)``). ``final=None`` leaves the final call without a reply (the run fails after decomposing).
    """
    example = Example(id=qid, question=QUESTION, answers=list(answers))
    example.metadata[MDPO_KEY] = {"question_id": qid, "decomposition": None if s == 0 else d}
    replies = ([] if s else [decomposition]) + subanswers + ([final] if final is not None else [])
    if s:
        example.id = f"{qid}#{d}"
        example.metadata[GIVEN_DECOMPOSITION] = decomposition
    llm = ScriptedLLM(_fail if fail_first_call else replies)
    ctx = Context(llm=llm, retriever=ListRetriever(passages("Ann was born in Paris.")), config=AceSearcherConfig(k=1))
    ctx.config.parallel = False
    trace = run("acesearcher", [example], ctx, progress=False)[0]
    if s == 0:
        return Rollout(f"{qid}#{d}", qid, d, trace)
    return Rollout(f"{qid}#{d}#{s - 1}", f"{qid}#{d}", s - 1, trace)


def runs(qid: str, d: int, decomposition: str, outcomes: list[tuple[list[str], str | None]]) -> list[Rollout]:
    return [rollout(qid, d, s, decomposition, subs, final) for s, (subs, final) in enumerate(outcomes)]


GOOD = (["Paris", "France"], RIGHT)
BAD = (["Lyon", "Spain"], WRONG)
HALF = (["Paris", "Spain"], WRONG)  # agrees with GOOD on Q1 only


# ------------------------------------------------------------------------------------------------ rewards


def test_reward_is_em_times_format_and_code_reward_is_em_acc_f1() -> None:
    clean = rollout("q", 0, 0, D_GOOD, ["Paris", "France"], RIGHT).trace
    assert trajectory_reward(clean)[0] == 1.0
    untagged = rollout("q", 0, 0, D_GOOD, ["Paris", "France"], UNTAGGED).trace
    reward, checks = trajectory_reward(untagged)
    assert untagged.answer == "France" and reward == 0.0 and not checks["answer_tags"]
    unparsed = rollout("q", 0, 0, D_UNPARSED, ["France"], RIGHT).trace  # the question itself is the sub-question
    reward, checks = trajectory_reward(unparsed)
    assert reward == 0.0 and not checks["decomposition"] and checks["answer_tags"]
    empty_sub = rollout("q", 0, 0, D_GOOD, ["", "France"], RIGHT).trace
    assert trajectory_reward(empty_sub)[1]["subanswers"] is False
    partial = rollout("q", 0, 0, D_GOOD, ["Paris", "France"], "<answer>Paris, France</answer>").trace
    assert trajectory_reward(partial)[0] == 0.0
    # code: EM 0 + Acc 1 ("france" inside "paris france") + set-F1 2/3
    assert trajectory_reward(partial, "code")[0] == pytest.approx(1 + 2 / 3)
    assert trajectory_reward(untagged, "code")[0] == 0.0
    assert trajectory_reward(clean, "code")[0] == 3.0


# ------------------------------------------------------------------------------------------------ pairs


def test_pairs_best_vs_worst_decomposition_subanswers_and_final() -> None:
    rollouts = (
        runs("q1", 0, D_GOOD, [GOOD, BAD, GOOD, HALF])  # mean 0.5, spread: D_subq / D_final pairs
        + runs("q1", 1, D_ALT, [GOOD, GOOD, GOOD, GOOD])  # mean 1.0: best decomposition, tied runs
        + runs("q1", 2, D_BAD, [(["Ann is a person"], WRONG)] * 4)  # mean 0.0: worst, tied runs
    )
    pairs, stats = build_pairs(rollouts, MDPOConfig())
    assert stats["pairs"] == {"decompose": 1, "subq": 1, "final": 1, "total": 3}
    assert stats["degenerate"] == {"solver_tie": 2}
    by_set = {p["set"]: p for p in pairs}

    dec = by_set["decompose"]
    assert dec["chosen"] == [{"role": "assistant", "content": D_ALT}]
    assert dec["rejected"] == [{"role": "assistant", "content": D_BAD}]
    assert (dec["chosen_reward"], dec["rejected_reward"]) == (1.0, 0.0)
    assert dec["prompt"][0]["role"] == "user" and "Please break down the question" in dec["prompt"][0]["content"]
    assert QUESTION in dec["prompt"][0]["content"] and dec["question_id"] == "q1"

    # T+ = run 0 (first of the best); T- among the tied worst runs 1 and 3 = run 3, which agrees with T+ on Q1,
    # so Q1's answers are equal and only Q2 gives a sub-answer pair.
    sub = by_set["subq"]
    assert sub["subquestion"] == 2 and (sub["chosen_key"], sub["rejected_key"]) == ("q1#0", "q1#0#2")
    assert "In which country is Paris?" in sub["prompt"][0]["content"]
    assert (sub["chosen"][0]["content"], sub["rejected"][0]["content"]) == ("France", "Spain")

    final = by_set["final"]
    assert (final["chosen"][0]["content"], final["rejected"][0]["content"]) == (RIGHT, WRONG)
    assert "Answer: Paris" in final["prompt"][0]["content"] and "Wrap your answer" in final["prompt"][0]["content"]
    assert stats["reward_margin"]["all"] == 1.0 and stats["mean_reward"] == pytest.approx(0.5)
    # the diagnosis: every chosen side is the correct one here (decompositions by their runs' mean EM)
    assert (dec["chosen_em"], dec["rejected_em"]) == (1.0, 0.0)
    assert (final["chosen_em"], final["rejected_em"]) == (1.0, 0.0)
    assert stats["pair_correctness"]["all"] == {
        "pairs": 3,
        "chosen_correct": 1.0,
        "rejected_correct": 0.0,
        "chosen_better": 1.0,
        "equal": 0.0,
        "rejected_better": 0.0,
    }

    best_only, _ = build_pairs(rollouts, MDPOConfig(pairs_from="best", pair_sets=("decompose", "final")))
    assert [p["set"] for p in best_only] == ["decompose"]  # the best decomposition's runs are all tied
    canonical, _ = build_pairs(rollouts, MDPOConfig(decomposition_completion="canonical", pair_sets=("decompose",)))
    assert canonical[0]["rejected"][0]["content"] == "### Q1: Who is Ann?"


def test_same_length_decompose_pairs_compare_decompositions_of_equal_steps() -> None:
    rollouts = (
        runs("q1", 0, D_GOOD, [GOOD, BAD, GOOD, HALF])  # 2 sub-questions, mean 0.5
        + runs("q1", 1, D_ALT, [GOOD, GOOD, GOOD, GOOD])  # 2 sub-questions, mean 1.0: best
        + runs("q1", 2, D_BAD, [(["Ann is a person"], WRONG)] * 4)  # 1 sub-question, mean 0.0: worst overall
    )
    paper, stats = build_pairs(rollouts, MDPOConfig(pair_sets=("decompose",)))
    assert (paper[0]["chosen_steps"], paper[0]["rejected_steps"]) == (2, 1)
    assert stats["decompose_steps"] == {
        "chosen": {"2": 1},
        "rejected": {"1": 1},
        "chosen_longer": 1,
        "same_length": 0,
        "chosen_shorter": 0,
    }
    same, stats = build_pairs(rollouts, MDPOConfig(pair_sets=("decompose",), decompose_pairs="same_length"))
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in same] == [(D_ALT, D_GOOD)]
    assert (same[0]["chosen_reward"], same[0]["rejected_reward"]) == (1.0, 0.5)
    assert stats["decompose_steps"]["same_length"] == 1 and stats["decompose_steps"]["chosen_longer"] == 0
    # no other decomposition as long as the best: no pair, counted
    lone = runs("q2", 0, D_ALT, [GOOD] * 4) + runs("q2", 1, D_BAD, [(["Ann is a person"], WRONG)] * 4)
    none, stats = build_pairs(lone, MDPOConfig(pair_sets=("decompose",), decompose_pairs="same_length"))
    assert none == [] and stats["degenerate"]["decompose_no_same_length"] == 1
    with pytest.raises(ValueError, match="decompose_pairs"):
        MDPOConfig(decompose_pairs="shortest").validate()  # type: ignore[arg-type]


def _greedy_replies(decompose: str, subq: str, final: str) -> Callable[[str], str]:
    """A policy whose greedy output depends only on which call a prompt is (the prompts say it)."""

    def respond(prompt: str) -> str:
        if "Please break down the question" in prompt:
            return decompose
        return final if "Wrap your answer" in prompt else subq

    return respond


def test_on_policy_pairs_take_the_greedy_output_as_rejected_or_drop_the_pair(tmp_path: Path) -> None:
    rollouts = (
        runs("q1", 0, D_GOOD, [GOOD, BAD, GOOD, HALF])
        + runs("q1", 1, D_ALT, [GOOD, GOOD, GOOD, GOOD])
        + runs("q1", 2, D_BAD, [(["Ann is a person"], WRONG)] * 4)
    )
    pairs, _ = build_pairs(rollouts, MDPOConfig())
    examples = mdpo._examples(rollouts)
    agent = AceSearcherConfig(k=1)
    # a policy that already decodes the chosen side everywhere: every pair goes (DPO would push down text it never
    # produces); the greedy output is compared by answer, so other wording of the same answer counts as chosen
    agrees = ScriptedLLM(_greedy_replies(D_ALT, " france ", "It is France. <answer>France</answer>"))
    greedy = mdpo.greedy_outputs(pairs, agrees, agent, tmp_path / "agrees.jsonl")
    assert len(greedy) == 3 and all(s.temperature == 0.0 for s in agrees.samplings)
    assert sorted(s.max_new_tokens for s in agrees.samplings) == [512, 512, 512]
    kept, counts = mdpo.on_policy_pairs(pairs, greedy, agent, examples)
    assert kept == []
    assert counts == {"decompose_greedy_is_chosen": 1, "final_greedy_is_chosen": 1, "subq_greedy_is_chosen": 1}

    # a policy that decodes wrong answers: they become the rejected sides; the decompose pair keeps its sampled one
    wrong_final = "Paris is in Italy. <answer>Italy</answer>"
    errs = ScriptedLLM(_greedy_replies(D_GOOD, "Italy", wrong_final))
    greedy = mdpo.greedy_outputs(pairs, errs, agent, tmp_path / "errs.jsonl")
    kept, counts = mdpo.on_policy_pairs(pairs, greedy, agent, examples)
    assert counts == {"decompose_kept_sampled": 1, "final_greedy_rejected": 1, "subq_greedy_rejected": 1}
    by_set = {p["set"]: p for p in kept}
    assert by_set["decompose"] == next(p for p in pairs if p["set"] == "decompose")
    assert by_set["subq"]["rejected"] == [{"role": "assistant", "content": "Italy"}]
    assert by_set["subq"]["rejected_source"] == "greedy" and by_set["subq"]["rejected_em"] is None
    assert by_set["final"]["rejected"][0]["content"] == wrong_final and by_set["final"]["rejected_em"] == 0.0
    assert by_set["final"]["chosen"] == next(p for p in pairs if p["set"] == "final")["chosen"]
    # pair_correctness leaves out the subq pair, whose greedy side has no EM of its own
    assert mdpo.pair_correctness(kept)["all"]["pairs"] == 2

    # the file is the cache: a rerun generates nothing; a torn last line (a killed run) is generated again
    again = ScriptedLLM([])
    assert mdpo.greedy_outputs(pairs, again, agent, tmp_path / "errs.jsonl") == greedy and again.requests == []
    path = tmp_path / "errs.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    redo = ScriptedLLM(_greedy_replies(D_GOOD, "Italy", wrong_final))
    assert mdpo.greedy_outputs(pairs, redo, agent, path) == greedy and len(redo.requests) == 1
    assert mdpo.load_greedy(path) == greedy  # the rows written after the torn one are readable
    # a prompt without a greedy output keeps its sampled pair, counted
    kept, counts = mdpo.on_policy_pairs(pairs, {}, agent, examples)
    assert kept == pairs and counts == {"decompose_no_greedy": 1, "final_no_greedy": 1, "subq_no_greedy": 1}


def test_rejected_option_is_checked() -> None:
    with pytest.raises(ValueError, match="rejected="):
        MDPOConfig(rejected="worst").validate()  # type: ignore[arg-type]


def test_pair_correctness_finds_pairs_whose_rejected_side_was_right_too() -> None:
    """Under the paper's reward (EM x format) an untagged but correct final answer scores 0: the pair it loses is
    counted as ``equal`` by EM, a pair that teaches the format, not the answer."""
    rollouts = runs("q1", 0, D_GOOD, [GOOD, (["Paris", "France"], UNTAGGED)]) + runs("q1", 1, D_ALT, [BAD, BAD])
    pairs, stats = build_pairs(rollouts, MDPOConfig(pair_sets=("final",)))
    assert [(p["chosen_em"], p["rejected_em"]) for p in pairs] == [(1.0, 1.0)]
    assert stats["pair_correctness"]["final"]["equal"] == 1.0 and stats["pair_correctness"]["final"]["pairs"] == 1
    train, held = split_heldout(_pairs(3), 0.5, seed=0)
    assert (
        len(train) == 1
        and len(held) == 2
        and {p["question_id"] for p in train}.isdisjoint(p["question_id"] for p in held)
    )
    assert split_heldout(_pairs(3), 0.0, seed=0) == (_pairs(3), [])
    assert len(split_heldout(_pairs(3), 0.99, seed=0)[0]) == 1  # one question always trains


def test_ties_are_dropped_and_counted() -> None:
    rollouts = runs("q2", 0, D_GOOD, [BAD, BAD]) + runs("q2", 1, D_ALT, [HALF, BAD])
    pairs, stats = build_pairs(rollouts)
    assert pairs == [] and stats["degenerate"] == {"decompose_tie": 1, "solver_tie": 2}
    margin, _ = build_pairs(runs("q3", 0, D_GOOD, [GOOD, BAD]) + runs("q3", 1, D_ALT, [BAD, BAD]), MDPOConfig())
    assert [p["set"] for p in margin] == ["decompose", "subq", "subq", "final"]
    gated, stats = build_pairs(
        runs("q3", 0, D_GOOD, [GOOD, BAD]) + runs("q3", 1, D_ALT, [BAD, BAD]), MDPOConfig(min_margin=0.5)
    )
    assert [p["set"] for p in gated] == ["subq", "subq", "final"]  # decomposition gap 0.5 is not > 0.5
    assert stats["degenerate"]["decompose_below_margin"] == 1


def test_reference_gates_at_their_boundaries() -> None:
    """The released create_dpo_pairs.py (digest §4.4), on its EM + Acc + F1 scale: decomposition pairs need a mean
    reward margin of at least 1.33 with the loser at most 1; sub-answer / final pairs a margin above 1.33 with the
    loser at most 1.2. The issue's one-line predicate "(>= 1.33 and <= 1) or (> 1.33 and <= 1.2)" is their union."""
    assert reference_gate("decompose", 1.33, 1.0)  # margin exactly 1.33, loser 1.0: accepted
    assert not reference_gate("answer", 1.33, 1.0)  # ... but the answer gate wants strictly above 1.33
    assert not reference_gate("decompose", 1.33, 1.1) and not reference_gate("answer", 1.33, 1.1)
    assert reference_gate("answer", 1.34, 1.1) and not reference_gate("decompose", 1.34, 1.1)
    assert reference_gate("answer", 1.34, 1.2) and not reference_gate("answer", 1.34, 1.2001)
    assert not reference_gate("answer", 1.7, 1.3) and not reference_gate("decompose", 1.7, 1.3)  # loser 1.3
    assert reference_gate("decompose", 3.0, 0.0) and reference_gate("answer", 3.0, 0.0)
    assert not reference_gate("decompose", 1.3299, 0.0) and not reference_gate("answer", 1.33, 0.0)
    for margin, loser in [(1.33, 1.0), (1.33, 1.1), (1.34, 1.1), (1.34, 1.3), (1.33, 0.5), (2.0, 1.2), (2.0, 1.21)]:
        union = reference_gate("decompose", margin, loser) or reference_gate("answer", margin, loser)
        assert union == ((margin >= 1.33 and loser <= 1) or (margin > 1.33 and loser <= 1.2))
    with pytest.raises(ValueError, match="gate"):
        reference_gate("final", 2.0, 0.0)  # type: ignore[arg-type]


D3 = "### Q1: Which city is first?\n### Q2: Which city is second?\n### Q3: Which city is third?"
D5 = D3 + "\n### Q4: Which city is fourth?\n### Q5: Which city is fifth?"
CITIES = ["Paris", "Lyon", "Rome", "Oslo", "Bern"]
PARTIAL = (["Paris", "France"], "Ann was born in Paris. <answer>Paris, France</answer>")  # code score 1 + 2/3


def _reference_rollouts() -> list[Rollout]:
    return (
        # q1: decompositions r̄ 1.5 / 2.33 / 0: d1 vs d2 passes the decomposition gate; d0's runs 3 vs 0 pass
        # the answer gate and T- (run 3) agrees with T+ on both sub-answers; d1's runs 3 vs 1.67 fail it
        runs("q1", 0, D_GOOD, [GOOD, BAD, GOOD, (["Paris", "France"], WRONG)])
        + runs("q1", 1, D_ALT, [GOOD, PARTIAL])
        + runs("q1", 2, D_BAD, [(["Ann is a person"], WRONG)] * 2)
        # q2: r̄ 3.0 vs 1.67: margin 1.33 but the loser is above 1
        + runs("q2", 0, D_GOOD, [GOOD, GOOD])
        + runs("q2", 1, D_ALT, [PARTIAL, PARTIAL])
        # q3 / q4 / q5: T- agrees with T+ on 3 of 5 (0.6), 4 of 5 (0.8), 2 of 3 (0.667) sub-answers
        + runs("q3", 0, D5, [(CITIES, RIGHT), ([*CITIES[:3], "Kyiv", "Riga"], WRONG)])
        + runs("q4", 0, D5, [(CITIES, RIGHT), ([*CITIES[:4], "Riga"], WRONG)])
        + runs("q5", 0, D3, [(CITIES[:3], RIGHT), ([*CITIES[:2], "Riga"], WRONG)])
        # q6: r̄ 3.0 vs 1.11: margin above 1.33 and loser <= 1.2 would pass the answer gate, not this one
        + runs("q6", 0, D_GOOD, [GOOD, GOOD])
        + runs("q6", 1, D_ALT, [PARTIAL, PARTIAL, (["Paris", "France"], WRONG)])
    )


def test_reference_pair_rule_applies_the_released_gates_and_agreement() -> None:
    rollouts = _reference_rollouts()
    pairs, stats = build_pairs(rollouts, MDPOConfig(reward="code", pair_rule="reference"))
    assert stats["pair_rule"] == "reference"
    assert stats["pairs"] == {"decompose": 1, "subq": 4, "final": 4, "total": 9}
    assert stats["degenerate"] == {
        "decompose_reference_gate": 2,  # q2 (loser 1.67), q6 (loser 1.11)
        "decompose_single_decomposition": 3,  # q3, q4, q5
        "final_low_agreement": 1,  # q3: similarity 0.6 < 0.666
        "solver_reference_gate": 1,  # q1 d1: margin 1.33 (not above), loser 1.67
        "solver_tie": 4,
        "subq_no_difference": 2,
    }
    finals = {p["question_id"]: p for p in pairs if p["set"] == "final"}
    assert sorted(finals) == ["q1", "q4", "q5", "q6"]  # 1.0, 0.8, 0.667 agreement accepted; q3's 0.6 rejected
    assert (finals["q1"]["chosen_key"], finals["q1"]["rejected_key"]) == ("q1#0", "q1#0#2")
    decompose = next(p for p in pairs if p["set"] == "decompose")
    assert decompose["chosen"][0]["content"] == D_ALT and decompose["rejected"][0]["content"] == D_BAD
    assert (decompose["chosen_reward"], decompose["rejected_reward"]) == (pytest.approx(7 / 3), 0.0)
    subq = sorted((p["question_id"], p["subquestion"]) for p in pairs if p["set"] == "subq")
    assert subq == [("q3", 4), ("q3", 5), ("q4", 5), ("q5", 3)]  # the gate passed: sub-answer pairs stay

    paper, stats = build_pairs(rollouts, MDPOConfig(reward="code"))  # the same runs under the paper's rule
    assert stats["pair_rule"] == "paper" and stats["pairs"] == {"decompose": 3, "subq": 4, "final": 6, "total": 13}


@pytest.mark.parametrize(
    ("winner", "loser", "reference", "normalised"),
    [
        ("Paris", "Paris.", 0.0, 1.0),  # the reference compares lower().strip(): the full stop differs
        ("The Beatles", "Beatles", 0.0, 1.0),  # the normaliser drops articles
        ("U.S.", "US", 0.0, 1.0),  # ... and punctuation
        ("3", "three", 1.0, 0.0),  # the reference maps "0".."10" to words on both sides
    ],
)
def test_sub_answer_agreement_under_both_rules(winner: str, loser: str, reference: float, normalised: float) -> None:
    """The four audited cases that flip: a second sub-question agreeing under both rules makes the share 1/2 or 2/2,
    either side of the 0.666 gate."""
    assert subanswer_agreement({1: winner}, {1: loser}, "reference") == reference
    assert subanswer_agreement({1: winner}, {1: loser}, "normalised") == normalised
    pair = ({1: winner, 2: "France"}, {1: loser, 2: "france "})
    assert subanswer_agreement(*pair, "reference") == (1 + reference) / 2
    assert subanswer_agreement(*pair, "normalised") == (1 + normalised) / 2


def test_reference_agreement_counts_the_losing_run_s_sub_questions() -> None:
    winner, loser = {1: "Ann", 2: "Paris", 3: "France"}, {1: "ann"}
    assert subanswer_agreement(winner, loser, "reference") == 1.0  # 1 of the loser's 1
    assert subanswer_agreement(winner, loser, "normalised") == pytest.approx(1 / 3)  # 1 of the 3 in either run
    assert subanswer_agreement({2: "Paris"}, {1: "Paris"}, "reference") == 0.0  # the winner lacks Q1
    assert subanswer_agreement(winner, {}, "reference") == 0.0
    assert MDPOConfig().agreement == "reference"  # the paper defines no agreement: the released code's rule
    with pytest.raises(ValueError, match="agreement"):
        dataclasses.replace(MDPOConfig(), agreement="exact").validate()  # type: ignore[arg-type]


def test_reference_pair_rule_needs_the_code_reward() -> None:
    assert MDPOConfig().pair_rule == "paper"  # the paper's rule (drop ties) is the default
    with pytest.raises(ValueError, match="reward='code'"):
        MDPOConfig(pair_rule="reference").validate()
    with pytest.raises(ValueError, match="min_margin"):
        MDPOConfig(reward="code", pair_rule="reference", min_margin=0.5).validate()
    with pytest.raises(ValueError, match="pair_rule"):
        MDPOConfig(pair_rule="bogus").validate()  # type: ignore[arg-type]
    MDPOConfig(reward="code", pair_rule="reference").validate()


def test_later_learning_rate_is_off_by_default_and_positive() -> None:
    assert MDPOConfig().later_learning_rate is None  # the paper: one rate for every iteration
    assert mdpo.iteration_config(MDPOConfig(learning_rate=2e-5), 2).learning_rate == 2e-5
    later = MDPOConfig(learning_rate=2e-5, later_learning_rate=5e-6)
    assert [mdpo.iteration_config(later, t).learning_rate for t in (1, 2, 3)] == [2e-5, 5e-6, 5e-6]
    with pytest.raises(ValueError, match="later_learning_rate"):
        MDPOConfig(later_learning_rate=0.0).validate()


def test_degenerate_groups_are_counted_not_fatal() -> None:
    rollouts = [
        rollout("q4", 0, 0, D_GOOD, [], None, fail_first_call=True),  # failed before decomposing
        rollout("q4", 1, 0, D_UNPARSED, ["France"], RIGHT),  # unparsed: reward 0 however right
        rollout("q4", 1, 1, D_UNPARSED, ["Spain"], WRONG),
        rollout("q4", 2, 0, D_GOOD, ["Paris", "France"], None),  # failed after decomposing
        rollout("q4", 2, 1, D_GOOD, ["Paris", "France"], RIGHT),
        # identical final outputs with different rewards (an empty sub-answer breaks the format)
        rollout("q4", 2, 2, D_GOOD, ["", "France"], RIGHT),
        # q5: both sampled decompositions are the same text: merged into one, no decomposition pair
        *runs("q5", 0, D_GOOD, [GOOD]),
        *runs("q5", 1, D_GOOD, [BAD]),
    ]
    pairs, stats = build_pairs(rollouts)
    degenerate = stats["degenerate"]
    assert degenerate["failed_runs"] == 2 and stats["failed_runs"] == 2
    assert degenerate["no_decomposition"] == 1 and degenerate["unparsed_decomposition"] == 1
    assert degenerate["final_identical_completions"] == 1
    assert degenerate["duplicate_decomposition"] == 1 and degenerate["decompose_single_decomposition"] == 1
    assert degenerate["solver_tie"] == 1  # q4's unparsed decomposition: both runs score 0
    sets = sorted(p["set"] for p in pairs)
    # q4: decomposition 2 (mean 1/2) vs 1 (0), its sub-answer pair ("Paris" vs ""); q5: the merged group's pairs
    assert sets == ["decompose", "final", "subq", "subq", "subq"]
    subq = [p for p in pairs if p["set"] == "subq" and p["question_id"] == "q4"][0]
    assert (subq["chosen"][0]["content"], subq["rejected"][0]["content"]) == ("Paris", "")
    assert stats["questions"] == 2 and stats["trajectories"] == 8


def test_pairs_jsonl_is_trl_conversational(tmp_path: Path) -> None:
    from trl.data_utils import is_conversational

    pairs, _ = build_pairs(runs("q1", 0, D_GOOD, [GOOD, BAD]) + runs("q1", 1, D_ALT, [BAD, BAD]))
    path = write_pairs(tmp_path / "pairs.jsonl", pairs)
    loaded = load_pairs(path)
    assert loaded == pairs and all(is_conversational(p) for p in loaded)
    for pair in loaded:
        assert {"prompt", "chosen", "rejected", "set", "question_id", "chosen_reward", "rejected_reward"} <= set(pair)
        assert [m["role"] for m in pair["chosen"] + pair["rejected"]] == ["assistant", "assistant"]


# ------------------------------------------------------------------------------------------------ sampling


def scripted_policy(seed: int = 0) -> Callable[[str], str]:
    """A stochastic stand-in for the policy: decompositions, sub-answers and final answers vary per call."""
    rng = random.Random(seed)

    def respond(prompt: str) -> str:
        if "Please break down the question" in prompt:
            return rng.choice([D_GOOD, D_ALT, D_BAD, D_UNPARSED])
        if "using the context as reference" in prompt:
            return rng.choice(["Paris", "Lyon", "France", "Spain"])
        return rng.choice([RIGHT, WRONG, UNTAGGED])

    return respond


def test_sampling_fixes_the_decomposition_and_resumes(tmp_path: Path) -> None:
    examples = [Example(id=f"q{i}", question=QUESTION, answers=["France"]) for i in range(2)]
    config = MDPOConfig(decompositions=3, solutions=4)
    llm = ScriptedLLM(scripted_policy())
    ctx = Context(llm=llm, retriever=ListRetriever(passages("Ann was born in Paris.")), config=config.rollout_agent())
    store = RolloutStore(tmp_path / "store", producer={"method": "acesearcher"})
    assert sample_rollouts(examples, ctx, store, 3, 4) == 2 * 3 * 4
    decompose_calls = [p for p in llm.prompts if "Please break down" in p]
    assert len(decompose_calls) == 2 * 3  # m per question; the fixed-decomposition runs make none
    assert {s.temperature for s in llm.samplings} == {1.0}
    rollouts = {r.key: r for r in store}
    assert "q0#2#2" in rollouts and len(rollouts) == 24
    for key, r in rollouts.items():
        step = r.trace.steps[0]
        assert step.kind == "decompose"
        if key.count("#") == 2:  # fixed: same text as the run that sampled it, no prompt
            source = rollouts[key.rsplit("#", 1)[0]].trace.steps[0]
            assert step.meta.get("given") and step.messages is None and step.output == source.output
            assert step.parsed == source.parsed
        else:
            assert step.messages is not None and not step.meta.get("given")
    calls = len(llm.prompts)
    assert sample_rollouts(examples, ctx, store, 3, 4) == 0 and len(llm.prompts) == calls
    _, stats = build_pairs(store)
    assert stats["trajectories"] == 24 and stats["questions"] == 2


# ------------------------------------------------------------------------------------------------ DPO


def _pairs(n: int = 2) -> list[dict[str, Any]]:
    base = [
        ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet.", "Paris is a city."),
        ("What is the capital of France?", "<answer>Paris</answer>", "The answer is forty two."),
        ("Search the corpus.", "Read the passages.", "No."),
    ]
    return [
        {
            "prompt": [{"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
            "set": "final",
            "question_id": f"q{i}",
            "chosen_reward": 1.0,
            "rejected_reward": 0.0,
        }
        for i, (q, c, r) in enumerate(base[:n])
    ]


def _completion_logp(model: Any, tokenizer: Any, prompt: list[dict], completion: list[dict]) -> tuple[float, int]:
    """Summed log-probability of the completion tokens, computed independently of TRL."""
    import torch

    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
    ids = tokenizer(full_text, add_special_tokens=False).input_ids
    assert ids[: len(prompt_ids)] == prompt_ids
    tensor = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tensor).logits[0, :-1].float()
    logps = logits.log_softmax(-1).gather(1, tensor[0, 1:, None])[:, 0]
    completion_logps = logps[len(prompt_ids) - 1 :]
    return completion_logps.sum().item(), len(completion_logps)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-ref"), seed=1)


def test_dpo_loss_is_the_formula_on_summed_completion_logprobs(
    tmp_path: Path, tiny_model_dir: Path, reference_dir: Path
) -> None:
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = _pairs(2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    beta = 0.1
    expected, nll = [], []
    for pair in pairs:
        pc, nc = _completion_logp(policy, tokenizer, pair["prompt"], pair["chosen"])
        pr, _ = _completion_logp(policy, tokenizer, pair["prompt"], pair["rejected"])
        rc, _ = _completion_logp(reference, tokenizer, pair["prompt"], pair["chosen"])
        rr, _ = _completion_logp(reference, tokenizer, pair["prompt"], pair["rejected"])
        z = beta * ((pc - rc) - (pr - rr))
        expected.append(-math.log(1 / (1 + math.exp(-z))))
        nll.append(-pc / nc)

    config = MDPOConfig(beta=beta, per_device_batch_size=2, progress=False)
    trainer = build_dpo_trainer(config, tiny_model_dir, pairs, tmp_path / "t", reference=reference_dir)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    loss = trainer.compute_loss(trainer.model, batch).item()
    assert loss == pytest.approx(sum(expected) / 2, rel=1e-4)

    # the chosen-NLL term with one pair per micro-batch: LLaMA-Factory's pref_ftx (per-sequence mean token NLL)
    config = MDPOConfig(beta=beta, per_device_batch_size=1, nll_weight=0.5, progress=False)
    trainer = build_dpo_trainer(config, tiny_model_dir, pairs[:1], tmp_path / "t2", reference=reference_dir)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    loss = trainer.compute_loss(trainer.model, batch).item()
    assert loss == pytest.approx(expected[0] + 0.5 * nll[0], rel=1e-4)


def test_parameters_change_after_a_dpo_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = MDPOConfig(learning_rate=1e-3, max_steps=1, batch_size=2, per_device_batch_size=2, warmup_ratio=0.0)
    config.progress = False
    metrics = train_dpo(config, tiny_model_dir, _pairs(2), tmp_path / "iter1")
    assert metrics["trained"] and metrics["steps"] == 1 and metrics["reference"] == str(tiny_model_dir)
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "iter1" / "model").state_dict()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and len(changed) >= len(before) // 2
    assert not (tmp_path / "iter1" / "trainer").exists() and not (tmp_path / "iter1" / "model.partial").exists()
    saved = json.loads((tmp_path / "iter1" / "train_metrics.json").read_text())
    assert saved["steps"] == 1 and saved["accuracy"] is not None
    assert saved["heldout"] is None


def test_heldout_pairs_give_the_implicit_reward_curve(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = MDPOConfig(
        learning_rate=1e-3,
        max_steps=2,
        batch_size=1,
        per_device_batch_size=1,
        warmup_ratio=0.0,
        heldout_pairs=0.5,
        heldout_eval_steps=1,
        progress=False,
    )
    metrics = train_dpo(config, tiny_model_dir, _pairs(3), tmp_path / "iter1")
    assert metrics["pairs"] == 1 and metrics["steps"] == 2
    held = metrics["heldout"]
    assert held["pairs"] == 2 and held["questions"] == 2
    assert [point["step"] for point in held["curve"]] == [1, 2]
    for point in held["curve"]:
        assert {"loss", "accuracy", "margin", "logps_chosen", "logps_rejected"} <= point.keys()
    # the policy moved away from the reference: the held-out implicit rewards are no longer 0
    assert held["curve"][-1]["margin"] != 0.0
    with pytest.raises(ValueError, match="heldout_pairs"):
        MDPOConfig(heldout_pairs=1.0).validate()


# ------------------------------------------------------------------------------------------------ iterations


def _write_examples(path: Path, n: int, prefix: str) -> str:
    rows = [Example(id=f"{prefix}{i}", question=QUESTION, answers=["France"]).to_dict() for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class Factory:
    """Makes a scripted 'policy' for a model directory and remembers which directories were asked for."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self.llms: list[ScriptedLLM] = []

    def __call__(self, path: Path) -> LLM:
        self.paths.append(Path(path))
        llm = ScriptedLLM(scripted_policy(seed=len(self.paths)))
        self.llms.append(llm)
        return llm


def _run_config(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> MDPOConfig:
    config = MDPOConfig(
        model=str(tiny_model_dir),
        output_dir=str(tmp_path / "run"),
        train_file=_write_examples(tmp_path / "train.jsonl", 4, "t"),
        dev_file=_write_examples(tmp_path / "dev.jsonl", 2, "d"),
        decompositions=2,
        solutions=3,
        iterations=2,
        batch_size=2,
        per_device_batch_size=2,
        max_steps=1,  # one optimizer step per iteration keeps the tests fast
        warmup_ratio=0.0,
        learning_rate=1e-3,
        max_length=512,
        progress=False,
        agent=AceSearcherConfig(k=1),
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_reference_of_each_iteration_is_the_previous_policy(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    seen: list[dict[str, Any]] = []
    real = mdpo.build_dpo_trainer

    def spy(config: MDPOConfig, policy: Path, pairs: list, output_dir: Path, **options: Any) -> Any:
        trainer = real(config, policy, pairs, output_dir, **options)
        seen.append(
            {
                "policy": Path(policy),
                "learning_rate": trainer.args.learning_rate,
                "ref": {k: v.clone() for k, v in trainer.ref_model.state_dict().items()},
                "start": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            }
        )
        return trainer

    monkeypatch.setattr(mdpo, "build_dpo_trainer", spy)
    factory = Factory()
    retriever = ListRetriever(passages("Ann was born in Paris."))
    config = _run_config(tmp_path, tiny_model_dir, later_learning_rate=1e-4)
    summary = train_mdpo(config, llm_factory=factory, retriever=retriever)
    run_dir = tmp_path / "run"
    iter1, iter2 = run_dir / "iter1" / "model", run_dir / "iter2" / "model"
    assert summary["final_model"] == str(iter2) and len(seen) == 2
    assert [s["learning_rate"] for s in seen] == [1e-3, 1e-4]  # the later rate from iteration 2 on
    # sampling with the newest model: θ(1) samples (and is evaluated), θ(2) = iter1/model is evaluated and samples
    assert factory.paths == [tiny_model_dir, iter1, iter1, iter2]
    assert seen[0]["policy"] == tiny_model_dir and seen[1]["policy"] == iter1
    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    theta2 = AutoModelForCausalLM.from_pretrained(iter1).state_dict()
    for name, value in theta2.items():
        assert torch.equal(seen[0]["ref"][name], tiny[name]) and torch.equal(seen[0]["start"][name], tiny[name])
        assert torch.equal(seen[1]["ref"][name], value) and torch.equal(seen[1]["start"][name], value)
    assert any(not torch.equal(tiny[n], theta2[n]) for n in tiny)
    for t, policy in ((1, tiny_model_dir), (2, iter1)):
        stats = json.loads((run_dir / f"iter{t}" / "stats.json").read_text())
        assert stats["reference"] == stats["policy"] == str(policy) and stats["pairs"]["total"] > 0
        assert stats["dpo"]["trained"] and stats["dpo"]["accuracy"] is not None
        assert stats["dpo"]["learning_rate"] == (1e-3 if t == 1 else 1e-4)
        assert stats["dev"]["n"] == 2 and stats["rollouts"] == 4 * 2 * 3
        assert (run_dir / f"iter{t}" / "pairs.jsonl").exists()
        producer = json.loads((run_dir / f"iter{t}" / "rollouts" / "store.json").read_text())
        assert producer["model"] == str(policy) and producer["model_revision"]
        assert producer["config"]["sampling"]["temperature"] == 1.0
    assert "dev_initial" in json.loads((run_dir / "iter1" / "stats.json").read_text())
    assert [i["iteration"] for i in json.loads((run_dir / "summary.json").read_text())["iterations"]] == [1, 2]


class Killed(BaseException):
    pass


def test_a_killed_run_resumes_without_resampling(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def kill(*args: Any, **kwargs: Any) -> Any:
        raise Killed

    retriever = ListRetriever(passages("Ann was born in Paris."))
    config = _run_config(tmp_path, tiny_model_dir, iterations=1)
    with monkeypatch.context() as patch:
        patch.setattr(mdpo, "build_pairs", kill)  # killed right after iteration 1's rollouts
        with pytest.raises(Killed):
            train_mdpo(config, llm_factory=Factory(), retriever=retriever)
    store_file = tmp_path / "run" / "iter1" / "rollouts" / "rollouts.jsonl"
    lines = store_file.read_text().splitlines(keepends=True)
    assert len(lines) == 4 * 2 * 3 and not (tmp_path / "run" / "iter1" / "model").exists()
    store_file.write_text("".join(lines[:-2]) + lines[-2][:30])  # and, as if mid-write, lose two rollouts

    factory = Factory()
    train_mdpo(config, llm_factory=factory, retriever=retriever)
    sampler = factory.llms[0]
    assert 0 < len(sampler.prompts) <= 2 * 4  # only the two lost fixed-decomposition runs were sampled again
    assert not any("Please break down" in p for p in sampler.prompts)
    keys = [json.loads(line)["key"] for line in store_file.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 4 * 2 * 3
    assert (tmp_path / "run" / "iter1" / "model").exists() and (tmp_path / "run" / "iter1" / "stats.json").exists()

    # a finished iteration is skipped on a rerun: no sampling, no training
    again = Factory()
    summary = train_mdpo(config, llm_factory=again, retriever=retriever)
    assert again.paths == [] and summary["iterations"][0]["iteration"] == 1


def _samples_its_own(config: MDPOConfig, out: Path, first: MDPOConfig, retriever: Any) -> dict[str, Any]:
    """Run ``config`` in ``out`` with ``rollouts_from`` = ``first``'s run; assert it copied nothing and sampled its
    own rollouts; its iteration-1 stats."""
    config.output_dir, config.rollouts_from = str(out), first.output_dir
    factory = Factory()
    train_mdpo(config, llm_factory=factory, retriever=retriever)
    assert factory.llms[0].prompts
    stats = json.loads((out / "iter1" / "stats.json").read_text())
    assert "rollouts_reused_from" not in stats
    return stats


def test_another_dpo_setting_reuses_the_first_runs_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    retriever = ListRetriever(passages("Ann was born in Paris."))
    first = _run_config(tmp_path, tiny_model_dir, iterations=1, eval_initial=False)
    train_mdpo(first, llm_factory=Factory(), retriever=retriever)
    first_store = tmp_path / "run" / "iter1" / "rollouts" / "rollouts.jsonl"
    store = RolloutStore(first_store.parent)
    train = [Example.from_dict(json.loads(line)) for line in Path(first.train_file).read_text().splitlines()]
    assert mdpo.pending_rollouts(train, store, 2, 3) == 0
    steps = [mdpo._decompose_step(r.trace) for r in store if r.key.count("#") == 1]
    decomposed = sum(1 for step in steps if step is not None and step.output is not None)
    assert decomposed > 0
    assert mdpo.pending_rollouts(train, store, 2, 4) == decomposed  # one more solver run per decomposition
    assert mdpo.pending_rollouts(train, store, 3, 3) == len(train)  # a third decomposition per question

    # another learning rate on the same starting model: iteration 1 trains on the first run's samples
    second = _run_config(
        tmp_path, tiny_model_dir, iterations=1, eval_initial=False, learning_rate=5e-4, rollouts_from=first.output_dir
    )
    second.output_dir = str(tmp_path / "run-lr")
    factory = Factory()
    train_mdpo(second, llm_factory=factory, retriever=retriever)
    # nothing to sample, so no sampling engine is started: the only model opened is the trained one, for dev
    assert factory.paths == [tmp_path / "run-lr" / "iter1" / "model"]
    reused = tmp_path / "run-lr" / "iter1" / "rollouts" / "rollouts.jsonl"
    assert reused.read_text() == first_store.read_text()
    stats_file = tmp_path / "run-lr" / "iter1" / "stats.json"
    stats = json.loads(stats_file.read_text())
    assert stats["rollouts_reused_from"] == str(tmp_path / "run" / "iter1" / "rollouts")
    assert stats["new_rollouts"] == 0 and stats["pairs"]["total"] > 0

    # killed after the copy, before the iteration finished: the resumed run still says where its rollouts came from
    shutil.rmtree(tmp_path / "run-lr" / "iter1" / "model")
    stats_file.unlink()
    train_mdpo(second, llm_factory=Factory(), retriever=retriever)
    assert json.loads(stats_file.read_text())["rollouts_reused_from"] == stats["rollouts_reused_from"]

    # another sampler setting (m') has another producer: nothing is copied, the run samples its own
    third = _run_config(tmp_path, tiny_model_dir, iterations=1, eval_initial=False, solutions=2)
    stats = _samples_its_own(third, tmp_path / "run-m2", first, retriever)
    assert stats["rollouts"] == 4 * 2 * 2


def test_greedy_rejected_run_trains_on_the_policy_s_own_outputs(tmp_path: Path, tiny_model_dir: Path) -> None:
    retriever = ListRetriever(passages("Ann was born in Paris."))
    first = _run_config(tmp_path, tiny_model_dir, iterations=1, eval_initial=False)
    train_mdpo(first, llm_factory=Factory(), retriever=retriever)
    sampled = load_pairs(tmp_path / "run" / "iter1" / "pairs.jsonl")
    assert sampled

    # the same samples, rejected = the SFT policy's greedy output: the policy is opened for it although nothing is
    # sampled, and once more on a rerun only if its outputs are missing
    second = _run_config(
        tmp_path, tiny_model_dir, iterations=1, eval_initial=False, rejected="greedy", rollouts_from=first.output_dir
    )
    second.output_dir = str(tmp_path / "run-greedy")
    factory = Factory()
    train_mdpo(second, llm_factory=factory, retriever=retriever)
    it = tmp_path / "run-greedy" / "iter1"
    assert factory.paths == [tiny_model_dir, it / "model"]
    greedy = mdpo.load_greedy(it / "greedy.jsonl")
    assert set(greedy) == {mdpo.prompt_key(p) for p in sampled}
    stats = json.loads((it / "stats.json").read_text())
    assert stats["pairs_sampled"]["total"] == len(sampled)
    assert sum(stats["on_policy"].values()) == len(sampled)
    trained = load_pairs(it / "pairs.jsonl")
    assert stats["pairs"]["total"] == len(trained)
    swapped = [p for p in trained if p.get("rejected_source") == "greedy"]
    assert len(swapped) == sum(v for k, v in stats["on_policy"].items() if k.endswith("_greedy_rejected"))
    for pair in swapped:
        assert pair["rejected"][0]["content"] == greedy[mdpo.prompt_key(pair)]

    # another DPO setting on the same samples takes their greedy outputs along: no engine opens for them
    third = _run_config(
        tmp_path, tiny_model_dir, iterations=1, eval_initial=False, rejected="greedy", rollouts_from=str(it.parent)
    )
    third.output_dir, third.nll_weight = str(tmp_path / "run-greedy-nll"), 0.5
    factory = Factory()
    train_mdpo(third, llm_factory=factory, retriever=retriever)
    assert factory.paths == [tmp_path / "run-greedy-nll" / "iter1" / "model"]
    assert load_pairs(tmp_path / "run-greedy-nll" / "iter1" / "pairs.jsonl") == trained


def test_a_later_iteration_reuses_rollouts_of_the_same_weights_elsewhere(tmp_path: Path, tiny_model_dir: Path) -> None:
    retriever = ListRetriever(passages("Ann was born in Paris."))
    first = _run_config(tmp_path, tiny_model_dir, eval_initial=False)
    train_mdpo(first, llm_factory=Factory(), retriever=retriever)

    # another rate from iteration 2 on: iteration 1 is the first run's, copied (as learn_acesearcher does), so
    # iteration 2 samples from the same weights in another directory and takes the first run's samples
    later_dir = tmp_path / "run-later"
    (later_dir / "iter1").mkdir(parents=True)
    for name in ("model", "stats.json", "train_metrics.json"):
        source = tmp_path / "run" / "iter1" / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, later_dir / "iter1" / name)
    later = _run_config(tmp_path, tiny_model_dir, eval_initial=False, later_learning_rate=5e-4)
    later.output_dir, later.rollouts_from = str(later_dir), (str(tmp_path / "never-ran"), first.output_dir)
    factory = Factory()
    train_mdpo(later, llm_factory=factory, retriever=retriever)
    assert factory.paths == [later_dir / "iter2" / "model"]  # nothing sampled: only the new model is evaluated
    store = later_dir / "iter2" / "rollouts"
    assert (store / "rollouts.jsonl").read_text() == (
        tmp_path / "run" / "iter2" / "rollouts" / "rollouts.jsonl"
    ).read_text()
    assert json.loads((store / "store.json").read_text())["model"] == str(later_dir / "iter1" / "model")
    stats = json.loads((later_dir / "iter2" / "stats.json").read_text())
    assert stats["rollouts_reused_from"] == str(tmp_path / "run" / "iter2" / "rollouts")
    assert stats["dpo"]["learning_rate"] == 5e-4 and stats["pairs"]["total"] > 0

    # a store that holds other questions than the iteration samples is not taken (its pairs would leak in)
    fresh = _run_config(
        tmp_path, tiny_model_dir, iterations=1, eval_initial=False, train_limit=2, fresh_questions=True
    )
    assert _samples_its_own(fresh, tmp_path / "run-fresh", first, retriever)["rollouts"] == 2 * 2 * 3


def test_fresh_questions_give_each_iteration_its_own_block(tmp_path: Path, tiny_model_dir: Path) -> None:
    retriever = ListRetriever(passages("Ann was born in Paris."))
    config = _run_config(tmp_path, tiny_model_dir, train_limit=2, fresh_questions=True, eval_initial=False)
    train_mdpo(config, llm_factory=Factory(), retriever=retriever)
    for t, block in ((1, {"t0", "t1"}), (2, {"t2", "t3"})):
        store = RolloutStore(tmp_path / "run" / f"iter{t}" / "rollouts")
        assert {r.key.split("#")[0] for r in store} == block
        pairs = [json.loads(line) for line in (tmp_path / "run" / f"iter{t}" / "pairs.jsonl").read_text().splitlines()]
        assert {p["question_id"] for p in pairs} <= block

    # too few questions for the last block: refused before anything is sampled
    short = _run_config(tmp_path, tiny_model_dir, train_limit=3, fresh_questions=True)
    short.output_dir = str(tmp_path / "short")
    factory = Factory()
    with pytest.raises(ValueError, match="iteration 2 needs training questions 4-6, the file has 4"):
        train_mdpo(short, llm_factory=factory, retriever=retriever)
    assert factory.paths == []
    with pytest.raises(ValueError, match="needs train_limit"):
        _run_config(tmp_path, tiny_model_dir, fresh_questions=True).validate()


def test_config_from_yaml_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from sleuth.train.config import ConfigError, load_config

    repo = Path(__file__).resolve().parents[1]
    config = load_config(MDPOConfig, repo / "configs" / "mdpo_synth.yaml", {"beta": "0.5", "agent.k": "3"})
    assert config.beta == 0.5 and config.agent.k == 3 and config.synth
    config.validate()
    monkeypatch.setattr(mdpo, "train_mdpo", lambda c: {"config": c})
    got = mdpo.main(repo / "configs" / "mdpo_synth.yaml", ["iterations=1", "agent.sampling.max_new_tokens=8"])
    assert got["config"].iterations == 1 and got["config"].agent.sampling.max_new_tokens == 8
    with pytest.raises(ConfigError):
        mdpo.main(None, ["no_such_option=1"])
    config = load_config(MDPOConfig, None, {"pair_sets": "decompose,final", "reward": "code"})
    assert config.pair_sets == ("decompose", "final") and config.reward == "code"
    config.reward = "bogus"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="reward"):
        config.validate()


# ------------------------------------------------------------------------------------------------ real backends


def test_tiny_model_end_to_end_with_bm25(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The default hf: backend and a real BM25 index: random output gives no pairs, the iteration still completes."""
    from tests.test_bm25 import write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl", n_filler=20)
    config = _run_config(tmp_path, tiny_model_dir, iterations=1, corpus=str(corpus), train_limit=2, dev_limit=1)
    config.agent.sampling = dataclasses.replace(config.agent.sampling, max_new_tokens=6)
    config.agent.max_subquestions = 2
    summary = train_mdpo(config)
    stats = json.loads((tmp_path / "run" / "iter1" / "stats.json").read_text())
    assert stats["rollouts"] == 2 * 2 * 3 and stats["failed_runs"] == 0
    assert summary["iterations"][0]["dev_em"] is not None and (tmp_path / "run" / "index").exists()
    assert (tmp_path / "run" / "iter1" / "model" / "config.json").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_samples_and_scores_one_question(tmp_path: Path) -> None:
    """SmolLM2-135M samples m=2 decompositions x m'=2 runs on a synthetic-world question; no training."""
    from sleuth.assets import ensure_default_model
    from sleuth.data.synth import synthesize
    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.bm25 import build_bm25_index

    sizes = {"train_entities": 40, "dev_entities": 20, "test_entities": 20}
    synthesize(tmp_path / "world", seed=0, train_questions=2, dev_questions=1, test_questions=1, max_hops=2, **sizes)
    build_bm25_index(tmp_path / "world" / "corpus.jsonl", tmp_path / "idx")
    example = next(iter(read_examples(str(tmp_path / "world" / "train.jsonl"), 1)))
    config = MDPOConfig(decompositions=2, solutions=2)
    config.agent = AceSearcherConfig(
        k=3, max_subquestions=3, decompose_max_new_tokens=40, subanswer_max_new_tokens=8, final_max_new_tokens=24
    )
    llm = load_llm(f"hf:{ensure_default_model()}?threads=1")
    ctx = Context(llm=llm, retriever=load_retriever(str(tmp_path / "idx")), config=config.rollout_agent())
    store = RolloutStore(tmp_path / "store")
    assert sample_rollouts([example], ctx, store, 2, 2) == 4
    _, stats = build_pairs(store, config)
    assert stats["trajectories"] == 4 and stats["failed_runs"] == 0
