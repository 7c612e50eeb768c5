"""The online RL loop's token path, sampler correction and precision (issue 35 items 1-3) on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig
from sleuth.llm import Sampling
from sleuth.records import Trace
from sleuth.train.online_rl import Episode, RLConfig, Task, train_online
from tests.test_online_rl import _config, _examples


class TokenTask(Task):
    """The `direct` agent; its episodes carry the recorded ids when the rollout recorded them (as ARENA's do)."""

    method = "direct"

    def agent_config(self, config: RLConfig) -> Any:
        return DirectConfig(sampling=Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=6))

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=None, config=agent_config)

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        out = []
        for trace in traces:
            step = trace.steps[-1]
            messages = [*(step.messages or []), {"role": "assistant", "content": step.output or ""}]
            reward = float(len(step.output or "") % 3)
            episode = Episode(trace.example.metadata["rl"]["group"], messages, reward, {"score": reward})
            if tokens := step.meta.get("tokens"):
                episode.prompt_ids = tokens["prompt"]
                episode.pieces = [{"source": "model", "ids": tokens["sampled"], "logprobs": tokens["logprobs"]}]
            out.append(episode)
        return out


def _log(config: RLConfig) -> dict[str, Any]:
    return json.loads((Path(config.output_dir) / "log.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_update_trains_on_the_sampled_ids_and_logs_the_sampler_mismatch(
    tmp_path: Path, tiny_model_dir: Path, temperature: float
) -> None:
    config = _config(tmp_path, tiny_model_dir, temperature=temperature)
    train_online(config, TokenTask(), _examples())
    entry = _log(config)
    assert entry["sampled_episodes"] == 6 and entry["retokenized"] == 0
    # the in-process engine samples from the trained weights: the trainer's old log-probs at the sampling
    # temperature are the sampler's up to numerics, and nothing is corrected (auto = none without a server)
    assert (
        entry["sampler_tokens"] > 0 and entry["sampler_mismatch_abs"] < 1e-4 and entry["sampler_mismatch_max"] < 1e-3
    )
    assert entry["sampler_corrected"] == 0.0
    # the stored rollouts hold, per trace, the prompt ids and the sampled ids with their log-probs
    from sleuth.train.rollouts import RolloutStore

    stored = list(RolloutStore(Path(config.output_dir) / "rollouts" / "step-00000"))
    assert len(stored) == 6
    for rollout in stored:
        tokens = rollout.trace.steps[-1].meta["tokens"]
        assert tokens["prompt"] and tokens["sampled"] and len(tokens["logprobs"]) == len(tokens["sampled"])


def test_an_engine_without_ids_falls_back_to_retokenizing_and_is_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir, episode_tokens="retokenize")
    train_online(config, TokenTask(), _examples())
    entry = _log(config)
    assert entry["retokenized"] == 6 and entry["sampled_episodes"] == 0 and "sampler_tokens" not in entry


def test_config_refuses_unknown_token_and_correction_settings(tmp_path: Path, tiny_model_dir: Path) -> None:
    for bad in ({"episode_tokens": "text"}, {"sampler_correction": "clip"}, {"sampler_cap": 0.5}, {"dtype": "fp8"}):
        with pytest.raises(ValueError):
            _config(tmp_path, tiny_model_dir, **bad).validate()
    assert _config(tmp_path, tiny_model_dir).correction() == "none"
    assert _config(tmp_path, tiny_model_dir, rollout_server="openai:m@http://x/v1").correction() == "tis"
    assert _config(tmp_path, tiny_model_dir, sampler_correction="token_mask").correction() == "token_mask"


def test_fp32_master_weights_keep_the_small_updates_that_bf16_weights_round_away(tiny_model_dir: Path) -> None:
    """``dtype: bfloat16`` (what ``auto`` is on a bf16 GPU): float32 weights and AdamW state, bf16 autocast (on a CPU
    here). One AdamW step at lr 1e-5 moves every weight that has a gradient; the old rule, the weights themselves in
    bf16, leaves nearly all of them where they were (a 1e-5 step is below half a bf16 ulp of a weight above ~0.003)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sleuth.train.online_rl import _Models

    config = RLConfig(model=str(tiny_model_dir), dtype="bfloat16", learning_rate=1e-5, algorithm="grpo")
    models = _Models(config, tiny_model_dir, None, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in models.policy.parameters())
    assert models.compute_dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 42, 99, 7, 23, 64, 11]])
    attention = torch.ones_like(ids)

    def loss_of(logits: Any) -> Any:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return -logp.gather(-1, ids[:, 1:, None]).mean()

    def changed_share(model: Any, step: Any) -> float:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        step()
        moved = total = 0
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            has_grad = p.grad != 0
            moved += int(((p.detach() != before[name]) & has_grad).sum())
            total += int(has_grad.sum())
        return moved / total

    def new_rule() -> None:
        logits, _ = models.forward(ids, attention)
        assert logits.dtype == torch.bfloat16  # the compute ran in bf16
        loss_of(logits).backward()
        models.optimizer.step()

    assert changed_share(models.policy, new_rule) > 0.99
    assert all(p.dtype == torch.float32 for g in models.optimizer.state.values() for p in g.values() if p.dim())

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(old.parameters(), lr=1e-5, weight_decay=0.0)

    def old_rule() -> None:
        loss_of(old(input_ids=ids, attention_mask=attention).logits).backward()
        optimizer.step()

    assert changed_share(old, old_rule) < 0.05
