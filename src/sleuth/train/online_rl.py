"""Online RL for search agents: rollouts through the agent code, then a GRPO or PPO update of the policy.

Size: one module on purpose (about 1,500 lines): the loop, the models (policy, reference, critic, with LoRA and
FSDP), the checkpoint format and resumption rely on each other's invariants (what is saved on every process is what
is restored); the RL maths is in :mod:`sleuth.train.rl`, token handling in :mod:`sleuth.train.tokens`, the methods
in ``arena_rl`` and ``s3_rl``.

One loop serves ARENA (single-turn, GRPO; :mod:`sleuth.train.arena_rl`) and s3 (multi-turn searcher with a frozen
generator, PPO or GRPO; :mod:`sleuth.train.s3_rl`). A :class:`Task` says which agent runs, how a finished Trace
becomes the training conversation (model-written text vs inserted observations) and what it earns. Per step:

1. **Rollouts.** ``prompts_per_step`` training questions (a seeded order, so a resumed run draws the same
   batches), ``group_size`` runs each, by the task's agent through the runner, sampling from the *live* policy
   (:meth:`sleuth.llm.hf.HFLLM.from_model` shares the weights being trained), or from a vLLM server that reloads
   the policy every step (``rollout_server``: :mod:`sleuth.train.served_policy`; the LoRA adapter by name, or a full
   fine-tune's weights reloaded from a saved copy). Failed runs are counted.
2. **Rewards** from the task (format/EM/relevance/bonus for ARENA, Gain Beyond RAG for s3).
3. **Tokens.** ``episode_tokens: sampled`` (the default; token-in, token-out): the ids the engine was given and
   sampled, recorded in the Trace during the rollout (:func:`sleuth.train.tokens.sampled_chat`: each model turn's
   sampled ids and end-of-turn id learn, the prompt and each observation, tokenized once when inserted, are masked),
   with the sampler's log-prob of every model token; an episode whose engine returned no ids falls back to
   ``retokenize`` (counted in the log as ``retokenized``): :func:`sleuth.train.tokens.tokenize_chat`, the ids the
   chat template gives the conversation's text and a mask of model-written tokens. The policy loss, the KL and the
   value loss cover model tokens only (state masking).
   An episode over ``max_episode_tokens`` is shortened by cutting inserted observations only
   (:func:`sleuth.train.tokens.fit_to_length`), or dropped when that cannot fit it; both are counted in the log.
4. **Advantages.** GRPO: group-normalised sequence rewards. PPO: values from the critic, token rewards =
   -kl_coef * KL(policy || reference) per model token plus the score on the last one, GAE(gamma, lambda) over the
   model tokens (observations in between are skipped). The critic (``critic: separate``, the default, as veRL) is
   its own model, initialised from the base model with a scalar value head, trained by its own optimizer at
   ``critic_learning_rate``; none of its gradients reach the policy. ``critic: shared_head`` puts a value head on
   the policy's backbone instead (one model less in memory; the value loss then also trains the policy).
5. **Update.** ``ppo_epochs`` passes over ``mini_batches`` mini-batches (micro-batched for memory) of the clipped
   surrogate (+ beta * KL for GRPO, - entropy_coef * entropy for PPO) and, for PPO, the clipped value loss of the
   critic (weighted by ``vf_coef`` only for the shared head); the old log-probs are the rollout policy's, the
   reference is the initial policy (a frozen copy, or the LoRA base with its adapter disabled). During the first
   ``critic_warmup_steps`` steps only the critic is updated (veRL's ``trainer.critic_warmup``). With the sampler's
   log-probs known, each token's surrogate is weighted for the sampler/trainer mismatch
   (:func:`sleuth.train.rl.sampler_correction`; ``sampler_correction: auto``: truncated importance sampling when a
   ``rollout_server`` samples, none for the in-process engine), and the mismatch is logged either way.

**Precision.** The policy and the critic keep float32 master weights and AdamW state; on a GPU with bf16 (``dtype:
auto``), or with ``dtype: bfloat16`` / ``float16`` anywhere, the forward passes (rollouts included) run under
``torch.autocast`` to that dtype. The frozen reference is held in the compute dtype.

Every step appends one line to ``OUT/log.jsonl`` (reward and its components, KL, entropy, clip fraction, response
length in model tokens, searches per question, episodes cut to fit and dropped, seconds); every ``save_steps`` the
policy, the critic, the optimizers and the step go to ``OUT/checkpoint`` (written to a temporary directory first,
then renamed), from which a killed run resumes. Each step's traces, with reward and components, go to
``OUT/rollouts/step-NNNNN`` (the rollout store format of :mod:`sleuth.train.rollouts`). At the end: ``OUT/model``
(LoRA merged) and ``OUT/curves.png``.

**Several processes** (``torchrun --nproc_per_node N`` or ``accelerate launch --num_processes N``: one per GPU, or
gloo on CPU): data parallel. Each process holds the policy, samples the rollouts of its share of the step's questions
(whole groups, so GRPO advantages stay local). The trained modules (the policy; the shared value head or the
separate critic, in a process group of its own) are wrapped with PyTorch's ``DistributedDataParallel``, which
all-reduces the gradients in the backward pass: micro-batches accumulate locally (``no_sync``) and the last backward
of each optimizer step syncs; a process without a micro-batch runs one zero-loss pass. Every loss is normalised by
the *global* token (or sequence) count and multiplied by the process count (DDP averages), so the gradients are the
sums and N processes make the same update as one process with the whole batch (tested). Rollouts, the reference and
the saved models use the plain modules. PPO's advantage whitening and every logged number use global statistics;
process 0 writes the log, the rollout store (all processes' traces) and the checkpoints.

**Sharded** (``sharding: fsdp``): the policy, the reference and the separate critic are each wrapped with PyTorch
FSDP2 ``fully_shard`` (every transformer block a unit, then the root; on a GPU fp32 master weights with bf16
compute, the frozen reference held in bf16), so each process holds 1/N of every model and of the AdamW state. The
engine all-gathers a block's weights for its forward and backward and reduce-scatters the gradients (as sums: the
losses are normalised globally as above); clipping runs on the sharded gradients. Every process must run the same
passes, so one with fewer micro-batches than another runs zero-loss passes on one padding token. Rollouts generate
from the policy gathered whole on every process for the duration (each process samples a different number of
tokens). Checkpoints are ``torch.distributed.checkpoint`` shards (``OUT/checkpoint/sharded``: models and optimizers;
resumed at the same process count), and ``OUT/model`` is the policy gathered to process 0 and saved for transformers.
A LoRA policy is sharded the same way (the peft model: frozen base weights and adapters alike), its reference is
the adapter disabled, and ``OUT/model`` is merged. Not yet with the shared value head or ``rollout_server`` (refused
by :meth:`RLConfig.validate`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.records import Example, Trace
from sleuth.train.common import TrainConfig, free_memory, resolve_model, trim_log

__all__ = ["DataParallel", "Episode", "RLConfig", "Task", "train_online"]

LOG_FILE = "log.jsonl"
# step-log keys that the curves (sleuth.train.tracking) spell as the HF Trainer does
CURVE_TAGS = {"lr": "learning_rate", "critic_lr": "critic_learning_rate"}


class DataParallel:
    """The process group of a data-parallel run (``torchrun`` / ``accelerate launch`` set ``WORLD_SIZE``); with one
    process every collective is the identity."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1:
            import torch
            import torch.distributed as dist

            if not dist.is_initialized():
                # generous: process 0 alone caches the s3 naive-RAG baseline while the others wait at a barrier
                timeout = datetime.timedelta(hours=4)
                dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
                _OWNED_GROUP[0] = True
                # torn down before the interpreter's own teardown: a group left to C++ static destruction can abort
                # the process ("terminate called without an active exception") after the run has finished
                atexit.register(_destroy_process_group)
            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self) -> Any:
        import torch

        return torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over processes."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device())
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order, on every process."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every process's ``obj``, in rank order, on process 0 only (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Process 0 runs the block first (building data, caches, writing summaries); the others run it after, when
        it finds everything built."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()


_OWNED_GROUP = [False]  # whether sleuth initialised the process group (and so tears it down)


def close_process_group() -> None:
    """End of a run: once every process is here (no collective in flight), tear down the group sleuth started, while
    the interpreter is fully alive. Gloo's worker threads that still hold work at interpreter teardown abort a
    finished process now and then ("terminate called without an active exception"), even with the atexit
    teardown. A group the caller started is left alone."""
    import torch.distributed as dist

    if _OWNED_GROUP[0] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _OWNED_GROUP[0] = False


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class RLConfig(TrainConfig):
    """Options shared by the RL trainers; each trainer's config adds its data and reward options and sets its
    paper's defaults (ARENA: GRPO, group 7; s3: PPO, one rollout per question). Model, seed, learning rate, LoRA
    and tracking: :class:`~sleuth.train.common.TrainConfig`."""

    output_dir: str = "runs/rl"
    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4  # rollouts per question (GRPO groups; PPO: usually 1)
    mini_batches: int = 1  # optimizer steps per rollout batch
    ppo_epochs: int = 1
    micro_batch: int = 4  # at most this many sequences per forward/backward (memory only: gradients accumulate)
    # the update's micro-batches by a token budget (sleuth.train.packing.micro_batch_budget): each mini-batch's
    # episodes sorted by length and cut so that rows x longest <= micro_batch_tokens and rows <= micro_batch.
    # Exact only with micro_batch_aggregation mini_batch_mean. None: 4096 there, fixed micro_batch rows with
    # micro_batch_mean (where grouping changes the weighting); 0: fixed rows; > 0: the budget, whatever the mode.
    # Memory: a PPO micro-batch (policy + separate critic, fp32, SmolLM2-135M) holds ~2 GB of activations per
    # 1,000 tokens on a CPU, ~0.2-0.4 GB with gradient_checkpointing (docs/results/bench_train.md)
    micro_batch_tokens: int | None = None
    critic_learning_rate: float = 1e-5
    warmup_steps: int = 0  # linear warm-up of the actor's learning rate (lr * (step + 1) / warmup_steps)
    # PPO's critic: "separate" (veRL: its own model from the base weights, own optimizer) or "shared_head" (a value
    # head on the policy's backbone: less memory, but the value loss trains the policy too; a deviation)
    critic: Literal["separate", "shared_head"] = "separate"
    critic_lora: bool | None = None  # LoRA adapters on the separate critic; None: as `lora`
    critic_warmup_steps: int = 0  # steps that update the critic only (veRL trainer.critic_warmup; s3's scripts: 0)
    critic_lr_warmup_steps: int = 0  # linear warm-up of the critic's learning rate, as warmup_steps
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    beta: float = 0.0  # KL-loss coefficient (GRPO)
    kl_coef: float = 0.0  # KL-in-reward coefficient (PPO)
    kl: str = "k3"  # estimator: k1 | k2 | k3 | arena | abs
    entropy_coef: float = 0.0
    vf_coef: float = 0.5  # weight of the value loss in the policy's loss: critic shared_head only
    value_clip: float = 0.5
    gamma: float = 1.0
    lam: float = 1.0
    adv_eps: float = 1e-6
    loss_aggregation: str = "token-mean"
    # how micro-batch losses make one optimizer step's loss (sleuth.train.rl.micro_batch_weights): "mini_batch_mean"
    # (each weighted by its share of the mini-batch's tokens: one mean over the mini-batch, micro_batch is memory
    # only) or "micro_batch_mean" (the mean of the micro-batches' means: TRL's and veRL's gradient accumulation, the
    # references of ARENA and s3, whose configs set it)
    micro_batch_aggregation: Literal["mini_batch_mean", "micro_batch_mean"] = "mini_batch_mean"
    # AdamW weight decay of the policy and the critic (HF Trainer's default 0, ARENA; veRL's 0.01, s3)
    weight_decay: float = 0.0
    # PPO value head: "normal" (veRL's critic, AutoModelForTokenClassification: weight ~ N(0, the model's
    # initializer_range), bias 0) or "zeros" (every first value 0)
    value_head_init: Literal["normal", "zeros"] = "normal"
    temperature: float = 1.0
    top_p: float = 1.0
    # tokens per training episode; a longer one has its observations (retrieved/given documents) cut, never the
    # instruction or a model token, and is dropped if that is not enough (both logged). None: no limit, as the
    # references (ARENA's trainer does not truncate prompts; s3's veRL keeps whole trajectories)
    max_episode_tokens: int | None = None
    # the ids trained on: "sampled" (token-in, token-out: those the engine sampled, recorded in the Trace) or
    # "retokenize" (the conversation's text through the chat template; also the fallback, counted, for an episode
    # whose engine returned no ids)
    episode_tokens: Literal["sampled", "retokenize"] = "sampled"
    # weights for the sampler/trainer mismatch (sleuth.train.rl.sampler_correction): "auto" (tis with a
    # rollout_server, none for the in-process engine, which samples from the trained weights), "tis", "token_mask",
    # "sequence_mask", "none"; sampler_cap: C (TRL's vllm_importance_sampling_cap)
    sampler_correction: Literal["auto", "tis", "token_mask", "sequence_mask", "none"] = "auto"
    sampler_cap: float = 2.0
    lora_r: int = 16
    lora_alpha: int = 32
    # compute dtype over float32 master weights: auto: bf16 autocast on a GPU that supports it, else fp32
    dtype: str = "auto"
    # several processes: "none" (each holds full replicas, DDP syncs the gradients) or "fsdp" (PyTorch FSDP2
    # fully_shard per transformer block + root for the policy, reference and separate critic; module doc, Scaling in
    # docs/training.md). With one process both are the same run.
    sharding: Literal["none", "fsdp"] = "none"
    # rollouts from a vLLM server that reloads the LoRA adapter every step (sleuth.train.served_policy)
    rollout_server: str = ""  # openai:BASE_MODEL@URL; empty: transformers generate from the live policy
    # where each step's adapter (or, without lora, full weights) is written for the server to read (default OUT/served)
    rollout_adapter_dir: str = ""
    save_steps: int = 10
    concurrency: int = 64  # episodes in flight at once
    # rows per transformers ``generate`` call of the live-policy rollouts (no rollout_server); 0: automatic
    # (rows_per_generate): on a GPU the process's prompts x group_size, one call a step (a decoding step of 32 rows
    # took 0.101 s on an H100, docs/results/gpu_check_generate.md; the H100 ARENA run sampled its 112 episodes a step
    # in one call; a sweep over row counts was not measured), on the CPU 32 (32 rows already fill the cores). Episodes
    # in flight are raised to match.
    rollout_batch: int = 0
    progress: bool = True
    # a step whose failed episodes (a rollout that raised, a reward that could not be computed) exceed this share of
    # its episodes stops the run before the update, naming the errors: failures are a bug or a dead endpoint, not
    # model behaviour (parsers are lenient), and training on the episodes that survived biases the step (the run
    # resumes from its last checkpoint once fixed). 1.0: never stop
    max_failed_fraction: float = 0.25

    def rows_per_generate(self, device_type: str, world: int = 1) -> int:
        """The rows of one live-policy ``generate`` call: ``rollout_batch`` when set, else on a GPU (``cuda``) all
        the episodes of a step on one of ``world`` processes, on the CPU 32."""
        if self.rollout_batch:
            return self.rollout_batch
        if device_type == "cuda":
            return -(-self.prompts_per_step // world) * self.group_size
        return 32

    def correction(self) -> str:
        """The sampler correction in force: ``auto`` is ``tis`` with a rollout server, else ``none``."""
        if self.sampler_correction == "auto":
            return "tis" if self.rollout_server else "none"
        return self.sampler_correction

    def validate(self) -> None:
        if self.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"algorithm={self.algorithm!r}; expected 'grpo' or 'ppo'")
        for name in ("steps", "prompts_per_step", "group_size", "mini_batches", "ppo_epochs", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        if self.kl not in ("k1", "k2", "k3", "arena", "abs"):
            raise ValueError(f"kl={self.kl!r}; expected k1, k2, k3, arena or abs")
        if self.critic not in ("separate", "shared_head"):
            raise ValueError(f"critic={self.critic!r}; expected 'separate' or 'shared_head'")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError("micro_batch_tokens must be >= 0 (0: fixed micro_batch rows; null: automatic)")
        if self.micro_batch_aggregation not in ("mini_batch_mean", "micro_batch_mean"):
            raise ValueError(
                f"micro_batch_aggregation={self.micro_batch_aggregation!r}; expected 'mini_batch_mean' or "
                "'micro_batch_mean'"
            )
        if self.value_head_init not in ("normal", "zeros"):
            raise ValueError(f"value_head_init={self.value_head_init!r}; expected 'normal' or 'zeros'")
        if self.rollout_batch < 0:
            raise ValueError("rollout_batch must be >= 0 (0: automatic)")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ValueError("max_failed_fraction must be in [0, 1]")
        if self.weight_decay < 0:
            raise ValueError("weight_decay must be >= 0")
        for name in ("warmup_steps", "critic_warmup_steps", "critic_lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.episode_tokens not in ("sampled", "retokenize"):
            raise ValueError(f"episode_tokens={self.episode_tokens!r}; expected 'sampled' or 'retokenize'")
        if self.sampler_correction not in ("auto", "tis", "token_mask", "sequence_mask", "none"):
            raise ValueError(
                f"sampler_correction={self.sampler_correction!r}; expected auto, tis, token_mask, sequence_mask, none"
            )
        if self.sampler_cap < 1.0:
            raise ValueError("sampler_cap must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}; expected auto, float32, bfloat16 or float16")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            raise ValueError("max_episode_tokens must be >= 2 (or null: no limit)")
        if self.sharding not in ("none", "fsdp"):
            raise ValueError(f"sharding={self.sharding!r}; expected 'none' or 'fsdp'")
        if self.sharding == "fsdp":
            unsupported = {
                "critic shared_head": self.algorithm == "ppo" and self.critic == "shared_head",
                "rollout_server": bool(self.rollout_server),
            }
            named = [name for name, on in unsupported.items() if on]
            if named:
                raise ValueError(f"sharding: fsdp does not support {', '.join(named)} yet; use sharding: none")


@dataclass
class Episode:
    """One rollout ready for the update: its group, conversation, reward (and components), and agent statistics."""

    group: str
    messages: list[dict[str, Any]] | None
    reward: float
    components: dict[str, float]
    searches: float = 0.0
    input_ids: list[int] | None = None
    mask: list[int] | None = None
    cut_tokens: int = 0  # observation tokens cut to fit max_episode_tokens
    skipped: str = ""  # why a conversation was not trained on ("too_long", "untokenizable")
    # token-in, token-out (the task fills them when the rollout recorded ids): the ids the engine was first given,
    # then each piece that followed ({"source": "model" | "observation" | "inserted", "ids", "logprobs"})
    prompt_ids: list[int] | None = None
    pieces: list[dict[str, Any]] | None = None
    # filled by _tokenize: which ids were trained on ("sampled" or "retokenize") and, on the sampled path, the
    # sampler's log-prob of each model token in order
    token_path: str = ""
    sampler_logprobs: list[float] | None = None


class Task:
    """What an RL trainer plugs into :func:`train_online`."""

    method: str = ""

    def agent_config(self, config: RLConfig) -> Any:
        """The agent's config for rollouts (sampling at the configured temperature)."""
        raise NotImplementedError

    def context(self, llm: Any, agent_config: Any) -> Context:
        raise NotImplementedError

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        """Conversation and reward of each trace, one Episode per trace in order (may call a frozen generator)."""
        raise NotImplementedError

    def episode_example(self, example: Example, group: str, sample: int) -> Example:
        """The question episode ``sample`` of ``group`` answers, a copy it may change (ARENA: its own order of
        the references); by default the question as given."""
        return example


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


class _Models:
    """The policy (optionally LoRA-wrapped), its frozen reference, for PPO the critic, and their optimizers.

    ``critic: separate``: ``self.critic`` is a plain module ``{"backbone", "head"}``: the base model's transformer
    (no LM head; LoRA-wrapped when ``critic_lora``) and a linear value head on its last hidden state, optimised by
    ``self.critic_optimizer``; it shares no parameter with the policy. ``critic: shared_head``: ``self.value_head``
    on the policy's last hidden state, a second parameter group of the policy's optimizer. Value heads run in
    float32 and start as ``value_head_init`` says (veRL's normal init by default, or zero). Both optimizers are
    AdamW with ``weight_decay``."""

    def __init__(
        self,
        config: RLConfig,
        path: Path,
        resume: Path | None,
        device: Any,
        sharded: bool = False,
        replicated: bool = False,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device
        self.sharded = sharded
        self.replicated = replicated and not sharded
        # float32 master weights and optimizer state always; the compute dtype (bf16 on a GPU that has it, under
        # dtype auto) through torch.autocast, or FSDP's mixed precision when sharded
        dtype, compute = master_and_compute_dtypes(config.dtype, self.device)
        mixed = compute if sharded else None
        self.compute_dtype = None if sharded else compute
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # a sharded checkpoint is loaded into the sharded models below, not through from_pretrained
        source = resume / "policy" if resume is not None and not config.lora and not sharded else path
        self.policy = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(self.device)
        hidden = self.policy.config.hidden_size
        self.reference = None
        if config.lora:
            saved = resume / "policy" if resume is not None and not sharded else None
            self.policy = _with_lora(self.policy, config, saved)
        else:
            # the frozen reference is held in the compute dtype (no master weights to keep)
            ref_dtype = compute or dtype
            self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=ref_dtype).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.value_head = None
        self.critic = None
        self.critic_optimizer = None
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": config.learning_rate}]
        if config.algorithm == "ppo" and config.critic == "shared_head":
            self.value_head = _value_head(hidden, self.device, _head_std(self.policy.config, config))
            if resume is not None:
                self.value_head.load_state_dict(torch.load(resume / "value_head.pt", weights_only=True))
            groups.append({"params": list(self.value_head.parameters()), "lr": config.critic_learning_rate})
        elif config.algorithm == "ppo":
            saved = resume / "critic" if resume is not None and not sharded else None
            self.critic = _critic(config, path, saved, dtype, self.device)
        if config.gradient_checkpointing:
            _checkpoint_activations(self.policy)
            if self.critic is not None:
                _checkpoint_activations(self.critic["backbone"])
        if sharded:
            _fully_shard(self.policy, mixed)
            if self.reference is not None:
                _fully_shard(self.reference, mixed)
            if self.critic is not None:
                _fully_shard(self.critic["backbone"], mixed)
                _fully_shard(self.critic["head"], None)  # the value head stays in float32
            groups[0]["params"] = [p for p in self.policy.parameters() if p.requires_grad]  # now DTensor shards
        # what a training pass (one that builds a graph) runs: the DDP wrappers when replicated, which sync the
        # gradients in the backward; rollouts, the reference, no-grad passes and every save use the plain modules
        self.trained_policy: Any = self.policy
        self.trained_values: Any = self.value_head if self.value_head is not None else self.critic
        # DDP averages the replicas' gradients; the losses are normalised by the global token count and want their
        # sum, so each backward's loss is multiplied by the process count (exact for a power of two)
        self.loss_scale = 1
        if self.replicated:
            self.loss_scale = torch.distributed.get_world_size()
            self.trained_policy = _replicate(self.policy, device)
            if self.trained_values is not None:  # its own process group: its syncs never queue behind the policy's
                self.trained_values = _replicate(self.trained_values, device, torch.distributed.new_group())
        if self.critic is not None:
            params = [p for p in self.critic.parameters() if p.requires_grad]
            self.critic_optimizer = torch.optim.AdamW(
                params, lr=config.critic_learning_rate, weight_decay=config.weight_decay
            )
            if resume is not None and not sharded:
                state = torch.load(resume / "critic_optimizer.pt", weights_only=True)
                self.critic_optimizer.load_state_dict(state)
        self.optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
        if resume is not None and sharded:
            self._load_sharded(resume / "sharded")
        elif resume is not None:
            self.optimizer.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=True))
        self.actor_lr = config.learning_rate
        self.critic_lr = config.critic_learning_rate
        if sharded:
            # FSDP takes the first sharded module to run a forward for the root; a LoRA policy generates through
            # the transformers model inside the peft wrapper, below the root, so every root runs one pass first
            # (and then frees what it gathered: a root keeps its weights gathered after a forward)
            from torch.distributed.fsdp import FSDPModule

            self.idle_pass(values=config.algorithm == "ppo")
            for model in (self.policy, self.reference, self.critic):
                for module in model.modules() if model is not None else ():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def set_learning_rates(self, step: int, config: RLConfig) -> dict[str, float]:
        """Linear warm-ups (``warmup_steps`` for the actor, ``critic_lr_warmup_steps`` for the critic), then
        constant; returns the rates of this step."""

        def warm(lr: float, steps: int) -> float:
            return lr * min(1.0, (step + 1) / steps) if steps else lr

        actor = warm(self.actor_lr, config.warmup_steps)
        critic = warm(self.critic_lr, config.critic_lr_warmup_steps)
        self.optimizer.param_groups[0]["lr"] = actor
        if self.value_head is not None:
            self.optimizer.param_groups[1]["lr"] = critic
        if self.critic_optimizer is not None:
            for group in self.critic_optimizer.param_groups:
                group["lr"] = critic
        out = {"lr": actor}
        if config.algorithm == "ppo":
            out["critic_lr"] = critic
        return out

    def train(self, mode: bool = True) -> None:
        self.trained_policy.train(mode)
        if self.critic is not None:
            self.trained_values.train(mode)

    def autocast(self) -> Any:
        """``torch.autocast`` to the compute dtype over the float32 master weights (unsharded), else nothing."""
        import torch

        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def forward(self, ids: Any, attention: Any, reference: bool = False, values: bool = False) -> tuple[Any, Any]:
        """Logits (and values: one per position, the state before the next token) of a padded batch. A pass with
        gradients enabled goes through the DDP wrappers (replicated runs), any other through the plain modules."""
        with self.autocast():
            return self._forward(ids, attention, reference, values)

    def _forward(self, ids: Any, attention: Any, reference: bool, values: bool) -> tuple[Any, Any]:
        import torch

        if reference:
            if self.reference is not None:
                return self.reference(input_ids=ids, attention_mask=attention).logits, None
            with self.policy.disable_adapter():
                return self.policy(input_ids=ids, attention_mask=attention).logits, None
        training = torch.is_grad_enabled()
        policy = self.trained_policy if training else self.policy
        shared = values and self.value_head is not None
        out = policy(input_ids=ids, attention_mask=attention, output_hidden_states=shared)
        value = None
        if shared:
            head = self.trained_values if training else self.value_head
            value = head(out.hidden_states[-1].float()).squeeze(-1)
        elif values and self.critic is not None:
            value = self.values(ids, attention)
        return out.logits, value

    def values(self, ids: Any, attention: Any) -> Any:
        """The critic's value at every position (``critic: separate``; the shared head needs the policy's pass)."""
        import torch

        assert self.critic is not None
        with self.autocast():
            return (self.trained_values if torch.is_grad_enabled() else self.critic)(ids, attention)

    def no_sync(self, accumulate: bool, policy: bool = True) -> contextlib.ExitStack:
        """Replicated: the passes run in this block keep their gradients local (``accumulate``: every pass of an
        optimizer step but its last); the policy's also when ``policy`` is False (the critic's warm-up with a shared
        head, which drops them). Otherwise nothing."""
        stack = contextlib.ExitStack()
        if self.replicated:
            if accumulate or not policy:
                stack.enter_context(self.trained_policy.no_sync())
            if accumulate and self.trained_values is not None:
                stack.enter_context(self.trained_values.no_sync())
        return stack

    def critic_parameters(self) -> list[Any]:
        if self.critic_optimizer is None:
            return []
        return [p for g in self.critic_optimizer.param_groups for p in g["params"]]

    def _sharded_state(self) -> dict[str, Any]:
        """What a sharded checkpoint holds: each model's and optimizer's state as DTensor shards (no process holds
        the whole); torch.distributed.checkpoint writes each process's shards and reads them back in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        policy, optimizer = get_state_dict(self.policy, self.optimizer)
        state = {"policy": policy, "optimizer": optimizer}
        if self.critic is not None and self.critic_optimizer is not None:
            state["critic"], state["critic_optimizer"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def _load_sharded(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(
            self.policy, self.optimizer, model_state_dict=state["policy"], optim_state_dict=state["optimizer"]
        )
        if self.critic is not None and self.critic_optimizer is not None:
            set_state_dict(
                self.critic,
                self.critic_optimizer,
                model_state_dict=state["critic"],
                optim_state_dict=state["critic_optimizer"],
            )

    def save_checkpoint(self, directory: Path, step: int, config: RLConfig, dist: DataParallel | None = None) -> None:
        """Process 0 writes the checkpoint; sharded models: every process writes its shards (call on all)."""
        import torch

        partial = directory.with_name(directory.name + ".partial")
        if self.sharded:
            assert dist is not None
            import torch.distributed.checkpoint as dcp

            if dist.main:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            dist.barrier()
            dcp.save(self._sharded_state(), checkpoint_id=str(partial / "sharded"))
            dist.barrier()
            if dist.main:
                self._commit(partial, directory, step)
            return
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        self.policy.save_pretrained(partial / "policy")
        torch.save(self.optimizer.state_dict(), partial / "optimizer.pt")
        if self.value_head is not None:
            torch.save(self.value_head.state_dict(), partial / "value_head.pt")
        if self.critic is not None and self.critic_optimizer is not None:
            self.critic["backbone"].save_pretrained(partial / "critic" / "backbone")
            torch.save(self.critic["head"].state_dict(), partial / "critic" / "value_head.pt")
            torch.save(self.critic_optimizer.state_dict(), partial / "critic_optimizer.pt")
        self._commit(partial, directory, step)

    def _commit(self, partial: Path, directory: Path, step: int) -> None:
        import torch

        state = {"step": step, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state().tolist()}
        (partial / "state.json").write_text(json.dumps(state))
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)

    def save_final(self, directory: Path, config: RLConfig, main: bool = True) -> None:
        """The policy as a transformers directory (LoRA merged). Sharded: every process must call it (the full
        weights are gathered to process 0's CPU memory, which writes them)."""
        if not self.sharded:
            if main:
                model = self.policy.merge_and_unload() if config.lora else self.policy
                model.save_pretrained(directory)
                self.tokenizer.save_pretrained(directory)
            return
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForCausalLM

        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not main:
            return
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.policy.config)
            if config.lora:  # the same adapters (same names) around it, merged once the weights are in
                model = _with_lora(model, config, None)
        model.load_state_dict(full, assign=True)
        if config.lora:
            model = model.merge_and_unload()
        model.tie_weights()
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    @contextlib.contextmanager
    def gathered_policy(self) -> Iterator[None]:
        """Sharded: the policy's full weights on every process for the block (rollouts: each process generates a
        different number of tokens, so generation cannot all-gather per forward pass; costs one unsharded copy of
        the policy per process while it lasts). Otherwise nothing."""
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.policy.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
        self.policy.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
            self.policy.set_reshard_after_forward(True)

    def idle_pass(self, values: bool, policy: bool = True, backward: bool = False) -> None:
        """A forward (and backward) on one padding token whose loss is zero: sharded models all-gather and
        reduce-scatter in every pass, and replicated ones sync gradients in an optimizer step's last backward, so a
        process with fewer micro-batches than another (sharded) or none (replicated) takes part this way."""
        import torch

        ids = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        attention = torch.ones_like(ids)
        loss = torch.zeros((), device=self.device)
        with contextlib.nullcontext() if backward else torch.no_grad():
            # the order of the real passes (the collectives must line up): policy, critic, reference
            if policy:
                logits, value = self.forward(ids, attention, values=values)
                loss = loss + logits.float().sum() * 0.0
                if value is not None:
                    loss = loss + value.sum() * 0.0
            elif values and self.critic is not None:
                loss = loss + self.values(ids, attention).sum() * 0.0
            if policy and not backward:
                self.forward(ids, attention, reference=True)
        if backward:
            loss.backward()


def master_and_compute_dtypes(dtype: str, device: Any) -> tuple[Any, Any]:
    """``(weights, compute)`` torch dtypes of a trained model: the weights (and so AdamW's state) are always float32;
    compute is bf16 for ``auto`` on a GPU that supports it, the named dtype for ``bfloat16`` / ``float16`` (on a CPU
    too: autocast to bf16 works there), None (plain float32) otherwise. Stepping AdamW on bf16 weights at a small
    learning rate drops most updates in the rounding (tests/test_online_rl.py)."""
    import torch

    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.float32, torch.bfloat16 if bf16 else None
    named = getattr(torch, dtype, None)
    if not isinstance(named, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch.float32, None if named == torch.float32 else named


def _fully_shard(model: Any, mixed: Any) -> None:
    """FSDP2: each transformer block (the classes the model names in ``_no_split_modules``) its own unit, then the
    rest at the root; gradients are summed, not averaged, over processes (every loss is already normalised by the
    global token count)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=None if mixed is None else _float32())
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)


def _replicate(module: Any, device: Any, group: Any = None) -> Any:
    """``module`` wrapped with DistributedDataParallel (its parameters stay the module's own; checkpoints and exports
    save the module). No buffer broadcast: the models' buffers are constants (rotary frequencies), and a broadcast in
    every forward would need every process to run the same number of forwards."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False, process_group=group)


def _checkpoint_activations(model: Any) -> None:
    """Recompute each block's activations in the backward pass (non-reentrant: works with FSDP and frozen
    inputs)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _float32() -> Any:
    import torch

    return torch.float32


def _with_lora(model: Any, config: RLConfig, saved: Path | None) -> Any:
    """``model`` with trainable LoRA adapters: new ones, or those saved in ``saved`` (a resumed run)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if saved is not None:
        return PeftModel.from_pretrained(model, saved, is_trainable=True)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_targets(),
    )
    return get_peft_model(model, lora)


def _head_std(model_config: Any, config: RLConfig) -> float | None:
    """The value head's init std: the model's ``initializer_range`` (0.02 when it has none), as transformers
    initialises veRL's ``AutoModelForTokenClassification`` score head; None for ``value_head_init: zeros``."""
    if config.value_head_init == "zeros":
        return None
    return float(getattr(model_config, "initializer_range", None) or 0.02)


def _value_head(hidden: int, device: Any, std: float | None = None) -> Any:
    """A linear value head in float32: weight ~ N(0, std) and bias 0 (veRL's critic), or all zeros (std None)."""
    import torch

    head = torch.nn.Linear(hidden, 1).to(device, torch.float32)
    if std is None:
        torch.nn.init.zeros_(head.weight)
    else:
        torch.nn.init.normal_(head.weight, mean=0.0, std=std)
    torch.nn.init.zeros_(head.bias)
    return head


def _critic(config: RLConfig, path: Path, saved: Path | None, dtype: Any, device: Any) -> Any:
    """The separate critic: the base model's transformer (``AutoModel``: no LM head) and a value head; from
    ``saved`` (``OUT/checkpoint/critic``) when resuming."""
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    lora = config.lora if config.critic_lora is None else config.critic_lora
    source = saved / "backbone" if saved is not None and not lora else path
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the causal LM's head is left out on purpose: no "unexpected key" report
    try:
        backbone = AutoModel.from_pretrained(source, dtype=dtype).to(device)
    finally:
        hf_logging.set_verbosity(verbosity)
    head = _value_head(backbone.config.hidden_size, device, _head_std(backbone.config, config))
    if lora:
        backbone = _with_lora(backbone, config, saved / "backbone" if saved is not None else None)
    if saved is not None:
        head.load_state_dict(torch.load(saved / "value_head.pt", weights_only=True))
    return _critic_class()({"backbone": backbone, "head": head})


@functools.cache
def _critic_class() -> type:
    """The separate critic's module class, built on first use (this module imports torch lazily)."""
    import torch

    class Critic(torch.nn.ModuleDict):
        """``backbone`` (the base model's transformer) and ``head`` (its value head); called, the value at every
        position (a module with a forward, so DDP can wrap it whole)."""

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self["backbone"](input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self["head"](hidden.float()).squeeze(-1)

    return Critic


# ---------------------------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------------------------


def _pad(episodes: Sequence[Episode], pad_id: int, device: Any) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(e.input_ids or []) for e in episodes)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(episodes), width), dtype=torch.long)
    mask = torch.zeros((len(episodes), width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.input_ids or [])
        ids[i, :n] = torch.tensor(e.input_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(e.mask, dtype=torch.float32)
    return ids.to(device), attention.to(device), mask.to(device)


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _passes(models: _Models, dist: DataParallel | None, n: int, backward: bool = False) -> int:
    """Idle passes this process adds to its ``n`` micro-batches so that the collectives line up: sharded, every
    pass all-gathers (and reduce-scatters), so each process runs as many passes as the busiest; replicated, only an
    optimizer step's last backward syncs, so a process without a micro-batch runs one (with ``backward``)."""
    if models.sharded and dist is not None:
        return max(dist.gather(n)) - n
    if models.replicated and backward:
        return int(n == 0)
    return 0


def _rollout_stats(
    models: _Models, episodes: list[Episode], config: RLConfig, dist: DataParallel | None = None
) -> list[dict[str, Any]]:
    """Per episode, with no gradient: old log-probs (the rollout policy), reference log-probs, values; where the
    sampler's log-probs are known, ``sampler`` (aligned with ``old``), ``sampler_mask`` (where they are) and
    ``old_t`` (the trainer's at the sampling temperature, what the sampler's are compared with)."""
    import torch

    from sleuth.train import rl

    temperature = config.temperature if config.temperature > 0 else 1.0
    out = []
    chunks = _chunks(episodes, config.micro_batch)
    for _ in range(_passes(models, dist, len(chunks))):
        models.idle_pass(values=config.algorithm == "ppo")
    with torch.no_grad():
        for chunk in chunks:
            ids, attention, mask = _pad(chunk, models.tokenizer.pad_token_id, models.device)
            logits, values = models.forward(ids, attention, values=config.algorithm == "ppo")
            old = rl.token_logprobs(logits[:, :-1].float(), ids[:, 1:])
            ref_logits, _ = models.forward(ids, attention, reference=True)
            ref = rl.token_logprobs(ref_logits[:, :-1].float(), ids[:, 1:])
            for i, e in enumerate(chunk):
                n = len(e.input_ids or []) - 1
                row = {"old": old[i, :n].cpu(), "ref": ref[i, :n].cpu(), "mask": mask[i, 1 : n + 1].cpu()}
                if values is not None:
                    row["values"] = values[i, :n].float().cpu()
                if e.sampler_logprobs is not None and len(e.sampler_logprobs) == int(row["mask"].sum()):
                    model = row["mask"] > 0
                    row["sampler"] = torch.zeros(n)
                    row["sampler"][model] = torch.tensor(e.sampler_logprobs, dtype=torch.float32)
                    row["sampler_mask"] = row["mask"].clone()
                    row["old_t"] = row["old"]
                    if temperature != 1.0:
                        scaled = logits[i : i + 1, :n].float() / temperature
                        row["old_t"] = rl.token_logprobs(scaled, ids[i : i + 1, 1 : n + 1])[0].cpu()
                out.append(row)
    return out


def _sampler_correction(stats: list[dict[str, Any]], config: RLConfig, dist: DataParallel) -> dict[str, float]:
    """Fill ``stats[i]["is_w"]`` (the per-token weights of :func:`sleuth.train.rl.sampler_correction`, all 1 where the
    sampler's log-probs are unknown or the correction is off) and return the logged mismatch over every process:
    ``sampler_mismatch_abs`` (mean |old - sampler| log-prob over model tokens), ``sampler_mismatch_max``,
    ``sampler_corrected`` (share of model tokens truncated or masked), ``sampler_tokens`` (model tokens compared)."""
    import torch

    from sleuth.train import rl

    mode = config.correction()
    count = total = corrected = 0.0
    largest = 0.0
    for row in stats:
        row["is_w"] = torch.ones_like(row["old"])
        if "sampler" not in row:
            continue
        weights, terms = rl.sampler_correction(
            row["old_t"][None], row["sampler"][None], row["sampler_mask"][None], mode=mode, cap=config.sampler_cap
        )  # type: ignore[arg-type]
        row["is_w"] = weights[0]
        n = float(row["sampler_mask"].sum())
        count += n
        total += float(terms["mismatch_abs"]) * n
        corrected += float(terms["corrected_share"]) * n
        largest = max(largest, float(terms["mismatch_max"]))
    count, total, corrected = dist.sum([count, total, corrected])
    if not count:
        return {}
    return {
        "sampler_mismatch_abs": total / count,
        "sampler_mismatch_max": max(dist.gather(largest)),
        "sampler_corrected": corrected / count,
        "sampler_tokens": count,
    }


def _advantages(
    episodes: list[Episode], stats: list[dict[str, Any]], config: RLConfig, dist: DataParallel
) -> dict[str, float]:
    """Fill ``stats[i]["adv"]`` (per token) and, for PPO, ``stats[i]["returns"]``; return logged numbers (global
    over processes; a process may hold no episode)."""
    import torch

    from sleuth.train import rl

    if config.algorithm == "grpo":
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        groups = [e.group for e in episodes]
        index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
        ids = torch.tensor([index[g] for g in groups], dtype=torch.long)
        adv = rl.grpo_advantages(rewards, ids, eps=config.adv_eps) if episodes else torch.zeros(0)
        for i, row in enumerate(stats):
            row["adv"] = torch.full_like(row["old"], float(adv[i]))
        total, n = dist.sum([float(adv.abs().sum()) if episodes else 0.0, float(len(episodes))])
        return {"advantage_abs": total / max(n, 1.0)}
    kls, scores = [], []
    for e, row in zip(episodes, stats, strict=True):
        mask = row["mask"][None]
        token_rewards = rl.kl_in_reward(
            torch.tensor([e.reward]), row["old"][None], row["ref"][None], mask, coef=config.kl_coef, kind=config.kl
        )
        adv, returns = rl.gae_advantages(
            token_rewards, row["values"][None], mask, gamma=config.gamma, lam=config.lam, whiten=False
        )
        row["adv"], row["returns"] = adv[0], returns[0]
        kls.append(float(rl.masked_mean(rl.kl_penalty(row["old"], row["ref"], kind=config.kl), row["mask"])))
        scores.append(e.reward)
    # whiten advantages over every model token of the whole batch, all processes (PPO's usual normalisation)
    flat = torch.cat([row["adv"][row["mask"] > 0] for row in stats]).double() if stats else torch.zeros(0)
    n, total, squares, kl_sum, kl_n = dist.sum(
        [flat.numel(), float(flat.sum()), float((flat**2).sum()), sum(kls), len(kls)]
    )
    mean = total / max(n, 1.0)
    std = math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 1.0  # unbiased, as torch.std
    for row in stats:
        row["adv"] = (row["adv"] - mean) / (std + 1e-8) * row["mask"]
    return {"kl": kl_sum / max(kl_n, 1.0)}


def _pad_rows(rows: Sequence[dict[str, Any]], key: str, width: int, device: Any) -> Any:
    import torch

    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : row[key].shape[0]] = row[key]
    return out.to(device)


def _full(norm: Any) -> float:
    """A gradient norm as a float (over sharded parameters clip_grad_norm_ returns a DTensor; its value is the
    norm of the whole gradient)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _update(
    models: _Models,
    episodes: list[Episode],
    stats: list[dict[str, Any]],
    config: RLConfig,
    dist: DataParallel,
    actor: bool = True,
) -> dict:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps; returns mean loss terms. ``actor=False`` (the critic's
    warm-up): only the critic learns; the policy's weights and optimizer state stay as they are.

    Every process splits its episodes into exactly ``mini_batches`` parts, so all take the same optimizer steps; a
    micro-batch's loss is weighted by :func:`sleuth.train.rl.micro_batch_weights`: with ``micro_batch_aggregation:
    mini_batch_mean`` by its share of the global mini-batch (tokens, or sequences for the ``seq-*`` aggregations),
    which makes the summed gradient that of the whole mini-batch; with ``micro_batch_mean`` by 1 / the number of
    micro-batches over all processes (TRL's and veRL's gradient accumulation; the value loss too). A mini-batch
    empty on every process is skipped (AdamW would move the weights on a zero gradient). A separate critic's value
    loss goes through its own backward path (no parameter in common) and its gradients are synced and clipped on
    their own."""
    import torch

    from sleuth.train import packing, rl

    ppo = config.algorithm == "ppo"
    separate = models.critic is not None
    correct = config.correction() != "none" and all("is_w" in row for row in stats)
    logged: Counter[str] = Counter()
    grad_norms: list[float] = []
    critic_norms: list[float] = []
    count = 0
    order = list(range(len(episodes)))
    params = [p for g in models.optimizer.param_groups for p in g["params"]]
    policy_params = list(models.optimizer.param_groups[0]["params"])
    critic_params = models.critic_parameters()
    for _ in range(config.ppo_epochs):
        random.shuffle(order)
        for m in range(config.mini_batches):
            mini = order[m :: config.mini_batches]
            budget = packing.micro_batch_budget(config.micro_batch_tokens, config.micro_batch_aggregation)
            lengths = [len(episodes[i].input_ids or []) for i in mini]
            micros = packing.micro_batches(mini, lengths, config.micro_batch, budget)
            tokens, sequences, n_micros = dist.sum(
                [sum(float(stats[i]["mask"].sum()) for i in mini), float(len(mini)), float(len(micros))]
            )
            if sequences == 0:
                continue
            tokens = tokens or 1.0
            models.optimizer.zero_grad(set_to_none=True)
            if models.critic_optimizer is not None:
                models.critic_optimizer.zero_grad(set_to_none=True)
            idle = _passes(models, dist, len(micros), backward=True)
            passes = idle + len(micros)  # replicated: all but the last accumulate locally, the last syncs
            for k in range(idle):
                with models.no_sync(k + 1 < passes, policy=actor):
                    models.idle_pass(values=ppo, policy=actor or not separate, backward=True)
            for j, micro in enumerate(micros):
                with models.no_sync(idle + j + 1 < passes, policy=actor):
                    chunk = [episodes[i] for i in micro]
                    rows = [stats[i] for i in micro]
                    ids, attention, _ = _pad(chunk, models.tokenizer.pad_token_id, models.device)
                    width = ids.shape[1] - 1
                    mask = _pad_rows(rows, "mask", width, models.device)
                    # each micro-batch's loss is a mean over its tokens (or sequences): weight it by its share of the
                    # mini-batch, or 1 / the micro-batch count (micro_batch_aggregation)
                    by_rows = config.loss_aggregation.startswith("seq")
                    size, total = (float(len(micro)), sequences) if by_rows else (float(mask.sum()), tokens)
                    mode = config.micro_batch_aggregation
                    share = float(rl.micro_batch_weights(torch.tensor([size]), mode, total, n_micros)[0])
                    token_share = float(
                        rl.micro_batch_weights(torch.tensor([float(mask.sum())]), mode, tokens, n_micros)[0]
                    )
                    loss = torch.zeros((), device=models.device)
                    values = None
                    if actor or not separate:
                        logits, values = models.forward(ids, attention, values=ppo and not separate)
                    if separate:
                        values = models.values(ids, attention)
                    if actor:
                        logits = logits[:, :-1].float()
                        logp = rl.token_logprobs(logits, ids[:, 1:])
                        old = _pad_rows(rows, "old", width, models.device)
                        adv = _pad_rows(rows, "adv", width, models.device)
                        is_w = _pad_rows(rows, "is_w", width, models.device) if correct else None
                        if config.algorithm == "grpo":
                            ref = _pad_rows(rows, "ref", width, models.device)
                            policy_loss, terms = rl.grpo_loss(
                                logp,
                                old,
                                ref,
                                adv,
                                mask,
                                clip_eps=config.clip_eps,
                                beta=config.beta,
                                kl=config.kl,  # type: ignore[arg-type]
                                aggregation=config.loss_aggregation,  # type: ignore[arg-type]
                                is_weights=is_w,
                            )
                        else:
                            policy_loss, terms = rl.ppo_policy_loss(
                                logp,
                                old,
                                adv,
                                mask,
                                clip_eps=config.clip_eps,
                                aggregation=config.loss_aggregation,  # type: ignore[arg-type]
                                is_weights=is_w,
                            )
                        entropy = rl.masked_mean(
                            rl.entropy_from_logits(logits if config.entropy_coef else logits.detach()), mask
                        )
                        # the entropy and the logged terms are token means: weighted by the token share (the same
                        # as share but with a seq-* aggregation), so that no grouping changes them
                        bonus = config.entropy_coef * entropy * token_share if config.entropy_coef else 0.0
                        loss = loss + policy_loss * share - bonus
                        logged["loss"] += float(policy_loss.detach()) * share - float(torch.as_tensor(bonus).detach())
                        logged["entropy"] += float(entropy.detach()) * token_share
                        for k, v in terms.items():
                            logged[k] += float(v) * token_share
                    if ppo:
                        returns = _pad_rows(rows, "returns", width, models.device)
                        old_values = _pad_rows(rows, "values", width, models.device)
                        v_loss, v_terms = rl.value_loss(
                            values[:, :width].float(), old_values, returns, mask, clip_eps=config.value_clip
                        )
                        loss = loss + (1.0 if separate else config.vf_coef) * v_loss * token_share
                        logged["value_loss"] += float(v_loss.detach()) * token_share
                        for k, v in v_terms.items():
                            logged[f"value_{k}"] += float(v) * token_share
                    (loss * models.loss_scale).backward()
            # the gradients are the global sums by now: FSDP reduce-scatters them in every backward, DDP all-reduces
            # them in the last one
            if actor:
                grad_norms.append(_full(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)))
                models.optimizer.step()
            elif not separate:  # shared head in the critic's warm-up: the value loss may move only the head
                for p in policy_params:
                    p.grad = None
                head = [p for p in params if all(p is not q for q in policy_params)]
                critic_norms.append(float(torch.nn.utils.clip_grad_norm_(head, config.max_grad_norm)))
                models.optimizer.step()
            if models.critic_optimizer is not None:
                critic_norms.append(_full(torch.nn.utils.clip_grad_norm_(critic_params, config.max_grad_norm)))
                models.critic_optimizer.step()
            count += 1
    # each process's terms are weighted by its share of the global mini-batch: their sum is the global mean
    keys = sorted(set().union(*dist.gather(sorted(logged))))
    out = dict(zip(keys, (v / max(count, 1) for v in dist.sum([logged[k] for k in keys])), strict=True))
    if grad_norms:  # the same on every process (computed after the gradients are summed)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    if critic_norms:
        out["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def _batch(examples: list[Example], step: int, size: int, seed: int) -> list[Example]:
    """The questions of ``step``: consecutive slices of one seeded shuffle per pass over the data."""
    out = []
    n = len(examples)
    for j in range(step * size, (step + 1) * size):
        epoch, at = divmod(j, n)
        order = list(range(n))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        out.append(examples[order[at]])
    return out


def rollout_traces(
    task: Task, llm: Any, agent: Any, batch: list[Example], config: RLConfig, step: int, rank: int = 0
) -> list[Trace]:
    """The traces of one step: ``config.group_size`` copies of each question (``metadata["rl"]``: its group and
    sample), run by the task's agent on ``llm`` with the step's seed (each call then draws its own:
    :func:`sleuth.agents.base.call_seed`). Also what a pilot samples to see a policy's reward before training."""
    from sleuth.runner import run

    copies = []
    for q, example in enumerate(batch):
        for g in range(config.group_size):
            copy = Example.from_dict(example.to_dict())
            copy.metadata["rl"] = {"group": f"{step}:{q}:{example.id}", "sample": g}
            copies.append(task.episode_example(copy, f"{step}:{q}:{example.id}", g))
    sampling = dataclasses.replace(agent.sampling, seed=config.seed * 1_000_003 + step + 7_919 * rank)
    agent = dataclasses.replace(agent, sampling=sampling)
    context = task.context(llm, agent)
    context.record_tokens = config.episode_tokens == "sampled"  # token-in, token-out
    return run(task.method, copies, context, concurrency=config.concurrency, progress=False)


def _tokenize(episode: Episode, tokenizer: Any, max_tokens: int | None, mode: str = "sampled") -> bool:
    """Fill ``episode.input_ids`` / ``mask`` (within ``max_tokens``, observations cut to fit); False, with the reason
    in ``episode.skipped``, when it has nothing to train on. Never raises on what a model wrote.

    ``mode`` ``sampled``: the ids recorded in the rollout (``episode.prompt_ids`` and ``pieces``) when the task
    filled them, with the sampler's log-probs; otherwise (and with ``retokenize``) the conversation's text through
    the chat template. ``episode.token_path`` says which."""
    from sleuth.train.tokens import TokenizationError, fit_to_length, prompt_observations, sampled_chat, tokenize_chat

    if episode.messages is None and episode.pieces is None:
        return False
    if mode == "sampled" and episode.prompt_ids is not None and episode.pieces is not None:
        prompt = (episode.messages or [])[:-1]  # the conversation before the (last) assistant message
        observed = prompt_observations(tokenizer, prompt, episode.prompt_ids)
        chat, episode.sampler_logprobs = sampled_chat(episode.prompt_ids, episode.pieces, observed)
        episode.token_path = "sampled"
    elif episode.messages is not None:
        try:
            chat = tokenize_chat(tokenizer, episode.messages)
        except TokenizationError:
            episode.skipped = "untokenizable"
            return False
        episode.token_path = "retokenize"
    else:
        return False
    fitted = fit_to_length(chat, max_tokens)
    if fitted is None:
        episode.skipped = "too_long"
        return False
    if not fitted.model_tokens:
        return False
    episode.input_ids, episode.mask, episode.cut_tokens = fitted.input_ids, fitted.model_mask, fitted.cut_tokens
    return True


def _store_rollouts(path: Path, task: Task, traces: list[Trace], episodes: list[Episode], step: int) -> None:
    """The step's traces in the shared rollout store format, with reward and components in ``extra``. A step redone
    after a resume replaces its directory, so the store always holds what the policy was trained on."""
    from sleuth.train.rollouts import Rollout, RolloutStore

    if path.exists():
        shutil.rmtree(path)
    store = RolloutStore(path, producer={"method": task.method, "step": step})
    rows = []
    for trace, episode in zip(traces, episodes, strict=True):
        rl_meta = trace.example.metadata.get("rl") or {}
        extra = {
            "step": step,
            "reward": episode.reward,
            "components": episode.components,
            "trained": episode.input_ids is not None,
        }
        if episode.cut_tokens:
            extra["cut_tokens"] = episode.cut_tokens
        if episode.skipped:
            extra["skipped"] = episode.skipped
        group, sample = str(rl_meta.get("group", trace.example.id)), int(rl_meta.get("sample", 0))
        rows.append(Rollout(f"{group}#{sample}", group, sample, trace, extra))
    store.append(rows)


def _plot(log: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = [k for k in ("reward", "kl", "entropy", "response_tokens", "searches") if any(k in r for r in log)]
    keys += sorted({k for r in log for k in r if k.startswith("reward/")})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(r["step"], r[key]) for r in log if r.get(key) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def train_online(config: RLConfig, task: Task, examples: list[Example], log_name: str = "rl") -> dict[str, Any]:
    """Run ``config.steps`` RL steps of ``task`` over ``examples`` (module doc); resumable; returns the summary."""
    import torch

    from sleuth.llm.hf import HFLLM
    from sleuth.train import tracking

    config.validate()
    if not examples:
        raise ValueError("no training questions")
    dist = DataParallel()
    if config.prompts_per_step < dist.world:
        raise ValueError(f"prompts_per_step={config.prompts_per_step} < {dist.world} processes: one would sit idle")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the curves (OUT/tb by default); a backend whose package is missing fails here, before any model loads
    tracker = tracking.Tracker(config.report_to, out, out.name, dataclasses.asdict(config), enabled=dist.main)
    checkpoint = out / "checkpoint"
    resume = checkpoint if (checkpoint / "state.json").exists() else None
    start = json.loads((checkpoint / "state.json").read_text())["step"] if resume else 0
    log_path = out / LOG_FILE
    log = trim_log(log_path, start - 1, write=dist.main)  # steps after the checkpoint are redone
    random.seed(config.seed + start)
    torch.manual_seed(config.seed + start)
    base = resolve_model(config.model)
    models = _Models(
        config,
        base,
        resume,
        dist.device(),
        sharded=config.sharding == "fsdp" and (dist.world > 1 or torch.distributed.is_initialized()),
        replicated=dist.world > 1,
    )
    rows = config.rows_per_generate(dist.device().type, dist.world)
    # episodes in flight: at least a generate call's rows, or the batch never fills
    config = dataclasses.replace(config, rollout_batch=rows, concurrency=max(config.concurrency, rows))
    llm = HFLLM.from_model(models.policy, models.tokenizer, max_batch=rows, autocast=models.compute_dtype)
    served = None
    if config.rollout_server:
        from sleuth.train.served_policy import ServedPolicy

        served_dir = Path(config.rollout_adapter_dir or out / "served")
        # LoRA: the adapter is loaded by name each step; full fine-tuning: the server reloads all weights in place
        served = ServedPolicy(
            config.rollout_server,
            served_dir,
            dist,
            mode="lora" if config.lora else "full",
            tokenizer=models.tokenizer,
            token_out=config.episode_tokens == "sampled",  # prompt ids in; sampled ids and log-probs back
        )
    agent = task.agent_config(config)
    if resume is not None:  # continue the random streams where the checkpoint left them (mini-batch order)
        saved = json.loads((checkpoint / "state.json").read_text())
        if "python_rng" in saved:
            version, internal, gauss = saved["python_rng"]
            random.setstate((version, tuple(internal), gauss))
            torch.set_rng_state(torch.tensor(saved["torch_rng"], dtype=torch.uint8))
    started_all = time.perf_counter()
    for step in range(start, config.steps):
        t0 = time.perf_counter()
        rates = models.set_learning_rates(step, config)
        actor = not (config.algorithm == "ppo" and step < config.critic_warmup_steps)
        models.policy.eval()
        batch = _batch(examples, step, config.prompts_per_step, config.seed)[dist.rank :: dist.world]
        if served is not None:
            llm = served.publish(models.policy, step)
        with models.gathered_policy():
            traces = rollout_traces(task, llm, agent, batch, config, step, dist.rank)
        t_rollout = time.perf_counter() - t0
        episodes = task.episodes(traces)
        usable = [
            e for e in episodes if _tokenize(e, models.tokenizer, config.max_episode_tokens, config.episode_tokens)
        ]
        # the step's traces go to process 0 for the store; the log's numbers (small) to every process
        parts = dist.gather_to_main((traces, episodes))
        if parts is not None:
            all_traces, all_episodes = [t for p in parts for t in p[0]], [e for p in parts for e in p[1]]
            _store_rollouts(out / "rollouts" / f"step-{step:05d}", task, all_traces, all_episodes, step)
        rows = [
            (
                e.reward,
                e.components,
                e.searches,
                sum(e.mask) if e.input_ids is not None and e.mask else None,
                e.cut_tokens,
                e.skipped,
                e.token_path,
            )
            for e in episodes
        ]
        rows = [row for part in dist.gather(rows) for row in part]
        entry: dict[str, Any] = {"step": step}
        entry["reward"] = sum(r[0] for r in rows) / max(len(rows), 1)
        for key in sorted({k for r in rows for k in r[1]}):
            values = [r[1][key] for r in rows if key in r[1]]
            entry[f"reward/{key}"] = sum(values) / len(values)
        trained = [r[3] for r in rows if r[3] is not None]
        entry["too_long"] = sum(r[5] == "too_long" for r in rows)
        entry["failed"] = len(rows) - len(trained) - entry["too_long"]
        if entry["failed"]:  # what the failed rollouts raised, by message (the Trace's error; "" for a reward)
            raised = [str(t.error)[:160] for t in traces if t.error]
            errors = Counter(e for part in dist.gather(raised) for e in part)
            entry["failed_errors"] = dict(errors.most_common(5))
            if entry["failed"] > config.max_failed_fraction * len(rows):
                raise RuntimeError(
                    f"step {step + 1}: {entry['failed']} of {len(rows)} episodes failed (max_failed_fraction "
                    f"{config.max_failed_fraction}), not training on the rest; errors: {entry['failed_errors']}"
                )
        entry["truncated"] = sum(1 for r in rows if r[4])  # episodes whose observations were cut to fit
        entry["truncated_tokens"] = sum(r[4] for r in rows)
        # trained on the ids sampled, or re-tokenized (episode_tokens: retokenize, or an engine that returned no ids)
        entry["sampled_episodes"] = sum(r[3] is not None and r[6] == "sampled" for r in rows)
        entry["retokenized"] = sum(r[3] is not None and r[6] == "retokenize" for r in rows)
        entry["searches"] = sum(r[2] for r in rows) / max(len(rows), 1)
        entry["response_tokens"] = sum(trained) / max(len(trained), 1)
        entry.update(rates)
        if config.algorithm == "ppo":
            entry["actor_updated"] = actor
        if trained:  # the same decision on every process (from the gathered numbers)
            models.train()
            stats = _rollout_stats(models, usable, config, dist)
            entry.update(_sampler_correction(stats, config, dist))
            entry.update(_advantages(usable, stats, config, dist))
            entry.update(_update(models, usable, stats, config, dist, actor=actor))
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        entry["tokens_per_second"] = round(sum(trained) / max(entry["seconds"], 1e-3), 1)  # response tokens
        entry["rollout_seconds"] = round(max(dist.gather(t_rollout)), 2)
        if served is not None and served.seconds:  # part of rollout_seconds: the policy saved and sent to the server
            entry["publish_seconds"] = round(sum(served.seconds.values()), 2)
        log.append(entry)
        if dist.main:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        tracker.log(step, {CURVE_TAGS.get(k, k): v for k, v in entry.items() if k != "step"})
        if config.progress and dist.main:
            cut = ""
            if entry["failed"]:
                cut += f" failed {entry['failed']}"
            if entry["truncated"] or entry["too_long"]:
                cut += (
                    f" cut {entry['truncated']} episodes ({entry['truncated_tokens']} observation tokens), "
                    f"{entry['too_long']} too long"
                )
            print(
                f"[{log_name}] step {step + 1}/{config.steps} reward {entry['reward']:.3f} "
                f"kl {entry.get('kl', 0):.4f} tokens {entry['response_tokens']:.0f}{cut} {entry['seconds']:.0f}s",
                flush=True,
            )
        if (step + 1) % config.save_steps == 0 or step + 1 == config.steps:
            if models.sharded:  # every process writes its shards
                models.save_checkpoint(checkpoint, step + 1, config, dist)
            elif dist.main:  # the processes' weights are identical: one copy
                models.save_checkpoint(checkpoint, step + 1, config)
            dist.barrier()
    models.train(False)
    final = out / "model"
    if start < config.steps or not (final / "config.json").exists():  # a run extended to more steps re-saves
        models.save_final(final, config, main=dist.main)
    tracker.close()
    if dist.main:
        _plot(log, out / "curves.png")
    summary = {
        "model": str(final),
        "steps": len(log),
        "first": log[0] if log else None,
        "last": log[-1] if log else None,
        "seconds": time.perf_counter() - started_all,
        "truncated": sum(r.get("truncated", 0) for r in log),
        "truncated_tokens": sum(r.get("truncated_tokens", 0) for r in log),
        "too_long": sum(r.get("too_long", 0) for r in log),
        # how the processes shared the work: "none" (one process), "ddp" (replicas), "fsdp" (shards)
        "parallelism": "fsdp" if models.sharded else "ddp" if models.replicated else "none",
    }
    if dist.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    # Free the (sharded) models now, while the interpreter is whole: FSDP's reference cycles keep the last step's
    # gloo work objects (and their tensors) alive until interpreter teardown otherwise, where destroying them
    # aborted about one 2-process run in 20 after it had finished ("terminate called without an active exception").
    del llm, models, served
    free_memory()
    dist.barrier()
    close_process_group()
    return summary
