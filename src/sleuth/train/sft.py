"""Stage I of AceSearcher (digest ``research/acesearcher.md`` §3): supervised fine-tuning of one model on the
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

import ast
import contextlib
import dataclasses
import json
import math
import operator
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from sleuth.agents.acesearcher import (
    AceSearcherConfig,
    decompose_prompt,
    final_prompt,
    is_fact,
    passage_budget,
    pool_passages,
    resolve_references,
    subanswer_prompt,
)
from sleuth.agents.acesearcher_doc import AceSearcherDocConfig, prompt_fields, rank_chunks, with_table_context
from sleuth.agents.base import load_prompt
from sleuth.eval.metrics import claim_label, numbers_match
from sleuth.records import Example, Passage
from sleuth.train.common import HFTrainConfig, peft_lora_config, training_arguments
from sleuth.train.config import ConfigError, load_config, to_mapping

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
# Records and gold data
# ---------------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """An example lacks what a record kind needs; ``reason`` is a short name counted in the data summary."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def make_record(prompt: str, completion: str, source: str, kind: str) -> Record:
    """A chat prompt-completion record (TRL's conversational prompt-completion format) with its provenance: one
    user turn and no system message, as the agent sends its prompts."""
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": completion}],
        "source": source,
        "kind": kind,
    }


def _is_document_task(example: Example) -> bool:
    """Whether the agent for ``example`` is ``acesearcher_doc`` (numeric reasoning over a document, GSM8K)."""
    return example.kind == "math" or example.metadata.get("format") in ("gsm8k", "tatqa", "docmath")


_ARROW = re.compile(r"^(.*?)\s*>>\s*(.+)$")


def _as_question(text: str) -> str:
    """A MuSiQue composition step ``"#1 >> capital"`` as a question (``"What is the capital of #1?"``); other
    steps unchanged. The relation is Wikidata's label, so the wording is templated."""
    text = " ".join(text.split())
    m = _ARROW.match(text)
    if m:
        return f"What is the {m.group(2).strip()} of {m.group(1).strip()}?"
    return text


def _socratic_steps(rationale: str) -> list[tuple[str, str]]:
    """(sub-question, worked answer) pairs of a GSM8K socratic solution (``"Q? ** A"`` lines); [] when not."""
    pairs = []
    for line in rationale.splitlines():
        question, sep, answer = line.partition(" ** ")
        if not sep:
            return []
        pairs.append((question.strip(), answer.strip()))
    return pairs


def _evidence_steps(example: Example) -> list[dict[str, Any]] | None:
    """2Wiki ``evidences`` triples ``[subject, relation, object]`` as steps ``"What is the {relation} of
    {subject}?"`` (answer: the object); a subject that is an earlier step's object becomes ``#k``. The step's
    supporting passage is the context passage titled like its subject (case-insensitive)."""
    evidences = example.metadata.get("evidences")
    if not isinstance(evidences, list) or not evidences:
        return None
    titles = {p.title.casefold(): p.id for p in example.context}
    objects: dict[str, int] = {}
    steps = []
    for k, triple in enumerate(evidences, 1):
        if not (isinstance(triple, list | tuple) and len(triple) == 3 and all(isinstance(t, str) for t in triple)):
            return None
        subject, relation, obj = (t.strip() for t in triple)
        ref = objects.get(subject.casefold())
        steps.append(
            {
                "question": f"What is the {relation} of {f'#{ref}' if ref else subject}?",
                "answer": obj,
                "supporting_ids": [titles[subject.casefold()]] if subject.casefold() in titles else [],
            }
        )
        objects.setdefault(obj.casefold(), k)
    return steps


def gold_steps(example: Example) -> list[dict[str, Any]] | None:
    """The gold decomposition of ``example`` as ``[{"question", "answer", "supporting_ids"}]`` (questions may
    refer to earlier answers as ``#k``), or None: ``Example.decomposition`` (MuSiQue ``>>`` steps turned into
    questions; StrategyQA, Bamboogle, the synthetic world), 2Wiki ``evidences``, GSM8K socratic sub-questions."""
    if example.decomposition:
        return [
            {
                "question": _as_question(str(s.get("question") or "")),
                "answer": None if s.get("answer") is None else str(s["answer"]).strip(),
                "supporting_ids": list(s.get("supporting_ids") or []),
            }
            for s in example.decomposition
        ]
    if example.metadata.get("evidences"):
        return _evidence_steps(example)
    pairs = _socratic_steps(str(example.metadata.get("rationale") or ""))
    if pairs:
        return [{"question": q, "answer": None, "supporting_ids": []} for q, _ in pairs]
    return None


def _checked_steps(example: Example, config: AceSearcherConfig) -> list[dict[str, Any]]:
    steps = gold_steps(example)
    if not steps:
        raise Skip("no_gold_decomposition")
    if any(not s["question"] for s in steps):
        raise Skip("empty_subquestion")
    if len(steps) > config.max_subquestions:
        raise Skip("too_many_subquestions")  # the agent would cut them (max_subquestions)
    return steps


def decomposition_text(questions: Sequence[str]) -> str:
    """The decomposer's output form the agent parses cleanly: ``### Q<k>: <question>`` lines."""
    return "\n".join(f"### Q{k}: {q}" for k, q in enumerate(questions, 1))


def _answer(example: Example, fact: bool) -> str:
    if not example.answers or not str(example.answers[0]).strip():
        raise Skip("no_answer")
    answer = str(example.answers[0]).strip()
    if fact:
        label = claim_label(answer)
        if label is None:
            raise Skip("no_yes_no_label")
        return "Yes" if label == "yes" else "No"
    return answer


def _passage_sets(example: Example, corpus: dict[str, Passage] | None) -> tuple[list[Passage], list[Passage]]:
    """(gold supporting passages, distractors) of an example: from its context, else from ``corpus`` by
    ``supporting_ids`` and ``metadata["distractor_ids"]`` (the synthetic world). With context but no supporting
    ids, every context passage counts as given context (gold)."""
    if example.context:
        wanted = set(example.supporting_ids)
        if not wanted:
            return list(example.context), []
        gold = [p for p in example.context if p.id in wanted]
        return gold, [p for p in example.context if p.id not in wanted]
    if corpus:
        gold = [corpus[i] for i in example.supporting_ids if i in corpus]
        distract = [corpus[i] for i in example.metadata.get("distractor_ids") or [] if i in corpus]
        return gold, distract
    return [], []


def _given(gold: list[Passage], distractors: list[Passage], budget: int, rng: random.Random) -> list[Passage]:
    """Gold passages first, then distractors, up to ``budget``; shuffled so the answer's position varies."""
    chosen = gold[:budget] + rng.sample(distractors, min(len(distractors), max(0, budget - len(gold))))
    rng.shuffle(chosen)
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# Builders: one per record kind, pure (randomness from the rng passed in)
# ---------------------------------------------------------------------------------------------------------------


def context_qa_records(
    example: Example,
    agent: AceSearcherConfig,
    rng: random.Random,
    source: str = "",
    passages: int = 10,
    corpus: dict[str, Passage] | None = None,
    steps: bool = False,
) -> list[Record]:
    """Question + given passages -> short answer (claims: Yes/No), in the agent's sub-question answering prompt.

    ``steps``: also one record per gold sub-question that has a gold answer and a supporting passage, its ``#k``
    replaced by the gold answers (the solver's actual inputs).
    """
    fact = is_fact(example, agent)
    gold, distractors = _passage_sets(example, corpus)
    if not gold:
        raise Skip("no_passages")
    answer = _answer(example, fact)

    def prompt(question: str, shown: list[Passage]) -> str:
        return subanswer_prompt(question, shown, fact, agent.prompts, agent.passage_style, agent.passage_order)

    shown = _given(gold, distractors, passages, rng)
    records = [make_record(prompt(example.question, shown), answer, source, "context_qa")]
    if steps:
        by_id = {p.id: p for p in gold + distractors}
        answers: dict[int, str] = {}
        for k, step in enumerate(gold_steps(example) or [], 1):
            if not step["answer"]:
                break
            answers[k] = step["answer"]
            support = [by_id[i] for i in step["supporting_ids"] if i in by_id]
            if not support:
                continue
            others = [p for p in gold + distractors if p.id not in step["supporting_ids"]]
            shown = _given(support, others, passages, rng)
            resolved = resolve_references(step["question"], answers)
            step_answer = step["answer"]
            if fact:
                label = claim_label(step_answer)
                step_answer = step_answer if label is None else ("Yes" if label == "yes" else "No")
            records.append(make_record(prompt(resolved, shown), step_answer, source, "context_qa"))
    return records


def _doc_fields(example: Example, doc: AceSearcherDocConfig) -> dict[str, str]:
    """The document variant's prompt fields for ``example``, chunks chosen as ``acesearcher_doc`` chooses them
    without a retriever: the whole document up to ``k`` chunks, else its BM25 top-k (GSM8K: no chunks)."""
    document = list(example.context)
    picked = document
    if len(document) > doc.k:
        picked = rank_chunks(example.question, document, doc.k)
        if doc.chunk_order == "document":
            position = {p.id: i for i, p in enumerate(document)}
            picked = sorted(picked, key=lambda p: position.get(p.id, 0))
        if doc.table_context:
            picked = with_table_context(picked, document)
    return prompt_fields(example, picked, doc.passage_style)


def _doc_template(stage: str, doc: AceSearcherDocConfig) -> str:
    if stage == "cot":  # the released code has no CoT prompt: both settings use Fig. 19
        return load_prompt("acesearcher_doc_cot")
    return load_prompt(f"acesearcher_doc_{'code_' if doc.prompts == 'code' else ''}{stage}")


def decompose_records(
    example: Example, agent: AceSearcherConfig, doc: AceSearcherDocConfig, source: str = ""
) -> list[Record]:
    """Question -> ``### Q<k>:`` lines of its gold decomposition, in the decomposition prompt the agent sends
    (QA or claim variant; the document variant's prompt for numeric-reasoning examples)."""
    steps = _checked_steps(example, agent)
    target = decomposition_text([s["question"] for s in steps])
    if _is_document_task(example):
        prompt = _doc_template("decompose", doc).format(**_doc_fields(example, doc)).strip()
    else:
        prompt = decompose_prompt(example.question, is_fact(example, agent), agent.prompts)
    return [make_record(prompt, target, source, "decompose")]


def final_rationale(items: Sequence[tuple[int, str, str]], answer: str, fact: bool) -> str:
    """The templated rationale of a final-answer target: each resolved sub-question and its gold answer, then
    the conclusion and ``<answer>answer</answer>``.

    >>> print(final_rationale([(1, "Who founded Velmo Guild?", "Ann Dask")], "Ann Dask", False))
    Who founded Velmo Guild? Ann Dask. So the answer is Ann Dask.
    <answer>Ann Dask</answer>
    """
    chain = " ".join(f"{q} {a.rstrip('.')}." for _, q, a in items)
    if fact:
        conclusion = "So the claim is supported." if answer == "Yes" else "So the claim is not supported."
    else:
        conclusion = f"So the answer is {answer}."
    return f"{chain} {conclusion}\n<answer>{answer}</answer>".strip()


def final_records(
    example: Example,
    agent: AceSearcherConfig,
    rng: random.Random,
    source: str = "",
    corpus: dict[str, Passage] | None = None,
) -> list[Record]:
    """Question + gold sub-questions/answers + pooled passages -> templated rationale + ``<answer>``.

    The passages of sub-question k are its supporting passages plus distractors, shuffled, ``budget`` of them
    (the agent's ``passage_budget``), pooled with the agent's ``pool_passages``. Claims get no passages (Fig. 17).
    """
    steps = _checked_steps(example, agent)
    if any(not s["answer"] for s in steps):
        raise Skip("no_gold_subanswers")
    fact = is_fact(example, agent)
    answer = _answer(example, fact)
    answers: dict[int, str] = {}
    items: list[tuple[int, str, str]] = []
    for k, step in enumerate(steps, 1):
        items.append((k, resolve_references(step["question"], answers), step["answer"]))
        answers[k] = step["answer"]
    pool: list[Passage] = []
    if not fact:
        gold, distractors = _passage_sets(example, corpus)
        by_id = {p.id: p for p in gold + distractors}
        if not by_id:
            raise Skip("no_passages")
        budget = passage_budget(len(steps), agent.total_passages, agent.budget_rule)
        per_step = []
        for step in steps:
            support = [by_id[i] for i in step["supporting_ids"] if i in by_id]
            others = [p for p in gold + distractors if p.id not in step["supporting_ids"]]
            per_step.append(_given(support, others, budget, rng))
        pool = pool_passages(per_step, budget)
    prompt = final_prompt(example.question, items, pool, fact, agent.prompts, agent.passage_style)
    return [make_record(prompt, final_rationale(items, answer, fact), source, "final")]


def breakdown_text(example: Example) -> str:
    """The breakdown pasted into the CoT/PoT prompts: the gold sub-questions, else the question as Q1."""
    steps = gold_steps(example)
    questions = [s["question"] for s in steps] if steps else [example.question]
    return decomposition_text(questions)


_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def _strip_calculator(text: str) -> str:
    return _CALC.sub("", text)


def cot_records(
    example: Example, doc: AceSearcherDocConfig, source: str = "", answer_format: str = "boxed"
) -> list[Record]:
    """Chain-of-thought target in the document variant's CoT prompt (Fig. 19): the GSM8K rationale (worked
    answers of socratic lines; calculator annotations removed) or the TAT-QA derivation, then the answer in
    ``\\boxed{}`` (``answer_format="answer_tag"``: ``<answer>...</answer>``)."""
    answer = _answer(example, False)
    rationale = str(example.metadata.get("rationale") or "").strip()
    if rationale:
        pairs = _socratic_steps(rationale)
        lines = [a for _, a in pairs] if pairs else rationale.splitlines()
        reasoning = "\n".join(_strip_calculator(line).strip() for line in lines if line.strip())
    elif str(example.metadata.get("derivation") or "").strip():
        scale = str(example.metadata.get("scale") or "").strip()
        reasoning = f"{str(example.metadata['derivation']).strip()} = {answer}{f' ({scale})' if scale else ''}"
    else:
        raise Skip("no_rationale")
    mark = f"<answer>{answer}</answer>" if answer_format == "answer_tag" else f"\\boxed{{{answer}}}"
    breakdown = breakdown_text(example)
    fields = _doc_fields(example, doc)
    prompt = _doc_template("cot", doc).format(**fields, decomposition=breakdown, decompose=breakdown).strip()
    return [make_record(prompt, f"{reasoning}\nThe final answer is {mark}.", source, "cot")]


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arith(expr: str) -> float | None:
    """The value of a plain arithmetic expression (numbers, + - * / // % **, parentheses), or None."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        result = value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    return float(result) if math.isfinite(result) else None


def _python_number(expr: str, percent: bool = True) -> str:
    """A derivation / calculator expression as Python: thousands separators and ``$`` dropped, ``[]`` -> ``()``,
    ``×`` -> ``*``, ``÷`` -> ``/``, and ``x%`` -> ``(x / 100)`` (``percent=False``: the ``%`` sign dropped)."""
    expr = expr.replace("[", "(").replace("]", ")").replace("$", "").replace("×", "*").replace("÷", "/")
    expr = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expr)
    expr = re.sub(r"(\d+(?:\.\d+)?)\s*%", r"(\1 / 100)" if percent else r"\1", expr)
    return " ".join(expr.split())


def _decimals(text: str) -> int | None:
    m = re.fullmatch(r"\s*-?\d+(?:\.(\d+))?\s*", text)
    return None if m is None else len(m.group(1) or "")


def _program_block(lines: Sequence[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```"


def _gsm8k_program(example: Example, answer: str) -> list[str] | None:
    """Assignments from GSM8K's calculator annotations ``<<48/2=24>>``, one per step, ``ans`` the last one;
    None unless every expression evaluates to its stated result and the last one to the gold answer."""
    rationale = str(example.metadata.get("rationale") or "")
    calls = _CALC.findall(rationale)
    if not calls:
        return None
    pairs = _socratic_steps(rationale)
    lines: list[str] = []
    for k, (expr, result) in enumerate(calls, 1):
        code = _python_number(expr)
        got = _arith(code)
        if got is None or not numbers_match(got, result, docmath_rules=False):
            return None
        if len(pairs) == len(calls):
            lines.append(f"# Q{k}: {pairs[k - 1][0]}")
        lines.append(f"step{k} = {code}")
    lines.append(f"ans = step{len(calls)}")
    last = _arith(_python_number(calls[-1][0]))
    return lines if last is not None and numbers_match(last, answer, docmath_rules=False) else None


def _matches(value: float, answer: str, decimals: int | None) -> bool:
    """``value`` is the gold ``answer``: within DocMath's tolerance, or equal once rounded like the gold."""
    if numbers_match(value, answer, docmath_rules=False):
        return True
    return decimals is not None and round(value, decimals) == round(float(answer), decimals)


def _derivation_program(example: Example, answer: str) -> list[str] | None:
    """``ans = <TAT-QA derivation>`` (``%`` read as a unit or as /100, x100 for a percentage the derivation gives
    as a fraction; rounded like the gold answer), or None when no reading evaluates to the gold answer."""
    derivation = str(example.metadata.get("derivation") or "").strip()
    if not derivation:
        return None
    decimals = _decimals(answer)
    scales = (1, 100) if example.metadata.get("scale") == "percent" else (1,)
    for code in dict.fromkeys((_python_number(derivation, percent=False), _python_number(derivation))):
        got = _arith(code)
        if got is None:
            continue
        for scale in scales:
            if _matches(got * scale, answer, decimals):
                expr = code if scale == 1 else f"({code}) * {scale}"
                return [f"ans = round({expr}, {decimals})" if decimals else f"ans = {expr}"]
    return None


def pot_records(example: Example, doc: AceSearcherDocConfig, source: str = "") -> list[Record]:
    """Program-of-thought target in the document variant's PoT prompt (Fig. 18): a fenced Python program that
    stores the answer in ``ans``, from GSM8K calculator annotations or a TAT-QA derivation when they reproduce the
    gold answer, else ``ans = <the answer>`` (a number when it parses as one)."""
    answer = _answer(example, False)
    lines = _gsm8k_program(example, answer) or _derivation_program(example, answer)
    if lines is None:
        decimals = _decimals(answer)
        literal = repr(answer) if decimals is None else str(int(answer)) if decimals == 0 else repr(float(answer))
        lines = [f"ans = {literal}"]
    breakdown = breakdown_text(example)
    fields = _doc_fields(example, doc)
    prompt = _doc_template("pot", doc).format(**fields, decomposition=breakdown, decompose=breakdown).strip()
    return [make_record(prompt, _program_block(lines), source, "pot")]


# ---------------------------------------------------------------------------------------------------------------
# Released AceSearcher SFT data (LLaMA-Factory records)
# ---------------------------------------------------------------------------------------------------------------

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


class _Malformed(ValueError):
    pass


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{what} should be a string, got {type(value).__name__}")
    return value


def _message(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or value.get("role") not in ("system", "user", "assistant"):
        raise _Malformed(f"{what} should be a {{role, content}} message with a system/user/assistant role")
    return {"role": value["role"], "content": _text(value.get("content"), f"{what} content")}


def released_record(data: Any, source: str) -> Record:
    """One released SFT record as a prompt-completion record; raises ValueError naming what is wrong.

    Alpaca (LLaMA-Factory): the user turn is ``instruction`` and ``input`` joined by a newline, the completion
    ``output``; ``system`` and ``history`` (``[[user, assistant], ...]``) become earlier messages. ShareGPT
    ``conversations`` (``from``: human/gpt/system) and ``messages`` (``role``/``content``): the last message must be
    the assistant's and is the completion; earlier messages are the prompt (not trained on). A record already in
    ``prompt``/``completion`` form is taken as it is.
    """
    if not isinstance(data, dict):
        raise _Malformed(f"expected a JSON object, got {type(data).__name__}")
    if "conversations" in data or "messages" in data:
        key = "conversations" if "conversations" in data else "messages"
        turns = data[key]
        if not isinstance(turns, list) or not turns:
            raise _Malformed(f"{key} should be a non-empty list")
        messages = []
        if data.get("system"):
            messages.append({"role": "system", "content": _text(data["system"], "system")})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise _Malformed(f"{key}[{i}] should be an object")
            role = turn.get("from", turn.get("role"))
            content = turn.get("value", turn.get("content"))
            if role not in _ROLES:
                raise _Malformed(f"{key}[{i}]: unsupported role {role!r}")
            messages.append({"role": _ROLES[role], "content": _text(content, f"{key}[{i}] content")})
        if messages[-1]["role"] != "assistant":
            raise _Malformed(f"{key}: the last message is not the assistant's")
        if not messages[-1]["content"].strip():
            raise _Malformed(f"{key}: the assistant's reply is empty")
        if not any(m["role"] == "user" for m in messages[:-1]):
            raise _Malformed(f"{key}: no user message before the reply")
        return {"prompt": messages[:-1], "completion": [messages[-1]], "source": source, "kind": "released"}
    if "instruction" in data or "output" in data:
        instruction = _text(data.get("instruction", ""), "instruction")
        extra = _text(data.get("input") or "", "input")
        output = _text(data.get("output"), "output")
        user = "\n".join(part for part in (instruction, extra) if part)
        if not user.strip():
            raise _Malformed("instruction and input are empty")
        if not output.strip():
            raise _Malformed("output is empty")
        messages = []
        if data.get("system"):
            messages.append({"role": "system", "content": _text(data["system"], "system")})
        for i, pair in enumerate(data.get("history") or []):
            if not (isinstance(pair, list | tuple) and len(pair) == 2):
                raise _Malformed(f"history[{i}] should be a [user, assistant] pair")
            messages.append({"role": "user", "content": _text(pair[0], f"history[{i}][0]")})
            messages.append({"role": "assistant", "content": _text(pair[1], f"history[{i}][1]")})
        messages.append({"role": "user", "content": user})
        completion = [{"role": "assistant", "content": output}]
        return {"prompt": messages, "completion": completion, "source": source, "kind": "released"}
    if "prompt" in data and "completion" in data:
        prompt, completion = data["prompt"], data["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return make_record(prompt, completion, source, "released")
        if isinstance(prompt, list) and isinstance(completion, list) and completion:
            return {
                "prompt": [_message(m, f"prompt[{i}]") for i, m in enumerate(prompt)],
                "completion": [_message(m, f"completion[{i}]") for i, m in enumerate(completion)],
                "source": source,
                "kind": "released",
            }
        raise _Malformed("prompt/completion should be strings or message lists")
    raise _Malformed(f"unknown record shape (keys {sorted(data)[:8]}); expected alpaca, sharegpt or messages")


def _released_rows(path: str, split: str) -> Iterator[tuple[str, Any]]:
    """(where, raw record) of a local file (a JSON array: ``FILE[INDEX]``; else JSON lines: ``FILE:LINE``, a line
    that does not parse yields a :class:`_Malformed`) or of a hub dataset (``NAME[SPLIT][INDEX]``)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            with contextlib.suppress(json.JSONDecodeError):
                rows = json.loads(text)
                if isinstance(rows, list):
                    for i, row in enumerate(rows):
                        yield f"{path}[{i}]", row
                    return
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{lineno}", _Malformed(f"invalid JSON ({exc.msg} at column {exc.colno})")
        return
    if path.endswith((".json", ".jsonl", ".gz")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise FileNotFoundError(f"released SFT data not found: {path} (neither a file nor a hub name like 'org/name')")
    import datasets

    for i, row in enumerate(datasets.load_dataset(path, split=split)):
        yield f"{path}[{split}][{i}]", row


def read_released(
    path: str, split: str = "train", limit: int | None = None, source: str | None = None
) -> tuple[list[Record], list[str], int]:
    """Records of released SFT data, the malformed ones as ``"FILE:LINE: reason"``, and the number read.

    ``path`` is a local ``.json`` (array) / ``.jsonl`` file; when it does not exist and looks like a hub name
    (``AceSearcher/Search-SFT``) the ``split`` is loaded with ``datasets.load_dataset``. ``limit`` counts records
    read, malformed ones included.
    """
    records: list[Record] = []
    malformed: list[str] = []
    read = 0
    label = source or f"{Path(path).stem}:released"
    for where, row in _released_rows(path, split):
        if limit is not None and read >= limit:
            break
        read += 1
        try:
            if isinstance(row, _Malformed):
                raise row
            records.append(released_record(row, label))
        except _Malformed as exc:
            malformed.append(f"{where}: {exc}")
    return records, malformed, read


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
    return SFTTrainer(
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
    trainer.train(resume_from_checkpoint=resume)
    save_final(trainer, config)
    return out


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> Path:
    """``sleuth train sft --config CFG [--set key=value ...]``: load the config and run :func:`train_sft`.

    ``overrides`` is a mapping or ``"key=value"`` strings (dotted keys reach nested options: ``agent.prompts=code``;
    old option names such as ``lr`` or ``lora.r`` are still read, with a warning).
    """
    return train_sft(load_sft_config(config_path, overrides))
