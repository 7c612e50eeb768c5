"""Training-step throughput on the embedded model against this machine's own dense-matmul peak, before and after
length-aware micro-batching (sleuth.train.packing).

Three steps, each on the same seeded length mix (uniform in ``--min-len``..``--max-len`` tokens), each timed as one
whole optimizer step (forward, backward, AdamW) over ``--sequences`` sequences:

- **SFT** (causal-LM NLL on every token, as TRL's SFTTrainer with ``num_items_in_batch``): ``rows1`` (one sequence
  per micro-batch: no padding, sleuth's default ``per_device_batch_size: 1``), ``random`` (``--rows`` per
  micro-batch in random order, padded to the longest: HF's random sampler with a larger per-device batch) and
  ``sorted`` (the same step's sequences sorted by length, then cut into ``--rows``: :class:`LengthSortedSampler`);
- **DPO** (sigmoid loss; the policy's forward+backward and the frozen reference's forward over chosen and rejected
  stacked in one batch, as TRL's DPOTrainer): ``--sequences`` / 2 pairs, ``rows1`` (one pair per micro-batch:
  chosen and rejected padded to each other), ``random`` and ``sorted`` (``--rows`` / 2 pairs per micro-batch);
- **PPO update**: sleuth's own ``online_rl._update`` (policy and a separate critic, both full fine-tuning, AdamW),
  ``fixed`` (``micro_batch: --rows``, ``micro_batch_tokens: 0``: the old path) against ``budget``
  (``micro_batch_tokens`` default, 4096: sorted, cut by a token budget).

Useful FLOPs (padding excluded) per sequence of ``s`` tokens: ``k x (P s + 2 L h s^2)``, with ``P`` the model's
parameters (SmolLM2's embedding is tied: the lm_head matmul uses it), ``L`` layers, ``h`` the hidden size, and
``k`` = 6 for a forward+backward (2 forward, 4 backward): ``6 P s + 12 L h s^2``, PaLM's appendix-B count (the
attention term counts the whole s x s score matrix, as dense kernels compute it). A frozen forward (DPO's
reference) counts ``k = 2``; the PPO critic counts as the policy less its lm_head. The peak is a torch fp32 matmul
of two ``--peak-n`` square matrices, ``2 n^3`` FLOPs, best of several, measured in the same run and threads.
"Share of peak" = useful FLOPs / step time / peak. Padding waste = padded tokens / (useful + padded).

    python benchmarks/bench_train.py --parts sft,dpo --out sft_dpo.json   # ~6 min on 2 cores
    python benchmarks/bench_train.py --parts ppo --out ppo.json           # ~5 min, ~13 GB: apart on a 24 GB machine
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sleuth.train import packing


def matmul_peak(n: int, repeats: int) -> float:
    """Best FLOP/s of an fp32 ``n x n`` matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_flops(lengths: Sequence[int], params: int, layers: int, hidden: int, k: int = 6) -> float:
    return float(sum(k * (params * s + 2 * layers * hidden * s * s) for s in lengths))


def pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
    return ids, attention


def groups_of(order: Sequence[int], rows: int) -> list[list[int]]:
    return [list(order[i : i + rows]) for i in range(0, len(order), rows)]


def plans(lengths: Sequence[int], rows: int, seed: int) -> dict[str, list[list[int]]]:
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    sorted_order = sorted(order, key=lambda i: (-lengths[i], i))
    return {"rows1": groups_of(order, 1), "random": groups_of(order, rows), "sorted": groups_of(sorted_order, rows)}


def waste(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> dict[str, float]:
    useful, padded = packing.padding_waste([[lengths[i] for i in g] for g in groups])
    return {"useful_tokens": useful, "padded_tokens": padded - useful, "padding_waste": (padded - useful) / padded}


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def sft_step(model: Any, optimizer: Any, seqs: list[list[int]], groups: list[list[int]], pad_id: int) -> None:
    total = sum(len(s) - 1 for s in seqs)
    optimizer.zero_grad(set_to_none=True)
    for g in groups:
        ids, attention = pad([seqs[i] for i in g], pad_id)
        labels = ids.masked_fill(attention == 0, -100)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        (nll / total).backward()
    optimizer.step()


def dpo_step(
    model: Any, ref: Any, optimizer: Any, pairs: list[tuple[list[int], list[int], int]], groups: list[list[int]]
) -> None:
    """TRL's layout: chosen and rejected of a micro-batch's pairs stacked, padded to one width; ``pairs[i]`` =
    (prompt+chosen, prompt+rejected, prompt length)."""
    optimizer.zero_grad(set_to_none=True)

    def logps(m: Any, ids: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (lp * completion[:, 1:]).sum(-1)

    for g in groups:
        rows = [pairs[i][0] for i in g] + [pairs[i][1] for i in g]
        ids, attention = pad(rows, 0)
        completion = attention.clone().float()
        for r, i in enumerate(list(g) + list(g)):
            completion[r, : pairs[i][2]] = 0
        with torch.no_grad():
            ref_lp = logps(ref, ids, attention, completion)
        lp = logps(model, ids, attention, completion)
        n = len(g)
        margin = (lp[:n] - ref_lp[:n]) - (lp[n:] - ref_lp[n:])
        loss = -torch.nn.functional.logsigmoid(0.1 * margin).sum() / len(pairs)
        loss.backward()
    optimizer.step()


def ppo_rows(seqs: Sequence[list[int]]) -> tuple[list[Any], list[dict[str, Any]]]:
    """PPO episodes of the token sequences ``seqs`` (the first third of each a masked prompt) and the per-token
    statistics ``online_rl._update`` reads (old / reference log-probs, advantages, values, returns: random)."""
    from sleuth.train.online_rl import Episode

    episodes, stats = [], []
    for ids in seqs:
        mask = [0] * (len(ids) // 3) + [1] * (len(ids) - len(ids) // 3)
        episodes.append(Episode(group="g", messages=None, reward=0.0, components={}, input_ids=list(ids), mask=mask))
        m = torch.tensor(mask[1:], dtype=torch.float32)
        n = len(ids) - 1
        stats.append(
            {
                "old": torch.full((n,), -5.0),
                "ref": torch.full((n,), -5.0),
                "mask": m,
                "adv": torch.randn(n) * m,
                "values": torch.randn(n),
                "returns": torch.randn(n),
            }
        )
    return episodes, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch of the padded paths")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-n", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="sft,dpo,ppo")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.model is None:
        from sleuth.assets import ensure_default_model

        args.model = str(ensure_default_model())
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(args.model)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.sequences)]
    vocab = cfg.vocab_size
    seqs = [[rng.randint(10, vocab - 1) for _ in range(n)] for n in lengths]
    peak_before = matmul_peak(args.peak_n, 5)
    print(f"peak {peak_before / 1e9:.1f} GFLOP/s; lengths {lengths}", flush=True)
    result: dict[str, Any] = {
        "command": "python benchmarks/bench_train.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads},
        "torch": torch.__version__,
        "model": Path(args.model).name,
        "lengths": lengths,
        "flops_formula": "6*P*s + 12*L*h*s^2 per sequence of s tokens (forward+backward); 2*P*s + 4*L*h*s^2 frozen",
        "peak_flops": {"before": peak_before},
        "load_avg": {"start": os.getloadavg()},
        "parts": {},
    }

    def fresh() -> tuple[Any, Any]:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-6)

    def report(part: str, name: str, seconds: list[float], flops: float, tokens: int, extra: dict) -> None:
        best = min(seconds)
        row = {
            "seconds": seconds,
            "useful_tokens_per_s": tokens / best,
            "useful_gflop_per_s": flops / best / 1e9,
            "share_of_peak": flops / best / peak_before,
            **extra,
        }
        result["parts"].setdefault(part, {})[name] = row
        print(
            f"{part:4s} {name:7s} {row['useful_tokens_per_s']:7.1f} tok/s  {row['share_of_peak']:.1%} of peak  "
            f"waste {extra.get('padding_waste', 0):.1%}  {seconds}",
            flush=True,
        )
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))

    parts = args.parts.split(",")
    params = None
    if "sft" in parts:
        model, optimizer = fresh()
        params = sum(p.numel() for p in model.parameters())
        flops = step_flops(lengths, params, layers, hidden)
        sft_step(model, optimizer, [seqs[0][:64]], [[0]], 0)  # warm-up
        for name, groups in plans(lengths, args.rows, args.seed).items():
            secs = [timed(lambda g=groups: sft_step(model, optimizer, seqs, g, 0)) for _ in range(args.repeats)]
            report("sft", name, secs, flops, sum(lengths), waste(groups, lengths))
        del model, optimizer
        gc.collect()
    if "dpo" in parts:
        model, optimizer = fresh()
        params = sum(p.numel() for p in model.parameters())
        ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        # pairs: a prompt of a third of the first sequence, two completions of the pair's lengths
        pairs = []
        for i in range(0, len(seqs) - 1, 2):
            prompt = seqs[i][: min(lengths[i], lengths[i + 1]) // 3]
            pairs.append((seqs[i], prompt + seqs[i + 1][len(prompt) :], len(prompt)))
        rows_of = [max(len(c), len(r)) for c, r, _ in pairs]  # chosen and rejected pad to each other
        useful = [len(c) + len(r) for c, r, _ in pairs]
        flops = step_flops([len(s) for c, r, _ in pairs for s in (c, r)], params, layers, hidden, 6)
        flops += step_flops([len(s) for c, r, _ in pairs for s in (c, r)], params, layers, hidden, 2)
        dpo_step(model, ref, optimizer, [(seqs[0][:64], seqs[1][:64], 16)], [[0]])  # warm-up
        for name, groups in plans(rows_of, max(1, args.rows // 2), args.seed).items():
            padded = sum(2 * len(g) * max(rows_of[i] for i in g) for g in groups)
            extra = {
                "useful_tokens": sum(useful),
                "padded_tokens": padded - sum(useful),
                "padding_waste": (padded - sum(useful)) / padded,
            }
            secs = [timed(lambda g=groups: dpo_step(model, ref, optimizer, pairs, g)) for _ in range(args.repeats)]
            report("dpo", name, secs, flops, sum(useful), extra)
        del model, optimizer, ref
        gc.collect()
    if "ppo" in parts:
        from sleuth.train import online_rl
        from sleuth.train.online_rl import RLConfig

        episodes, stats = ppo_rows(seqs)
        for name, tokens in (("fixed", 0), ("budget", None)):
            config = RLConfig(
                model=args.model,
                algorithm="ppo",
                group_size=1,
                micro_batch=args.rows,
                micro_batch_tokens=tokens,
                learning_rate=1e-6,
                critic_learning_rate=1e-6,
                progress=False,
            )
            models = online_rl._Models(config, Path(args.model), None, torch.device("cpu"))
            models.train()
            params = sum(p.numel() for p in models.policy.parameters())
            critic = sum(p.numel() for p in models.critic_parameters())
            flops = step_flops(lengths, params, layers, hidden) + step_flops(lengths, critic, layers, hidden)
            budget = packing.micro_batch_budget(tokens, config.micro_batch_aggregation)
            order = list(range(len(seqs)))
            random.seed(args.seed)
            random.shuffle(order)  # what _update does first, after the same seed
            groups = packing.micro_batches(order, [lengths[i] for i in order], args.rows, budget)
            dp = online_rl.DataParallel()
            short = dataclasses.replace(episodes[0], input_ids=seqs[0][:64], mask=episodes[0].mask[:64])
            online_rl._update(models, [short], [{k: v[:63] for k, v in stats[0].items()}], config, dp)  # warm-up

            def update(m: Any = models, c: RLConfig = config, dp: Any = dp) -> None:
                random.seed(args.seed)
                online_rl._update(m, episodes, stats, c, dp)

            secs = [timed(update) for _ in range(args.repeats)]
            extra = waste(groups, lengths)
            report("ppo", name, secs, flops, sum(lengths), extra)
            del models
            gc.collect()
    result["peak_flops"]["after"] = matmul_peak(args.peak_n, 5)
    result["load_avg"]["end"] = os.getloadavg()
    print(f"peak after {result['peak_flops']['after'] / 1e9:.1f} GFLOP/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
