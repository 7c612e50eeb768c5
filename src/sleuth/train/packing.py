"""Length-aware micro-batching: less padding, the same loss.

A batch of causal-LM sequences padded on the right to its longest row computes exactly what each row alone computes
(a token attends only to earlier tokens of its own row; padding is masked out of the attention and of the loss), but
every padding position costs a full forward and backward. Grouping rows of similar length wastes less, and it changes
nothing as long as the loss of an optimizer step does not depend on which rows share a micro-batch:

- :func:`micro_batches` plans the RL update's micro-batches (``RLConfig.micro_batch_tokens``): the rows of a mini-batch
  sorted by length, cut so that ``rows x longest row <= budget`` and ``rows <= micro_batch`` (veRL's
  ``use_dynamic_bsz``, OpenRLHF's token-budget batching, without packing several rows into one). Exact with
  ``micro_batch_aggregation: mini_batch_mean`` (each micro-batch weighted by its share of the mini-batch's tokens or
  sequences: the sum is one mean over the mini-batch, whatever the grouping); with ``micro_batch_mean`` (the mean of
  the micro-batches' means) the grouping is part of the weighting by definition, so the trainer keeps fixed rows there
  unless asked.
- :class:`LengthSortedSampler` orders a Hugging Face Trainer's training set for SFT, DPO and the ExSearch M-step:
  one seeded permutation cut into optimizer-step windows (``per_device x accumulation x processes`` examples), each
  window sorted by length, so that an optimizer step sees the same examples as it would in random order and only
  their split into (equal-sized) micro-batches changes. Exact where the step's loss is a token mean over the whole
  window (TRL SFT's ``num_items_in_batch`` normalisation) or a mean over equal-sized micro-batches of per-example
  means (DPO's sigmoid loss, the M-step's weighted NLL except ``reference_nll_share``); HF's ``group_by_length``
  instead sorts megabatches of 50 windows, which also changes which examples share a step.

True packing (several sequences in one row with restarting position ids, TRL's ``padding_free``) is not used. TRL
1.16 documents it for FlashAttention 2/3 only (and disables it in its DPOTrainer); with ``sdpa``, transformers 5's
mask code does detect the restarts (``find_packed_sequence_indices``) and builds a block-diagonal causal mask, which
is exact, but the dense kernel then computes attention over ``(sum of lengths)^2`` positions instead of
``sum(length^2)``: for 4 sequences of 128-1024 tokens that is ~2-3x the attention FLOPs, more than the padding left
after sorting saves (docs/results/bench_train.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "LengthSortedSampler",
    "DEFAULT_MICRO_BATCH_TOKENS",
    "example_lengths",
    "length_sorted_order",
    "length_sorted_trainer",
    "micro_batch_budget",
    "micro_batches",
    "padding_waste",
    "token_budget_groups",
]

# the RL update's token budget when none is set: about the old default's 4 rows of 1024 tokens
DEFAULT_MICRO_BATCH_TOKENS = 4096

T = TypeVar("T")


def token_budget_groups(lengths: Sequence[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices into ``lengths``, longest first, cut into groups whose ``rows x longest row`` is at most ``budget``
    and, with ``max_rows``, of at most that many rows (a row longer than the budget goes alone). Sorted, each
    group's rows are as close in length as greedy cutting can make them: the padding left is that between
    neighbours in the sorted order."""
    if budget < 1:
        raise ValueError("budget must be >= 1 token")
    if max_rows is not None and max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # the first row of a group is its longest: rows x that length bounds the padded size
        if (
            groups
            and (max_rows is None or len(groups[-1]) < max_rows)
            and (len(groups[-1]) + 1) * max(lengths[groups[-1][0]], 1) <= budget
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def micro_batch_budget(micro_batch_tokens: int | None, aggregation: str) -> int:
    """The token budget the RL update uses: ``micro_batch_tokens`` when set (0: fixed rows); None (the default),
    :data:`DEFAULT_MICRO_BATCH_TOKENS` with ``mini_batch_mean``, where grouping cannot change the loss, and fixed
    rows with ``micro_batch_mean``, where it would (each micro-batch's mean weighs the same)."""
    if micro_batch_tokens is not None:
        if micro_batch_tokens < 0:
            raise ValueError("micro_batch_tokens must be >= 0 (0: fixed micro_batch rows; null: automatic)")
        return micro_batch_tokens
    return DEFAULT_MICRO_BATCH_TOKENS if aggregation == "mini_batch_mean" else 0


def micro_batches(items: Sequence[T], lengths: Sequence[int], rows: int, budget: int = 0) -> list[list[T]]:
    """The micro-batches of ``items`` (``lengths[i]`` tokens each): ``budget`` > 0, :func:`token_budget_groups`
    with at most ``rows`` rows each (both bound the memory: a run that lowered ``micro_batch`` to fit keeps
    fitting); 0, consecutive runs of ``rows`` items in their given order (the fixed-rows path)."""
    if len(items) != len(lengths):
        raise ValueError("items and lengths differ in length")
    if rows < 1:
        raise ValueError("rows must be >= 1")
    if budget > 0:
        return [[items[i] for i in group] for group in token_budget_groups(lengths, budget, rows)]
    return [list(items[i : i + rows]) for i in range(0, len(items), rows)]


def padding_waste(groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(useful, padded)`` tokens of micro-batches given as their rows' lengths, each padded to its longest."""
    useful = sum(sum(g) for g in groups)
    padded = sum(len(g) * max(g, default=0) for g in groups)
    return useful, padded


def length_sorted_order(lengths: Sequence[int], window: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(len(lengths))`` whose consecutive ``window``-sized slices are each sorted by
    length, longest first (the last slice may be shorter): the slices hold the examples a random order would put
    in one optimizer step, arranged for little padding."""
    if window < 1:
        raise ValueError("window must be >= 1")
    g = torch.Generator()
    g.manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    out: list[int] = []
    for start in range(0, len(order), window):
        out.extend(sorted(order[start : start + window], key=lambda i: (-lengths[i], i)))
    return out


class LengthSortedSampler(torch.utils.data.Sampler[int]):
    """A training sampler giving :func:`length_sorted_order` of ``lengths``, a new permutation every epoch (seed
    ``seed + epoch``; the Trainer's ``set_epoch`` or, without it, one epoch per iteration)."""

    def __init__(self, lengths: Sequence[int], window: int, seed: int = 0) -> None:
        self.lengths = list(lengths)
        self.window = window
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = length_sorted_order(self.lengths, self.window, self.seed + self.epoch)
        self.epoch += 1
        return iter(order)


def example_lengths(dataset: Any) -> list[int]:
    """Padded length of each tokenised example of a Hugging Face dataset: ``input_ids`` (SFT, the ExSearch M-step)
    or ``prompt_ids`` + the longer of ``chosen_ids`` / ``rejected_ids`` (TRL's DPO collator pads both to one
    width)."""
    columns = set(dataset.column_names)
    if "input_ids" in columns:
        return [len(ids) for ids in dataset["input_ids"]]
    if {"prompt_ids", "chosen_ids", "rejected_ids"} <= columns:
        return [
            len(p) + max(len(c), len(r))
            for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
        ]
    raise ValueError(f"no token ids to measure in columns {sorted(columns)}")


def length_sorted_trainer(base: type) -> type:
    """``base`` (a transformers ``Trainer`` subclass) whose training sampler is :class:`LengthSortedSampler` over
    optimizer-step windows (``per_device x accumulation x processes``); evaluation is unchanged."""

    class LengthSorted(base):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            if dataset is None or not hasattr(dataset, "column_names"):
                return super()._get_train_sampler(train_dataset)
            args = self.args
            window = args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
            return LengthSortedSampler(example_lengths(dataset), window, seed=args.data_seed or args.seed)

    LengthSorted.__name__ = LengthSorted.__qualname__ = f"LengthSorted{base.__name__}"
    return LengthSorted
