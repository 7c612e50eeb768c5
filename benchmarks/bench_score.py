"""Scoring best-of-n candidates on the hf backend: each completion read with its whole prompt, against the
completions of one prompt sharing one pass over it (``HFLLM._score_rows`` groups them; ``_score_separately`` is the
per-row path it falls back to for a prompt with one completion).

This is the ExSearch E-step's load (``BestOfLLM``, best_of = 8: every model call scores its distinct candidates
after the same conversation). Both paths run in one process on the same rows, alternating ``--repeats`` times, so
the ratio of the medians holds on a noisy shared machine; the largest log-probability difference between the two
is printed (they must agree).

    python benchmarks/bench_score.py                      # SmolLM2, ~1.2k-token prompt, 8 completions
    python benchmarks/bench_score.py --prompt-words 300   # shorter prompt: less to share
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from sleuth.llm.hf import HFLLM

WORDS = [
    "the",
    "river",
    "city",
    "was",
    "born",
    "film",
    "director",
    "wrote",
    "Paris",
    "source",
    "founded",
    "in",
    "year",
    "of",
    "its",
    "a",
    "by",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-words", type=int, default=900)
    parser.add_argument("--completions", type=int, default=8, help="distinct candidates of the prompt (best_of)")
    parser.add_argument("--max-completion-words", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the measurement as JSON")
    args = parser.parse_args()
    if args.model is None:
        from sleuth.assets import ensure_default_model

        args.model = str(ensure_default_model())
    import torch

    torch.set_num_threads(args.threads)
    llm = HFLLM(args.model, device="cpu")
    rng = random.Random(args.seed)
    text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
    prompt = llm.encode_prompt([{"role": "user", "content": text}])
    rows = []
    for _ in range(args.completions):
        words = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, args.max_completion_words)))
        rows.append((prompt, llm.tokenizer(words, add_special_tokens=False)["input_ids"]))

    separate_s, shared_s, difference = [], [], 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        alone = llm._score_separately(rows)
        separate_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        shared = llm._score_rows(rows)
        shared_s.append(time.perf_counter() - start)
        difference = max(
            [difference]
            + [
                abs(p - q)
                for a, b in zip(alone, shared, strict=True)
                for p, q in zip(a.token_logprobs, b.token_logprobs, strict=True)
            ]
        )
    result = {
        "model": args.model,
        "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}, "
        f"{args.threads} threads",
        "prompt_tokens": len(prompt),
        "completion_tokens": [len(c) for _, c in rows],
        "separate_s": statistics.median(separate_s),
        "shared_s": statistics.median(shared_s),
        "ratio": statistics.median(separate_s) / statistics.median(shared_s),
        "max_token_logprob_difference": difference,
    }
    print(
        f"{result['prompt_tokens']} prompt tokens, {args.completions} completions: each with its prompt "
        f"{result['separate_s']:.2f} s, sharing the prompt pass {result['shared_s']:.2f} s "
        f"({result['ratio']:.1f}x); max |token log-prob difference| {difference:.1e}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
