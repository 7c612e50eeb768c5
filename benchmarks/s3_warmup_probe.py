"""Does a (warm-started) s3 searcher open with a search? The log-probability of each possible opening of its first
reply, ``<query>`` (search, the prompt's "not enough" example), ``<search_complete>True`` (stop) and
``<search_complete>False`` (the warm start's first layout), on the searcher prompts of warm-start transcripts, and
p(query) / (p(query) + p(stop)) split by whether the transcript searches. Prompts are rendered as the agent renders
them (chat template, generation prompt), so the numbers are what greedy decoding sees.

    python benchmarks/s3_warmup_probe.py --records runs/learn-s3/warmup-1d25992b961e/records.jsonl \\
        --model ~/.cache/sleuth/models/SmolLM2-135M-Instruct runs/learn-s3/warmup-1d25992b961e/model
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

OPENINGS = {"query": "<query>\n{", "stop": "<search_complete>\nTrue", "false_first": "<search_complete>\nFalse"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, required=True, help="a warm start's records.jsonl")
    parser.add_argument("--model", nargs="+", required=True, help="searcher model directories")
    parser.add_argument("--limit", type=int, default=24, help="transcripts probed")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()][: args.limit]
    for path in args.model:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        logp: dict[str, list[float]] = {k: [] for k in OPENINGS}
        share: dict[bool, list[float]] = {True: [], False: []}
        for record in records:
            prompt = "".join(s["text"] for s in record["messages"][0]["segments"])
            head = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            start = len(tokenizer(head)["input_ids"])
            values = {}
            for name, opening in OPENINGS.items():
                ids = torch.tensor([tokenizer(head + opening)["input_ids"]])
                with torch.no_grad():
                    lp = model(ids).logits[0, :-1].log_softmax(-1)
                values[name] = sum(lp[i - 1, ids[0, i]].item() for i in range(start, ids.shape[1]))
                logp[name].append(values[name])
            q, s = math.exp(values["query"]), math.exp(values["stop"])
            share[bool(record["queries"])].append(q / (q + s))
        print(f"{path}  ({len(records)} transcripts)")
        for name, values in logp.items():
            print(f"  log p({OPENINGS[name]!r}): mean {sum(values) / len(values):.2f}")
        for searches, values in share.items():
            if values:
                print(
                    f"  p(query | query or stop), transcripts that {'search' if searches else 'stop'} ({len(values)}):"
                    f" {min(values):.2f}-{max(values):.2f}"
                )


if __name__ == "__main__":
    main()
