"""s3 training: RL of the searcher on Gain Beyond RAG while the generator stays frozen (Jiang et al., arXiv
2505.14146, §3; digest ``research/s3.md`` §4-7).

``sleuth train s3 --config configs/s3_ppo.yaml``. Only the searcher learns; the generator is any backend spec
(another local model, a vLLM or hosted endpoint) and is never updated. Before training, the naive-RAG accuracy
of every training question (the generator answering from the top-3 documents for the question) is computed once
into ``OUT/naive_rag_cache.jsonl`` (keyed by a fingerprint of the generator and retrieval settings: a different
generator recomputes), and the training questions are filtered as the paper does: yes/no/true/false answers and
questions naive RAG already answers are dropped, with counts in ``OUT/data_summary.json``.

Each step the ``s3`` agent runs on the step's questions with the live searcher sampling at T = 0.6, top-p 0.95 and
the frozen generator answering from the documents it kept; the reward is
``GBR = Acc(G(Q, D_s3), A) - Acc(G(Q, D_RAG), A)`` (``reward: code`` adds the official code's ``+ Acc``), with Acc
the normalised span match (``metric: judge`` and a ``judge`` spec switch to the LLM judge). The searcher's whole
trajectory is one assistant message in which retrieved ``<information>`` blocks are inserted: they are masked out
of the policy loss, the KL and the value loss (the initial documents in the prompt are marked as observations too,
so an episode over ``max_episode_tokens`` loses document text, never the instruction). Algorithms: **PPO** (the
paper's, with the reference's veRL settings: a separate critic initialised from the base model, critic lr 1e-5 with
a 15-step linear warm-up, actor lr 1e-6 constant, no critic-only warm-up steps, GAE with gamma = lambda = 1, KL to
the initial searcher in the reward with coefficient 0.001, clip 0.2, value clip 0.5, entropy 0.001, 120 questions
per step in 4 mini-batches; ``critic: shared_head`` is the memory-saving deviation) or **GRPO**
(``algorithm: grpo``, ``group_size`` rollouts per question, group-normalised GBR). The loop, its log, checkpoints
and resume: :mod:`sleuth.train.online_rl`.

>>> summary = train_s3(load_config(S3RLConfig, "configs/s3_ppo.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.agents.base import escape_observation, parse_options
from sleuth.agents.s3 import S3Config
from sleuth.llm import LLM
from sleuth.records import Example, Trace
from sleuth.retrieval import Retriever
from sleuth.train.config import ConfigError, load_config, to_mapping
from sleuth.train.online_rl import DataParallel, Episode, RLConfig, Task, train_online
from sleuth.train.tokens import observation_segments

__all__ = ["S3RLConfig", "S3Task", "main", "prepare_s3_data", "train_s3", "trajectory_messages"]


@dataclass
class S3RLConfig(RLConfig):
    """Options of ``sleuth train s3`` (defaults: the paper and its training script, research/s3.md §7)."""

    output_dir: str = "runs/s3-rl"
    algorithm: Literal["grpo", "ppo"] = "ppo"
    group_size: int = 1  # PPO: one rollout per question (n_agent = 1)
    prompts_per_step: int = 120
    steps: int = 20  # the paper evaluates the step-20 checkpoint
    mini_batches: int = 4  # ppo_mini_batch_size 30 of 120
    learning_rate: float = 1e-6
    critic_learning_rate: float = 1e-5
    # veRL's critic lr_warmup_steps_ratio 0.01 x the script's total_training_steps 1500 (veRL starts that ramp at 0,
    # sleuth at lr / 15); trainer.critic_warmup = 0 in s3's scripts: the actor learns from the first step
    critic_lr_warmup_steps: int = 15
    kl_coef: float = 0.001
    kl: str = "k1"
    entropy_coef: float = 0.001
    value_clip: float = 0.5
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 42
    # data: a synthetic world (data_dir, generated from `synth` when missing) or explicit files
    data_dir: str = ""
    synth: dict[str, Any] = field(default_factory=dict)
    train_file: str = ""
    corpus: str = ""
    index: str = ""
    train_limit: int | None = None
    generator: str = "default"  # the frozen generator: any backend spec ("default": the embedded SmolLM2)
    llm_options: str = ""  # hf: options of the searcher's sampling model
    agent: S3Config = field(default_factory=S3Config)
    reward: Literal["paper", "code"] = "paper"  # GBR, or the official code's GBR + Acc
    metric: Literal["genacc", "span", "judge"] = "genacc"
    judge: str = ""  # LLM judge spec for metric genacc/judge ("" = span match only)
    filter: bool = True  # the paper's training-data filter

    def validate(self) -> None:
        super().validate()
        if self.reward not in ("paper", "code"):
            raise ValueError(f"reward={self.reward!r}; expected 'paper' or 'code'")


def trajectory_messages(trace: Trace) -> list[dict[str, Any]] | None:
    """The searcher's conversation: the prompt (its initial documents' texts marked as observations), then ONE
    assistant message made of model segments and inserted observations (``trace.meta["transcript"]``). None when
    the searcher never wrote anything."""
    prompt = trace.meta.get("searcher_prompt")
    segments = [s for s in trace.meta.get("transcript") or [] if s.get("text")]
    if not prompt or not any(s["source"] == "model" for s in segments):
        return None
    user: dict[str, Any] = {"role": "user", "content": prompt}
    documents = [escape_observation(str(p.get("text") or "")) for p in trace.meta.get("naive_rag_passages") or []]
    marked = observation_segments(prompt, documents)  # the initial documents: cut before the instruction
    if marked is not None:
        user["segments"] = marked
    return [user, {"role": "assistant", "segments": segments}]


class S3Task(Task):
    method = "s3"

    def __init__(self, config: S3RLConfig, retriever: Retriever, generator: LLM, cache: Any, judge: Any) -> None:
        self.config = config
        self.retriever = retriever
        self.generator = generator
        self.cache = cache
        self.judge = judge

    def agent_config(self, config: RLConfig) -> Any:
        agent = self.config.agent
        sampling = dataclasses.replace(agent.sampling, temperature=config.temperature, top_p=config.top_p)
        return dataclasses.replace(agent, sampling=sampling)

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=self.retriever, config=agent_config, roles={"generator": self.generator})

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        from sleuth.train.rewards import s3_reward

        async def rewards() -> list[dict[str, Any] | None]:
            async def one(trace: Trace) -> dict[str, Any] | None:
                if trace.error:
                    return None
                return await s3_reward(
                    trace,
                    self.generator,
                    self.cache,
                    self.config.reward,
                    self.judge,
                    config=self.config.agent,
                    metric=self.config.metric,
                )

            return list(await asyncio.gather(*(one(t) for t in traces)))

        out = []
        for trace, scores in zip(traces, asyncio.run(rewards()), strict=True):
            group = trace.example.metadata["rl"]["group"]
            messages = trajectory_messages(trace) if scores is not None else None
            searches = max(len(trace.meta.get("rounds") or []) - 1, 0)
            if scores is None or messages is None:
                out.append(Episode(group=group, messages=None, reward=0.0, components={}, searches=searches))
                continue
            components = {
                "acc_s3": float(scores["acc_s3"]),
                "acc_naive": float(scores["acc_naive"]),
                "selected": float(len(trace.meta.get("selected_ids") or [])),
            }
            out.append(
                Episode(
                    group=group,
                    messages=messages,
                    reward=float(scores["reward"]),
                    components=components,
                    searches=searches,
                )
            )
        return out


def prepare_s3_data(config: S3RLConfig) -> tuple[list[Example], str]:
    """Training questions and the retriever spec (generating the synthetic world / BM25 index when needed)."""
    from sleuth.train.mdpo import prepare_data

    train, _, index = prepare_data(config)  # type: ignore[arg-type]  # S3RLConfig has the same data fields
    return train, index


def train_s3(config: S3RLConfig, generator: LLM | None = None, retriever: Retriever | None = None) -> dict[str, Any]:
    """Cache the naive-RAG baseline, filter, then RL (module doc). ``generator`` / ``retriever`` replace the
    ones the config names (tests pass scripted ones)."""
    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.train.rewards import NaiveRagCache, filter_training_examples, precompute_naive_rag

    config.validate()
    out = Path(config.output_dir)
    processes = DataParallel()
    with processes.main_first():  # several processes: process 0 builds the data and the baseline cache
        out.mkdir(parents=True, exist_ok=True)
        train, index = prepare_s3_data(config)
        if retriever is None:  # not `or`: a Retriever defines __len__ (0 for in-memory ones)
            retriever = load_retriever(index)
        if generator is None:
            generator = load_llm(None if config.generator == "default" else config.generator)
        judge = load_llm(config.judge) if config.judge else None
        cache = NaiveRagCache.for_s3(
            out / "naive_rag_cache.jsonl",
            generator,
            config.agent,
            retriever=index or retriever.spec,
            judge=judge,
            metric=config.metric,
        )
        naive = asyncio.run(
            precompute_naive_rag(
                train, retriever, generator, cache, config.agent, judge, config.metric, config.concurrency
            )
        )
        kept, dropped = filter_training_examples(train, naive) if config.filter else (train, {})
        summary = {
            "questions": len(train),
            "kept": len(kept),
            "dropped": dict(dropped),
            "naive_rag_accuracy": sum(naive.values()) / max(len(naive), 1),
            "cache": {"hits": cache.hits, "misses": cache.misses},
        }
        if processes.main:
            (out / "config.json").write_text(json.dumps(to_mapping(config), indent=2, default=str) + "\n")
            (out / "data_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not kept:
        raise ValueError(f"no training questions left after filtering: {summary}")
    result = train_online(config, S3Task(config, retriever, generator, cache, judge), kept, log_name="s3")
    result["data"] = summary
    return result


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """``sleuth train s3 --config cfg.yaml [--set key=value]``."""
    try:
        options = parse_options(overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return train_s3(load_config(S3RLConfig, config_path, options))
