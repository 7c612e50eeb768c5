"""What the trainers share: the config base classes, data and engine set-up, dev evaluation, and small helpers.

Every ``sleuth train ...`` command's config derives from :class:`TrainConfig` (model, output, seed, learning rate,
LoRA, tracking: one spelling each). The Hugging Face ``Trainer``-based trainers (SFT, mDPO, ExSearch's M-step) add
:class:`HFTrainConfig` (epochs, batch sizes, warm-up, scheduler, weight decay, ``max_length``, ``bf16``) and build
their ``TrainingArguments`` with :func:`training_arguments`; the trainers that sample from a (synthetic) world add
:class:`WorldConfig` (data files, index, sampling engine, dev evaluation) and read it with :func:`prepare_data`.

Renamed options keep loading: a config class's ``renamed`` table maps an old key (dotted for an old nested one) to
the new field, and :func:`sleuth.train.config.from_mapping` accepts the old key with a ``DeprecationWarning``.

Sampling and evaluation engines (:func:`engine_spec`, :class:`Engines`): ``hf`` (the ``hf:`` backend with
``llm_options``, loaded per stage), ``vllm`` (a vLLM server sleuth starts on a model directory and stops) or a spec
template with ``{model}`` (``vllm:{model}?tensor_parallel=2``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from sleuth.agents import Context
from sleuth.eval.metrics import score_example
from sleuth.llm import LLM
from sleuth.records import Example
from sleuth.retrieval import Retriever

A = TypeVar("A")

__all__ = [
    "DataConfig",
    "EngineOptions",
    "Engines",
    "HFTrainConfig",
    "TrainConfig",
    "WorldConfig",
    "auto_engine",
    "close_llm",
    "default_llm_factory",
    "engine_record",
    "engine_spec",
    "evaluate_dev",
    "free_memory",
    "log",
    "malloc_trim",
    "peft_lora_config",
    "prepare_data",
    "read_examples",
    "resident_bytes",
    "resolve_model",
    "seed_all",
    "serves",
    "training_arguments",
    "with_sampling",
    "write_json",
]


# ---------------------------------------------------------------------------------------------------------------
# Config base classes
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Options every trainer has. ``lora``: train LoRA adapters (rank ``lora_r``, scale ``lora_alpha``, dropout
    ``lora_dropout``) on ``lora_target`` ("all-linear" or comma-separated module names) instead of all weights."""

    # old option name (dotted: a key of an old nested mapping) -> the field that replaced it
    renamed: ClassVar[dict[str, str]] = {}

    model: str = "default"  # a transformers directory or "default" (the embedded SmolLM2)
    output_dir: str = "runs/train"
    seed: int = 0
    learning_rate: float = 1e-6
    gradient_checkpointing: bool = False  # recompute activations in the backward pass
    save_steps: int = 50
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target: str = "all-linear"
    # curves (sleuth.train.tracking): "tensorboard" (OUT/tb), "wandb", "mlflow", "trackio"; [] or "none": off
    report_to: list[str] | str = field(default_factory=lambda: ["tensorboard"])

    def lora_targets(self) -> str | list[str]:
        """``lora_target`` as PEFT's ``target_modules``: "all-linear", or the list of module names."""
        names = [n.strip() for n in self.lora_target.split(",") if n.strip()]
        return "all-linear" if names in ([], ["all-linear"]) else names


@dataclass
class HFTrainConfig(TrainConfig):
    """Options of the trainers built on a Hugging Face ``Trainer`` (SFT, mDPO's DPO, ExSearch's M-step).
    ``batch_size`` is the global batch (gradient accumulation makes up what ``per_device_batch_size`` does not);
    ``max_steps`` > 0 overrides ``epochs``; ``warmup_ratio`` is a fraction of the training steps; ``bf16`` None: on
    a GPU that supports it."""

    epochs: float = 1.0
    max_steps: int = -1
    batch_size: int = 64
    per_device_batch_size: int = 1
    warmup_ratio: float = 0.05
    lr_scheduler: str = "linear"
    weight_decay: float = 0.0
    max_length: int | None = 2048
    bf16: bool | None = None
    # each optimizer step's examples (a seeded random draw, as without it) sorted by length before they are cut into
    # per_device_batch_size micro-batches: less padding, the same step (sleuth.train.packing.LengthSortedSampler;
    # exact for SFT's token mean, DPO's pair mean and the M-step's example mean; no effect at one example per
    # micro-batch). The M-step's reference_nll_share weighting, defined per micro-batch, keeps the random order.
    length_sorted: bool = True


@dataclass
class DataConfig:
    """Training data of the trainers that sample from a world (mDPO, ExSearch EM, s3).

    ``train_file`` (Example jsonl), ``corpus`` (passages) and ``index`` (a retriever spec). With ``data_dir`` set,
    they default to its ``train.jsonl``/``corpus.jsonl``, and a non-empty ``synth`` (keyword arguments of
    :func:`sleuth.data.synth.synthesize`) first generates a synthetic world there if it has no ``world.json``.
    Without ``index``, a BM25 index of ``corpus`` is built in ``OUT/index``."""

    data_dir: str = ""
    synth: dict[str, Any] = field(default_factory=dict)
    train_file: str = ""
    corpus: str = ""
    index: str = ""
    train_limit: int | None = None  # training questions used per iteration (None: all)
    llm_options: str = ""  # options of the hf: backend for sampling and evaluation ("device=cpu&threads=2")

    def questions_to_read(self) -> int | None:
        """How many training questions the run reads (``train_limit``; a trainer may read more)."""
        return self.train_limit


@dataclass
class WorldConfig(DataConfig):
    """:class:`DataConfig` plus dev questions (``dev_file``, default ``data_dir``'s ``dev.jsonl``), the sampling
    and evaluation engine, and the progress log (mDPO, ExSearch EM)."""

    dev_file: str = ""
    dev_limit: int | None = 100  # dev questions for the per-iteration EM (0: no evaluation)
    # sampling/evaluation engine: "hf", "vllm" (a server on each iteration's model) or a spec with "{model}"
    engine: str = "hf"
    concurrency: int = 64
    progress: bool = True


def with_sampling(agent: A, temperature: float, top_p: float) -> A:
    """The agent config ``agent`` (a dataclass with a frozen ``sampling``) sampling at ``temperature`` / ``top_p``."""
    sampling = dataclasses.replace(agent.sampling, temperature=temperature, top_p=top_p)  # type: ignore[attr-defined]
    return dataclasses.replace(agent, sampling=sampling)  # type: ignore[type-var]


def training_arguments(config: HFTrainConfig, output_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords the Hugging Face-based trainers share (learning rate, epochs, batch,
    warm-up, scheduler, weight decay, seeds, checkpoints), from ``config``; ``overrides`` replace or add any."""
    arguments: dict[str, Any] = {
        "output_dir": str(output_dir),
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps,
        "learning_rate": config.learning_rate,
        "per_device_train_batch_size": config.per_device_batch_size,
        "warmup_steps": config.warmup_ratio,  # a float < 1 is a fraction of the training steps
        "lr_scheduler_type": config.lr_scheduler,
        "weight_decay": config.weight_decay,
        "seed": config.seed,
        "data_seed": config.seed,
        "save_strategy": "steps",
        "save_steps": config.save_steps,
        "save_total_limit": 2,
        "logging_steps": 1,
    }
    arguments.update(overrides)
    return arguments


def peft_lora_config(config: TrainConfig) -> Any:
    """PEFT's ``LoraConfig`` of a causal LM from the ``lora_*`` options."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_targets(),
        task_type="CAUSAL_LM",
    )


# ---------------------------------------------------------------------------------------------------------------
# Data, models and engines
# ---------------------------------------------------------------------------------------------------------------


def log(progress: bool, message: str, label: str = "mdpo") -> None:
    """``label message`` on stderr when ``progress``."""
    if progress:
        from rich.console import Console

        Console(stderr=True).print(f"[bold cyan]{label}[/] {message}", soft_wrap=True, highlight=False)


def resolve_model(spec: str) -> Path:
    """The model directory of ``spec`` ("" or "default": the embedded SmolLM2, fetched if needed; ``hf:PATH``)."""
    if spec in ("", "default"):
        from sleuth.assets import ensure_default_model

        return ensure_default_model()
    return Path(spec.removeprefix("hf:"))


def read_examples(path: str, limit: int | None) -> list[Example]:
    """The first ``limit`` examples of the jsonl ``path`` (all with None; none for an empty path)."""
    from sleuth.data.synth import load_synth

    if not path:
        return []
    examples = list(load_synth(path))
    return examples[:limit] if limit is not None else examples


def questions_read(limit: int | None, iterations: int, fresh: bool) -> int | None:
    """How many training questions an iterated trainer reads: ``limit`` (``train_limit``), or with ``fresh``
    (``fresh_questions``) one block of ``limit`` per iteration (:func:`question_block`)."""
    return limit * iterations if fresh and limit is not None else limit


def question_block(train: list[Example], limit: int | None, index: int, fresh: bool) -> list[Example]:
    """The training questions of iteration ``index`` (0-based): all of ``train``, or with ``fresh`` its
    ``index``-th block of ``limit`` questions (``fresh_questions`` of mDPO and ExSearch EM: a later iteration does not
    train again on an earlier one's questions); an error when the file has too few for the block."""
    if not fresh:
        return train
    n = limit or 0
    block = train[index * n : (index + 1) * n]
    if len(block) < n:
        raise ValueError(
            f"fresh_questions: iteration {index + 1} needs training questions {index * n + 1}-{(index + 1) * n}, "
            f"the file has {len(train)}"
        )
    return block


def prepare_data(
    config: DataConfig, output_dir: str | Path, progress: bool = True, need_index: bool = True
) -> tuple[list[Example], list[Example], str]:
    """Training and dev examples (dev: only for a :class:`WorldConfig`) and the retriever spec (generating the
    synthetic world and building the BM25 index in ``output_dir/index`` when needed; ``need_index=False``: no index,
    the spec is "")."""
    data = Path(config.data_dir) if config.data_dir else None
    if data is not None and config.synth and not (data / "world.json").exists():
        from sleuth.data.synth import synthesize

        log(progress, f"generating a synthetic world in {data}")
        synthesize(data, **config.synth)
    train_file = config.train_file or (str(data / "train.jsonl") if data else "")
    dev_file, dev_limit = "", None
    if isinstance(config, WorldConfig):
        dev_file, dev_limit = config.dev_file or (str(data / "dev.jsonl") if data else ""), config.dev_limit
    corpus = config.corpus or (str(data / "corpus.jsonl") if data else "")
    if not train_file:
        raise ValueError("mdpo needs training questions: set train_file or data_dir")
    index = config.index
    if not index and need_index:
        if not corpus:
            raise ValueError("mdpo needs a retriever: set index, or corpus / data_dir to build a BM25 index")
        index_dir = Path(output_dir) / "index"
        if not index_dir.exists():
            from sleuth.retrieval.bm25 import build_bm25_index

            log(progress, f"building a BM25 index of {corpus} in {index_dir}")
            build_bm25_index(corpus, index_dir)
        index = str(index_dir)
    return read_examples(train_file, config.questions_to_read()), read_examples(dev_file, dev_limit), index


class EngineOptions(Protocol):
    """What :func:`engine_spec` reads: a :class:`WorldConfig`, or any object with these two attributes."""

    engine: str
    llm_options: str


def engine_spec(config: EngineOptions, path: Path) -> str:
    """The LLM spec that samples and evaluates with the model in ``path``: ``config.engine`` is ``hf`` (the ``hf:``
    backend with ``config.llm_options``), ``vllm`` (``vllm:PATH``, a server sleuth starts and stops) or a template
    with ``{model}``. Raises ValueError for anything else."""
    engine = (config.engine or "hf").strip()
    if engine == "hf":
        return f"hf:{path}" + (f"?{config.llm_options}" if config.llm_options else "")
    if engine == "vllm":
        engine = "vllm:{model}"
    if "{model}" not in engine or ":" not in engine.partition("{model}")[0]:
        raise ValueError(f"engine={engine!r}; expected 'hf', 'vllm' or a spec with {{model}} ('vllm:{{model}}?...')")
    return engine.replace("{model}", str(path))


def auto_engine(choice: str = "auto") -> str:
    """``auto``: ``vllm`` when an interpreter with vLLM is found (``.venv-vllm`` from ``make vllm``, see
    :func:`sleuth.llm.vllm_server.find_vllm_python`), else ``hf``; any other choice as given."""
    if choice != "auto":
        return choice
    from sleuth.llm.base import LLMError
    from sleuth.llm.vllm_server import find_vllm_python

    try:
        find_vllm_python()
    except LLMError:
        return "hf"
    return "vllm"


def serves(config: EngineOptions) -> bool:
    """Whether ``config.engine`` starts a server per model (so a model used twice in a row keeps its server)."""
    return (config.engine or "hf").strip() != "hf"


def default_llm_factory(config: EngineOptions) -> Callable[[Path], LLM]:
    """Opens the LLM of a model directory on ``config``'s engine."""
    from sleuth.llm import load_llm

    def factory(path: Path) -> LLM:
        return load_llm(engine_spec(config, path))

    return factory


def close_llm(llm: LLM) -> None:
    """Stop the server an engine started (``vllm:``; nothing for the others), then free the model's memory."""
    close = getattr(llm, "close", None)
    if callable(close):
        close()
    free_memory()


class Engines:
    """Opens the LLM of a model directory with ``factory``; with ``keep``, an LLM released with ``keep=True`` stays
    open for the next :meth:`open` of the same directory (a server is not restarted on the same weights), and is
    closed as soon as another directory is opened, or by :meth:`close`."""

    def __init__(self, factory: Callable[[Path], LLM], keep: bool) -> None:
        self.factory = factory
        self.keep = keep
        self.held: tuple[Path, LLM] | None = None
        self.opened: list[Path] = []  # the directories the factory was asked for

    def open(self, path: Path) -> LLM:
        if self.held is not None:
            held_path, llm = self.held
            self.held = None
            if held_path == path:
                return llm
            close_llm(llm)
        self.opened.append(Path(path))
        return self.factory(path)

    def release(self, path: Path, llm: LLM, keep: bool = False) -> None:
        if keep and self.keep:
            self.held = (Path(path), llm)
        else:
            close_llm(llm)

    def close(self) -> None:
        if self.held is not None:
            close_llm(self.held[1])
            self.held = None


def engine_record(llm: LLM) -> dict[str, Any]:
    """Which engine a stage ran on, for the stats: the backend, its spec or model, and the server it used."""
    info = llm.describe()
    record = {k: info[k] for k in ("backend", "spec", "model", "base_url", "path") if info.get(k) is not None}
    server = info.get("server")
    if isinstance(server, dict):
        record["server"] = {k: server[k] for k in ("url", "log", "attached") if k in server}
    return record


def free_memory() -> None:
    """Collect the models the caller just dropped and give their memory back to the system: before training loads
    two more copies, or before a benchmark starts engine servers beside a trainer that has finished.

    ``gc.collect`` alone frees tensors to glibc's allocator, which can keep freed heap pages resident (4 MB tensors
    freed between kept ones: 1.6 GiB stayed resident until trimmed). A learn_s3 process was OOM-killed with 10.8 GB
    resident when its evaluation started two vLLM servers after six PPO steps; how much of that was freed heap was
    not measured. ``malloc_trim(0)`` returns the freed heap pages (glibc only; a no-op elsewhere)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    malloc_trim()


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    import ctypes

    if sys.platform != "linux":
        return None
    try:  # the running process's own symbols: glibc's when it is linked against glibc
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: give the freed heap back to the system; False where there is no glibc."""
    trim = _libc_malloc_trim()
    return bool(trim(0)) if trim is not None else False


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux ``/proc/self/statm``); None elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def seed_all(seed: int) -> None:
    """Seed Python's and torch's generators."""
    random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover
        pass


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (a ``.partial`` file, then a rename)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------------------------
# Dev evaluation
# ---------------------------------------------------------------------------------------------------------------


def evaluate_dev(
    examples: list[Example],
    llm: LLM,
    retriever: Retriever | None,
    agent: Any,
    out: str | Path | None = None,
    concurrency: int = 64,
    progress: bool = False,
    method: str = "acesearcher",
) -> dict[str, Any]:
    """Run the agent ``method`` (``agent``: its config; decoding greedy by default) on ``examples``; mean EM / F1,
    failed runs, and what over-optimisation shows first: the mean completion tokens of a run and characters of its
    answer, and the share of runs where the lenient parsers fell back (``format_fallback_rate``, the most frequent
    fallbacks in ``fallbacks``). ``out``: also write the traces there (jsonl)."""
    from sleuth.runner import run

    if not examples:
        return {"n": 0, "em": None, "f1": None, "errors": 0}
    ctx = Context(llm=llm, retriever=retriever, config=agent)
    traces = run(method, examples, ctx, concurrency=concurrency, progress=progress, description="dev")
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(t.to_json() + "\n" for t in traces)
    scores = [score_example(t.example, t.answer or "") for t in traces]
    em = [float(s.get("em") or 0.0) for s in scores]
    f1 = [float(s.get("f1") or s.get("em") or 0.0) for s in scores]
    fallbacks: Counter[str] = Counter()
    for trace in traces:
        fallbacks.update({name for step in trace.steps if step.fallback for name in step.fallback.split(",")})
    return {
        "n": len(traces),
        "em": sum(em) / len(em),
        "f1": sum(f1) / len(f1),
        "errors": sum(t.error is not None for t in traces),
        "completion_tokens_mean": sum(t.completion_tokens for t in traces) / len(traces),
        "answer_chars_mean": sum(len(t.answer or "") for t in traces) / len(traces),
        "format_fallback_rate": sum(any(s.fallback for s in t.steps) for t in traces) / len(traces),
        "fallbacks": dict(fallbacks.most_common(10)),
        "per_example_em": em,
        "per_example_f1": f1,
    }


def trim_log(path: Path, through: int, write: bool = True) -> list[dict[str, Any]]:
    """The records of a JSONL step log (``{"step": int, ...}`` per line) up to step ``through``, the last step a
    resumed run keeps (its checkpoint's): a killed run's later steps are trained again and would otherwise appear
    twice in the curve. A line cut off by the kill (or any line that is not such a record) is dropped. ``write``:
    rewrite the file with the kept lines (the writing process only)."""
    if not path.exists():
        return []
    kept: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= through:
            kept.append(record)
    if write:
        path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    return kept
