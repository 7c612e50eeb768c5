"""ARENA training: GRPO of the evidence-citing reader with adaptive rewards (Ren et al., arXiv 2505.13258, §3.2;
docs/training.md, "ARENA GRPO").

``sleuth train arena --config configs/arena_grpo.yaml``. Questions with given references (HotpotQA, 2Wiki, MuSiQue
train files: their paragraphs, in their original order, numbered as the ``arena`` agent numbers them) are answered
``group_size`` (G = 7) times each by the ``arena`` agent sampling from the live policy (T = 0.9, 256 new tokens);
each completion earns format + accuracy (EM; F1 as the paper's variant) + relevance (1 for exactly the supporting
references, 0.5 for an overlap, 0 otherwise) + a bonus of 10 when all three are full
(:mod:`sleuth.train.rewards`); advantages are group-normalised (unbiased std, eps 1e-4 as the code), the loss is the
clipped surrogate plus beta * KL to the initial policy with ARENA's squared log-ratio (``kl: k3`` for the standard
GRPO estimator), averaged over tokens as the released trainer does. LoRA is supported (the reference is then the
base model with the adapter disabled). The loop, its log, checkpoints and resume: :mod:`sleuth.train.online_rl`.

Examples without supporting passages among their references cannot be scored for relevance and are left out
(counted in ``OUT/data_summary.json``), as are examples without references.

>>> summary = train_arena(load_config(ArenaRLConfig, "configs/arena_grpo.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.agents.arena import ArenaConfig
from sleuth.agents.base import escape_observation
from sleuth.llm import Sampling
from sleuth.records import Example, Trace
from sleuth.train.common import with_sampling
from sleuth.train.config import load_config, to_mapping
from sleuth.train.online_rl import DataParallel, Episode, RLConfig, Task, train_online
from sleuth.train.tokens import observation_segments

__all__ = ["ArenaRLConfig", "ArenaTask", "load_arena_examples", "main", "relevant_numbers", "train_arena"]


@dataclass
class ArenaRLConfig(RLConfig):
    """Options of ``sleuth train arena`` (defaults: the paper / released code; docs/training.md, "ARENA GRPO")."""

    output_dir: str = "runs/arena-grpo"
    algorithm: Literal["grpo", "ppo"] = "grpo"
    group_size: int = 7
    prompts_per_step: int = 256  # paper: 256 prompts per optimizer step
    steps: int = 95  # 24,500 prompts / 256
    learning_rate: float = 3e-6
    warmup_steps: int = 10  # code: warmup_ratio 0.1 of ~95 steps
    beta: float = 0.04
    kl: str = "arena"
    adv_eps: float = 1e-4
    loss_aggregation: str = "token-mean"
    # TRL's gradient accumulation (4 per device x 64 steps): the mean of the micro-batches' token means
    micro_batch_aggregation: Literal["mini_batch_mean", "micro_batch_mean"] = "micro_batch_mean"
    temperature: float = 0.9
    top_p: float = 1.0
    seed: int = 42
    train_files: list[str] = field(default_factory=list)
    train_limit: int | None = None  # questions per file
    format: str | None = None
    agent: ArenaConfig = field(default_factory=lambda: ArenaConfig(sampling=Sampling(max_new_tokens=256)))
    accuracy: Literal["em", "f1"] = "em"
    bonus: float = 10.0
    # a deviation (the paper shows every sample the dataset's order): each of a group's episodes sees the shown
    # references in its own seeded random order, so that citing a number the policy favours wherever it stands is
    # right in some of a group's episodes and wrong in others (docs/training.md, "ARENA GRPO")
    shuffle_references: bool = False

    def validate(self) -> None:
        super().validate()
        if self.accuracy not in ("em", "f1"):
            raise ValueError(f"accuracy={self.accuracy!r}; expected 'em' or 'f1'")
        if not self.train_files:
            raise ValueError("train_files is empty: give ARENA training files with references")


def relevant_numbers(trace: Trace) -> set[int]:
    """The 1-based numbers, as the agent showed them, of the references that support the answer."""
    supporting = set(trace.example.supporting_ids)
    return {i for i, pid in enumerate(trace.meta.get("reference_ids") or [], 1) if pid in supporting}


class ArenaTask(Task):
    method = "arena"

    def __init__(self, config: ArenaRLConfig) -> None:
        self.config = config

    def agent_config(self, config: RLConfig) -> Any:
        return with_sampling(self.config.agent, config.temperature, config.top_p)

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=None, config=agent_config)

    def episode_example(self, example: Example, group: str, sample: int) -> Example:
        """With ``shuffle_references``: the shown references (the first ``agent.max_references``) in an order of
        the episode's own, seeded by the run's seed, the group and the sample (a resumed step draws the same); the
        references the agent cuts stay cut. Rewards follow, since the agent records the numbering it showed."""
        if not self.config.shuffle_references:
            return example
        shown = self.config.agent.max_references or len(example.context)
        head = list(example.context[:shown])
        random.Random(f"{self.config.seed}:{group}:{sample}").shuffle(head)
        example.context = head + list(example.context[shown:])
        return example

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        from sleuth.train.rewards import arena_reward

        out = []
        for trace in traces:
            group = trace.example.metadata["rl"]["group"]
            step = next((s for s in reversed(trace.steps) if s.messages is not None), None)
            if trace.error or step is None or step.output is None:
                out.append(Episode(group=group, messages=None, reward=0.0, components={}))
                continue
            scores = arena_reward(
                step.output,
                trace.example.answers,
                relevant_numbers(trace),
                accuracy=self.config.accuracy,
                bonus=self.config.bonus,
            )
            components = {k: float(v) for k, v in scores.items() if k != "total"}
            messages = [*_mark_references(step.messages, trace), {"role": "assistant", "content": step.output}]
            episode = Episode(group=group, messages=messages, reward=float(scores["total"]), components=components)
            tokens = step.meta.get("tokens")
            if tokens:  # token-in, token-out: the prompt ids as sent and every id sampled (end-of-turn included)
                episode.prompt_ids = list(tokens["prompt"])
                episode.pieces = [{"source": "model", "ids": tokens["sampled"], "logprobs": tokens.get("logprobs")}]
            out.append(episode)
        return out


def _mark_references(messages: list[dict[str, Any]], trace: Trace) -> list[dict[str, Any]]:
    """The prompt with the texts of its references marked as observations, so that an episode over
    ``max_episode_tokens`` is shortened in the references, never in the instruction."""
    by_id = {p.id: p for p in [*trace.example.context, *(p for s in trace.steps for p in s.passages)]}
    texts = [escape_observation(by_id[i].text) for i in trace.meta.get("reference_ids") or [] if i in by_id]
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            marked = observation_segments(message["content"], texts)
            if marked is not None:
                message["segments"] = marked
            break
    return out


def load_arena_examples(
    files: Sequence[str], limit: int | None = None, format: str | None = None, max_references: int | None = None
) -> tuple[list[Example], dict[str, Any]]:
    """Training questions with references and at least one supporting reference among those the agent shows (the
    first ``max_references``, when the agent cuts them: a cut-off supporting reference can never be cited, so
    R_rel and the bonus would be unreachable); the rest counted per file."""
    from sleuth.data import load_examples

    kept: list[Example] = []
    report: dict[str, Any] = {}
    for path in files:
        skipped: Counter[str] = Counter()
        examples = load_examples(path, format=format, limit=limit)
        for example in examples:
            shown = example.context if max_references is None else example.context[:max_references]
            if not example.context:
                skipped["no_references"] += 1
            elif not {p.id for p in example.context} & set(example.supporting_ids):
                skipped["no_supporting_reference"] += 1
            elif not {p.id for p in shown} & set(example.supporting_ids):
                skipped["supporting_references_cut"] += 1
            elif not example.answers:
                skipped["no_answer"] += 1
            else:
                kept.append(example)
        report[str(path)] = {"loaded": len(examples), "kept": len(examples) - sum(skipped.values()), **skipped}
    return kept, report


def train_arena(config: ArenaRLConfig) -> dict[str, Any]:
    config.validate()
    examples, report = load_arena_examples(
        config.train_files, config.train_limit, config.format, config.agent.max_references
    )
    out = Path(config.output_dir)
    if DataParallel().main:  # one writer when several processes train (torchrun / accelerate launch)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(to_mapping(config), indent=2, default=str) + "\n")
        (out / "data_summary.json").write_text(json.dumps(report, indent=2) + "\n")
    return train_online(config, ArenaTask(config), examples, log_name="arena")


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """``sleuth train arena --config cfg.yaml [--set key=value]``."""
    return train_arena(load_config(ArenaRLConfig, config_path, overrides))
