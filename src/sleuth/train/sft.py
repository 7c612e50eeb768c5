"""Stage I of AceSearcher (paper §3.2, App. F; docs/training.md, "SFT"): supervised fine-tuning of one model on the
three competencies the agent uses, with the agent's own prompts.

Every training record is a chat prompt-completion pair whose prompt is *exactly* what the agent sends at inference
(:func:`~sleuth.agents.acesearcher.decompose_prompt`, :func:`~sleuth.agents.acesearcher.subanswer_prompt`,
:func:`~sleuth.agents.acesearcher.final_prompt` and the document variant's prompt files, with the same passage
formatting), so ``sleuth ask --method acesearcher --llm hf:OUTDIR`` uses the trained model unchanged:

``context_qa``
    question + given passages (gold supporting passages first, then distractors up to ``context_passages``, shuffled
    with the seed) -> short answer (claims: Yes/No), in the sub-question answering prompt: what the solver does for
    each sub-question. ``steps: true`` adds one record per gold sub-question with a gold answer (MuSiQue, synth,
    2Wiki), its ``#k`` references replaced by the gold answers, over that step's supporting passages.
``decompose``
    question -> ``### Q1: ...`` lines from a gold decomposition (MuSiQue ``question_decomposition``, with its
    ``X >> relation`` steps turned into questions; 2Wiki ``evidences`` triples; StrategyQA; Bamboogle ``Qk``; the
    synthetic world; GSM8K socratic sub-questions) in the decomposition prompt (QA or claim variant as the agent
    picks it; the document variant's prompt for GSM8K / TAT-QA / DocMath).
``final``
    question + gold sub-question/answer pairs + the pooled passages the agent would show -> a rationale and
    ``<answer>...</answer>``. The rationale is a *template* chaining the gold sub-answers ("Who founded X? Ann.
    Where was Ann born? Pella. So the answer is Pella."); no dataset has written rationales.
``cot`` / ``pot``
    The document variant's chain-of-thought (paper Fig. 19) and program-of-thought (Fig. 18) prompts with a
    breakdown (the gold socratic sub-questions, else the question as the one sub-question): GSM8K rationales
    (calculator annotations removed) and TAT-QA derivations as CoT; programs from GSM8K's calculator annotations and
    TAT-QA derivations (checked against the gold answer) as PoT, else a program that sets ``ans`` to the answer.
``released``
    The released AceSearcher SFT data (HF ``AceSearcher/Search-SFT``, LLaMA-Factory records: alpaca
    ``{instruction, input, output, system?, history?}``, sharegpt ``{conversations: [{from, value}]}``, or
    ``{messages: [{role, content}]}``) from a local json/jsonl file, or from the hub through
    ``datasets.load_dataset`` when the path does not exist.

The record builders and the released-data reader live in :mod:`sleuth.train.sft_records` (re-exported here); this
module holds the config, the mixture and the training.

Records that cannot be built are never dropped silently: released records that do not parse are *malformed*
(reported ``FILE:LINE: reason``), benchmark examples that lack what a kind needs are *skipped* with the reason and
example ids; both go to ``OUTPUT_DIR/data_summary.json`` and are printed. A malformed benchmark file raises
:class:`~sleuth.data.DatasetError` naming ``FILE:LINE`` (the benchmark loaders are strict).

Training (:func:`train_sft`) is TRL's ``SFTTrainer`` on the prompt-completion records, so the loss covers the
assistant completion only; full or LoRA fine-tuning; checkpoints every ``save_steps`` and automatic resumption
from the last ``OUTPUT_DIR/checkpoint-*``; metrics to ``OUTPUT_DIR/log.jsonl``; the final model and tokenizer in
``OUTPUT_DIR`` (LoRA merged unless ``lora_save: adapter``). ``accelerate launch`` works unchanged: every process
builds the same data from the seed, only the main process writes files.

>>> config = load_sft_config("configs/sft_synth.yaml", {"max_steps": "20"})  # doctest: +SKIP
>>> train_sft(config)  # doctest: +SKIP
PosixPath('runs/sft-synth')
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from sleuth.agents.acesearcher import (
    AceSearcherConfig,
)
from sleuth.agents.acesearcher_doc import AceSearcherDocConfig
from sleuth.records import Passage
from sleuth.train.common import HFTrainConfig, peft_lora_config, training_arguments, trim_log
from sleuth.train.config import ConfigError, load_config, to_mapping
from sleuth.train.sft_records import (
    Skip,
    breakdown_text,
    context_qa_records,
    cot_records,
    decompose_records,
    decomposition_text,
    final_rationale,
    final_records,
    gold_steps,
    make_record,
    pot_records,
    read_released,
    released_record,
)

__all__ = [
    "KINDS",
    "SFTConfig",
    "SFTSource",
    "Skip",
    "SourceReport",
    "breakdown_text",
    "build_dataset",
    "build_source",
    "build_trainer",
    "context_qa_records",
    "cot_records",
    "decompose_records",
    "decomposition_text",
    "ensure_synth",
    "final_rationale",
    "final_records",
    "gold_steps",
    "last_checkpoint",
    "load_sft_config",
    "main",
    "make_record",
    "mix_counts",
    "pot_records",
    "print_summary",
    "read_released",
    "released_record",
    "save_final",
    "train_sft",
]

KINDS: tuple[str, ...] = ("context_qa", "decompose", "final", "cot", "pot", "released")
Record = dict[str, Any]
SUMMARY_FILE = "data_summary.json"
LOG_FILE = "log.jsonl"
CONFIG_FILE = "sft_config.json"
SAMPLE_FILE = "data_sample.jsonl"
_MAX_LISTED = 20  # malformed records / skipped ids listed per source in the summary (all are counted)


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SFTSource:
    """One input of the SFT mixture.

    ``path``: a dataset file (any ``sleuth.data`` format), or for ``kind: released`` a json/jsonl file or a hub
    dataset name. ``format``: the dataset format (None: detected from the file). ``kind``: one of :data:`KINDS`.
    ``limit``: examples (records) read from the start of the file. ``weight``: mixing weight (see
    :attr:`SFTConfig.num_examples`). ``name``: the label in the summary (default ``"<file stem>:<kind>"``).
    ``split``: the hub split for released data. ``corpus``: a corpus file giving the passages of examples that come
    without context (default for synthetic-world splits: ``corpus.jsonl`` beside the file). ``steps``:
    ``context_qa`` also emits one record per gold sub-question. ``synth``: when ``path`` does not exist, build the
    synthetic world in its directory first with :func:`sleuth.data.synth.synthesize` and these knobs (``{seed: 0}``).
    """

    path: str = ""
    format: str | None = None
    kind: str = "context_qa"
    limit: int | None = None
    weight: float = 1.0
    name: str | None = None
    split: str = "train"
    corpus: str | None = None
    steps: bool = False
    synth: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """The source's name in records and the summary: ``name``, else ``"<folder>/<file stem>:<kind>"``."""
        if self.name:
            return self.name
        path = Path(self.path)
        return f"{path.parent.name}/{path.stem}:{self.kind}" if path.parent.name else f"{path.stem}:{self.kind}"


@dataclass
class SFTConfig(HFTrainConfig):
    """Options of ``sleuth train sft``; defaults follow the paper (§3.2, App. F) where it states them.

    Data:

    * ``sources``: the inputs (:class:`SFTSource` mappings in the YAML file).
    * ``num_examples``: total training records after mixing, shared among sources in proportion to their weights
      (largest-remainder rounding; a source smaller than its share is repeated, shuffled). None: each source
      contributes ``round(weight * its records)`` (weight 1 = all of them once). The paper's mixture is 180,600
      records (Table 5).
    * ``val_fraction``: records of each source held out for evaluation before mixing (the released configs'
      ``val_size: 0.03``; the paper states none). ``eval_steps``: evaluate every this many steps (None: at
      ``save_steps``).
    * ``context_passages``: passages shown with a context-QA question (the agent retrieves k=10 per sub-question).
    * ``cot_answer``: how CoT targets mark the answer: ``"boxed"`` (``\\boxed{}``, what the Fig. 19 prompt asks and
      the agent reads) or ``"answer_tag"`` (``<answer>...</answer>``, the released RFT CoT targets, §2.2g).
    * ``agent`` / ``doc_agent``: the agent configs whose prompts the records use (prompt wording ``paper``/``code``,
      passage style and order, final-passage budget, chunk selection): train with the options you will run.

    Optimisation (paper §5.1, App. F.1-F.2):

    * ``learning_rate`` 5e-6: the paper's full fine-tuning rate for the 1.5B model (1e-6 for 8B/14B, 1e-5 for 32B
      LoRA; the released configs use 1e-6 / 2e-6 / 1e-6 / 4e-5).
    * ``batch_size`` 64: the global batch. ``gradient_accumulation_steps`` None derives it as
      ``batch_size / (per_device_batch_size * processes)`` (rounded up); a number overrides it.
    * ``epochs`` 1, ``warmup_ratio`` 0.05, AdamW ``adam_beta1`` 0.9 / ``adam_beta2`` 0.98 (paper);
      ``lr_scheduler`` cosine (the released configs; the paper names none). ``max_steps`` > 0 overrides epochs.
    * ``max_length`` 2048 (§5.1; App. F.1 says 2560, the released configs cut at 2304): longer records are
      truncated at the end, and records left with no completion token are dropped by TRL (counted in the summary).
    * ``bf16``: None = on when the GPU supports it. ``dtype``: the weights' dtype when loaded (float32 master
      weights with bf16 autocast by default). ``gradient_checkpointing`` saves memory at some speed cost.
    * ``save_steps`` / ``save_total_limit``: checkpoints ``OUTPUT_DIR/checkpoint-N``; ``resume`` continues from
      the last one.
    * ``lora``: LoRA (paper, AceSearcher-32B: ``lora_r`` 8, ``lora_alpha`` 16; the released 32B config uses rank
      16 on all linear layers; dropout is not stated, LLaMA-Factory's default is 0). ``lora_save``: ``"merged"``
      writes the merged full model (loadable by ``hf:OUTDIR`` anywhere); ``"adapter"`` writes the adapter only
      (``hf:OUTDIR`` then needs PEFT and the base model at its recorded path).

    The shared options (and their old spellings, still read with a warning: ``lr``, ``use_lora``, ``lora.r``, ...)
    are :class:`~sleuth.train.common.HFTrainConfig`'s.
    """

    renamed: ClassVar[dict[str, str]] = {
        "lr": "learning_rate",
        "use_lora": "lora",
        "lora.r": "lora_r",
        "lora.alpha": "lora_alpha",
        "lora.dropout": "lora_dropout",
        "lora.target_modules": "lora_target",
        "lora.save": "lora_save",
    }

    model: str = "default"  # a local model directory or hub name; "default" is the embedded SmolLM2
    output_dir: str = "runs/sft"
    sources: list[SFTSource] = field(default_factory=list)
    num_examples: int | None = None
    val_fraction: float = 0.03
    eval_steps: int | None = None
    context_passages: int = 10
    cot_answer: Literal["boxed", "answer_tag"] = "boxed"
    max_length: int = 2048
    learning_rate: float = 5e-6
    per_device_batch_size: int = 4
    gradient_accumulation_steps: int | None = None
    lr_scheduler: str = "cosine"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    seed: int = 42
    save_steps: int = 500
    save_total_limit: int | None = 2
    logging_steps: int = 10
    resume: bool = True
    lora_save: str = "merged"
    dtype: str = "float32"
    gradient_checkpointing: bool = True
    agent: AceSearcherConfig = field(default_factory=AceSearcherConfig)
    doc_agent: AceSearcherDocConfig = field(default_factory=AceSearcherDocConfig)

    def validate(self) -> SFTConfig:
        """Check the options and turn ``sources`` mappings (from YAML) into :class:`SFTSource`; returns self."""
        sources = []
        known = {f.name for f in dataclasses.fields(SFTSource)}
        for i, item in enumerate(self.sources):
            if isinstance(item, dict):
                unknown = sorted(set(item) - known)
                if unknown:
                    raise ConfigError(f"sources[{i}]: unknown key(s) {unknown}; known: {sorted(known)}")
                item = SFTSource(**item)
            if not isinstance(item, SFTSource):
                raise ConfigError(f"sources[{i}]: expected a mapping, got {type(item).__name__}")
            if item.kind not in KINDS:
                raise ConfigError(f"sources[{i}]: kind {item.kind!r}; expected one of {KINDS}")
            if not item.path:
                raise ConfigError(f"sources[{i}]: path is required")
            if item.weight < 0 or (item.limit is not None and item.limit < 0):
                raise ConfigError(f"sources[{i}]: weight and limit must be >= 0")
            sources.append(item)
        self.sources = sources
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.cot_answer not in ("boxed", "answer_tag"):
            raise ConfigError(f"cot_answer {self.cot_answer!r}; expected 'boxed' or 'answer_tag'")
        if self.lora_save not in ("merged", "adapter"):
            raise ConfigError(f"lora_save {self.lora_save!r}; expected 'merged' or 'adapter'")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        for name in ("batch_size", "per_device_batch_size", "save_steps", "logging_steps", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.num_examples is not None and self.num_examples < 0:
            raise ConfigError("num_examples must be >= 0")
        try:
            self.agent.validate()
            self.doc_agent.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self

    def model_path(self) -> str:
        """The model to fine-tune: ``"default"`` is the embedded SmolLM2 (``sleuth assets fetch``)."""
        if self.model in ("", "default"):
            from sleuth.assets import default_model_dir

            return str(default_model_dir())
        return self.model


def load_sft_config(path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> SFTConfig:
    """Read a YAML/JSON config file (unknown keys are errors), apply ``--set`` overrides, validate."""
    return load_config(SFTConfig, path, overrides).validate()


# ---------------------------------------------------------------------------------------------------------------
# The mixture
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SourceReport:
    """What one source gave: examples (records) read, records built, skips by reason (with a few example ids),
    malformed records (``FILE:LINE: reason``), then the validation / training records taken from it."""

    name: str
    kind: str
    path: str
    read: int = 0
    built: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_ids: dict[str, list[str]] = field(default_factory=dict)
    malformed: int = 0
    malformed_records: list[str] = field(default_factory=list)
    val: int = 0
    selected: int = 0

    def skip(self, reason: str, example_id: str) -> None:
        self.skipped[reason] += 1
        ids = self.skipped_ids.setdefault(reason, [])
        if len(ids) < 5:
            ids.append(example_id)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["skipped"] = dict(self.skipped)
        return data


def mix_counts(sizes: Sequence[int], weights: Sequence[float], total: int | None) -> list[int]:
    """Records taken from each source: ``round(weight * size)`` without a ``total``; with one, ``total`` shared
    in proportion to the weights of the non-empty sources (largest remainders get the rounding).

    >>> mix_counts([100, 10], [1.0, 2.0], None), mix_counts([100, 10], [3, 1], 10), mix_counts([5, 0], [1, 1], 4)
    ([100, 20], [8, 2], [4, 0])
    """
    if total is None:
        return [int(round(w * n)) for n, w in zip(sizes, weights, strict=True)]
    live = [w if n > 0 else 0.0 for n, w in zip(sizes, weights, strict=True)]
    norm = sum(live)
    if norm <= 0:
        return [0 for _ in sizes]
    exact = [total * w / norm for w in live]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _take(pool: list[Record], count: int, rng: random.Random) -> list[Record]:
    """``count`` records of ``pool``: whole shuffled copies while ``count`` exceeds it, then a sample."""
    if not pool or count <= 0:
        return []
    full, rest = divmod(count, len(pool))
    out: list[Record] = []
    for _ in range(full):
        out.extend(rng.sample(pool, len(pool)))
    return out + rng.sample(pool, rest)


def _read_corpus(path: str) -> dict[str, Passage]:
    from sleuth.corpus import read_corpus

    return {p.id: p for p in read_corpus(path)}


def _corpus_path(source: SFTSource) -> str | None:
    if source.corpus:
        return source.corpus
    beside = Path(source.path).parent / "corpus.jsonl"
    if (source.format == "synth" or (Path(source.path).parent / "world.json").exists()) and beside.exists():
        return str(beside)
    return None


def _rank() -> int:
    """This process's rank under ``torchrun`` / ``accelerate launch`` (they set ``RANK``); 0 when alone."""
    return int(os.environ.get("RANK", "0") or 0)


def _world_size() -> int:
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def ensure_synth(source: SFTSource, wait_s: float = 1800.0) -> None:
    """Build the synthetic world a source names when its file is missing and ``synth`` knobs are given. Under
    several processes the main one builds it and the others wait for its ``world.json`` (written last)."""
    if source.synth is None or Path(source.path).exists():
        return
    from sleuth.data.synth import synthesize

    folder = Path(source.path).parent
    if _rank() == 0:
        synthesize(folder, **source.synth)
    else:
        deadline = time.monotonic() + wait_s
        while not (folder / "world.json").exists() and time.monotonic() < deadline:
            time.sleep(1.0)
    if not Path(source.path).exists():
        raise FileNotFoundError(f"{source.path}: not among the files of the synthetic world built for it")


def build_source(source: SFTSource, config: SFTConfig) -> tuple[list[Record], SourceReport]:
    """All records one source gives, and its report."""
    label = source.label
    report = SourceReport(name=label, kind=source.kind, path=source.path)
    if source.kind == "released":
        records, malformed, read = read_released(source.path, source.split, source.limit, label)
        report.read, report.built = read, len(records)
        report.malformed, report.malformed_records = len(malformed), malformed[:_MAX_LISTED]
        return records, report
    from sleuth.data import iter_examples

    ensure_synth(source)
    corpus_path = _corpus_path(source) if source.kind in ("context_qa", "final") else None
    corpus: dict[str, Passage] | None = None
    records: list[Record] = []
    for example in iter_examples(source.path, format=source.format, limit=source.limit):
        report.read += 1
        if corpus is None and corpus_path and not example.context:
            corpus = _read_corpus(corpus_path)
        rng = random.Random(f"{config.seed}:{label}:{example.id}")
        try:
            if source.kind == "context_qa":
                built = context_qa_records(
                    example, config.agent, rng, label, config.context_passages, corpus, source.steps
                )
            elif source.kind == "decompose":
                built = decompose_records(example, config.agent, config.doc_agent, label)
            elif source.kind == "final":
                built = final_records(example, config.agent, rng, label, corpus)
            elif source.kind == "cot":
                built = cot_records(example, config.doc_agent, label, config.cot_answer)
            else:
                built = pot_records(example, config.doc_agent, label)
        except Skip as skip:
            report.skip(skip.reason, example.id)
            continue
        records.extend(built)
    report.built = len(records)
    return records, report


def build_dataset(config: SFTConfig) -> tuple[list[Record], list[Record], dict[str, Any]]:
    """(train records, validation records, summary) for ``config``: every source built, ``val_fraction`` of
    each held out, the rest mixed by weight (seeded) and shuffled."""
    config.validate()
    pools: list[list[Record]] = []
    reports: list[SourceReport] = []
    val: list[Record] = []
    for i, source in enumerate(config.sources):
        records, report = build_source(source, config)
        rng = random.Random(f"{config.seed}:split:{i}")
        records = rng.sample(records, len(records))
        n_val = int(round(config.val_fraction * len(records)))
        if config.val_fraction > 0 and n_val == 0 and len(records) >= 2:
            n_val = 1
        val.extend(records[:n_val])
        pools.append(records[n_val:])
        report.val = n_val
        reports.append(report)
    counts = mix_counts([len(p) for p in pools], [s.weight for s in config.sources], config.num_examples)
    train: list[Record] = []
    for i, (pool, count) in enumerate(zip(pools, counts, strict=True)):
        taken = _take(pool, count, random.Random(f"{config.seed}:mix:{i}"))
        reports[i].selected = len(taken)
        train.extend(taken)
    random.Random(f"{config.seed}:shuffle").shuffle(train)
    summary = {
        "sources": [r.to_dict() for r in reports],
        "train": len(train),
        "val": len(val),
        "train_by_kind": dict(Counter(r["kind"] for r in train)),
        "val_by_kind": dict(Counter(r["kind"] for r in val)),
        "malformed": sum(r.malformed for r in reports),
        "skipped": sum(sum(r.skipped.values()) for r in reports),
    }
    return train, val, summary


def print_summary(summary: dict[str, Any]) -> None:
    """The data summary as a table: per source read / built / skipped / malformed / val / train records."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SFT data", show_lines=False)
    table.add_column("source", overflow="fold")
    table.add_column("kind")
    for column in ("read", "built", "skipped", "malformed", "val", "train"):
        table.add_column(column, justify="right")
    for s in summary["sources"]:
        counts = (s["read"], s["built"], sum(s["skipped"].values()), s["malformed"], s["val"], s["selected"])
        table.add_row(s["name"], s["kind"], *(str(c) for c in counts))
    console = Console(stderr=True)
    console.print(table)
    for s in summary["sources"]:
        for reason, count in s["skipped"].items():
            console.print(f"[dim]{s['name']}: skipped {count} ({reason}), e.g. {', '.join(s['skipped_ids'][reason])}")
        for line in s["malformed_records"]:
            console.print(f"[yellow]{s['name']}: malformed {line}")
        if s["malformed"] > len(s["malformed_records"]):
            console.print(f"[yellow]{s['name']}: ... {s['malformed'] - len(s['malformed_records'])} more malformed")
    if summary.get("dropped_by_length"):
        console.print(f"[yellow]{summary['dropped_by_length']} record(s) dropped: no completion within max_length")


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def _accumulation(config: SFTConfig) -> int:
    if config.gradient_accumulation_steps is not None:
        return max(1, config.gradient_accumulation_steps)
    return max(1, math.ceil(config.batch_size / (config.per_device_batch_size * _world_size())))


def _bf16(config: SFTConfig) -> bool:
    if config.bf16 is not None:
        return config.bf16
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _log_callback(path: Path) -> Any:
    """A TrainerCallback appending every logged metrics dict (train loss per logging step, eval loss, the final
    summary) as one JSON line ``{"step", "epoch", ...}`` to ``path``, from the main process only."""
    from transformers import TrainerCallback

    class JsonlLog(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if not state.is_world_process_zero or not logs:
                return
            entry = {"step": state.global_step, "epoch": state.epoch, **logs}
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, default=float) + "\n")

    return JsonlLog()


def last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` directory in ``output_dir`` (one with its trainer state), or None."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for path in root.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if m and path.is_dir() and (path / "trainer_state.json").exists():
            found.append((int(m.group(1)), path))
    return str(max(found)[1]) if found else None


def build_trainer(
    config: SFTConfig,
    train: list[Record],
    val: list[Record] | None = None,
    callbacks: Sequence[Any] = (),
) -> Any:
    """TRL's ``SFTTrainer`` for ``config`` on prompt-completion records (loss on the completion tokens only).

    The records' ``source``/``kind`` fields stay out of the datasets. The tokenizer is the model's, its pad token
    set to EOS when it has none; the model must have a chat template (the agent sends chat messages).
    """
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    from sleuth.train.tracking import hf_reporting

    if not train:
        raise ValueError("no training records: check the sources (see the data summary)")
    model_path = config.model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not tokenizer.chat_template:
        raise ValueError(f"{model_path} has no chat template; the agent's prompts are chat messages")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def dataset(records: list[Record]) -> Any:
        return Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in records])

    eval_set = dataset(val) if val else None
    # the curves: TensorBoard events in OUTPUT_DIR/tb (train/loss, train/learning_rate, eval/loss, ...)
    report_to, reporting = hf_reporting(config.report_to, config.output_dir)
    args = TRLConfig(
        **training_arguments(
            config,
            config.output_dir,
            per_device_eval_batch_size=config.per_device_batch_size,
            gradient_accumulation_steps=_accumulation(config),
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            save_total_limit=config.save_total_limit,
            logging_steps=config.logging_steps,
            eval_strategy="steps" if eval_set is not None else "no",
            eval_steps=config.eval_steps or config.save_steps,
            bf16=_bf16(config),
            fp16=False,
            gradient_checkpointing=config.gradient_checkpointing,
            max_length=config.max_length,
            completion_only_loss=True,
            packing=False,
            model_init_kwargs={"dtype": config.dtype},
            report_to=report_to,
        )
    )
    peft_config = peft_lora_config(config) if config.lora else None
    from sleuth.train.packing import length_sorted_trainer

    trainer_class = length_sorted_trainer(SFTTrainer) if config.length_sorted else SFTTrainer
    return trainer_class(
        model=model_path,
        args=args,
        train_dataset=dataset(train),
        eval_dataset=eval_set,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[*reporting, *callbacks],
    )


def save_final(trainer: Any, config: SFTConfig) -> None:
    """The trained model and tokenizer into ``output_dir``: the full model, the merged LoRA model, or the LoRA
    adapter alone (``lora_save: adapter``). Merging runs on the main process (not for ZeRO-3/FSDP-sharded runs:
    save the adapter there and merge afterwards)."""
    out = config.output_dir
    trainer.accelerator.wait_for_everyone()
    if config.lora and config.lora_save == "merged":
        if trainer.args.should_save:
            model = trainer.accelerator.unwrap_model(trainer.model)
            merged = model.merge_and_unload()
            merged.save_pretrained(out)
    else:
        trainer.save_model(out)
    if trainer.args.should_save:
        trainer.processing_class.save_pretrained(out)
    trainer.accelerator.wait_for_everyone()


def train_sft(config: SFTConfig, callbacks: Sequence[Any] = ()) -> Path:
    """Build the data, fine-tune, save; returns ``output_dir``.

    Resumes from the last checkpoint in ``output_dir`` when ``config.resume`` (a killed run continues at its step
    count with the same data order, rebuilt from the seed). Writes ``data_summary.json``, ``data_sample.jsonl``
    (the first records, to inspect the prompts), ``sft_config.json`` and ``log.jsonl`` (main process only).
    ``callbacks`` are extra ``TrainerCallback`` objects.
    """
    config.validate()
    out = Path(config.output_dir)
    train, val, summary = build_dataset(config)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / CONFIG_FILE, to_mapping(config))
        with open(out / SAMPLE_FILE, "w", encoding="utf-8") as f:
            for record in train[:20]:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    trainer = build_trainer(config, train, val, [_log_callback(out / LOG_FILE), *callbacks])
    summary["dropped_by_length"] = len(train) - len(trainer.train_dataset)
    summary["gradient_accumulation_steps"] = trainer.args.gradient_accumulation_steps
    summary["global_batch_size"] = (
        trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps * _world_size()
    )
    if trainer.is_world_process_zero():
        _write_json(out / SUMMARY_FILE, summary)
        print_summary(summary)
    resume = last_checkpoint(out) if config.resume else None
    if trainer.is_world_process_zero():
        trim_log(out / LOG_FILE, int(Path(resume).name.rpartition("-")[2]) if resume else 0)
    trainer.train(resume_from_checkpoint=resume)
    save_final(trainer, config)
    return out


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> Path:
    """``sleuth train sft --config CFG [--set key=value ...]``: load the config and run :func:`train_sft`.

    ``overrides`` is a mapping or ``"key=value"`` strings (dotted keys reach nested options: ``agent.prompts=code``;
    old option names such as ``lr`` or ``lora.r`` are still read, with a warning).
    """
    return train_sft(load_sft_config(config_path, overrides))
