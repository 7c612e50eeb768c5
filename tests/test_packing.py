"""Length-aware micro-batching (sleuth.train.packing): the plans, and that the RL update's token-budget
micro-batches and the trainers' length-sorted sampler change the padding, not the gradient."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sleuth.train import online_rl, packing
from sleuth.train.online_rl import Episode, RLConfig


def test_token_budget_groups_sort_by_length_and_respect_the_budget() -> None:
    lengths = [5, 30, 7, 12, 28, 3, 40, 9]
    groups = packing.token_budget_groups(lengths, budget=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(lengths, reverse=True)
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 60 or len(g) == 1
    assert packing.token_budget_groups([100, 10], budget=50) == [[0], [1]]  # too long: alone
    capped = packing.token_budget_groups(lengths, budget=60, max_rows=2)
    assert max(len(g) for g in capped) == 2 and [lengths[i] for g in capped for i in g] == flat
    # the RL update's micro_batch caps the rows under a budget too: micro_batch 1 (memory) means one row each
    assert packing.micro_batches(list(range(8)), lengths, rows=1, budget=4096) == [
        [6],
        [1],
        [4],
        [3],
        [7],
        [2],
        [0],
        [5],
    ]


def test_sorting_removes_padding_and_fixed_rows_keep_the_order() -> None:
    lengths = [256, 1024, 512, 768, 300, 900, 128, 640]
    fixed = packing.micro_batches(lengths, lengths, rows=2)
    assert fixed == [[256, 1024], [512, 768], [300, 900], [128, 640]]
    budget = packing.micro_batches(lengths, lengths, rows=2, budget=2048)
    useful, padded = packing.padding_waste(fixed)
    assert packing.padding_waste(budget)[0] == useful
    assert packing.padding_waste(budget)[1] < padded
    assert packing.micro_batch_budget(None, "mini_batch_mean") == packing.DEFAULT_MICRO_BATCH_TOKENS
    assert packing.micro_batch_budget(None, "micro_batch_mean") == 0
    assert packing.micro_batch_budget(512, "micro_batch_mean") == 512
    with pytest.raises(ValueError):
        packing.micro_batch_budget(-1, "mini_batch_mean")


def test_length_sorted_order_keeps_each_windows_examples() -> None:
    import torch

    lengths = [random.Random(0).randint(1, 100) for _ in range(23)]
    order = packing.length_sorted_order(lengths, window=8, seed=3)
    g = torch.Generator()
    g.manual_seed(3)
    plain = torch.randperm(23, generator=g).tolist()
    assert sorted(order) == list(range(23))
    for start in range(0, 23, 8):
        window = order[start : start + 8]
        assert set(window) == set(plain[start : start + 8])
        assert [lengths[i] for i in window] == sorted((lengths[i] for i in window), reverse=True)
    sampler = packing.LengthSortedSampler(lengths, window=8, seed=3)
    assert list(sampler) == order and list(sampler) != order  # a new permutation every epoch


def _episodes_and_stats(n: int, ppo: bool, seed: int = 0) -> tuple[list[Episode], list[dict[str, Any]]]:
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    episodes, stats = [], []
    for i in range(n):
        length = rng.randint(4, 40)
        prompt = rng.randint(1, length - 2)
        mask = [0] * prompt + [1] * (length - prompt)
        ids = [rng.randint(4, 300) for _ in range(length)]
        episodes.append(Episode(group=f"g{i % 2}", messages=None, reward=0.0, components={}, input_ids=ids, mask=mask))
        m = torch.tensor(mask[1:], dtype=torch.float32)
        row = {
            "old": -torch.rand(length - 1) * 3,
            "ref": -torch.rand(length - 1) * 3,
            "mask": m,
            "adv": torch.randn(length - 1) * m,
        }
        if ppo:
            row["values"] = torch.randn(length - 1)
            row["returns"] = torch.randn(length - 1)
        stats.append(row)
    return episodes, stats


def _update_gradients(tiny_model_dir: Path, config: RLConfig, n: int) -> tuple[dict[str, Any], dict]:
    """The gradients (policy and critic) one ``_update`` step computes from fresh weights, and its logged terms."""
    import torch

    torch.manual_seed(0)
    models = online_rl._Models(config, tiny_model_dir, None, torch.device("cpu"))
    models.train()
    grads: dict[str, Any] = {}

    def record(prefix: str, optimizer: Any) -> None:
        def step(*_: Any, **__: Any) -> None:
            for g, group in enumerate(optimizer.param_groups):
                for k, p in enumerate(group["params"]):
                    if p.grad is not None:
                        grads[f"{prefix}{g}.{k}"] = p.grad.detach().clone()

        optimizer.step = step

    record("policy", models.optimizer)
    if models.critic_optimizer is not None:
        record("critic", models.critic_optimizer)
    episodes, stats = _episodes_and_stats(n, config.algorithm == "ppo")
    # old and reference log-probs near the model's own (ratios near 1, some clipped), from one padded batch
    fixed = RLConfig(**{**vars(config), "micro_batch": n})
    for row, real in zip(stats, online_rl._rollout_stats(models, episodes, fixed), strict=True):
        row["old"] = real["old"] + 0.3 * row["old"]
        row["ref"] = real["ref"] + 0.3 * row["ref"]
    logged = online_rl._update(models, episodes, stats, config, online_rl.DataParallel())
    return grads, logged


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_gradient_of_one_padded_batch(
    tiny_model_dir: Path, algorithm: str, aggregation: str
) -> None:
    """With ``mini_batch_mean`` the update's gradient is that of the whole mini-batch padded as one batch, whether
    the episodes go in fixed rows in their shuffled order or sorted under a token budget (a budget small enough to
    make several micro-batches of different row counts)."""
    n = 7
    base = RLConfig(
        model=str(tiny_model_dir),
        algorithm=algorithm,  # type: ignore[arg-type]
        group_size=2,
        beta=0.1,
        entropy_coef=0.01,
        loss_aggregation=aggregation,
        max_grad_norm=1e9,
        micro_batch_aggregation="mini_batch_mean",
        progress=False,
    )
    one, one_log = _update_gradients(
        tiny_model_dir, RLConfig(**{**vars(base), "micro_batch": n, "micro_batch_tokens": 0}), n
    )
    for micro_batch, tokens in ((2, 0), (2, 64), (2, None)):
        config = RLConfig(**{**vars(base), "micro_batch": micro_batch, "micro_batch_tokens": tokens})
        grads, logged = _update_gradients(tiny_model_dir, config, n)
        assert grads.keys() == one.keys() and len(grads) > 0
        for k in one:
            assert (grads[k] - one[k]).abs().max() <= 1e-5 + 1e-4 * one[k].abs().max(), k
        for key in ("loss", "kl", "value_loss"):
            if key in one_log:
                assert logged[key] == pytest.approx(one_log[key], rel=1e-5, abs=1e-6), key


def test_the_plan_has_several_micro_batches_under_a_small_budget() -> None:
    episodes, _ = _episodes_and_stats(7, ppo=False)
    lengths = [len(e.input_ids or []) for e in episodes]
    plan = packing.micro_batches(list(range(7)), lengths, rows=2, budget=64)
    assert len(plan) > 2 and len({len(g) for g in plan}) > 1


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_sft_trainer_sorts_each_step_by_length_and_its_gradient_is_the_unpadded_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """TRL's SFTTrainer with ``length_sorted`` (the default): one optimizer step's micro-batches, sorted by length
    and padded, give the gradient of the same examples each alone (no padding), at the step's token mean."""
    import torch

    from sleuth.train.sft import build_dataset, build_trainer
    from tests.test_sft import tiny_config

    config = tiny_config(tiny_model_dir, tmp_path / "out", batch_size=6, per_device_batch_size=2)
    train, _, _ = build_dataset(config)
    trainer = build_trainer(config, train[:6])
    assert isinstance(trainer._get_train_sampler(), packing.LengthSortedSampler)
    loader = trainer.get_train_dataloader()
    step = [next(it) for it in [iter(loader)] for _ in range(3)]  # accumulation 3 x 2 rows
    widths = [int(b["attention_mask"].sum(-1).max()) for b in step]
    assert widths == sorted(widths, reverse=True)
    model = trainer.model
    model.train()
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in step)

    def accumulate(batches: list[dict[str, Any]]) -> dict[str, Any]:
        model.zero_grad(set_to_none=True)
        for b in batches:
            trainer.compute_loss(model, dict(b), num_items_in_batch=torch.tensor(items)).backward()
        return _grads(model)

    sorted_grads = accumulate(step)
    alone = []
    for b in step:
        for i in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][i].sum())
            alone.append({k: v[i : i + 1, :n] for k, v in b.items() if torch.is_tensor(v) and v.dim() == 2})
    alone_grads = accumulate(alone)
    assert sorted_grads.keys() == alone_grads.keys() and len(sorted_grads) > 0
    for k, g in sorted_grads.items():
        diff = float((g - alone_grads[k]).abs().max())
        assert diff <= 1e-5 + 1e-4 * float(g.abs().max()), (k, diff, float(g.abs().max()))
