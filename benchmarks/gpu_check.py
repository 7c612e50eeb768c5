"""`make gpu-check`: sleuth's GPU paths, each run once and timed, in under 10 minutes on one H100 (hf engine).

Parts (each wrapped: a failing part is reported with its exception line and the others still run):

1. ``generate``: bf16 generation with the hf backend (``hf:MODEL?device=cuda&dtype=bfloat16&max_batch=32``) on
   ``--prompts`` chat prompts (one untimed warm-up call first); tokens/s = completion tokens / wall time.
2. ``sft``: sleuth's SFT trainer (``sleuth.train.sft.build_trainer``, TRL's SFTTrainer) for ``--steps`` steps on
   synthetic prompt-completion records, bf16 autocast over fp32 weights on a bf16 GPU; tokens/s = the records'
   tokens (one pass) / ``trainer.train()`` time.
3. ``dpo``: mDPO's ``build_dpo_trainer`` (TRL's DPOTrainer, frozen reference) for ``--steps`` steps on synthetic
   pairs; tokens/s = chosen + rejected sequence tokens / ``trainer.train()`` time.
4. ``ppo``: ``sleuth.train.online_rl.train_online``, PPO with the separate critic, ``dtype: auto`` (bf16 autocast
   over fp32 master weights on a bf16 GPU), one step of a trivial task; step seconds and tokens/s (response tokens
   / step time, rollouts included) from the run's ``log.jsonl``.
5. ``ppo_fsdp``: the same step with ``sharding: fsdp`` (FSDP2) in one process under a torch.distributed group this
   script starts (nccl on CUDA, gloo on CPU; MASTER_ADDR/PORT, RANK=0, WORLD_SIZE=1).

A part whose package is missing (no trl/datasets on an offline GPU node) is reported as SKIPPED with the package
named; ``--require-all`` turns skips into failures. The exit code is 1 when any part failed.

    python benchmarks/gpu_check.py                       # CUDA: writes docs/results/gpu_check.json and .md
    python benchmarks/gpu_check.py --device cpu --model PATH_TO_TINY_MODEL --steps 1 --prompts 4   # prints only

On CUDA the results go to ``docs/results/gpu_check.json`` / ``.md`` (or ``--out PATH``: the JSON there, the table
next to it with ``.md``); on CPU they are printed only, unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "gpu_check.json"


@dataclass
class Settings:
    """What one check runs: the device, the model directory and the sizes (CUDA defaults; tiny ones on CPU)."""

    device: str = "cuda"
    model: str = ""  # empty: the embedded SmolLM2 (sleuth.assets.default_model_dir())
    prompts: int = 32
    max_new_tokens: int = 128  # generation part
    steps: int = 2  # SFT / DPO optimizer steps
    batch: int = 4  # SFT rows / DPO pairs per step
    record_tokens: int = 512  # rough length of a synthetic SFT / DPO prompt
    rl_prompts: int = 8  # questions in the PPO step
    rl_new_tokens: int = 64  # rollout length in the PPO step
    workdir: str = ""  # empty: a temporary directory, removed afterwards

    @classmethod
    def for_device(cls, device: str, **overrides: Any) -> Settings:
        base = cls(device=device)
        if device == "cpu":
            base = dataclasses.replace(
                base, prompts=4, max_new_tokens=8, steps=1, batch=2, record_tokens=24, rl_prompts=2, rl_new_tokens=6
            )
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def model_dir(self) -> str:
        if self.model:
            return self.model
        from sleuth.assets import default_model_dir

        return str(default_model_dir())


@dataclass
class PartResult:
    name: str
    status: str = "ok"  # ok | failed | skipped
    seconds: float = 0.0  # wall time of the whole part (loading included)
    tokens: int = 0
    timed_seconds: float = 0.0  # the time tokens/s is computed over
    tokens_per_second: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ------------------------------------------------------------------------------------------------------- helpers


def _missing(packages: tuple[str, ...]) -> list[str]:
    return [p for p in packages if importlib.util.find_spec(p) is None]


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_memory_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def _filler(i: int, tokens: int) -> str:
    """About ``tokens`` tokens of varied text for synthetic record ``i``."""
    words = ["archive", "river", "council", "founded", "poet", "city", "museum", "bridge", "author", "century"]
    body = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(max(1, tokens * 3 // 4)))
    return f"Passage {i}: {body}."


def _chat_length(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def _check_steps(trainer: Any, steps: int) -> None:
    """A trainer that ran fewer optimizer steps than asked (records dropped, an empty epoch) is a failure."""
    if trainer.state.global_step != steps:
        raise RuntimeError(f"the trainer ran {trainer.state.global_step} of {steps} steps (records dropped?)")


def _sft_records(settings: Settings) -> list[dict[str, Any]]:
    rows = []
    for i in range(settings.batch * settings.steps):
        prompt = f"{_filler(i, settings.record_tokens)}\n\nQuestion: who founded the archive in passage {i}?"
        answer = f"The archive in passage {i} was founded by the council. \\boxed{{council {i}}}"
        rows.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": answer}],
            }
        )
    return rows


def _dpo_pairs(settings: Settings) -> list[dict[str, Any]]:
    pairs = []
    for i in range(settings.batch * settings.steps):
        prompt = f"{_filler(i, settings.record_tokens)}\n\nQuestion: which city is named in passage {i}?"
        pairs.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": f"The city of passage {i}. <answer>city {i}</answer>"}],
                "rejected": [{"role": "assistant", "content": "I do not know."}],
            }
        )
    return pairs


# --------------------------------------------------------------------------------------------------------- parts


def part_generate(settings: Settings, workdir: Path) -> PartResult:
    """bf16 (CUDA) / fp32 (CPU) generation with the hf backend on ``settings.prompts`` prompts."""
    from sleuth.llm import Request, Sampling, load_llm

    if settings.device == "cuda":
        options = "device=cuda&dtype=bfloat16&max_batch=32"
    else:
        options = f"device=cpu&dtype=float32&max_batch={max(1, settings.prompts)}"
    llm = load_llm(f"hf:{settings.model_dir()}?{options}")
    requests = [
        Request.chat(f"Write a detailed paragraph about the history of city number {i} and its bridges.")
        for i in range(settings.prompts)
    ]
    # greedy, no stop strings: the model stops at its EOS; tokens are counted, not assumed
    sampling = Sampling(temperature=0.0, max_new_tokens=settings.max_new_tokens)

    timing: dict[str, float] = {}

    async def generate() -> list[Any]:
        await llm.generate(requests[:2], Sampling(max_new_tokens=4))  # warm-up (CUDA kernels, allocator)
        _peak_memory_reset()
        calls = llm.stats.calls
        t0 = time.perf_counter()
        out = await llm.generate(requests, sampling)
        timing["seconds"] = time.perf_counter() - t0
        timing["calls"] = llm.stats.calls - calls
        timing.update(_raw_generate(llm, requests, settings.max_new_tokens))
        await llm.aclose()
        return out

    generations = asyncio.run(generate())
    seconds = timing["seconds"]
    tokens = sum(sum(g.completion_tokens) for g in generations)
    prompt_tokens = sum(g.prompt_tokens for g in generations)
    describe = llm.describe()
    longest = max((max(g.completion_tokens, default=0) for g in generations), default=0)
    return PartResult(
        name="generate",
        tokens=tokens,
        timed_seconds=seconds,
        detail={
            "prompts": settings.prompts,
            "max_new_tokens": settings.max_new_tokens,
            "prompt_tokens": prompt_tokens,
            # what a decoding step costs through sleuth's backend (its generate calls run one after another) and
            # through a bare transformers generate of the same batch, forced to the same length: which one is slow
            "generate_calls": timing["calls"],
            "seconds_per_step": round(seconds / max(1, longest * timing["calls"]), 4),
            "raw_seconds_per_step": timing["raw_seconds_per_step"],
            "backend": describe,
            "peak_gib": _peak_memory_gib(),
        },
    )


def _raw_generate(llm: Any, requests: list[Any], new_tokens: int) -> dict[str, float]:
    """One bare ``model.generate`` of all the prompts (greedy, left-padded, no logits processor or stopping rule,
    ``min_new_tokens`` = ``new_tokens``): seconds per decoding step without sleuth's backend around it."""
    import torch

    rows = [llm.encode_prompt(r.messages) for r in requests]
    width, pad = max(len(r) for r in rows), llm.tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    kwargs = {"do_sample": False, "pad_token_id": pad, "temperature": None, "top_p": None, "top_k": None}
    with torch.inference_mode():
        ids, mask = ids.to(llm.device), mask.to(llm.device)
        _synchronize(llm.device)
        t0 = time.perf_counter()
        llm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, **kwargs)
        _synchronize(llm.device)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs
        )
        _synchronize(llm.device)
        total = time.perf_counter() - t0
    return {"raw_seconds_per_step": round((total - prefill) / max(1, new_tokens - 1), 4)}


def _synchronize(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def part_sft(settings: Settings, workdir: Path) -> PartResult:
    """``settings.steps`` steps of sleuth's SFT trainer on synthetic records (one pass over them)."""
    from transformers import AutoTokenizer

    from sleuth.train.sft import SFTConfig, build_trainer

    records = _sft_records(settings)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir())
    # no record is cut (a record cut to no completion token would be dropped, leaving nothing to train on)
    longest = max(_chat_length(tokenizer, r["prompt"] + r["completion"]) for r in records)
    config = SFTConfig(
        model=settings.model_dir(),
        output_dir=str(workdir / "sft"),
        val_fraction=0.0,
        max_length=longest + 16,
        max_steps=settings.steps,
        learning_rate=1e-5,
        batch_size=settings.batch,
        per_device_batch_size=settings.batch,
        gradient_accumulation_steps=1,
        warmup_ratio=0.0,
        save_steps=10_000,
        logging_steps=1,
        bf16=None,  # on when the GPU supports it (fp32 weights, bf16 autocast)
        gradient_checkpointing=settings.device == "cuda",
        report_to=[],
        resume=False,
    ).validate()
    trainer = build_trainer(config, records)
    lengths = [min(len(ids), config.max_length) for ids in trainer.train_dataset["input_ids"]]
    _peak_memory_reset()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    _check_steps(trainer, settings.steps)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = PartResult(
        name="sft",
        tokens=sum(lengths),
        timed_seconds=seconds,
        detail={
            "steps": trainer.state.global_step,
            "rows": len(lengths),
            "bf16": bool(trainer.args.bf16),
            "loss": losses[-1] if losses else None,
            "peak_gib": _peak_memory_gib(),
        },
    )
    del trainer
    return result


def part_dpo(settings: Settings, workdir: Path) -> PartResult:
    """``settings.steps`` steps of mDPO's DPO trainer on synthetic pairs (policy + frozen reference)."""
    from transformers import AutoTokenizer

    from sleuth.train.mdpo import MDPOConfig, build_dpo_trainer

    pairs = _dpo_pairs(settings)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir())
    chosen = [_chat_length(tokenizer, p["prompt"] + p["chosen"]) for p in pairs]
    rejected = [_chat_length(tokenizer, p["prompt"] + p["rejected"]) for p in pairs]
    config = MDPOConfig(
        learning_rate=1e-6,
        max_steps=settings.steps,
        batch_size=settings.batch,
        per_device_batch_size=settings.batch,
        warmup_ratio=0.0,
        max_length=max(chosen + rejected) + 16,  # no pair is cut
        save_steps=10_000,
        report_to=[],
    )
    config.progress = False
    tokens = sum(chosen) + sum(rejected)
    trainer = build_dpo_trainer(config, settings.model_dir(), pairs, workdir / "dpo" / "iter1" / "trainer")
    _peak_memory_reset()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    _check_steps(trainer, settings.steps)
    history = [h for h in trainer.state.log_history if "loss" in h]
    result = PartResult(
        name="dpo",
        tokens=tokens,
        timed_seconds=seconds,
        detail={
            "steps": trainer.state.global_step,
            "pairs": len(pairs),
            "bf16": bool(trainer.args.bf16),
            "loss": history[-1]["loss"] if history else None,
            "peak_gib": _peak_memory_gib(),
        },
    )
    del trainer
    return result


def _rl_task(max_new_tokens: int) -> Any:
    from sleuth.agents import Context
    from sleuth.agents.baselines import DirectConfig
    from sleuth.llm import Sampling
    from sleuth.records import Trace
    from sleuth.train.online_rl import Episode, RLConfig, Task

    class LengthTask(Task):
        """The ``direct`` agent, rewarded by a fixed rule on its answer's length (varied rewards, no grader)."""

        method = "direct"

        def agent_config(self, config: RLConfig) -> Any:
            return DirectConfig(
                sampling=Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=max_new_tokens)
            )

        def context(self, llm: Any, agent_config: Any) -> Context:
            return Context(llm=llm, retriever=None, config=agent_config)

        def episodes(self, traces: list[Trace]) -> list[Episode]:
            out = []
            for trace in traces:
                step = trace.steps[-1]
                messages = [*(step.messages or []), {"role": "assistant", "content": step.output or ""}]
                reward = float(len(trace.answer or "") % 3)
                group = trace.example.metadata["rl"]["group"]
                out.append(Episode(group=group, messages=messages, reward=reward, components={"length": reward}))
            return out

    return LengthTask()


def _ppo(settings: Settings, workdir: Path, name: str, sharding: str) -> PartResult:
    from sleuth.records import Example
    from sleuth.train.online_rl import RLConfig, train_online

    out = workdir / name
    config = RLConfig(
        model=settings.model_dir(),
        output_dir=str(out),
        algorithm="ppo",
        critic="separate",
        dtype="auto",  # bf16 autocast over fp32 master weights on a bf16 GPU; fp32 elsewhere
        sharding=sharding,  # type: ignore[arg-type]
        steps=1,
        prompts_per_step=settings.rl_prompts,
        group_size=1,
        micro_batch=4,
        learning_rate=1e-6,
        critic_learning_rate=1e-5,
        temperature=1.0,
        save_steps=10_000,
        report_to=[],
        progress=False,
    )
    examples = [
        Example(id=f"q{i}", question=f"Who wrote book number {i}, and where was the author born?", answers=["Ann"])
        for i in range(settings.rl_prompts)
    ]
    _peak_memory_reset()
    summary = train_online(config, _rl_task(settings.rl_new_tokens), examples)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    if not log:
        raise RuntimeError(f"{out / 'log.jsonl'} has no step entry")
    entry = log[-1]
    if sharding == "fsdp" and summary.get("parallelism") != "fsdp":
        raise RuntimeError(f"expected an FSDP run, the summary says parallelism={summary.get('parallelism')!r}")
    return PartResult(
        name=name,
        tokens=int(entry.get("response_tokens", 0)),
        timed_seconds=float(entry["seconds"]),
        tokens_per_second=float(entry["tokens_per_second"]),
        detail={
            "step_seconds": entry["seconds"],
            "rollout_seconds": entry.get("rollout_seconds"),
            "parallelism": summary.get("parallelism"),
            "reward": entry.get("reward"),
            "episodes": settings.rl_prompts,
            "peak_gib": _peak_memory_gib(),
        },
    )


def part_ppo(settings: Settings, workdir: Path) -> PartResult:
    """One PPO step (separate critic, fp32 masters) of ``train_online``."""
    return _ppo(settings, workdir, "ppo", "none")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def single_process_group(device: str) -> Iterator[None]:
    """A one-process torch.distributed group (nccl on CUDA, gloo on CPU), as torchrun with one process would set
    it up; the environment and the group are restored / destroyed afterwards."""
    import torch
    import torch.distributed as dist

    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
    )
    started = False
    try:
        if not dist.is_initialized():
            if device == "cuda":
                torch.cuda.set_device(0)
            dist.init_process_group(backend="nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
            started = True
        yield
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def part_ppo_fsdp(settings: Settings, workdir: Path) -> PartResult:
    """The PPO step with ``sharding: fsdp`` (FSDP2) in one process."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    with single_process_group(settings.device):
        return _ppo(settings, workdir, "ppo_fsdp", "fsdp")


# name -> (function, packages it needs beyond torch/transformers)
PARTS: dict[str, tuple[Callable[[Settings, Path], PartResult], tuple[str, ...]]] = {
    "generate": (part_generate, ("torch", "transformers")),
    "sft": (part_sft, ("torch", "transformers", "trl", "datasets")),
    "dpo": (part_dpo, ("torch", "transformers", "trl", "datasets")),
    "ppo": (part_ppo, ("torch", "transformers")),
    "ppo_fsdp": (part_ppo_fsdp, ("torch", "transformers")),
}


def run_part(name: str, settings: Settings, workdir: Path) -> PartResult:
    """One part, timed; a missing package gives ``skipped``, an exception ``failed`` with its first line."""
    function, packages = PARTS[name]
    missing = _missing(packages)
    if missing:
        print(f"[gpu-check] SKIPPED {name}: package(s) not installed: {', '.join(missing)}", flush=True)
        return PartResult(name=name, status="skipped", error=f"not installed: {', '.join(missing)}")
    print(f"[gpu-check] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        result = function(settings, workdir)
        if not result.tokens_per_second and result.timed_seconds > 0:
            result.tokens_per_second = result.tokens / result.timed_seconds
        result.tokens_per_second = round(result.tokens_per_second, 1)
        result.timed_seconds = round(result.timed_seconds, 3)
        if result.tokens <= 0:
            result.status, result.error = "failed", "no tokens were processed"
    except Exception as exc:  # every part is reported; the next one still runs
        traceback.print_exc()
        line = (str(exc).strip().splitlines() or [""])[0]
        result = PartResult(name=name, status="failed", error=f"{type(exc).__name__}: {line}")
    result.seconds = round(time.perf_counter() - t0, 2)
    _free_memory()
    state = result.status.upper()
    extra = f" {result.tokens_per_second} tok/s" if result.ok else f" {result.error}"
    print(f"[gpu-check] {name}: {state} in {result.seconds:.1f}s{extra}", flush=True)
    return result


def run_parts(settings: Settings, names: list[str] | None = None) -> list[PartResult]:
    """Every part (or ``names``) in order, in ``settings.workdir`` or a temporary directory."""
    names = names or list(PARTS)
    with contextlib.ExitStack() as stack:
        if settings.workdir:
            workdir = Path(settings.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        return [run_part(name, settings, workdir) for name in names]


# -------------------------------------------------------------------------------------------------------- report


def environment(settings: Settings) -> dict[str, Any]:
    import torch

    versions = {}
    for package in ("torch", "transformers", "trl", "datasets", "peft", "vllm"):
        if importlib.util.find_spec(package) is None:
            versions[package] = None
            continue
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = "installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and settings.device == "cuda" else None
    return {
        "device": settings.device,
        "gpu": gpu,
        "bf16_supported": bool(gpu and torch.cuda.is_bf16_supported()),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "packages": versions,
        "model": settings.model_dir(),
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# GPU check ({env['gpu'] or env['device']})",
        "",
        f"Model `{Path(env['model']).name}`; torch {env['packages']['torch']}, transformers "
        f"{env['packages']['transformers']}, trl {env['packages']['trl']}. "
        f"`{report.get('command', 'python benchmarks/gpu_check.py')}`.",
        "",
        "| part | status | tokens | timed s | tokens/s | part s | peak GiB | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for part in report["parts"]:
        detail = part["detail"]
        note = part["error"] or ", ".join(
            f"{k} {v}"
            for k, v in detail.items()
            if k in ("steps", "bf16", "parallelism", "rollout_seconds", "seconds_per_step", "raw_seconds_per_step")
        )
        peak = detail.get("peak_gib")
        lines.append(
            f"| {part['name']} | {part['status']} | {part['tokens']} | {part['timed_seconds']} | "
            f"{part['tokens_per_second']} | {part['seconds']} | {'' if peak is None else peak} | {note} |"
        )
    lines += ["", f"Total {report['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="", help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=None, help="SFT / DPO optimizer steps")
    parser.add_argument("--prompts", type=int, default=None, help="prompts in the generation part")
    parser.add_argument("--parts", default="", help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--workdir", default="", help="keep the runs' outputs here (default: a temporary directory)")
    parser.add_argument("--out", default="", help="write the JSON here (and the table next to it, .md)")
    parser.add_argument("--require-all", action="store_true", help="a part skipped for a missing package fails")
    args = parser.parse_args(argv)
    if args.device == "cpu" and "torch" not in sys.modules:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainers pick CUDA by themselves when they see it

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("[gpu-check] FAILED: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.parts.split(",") if n.strip()] or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    settings = Settings.for_device(args.device, model=args.model, steps=args.steps, prompts=args.prompts)
    settings.workdir = args.workdir
    if not Path(settings.model_dir()).is_dir():
        print(f"[gpu-check] FAILED: no model directory {settings.model_dir()} (run `sleuth assets fetch`)")
        return 2
    t0 = time.perf_counter()
    results = run_parts(settings, names)
    given = sys.argv[1:] if argv is None else argv
    report = {
        "command": " ".join(["python benchmarks/gpu_check.py", *(shlex.quote(a) for a in given)]),
        "environment": environment(settings),
        "settings": dataclasses.asdict(settings),
        "seconds": round(time.perf_counter() - t0, 1),
        "parts": [dataclasses.asdict(r) for r in results],
    }
    table = markdown(report)
    print(table)
    out = Path(args.out) if args.out else (RESULTS if args.device == "cuda" else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(table)
        print(f"[gpu-check] wrote {out} and {out.with_suffix('.md')}")
    failed = [r.name for r in results if r.status == "failed"]
    skipped = [f"{r.name} ({r.error})" for r in results if r.status == "skipped"]
    if skipped:
        print(f"[gpu-check] SKIPPED for a missing package: {'; '.join(skipped)}")
    if failed:
        print(f"[gpu-check] FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or (skipped and args.require_all) else 0


if __name__ == "__main__":
    sys.exit(main())
