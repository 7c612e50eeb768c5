"""How often does re-tokenizing an episode's text give other ids than those the model sampled? (issue 35 item 1)

Runs s3 and ARENA rollouts with the ``hf`` engine on the embedded SmolLM2-135M-Instruct (``default``), sampling at
temperature 1 as RL does, over questions of a small synthetic world (``sleuth.data.synth``, BM25 index). Every LLM
call records the ids it was given and sampled (``Context.record_tokens``: token-in, token-out). Each episode is then
built twice, as the RL trainer builds it:

* **sampled**: the ids recorded (:func:`sleuth.train.tokens.sampled_chat`), what ``episode_tokens: sampled`` trains;
* **retokenized**: the conversation's text through the chat template (:func:`sleuth.train.tokens.tokenize_chat`),
  what the trainer trained on before (``episode_tokens: retokenize``).

Reported per agent: the share of episodes whose retokenized ids differ from the sampled ones (the whole sequence;
and the model-token sequence alone), and the share of sampled model tokens that the retokenized model tokens do not
reproduce (sampled model ids minus the longest common subsequence-like match of :class:`difflib.SequenceMatcher`).

**Qwen-family tokenizer (a proxy).** Qwen's vocabulary is not available offline, so a stand-in is built: SmolLM2's
byte-level BPE vocabulary and merges behind Qwen2's pre-tokenizer (its split regex: single digits, punctuation runs
that swallow following newlines, ``\\s*[\\r\\n]+``) and Qwen2.5's ChatML template (default system message). No model
samples from it, so its "sampled" ids are a proxy: the prompt as the engine would encode it, then each kept reply and
each observation tokenized on its own (a model emits close to the canonical tokens of its own text), against the
whole conversation re-tokenized. The same proxy is reported for SmolLM2 next to its real figure, to show how much of
the real drift the proxy captures.

    python benchmarks/token_drift.py                    # 24 s3 + 24 ARENA episodes (tens of minutes on 2 cores)
    python benchmarks/token_drift.py --questions 3 --max-new-tokens 64   # quicker (a loaded machine)
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_like_tokenizer(smol: Any) -> Any:
    """SmolLM2's byte-level BPE behind Qwen2's pre-tokenizer regex, with Qwen2.5's ChatML template (module doc)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer.from_str(smol.backend_tokenizer.to_str())
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def compare(sampled: Any, retokenized: Any) -> dict[str, int]:
    """Counts for one episode: whether the sequences differ, and the sampled model tokens not reproduced."""
    model_s = [t for t, m in zip(sampled.input_ids, sampled.model_mask, strict=True) if m]
    model_r = [t for t, m in zip(retokenized.input_ids, retokenized.model_mask, strict=True) if m]
    matcher = difflib.SequenceMatcher(a=model_s, b=model_r, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return {
        "episodes": 1,
        "sequence_differs": int(sampled.input_ids != retokenized.input_ids),
        "model_differs": int(model_s != model_r),
        "model_tokens": len(model_s),
        "model_tokens_differing": len(model_s) - matched,
    }


def proxy_ids(tokenizer: Any, prompt_messages: list[dict[str, Any]], pieces: list[tuple[str, str, bool]]) -> Any:
    """The proxy "sampled" episode of ``tokenizer``: the prompt encoded as an engine would, then each piece
    ``(source, text, eos)`` tokenized alone (a model piece with ``eos`` gets the end-of-turn id)."""
    from sleuth.llm.base import encode_prompt
    from sleuth.train.tokens import sampled_chat

    plain = [{"role": m["role"], "content": m["content"]} for m in prompt_messages]
    prompt_ids = encode_prompt(tokenizer, plain)
    built = []
    for source, text, eos in pieces:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos:
            ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        built.append({"source": source, "ids": ids})
    chat, _ = sampled_chat(prompt_ids, built)
    return chat


def episode_views(method: str, trace: Any) -> tuple[Any, Any, Any] | None:
    """(messages for the text path, (prompt_ids, pieces) for the sampled path, proxy pieces) of one trace."""
    from sleuth.train.arena_rl import _mark_references
    from sleuth.train.s3_rl import trajectory_messages, trajectory_pieces

    if trace.error:
        return None
    if method == "arena":
        step = next((s for s in reversed(trace.steps) if s.messages is not None), None)
        if step is None or step.output is None or not step.meta.get("tokens"):
            return None
        messages = [*_mark_references(step.messages, trace), {"role": "assistant", "content": step.output}]
        tokens = step.meta["tokens"]
        pieces = [{"source": "model", "ids": tokens["sampled"], "logprobs": tokens["logprobs"]}]
        ended = step.meta.get("finish_reason") == "stop"
        return messages, (tokens["prompt"], pieces), [("model", step.output, ended)]
    messages = trajectory_messages(trace)
    sampled = trajectory_pieces(trace)
    if messages is None or sampled is None:
        return None
    segments = [s for s in trace.meta.get("transcript") or [] if s.get("text")]
    last = len(segments) - 1
    proxy = [
        (s["source"], s["text"], i == last and s["source"] == "model" and s.get("eos") is not None)
        for i, s in enumerate(segments)
    ]
    return messages, sampled, proxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=12, help="questions per agent (x --samples episodes)")
    parser.add_argument("--samples", type=int, default=2, help="episodes per question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per reply")
    parser.add_argument("--agents", default="s3,arena", help="comma-separated: s3, arena")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = parser.parse_args()

    from sleuth.agents import Context
    from sleuth.agents.arena import ArenaConfig
    from sleuth.agents.s3 import S3Config
    from sleuth.assets import default_model_dir
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.llm import Sampling
    from sleuth.llm.base import ReplayLLM
    from sleuth.llm.hf import HFLLM
    from sleuth.records import Example
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.bm25 import build_bm25_index
    from sleuth.runner import run
    from sleuth.train.tokens import TokenizationError, sampled_chat, tokenize_chat

    started = time.perf_counter()
    world = Path(tempfile.mkdtemp(prefix="token-drift-"))
    synthesize(world, seed=args.seed, min_hops=2, max_hops=3, train_entities=80, train_questions=args.questions)
    build_bm25_index(world / "corpus.jsonl", world / "index")
    retriever = load_retriever(str(world / "index"))
    questions = list(load_synth(world / "train.jsonl"))[: args.questions]
    llm = HFLLM(str(default_model_dir()), device="cpu", threads=args.threads)
    smol = llm.tokenizer
    qwen = qwen_like_tokenizer(smol)

    def copies(method: str) -> list[Example]:
        out = []
        for example in questions:
            for g in range(args.samples):
                copy = Example.from_dict(example.to_dict())
                copy.id = f"{example.id}#{g}"
                copy.context = []  # ARENA retrieves its references (BM25 top-5)
                out.append(copy)
        return out

    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    s3_sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, stop=("</query>",), seed=args.seed)
    s3_config = S3Config(sampling=s3_sampling, max_turns=2)
    generator = ReplayLLM(lambda request: "unknown", spec="stub-generator")  # the searcher's tokens are measured
    arena_config = ArenaConfig(sampling=sampling, k=5)
    runs = {
        "s3": Context(llm=llm, retriever=retriever, config=s3_config, roles={"generator": generator}),
        "arena": Context(llm=llm, retriever=retriever, config=arena_config),
    }
    report: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "questions": len(questions), "samples": args.samples}
    for method, ctx in runs.items():
        if method not in args.agents.split(","):
            continue
        ctx.record_tokens = True
        t0 = time.perf_counter()
        traces = run(method, copies(method), ctx, concurrency=16, progress=False)
        counts: dict[str, dict[str, int]] = {"smollm2": {}, "smollm2_proxy": {}, "qwen_like_proxy": {}}
        skipped = 0
        for trace in traces:
            views = episode_views(method, trace)
            if views is None:
                skipped += 1
                continue
            messages, (prompt_ids, pieces), proxy = views
            try:
                real = compare(sampled_chat(prompt_ids, pieces)[0], tokenize_chat(smol, messages))
                smol_proxy = compare(proxy_ids(smol, messages[:-1], proxy), tokenize_chat(smol, messages))
                qwen_proxy = compare(proxy_ids(qwen, messages[:-1], proxy), tokenize_chat(qwen, messages))
            except TokenizationError:
                skipped += 1
                continue
            for name, one in (("smollm2", real), ("smollm2_proxy", smol_proxy), ("qwen_like_proxy", qwen_proxy)):
                for key, value in one.items():
                    counts[name][key] = counts[name].get(key, 0) + value
        summary: dict[str, Any] = {"episodes_run": len(traces), "skipped": skipped}
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        for name, c in counts.items():
            n, tokens = c.get("episodes", 0), c.get("model_tokens", 0)
            summary[name] = {
                **c,
                "share_sequence_differs": round(c.get("sequence_differs", 0) / max(n, 1), 3),
                "share_model_differs": round(c.get("model_differs", 0) / max(n, 1), 3),
                "share_model_tokens_differing": round(c.get("model_tokens_differing", 0) / max(tokens, 1), 4),
            }
        report[method] = summary
        print(json.dumps({method: summary}, indent=1), flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"done in {report['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
