"""The online RL loop (sleuth.train.online_rl) on a tiny random model: what an update changes and what it must not,
state masking on a real chat template, resumption after a kill."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig
from sleuth.llm import Sampling
from sleuth.records import Example, Trace
from sleuth.train import online_rl
from sleuth.train.online_rl import Episode, RLConfig, Task, train_online
from tests.conftest import model_params, two_process_rl_config


class DirectTask(Task):
    """The `direct` agent with a reward computed from its answer by ``score`` (a fixed rule: isolates the loop)."""

    method = "direct"

    def __init__(self, score: Callable[[Trace], float]) -> None:
        self.score = score

    def agent_config(self, config: RLConfig) -> Any:
        return DirectConfig(
            sampling=Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=6),
        )

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=None, config=agent_config)

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        out = []
        for trace in traces:
            step = trace.steps[-1]
            messages = [*(step.messages or []), {"role": "assistant", "content": step.output or ""}]
            reward = self.score(trace)
            out.append(
                Episode(
                    group=trace.example.metadata["rl"]["group"],
                    messages=messages,
                    reward=reward,
                    components={"score": reward},
                )
            )
        return out


def _examples(n: int = 3) -> list[Example]:
    return [Example(id=f"q{i}", question=f"Who wrote book {i}?", answers=["Ann"]) for i in range(n)]


def _config(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> RLConfig:
    config = RLConfig(
        model=str(tiny_model_dir),
        output_dir=str(tmp_path / "rl"),
        steps=1,
        prompts_per_step=2,
        group_size=3,
        micro_batch=2,
        learning_rate=1e-2,
        critic_learning_rate=1e-2,
        temperature=1.0,
        save_steps=1,
        progress=False,
    )
    return dataclasses.replace(config, **overrides)


def test_equal_rewards_give_zero_advantages_and_leave_the_policy_unchanged(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import torch

    config = _config(tmp_path, tiny_model_dir, beta=0.0)
    train_online(config, DirectTask(lambda t: 1.0), _examples())
    log = [json.loads(line) for line in (tmp_path / "rl" / "log.jsonl").read_text().splitlines()]
    assert log[0]["advantage_abs"] == 0.0 and log[0]["reward"] == 1.0
    before, after = model_params(tiny_model_dir), model_params(tmp_path / "rl" / "model")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_different_rewards_change_the_policy_and_log_every_term(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    config = _config(tmp_path, tiny_model_dir, beta=0.04, kl="arena")
    summary = train_online(config, DirectTask(lambda t: float(len(t.answer or "") % 3)), _examples())
    before, after = model_params(tiny_model_dir), model_params(tmp_path / "rl" / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    last = summary["last"]
    for key in ("reward", "reward/score", "kl", "entropy", "clip_fraction", "grad_norm", "response_tokens"):
        assert key in last, key
    assert last["advantage_abs"] > 0 and (tmp_path / "rl" / "curves.png").exists()
    from sleuth.train.rollouts import RolloutStore

    steps = sorted((tmp_path / "rl" / "rollouts").iterdir())
    assert [d.name for d in steps] == [f"step-{i:05d}" for i in range(config.steps)]
    stored = list(RolloutStore(steps[-1]))
    assert len(stored) == config.prompts_per_step * config.group_size
    assert all(r.extra["reward"] == float(len(r.trace.answer or "") % 3) for r in stored)


class FixedTask(DirectTask):
    """Episodes that do not depend on the sampled text (the reply is fixed by question and sample; the reward by
    the question), so that two runs can be compared exactly; ``long``: the prompt carries a long document (an
    observation). Remembers the episodes it handed to the loop."""

    def __init__(self, long: bool = False) -> None:
        super().__init__(_odd)
        self.long = long
        self.seen: list[Episode] = []

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        out = super().episodes(traces)
        for episode, trace in zip(out, traces, strict=True):
            sample = trace.example.metadata["rl"]["sample"]
            reply = {"role": "assistant", "content": f"{trace.example.id} is number {sample}"}
            prompt = _prompt(trace.example.question) if self.long else {"role": "user", "content": "Who?"}
            episode.messages = [prompt, reply]
            episode.reward = float((int(trace.example.id[1:]) + sample) % 2)
        self.seen.extend(out)
        return out


def _ppo(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> RLConfig:
    settings: dict[str, Any] = {
        "algorithm": "ppo",
        "group_size": 1,
        "prompts_per_step": 3,
        "kl_coef": 0.001,
        "kl": "k1",
        "entropy_coef": 0.001,
        "mini_batches": 2,
        **overrides,
    }
    return _config(tmp_path, tiny_model_dir, **settings)


def _odd(trace: Trace) -> float:
    return float(len(trace.answer or "") % 2)


def _critic_params(checkpoint: Path) -> dict[str, Any]:
    """The separate critic of a checkpoint: backbone weights and value head."""
    import torch
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(checkpoint / "critic" / "backbone").state_dict()
    head = torch.load(checkpoint / "critic" / "value_head.pt", weights_only=True)
    return {**{k: v.clone() for k, v in backbone.items()}, **{f"head.{k}": v for k, v in head.items()}}


def test_ppo_trains_a_separate_critic_from_the_base_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    """veRL's layout (s3's reference): the critic is its own model, initialised from the base weights, with its
    own optimizer and learning rate; both it and the policy learn, and the checkpoint holds both."""
    import torch

    summary = train_online(_ppo(tmp_path, tiny_model_dir, steps=2), FixedTask(), _examples())
    checkpoint = tmp_path / "rl" / "checkpoint"
    assert not (checkpoint / "value_head.pt").exists() and (checkpoint / "critic_optimizer.pt").exists()
    critic = _critic_params(checkpoint)
    assert float(critic["head.bias"].abs()) > 0  # the value head (initialised at zero) learned
    base = model_params(tiny_model_dir)
    # once the head is off zero (after the first optimizer step that sees a return), the gradient reaches the backbone
    assert any(not torch.equal(v, base[f"model.{k}"]) for k, v in critic.items() if not k.startswith("head."))
    policy = model_params(tmp_path / "rl" / "model")
    assert any(not torch.equal(base[k], policy[k]) for k in base)
    last = summary["last"]
    assert last["actor_updated"] is True and last["critic_lr"] == pytest.approx(1e-2) and last["lr"] == 1e-2
    for key in ("value_loss", "value_clip_fraction", "critic_grad_norm", "grad_norm", "clip_fraction"):
        assert key in last, key


def test_the_value_loss_reaches_the_policy_only_with_a_shared_head(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    from sleuth.train import online_rl, rl

    ids = torch.tensor([[5, 9, 11, 14, 20, 7]])
    attention = torch.ones_like(ids)
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]])
    for critic in ("separate", "shared_head"):
        config = _ppo(tmp_path, tiny_model_dir, critic=critic)
        models = online_rl._Models(config, tiny_model_dir, None, torch.device("cpu"))
        policy = {id(p) for p in models.policy.parameters()}
        critic_params = models.critic_parameters() if critic == "separate" else list(models.value_head.parameters())
        assert not policy & {id(p) for p in critic_params}  # nothing shared, in either layout
        _, values = models.forward(ids, attention, values=True)
        loss, _ = rl.value_loss(values[:, :-1], torch.zeros(1, 5), torch.ones(1, 5), mask, clip_eps=10.0)
        loss.backward()
        assert all(p.grad is not None for p in critic_params)
        reached = [p for p in models.policy.parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)]
        if critic == "separate":
            assert reached == []
        else:  # the shared head's value loss trains the searcher's own weights (after the head moved off zero)
            with torch.no_grad():
                models.value_head.weight.fill_(0.1)
            _, values = models.forward(ids, attention, values=True)
            loss, _ = rl.value_loss(values[:, :-1], torch.zeros(1, 5), torch.ones(1, 5), mask, clip_eps=10.0)
            loss.backward()
            assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in models.policy.parameters())


def test_during_the_critic_warmup_only_the_critic_learns(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    config = _ppo(tmp_path, tiny_model_dir, steps=1, critic_warmup_steps=1)
    summary = train_online(config, FixedTask(), _examples())
    base, policy = model_params(tiny_model_dir), model_params(tmp_path / "rl" / "model")
    assert all(torch.equal(base[k], policy[k]) for k in base)  # not one weight of the policy moved
    optimizer = torch.load(tmp_path / "rl" / "checkpoint" / "optimizer.pt", weights_only=True)
    assert optimizer["state"] == {}  # the actor's optimizer never stepped
    assert float(_critic_params(tmp_path / "rl" / "checkpoint")["head.bias"].abs()) > 0
    last = summary["last"]
    assert last["actor_updated"] is False and "value_loss" in last and "grad_norm" not in last


def test_the_policy_update_is_independent_of_the_critics_learning(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With a separate critic the actor's step does not depend on how the critic learns (its rate here); with the
    shared head it does: the value loss's weight changes the searcher's own weights."""
    import torch

    def policy_after(name: str, **overrides: Any) -> dict[str, Any]:
        config = _ppo(tmp_path, tiny_model_dir, output_dir=str(tmp_path / name), **overrides)
        train_online(config, FixedTask(), _examples())
        return model_params(tmp_path / name / "model")

    fast, frozen = policy_after("fast", critic_learning_rate=1e-2), policy_after("frozen", critic_learning_rate=0.0)
    assert any(not torch.equal(fast[k], v) for k, v in model_params(tiny_model_dir).items())
    assert all(torch.equal(fast[k], frozen[k]) for k in fast)
    # (the head starts at zero, so the value gradient reaches the backbone from the second mini-batch on)
    weighted = policy_after("shared", critic="shared_head", vf_coef=1.0)
    unweighted = policy_after("shared0", critic="shared_head", vf_coef=0.0)
    assert any(not torch.equal(weighted[k], unweighted[k]) for k in weighted)


def test_a_resumed_ppo_run_restores_the_critic_and_its_optimizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two steps in one go equal one step, a restart, and the second step: the critic and its optimizer state
    (Adam's moments) come back from the checkpoint."""
    import torch

    straight = _ppo(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "straight"), steps=2, mini_batches=1)
    train_online(straight, FixedTask(), _examples())
    resumed = dataclasses.replace(straight, output_dir=str(tmp_path / "resumed"), steps=1)
    train_online(resumed, FixedTask(), _examples())
    after_one = _critic_params(tmp_path / "resumed" / "checkpoint")
    train_online(dataclasses.replace(resumed, steps=2), FixedTask(), _examples())
    a, b = _critic_params(tmp_path / "straight" / "checkpoint"), _critic_params(tmp_path / "resumed" / "checkpoint")
    assert any(not torch.equal(after_one[k], b[k]) for k in b)  # the second step moved the critic
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), max(float((a[k] - b[k]).abs().max()) for k in a)
    opt_a = torch.load(tmp_path / "straight" / "checkpoint" / "critic_optimizer.pt", weights_only=True)
    opt_b = torch.load(tmp_path / "resumed" / "checkpoint" / "critic_optimizer.pt", weights_only=True)
    assert [float(s["step"]) for s in opt_b["state"].values()] == [2.0] * len(opt_b["state"])  # not restarted
    for k, state in opt_a["state"].items():
        assert torch.allclose(state["exp_avg_sq"], opt_b["state"][k]["exp_avg_sq"], atol=1e-9)
    pa, pb = model_params(tmp_path / "straight" / "model"), model_params(tmp_path / "resumed" / "model")
    assert all(torch.allclose(pa[k], pb[k], atol=1e-6) for k in pa)


def test_a_lora_critic_is_trained_checkpointed_and_resumed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``critic_lora`` (default: as ``lora``): the critic is the base transformer with its own LoRA adapters and a
    value head; ``critic_lora: false`` keeps a fully trained critic beside a LoRA policy."""
    from safetensors.torch import load_file

    config = _ppo(tmp_path, tiny_model_dir, lora=True, lora_r=4, steps=2)
    train_online(config, FixedTask(), _examples())
    backbone = tmp_path / "rl" / "checkpoint" / "critic" / "backbone"
    adapter = load_file(str(backbone / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the critic's adapter learned
    assert not (backbone / "model.safetensors").exists()
    summary = train_online(dataclasses.replace(config, steps=3), FixedTask(), _examples())
    assert summary["steps"] == 3 and "critic_grad_norm" in summary["last"]
    resumed = load_file(str(backbone / "adapter_model.safetensors"))
    assert resumed.keys() == adapter.keys() and any(not (resumed[k] == adapter[k]).all() for k in adapter)

    full = _ppo(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "full"), lora=True, critic_lora=False)
    train_online(full, FixedTask(), _examples())
    assert (tmp_path / "full" / "checkpoint" / "critic" / "backbone" / "model.safetensors").exists()


class Killed(Exception):
    pass


def test_a_killed_run_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, tiny_model_dir, steps=3)
    calls = {"n": 0}

    def score(trace: Trace) -> float:
        return float(len(trace.answer or "") % 2)

    class Dying(DirectTask):
        def episodes(self, traces: list[Trace]) -> list[Episode]:
            calls["n"] += 1
            if calls["n"] == 3:
                raise Killed  # during the third step, after the checkpoint of step 2
            return super().episodes(traces)

    with pytest.raises(Killed):
        train_online(config, Dying(score), _examples())
    state = json.loads((tmp_path / "rl" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2
    seen: list[list[str]] = []
    real = online_rl._batch

    def recorded(*args: Any, **kwargs: Any) -> list[Example]:
        batch = real(*args, **kwargs)
        seen.append([e.id for e in batch])
        return batch

    monkeypatch.setattr(online_rl, "_batch", recorded)
    summary = train_online(config, DirectTask(score), _examples())
    assert len(seen) == 1 and seen[0] == [e.id for e in real(_examples(), 2, 2, config.seed)]  # only step 3 ran
    steps = [json.loads(line)["step"] for line in (tmp_path / "rl" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2] and summary["steps"] == 3


class _RaisingContext(Context):
    """The live policy's context, except that a rollout of book 1 raises (as a token-extraction bug once did)."""

    async def chat(self, trace: Trace, kind: str, user: str, sampling: Sampling, **kw: Any) -> Any:
        if "book 1" in user:
            raise KeyError("eos_logprob")
        return await super().chat(trace, kind, user, sampling, **kw)


class RaisingTask(DirectTask):
    def context(self, llm: Any, agent_config: Any) -> Context:
        return _RaisingContext(llm=llm, retriever=None, config=agent_config)

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        failed = [t for t in traces if t.error]
        out = super().episodes([t for t in traces if not t.error])
        return out + [
            Episode(group=t.example.metadata["rl"]["group"], messages=None, reward=0.0, components={}) for t in failed
        ]


def test_a_step_with_too_many_failed_rollouts_stops_before_training_on_the_rest(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """2 of 6 episodes raise: over max_failed_fraction (0.25) the run stops before the update, naming the error; at
    1.0 it trains on the rest and the step log counts the failures by message."""
    config = _config(tmp_path, tiny_model_dir, prompts_per_step=3, group_size=2, output_dir=str(tmp_path / "stop"))
    with pytest.raises(RuntimeError, match=r"2 of 6 episodes failed.*KeyError: 'eos_logprob'"):
        train_online(config, RaisingTask(lambda t: float(len(t.answer or "") % 2)), _examples(3))
    assert not (tmp_path / "stop" / "log.jsonl").exists() or not (tmp_path / "stop" / "log.jsonl").read_text()
    assert not (tmp_path / "stop" / "model").exists()
    config = dataclasses.replace(config, max_failed_fraction=1.0, output_dir=str(tmp_path / "go"))
    train_online(config, RaisingTask(lambda t: float(len(t.answer or "") % 2)), _examples(3))
    log = [json.loads(x) for x in (tmp_path / "go" / "log.jsonl").read_text().splitlines()]
    assert log[0]["failed"] == 2 and log[0]["failed_errors"] == {"KeyError: 'eos_logprob'": 2}
    assert (tmp_path / "go" / "model").exists()


def test_batches_cover_the_data_before_repeating() -> None:
    examples = _examples(5)
    ids = [e.id for step in range(5) for e in online_rl._batch(examples, step, 2, seed=1)]
    assert sorted(ids[:5]) == sorted(e.id for e in examples)  # the first pass sees every question once
    assert online_rl._batch(examples, 3, 2, seed=1) == online_rl._batch(examples, 3, 2, seed=1)


def test_observation_tokens_do_not_enter_the_loss(tiny_model_dir: Path) -> None:
    """State masking on a real chat template: log-probs at observation positions can be anything."""
    import torch
    from transformers import AutoTokenizer

    from sleuth.train import rl
    from sleuth.train.tokens import tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    segments = [
        {"source": "model", "text": "<query>who wrote it</query>"},
        {"source": "observation", "text": "\n<information>Doc 1 Ann wrote it.</information>\n"},
        {"source": "model", "text": "<search_complete>True</search_complete>"},
    ]
    chat = tokenize_chat(tokenizer, [{"role": "user", "content": "Q"}, {"role": "assistant", "segments": segments}])
    mask = torch.tensor([chat.model_mask[1:]], dtype=torch.float32)
    torch.manual_seed(0)
    logp = -torch.rand(mask.shape)
    old = logp.detach() - 0.05
    ref = logp.detach() + 0.1
    adv = torch.tensor([1.5])
    loss, _ = rl.grpo_loss(logp, old, ref, adv, mask, beta=0.04, kl="arena", aggregation="token-mean")
    noisy = torch.where(mask > 0, logp, logp - 5 * torch.rand(mask.shape))
    loss_noisy, _ = rl.grpo_loss(noisy, old, ref, adv, mask, beta=0.04, kl="arena", aggregation="token-mean")
    assert float(loss) == pytest.approx(float(loss_noisy))
    assert 0 < mask.sum() < mask.numel()


HEADER = "INSTRUCTION: answer the question from the documents below, citing them.\n"
LONG_DOC = "Doc 1 " + "alpha beta gamma " * 40
SHORT_DOC = "Doc 2 a short note."


def _prompt(question: str) -> dict[str, Any]:
    from sleuth.train.tokens import observation_segments

    content = f"{HEADER}{LONG_DOC}\n{SHORT_DOC}\nQuestion: {question}"
    return {"role": "user", "content": content, "segments": observation_segments(content, [LONG_DOC, SHORT_DOC])}


def _long_chat() -> list[dict[str, Any]]:
    segments = [
        {"source": "model", "text": "<query>who wrote it</query>"},
        {"source": "observation", "text": "\n\n<information>" + "delta epsilon " * 30 + "</information>\n\n"},
        {"source": "model", "text": "<answer>Ann</answer>"},
    ]
    return [_prompt("Who wrote it?"), {"role": "assistant", "segments": segments}]


def _model_ids(ids: list[int], mask: list[int]) -> list[int]:
    return [t for t, m in zip(ids, mask, strict=True) if m]


def test_observation_segments_change_neither_the_ids_nor_the_model_mask(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from sleuth.train.tokens import tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    marked = tokenize_chat(tokenizer, _long_chat())
    plain = tokenize_chat(tokenizer, [{"role": "user", "content": _long_chat()[0]["content"]}, _long_chat()[1]])
    assert marked.input_ids == plain.input_ids and marked.model_mask == plain.model_mask
    observed = tokenizer.decode([t for t, o in zip(marked.input_ids, marked.observation_mask, strict=True) if o])
    assert "alpha beta gamma" in observed and "short note" in observed and "delta epsilon" in observed
    assert "INSTRUCTION" not in observed and "<answer>" not in observed
    assert len({o for o in marked.observation_mask if o}) == 3  # three observations, kept apart


def test_an_episode_over_the_limit_keeps_its_instruction_and_every_model_token(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from sleuth.train.tokens import KEEP_TAIL, fit_to_length, tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = tokenize_chat(tokenizer, _long_chat())
    assert fit_to_length(full, None) is full and fit_to_length(full, len(full)) is full
    fitted = fit_to_length(full, len(full) - 50)
    assert fitted is not None and len(fitted) == len(full) - 50 and fitted.cut_tokens == 50 and fitted.truncated
    first_observation = full.observation_mask.index(1)
    assert fitted.input_ids[:first_observation] == full.input_ids[:first_observation]  # the instruction, whole
    assert tokenizer.decode(fitted.input_ids[:first_observation]).count("INSTRUCTION") == 1
    assert _model_ids(fitted.input_ids, fitted.model_mask) == _model_ids(full.input_ids, full.model_mask)
    assert fitted.model_tokens == full.model_tokens
    sizes = {o: full.observation_mask.count(o) for o in (1, 2, 3)}
    after = {o: fitted.observation_mask.count(o) for o in (1, 2, 3)}
    assert sizes[1] - 50 > sizes[3] > sizes[2]
    assert after == {1: sizes[1] - 50, 2: sizes[2], 3: sizes[3]}  # only the longest observation is cut
    more = fit_to_length(full, len(full) - (sizes[1] - sizes[3]) - 40)
    assert more is not None
    after = {o: more.observation_mask.count(o) for o in (1, 2, 3)}
    assert after == {1: sizes[3] - 20, 2: sizes[2], 3: sizes[3] - 20}  # the two long ones, down to one length
    text = tokenizer.decode(fitted.input_ids)
    assert text.endswith("<answer>Ann</answer><|im_end|>\n") and "</information>" in text  # closing tags kept
    last = [t for t, o in zip(fitted.input_ids, fitted.observation_mask, strict=True) if o == 3][-KEEP_TAIL:]
    assert last == [t for t, o in zip(full.input_ids, full.observation_mask, strict=True) if o == 3][-KEEP_TAIL:]


def test_an_episode_that_cannot_fit_without_cutting_the_model_or_the_instruction_is_refused(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    from sleuth.train.tokens import fit_to_length, tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = tokenize_chat(tokenizer, _long_chat())
    kept = sum(1 for o in full.observation_mask if not o)
    assert fit_to_length(full, kept - 1) is None
    bare = fit_to_length(full, kept)
    assert bare is not None and not any(bare.observation_mask) and len(bare) == kept
    assert _model_ids(bare.input_ids, bare.model_mask) == _model_ids(full.input_ids, full.model_mask)


def test_observations_are_cut_longest_first_down_to_one_level() -> None:
    from sleuth.train.tokens import _level_cuts

    assert _level_cuts([10, 3, 7], 6) == [5, 0, 1]  # lengths 5, 3, 6: the two long ones meet, the short one stays
    assert _level_cuts([4, 4], 3) == [2, 1]
    assert _level_cuts([9], 9) == [9]


def test_the_step_log_counts_cut_and_dropped_episodes(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    from sleuth.train.tokens import tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = FixedTask(long=True)
    probe = tokenize_chat(tokenizer, [_prompt("Who wrote book 0?"), {"role": "assistant", "content": ""}])
    limit = len(probe) - 20  # every episode is longer than that: each loses document tokens
    config = _config(tmp_path, tiny_model_dir, max_episode_tokens=limit, progress=True)
    summary = train_online(config, task, _examples())
    log = [json.loads(line) for line in (tmp_path / "rl" / "log.jsonl").read_text().splitlines()]
    assert len(task.seen) == 6 and log[0]["truncated"] == 6 and log[0]["too_long"] == 0 and log[0]["failed"] == 0
    cut = 0
    for episode in task.seen:
        full = tokenize_chat(tokenizer, episode.messages or [])
        assert episode.input_ids is not None and episode.mask is not None and len(episode.input_ids) <= limit
        assert episode.input_ids[:10] == full.input_ids[:10]
        assert _model_ids(episode.input_ids, episode.mask) == _model_ids(full.input_ids, full.model_mask)
        assert episode.cut_tokens == len(full) - len(episode.input_ids) > 0
        cut += episode.cut_tokens
    assert log[0]["truncated_tokens"] == cut and "loss" in log[0] and summary["truncated"] == 6
    assert "cut 6 episodes" in capsys.readouterr().out

    # a limit below the instruction and the answer: every episode is dropped, counted, and the run goes on
    config = _config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "tiny-limit"), max_episode_tokens=5)
    summary = train_online(config, FixedTask(long=True), _examples())
    last = summary["last"]
    assert last["too_long"] == 6 and last["failed"] == 0 and last["truncated"] == 0 and "loss" not in last
    assert summary["too_long"] == 6


_DATA_PARALLEL_SCRIPT = '''
import json, os, sys
from typing import Any

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig
from sleuth.llm import Sampling
from sleuth.records import Example
from sleuth.train.online_rl import Episode, RLConfig, Task, train_online


class FixedTask(Task):
    """Episodes that do not depend on the sampled text: the update is then a function of the batch alone."""

    method = "direct"

    def agent_config(self, config: RLConfig) -> Any:
        return DirectConfig(sampling=Sampling(temperature=1.0, max_new_tokens=2))

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=None, config=agent_config)

    def episodes(self, traces: list) -> list:
        out = []
        for trace in traces:
            meta = trace.example.metadata["rl"]
            answer = f"{trace.example.id} is number {meta['sample']}"
            messages = [{"role": "user", "content": trace.example.question}, {"role": "assistant", "content": answer}]
            reward = float((int(trace.example.id[1:]) + 2 * meta["sample"]) % 3)
            if os.environ.get("FAIL_RANK") == os.environ.get("RANK", "0"):  # this process's rollouts all failed
                messages = None
            out.append(Episode(group=meta["group"], messages=messages, reward=reward, components={"r": reward}))
        return out


config = RLConfig(**json.loads(sys.argv[1]))
examples = [Example(id=f"q{i}", question=f"Who wrote book {i}?", answers=["Ann"]) for i in range(5)]
train_online(config, FixedTask(), examples)
'''


@pytest.mark.parametrize(
    ("algorithm", "variant"),
    [
        ("grpo", {}),  # the one variant `make test` runs; the others (30-65 s each) run in CI's `make test-full`
        pytest.param("ppo", {}, marks=pytest.mark.slow),
        # DDP over the shared value head, and over a policy that only accumulates during the critic's warm-up
        pytest.param("ppo", {"critic": "shared_head", "critic_warmup_steps": 1}, marks=pytest.mark.slow),
        # DDP over the adapter's parameters only
        pytest.param("grpo", {"lora": True, "learning_rate": 1e-2}, marks=pytest.mark.slow),
    ],
    ids=["grpo", "ppo", "ppo-shared-head-warmup", "grpo-lora"],
)
def test_two_processes_make_the_same_update_as_one_with_the_whole_batch(
    algorithm: str, variant: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Data parallel (torchrun, gloo on CPU): each process trains on half the questions, DDP syncs the gradients
    (global normalisation, the loss scaled by the process count: sums), so the weights after two steps equal a single
    process's on the same batches (for PPO: the policy's and the critic's, separate or shared head)."""
    import os
    import subprocess
    import sys

    import torch

    assert not hasattr(online_rl.DataParallel, "sum_gradients")  # the engine syncs, nothing sums by hand
    script = tmp_path / "train.py"
    script.write_text(_DATA_PARALLEL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, launcher in [
        ("one", [sys.executable]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]),
    ]:
        config = two_process_rl_config(
            tiny_model_dir, tmp_path / name, algorithm, steps=2, prompts_per_step=4, save_steps=2, **variant
        )
        args = json.dumps(dataclasses.asdict(config))
        done = subprocess.run([*launcher, str(script), args], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name
    parallelism = {n: json.loads((d / "summary.json").read_text())["parallelism"] for n, d in runs.items()}
    assert parallelism == {"one": "none", "two": "ddp"}
    one, two = model_params(runs["one"] / "model"), model_params(runs["two"] / "model")
    base = model_params(tiny_model_dir)
    assert any(not torch.allclose(base[k], one[k], atol=1e-4) for k in base)  # training moved the weights
    # float summation order differs; Adam magnifies it where a gradient is near its eps (updates are 1e-3 per step)
    assert all(torch.allclose(one[k], two[k], atol=1e-4) for k in one), max(
        float((one[k] - two[k]).abs().max()) for k in one
    )
    if variant.get("critic") == "shared_head":
        h1, h2 = (torch.load(d / "checkpoint" / "value_head.pt", weights_only=True) for d in runs.values())
        assert float(h1["bias"].abs()) > 0  # the head learned (alone in the warm-up step)
        assert all(torch.allclose(h1[k], h2[k], atol=1e-4) for k in h1)
    elif algorithm == "ppo":  # the separate critic's gradients are synced across processes like the policy's
        c1, c2 = _critic_params(runs["one"] / "checkpoint"), _critic_params(runs["two"] / "checkpoint")
        assert any(not torch.equal(c1[k], base[f"model.{k}"]) for k in c1 if not k.startswith("head."))
        assert all(torch.allclose(c1[k], c2[k], atol=1e-4) for k in c1), max(
            float((c1[k] - c2[k]).abs().max()) for k in c1
        )
    logs = {name: [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()] for name, d in runs.items()}
    for a, b in zip(logs["one"], logs["two"], strict=True):
        for key in (
            "reward",
            "reward/r",
            "response_tokens",
            "loss",
            "kl",
            "entropy",
            "grad_norm",
            "value_loss",
            "critic_grad_norm",
        ):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    from sleuth.train.rollouts import RolloutStore

    stored = list(RolloutStore(runs["two"] / "rollouts" / "step-00001"))
    assert len(stored) == 4 * (2 if algorithm == "grpo" else 1)  # both processes' traces, written once

    # a process whose rollouts all fail still takes part in every collective; the other one trains
    done = subprocess.run(
        # (max_failed_fraction 1.0: half the step's episodes fail by design, which would otherwise stop the run)
        [
            *launcher,
            str(script),
            json.dumps({**json.loads(args), "output_dir": str(tmp_path / "failing"), "max_failed_fraction": 1.0}),
        ],
        env={**env, "FAIL_RANK": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = [json.loads(x) for x in (tmp_path / "failing" / "log.jsonl").read_text().splitlines()]
    assert [r["failed"] for r in log] == [len(stored) // 2] * 2
    assert all("loss" in r if r.get("actor_updated", True) else "value_loss" in r for r in log)  # (critic warm-up)


class _LoraServer:
    """A vLLM-like OpenAI server with runtime LoRA loading, over a real socket: ``/v1/load_lora_adapter`` reads the
    adapter's safetensors from ``lora_path`` (400 if the name is taken), ``/v1/unload_lora_adapter`` (404 if
    unknown), and completions (chat, or token-id prompts) answer only for a loaded adapter's name (404 otherwise, as
    vLLM does), without token ids (a server without vLLM's ``return_token_ids``: the trainer re-tokenizes)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.loaded: dict[str, dict[str, Any]] = {}
        self.history: dict[str, dict[str, Any]] = {}  # every adapter ever loaded, by name
        self.events: list[tuple[str, str, int]] = []  # (endpoint, name, status)
        self.completions: list[str] = []  # model name of each completion request
        self.run_ids: set[str] = set()  # ServedPolicy's per-run id in the adapter names
        self.per_prompt: dict[str, int] = {}
        self.lock = threading.Lock()
        state = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                status, payload = state.handle(self.path, body)
                self._send(status, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from safetensors.torch import load_file

        with self.lock:
            if path.endswith("/load_lora_adapter"):
                name = body["lora_name"]
                self.run_ids.add(name.split("-")[1])
                status = 400 if name in self.loaded else 200
                if status == 200:
                    tensors = load_file(str(Path(body["lora_path"]) / "adapter_model.safetensors"))
                    self.loaded[name] = self.history[name] = tensors
                self.events.append(("load", name, status))
                return status, {"message": "ok" if status == 200 else f"{name} has already been loaded"}
            if path.endswith("/unload_lora_adapter"):
                name = body["lora_name"]
                status = 200 if self.loaded.pop(name, None) is not None else 404
                self.events.append(("unload", name, status))
                return status, {"message": "ok" if status == 200 else f"{name} cannot be found"}
            if path.endswith("/completions"):  # chat, or (token-in) ids to /completions; no ids come back
                if body["model"] not in self.loaded:
                    return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
                self.completions.append(body["model"])
                # alternate per prompt, not per arrival: a group's samples of one question arrive interleaved with the
                # other group's, and by arrival order a group could get all "Ann" (no variance, no update)
                prompt = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)
                self.per_prompt[prompt] = self.per_prompt.get(prompt, 0) + 1
                text = "Ann" if self.per_prompt[prompt] % 2 else "Bob"
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
                if path.endswith("/chat/completions"):
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return 200, {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
            return 404, {"error": {"message": f"no route {path}"}}

    def plain(self, names: Any) -> list[str]:
        """Adapter names without the run id (``policy-RUNID-step-00001`` -> ``policy-step-00001``)."""
        return [re.sub(r"^policy-[0-9a-f]{8}-", "policy-", n) for n in names]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_rollouts_from_a_server_that_reloads_the_lora_adapter_every_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    server = _LoraServer()
    try:
        spec = f"openai:tiny@{server.url}?timeout=5&max_retries=0&backoff=0.01"
        task = DirectTask(lambda t: float("Ann" in (t.answer or "")))
        config = _config(tmp_path, tiny_model_dir, lora=True, lora_r=4, rollout_server=spec, steps=1)
        train_online(config, task, _examples())
        out = tmp_path / "rl"
        assert server.plain(server.completions) == ["policy-step-00000"] * 6  # 2 questions x group 3, the adapter
        (first,) = server.history
        initial = server.history[first]
        assert all(float(t.abs().max()) == 0.0 for k, t in initial.items() if "lora_B" in k)  # PEFT starts B at 0
        after_one = load_file(str(out / "checkpoint" / "policy" / "adapter_model.safetensors"))
        assert any(float(t.abs().max()) > 0 for k, t in after_one.items() if "lora_B" in k)  # the update moved B

        # resumed to three steps: step 1 samples from the weights of the checkpoint, step 2 replaces it
        train_online(dataclasses.replace(config, steps=3), task, _examples())
        (resumed,) = [n for n in server.history if n != first and n.endswith("-step-00001")]
        served = server.history[resumed]
        assert served.keys() == after_one.keys() and all(torch.equal(served[k], after_one[k]) for k in served)
        assert server.plain(server.completions[6:]) == ["policy-step-00001"] * 6 + ["policy-step-00002"] * 6
        assert len(server.run_ids) == 2  # each run names its adapters with its own id
        assert ("unload", resumed, 200) in server.events and resumed not in server.loaded
        assert sorted(p.name for p in (out / "served").iterdir()) == ["step-00002"]
        assert ("unload", first, 200) in server.events  # the first run's adapter, cleaned on resume
        assert server.plain(server.loaded) == ["policy-step-00002"]
    finally:
        server.close()


def test_a_rollout_server_must_be_reachable_and_named_with_the_setting_it_needs(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from sleuth.train.served_policy import ServedPolicyError

    spec = "openai:tiny@http://127.0.0.1:9/v1?timeout=1&max_retries=0"
    full = _config(tmp_path, tiny_model_dir, rollout_server=spec)  # no lora: the full weights are reloaded
    with pytest.raises(ServedPolicyError, match="VLLM_SERVER_DEV_MODE=1"):
        train_online(full, DirectTask(lambda t: 0.0), _examples())
    config = _config(tmp_path, tiny_model_dir, lora=True, rollout_server=spec)
    with pytest.raises(ServedPolicyError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        train_online(config, DirectTask(lambda t: 0.0), _examples())


def test_gradient_checkpointing_recomputes_activations_without_changing_the_update(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``gradient_checkpointing`` is a memory option only: the policy and the critic recompute their activations
    in the backward pass, and a PPO step ends with the same weights as without it."""
    import torch

    for on in (False, True):  # a block runs again in the backward pass only with checkpointing
        config = _ppo(tmp_path, tiny_model_dir, gradient_checkpointing=on)
        models = online_rl._Models(config, tiny_model_dir, None, torch.device("cpu"))
        assert models.critic is not None
        models.train()
        calls = {"policy": 0, "critic": 0}
        inner = {
            "policy": models.policy.model.layers[0].self_attn,
            "critic": models.critic["backbone"].layers[0].self_attn,
        }

        def counter(name: str, calls: dict[str, int] = calls) -> Callable[..., None]:
            return lambda *_: calls.__setitem__(name, calls[name] + 1)

        for name, module in inner.items():
            module.register_forward_hook(counter(name))
        ids = torch.tensor([[5, 6, 7, 8]])
        logits, values = models.forward(ids, torch.ones_like(ids), values=True)
        (logits.sum() + values.sum()).backward()
        assert calls == ({"policy": 2, "critic": 2} if on else {"policy": 1, "critic": 1})
    runs = {}
    for on in (False, True):
        out = tmp_path / f"checkpointing-{on}"
        config = _ppo(tmp_path, tiny_model_dir, output_dir=str(out), gradient_checkpointing=on, steps=2)
        train_online(config, FixedTask(), _examples())
        runs[on] = (model_params(out / "model"), _critic_params(out / "checkpoint"))
    for plain, recomputed in zip(runs[False], runs[True], strict=True):
        assert all(torch.allclose(plain[k], recomputed[k], atol=1e-6) for k in plain)
    assert any(not torch.equal(runs[True][0][k], v) for k, v in model_params(tiny_model_dir).items())


class _OneParameterPolicy:
    """Stands in for ``_Models`` in ``_update``: every position's logits are ``[theta, 0]``, so the log-prob of
    token 0 is ``theta - log(e^theta + 1)``, whose derivative at theta = 0 is 1/2."""

    def __init__(self) -> None:
        import torch

        self.theta = torch.zeros((), requires_grad=True)
        self.optimizer = torch.optim.SGD([self.theta], lr=1.0)
        self.critic = None
        self.critic_optimizer = None
        self.device = torch.device("cpu")
        self.tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
        self.loss_scale = 1
        self.sharded = self.replicated = False

    def critic_parameters(self) -> list[Any]:
        return []

    def no_sync(self, accumulate: bool, policy: bool = True) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def forward(self, ids: Any, attention: Any, values: bool = False) -> tuple[Any, Any]:
        import torch

        logits = torch.stack([self.theta.expand(ids.shape), torch.zeros(ids.shape)], dim=-1)
        return logits, None


@pytest.mark.parametrize(("mode", "expected"), [("mini_batch_mean", 0.125), ("micro_batch_mean", 0.25)])
def test_micro_batch_aggregation_sets_the_gradient_scale_of_unequal_micro_batches(mode: str, expected: float) -> None:
    """Two micro-batches, of 1 and 3 model tokens, with advantages 1 and 0 (GRPO, ratio 1, no KL): each token's
    loss has gradient -A * 1/2. One token mean over the mini-batch gives the first micro-batch 1/4 of the weight
    (gradient -1/8); the mean of the two micro-batch means gives it 1/2 (gradient -1/4). SGD at lr 1 moves theta
    by minus the gradient."""
    import torch

    models = _OneParameterPolicy()
    episodes = [
        Episode(group="g", messages=None, reward=1.0, components={}, input_ids=[0, 0], mask=[0, 1]),
        Episode(group="g", messages=None, reward=0.0, components={}, input_ids=[0, 0, 0, 0], mask=[0, 1, 1, 1]),
    ]
    logp = -math.log(2.0)
    stats = [
        {
            "old": torch.full((n,), logp),
            "ref": torch.full((n,), logp),
            "mask": torch.ones(n),
            "adv": torch.full((n,), a),
        }
        for n, a in ((1, 1.0), (3, 0.0))
    ]
    config = RLConfig(micro_batch=1, max_grad_norm=1e9, micro_batch_aggregation=mode)  # type: ignore[arg-type]
    online_rl._update(models, episodes, stats, config, online_rl.DataParallel())  # type: ignore[arg-type]
    assert float(models.theta.detach()) == pytest.approx(expected)


def test_the_value_head_starts_as_verl_s_and_adamw_decays_as_configured(tiny_model_dir: Path) -> None:
    """veRL's critic is AutoModelForTokenClassification: its score head has weight ~ N(0, initializer_range) and
    bias 0; s3's AdamW (actor and critic) has veRL's weight decay 0.01, ARENA's the HF Trainer's 0."""
    import torch
    from transformers import AutoConfig

    from sleuth.train.arena_rl import ArenaRLConfig
    from sleuth.train.s3_rl import S3RLConfig

    std = AutoConfig.from_pretrained(tiny_model_dir).initializer_range
    s3 = S3RLConfig(model=str(tiny_model_dir))
    assert (s3.weight_decay, s3.value_head_init, s3.micro_batch_aggregation) == (0.01, "normal", "micro_batch_mean")
    arena = ArenaRLConfig()
    assert (arena.weight_decay, arena.micro_batch_aggregation) == (0.0, "micro_batch_mean")
    assert RLConfig().micro_batch_aggregation == "mini_batch_mean"
    torch.manual_seed(0)
    models = online_rl._Models(s3, tiny_model_dir, None, torch.device("cpu"))
    head = models.critic["head"]  # type: ignore[index]
    assert float(head.bias.detach().abs().sum()) == 0.0
    weight = head.weight.detach().flatten()
    assert weight.numel() >= 32 and 0.6 * std < float(weight.std()) < 1.4 * std and abs(float(weight.mean())) < std
    assert [g["weight_decay"] for g in models.optimizer.param_groups] == [0.01]
    assert [g["weight_decay"] for g in models.critic_optimizer.param_groups] == [0.01]  # type: ignore[union-attr]
    zeros = dataclasses.replace(s3, value_head_init="zeros", weight_decay=0.0, critic="shared_head")
    models = online_rl._Models(zeros, tiny_model_dir, None, torch.device("cpu"))
    assert float(models.value_head.weight.detach().abs().sum()) == 0.0  # type: ignore[union-attr]
    assert [g["weight_decay"] for g in models.optimizer.param_groups] == [0.0, 0.0]
    with pytest.raises(ValueError, match="value_head_init"):
        dataclasses.replace(s3, value_head_init="xavier").validate()  # type: ignore[arg-type]


def test_rows_per_generate_is_a_step_s_episodes_on_a_gpu_and_32_on_the_cpu() -> None:
    """RLConfig.rollout_batch 0 (the default) picks the rows of one live-policy generate call from the device: on a
    GPU all of a process's episodes of a step (prompts split over the processes, rounded up), on the CPU 32; a value
    set is kept; a negative one is refused."""
    config = RLConfig(model="m", output_dir="o", prompts_per_step=16, group_size=7)
    assert config.rows_per_generate("cuda") == 112 and config.rows_per_generate("cuda", world=3) == 6 * 7
    assert config.rows_per_generate("cpu") == 32
    assert dataclasses.replace(config, rollout_batch=48).rows_per_generate("cuda") == 48
    with pytest.raises(ValueError, match="rollout_batch"):
        dataclasses.replace(config, rollout_batch=-1).validate()
