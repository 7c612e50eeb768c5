"""FSDP2 sharding of the online RL loop (``sharding: fsdp``), two gloo processes on CPU with a tiny random model:
each process holds half of every model, the sharded update equals one process's on the whole batch (GRPO, and PPO
with its separate critic), a killed run resumes from its sharded checkpoint to the same weights, and the exported
policy loads with ``hf:``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sleuth.train.online_rl import RLConfig
from tests.conftest import model_params, two_process_rl_config

_SCRIPT = '''
import json, os, sys
from pathlib import Path
from typing import Any

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig
from sleuth.llm import Sampling
from sleuth.records import Example
from sleuth.train.online_rl import DataParallel, Episode, RLConfig, Task, _Models, train_online


class FixedTask(Task):
    """Episodes that do not depend on the sampled text: the update is a function of the batch alone."""

    method = "direct"
    calls = 0

    def agent_config(self, config: RLConfig) -> Any:
        return DirectConfig(sampling=Sampling(temperature=1.0, max_new_tokens=2))

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=None, config=agent_config)

    def episodes(self, traces: list) -> list:
        FixedTask.calls += 1
        if str(FixedTask.calls) == os.environ.get("DIE_AT_CALL"):
            os._exit(3)  # killed: no clean-up, no final save
        out = []
        for trace in traces:
            meta = trace.example.metadata["rl"]
            answer = f"{trace.example.id} is number {meta['sample']}"
            messages = [{"role": "user", "content": trace.example.question}, {"role": "assistant", "content": answer}]
            reward = float((int(trace.example.id[1:]) + 2 * meta["sample"]) % 3)
            out.append(Episode(group=meta["group"], messages=messages, reward=reward, components={"r": reward}))
        return out


config = RLConfig(**json.loads(sys.argv[1]))
dist = DataParallel()
if os.environ.get("COUNT_SHARDS") and dist.world > 1:
    import torch

    models = _Models(config, Path(config.model), None, torch.device("cpu"), sharded=True)
    def local(module):
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
    counts = {"policy": local(models.policy)}
    if models.reference is not None:
        counts["reference"] = local(models.reference)
    if config.lora:
        counts["adapter"] = sum(
            p.to_local().numel() for p in models.policy.parameters() if p.requires_grad
        )
    if models.critic is not None:
        counts["critic"] = local(models.critic)
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(config.output_dir) / f"shards-{dist.rank}.json").write_text(json.dumps(counts))
    del models
examples = [Example(id=f"q{i}", question=f"Who wrote book {i}?", answers=["Ann"]) for i in range(5)]
train_online(config, FixedTask(), examples)
'''

_TWO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _config(tiny_model_dir: Path, out: Path, algorithm: str, **overrides: Any) -> RLConfig:
    # 3 questions over 2 processes: one process has more micro-batches than the other (idle passes)
    return two_process_rl_config(tiny_model_dir, out, algorithm, **overrides)


def _run(launcher: list[str], script: Path, config: RLConfig, **env: str) -> subprocess.CompletedProcess[str]:
    args = json.dumps(dataclasses.asdict(config))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([*launcher, str(script), args], env=full_env, capture_output=True, text=True, timeout=900)


def _close(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-4) -> tuple[bool, float]:
    import torch

    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return all(torch.allclose(a[k].float(), b[k].float(), atol=atol) for k in a), worst


def _sharded_critic(checkpoint: Path, tmp: Path) -> dict[str, Any]:
    """The critic of a sharded checkpoint, read back in one process (DCP to a plain torch file)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint / "sharded"), str(tmp))
    state = torch.load(tmp, weights_only=False)["critic"]
    return {k: v for k, v in state.items()}


def _plain_critic(checkpoint: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(checkpoint / "critic" / "backbone").state_dict()
    head = torch.load(checkpoint / "critic" / "value_head.pt", weights_only=True)
    return {**{f"backbone.{k}": v for k, v in backbone.items()}, **{f"head.{k}": v for k, v in head.items()}}


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_two_sharded_processes_hold_half_and_make_the_update_of_one_process(
    algorithm: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    # two steps: the critic's value head starts at zero, so its backbone first moves in the second
    one = _config(tiny_model_dir, tmp_path / "one", algorithm, steps=2)
    # PPO's sharded run also recomputes activations (FSDP with activation checkpointing: the same update)
    checkpointing = algorithm == "ppo"
    two = _config(
        tiny_model_dir, tmp_path / "two", algorithm, steps=2, sharding="fsdp", gradient_checkpointing=checkpointing
    )
    done = _run([sys.executable], script, one)
    assert done.returncode == 0, done.stderr[-6000:]
    done = _run(_TWO, script, two, COUNT_SHARDS="1")
    assert done.returncode == 0, done.stderr[-6000:]

    base = model_params(tiny_model_dir)
    total = sum(v.numel() for v in base.values())
    counts = [json.loads((tmp_path / "two" / f"shards-{r}.json").read_text()) for r in range(2)]
    for name in counts[0]:
        local = [c[name] for c in counts]
        whole = total if name != "critic" else None
        if whole is not None:
            assert sum(local) == whole, (name, local, whole)  # every parameter in exactly one shard
        assert all(0.4 <= n / sum(local) <= 0.6 for n in local), (name, local)  # about half each

    a, b = model_params(tmp_path / "one" / "model"), model_params(tmp_path / "two" / "model")
    assert not _close(base, a, atol=1e-6)[0]  # the step moved the weights
    ok, worst = _close(a, b)
    assert ok, worst
    if algorithm == "ppo":
        c1 = _plain_critic(tmp_path / "one" / "checkpoint")
        c2 = _sharded_critic(tmp_path / "two" / "checkpoint", tmp_path / "critic.pt")
        backbone = [k for k in c1 if k.startswith("backbone.")]
        initial = {k: base[k.replace("backbone.", "model.", 1)] for k in backbone}
        assert not _close({k: c1[k] for k in backbone}, initial, atol=1e-6)[0]  # the critic's backbone learned
        ok, worst = _close(c1, c2)
        assert ok, worst
    logs = {n: [json.loads(x) for x in (tmp_path / n / "log.jsonl").read_text().splitlines()] for n in ("one", "two")}
    for a_step, b_step in zip(logs["one"], logs["two"], strict=True):
        for key in ("reward", "loss", "entropy", "kl", "grad_norm", "value_loss", "critic_grad_norm"):
            if key in a_step:
                assert b_step[key] == pytest.approx(a_step[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_to_the_same_weights_and_exports_for_hf(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from sleuth.llm import load_llm

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    whole = _config(tiny_model_dir, tmp_path / "whole", "ppo", steps=2, sharding="fsdp")
    killed = dataclasses.replace(whole, output_dir=str(tmp_path / "killed"))
    done = _run(_TWO, script, whole)
    assert done.returncode == 0, done.stderr[-6000:]
    done = _run(_TWO, script, killed, DIE_AT_CALL="2")  # dies in step 2, after step 1's sharded checkpoint
    assert done.returncode != 0
    checkpoint = tmp_path / "killed" / "checkpoint"
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 1
    assert not (tmp_path / "killed" / "model").exists()
    done = _run(_TWO, script, killed)
    assert done.returncode == 0, done.stderr[-6000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    whole, killed = model_params(tmp_path / "whole" / "model"), model_params(tmp_path / "killed" / "model")
    ok, worst = _close(whole, killed, atol=1e-6)
    assert ok, worst  # policy (and its optimizer state, which the second step used) restored
    c1 = _sharded_critic(tmp_path / "whole" / "checkpoint", tmp_path / "c1.pt")
    c2 = _sharded_critic(checkpoint, tmp_path / "c2.pt")
    ok, worst = _close(c1, c2, atol=1e-6)
    assert ok, worst

    llm = load_llm(f"hf:{tmp_path / 'killed' / 'model'}")
    assert type(llm).__name__ == "HFLLM"
    base, exported = model_params(tiny_model_dir), model_params(tmp_path / "killed" / "model")
    assert exported.keys() == base.keys()


@pytest.mark.slow
def test_a_sharded_lora_policy_makes_the_update_of_one_process_and_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """LoRA under FSDP: the peft model is sharded like the plain one (frozen base weights and adapters alike, each
    process holds about half), the reference is the base with the adapter disabled, the update equals one process's
    (unsharded, the same LoRA), a killed run resumes from its sharded checkpoint, and the export is merged."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    one = _config(tiny_model_dir, tmp_path / "one", "grpo", steps=2, lora=True, learning_rate=1e-2)
    two = dataclasses.replace(one, output_dir=str(tmp_path / "two"), sharding="fsdp")
    killed = dataclasses.replace(two, output_dir=str(tmp_path / "killed"))
    done = _run([sys.executable], script, one)
    assert done.returncode == 0, done.stderr[-6000:]
    done = _run(_TWO, script, two, COUNT_SHARDS="1")
    assert done.returncode == 0, done.stderr[-6000:]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["parallelism"] == "fsdp"
    counts = [json.loads((tmp_path / "two" / f"shards-{r}.json").read_text()) for r in range(2)]
    assert all("reference" not in c for c in counts)  # no frozen copy: the adapter is switched off instead
    for name in ("policy", "adapter"):
        local = [c[name] for c in counts]
        assert all(0.4 <= n / sum(local) <= 0.6 for n in local), (name, local)

    base = model_params(tiny_model_dir)
    a, b = model_params(tmp_path / "one" / "model"), model_params(tmp_path / "two" / "model")
    assert a.keys() == base.keys()  # merged: a plain transformers model
    assert not _close(base, a, atol=1e-6)[0]
    ok, worst = _close(a, b)
    assert ok, worst
    logs = {n: [json.loads(x) for x in (tmp_path / n / "log.jsonl").read_text().splitlines()] for n in ("one", "two")}
    for a_step, b_step in zip(logs["one"], logs["two"], strict=True):
        for key in ("reward", "loss", "entropy", "kl", "grad_norm"):
            assert b_step[key] == pytest.approx(a_step[key], rel=1e-4, abs=1e-6), key

    done = _run(_TWO, script, killed, DIE_AT_CALL="2")
    assert done.returncode != 0
    assert json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())["step"] == 1
    done = _run(_TWO, script, killed)
    assert done.returncode == 0, done.stderr[-6000:]
    ok, worst = _close(b, model_params(tmp_path / "killed" / "model"), atol=1e-6)
    assert ok, worst  # the adapter and its optimizer state restored from the shards


def test_sharding_rejects_what_it_does_not_support_yet(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir, tmp_path, "ppo", sharding="fsdp", critic="shared_head")
    with pytest.raises(ValueError, match="sharding: fsdp does not support critic shared_head"):
        config.validate()
    _config(tiny_model_dir, tmp_path, "grpo", sharding="fsdp", lora=True).validate()  # LoRA is sharded now
    with pytest.raises(ValueError, match="sharding="):
        _config(tiny_model_dir, tmp_path, "grpo", sharding="zero3").validate()


_GENERATE = """
import json, sys
from pathlib import Path

import torch

from sleuth.train.online_rl import DataParallel, RLConfig, _Models, close_process_group

path, out = Path(sys.argv[1]), Path(sys.argv[2])
dist = DataParallel()
config = RLConfig(model=str(path), lora=True, sharding="fsdp" if dist.world > 1 else "none")
torch.manual_seed(0)  # the adapter's random init, alike on every process (train_online seeds them so)
models = _Models(config, path, None, torch.device("cpu"), sharded=dist.world > 1)
with torch.no_grad():  # an adapter that changes the output (a new one's B is zero)
    for name, p in models.policy.named_parameters():
        if "lora_B" in name:
            p.fill_(0.05)
ids = torch.tensor([[1, 5, 9, 11, 14, 20]])
greedy = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False}
with models.gathered_policy():
    tuned = models.policy.generate(input_ids=ids, **greedy)[0].tolist()
    with models.policy.disable_adapter():
        base = models.policy.generate(input_ids=ids, **greedy)[0].tolist()
out.mkdir(parents=True, exist_ok=True)
(out / f"{dist.rank}.json").write_text(json.dumps({"tuned": tuned, "base": base}))
close_process_group()  # what train_online ends with: left to interpreter teardown, gloo aborts a process now and then
"""


@pytest.mark.slow
def test_a_sharded_lora_policy_generates_what_the_whole_one_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Rollouts from a sharded peft model enter below the FSDP root (peft generates through the transformers model
    inside it): gathered, it samples the unsharded model's tokens, with the adapter and with it disabled."""
    script = tmp_path / "generate.py"
    script.write_text(_GENERATE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, launcher in (("one", [sys.executable]), ("two", _TWO)):
        args = [*launcher, str(script), str(tiny_model_dir), str(tmp_path / name)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-6000:]
    whole = json.loads((tmp_path / "one" / "0.json").read_text())
    assert whole["tuned"] != whole["base"]  # the adapter matters
    for rank in range(2):
        assert json.loads((tmp_path / "two" / f"{rank}.json").read_text()) == whole
