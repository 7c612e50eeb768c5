"""Token-in, token-out episodes (issue 35 item 1): the engine's sampled ids and log-probs, recorded in the Trace, are
exactly the ids the RL update trains on, where re-tokenizing the text would give other ids."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents import Context
from sleuth.agents.base import kept_token_ids
from sleuth.agents.s3 import S3Config
from sleuth.llm import Request, Sampling
from sleuth.llm.hf import HFLLM
from sleuth.records import Example, Trace
from sleuth.runner import run
from sleuth.train.online_rl import Episode, _tokenize
from sleuth.train.s3_rl import trajectory_messages, trajectory_pieces
from sleuth.train.tokens import prompt_observations, sampled_chat, tokenize_chat
from tests.scripted import ListRetriever, ScriptedLLM, passages


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> HFLLM:
    return HFLLM(str(tiny_model_dir), device="cpu", threads=1)


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as one id per byte-level character: a tokenization a model may sample, never the canonical one."""
    return [
        tokenizer.convert_tokens_to_ids(c)
        for c in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)[0][0]
    ]


def test_hf_returns_the_prompt_ids_the_sampled_ids_and_their_log_probs_at_the_sampling_temperature(
    llm: HFLLM,
) -> None:
    import torch

    request = Request.chat("Who wrote Hamlet?")
    for temperature in (1.0, 0.5):
        sampling = Sampling(temperature=temperature, max_new_tokens=10, seed=1, n=2)
        generation = asyncio.run(llm.generate([request], sampling))[0]
        assert generation.prompt_ids == llm.encode_prompt(request.messages or [])
        assert generation.sampled_ids is not None and generation.logprobs is not None
        for ids, logprobs, text_ids in zip(
            generation.sampled_ids, generation.logprobs, generation.token_ids or [], strict=True
        ):
            assert ids[: len(text_ids)] == text_ids and len(ids) - len(text_ids) in (0, 1)  # + the EOS, if sampled
            assert len(logprobs) == len(ids)
            with torch.no_grad():
                logits = llm.model(torch.tensor([generation.prompt_ids + ids])).logits[0].float()
            start = len(generation.prompt_ids) - 1
            expected = torch.log_softmax(logits[start : start + len(ids)] / temperature, dim=-1)
            expected = expected[torch.arange(len(ids)), torch.tensor(ids)]
            assert torch.allclose(expected, torch.tensor(logprobs), atol=1e-4)


def test_prompt_ids_are_what_the_engine_continues(llm: HFLLM) -> None:
    """Token-in: a request's ``prompt_ids`` win over its text (here the text says something else entirely)."""
    sampling = Sampling(temperature=0.0, max_new_tokens=6)
    real = Request(prompt="Paris is a city")
    ids = llm.encode_prompt("Paris is a city")
    by_text = asyncio.run(llm.generate([real], sampling))[0]
    by_ids = asyncio.run(llm.generate([Request(prompt="unrelated words", prompt_ids=ids)], sampling))[0]
    assert by_ids.prompt_ids == ids and by_ids.sampled_ids == by_text.sampled_ids


def test_a_sampled_episode_trains_on_the_sampled_ids_where_retokenizing_would_merge_them(
    tiny_model_dir: Path, llm: HFLLM
) -> None:
    tokenizer = llm.tokenizer
    messages = [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris is"}]
    prompt_ids = llm.encode_prompt(messages[:1])
    sampled = char_ids(tokenizer, "Paris is") + [tokenizer.eos_token_id]  # as a model may sample them
    logprobs = [-0.5] * len(sampled)
    retokenized = tokenize_chat(tokenizer, messages)
    model_retokenized = [t for t, m in zip(retokenized.input_ids, retokenized.model_mask, strict=True) if m]
    assert model_retokenized != sampled  # the merge: "Paris" is fewer tokens re-tokenized

    episode = Episode(group="g", messages=messages, reward=1.0, components={}, prompt_ids=prompt_ids)
    episode.pieces = [{"source": "model", "ids": sampled, "logprobs": logprobs}]
    assert _tokenize(episode, tokenizer, None, "sampled")
    assert episode.token_path == "sampled"
    assert episode.input_ids == prompt_ids + sampled
    assert episode.mask == [0] * len(prompt_ids) + [1] * len(sampled)
    assert episode.sampler_logprobs == logprobs
    # the fallback, and the explicit setting, re-tokenize the text
    episode.pieces = None
    assert _tokenize(episode, tokenizer, None, "sampled") and episode.token_path == "retokenize"
    assert episode.input_ids == retokenized.input_ids


def test_sampled_chat_masks_observations_and_inserted_text_and_keeps_prompt_observations_cuttable() -> None:
    chat, logprobs = sampled_chat(
        [1, 2, 3],
        [
            {"source": "model", "ids": [10, 11], "logprobs": [-1.0, -2.0]},
            {"source": "observation", "ids": [20, 21, 22]},
            {"source": "inserted", "ids": [30]},
            {"source": "model", "ids": [12], "logprobs": [-3.0]},
        ],
        prompt_observation_mask=[0, 1, 0],
    )
    assert chat.input_ids == [1, 2, 3, 10, 11, 20, 21, 22, 30, 12]
    assert chat.model_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert chat.observation_mask == [0, 1, 0, 0, 0, 2, 2, 2, 0, 0]
    assert logprobs == [-1.0, -2.0, -3.0]
    _, unknown = sampled_chat([1], [{"source": "model", "ids": [5], "logprobs": None}])
    assert unknown is None


def test_prompt_observations_find_the_marked_documents_in_the_prompt_ids(llm: HFLLM) -> None:
    tokenizer = llm.tokenizer
    content = "Read: Paris is a city. Answer."
    user = {"role": "user", "content": content}
    user["segments"] = [  # type: ignore[assignment]
        {"source": "prompt", "text": "Read:"},
        {"source": "observation", "text": " Paris is a city."},
        {"source": "prompt", "text": " Answer."},
    ]
    prompt_ids = llm.encode_prompt([{"role": "user", "content": content}])  # with the generation prompt
    marks = prompt_observations(tokenizer, [user], prompt_ids)
    inside = tokenizer.decode([t for t, m in zip(prompt_ids, marks, strict=True) if m])
    assert len(marks) == len(prompt_ids) and inside.strip() == "Paris is a city."


def test_kept_ids_of_a_reply_cut_mid_token_completed_or_not_matching(llm: HFLLM) -> None:
    tokenizer = llm.tokenizer
    sampled = tokenizer("Paris is a city", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    whole = kept_token_ids(tokenizer, sampled, [-1.0] * len(sampled), "Paris is a city")
    assert whole is not None and whole["ids"] == sampled[:-1] and whole["eos"] == tokenizer.eos_token_id
    assert whole["eos_logprob"] == -1.0 and whole["inserted"] == []
    # cut inside a token ("Paris is a ci"): the whole token that covers the cut is kept, as sampled; no EOS
    cut = kept_token_ids(tokenizer, sampled, None, "Paris is a ci")
    assert cut is not None and cut["eos"] is None and cut["eos_logprob"] is None and cut["inserted"] == []
    # the same keys on every path (s3 reads them all: a cut reply once raised KeyError and lost its episode)
    assert set(cut) == set(whole)
    assert tokenizer.decode(cut["ids"]).startswith("Paris is a ci") and cut["ids"] == sampled[: len(cut["ids"])]
    assert not tokenizer.decode(cut["ids"][:-1]).startswith("Paris is a ci")
    # text put back after the reply: inserted ids, tokenized once
    longer = kept_token_ids(tokenizer, sampled, None, "Paris is a city</query>")
    assert longer is not None and longer["ids"] == sampled[:-1]
    assert tokenizer.decode(longer["inserted"]) == "</query>"
    assert kept_token_ids(tokenizer, sampled, None, "London") is None


def test_s3_rollouts_continue_from_ids_and_train_on_exactly_the_sampled_ids(llm: HFLLM) -> None:
    """The tiny model as the searcher (its random replies are invalid actions: feedback observations are inserted
    and the next reply continues): each reply's prompt ids are the previous prompt, the kept sampled ids and the
    observation's ids; the episode is the final context plus the last reply, masked on the sampled ids only."""
    tokenizer = llm.tokenizer
    config = S3Config(sampling=Sampling(temperature=1.0, max_new_tokens=8, stop=("</query>",), seed=3), max_turns=2)
    retriever = ListRetriever(lambda q: passages("Paris is a city.", "London is big.", "x"))
    ctx = Context(llm=llm, retriever=retriever, config=config, roles={"generator": ScriptedLLM(lambda _: "Paris")})
    ctx.record_tokens = True
    trace: Trace = run("s3", [Example(id="q", question="Capital of France?", answers=["Paris"])], ctx, progress=False)[
        0
    ]
    assert trace.error is None
    steps = [s for s in trace.steps if s.kind == "searcher"]
    assert len(steps) >= 2 and "tokens_off" not in trace.meta
    segments = [s for s in trace.meta["transcript"] if s.get("text")]
    head = trace.meta["searcher_prompt_ids"]
    assert steps[0].meta["tokens"]["prompt"] == head
    context = list(head)
    model_ids: list[int] = []
    model_logprobs: list[float] = []
    models = iter(s for s in segments if s["source"] == "model")
    for k, step in enumerate(steps):
        record = step.meta["tokens"]
        assert record["prompt"] == context  # token-in: exactly the ids so far
        segment = next(models)
        assert record["sampled"][: len(segment["ids"])] == segment["ids"]  # the kept ids are the sampled ones
        model_ids += segment["ids"]
        model_logprobs += record["logprobs"][: len(segment["ids"])]
        context += segment["ids"] + segment.get("inserted", [])
        following = segments[segments.index(segment) + 1 : segments.index(segment) + 2]
        if k + 1 < len(steps):
            assert following and following[0]["source"] == "observation"
            assert following[0]["ids"] == tokenizer(following[0]["text"], add_special_tokens=False)["input_ids"]
            context += following[0]["ids"]
    prompt_ids, pieces = trajectory_pieces(trace) or ([], [])
    episode = Episode(group="g", messages=trajectory_messages(trace), reward=0.0, components={})
    episode.prompt_ids, episode.pieces = prompt_ids, pieces
    assert _tokenize(episode, tokenizer, None, "sampled")
    last = segments[-1]
    end = [last["eos"]] if last["source"] == "model" and last.get("eos") is not None else []
    assert episode.input_ids == context + end
    trained = [t for t, m in zip(episode.input_ids or [], episode.mask or [], strict=True) if m]
    assert trained == model_ids + end
    assert episode.sampler_logprobs is not None
    assert all(math.isclose(a, b) for a, b in zip(episode.sampler_logprobs, model_logprobs, strict=False))


def test_the_token_record_of_a_step_survives_the_trace_json_round_trip_exactly() -> None:
    from sleuth.records import Step

    tokens = {"prompt": [1, 2, 3], "sampled": [7, 8, 2], "logprobs": [-0.1234567890123, -2.5e-12, -17.000000000001]}
    step = Step(kind="answer", output="hi", meta={"tokens": tokens})
    trace = Trace(example=Example(id="q", question="?"), method="arena", steps=[step])
    again = Trace.from_json(trace.to_json())
    assert again.steps[0].meta["tokens"] == tokens and again.to_dict() == trace.to_dict()
