"""The local transformers backend on a tiny random model: batching, stop strings, n, score."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sleuth.llm import LLMError, Request, Sampling, load_llm
from sleuth.llm.hf import HFLLM, length_buckets

PROMPTS = [
    "The capital of France is",
    "Who wrote Hamlet?",
    "Search the corpus and answer with evidence about Paris and the Seine.",
    "Question: what",
    "answer",
    "William Shakespeare wrote Hamlet in London. The capital",
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> HFLLM:
    return HFLLM(str(tiny_model_dir), device="cpu")


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("max_padding", [0.0, 1.25])
def test_greedy_batched_equals_one_by_one(llm: HFLLM, max_padding: float) -> None:
    llm.max_padding = max_padding
    sampling = Sampling(max_new_tokens=12)
    requests = [Request(prompt=p) for p in PROMPTS] + [Request.chat(p) for p in PROMPTS]
    alone = [run(llm.generate([r], sampling))[0].texts for r in requests]
    calls_before = llm.stats.calls
    batched = run(llm.generate(requests, sampling))
    calls = llm.stats.calls - calls_before
    if max_padding == 0:
        assert calls == 1, "without length buckets all rows share one model.generate"
    else:
        assert 1 < calls < len(requests), "prompts of very different lengths go to a few length buckets"
    assert [g.texts for g in batched] == alone
    assert any(t[0] for t in alone), "the tiny model should produce some text"
    assert len({t[0] for t in alone}) > 1, "different prompts should give different continuations"


def test_length_buckets_bound_padding() -> None:
    lengths = [100, 900, 110, 880, 500, 95, 520]
    buckets = length_buckets(lengths, 1.25)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        assert len(bucket) * max(lengths[i] for i in bucket) <= 1.25 * sum(lengths[i] for i in bucket)
    assert len(buckets) == 3
    assert length_buckets(lengths, 0) == [sorted(range(len(lengths)), key=lambda i: lengths[i])]
    assert length_buckets([], 1.25) == []


def test_concurrent_callers_are_micro_batched(llm: HFLLM) -> None:
    sampling = Sampling(max_new_tokens=6)

    async def many() -> list:
        return await asyncio.gather(*(llm.generate([Request(prompt=p)], sampling) for p in PROMPTS * 3))

    before_calls, before_requests = llm.stats.calls, llm.stats.requests
    results = run(many())
    assert llm.stats.requests - before_requests == len(PROMPTS) * 3
    assert llm.stats.calls - before_calls < len(PROMPTS) * 3
    assert [r[0].text for r in results[: len(PROMPTS)]] == [r[0].text for r in results[len(PROMPTS) :][: len(PROMPTS)]]


def test_stop_strings_are_honoured_per_row(llm: HFLLM) -> None:
    free = run(llm.generate([Request(prompt=p) for p in PROMPTS], Sampling(max_new_tokens=16)))
    # Pick a stop string that occurs in the middle of one row's free-running text.
    target = next(i for i, g in enumerate(free) if len(g.text) > 6)
    stop = free[target].text[3:6]
    stopped = run(llm.generate([Request(prompt=p) for p in PROMPTS], Sampling(max_new_tokens=16, stop=(stop,))))
    for before, after in zip(free, stopped, strict=True):
        expected = before.text.split(stop)[0] if stop in before.text else before.text
        assert after.text == expected
        assert stop not in after.text
    assert stopped[target].finish_reasons == ["stop"]
    assert stopped[target].completion_tokens[0] < free[target].completion_tokens[0]


def test_n_samples(llm: HFLLM) -> None:
    sampled = run(llm.generate([Request(prompt=PROMPTS[0])], Sampling(max_new_tokens=10, temperature=1.5, n=4)))[0]
    assert len(sampled.texts) == 4 and len(sampled.completion_tokens) == 4
    assert len(set(sampled.texts)) > 1, "temperature 1.5 on a random model should vary"
    greedy = run(llm.generate([Request(prompt=PROMPTS[0])], Sampling(max_new_tokens=10, n=3)))[0]
    assert len(greedy.texts) == 3 and len(set(greedy.texts)) == 1


def test_seeded_sampling_is_reproducible(llm: HFLLM) -> None:
    sampling = Sampling(max_new_tokens=10, temperature=1.0, n=2, seed=1234)
    first = run(llm.generate([Request(prompt=PROMPTS[1])], sampling))[0].texts
    second = run(llm.generate([Request(prompt=PROMPTS[1])], sampling))[0].texts
    assert first == second


def test_length_finish_reason_and_token_counts(llm: HFLLM) -> None:
    out = run(llm.generate([Request.chat(PROMPTS[2])], Sampling(max_new_tokens=5)))[0]
    assert out.prompt_tokens == len(llm.encode_prompt([{"role": "user", "content": PROMPTS[2]}]))
    assert out.completion_tokens[0] <= 5
    if out.completion_tokens[0] == 5:
        assert out.finish_reasons == ["length"]


def test_score_matches_logits(llm: HFLLM) -> None:
    prompt, completion = "The capital of France is", " Paris on the Seine."
    score = run(llm.score(prompt, completion))
    prompt_ids = llm.tokenizer(prompt)["input_ids"]
    completion_ids = llm.tokenizer(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(llm.model(ids).logits[0], dim=-1)
    expected = [logprobs[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(completion_ids)]
    assert score.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert score.logprob == pytest.approx(sum(expected), abs=1e-3)
    assert len(score.tokens) == len(completion_ids)


def test_score_batched_equals_alone(llm: HFLLM) -> None:
    pairs = [("Who wrote Hamlet?", " William Shakespeare"), ("The capital", " of France is Paris."), ("a", " b")]
    alone = [run(llm.score(p, c)).logprob for p, c in pairs]

    async def together() -> list:
        return await asyncio.gather(*(llm.score(p, c) for p, c in pairs))

    assert [s.logprob for s in run(together())] == pytest.approx(alone, abs=1e-4)


def test_score_chunks_rows_to_bound_logits_memory(llm: HFLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget smaller than one row's logits scores every row in its own forward pass, in the caller's order."""
    import sleuth.llm.hf as hf

    rows = [
        (llm.encode_prompt(p), llm.tokenizer(c, add_special_tokens=False)["input_ids"])
        for p, c in [
            ("The capital of France", " is Paris, a large city."),
            ("a", " b"),
            ("Who wrote Hamlet?", " Shakespeare"),
        ]
    ]
    whole = llm._score_separately(rows)
    calls = llm.stats.calls
    monkeypatch.setattr(hf, "SCORE_LOGITS_BYTES", 1)
    chunked = llm._score_separately(rows)
    assert llm.stats.calls - calls == len(rows)
    assert [s.logprob for s in chunked] == pytest.approx([s.logprob for s in whole], abs=1e-4)
    assert [len(s.token_logprobs) for s in chunked] == [len(c) for _, c in rows]


def test_completions_of_one_prompt_share_its_pass_and_score_as_alone(
    llm: HFLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Best-of-n candidates share their prompt: one pass over it and its cache, the same values as each row whole
    (a one-token completion, a long one, a repeated one, a row of another prompt, and chunked continuations)."""
    import sleuth.llm.hf as hf

    prompt = llm.encode_prompt([{"role": "user", "content": "Who wrote Hamlet, and when?"}])
    texts = [" Shakespeare", " William Shakespeare wrote it around 1600.", " Shakespeare", " Marlowe, in 1590"]
    rows = [(prompt, llm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    rows.insert(2, (prompt, rows[1][1][:1]))  # one token: scored from the prompt pass alone
    rows.append((llm.encode_prompt("a"), llm.tokenizer(" b", add_special_tokens=False)["input_ids"]))
    alone = [llm._score_separately([row])[0] for row in rows]
    calls = llm.stats.calls
    shared = llm._score_rows(rows)
    assert llm.stats.calls - calls == 3  # the prompt, its continuations, the other prompt's row
    for got, want, (_, completion) in zip(shared, alone, rows, strict=True):
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert got.tokens == llm.tokenizer.convert_ids_to_tokens(completion)
    monkeypatch.setattr(hf, "SCORE_LOGITS_BYTES", 1)  # every continuation in its own pass
    chunked = llm._score_rows(rows)
    assert [s.logprob for s in chunked] == pytest.approx([s.logprob for s in alone], abs=1e-3)


def test_chat_score_uses_generation_prompt(llm: HFLLM) -> None:
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    chat = run(llm.score(messages, "Shakespeare"))
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    raw = run(llm.score(text, "Shakespeare"))
    # The raw string is tokenized with special tokens parsed the same way, so the two agree.
    assert chat.logprob == pytest.approx(raw.logprob, abs=1e-4)


def test_spec_loading_and_errors(tiny_model_dir) -> None:
    llm = load_llm(f"hf:{tiny_model_dir}?device=cpu&max_batch=4")
    assert isinstance(llm, HFLLM) and llm.spec.startswith("hf:")
    with pytest.raises(LLMError, match="unknown hf option"):
        load_llm(f"hf:{tiny_model_dir}?colour=blue")
    with pytest.raises(LLMError, match="unknown LLM backend"):
        load_llm("nope:thing")
    with pytest.raises(LLMError, match="hf:/does/not/exist: no model found"):
        load_llm("hf:/does/not/exist")


def test_final_assistant_message_is_continued_in_place(llm: HFLLM) -> None:
    """A prefilled assistant turn (s3's rolling trajectory) is continued, not closed and followed by a new turn."""
    user = [{"role": "user", "content": "Search for it."}]
    prefilled = [*user, {"role": "assistant", "content": "<query>capital"}]
    text = llm.tokenizer.decode(llm.encode_prompt(prefilled))
    assert text.endswith("<|im_start|>assistant\n<query>capital")
    fresh = llm.tokenizer.decode(llm.encode_prompt(user))
    assert fresh.endswith("<|im_start|>assistant\n") and text.startswith(fresh)


def test_decoded_text_is_made_encodable(llm: HFLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (slow, Python) tokenizer can decode to a lone surrogate; the backend hands on only encodable text."""
    decode = llm.tokenizer.decode
    monkeypatch.setattr(llm.tokenizer, "decode", lambda ids, **kw: "ANS-7 \ud800" + decode(ids, **kw))
    (gen,) = run(llm.generate([Request(prompt="The capital of France is")], Sampling(max_new_tokens=4)))
    assert gen.texts[0].startswith("ANS-7 \ufffd")
    gen.texts[0].encode("utf-8")


def test_rows_of_different_seeds_share_one_batch_and_each_seed_set_reproduces_its_draw(llm: HFLLM) -> None:
    """Per-call seeds (sleuth.agents.base.call_seed) must not split the micro-batch: the batcher's key leaves the
    seed out, and the batch's torch seed comes from its rows' seeds (bucket_seed)."""
    from sleuth.llm.hf import bucket_seed

    prompts = [PROMPTS[1]] * 4

    async def seeded(seeds: list[int]) -> list[str]:
        calls = [
            llm.generate([Request(prompt=p)], Sampling(max_new_tokens=10, temperature=1.5, seed=s))
            for p, s in zip(prompts, seeds, strict=True)
        ]
        return [g[0].text for g in await asyncio.gather(*calls)]

    before = llm.stats.calls
    first = run(seeded([11, 12, 13, 14]))
    assert llm.stats.calls - before == 1  # one generate for the four rows
    assert len(set(first)) > 1, "four rows of one prompt at temperature 1.5 on a random model should vary"
    assert run(seeded([11, 12, 13, 14])) == first
    assert bucket_seed([None, None]) is None and bucket_seed([5, None, 5]) == 5
    assert bucket_seed([1, 2]) != bucket_seed([2, 1]) and bucket_seed([1, 2]) == bucket_seed([1, 2])
