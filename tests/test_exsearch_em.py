"""ExSearch's generalized EM (sleuth.train.exsearch_em) and the chat tokenization with model-token masks
(sleuth.train.tokens): hand-computed weights and losses on a tiny random model, masks on a real chat template,
warm-up trajectories replayed through the agent, resumption."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents.exsearch import ExSearchConfig
from sleuth.llm import LLM, Generation, Request, Sampling
from sleuth.llm.base import Score
from sleuth.records import Example, Passage
from sleuth.train import exsearch_em
from sleuth.train.exsearch_em import (
    BestOfLLM,
    EMConfig,
    best_of_sampler,
    build_weighted_records,
    fireact_trajectories,
    normalize_weights,
    synth_trajectories,
    train_exsearch,
    train_weighted,
    trajectory_messages,
    weighted_nll,
)
from sleuth.train.rollouts import Rollout
from sleuth.train.tokens import IGNORE_INDEX, TokenizationError, tokenize_chat
from tests.scripted import ListRetriever, ScriptedLLM

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

CHAT = [
    {"role": "user", "content": "Question: who wrote it?"},
    {"role": "assistant", "content": "<THINK> who wrote it"},
    {"role": "user", "content": "<SEARCH> [1] Title: Ann. Content: Ann wrote it."},
    {"role": "assistant", "content": "<RECORD> Ann wrote it.\n<FINAL>"},
    {"role": "user", "content": "<SEARCH> end search. please give the final answer"},
    {"role": "assistant", "content": "Ann"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------------------------------------ tokens and masks


def test_chat_ids_are_the_templates_and_only_assistant_tokens_are_labelled(tokenizer: Any) -> None:
    chat = tokenize_chat(tokenizer, CHAT)
    reference = tokenizer.apply_chat_template(CHAT, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert chat.input_ids == list(reference)  # re-tokenisation did not shift anything
    written = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.model_mask, strict=True) if m])
    assert written == "<THINK> who wrote it<|im_end|><RECORD> Ann wrote it.\n<FINAL><|im_end|>Ann<|im_end|>"
    inserted = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.model_mask, strict=True) if not m])
    assert "Ann wrote it." in inserted and "Content" in inserted and "<THINK>" not in inserted
    labels = chat.labels
    assert all((label == IGNORE_INDEX) != bool(m) for label, m in zip(labels, chat.model_mask, strict=True))


def test_changing_an_observation_changes_no_label(tokenizer: Any) -> None:
    other = [dict(m) for m in CHAT]
    other[2]["content"] = "<SEARCH> [1] Title: Bob. Content: Bob wrote a different, much longer book about it."
    a, b = tokenize_chat(tokenizer, CHAT), tokenize_chat(tokenizer, other)
    assert [t for t in a.labels if t != IGNORE_INDEX] == [t for t in b.labels if t != IGNORE_INDEX]


def test_template_that_is_not_prefix_stable_is_refused(tokenizer: Any) -> None:
    import copy

    odd = copy.copy(tokenizer)
    # renders the message count up front: a prefix of the chat renders differently from the whole chat
    odd.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(TokenizationError, match="prefix-stable"):
        tokenize_chat(odd, CHAT)


def test_truncation_keeps_the_end(tokenizer: Any) -> None:
    full = tokenize_chat(tokenizer, CHAT)
    cut = tokenize_chat(tokenizer, CHAT, max_length=10)
    assert cut.truncated and cut.input_ids == full.input_ids[-10:] and cut.model_mask == full.model_mask[-10:]


# ------------------------------------------------------------------------------------------------ best-of sampling


class _Recording(LLM):
    """A real backend whose generate calls are recorded (every candidate best-of sees), nothing else changed."""

    def __init__(self, inner: LLM) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[list[Request], Sampling, list[Generation]]] = []
        self.scored: list[tuple[Any, str]] = []

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        out = await self.inner.generate(requests, sampling)
        self.calls.append((requests, sampling, out))
        return out

    async def score(self, prompt: Any, completion: str) -> Score:
        self.scored.append((prompt, completion))
        return await self.inner.score(prompt, completion)


def test_best_of_keeps_the_candidate_of_highest_log_probability(tiny_model_dir: Path) -> None:
    """vLLM best_of=n, n=1: sample n, keep the one the model itself finds most likely (checked with score())."""
    import asyncio

    from sleuth.llm import load_llm

    llm = load_llm(f"hf:{tiny_model_dir}")
    recorded = _Recording(llm)
    best = BestOfLLM(recorded, 6)
    requests = [Request.chat(q) for q in ("Who wrote it?", "Where was Ann born?", "Which river?", "Name a city.")]
    sampling = Sampling(temperature=1.0, max_new_tokens=5, seed=11)

    async def go() -> tuple[list[Generation], list[list[float]]]:
        kept = await best.generate(requests, sampling)
        (_, wide, candidates) = recorded.calls[0]
        assert wide.n == 6 and wide.temperature == 1.0 and len(recorded.calls) == 1
        scores = []
        for request, generation in zip(requests, candidates, strict=True):
            found = [await llm.score(request.messages or [], t) for t in generation.texts]
            scores.append([s.logprob if t else -math.inf for s, t in zip(found, generation.texts, strict=True)])
        return kept, scores

    kept, scores = asyncio.run(go())
    candidates = recorded.calls[0][2]
    picked = []
    for generation, pool, logprobs in zip(kept, candidates, scores, strict=True):
        assert len(pool.texts) == 6 and len(generation.texts) == 1
        index = pool.texts.index(generation.text)
        assert logprobs[index] == pytest.approx(max(logprobs), abs=1e-4)
        assert generation.token_ids == [pool.token_ids[index]]  # the kept sample's own tokens, finish reason
        assert generation.completion_tokens == [pool.completion_tokens[index]]
        picked.append(index)
    assert any(i != 0 for i in picked)  # it did choose: the first sample is not simply passed on
    assert best.report()["calls"] == 4 and best.report()["candidates"] == 24
    assert best.report()["mean_logprob_kept"] >= best.report()["mean_logprob_first_sample"]


def test_best_of_one_and_greedy_leave_sampling_unchanged(tiny_model_dir: Path) -> None:
    import asyncio

    from sleuth.llm import load_llm

    llm = load_llm(f"hf:{tiny_model_dir}")
    requests = [Request.chat("Who wrote it?"), Request.chat("Where was Ann born?")]
    sampling = Sampling(temperature=1.0, max_new_tokens=5, seed=5)
    plain = asyncio.run(llm.generate(requests, sampling))
    recorded = _Recording(llm)
    through = asyncio.run(BestOfLLM(recorded, 1).generate(requests, sampling))
    assert [g.texts for g in through] == [g.texts for g in plain]
    assert recorded.calls[0][1] == sampling and recorded.scored == []  # one sample each, nothing scored
    asyncio.run(BestOfLLM(recorded, 8).generate(requests, Sampling(max_new_tokens=5)))  # greedy: no best-of
    assert recorded.calls[-1][1].n == 1 and recorded.scored == []

    sampler, record = best_of_sampler(llm, 1, sampling)
    assert sampler is llm and record == {"best_of": 1, "applied": False, "reason": "best_of=1"}
    sampler, record = best_of_sampler(llm, 8, Sampling())
    assert sampler is llm and not record["applied"] and "greedy" in record["reason"]
    sampler, record = best_of_sampler(llm, 8, sampling)
    assert isinstance(sampler, BestOfLLM) and sampler.best_of == 8 and record["applied"]
    scripted = ScriptedLLM(["x"])  # a backend that cannot score: plain sampling, and the reason is recorded
    sampler, record = best_of_sampler(scripted, 8, sampling)
    assert sampler is scripted and not record["applied"] and "NotImplementedError" in record["reason"]
    with pytest.raises(ValueError, match="best_of"):
        EMConfig(best_of=0).validate()
    assert EMConfig().best_of == 8  # the reference's vLLM best_of


class _Ranked(LLM):
    """Candidate i of every call ends in the digit i; the model "prefers" candidate 2 (log-prob -|i - 2|)."""

    def __init__(self) -> None:
        super().__init__()
        self.scored_prompts: list[Any] = []
        self.requests: list[list[dict[str, str]]] = []

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        out = []
        for request in requests:
            messages = request.messages or []
            self.requests.append(messages)
            turn = sum(m["role"] == "assistant" for m in messages)
            final = "end search" in messages[-1]["content"]
            if final:
                texts = [f"answer {i}" for i in range(sampling.n)]
            elif turn == 0:
                texts = [f"<THINK> query {i}" for i in range(sampling.n)]
            else:
                texts = [f"<RECORD> fact {i}\n<FINAL>" for i in range(sampling.n)]
            out.append(
                Generation(texts=texts, completion_tokens=[2] * sampling.n, finish_reasons=["stop"] * sampling.n)
            )
        return out

    async def score(self, prompt: Any, completion: str) -> Score:
        self.scored_prompts.append(prompt)
        digit = int(re.findall(r"\d", completion)[-1])
        return Score(logprob=-abs(digit - 2), token_logprobs=[], tokens=[])


def test_best_of_applies_to_each_model_turn_of_a_trajectory() -> None:
    """vLLM best_of acts per generate() call, so every turn of the multi-turn rollout is the best of its own
    candidates, each scored after the conversation so far."""
    from sleuth.agents import Context
    from sleuth.runner import run

    ranked = _Ranked()
    agent = ExSearchConfig(k=1, max_steps=3, sampling=Sampling(temperature=0.8, max_new_tokens=8))
    retriever = ListRetriever([Passage(id="p1", title="Ann", text="Ann was born in Paris.")])
    example = Example(id="q1", question="Where was Ann born?", answers=["Paris"])
    ctx = Context(llm=BestOfLLM(ranked, 4), retriever=retriever, config=agent)
    trace = run("exsearch", [example], ctx, progress=False)[0]
    assert trace.error is None
    assert [s.output for s in trace.steps if s.kind != "search"] == [
        "<THINK> query 2",
        "<RECORD> fact 2\n<FINAL>",
        "answer 2",
    ]
    assert [s.query for s in trace.steps if s.kind == "search"] == ["query 2"]
    assert trace.answer == "answer 2"
    assert len(ranked.requests) == 3 and len(ranked.scored_prompts) == 12  # 3 calls x 4 distinct candidates
    for i, messages in enumerate(ranked.requests):  # each candidate is scored after that turn's own context
        assert ranked.scored_prompts[4 * i : 4 * i + 4] == [messages] * 4
    assert ranked.requests[1][1]["content"] == "<THINK> query 2"  # the next turn continues the kept one


# ------------------------------------------------------------------------------------------------ weights


def test_weight_is_the_probability_of_the_gold_answer_computed_directly(tmp_path: Path, tiny_model_dir: Path) -> None:
    """E-step on a real (random) model: w(z) = exp(sum of the gold answer's token log-probs after the trajectory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.agents import Context
    from sleuth.llm import load_llm
    from sleuth.runner import run

    llm = load_llm(f"hf:{tiny_model_dir}")
    agent = ExSearchConfig(k=1, max_steps=2, sampling=Sampling(temperature=1.0, max_new_tokens=6, seed=3))
    retriever = ListRetriever([Passage(id="p1", title="Ann", text="Ann was born in Paris.")])
    example = Example(id="q1", question="Where was Ann born?", answers=["Paris", "paris city"])
    traces = run("exsearch", [example, example], Context(llm=llm, retriever=retriever, config=agent), progress=False)
    rollouts = [Rollout(key=f"q1#{i}", group="q1", sample=i, trace=t) for i, t in enumerate(traces)]
    records, info = build_weighted_records(rollouts, llm, EMConfig(weighting="likelihood"))
    assert len(records) == 2 and info["degenerate"] == {}

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for record, trace in zip(records, traces, strict=True):
        context = trajectory_messages(trace)
        assert record["messages"] == [*context, {"role": "assistant", "content": "Paris"}]  # gold substituted
        prompt_ids = tok.apply_chat_template(context, add_generation_prompt=True, tokenize=True)
        prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
        answer_ids = tok("Paris", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + answer_ids])).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        direct = sum(float(logp[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(answer_ids))
        assert record["log_p_answer"] == pytest.approx(direct, abs=1e-4)
        assert record["weight"] == pytest.approx(math.exp(direct), rel=1e-3)


def test_weight_normalisations() -> None:
    log_p = [math.log(0.2), math.log(0.6), math.log(0.05), math.log(0.05)]
    groups = ["a", "a", "b", "b"]
    assert normalize_weights(log_p, groups, "likelihood") == pytest.approx([0.2, 0.6, 0.05, 0.05])
    assert normalize_weights(log_p, groups, "self_normalized") == pytest.approx([0.25, 0.75, 0.5, 0.5])
    assert normalize_weights(log_p, groups, "uniform") == [1.0] * 4
    assert normalize_weights(log_p, groups, "em", metrics=[1, 0, 0, 1]) == [1.0, 0.0, 0.0, 1.0]
    # exp(mean log p) over the answer's tokens: 0.2 over 2 tokens -> sqrt(0.2)
    got = normalize_weights(log_p[:1], groups[:1], "likelihood", lengths=[2], length_normalize=True)
    assert got == pytest.approx([math.sqrt(0.2)])
    with pytest.raises(ValueError):
        normalize_weights(log_p, groups, "em")


# ------------------------------------------------------------------------------------------------ M-step loss


def test_weighted_loss_is_the_hand_computed_weighted_nll() -> None:
    import torch

    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[-100, 2, 4, -100], [-100, -100, 1, 3]])
    weights = torch.tensor([0.3, 2.0])
    logp = torch.log_softmax(logits, dim=-1)
    # example 0: logits[0,0] predicts label 2, logits[0,1] predicts label 4 (label[0,3] is masked)
    nll0 = [-float(logp[0, 0, 2]), -float(logp[0, 1, 4])]
    # example 1: logits[1,1] predicts 1, logits[1,2] predicts 3
    nll1 = [-float(logp[1, 1, 1]), -float(logp[1, 2, 3])]
    by_sum = (0.3 * sum(nll0) + 2.0 * sum(nll1)) / 2
    by_mean = (0.3 * sum(nll0) / 2 + 2.0 * sum(nll1) / 2) / 2
    assert float(weighted_nll(logits, labels, weights, "sum")) == pytest.approx(by_sum, rel=1e-5)
    assert float(weighted_nll(logits, labels, weights, "mean")) == pytest.approx(by_mean, rel=1e-5)
    assert float(weighted_nll(logits, labels, torch.zeros(2))) == 0.0


def test_reference_nll_share_weighs_the_worse_trajectory_more() -> None:
    """The official trainer's M-step (digest §4.9): w_b = NLL_b / sum NLL over the micro-batch (mean NLL per
    sequence, detached), loss = sum_b w_b * NLL_b. Two-token vocabulary, logits [0, 0] (p = 1/2) or [ln 3, 0]
    (p(0) = 3/4, p(1) = 1/4)."""
    import torch

    logits = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0], [0.0, 0.0]], [[math.log(3), 0.0], [0.0, 0.0], [0.0, 0.0]]])
    logits.requires_grad_(True)
    labels = torch.tensor([[-100, 0, 0], [-100, 1, -100]])
    m0 = (math.log(2) + math.log(4 / 3)) / 2  # example 0: label 0 at p 1/2, then at p 3/4
    m1 = math.log(4)  # example 1: label 1 at p 1/4 (the worse fit)
    w0, w1 = m0 / (m0 + m1), m1 / (m0 + m1)
    assert w1 == pytest.approx(0.7387, abs=1e-4)
    loss = weighted_nll(logits, labels, torch.tensor([5.0, 0.0]), "mean", "reference_nll_share")  # weights ignored
    assert float(loss) == pytest.approx(w0 * m0 + w1 * m1, rel=1e-6)
    # the paper's path with unit weights is the plain mean of the two NLLs
    assert float(weighted_nll(logits, labels, torch.ones(2), "mean")) == pytest.approx((m0 + m1) / 2, rel=1e-6)
    # detached weights: the gradient is w_b times example b's NLL gradient (softmax - one-hot: [3/4, -3/4] here)
    loss.backward()
    assert logits.grad is not None
    assert logits.grad[1, 0].tolist() == pytest.approx([0.75 * w1, -0.75 * w1], rel=1e-5)
    assert normalize_weights([math.log(0.2)], ["a"], "reference_nll_share") == [1.0]  # records keep weight 1


def _records(weight: float, n: int = 2) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "messages": CHAT, "weight": weight} for i in range(n)]


def _m_step_config(**overrides: Any) -> EMConfig:
    config = EMConfig(
        batch_size=2,
        per_device_batch_size=2,
        learning_rate=1e-2,
        warmup_ratio=0.0,
        lr_scheduler="constant",
        max_steps=1,
        max_length=512,
        min_weight=-1.0,
        progress=False,
    )
    return dataclasses.replace(config, **overrides)


def _params(path: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def test_zero_weight_leaves_parameters_unchanged_and_a_weight_changes_them(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import torch

    before = _params(tiny_model_dir)
    train_weighted(_records(0.0), tiny_model_dir, tmp_path / "zero", _m_step_config())
    after_zero = _params(tmp_path / "zero" / "model")
    assert all(torch.equal(before[k], after_zero[k]) for k in before)
    train_weighted(_records(1.0), tiny_model_dir, tmp_path / "one", _m_step_config())
    after_one = _params(tmp_path / "one" / "model")
    assert any(not torch.equal(before[k], after_one[k]) for k in before)


def test_records_at_or_below_min_weight_are_counted_not_trained(tmp_path: Path, tiny_model_dir: Path) -> None:
    records = [*_records(0.0, 1), *_records(0.5, 2)]
    stats = train_weighted(records, tiny_model_dir, tmp_path / "m", _m_step_config(min_weight=0.0))
    assert stats["below_min_weight"] == 1 and stats["trained"] == 2
    with pytest.raises(ValueError, match="no M-step records"):
        train_weighted(_records(0.0), tiny_model_dir, tmp_path / "none", _m_step_config(min_weight=0.0))


class Killed(Exception):
    pass


def test_a_killed_m_step_resumes_from_its_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import TrainerCallback

    class KillAfterFirstSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            raise Killed

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.steps.append(state.global_step)

    config = _m_step_config(max_steps=3, save_steps=1, per_device_batch_size=1)
    with pytest.raises(Killed):
        train_weighted(_records(1.0), tiny_model_dir, tmp_path / "m", config, callbacks=[KillAfterFirstSave()])
    assert (tmp_path / "m" / "trainer" / "checkpoint-1").exists() and not (tmp_path / "m" / "model").exists()
    seen = Steps()
    stats = train_weighted(_records(1.0), tiny_model_dir, tmp_path / "m", config, callbacks=[seen])
    assert seen.steps == [2, 3] and stats["steps"] == 3  # step 1 was not redone
    again = train_weighted(_records(1.0), tiny_model_dir, tmp_path / "m", config, callbacks=[seen])
    assert again == stats and seen.steps == [2, 3]  # a finished stage is not retrained


# ------------------------------------------------------------------------------------------------ warm-up data


def test_fireact_rows_become_exsearch_trajectories_and_bad_rows_are_counted(tmp_path: Path) -> None:
    good = {
        "messages": [
            {"role": "user", "content": "Where was the director of Jaws born?"},
            {"role": "assistant", "content": "Thought: find the director.\nAction: search[Jaws director]"},
            {"role": "user", "content": "Observation: Jaws was directed by Steven Spielberg."},
            {"role": "assistant", "content": "Thought: Spielberg directed it.\nAction: search[Steven Spielberg born]"},
            {"role": "user", "content": "Observation: Spielberg was born in Cincinnati."},
            {"role": "assistant", "content": "Thought: He was born in Cincinnati.\nAction: finish[Cincinnati]"},
            {"role": "user", "content": "Observation: Episode finished, reward = True"},
        ]
    }
    failed = json.loads(json.dumps(good))
    failed["messages"][-1]["content"] = "Observation: Episode finished, reward = False"
    lookup = json.loads(json.dumps(good))
    lookup["messages"][1]["content"] = "Thought: x\nAction: lookup[director]"
    path = tmp_path / "react.jsonl"
    path.write_text("\n".join([json.dumps(good), json.dumps(failed), "{not json", json.dumps(lookup)]) + "\n")
    records, report = fireact_trajectories(path, ExSearchConfig())
    assert report["skipped"] == {"reward_false": 1, "malformed": 1, "unsupported_action": 1}
    assert report["malformed"] == [f"{path}:3: not JSON"]
    (record,) = records
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]
    written = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert written == [
        "<THINK> Jaws director",
        "<RECORD> Spielberg directed it.\n<THINK> Steven Spielberg born",
        "<RECORD> He was born in Cincinnati.\n<FINAL>",
        "Cincinnati",
    ]
    assert "Content: Jaws was directed by Steven Spielberg." in record["messages"][2]["content"]
    assert "end search" in record["messages"][-2]["content"]  # the agent's own finalization turn


@pytest.mark.skipif(not (SHARED / "fireact").exists(), reason="needs ../shared/data/fireact")
def test_every_shipped_fireact_trajectory_converts() -> None:
    records, report = fireact_trajectories(SHARED / "fireact" / "hotpotqa_react_trajectories.jsonl", ExSearchConfig())
    assert report["records"] + sum(report["skipped"].values()) == 500 and report["records"] >= 450


def test_synth_gold_trajectory_injects_the_gold_passage_and_records_its_sentence() -> None:
    gold1 = Passage(id="g1", title="Jaws", text="Jaws is a film. Jaws was directed by Ann Lee. It is long.")
    gold2 = Passage(id="g2", title="Ann Lee", text="Ann Lee is a director. Ann Lee was born in Pella.")
    noise = [Passage(id=f"n{i}", title=f"N{i}", text="Nothing here.") for i in range(3)]
    example = Example(
        id="s1",
        question="Where was the director of Jaws born?",
        answers=["Pella"],
        decomposition=[
            {"question": "Who directed Jaws?", "answer": "Ann Lee", "supporting_ids": ["g1"]},
            {"question": "Where was #1 born?", "answer": "Pella", "supporting_ids": ["g2"]},
        ],
    )
    retriever = ListRetriever(lambda q: [gold1, *noise] if "Jaws" in q else noise)
    records, report = synth_trajectories([example], retriever, {"g1": gold1, "g2": gold2}, ExSearchConfig(k=3))
    assert report["records"] == 1 and retriever.queries == ["Where was Ann Lee born?", "Who directed Jaws?"]
    messages = records[0]["messages"]
    written = [m["content"] for m in messages if m["role"] == "assistant"]
    assert written == [
        "<THINK> Who directed Jaws?",
        "<RECORD> Jaws was directed by Ann Lee.\n<THINK> Where was Ann Lee born?",
        "<RECORD> Ann Lee was born in Pella.\n<FINAL>",
        "Pella",
    ]
    second_search = messages[4]["content"]
    assert second_search.count("[") == 3 and "Title: Ann Lee" in second_search  # gold replaced the last hit


# ------------------------------------------------------------------------------------------------ the loop


def _world(tmp_path: Path) -> Path:
    from sleuth.data.synth import synthesize

    sizes = {"train_entities": 40, "dev_entities": 20, "test_entities": 20}
    synthesize(tmp_path / "world", seed=0, train_questions=4, dev_questions=2, test_questions=1, max_hops=2, **sizes)
    return tmp_path / "world"


def _loop_config(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> EMConfig:
    config = _m_step_config(
        model=str(tiny_model_dir),
        output_dir=str(tmp_path / "run"),
        data_dir=str(_world(tmp_path)),
        train_limit=3,
        dev_limit=2,
        warmup_synth=3,
        iterations=2,
        patience=5,
        agent=ExSearchConfig(k=2, max_steps=2, sampling=Sampling(max_new_tokens=6), answer_max_new_tokens=4),
        best_of=2,
    )
    return dataclasses.replace(config, **overrides)


def test_em_loop_on_a_tiny_model_writes_stats_and_resumes(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _loop_config(tmp_path, tiny_model_dir)
    real = exsearch_em.train_weighted
    calls: list[str] = []

    def counted(records: Any, model_path: Any, out: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(Path(out).name)
        if Path(out).name == "iter1" and not (Path(out) / "model").exists():
            raise Killed  # killed before the second M-step
        return real(records, model_path, out, *args, **kwargs)

    monkeypatch.setattr(exsearch_em, "train_weighted", counted)
    with pytest.raises(Killed):
        train_exsearch(config)
    out = tmp_path / "run"
    stats0 = json.loads((out / "iter0" / "stats.json").read_text())
    assert stats0["trajectories"]["n"] + sum(stats0["degenerate"].values()) == 3 * 2
    assert stats0["policy"] == str(out / "warmup" / "model") and stats0["dev"]["n"] == 2
    assert json.loads((out / "warmup" / "data_summary.json").read_text())["records"] == 3
    assert json.loads((out / "config.json").read_text())["best_of"] == 2  # the setting, and that it was applied
    best_of = json.loads((out / "iter0" / "estep.json").read_text())["best_of"]
    assert best_of["best_of"] == 2 and best_of["applied"] and best_of["reason"] is None
    assert best_of["calls"] >= 3 * 2 * 2 and best_of["candidates"] == 2 * best_of["calls"]  # >= think + answer
    assert stats0["best_of"] == best_of
    assert json.loads((out / "iter0" / "rollouts" / "store.json").read_text())["best_of"] == 2
    rollouts = (out / "iter1" / "rollouts" / "rollouts.jsonl").read_text()

    monkeypatch.setattr(exsearch_em, "train_weighted", real)
    summary = train_exsearch(config)
    assert (out / "iter1" / "rollouts" / "rollouts.jsonl").read_text() == rollouts  # E-step not resampled
    assert [it["iteration"] for it in summary["iterations"]] == [0, 1]
    assert summary["best_model"] and summary["base"]["dev"]["n"] == 2
    stats1 = json.loads((out / "iter1" / "stats.json").read_text())
    assert stats1["policy"] == str(out / "iter0" / "model")  # θ(t+1) is trained from θ(t)
    for record in map(json.loads, (out / "iter1" / "weighted.jsonl").read_text().splitlines()):
        assert record["messages"][-1]["role"] == "assistant" and record["weight"] >= 0


def test_early_stopping_on_dev_em(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _loop_config(tmp_path, tiny_model_dir, patience=1, iterations=3, warmup=False)
    summary = train_exsearch(config)  # a random model never improves dev EM: stops after the first iteration
    assert summary["early_stopped_after"] == 0 and len(summary["iterations"]) == 1
    assert summary["best_model"] == str(tiny_model_dir)


def test_fresh_questions_give_each_e_step_its_own_block(tmp_path: Path, tiny_model_dir: Path) -> None:
    from sleuth.data.synth import load_synth
    from sleuth.train.rollouts import RolloutStore

    config = _loop_config(tmp_path, tiny_model_dir, train_limit=2, fresh_questions=True, warmup=False, best_of=1)
    config.dev_limit = 0
    train_exsearch(config)
    ids = [e.id for e in load_synth(tmp_path / "world" / "train.jsonl")]
    for t, block in ((0, ids[:2]), (1, ids[2:4])):
        store = RolloutStore(tmp_path / "run" / f"iter{t}" / "rollouts")
        assert {r.key.split("#")[0] for r in store} == set(block)

    # too few questions for the last block: refused before anything is sampled
    short = _loop_config(tmp_path, tiny_model_dir, train_limit=3, fresh_questions=True, warmup=False)
    short.output_dir = str(tmp_path / "short")
    with pytest.raises(ValueError, match="iteration 2 needs training questions 4-6, the file has 4"):
        train_exsearch(short)
    assert not (tmp_path / "short" / "iter0").exists() and not (tmp_path / "short" / "dev_base.json").exists()
    with pytest.raises(ValueError, match="needs train_limit"):
        _loop_config(tmp_path, tiny_model_dir, train_limit=None, fresh_questions=True).validate()


def test_config_from_yaml_and_cli_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from sleuth.train.config import load_config

    repo = Path(__file__).resolve().parents[1]
    config = load_config(EMConfig, repo / "configs" / "exsearch_synth.yaml", {"weighting": "uniform"})
    config.validate()
    assert config.weighting == "uniform" and config.samples == 2
    monkeypatch.setattr(exsearch_em, "train_exsearch", lambda c: {"config": c})
    got = exsearch_em.main(repo / "configs" / "exsearch_synth.yaml", ["iterations=1", "agent.k=3"])
    assert got["config"].iterations == 1 and got["config"].agent.k == 3
    config.weighting = "bogus"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="weighting"):
        config.validate()


def test_segments_inside_one_assistant_message_mask_the_observations(tokenizer: Any) -> None:
    segments = [
        {"source": "model", "text": "<query>who wrote it</query>"},
        {"source": "observation", "text": "\n<information>Doc 1 Ann wrote it.</information>\n"},
        {"source": "model", "text": "<search_complete>True</search_complete>"},
    ]
    chat = tokenize_chat(tokenizer, [{"role": "user", "content": "Q"}, {"role": "assistant", "segments": segments}])
    written = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.model_mask, strict=True) if m])
    assert written == "<query>who wrote it</query><search_complete>True</search_complete><|im_end|>"
    whole = "".join(s["text"] for s in segments)
    reference = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": whole}], tokenize=True
    )
    assert chat.input_ids == list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    with pytest.raises(TokenizationError, match="add up"):
        tokenize_chat(tokenizer, [{"role": "assistant", "content": "x", "segments": segments}])
