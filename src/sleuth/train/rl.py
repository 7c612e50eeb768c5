"""Pure tensor functions for policy-gradient RL on token sequences: masks, advantages, losses, KL estimators.

The RL trainers (s3's PPO with a critic, ARENA's GRPO, and GRPO for s3) are built from these functions. They hold no
state and know nothing about models or rollouts. They follow the veRL layout: every token-level tensor has shape
``(batch, tokens)``, and every function that reduces over tokens takes a ``mask`` in which 1 marks a model-written
token that counts and 0 marks anything else (prompt, an inserted observation such as retrieved documents, padding).
Entries at mask-0 positions never change a result, even when they hold ``inf`` or ``nan`` (log-probs of padding), and
get a zero gradient (the policy losses guarantee that for non-finite log-probs too).

Formulas and their sources:

- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation", Eq. 16,
  computed only over model tokens (multi-turn state masking: s3 digest §7, ``actor.state_masking``).
- PPO clipped surrogate and clipped value loss: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
  Eq. 7 (s3 digest §7); value clipping as in the PPO baselines implementation. The decoupled upper clip
  ``clip_eps_high`` follows DAPO (Yu et al. 2025, "clip-higher").
- GRPO group advantages and objective: Shao et al. 2024, DeepSeekMath, §4.1 Eq. 3 (ARENA digest §6.1); the
  mean-only variant follows Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training").
- KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html);
  ARENA's squared log-ratio: ARENA digest §6.2.
- KL in the reward (s3/veRL PPO, ``kl_coef=0.001``, k1, score on the last response token): s3 digest §5.2 and §7.

Stats are returned as detached 0-dim tensors so that a training loop can log them without forcing a device sync on
every micro-batch (call ``.item()`` when needed).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch

__all__ = [
    "Aggregation",
    "KLKind",
    "MicroBatchAggregation",
    "aggregate_loss",
    "aggregate_micro_batches",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "grpo_loss",
    "kl_in_reward",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "micro_batch_weights",
    "ppo_policy_loss",
    "token_logprobs",
    "sampler_correction",
    "value_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3", "arena", "abs"]
MicroBatchAggregation = Literal["mini_batch_mean", "micro_batch_mean"]
SamplerCorrection = Literal["tis", "token_mask", "sequence_mask", "none"]

_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
_KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "arena", "abs")
SAMPLER_CORRECTIONS: tuple[str, ...] = ("tis", "token_mask", "sequence_mask", "none")
MICRO_BATCH_AGGREGATIONS: tuple[str, ...] = ("mini_batch_mean", "micro_batch_mean")


# ----------------------------------------------------------------------------------------------------------------
# masked reductions


def _masked(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with mask-0 entries replaced by 0 (so ``inf``/``nan`` there cannot leak), and the mask in x's dtype."""
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    x = x if x.is_floating_point() else x.float()
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i mask_i * x_i over ``dim`` (all entries when None); entries where mask is 0 are ignored entirely."""
    xm, m = _masked(x, mask)
    prod = xm * m
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(mask * x) / sum(mask) over ``dim`` (all entries when None).

    Where the mask sums to 0 (an empty row, a batch of only padding) the result is 0, not NaN, and its gradient is 0:
    an empty micro-batch must not poison the accumulated gradient.
    """
    total = masked_sum(x, mask, dim)
    _, m = _masked(x, mask)
    count = m.sum() if dim is None else m.sum(dim=dim)
    safe = torch.where(count != 0, count, torch.ones_like(count))
    return torch.where(count != 0, total / safe, torch.zeros_like(total))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries: mean(mask * (x - mean)^2), times n / (n - 1) when ``unbiased`` (Bessel).

    n is the mask sum. With n = 0 the result is 0; with n = 1 it is 0 too (the unbiased estimate is undefined there,
    and no spread has been observed), so whitening a one-token batch gives 0 instead of NaN.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        _, m = _masked(x, mask)
        n = m.sum()
        denominator = torch.where(n > 1, n - 1, torch.ones_like(n))
        var = torch.where(n > 1, var * n / denominator, var)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked entries; mask-0 entries become 0.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised), as PPO implementations do
    for rewards. Used on GAE advantages (PPO's advantage normalisation).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    white = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        white = white + mean
    xm, _ = _masked(white, mask)
    return xm


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "token-mean") -> torch.Tensor:
    """Reduce a ``(batch, tokens)`` per-token loss to a scalar.

    - ``token-mean``: sum over all counted tokens / their number (TRL and ARENA's code, veRL's default);
    - ``seq-mean-token-mean``: mean over rows of each row's token mean (DeepSeekMath's 1/G sum_i 1/|o_i| sum_t);
    - ``seq-mean-token-sum``: mean over rows of each row's token sum (no length normalisation, Dr. GRPO's
      argument against the 1/|o_i| length bias).

    Rows with no counted token are left out of the row mean (they have no loss to average, and counting them would
    shrink the loss with the amount of padding in the batch).
    """
    if aggregation == "token-mean":
        return masked_mean(loss, mask)
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {_AGGREGATIONS}")
    per_row = masked_mean(loss, mask, dim=-1) if aggregation == "seq-mean-token-mean" else masked_sum(loss, mask, -1)
    _, m = _masked(loss, mask)
    has_tokens = (m != 0).any(dim=-1)
    return masked_mean(per_row, has_tokens)


def micro_batch_weights(
    sizes: torch.Tensor,
    mode: MicroBatchAggregation = "mini_batch_mean",
    total_size: float | None = None,
    count: float | None = None,
) -> torch.Tensor:
    """The weight of each micro-batch's loss (itself a mean over its tokens or sequences, :func:`aggregate_loss`)
    in one optimizer step's loss, from ``sizes``, each micro-batch's number of tokens (or sequences).

    - ``mini_batch_mean``: ``size / total_size``, the micro-batch's share: the summed loss is the one mean over the
      whole mini-batch, so the micro-batch size changes memory only;
    - ``micro_batch_mean``: ``1 / count``, every micro-batch the same: the mean of the per-micro-batch means, as
      gradient accumulation does in TRL (ARENA's trainer) and veRL's ``dp_actor`` / ``dp_critic`` (s3: the loss
      divided by ``gradient_accumulation``); a short micro-batch's tokens weigh more than a long one's.

    ``total_size`` and ``count`` default to ``sizes.sum()`` and ``len(sizes)``; pass the totals over every process
    when ``sizes`` are one process's micro-batches."""
    if mode not in MICRO_BATCH_AGGREGATIONS:
        raise ValueError(f"unknown micro-batch aggregation {mode!r}; expected one of {MICRO_BATCH_AGGREGATIONS}")
    sizes = sizes.to(torch.float64)
    if mode == "micro_batch_mean":
        n = float(sizes.numel()) if count is None else float(count)
        return torch.full_like(sizes, 1.0 / max(n, 1.0))
    total = float(sizes.sum()) if total_size is None else float(total_size)
    return sizes / max(total, 1e-12)


def aggregate_micro_batches(
    losses: torch.Tensor, sizes: torch.Tensor, mode: MicroBatchAggregation = "mini_batch_mean"
) -> torch.Tensor:
    """One optimizer step's loss from its micro-batches' mean ``losses`` and ``sizes`` (tokens or sequences), as
    weighted by :func:`micro_batch_weights` (veRL's ``agg_loss`` at the level of micro-batches)."""
    return (losses * micro_batch_weights(sizes, mode).to(losses.dtype)).sum()


# ----------------------------------------------------------------------------------------------------------------
# advantages


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE (Schulman et al. 2016, Eq. 16) over the model tokens only; returns ``(advantages, returns)``.

    For the model tokens t_1 < t_2 < ... < t_n of a row (mask 1), backwards from t_n:

        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]          (V[t_{n+1}] = 0: nothing follows the last model token)
        A[t_k]  = delta_k + gamma * lam * A[t_{k+1}]             (A[t_{n+1}] = 0)

    Tokens with mask 0 (an observation inserted between two turns, padding) are skipped: the "next value" of a
    model token is the value of the next *model* token, and their rewards and values are ignored. This is the
    multi-turn state masking of veRL-style agent RL (s3 digest §7): the result equals plain GAE on the row with the
    masked tokens removed. ``returns = A + V`` before whitening (the critic's regression target); with
    ``whiten=True`` (PPO's default advantage normalisation) the advantages are whitened over the mask. Both outputs
    are 0 at mask-0 positions. s3's setting is gamma = lam = 1, where A[t] = (sum of rewards from t on) - V[t].
    """
    m = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(m, rewards.to(values.dtype), zero)
    vals = torch.where(m, values, zero)
    batch, length = vals.shape
    next_value = torch.zeros(batch, dtype=vals.dtype, device=vals.device)
    last_gae = torch.zeros(batch, dtype=vals.dtype, device=vals.device)
    advantages = torch.zeros_like(vals)
    for t in range(length - 1, -1, -1):
        at = m[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(at, gae, zero)
        next_value = torch.where(at, vals[:, t], next_value)
        last_gae = torch.where(at, gae, last_gae)
    returns = torch.where(m, advantages + vals, zero)
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


def _group_index(
    batch: int, group_ids: torch.Tensor | Sequence[Hashable] | None, group_size: int | None, device: torch.device
) -> torch.Tensor:
    """A ``(batch,)`` long tensor mapping each sequence to a group number 0..G-1."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids and group_size")
    if group_size is not None:
        if group_size < 1 or batch % group_size:
            raise ValueError(f"batch {batch} is not a multiple of group_size {group_size}")
        return torch.arange(batch, device=device) // group_size
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({batch},)")
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    assert group_ids is not None
    if len(group_ids) != batch:
        raise ValueError(f"{len(group_ids)} group ids for {batch} rewards")
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in group_ids], dtype=torch.long, device=device)


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable] | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    scale: Literal["std", "none"] = "std",
    unbiased: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantages (DeepSeekMath §4.1.2): each sequence's reward normalised within its group.

    ``rewards`` has shape ``(batch,)``. Groups are given by ``group_ids`` (a tensor or any hashables, such as
    question ids, in any order) or by ``group_size`` (consecutive blocks of that size). For sequence i in group g:

        scale="std":  A_i = (r_i - mean_g) / (std_g + eps)
        scale="none": A_i = r_i - mean_g                    (Dr. GRPO: no division by the group std)

    The std is the unbiased one (n - 1) by default: torch's default, which TRL's GRPO and ARENA's code use (digest
    §6.2; the DeepSeekMath paper writes std(r) without saying which); ``unbiased=False`` gives the population std.
    ``eps`` is 1e-6 here as in veRL; ARENA's code uses 1e-4 (digest §6.2), pass it to reproduce that. A group whose
    rewards are all equal (including a group of one) has exactly 0 advantages: it carries no ranking signal.
    Broadcast the result to tokens with ``A[:, None]`` or pass it as is to :func:`ppo_policy_loss` /
    :func:`grpo_loss`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (batch,), got {tuple(rewards.shape)}")
    if scale not in ("std", "none"):
        raise ValueError(f"unknown scale {scale!r}; expected 'std' or 'none'")
    r = rewards if rewards.is_floating_point() else rewards.float()
    index = _group_index(r.shape[0], group_ids, group_size, r.device)
    groups = int(index.max().item()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, index, r) / count
    centred = r - mean[index]
    highest = torch.full((groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, index, r, "amax")
    lowest = torch.full((groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, index, r, "amin")
    constant = (highest == lowest)[index]
    if scale == "std":
        squares = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, index, centred**2)
        dof = count - 1 if unbiased else count
        std = torch.sqrt(squares / torch.clamp(dof, min=1))
        centred = centred / (std[index] + eps)
    return torch.where(constant, torch.zeros_like(centred), centred)


# ----------------------------------------------------------------------------------------------------------------
# KL estimators and token statistics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's log-probs, with log_ratio = logp - ref_logp.

    Schulman 2020, "Approximating KL Divergence" (samples drawn from pi):

    - ``k1`` = log_ratio: unbiased, high variance, can be negative (s3/veRL's ``kl_penalty=kl``);
    - ``k2`` = 0.5 * log_ratio^2: biased, low variance, >= 0;
    - ``k3`` = exp(-log_ratio) - 1 + log_ratio = exp(ref - logp) - (ref - logp) - 1: unbiased, >= 0, 0 only at
      log_ratio = 0 (DeepSeekMath GRPO's estimator); it explodes as pi(token) -> 0;
    - ``arena`` = 0.5 * (ref_logp - logp)^2, ARENA's replacement of k3 (ARENA digest §6.2: ``per_token_kl = 0.5 *
      (ref_per_token_logps - per_token_logps) ** 2``, factor 1/2 included). It is the same value as k2; it is kept
      as its own name so that a config says which paper it follows;
    - ``abs`` = |log_ratio|.

    Returns a tensor of the inputs' shape; the caller masks it.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind in ("k2", "arena"):
        return 0.5 * log_ratio**2
    if kind == "k3":
        # expm1(-x) + x is exp(-x) - 1 + x without the cancellation near x = 0 that can round it below 0
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {_KL_KINDS}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: H = logsumexp(z) - sum_v softmax(z)_v * z_v.

    ``(batch, tokens, vocab) -> (batch, tokens)`` (any leading shape works). The logsumexp form never exponentiates
    a large logit; ``-inf`` logits (a masked-out vocabulary entry) contribute 0, not NaN.
    """
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return lse - (probs * finite).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[b, t])[labels[b, t]]: ``(batch, tokens, vocab), (batch, tokens) -> (batch, tokens)``.

    ``logits[:, t]`` must be the prediction for ``labels[:, t]``: the causal-LM shift (``logits[:, :-1]`` against
    ``input_ids[:, 1:]``) is the caller's job. Computed as z[label] - logsumexp(z), which never materialises the
    full log-softmax; half-precision logits are upcast to float32 one row at a time (log-probs in bf16 are too
    coarse for a ratio exp(logp - old_logp)). Negative labels (``-100`` padding) give 0.
    """
    valid = labels >= 0
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        rows = [
            row.float().gather(-1, lab).squeeze(-1) - torch.logsumexp(row.float(), dim=-1)
            for row, lab in zip(logits, safe, strict=True)
        ]
        out = torch.stack(rows)
    else:
        out = logits.gather(-1, safe).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(valid, out, torch.zeros_like(out))


@torch.no_grad()
def kl_in_reward(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 0.001,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """Token rewards for PPO with the KL penalty in the reward (s3 digest §5.2, §7; veRL ``use_kl_loss=False``).

        reward[b, t] = -coef * KL_t(kind)           at every model token t,
                       + scores[b]                  added at the LAST model token of row b,
                       0                            at mask-0 tokens.

    ``scores`` has shape ``(batch,)`` (s3: the GBR reward). s3 uses ``coef=0.001``, ``kind="k1"``. A row without
    any model token gets no reward (there is no token to place it on).
    """
    m = mask != 0
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(m, -coef * kl, zero)
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).max(dim=-1).values
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    rewards[rows, last[has]] += scores.to(rewards.dtype)[has]
    return rewards


# ----------------------------------------------------------------------------------------------------------------
# losses


def _clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - eps, 1 + eps_high)) and the clip-active indicator."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # the ratio at masked tokens is forced to exp(0) so that inf/nan there cannot reach the (masked) gradient
    log_ratio = torch.where(m, logprobs - old_logprobs, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(logprobs.dtype)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: Aggregation = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, Eq. 7), as a loss to minimise.

        ratio_t = exp(logp_t - old_logp_t)
        loss_t  = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high))

    reduced over the mask by ``aggregation`` (:func:`aggregate_loss`). ``clip_eps_high`` defaults to ``clip_eps``
    (symmetric clip); a larger value is DAPO's clip-higher. ``advantages`` may be per sequence ``(batch,)`` (GRPO,
    broadcast to every token) or per token ``(batch, tokens)`` (GAE).

    Stats: ``clip_fraction`` = share of counted tokens where the clipped term is the active one (its gradient is 0),
    ``approx_kl`` = masked mean of old_logp - logp (k1 estimate of KL(old || new) on tokens sampled from old),
    ``ratio_mean``; all detached.

    ``is_weights`` (``(batch, tokens)``, from :func:`sampler_correction`) multiply each token's surrogate: the
    correction for rollouts sampled by another engine than the trainer.
    """
    per_token, clip_active = _clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, aggregation)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean(clip_active, mask),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask),
            "ratio_mean": masked_mean(torch.exp(logprobs - old_logprobs), mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss: 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old_v + clip(v - old_v, -eps, eps).

    The clip keeps the critic near the values the advantages were computed with (PPO baselines' ``cliprange_value``;
    s3's config uses 0.5, pass ``clip_eps=0.5`` to reproduce it). Reduced by ``aggregation`` over the mask
    (token mean by default, as veRL). Stats: ``clip_fraction`` = share of counted tokens where the clipped term is the
    larger one, and ``value_mean`` (both detached).
    """
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    unclipped = (values - returns) ** 2
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), mask, aggregation)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(values.dtype), mask),
            "value_mean": masked_mean(values, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    kl: KLKind = "k3",
    aggregation: Aggregation = "seq-mean-token-mean",
    clip_eps_high: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (DeepSeekMath §4.1 Eq. 3, ARENA digest §6.1): PPO-clip surrogate plus beta * KL(pi || ref) per token.

        loss_t = max(-A_i * ratio_t, -A_i * clip(ratio_t, 1 - eps, 1 + eps_high)) + beta * KL_t(kl)

    with sequence advantages ``A`` of shape ``(batch,)`` (from :func:`grpo_advantages`; ``(batch, tokens)`` works
    too). The default ``aggregation="seq-mean-token-mean"`` is the paper's 1/G sum_i 1/|o_i| sum_t;
    TRL and ARENA's code use ``"token-mean"`` (digest §6.2). DeepSeekMath's KL estimator is k3 (the default); ARENA
    uses ``kl="arena"`` (0.5 * squared log-ratio). With ``beta=0`` the reference log-probs may be None.

    Stats (detached): ``kl`` = masked mean of the per-token KL estimate (0 when beta is 0 and no reference is given),
    ``clip_fraction``, ``approx_kl`` (old vs new, as in :func:`ppo_policy_loss`).

    ``is_weights`` multiply the surrogate only (not the KL term), as in :func:`ppo_policy_loss`.
    """
    per_token, clip_active = _clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    if ref_logprobs is not None:
        m = mask != 0
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        # masked tokens get log_ratio 0 so that inf there (padding log-probs) cannot turn into a nan gradient
        kl_tokens = kl_penalty(torch.where(m, logprobs, zero), torch.where(m, ref_logprobs, zero), kl)
        if beta != 0:
            per_token = per_token + beta * kl_tokens
        kl_mean = masked_mean(kl_tokens.detach(), mask)
    elif beta != 0:
        raise ValueError("grpo_loss needs ref_logprobs when beta != 0")
    else:
        kl_mean = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss = aggregate_loss(per_token, mask, aggregation)
    with torch.no_grad():
        stats = {
            "kl": kl_mean,
            "clip_fraction": masked_mean(clip_active, mask),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def sampler_correction(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: SamplerCorrection = "tis",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights that correct for rollouts sampled by an engine whose distribution is not the trainer's.

    With ``rho_t = exp(old_logp_t - sampler_logp_t)`` (the trainer's old policy over the sampler's, on the sampled
    token; both at the sampling temperature):

    - ``"tis"`` (truncated importance sampling): ``w_t = min(rho_t, cap)`` (TRL's ``vllm_importance_sampling_cap``,
      veRL's ``rollout_is_threshold``);
    - ``"token_mask"``: ``w_t = 1`` when ``1/cap <= rho_t <= cap``, else 0 (the token drops out of the surrogate);
    - ``"sequence_mask"``: the sequence's geometric-mean ratio ``exp(mean_t log rho_t)`` over its model tokens;
      every token of a sequence outside ``[1/cap, cap]`` gets 0, the others 1;
    - ``"none"``: every weight 1 (the mismatch is still measured).

    The weights multiply the policy-gradient surrogate per token (``is_weights`` of :func:`ppo_policy_loss`,
    :func:`grpo_loss`); they carry no gradient. Weights at mask-0 positions are 1.

    Stats (detached): ``mismatch_abs`` = masked mean of ``|old_logp - sampler_logp|``, ``mismatch_max`` its max,
    ``corrected_share`` = share of model tokens whose weight the correction changed (truncated or masked).
    """
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction {mode!r}; expected one of {SAMPLER_CORRECTIONS}")
    if cap < 1.0:
        raise ValueError("the importance-sampling cap must be >= 1")
    m = mask != 0
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_rho = torch.where(m, old_logprobs.detach() - sampler_logprobs.detach(), zero)
    rho = torch.exp(log_rho)
    ones = torch.ones_like(rho)
    if mode == "tis":
        weights = torch.clamp(rho, max=cap)
        changed = rho > cap
    elif mode == "token_mask":
        changed = (rho > cap) | (rho < 1.0 / cap)
        weights = torch.where(changed, torch.zeros_like(rho), ones)
    elif mode == "sequence_mask":
        counts = m.sum(-1).clamp(min=1)
        seq_rho = torch.exp(log_rho.sum(-1) / counts)
        outside = (seq_rho > cap) | (seq_rho < 1.0 / cap)
        changed = outside.unsqueeze(-1).expand_as(rho)
        weights = torch.where(changed, torch.zeros_like(rho), ones)
    else:
        weights = ones
        changed = torch.zeros_like(m)
    weights = torch.where(m, weights, ones)
    changed = changed & m
    with torch.no_grad():
        gap = log_rho.abs()
        stats = {
            "mismatch_abs": masked_mean(gap, mask),
            "mismatch_max": gap.max() if gap.numel() else zero,
            "corrected_share": masked_mean(changed.to(rho.dtype), mask),
        }
    return weights.detach(), stats
