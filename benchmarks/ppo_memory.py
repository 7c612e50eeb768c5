"""Peak memory of one PPO update micro-batch on the embedded model (policy + separate critic, fp32, AdamW, CPU):
``ROWS`` random sequences of ``LENGTH`` tokens through ``online_rl._update`` as one micro-batch; prints the peak
resident set before and after. Run one size per process (the peak is per process)::

    python benchmarks/ppo_memory.py --rows 1 --length 1024   # 5.4 GB on SmolLM2-135M (docs/results/bench_train.md)
    python benchmarks/ppo_memory.py --rows 2 --length 1024 --gradient-checkpointing
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

import torch

from sleuth.assets import default_model_dir
from sleuth.train import online_rl
from sleuth.train.online_rl import RLConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ppo_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_dir())
    config = RLConfig(
        model=model,
        algorithm="ppo",
        group_size=1,
        micro_batch=args.rows,
        micro_batch_tokens=0,
        learning_rate=1e-6,
        critic_learning_rate=1e-6,
        gradient_checkpointing=args.gradient_checkpointing,
        progress=False,
    )
    models = online_rl._Models(config, Path(model), None, torch.device("cpu"))
    models.train()
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    rng = random.Random(0)
    seqs = [[rng.randrange(100, models.tokenizer.vocab_size) for _ in range(args.length)] for _ in range(args.rows)]
    episodes, stats = ppo_rows(seqs)
    started = time.perf_counter()
    online_rl._update(models, episodes, stats, config, online_rl.DataParallel())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(
        f"rows {args.rows} x {args.length} tokens, gradient checkpointing {args.gradient_checkpointing}: models "
        f"loaded {loaded:.1f} GB, peak {peak:.1f} GB resident, update {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
