"""Pure RL tensor functions: every expected value is computed by hand in the test, on tensors of a few entries."""

from __future__ import annotations

import math

import pytest
import torch

from sleuth.train.rl import (
    aggregate_loss,
    aggregate_micro_batches,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    grpo_loss,
    kl_in_reward,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    micro_batch_weights,
    ppo_policy_loss,
    token_logprobs,
    value_loss,
)

E = math.e


def t(*rows: list[float] | float) -> torch.Tensor:
    return torch.tensor(rows if not isinstance(rows[0], list) else list(rows), dtype=torch.float64)


def close(actual: torch.Tensor, expected: torch.Tensor | list | float, atol: float = 1e-9) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected_t.shape, (actual.shape, expected_t.shape)
    assert torch.allclose(actual, expected_t, atol=atol, rtol=0), (actual, expected_t)


# ---------------------------------------------------------------------------------------------------- reductions

X = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
M = torch.tensor([[1, 0, 1], [0, 1, 1]])


def test_masked_sum_and_mean_by_hand() -> None:
    # counted entries: 1, 3 | 5, 6
    close(masked_sum(X, M), 1 + 3 + 5 + 6)
    close(masked_sum(X, M, dim=-1), [1 + 3, 5 + 6])
    close(masked_mean(X, M), (1 + 3 + 5 + 6) / 4)
    close(masked_mean(X, M, dim=-1), [(1 + 3) / 2, (5 + 6) / 2])
    close(masked_mean(X, M, dim=0), [1 / 1, 5 / 1, (3 + 6) / 2])


@pytest.mark.parametrize("junk", [1e6, float("inf"), float("nan"), -float("inf")])
def test_masked_mean_ignores_masked_entries(junk: float) -> None:
    x = X.clone()
    x[0, 1] = junk
    x[1, 0] = junk
    close(masked_mean(x, M), 15 / 4)
    close(masked_sum(x, M, dim=-1), [4.0, 11.0])
    x.requires_grad_(True)
    masked_mean(x, M).backward()
    close(x.grad, [[0.25, 0.0, 0.25], [0.0, 0.25, 0.25]])


def test_masked_mean_of_empty_mask_is_zero_with_zero_gradient() -> None:
    x = X.clone().requires_grad_(True)
    empty = torch.zeros_like(M)
    out = masked_mean(x, empty)
    assert out.item() == 0.0 and not torch.isnan(out)
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(X))
    # an empty row along a dim gives 0 for that row only: row 0 = (1 + 2 + 3) / 3
    close(masked_mean(X, torch.tensor([[1, 1, 1], [0, 0, 0]]), dim=-1), [2.0, 0.0])


def test_masked_var_by_hand() -> None:
    x = t(1.0, 2.0, 3.0, 100.0)
    m = torch.tensor([1, 1, 1, 0])
    # mean 2, squared deviations 1, 0, 1: biased 2/3, unbiased 2/2
    close(masked_var(x, m, unbiased=False), 2 / 3)
    close(masked_var(x, m), 1.0)
    # one counted entry: no spread, 0 rather than NaN; none: 0
    close(masked_var(x, torch.tensor([0, 0, 0, 1])), 0.0)
    close(masked_var(x, torch.zeros(4)), 0.0)


def test_masked_whiten_by_hand() -> None:
    x = t(2.0, 4.0, 6.0, -50.0)
    m = torch.tensor([1, 1, 1, 0])
    # mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> (x - 4) / 2; the masked entry becomes 0
    close(masked_whiten(x, m), [-1.0, 0.0, 1.0, 0.0], atol=1e-6)
    # shift_mean=False adds the mean back: (x - 4) / 2 + 4
    close(masked_whiten(x, m, shift_mean=False), [3.0, 4.0, 5.0, 0.0], atol=1e-6)


def test_aggregate_loss_modes_and_empty_rows() -> None:
    loss = t([1.0, 2.0, 3.0], [4.0, 8.0, 100.0], [7.0, 7.0, 7.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    close(aggregate_loss(loss, mask, "token-mean"), (1 + 2 + 3 + 4 + 8) / 5)
    # row means 2 and 6; the empty third row is left out of the row mean
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), (2 + 6) / 2)
    # row sums 6 and 12
    close(aggregate_loss(loss, mask, "seq-mean-token-sum"), (6 + 12) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss, mask, "sum")  # type: ignore[arg-type]


def test_micro_batch_weights_share_or_mean_by_hand() -> None:
    # two micro-batches of 2 and 6 tokens whose token means are 1.0 and 3.0
    sizes, losses = t(2.0, 6.0), t(1.0, 3.0)
    close(micro_batch_weights(sizes, "mini_batch_mean"), [0.25, 0.75])
    close(micro_batch_weights(sizes, "micro_batch_mean"), [0.5, 0.5])
    # one token mean over the 8 tokens: (2 * 1 + 6 * 3) / 8; the mean of the two means: (1 + 3) / 2
    close(aggregate_micro_batches(losses, sizes, "mini_batch_mean"), 2.5)
    close(aggregate_micro_batches(losses, sizes, "micro_batch_mean"), 2.0)
    # one process's micro-batch of 2 tokens, when all processes hold 10 tokens in 4 micro-batches
    close(micro_batch_weights(t(2.0), "mini_batch_mean", total_size=10.0, count=4), [0.2])
    close(micro_batch_weights(t(2.0), "micro_batch_mean", total_size=10.0, count=4), [0.25])
    with pytest.raises(ValueError, match="micro-batch aggregation"):
        micro_batch_weights(sizes, "token-mean")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- GAE


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    rewards = t([0.0, 0.0, 1.0], [0.5, 0.0, 2.0])
    values = t([0.5, 0.2, 0.1], [1.0, 1.0, 1.0])
    mask = torch.ones(2, 3)
    adv, ret = gae_advantages(rewards, values, mask, whiten=False)
    # reward-to-go row 0: [1, 1, 1]; row 1: [2.5, 2, 2]
    close(adv, [[1 - 0.5, 1 - 0.2, 1 - 0.1], [2.5 - 1, 2 - 1, 2 - 1]])
    close(ret, [[1.0, 1.0, 1.0], [2.5, 2.0, 2.0]])


def test_gae_general_gamma_lambda_by_hand() -> None:
    rewards = t([1.0, 0.0, 2.0])
    values = t([1.0, 2.0, 3.0])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.5, whiten=False)
    # t=2: delta = 2 + 0.5*0 - 3 = -1;  A = -1
    # t=1: delta = 0 + 0.5*3 - 2 = -0.5; A = -0.5 + 0.25*(-1) = -0.75
    # t=0: delta = 1 + 0.5*2 - 1 = 1;   A = 1 + 0.25*(-0.75) = 0.8125
    close(adv, [[0.8125, -0.75, -1.0]])
    close(ret, [[0.8125 + 1, -0.75 + 2, -1.0 + 3]])


def test_gae_observation_gap_equals_gap_removed() -> None:
    # the row above with a 2-token observation inserted after token 0 (its rewards/values are junk) and 1 pad token
    rewards = t([1.0, 9.0, 9.0, 0.0, 2.0, 5.0])
    values = t([1.0, 7.0, -7.0, 2.0, 3.0, 8.0])
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[0.8125, 0.0, 0.0, -0.75, -1.0, 0.0]])
    close(ret, [[1.8125, 0.0, 0.0, 1.25, 2.0, 0.0]])
    # and against the same function on the row with the gap removed, with whitening on
    gapped, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    plain, _ = gae_advantages(t([1.0, 0.0, 2.0]), t([1.0, 2.0, 3.0]), torch.ones(1, 3), gamma=0.5, lam=0.5)
    close(gapped[:, [0, 3, 4]], plain)
    close(gapped[:, [1, 2, 5]], [[0.0, 0.0, 0.0]])


def test_gae_whitening_by_hand_and_batch_rows_independent() -> None:
    # gamma = lam = 1: A = reward-to-go - V = [3-0, 3-1, 3-2] = [3, 2, 1]; returns = [3, 3, 3]
    # whitened over the mask: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [1, 0, -1]
    rewards = t([0.0, 0.0, 3.0])
    values = t([0.0, 1.0, 2.0])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3))
    close(adv, [[1.0, 0.0, -1.0]], atol=1e-6)
    close(ret, [[3.0, 3.0, 3.0]])
    # a second row with one model token: A = 4 - 1 = 3; rows do not mix before whitening
    adv2, ret2 = gae_advantages(t([0.0, 0.0, 3.0], [4.0, 0.0, 0.0]), t([0.0, 1.0, 2.0], [1.0, 0.0, 0.0]),
                                torch.tensor([[1, 1, 1], [1, 0, 0]]), whiten=False)  # fmt: skip
    close(adv2, [[3.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    close(ret2, [[3.0, 3.0, 3.0], [4.0, 0.0, 0.0]])


# ---------------------------------------------------------------------------------------------------- GRPO advantages


def test_grpo_advantages_std_by_hand() -> None:
    r = t(0.0, 1.0, 2.0, 5.0, 5.0, 7.0)
    # group 1 [0, 1, 2]: mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # group 2 [5, 5, 7]: mean 17/3, deviations -2/3, -2/3, 4/3; unbiased var (4/9 + 4/9 + 16/9) / 2 = 4/3
    s2 = math.sqrt(4 / 3)
    eps = 1e-6
    expected = [-1 / (1 + eps), 0.0, 1 / (1 + eps), (-2 / 3) / (s2 + eps), (-2 / 3) / (s2 + eps), (4 / 3) / (s2 + eps)]
    close(grpo_advantages(r, group_size=3), expected)
    # population std: group 1 sqrt(2/3), group 2 sqrt(8/9)
    p1, p2 = math.sqrt(2 / 3), math.sqrt(8 / 9)
    close(
        grpo_advantages(r, group_size=3, unbiased=False, eps=0.0),
        [-1 / p1, 0, 1 / p1, -2 / 3 / p2, -2 / 3 / p2, 4 / 3 / p2],
    )
    # Dr. GRPO: mean only
    close(grpo_advantages(r, group_size=3, scale="none"), [-1.0, 0.0, 1.0, -2 / 3, -2 / 3, 4 / 3])


def test_grpo_advantages_group_ids_in_any_order() -> None:
    # interleaved groups q1 = [1, 0], q2 = [0, 0.5 ... ] given as strings and as a tensor
    r = t(1.0, 3.0, 0.0, 1.0)
    ids = ["q1", "q2", "q1", "q2"]
    # q1 [1, 0]: mean 0.5, unbiased std sqrt(0.5); q2 [3, 1]: mean 2, unbiased std sqrt(2)
    h, s = 1 / math.sqrt(0.5), 1 / math.sqrt(2)
    expected = [0.5 * h, 1 * s, -0.5 * h, -1 * s]
    close(grpo_advantages(r, ids, eps=0.0), expected)
    close(grpo_advantages(r, torch.tensor([7, 3, 7, 3]), eps=0.0), expected)


def test_grpo_all_equal_rewards_give_exact_zeros() -> None:
    r = t(0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 2.5)
    out = grpo_advantages(r, [0, 0, 0, 1, 1, 1, 2])
    # group 0 all equal, group 2 a single sequence: exactly 0, not ~1e-17
    assert torch.equal(out[[0, 1, 2, 6]], torch.zeros(4, dtype=torch.float64))
    assert out[3] > 0 > out[4]
    assert torch.equal(grpo_advantages(t(0.3, 0.3), group_size=2, scale="none"), torch.zeros(2, dtype=torch.float64))


def test_grpo_advantages_argument_errors() -> None:
    r = t(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(r)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(r, [0, 0, 1], group_size=3)
    with pytest.raises(ValueError, match="multiple"):
        grpo_advantages(r, group_size=2)
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(r, [0, 1])


# ---------------------------------------------------------------------------------------------------- PPO


def _ppo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ratios row 0: 1.5, 0.5, 0.5; row 1: 1.5, 1.1, (masked 3.0, -inf old log-prob)."""
    old = t([-1.0, -1.0, -1.0], [-2.0, -2.0, -float("inf")])
    ratios = t([1.5, 0.5, 0.5], [1.5, 1.1, 3.0])
    logprobs = old + ratios.log()
    logprobs[1, 2] = -0.3
    adv = t([1.0, 1.0, -1.0], [-1.0, 2.0, 5.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs, old, adv, mask


def test_ppo_policy_loss_clip_active_and_inactive() -> None:
    logprobs, old, adv, mask = _ppo_case()
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   A=+1 r=1.5: max(-1.5, -1.2) = -1.2  clipped
    #   A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1 r=0.5: max( 0.5,  0.8) =  0.8  clipped
    #   A=-1 r=1.5: max( 1.5,  1.2) =  1.5
    #   A=+2 r=1.1: max(-2.2, -2.2) = -2.2
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask)
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5 - 2.2) / 5)
    close(stats["clip_fraction"], 2 / 5)
    # approx_kl = mean(old - new) = -mean(log r)
    close(stats["approx_kl"], -math.log(1.5 * 0.5 * 0.5 * 1.5 * 1.1) / 5)
    close(stats["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)
    # row 0 sum -0.9 over 3 tokens, row 1 sum -0.7 over 2 tokens
    close(ppo_policy_loss(logprobs, old, adv, mask, aggregation="seq-mean-token-mean")[0], (-0.9 / 3 - 0.7 / 2) / 2)
    close(ppo_policy_loss(logprobs, old, adv, mask, aggregation="seq-mean-token-sum")[0], (-0.9 - 0.7) / 2)


def test_ppo_policy_loss_clip_higher() -> None:
    logprobs, old, adv, mask = _ppo_case()
    # clip range [0.8, 1.6]: A=+1 r=1.5 is no longer clipped (-1.5); A=-1 r=0.5 still is (0.8)
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, clip_eps_high=0.6)
    close(loss, (-1.5 - 0.5 + 0.8 + 1.5 - 2.2) / 5)
    close(stats["clip_fraction"], 1 / 5)


def test_ppo_policy_loss_sequence_advantages_broadcast() -> None:
    logprobs = t([-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # ratio 1 everywhere: loss per token = -A of its row -> (-1 * 3 + 2 * 2) / 5
    loss, stats = ppo_policy_loss(logprobs, logprobs.clone(), t(1.0, -2.0), mask)
    close(loss, (-3 + 4) / 5)
    close(stats["clip_fraction"], 0.0)
    close(stats["approx_kl"], 0.0)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_policy_loss_gradient_is_zero_at_masked_positions(aggregation: str) -> None:
    logprobs, old, adv, mask = _ppo_case()
    logprobs[0, 0] = float("nan")  # unused: mask it too
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    logprobs.requires_grad_(True)
    loss, _ = ppo_policy_loss(logprobs, old, adv, mask, aggregation=aggregation)  # type: ignore[arg-type]
    loss.backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[1, 2] == 0
    # clipped tokens (A=-1 r=0.5) have zero gradient too; unclipped ones d(-A r)/dlogp = -A r
    assert logprobs.grad[0, 2] == 0
    if aggregation == "token-mean":  # 4 counted tokens
        close(logprobs.grad[0, 1], -1.0 * 0.5 / 4)
        close(logprobs.grad[1, 0], 1.0 * 1.5 / 4)
        close(logprobs.grad[1, 1], -2.0 * 1.1 / 4, atol=1e-9)


# ---------------------------------------------------------------------------------------------------- value loss


def test_value_loss_clip_by_hand() -> None:
    values = t([1.0, 2.0, 2.0, 100.0])
    old = t([0.8, 1.5, 1.5, 0.0])
    returns = t([1.5, 1.0, 3.0, -100.0])
    mask = torch.tensor([[1, 1, 1, 0]])
    # v_clip = old + clip(v - old, -0.2, 0.2) = [1.0, 1.7, 1.7]
    #   t0: (1 - 1.5)^2 = 0.25, (1.0 - 1.5)^2 = 0.25 -> 0.25
    #   t1: (2 - 1)^2 = 1,      (1.7 - 1)^2 = 0.49   -> 1
    #   t2: (2 - 3)^2 = 1,      (1.7 - 3)^2 = 1.69   -> 1.69 (clipped term active)
    loss, stats = value_loss(values, old, returns, mask)
    close(loss, 0.5 * (0.25 + 1 + 1.69) / 3)
    close(stats["clip_fraction"], 1 / 3)
    close(stats["value_mean"], (1 + 2 + 2) / 3)
    # s3's cliprange_value 0.5: v_clip = [1.0, 2.0, 2.0] -> nothing clipped, 0.5 * (0.25 + 1 + 1) / 3
    loss5, stats5 = value_loss(values, old, returns, mask, clip_eps=0.5)
    close(loss5, 0.5 * 2.25 / 3)
    close(stats5["clip_fraction"], 0.0)


# ------------------------------------------------------------------------------------- KL, entropy, log-probs


def test_kl_estimators_on_known_log_ratios() -> None:
    log_ratio = t(0.0, 1.0, -1.0, 2.0)
    ref = t(-0.5, -0.5, -0.5, -0.5)
    logp = ref + log_ratio
    close(kl_penalty(logp, ref, "k1"), [0.0, 1.0, -1.0, 2.0])
    close(kl_penalty(logp, ref, "k2"), [0.0, 0.5, 0.5, 2.0])
    # k3 = exp(-x) - 1 + x: x=1 -> 1/e; x=-1 -> e - 2; x=2 -> e^-2 + 1
    close(kl_penalty(logp, ref, "k3"), [0.0, 1 / E, E - 2, E**-2 + 1])
    # ARENA digest §6.2: 0.5 * (ref - logp)^2, factor 1/2 included
    close(kl_penalty(logp, ref, "arena"), [0.0, 0.5, 0.5, 2.0])
    close(kl_penalty(logp, ref, "abs"), [0.0, 1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="KL kind"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_nonnegative_and_zero_at_zero() -> None:
    x = torch.arange(-20, 21, dtype=torch.float64) / 4  # -5, -4.75, ..., 5, exactly 0 at index 20
    k3 = kl_penalty(x, torch.zeros_like(x), "k3")
    assert k3[20] == 0.0
    assert (k3[:20] > 0).all() and (k3[21:] > 0).all()
    # around 0 the estimate is ~x^2/2 and must not round below 0
    tiny = torch.tensor([-1e-9, -2.7e-16, 1e-300, 3e-12], dtype=torch.float64)
    assert (kl_penalty(tiny, torch.zeros_like(tiny), "k3") >= 0).all()


def test_entropy_from_logits() -> None:
    # uniform over V = 5 -> log 5, whatever the constant logit
    for c in (0.0, 7.0, 1000.0):
        uniform = torch.full((2, 3, 5), c, dtype=torch.float64)
        close(entropy_from_logits(uniform), torch.full((2, 3), math.log(5), dtype=torch.float64), atol=1e-12)
    # p = [1/4, 3/4] from logits [0, log 3]: H = -(1/4 log 1/4 + 3/4 log 3/4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(entropy_from_logits(torch.tensor([[[0.0, math.log(3)]]], dtype=torch.float64)), [[h]])
    # a -inf logit is a 0-probability entry: [0, 0, -inf] -> log 2, finite gradient
    z = torch.tensor([[[0.0, 0.0, -float("inf")]]], dtype=torch.float64, requires_grad=True)
    out = entropy_from_logits(z)
    close(out, [[math.log(2)]])
    out.sum().backward()
    assert torch.isfinite(z.grad).all()


def test_token_logprobs_no_shift_and_ignore_index() -> None:
    # position 0: p = [1/4, 3/4, 0...]; position 1: uniform over 3
    logits = torch.tensor([[[0.0, math.log(3), -float("inf")], [1.0, 1.0, 1.0]]], dtype=torch.float64)
    labels = torch.tensor([[1, 2]])
    close(token_logprobs(logits, labels), [[math.log(0.75), math.log(1 / 3)]])
    close(token_logprobs(logits, torch.tensor([[0, -100]])), [[math.log(0.25), 0.0]])
    # bf16 logits are upcast: log(3/4) to float32 precision of the bf16-rounded inputs
    lp = token_logprobs(torch.tensor([[[0.0, 2.0]]], dtype=torch.bfloat16), torch.tensor([[1]]))
    assert lp.dtype == torch.float32
    close(lp, [[-math.log(1 + math.exp(-2.0))]], atol=1e-6)


# ---------------------------------------------------------------------------------------------------- KL in reward


def test_kl_in_reward_places_score_on_last_model_token() -> None:
    logprobs = torch.full((3, 5), -1.0, dtype=torch.float64)
    ref = torch.full((3, 5), -1.5, dtype=torch.float64)  # k1 = 0.5 everywhere
    mask = torch.tensor(
        [
            [1, 1, 0, 1, 0],  # observation at 2, last model token 3, pad at 4
            [1, 1, 0, 0, 0],  # last model token 1
            [0, 0, 0, 0, 0],  # no model token: no reward at all
        ]
    )
    scores = t(2.0, -1.0, 9.0)
    out = kl_in_reward(scores, logprobs, ref, mask, coef=0.001)
    k = -0.001 * 0.5
    close(out, [[k, k, 0, 2 + k, 0], [k, -1 + k, 0, 0, 0], [0, 0, 0, 0, 0]])
    # k2 with coef 0.1: 0.1 * 0.5 * 0.5^2 = 0.0125
    out2 = kl_in_reward(scores, logprobs, ref, mask, coef=0.1, kind="k2")
    close(out2[0], [-0.0125, -0.0125, 0, 2 - 0.0125, 0])


# ---------------------------------------------------------------------------------------------------- GRPO loss


def _grpo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ratio 1 (on-policy); log_ratio to the reference row 0: [0, 1, 0], row 1: [-1, 0, masked]."""
    logprobs = t([-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0])
    ref = logprobs - t([0.0, 1.0, 0.0], [-1.0, 0.0, 0.0])
    ref[1, 2] = -float("inf")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs, ref, t(1.0, -1.0), mask


def test_grpo_loss_by_hand() -> None:
    logprobs, ref, adv, mask = _grpo_case()
    # k3 tokens: row 0 [0, 1/e, 0], row 1 [e - 2, 0]; per token -A + 0.1 * k3
    row0 = [-1.0, -1.0 + 0.1 / E, -1.0]
    row1 = [1.0 + 0.1 * (E - 2), 1.0]
    loss, stats = grpo_loss(logprobs, logprobs.clone(), ref, adv, mask, beta=0.1)
    close(loss, (sum(row0) / 3 + sum(row1) / 2) / 2)  # DeepSeekMath: mean over sequences of token means
    close(stats["kl"], (1 / E + E - 2) / 5)
    close(stats["clip_fraction"], 0.0)
    loss_tm, _ = grpo_loss(logprobs, logprobs.clone(), ref, adv, mask, beta=0.1, aggregation="token-mean")
    close(loss_tm, (sum(row0) + sum(row1)) / 5)
    # ARENA: 0.5 * log_ratio^2 -> row 0 [0, 0.5, 0], row 1 [0.5, 0]
    loss_a, stats_a = grpo_loss(logprobs, logprobs.clone(), ref, adv, mask, beta=0.1, kl="arena")
    close(loss_a, ((-3 + 0.05) / 3 + (2 + 0.05) / 2) / 2)
    close(stats_a["kl"], 1.0 / 5)


def test_grpo_loss_gradient_k3_vs_arena() -> None:
    # token-mean over 5 tokens, ratio 1: d/dlogp = (-A + beta * dKL/dlogp) / 5
    #   k3: dKL/dlogp = 1 - exp(-x);  arena: dKL/dlogp = x   (x = logp - ref)
    for kind, slope in (("k3", 1 - 1 / E), ("arena", 1.0)):
        logprobs, ref, adv, mask = _grpo_case()
        logprobs.requires_grad_(True)
        loss, _ = grpo_loss(logprobs, logprobs.detach(), ref, adv, mask, beta=0.1, kl=kind, aggregation="token-mean")  # type: ignore[arg-type]
        loss.backward()
        close(logprobs.grad[0, 1], (-1.0 + 0.1 * slope) / 5)
        assert logprobs.grad[1, 2] == 0  # masked (its reference log-prob is -inf)


def test_grpo_loss_without_reference() -> None:
    logprobs, _, adv, mask = _grpo_case()
    loss, stats = grpo_loss(logprobs, logprobs.clone(), None, adv, mask, beta=0.0, aggregation="token-mean")
    close(loss, (-3 + 2) / 5)
    close(stats["kl"], 0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logprobs, logprobs.clone(), None, adv, mask, beta=0.04)


# ----------------------------------------------------------------------------------------------------------------
# sampler correction (issue 35 item 2)


def test_sampler_correction_weights_and_mismatch_by_hand() -> None:
    from sleuth.train.rl import ppo_policy_loss, sampler_correction

    # rho = exp(old - sampler) = 1, 3, 1/4 on the model tokens; the last position is padding (mask 0)
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    sampler = old - torch.log(torch.tensor([[1.0, 3.0, 0.25, 99.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = sampler_correction(old, sampler, mask, mode="tis", cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.25, 1.0]]))  # min(rho, C); padding 1
    close(stats["mismatch_abs"], (0 + math.log(3) + math.log(4)) / 3, atol=1e-6)
    close(stats["mismatch_max"], math.log(4), atol=1e-6)
    close(stats["corrected_share"], 1 / 3)  # only rho = 3 is truncated
    masked, stats = sampler_correction(old, sampler, mask, mode="token_mask", cap=2.0)
    assert torch.allclose(masked, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))  # rho outside [1/2, 2]
    close(stats["corrected_share"], 2 / 3, atol=1e-6)
    # the sequence's geometric mean ratio (3 * 1/4)^(1/3) = 0.909 is inside [1/2, 2]: kept; with C = 1.05 not
    kept, _ = sampler_correction(old, sampler, mask, mode="sequence_mask", cap=2.0)
    assert torch.equal(kept, torch.ones_like(kept))
    dropped, stats = sampler_correction(old, sampler, mask, mode="sequence_mask", cap=1.05)
    assert torch.equal(dropped, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    close(stats["corrected_share"], 1.0, atol=1e-6)
    none, stats = sampler_correction(old, sampler, mask, mode="none")
    assert torch.equal(none, torch.ones_like(none)) and float(stats["corrected_share"]) == 0.0
    close(stats["mismatch_abs"], (math.log(3) + math.log(4)) / 3)  # measured even when nothing is corrected

    # the loss: at ratio pi/pi_old = 1 and A = 1 on every token, token-mean of -A * r * w = -(1 + 2 + 0.25) / 3,
    # and each token's gradient is -A * w_t / 3
    logp = old.clone().requires_grad_(True)
    adv = torch.ones(1, 4)
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    close(plain, -1.0, atol=1e-6)
    loss, _ = ppo_policy_loss(logp, old, adv, mask, is_weights=weights)
    close(loss, -(1 + 2 + 0.25) / 3, atol=1e-6)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -2 / 3, -0.25 / 3, 0.0]]), atol=1e-6)
    # GRPO: the weights multiply the surrogate, not the KL term (beta * k1 with ref = logp - 0.5: 0.5 per token)
    loss, _ = grpo_loss(
        old, old, old - 0.5, adv, mask, beta=0.1, kl="k1", aggregation="token-mean", is_weights=weights
    )
    close(loss, -(1 + 2 + 0.25) / 3 + 0.1 * 0.5, atol=1e-6)
    with pytest.raises(ValueError, match="cap"):
        sampler_correction(old, sampler, mask, cap=0.5)
