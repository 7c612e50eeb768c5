"""SFT for AceSearcher: the builders reproduce the agents' prompts, released data parsing, mixing, loss masking,
full / LoRA training, resumption after an interruption."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents import Context
from sleuth.agents.acesearcher import AceSearcherConfig, parse_decomposition
from sleuth.agents.acesearcher_doc import AceSearcherDocConfig
from sleuth.records import Example, Passage
from sleuth.runner import run
from sleuth.train.config import ConfigError
from sleuth.train.sft import (
    SFTConfig,
    SFTSource,
    Skip,
    breakdown_text,
    build_dataset,
    context_qa_records,
    cot_records,
    decompose_records,
    final_records,
    gold_steps,
    load_sft_config,
    mix_counts,
    pot_records,
    read_released,
    released_record,
)
from tests.scripted import ListRetriever, ScriptedLLM

needs_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="the train extra (trl, peft, datasets) is not installed"
)

FIXTURE = Path(__file__).parent / "fixtures" / "acesearcher_sft_sample.jsonl"
ROOT = Path(__file__).parent.parent

VELMO = Passage("p1", "Velmo Guild", "Velmo Guild is an organisation. Velmo Guild was founded by Ann Dask.")
ANN = Passage("p2", "Ann Dask", "Ann Dask is a poet. Ann Dask was born in the city of Pella.")
NOISE = Passage("p3", "Velmo Society", "Velmo Society was founded by Bo Rell.")


def bridge_example() -> Example:
    return Example(
        id="e1",
        question="Where was the founder of Velmo Guild born?",
        answers=["Pella"],
        context=[VELMO, ANN],
        supporting_ids=["p1", "p2"],
        decomposition=[
            {"question": "Who founded Velmo Guild?", "answer": "Ann Dask", "supporting_ids": ["p1"]},
            {"question": "Where was #1 born?", "answer": "Pella", "supporting_ids": ["p2"]},
        ],
    )


def user_text(record: dict[str, Any]) -> str:
    return record["prompt"][-1]["content"]


def reply_text(record: dict[str, Any]) -> str:
    return record["completion"][0]["content"]


# ------------------------------------------------------------------------------------------ prompts = the agents'


@pytest.mark.parametrize("prompts", ["paper", "code"])
def test_builders_send_exactly_the_agents_prompts(prompts: str) -> None:
    # One passage per sub-question (context budget 1, final budget 3 // 2 = 1), so that the passages the builders
    # show are exactly those the scripted retriever gives the agent.
    agent = AceSearcherConfig() if prompts == "paper" else AceSearcherConfig.official_code()
    agent = dataclasses.replace(agent, budget_rule="paper", total_passages=3)
    example = bridge_example()
    decompose = decompose_records(example, agent, AceSearcherDocConfig(), "s")[0]
    steps = context_qa_records(example, agent, random.Random(0), "s", passages=1, steps=True)[1:]
    final = final_records(example, agent, random.Random(0), "s")[0]

    # Play the gold outputs through the agent; the retriever returns each step's own passage.
    def respond(prompt: str) -> str:
        text = prompt.split(": ", 1)[1]
        if text == user_text(decompose):
            return reply_text(decompose)
        for record in steps:
            if text == user_text(record):
                return reply_text(record)
        return reply_text(final)

    llm = ScriptedLLM(respond)
    retriever = ListRetriever(lambda q: [VELMO] if "Velmo" in q else [ANN])
    trace = run("acesearcher", [example], Context(llm=llm, retriever=retriever, config=agent), progress=False)[0]
    assert trace.error is None, trace.meta.get("traceback")
    sent = [r.messages[0]["content"] for r in llm.requests]
    assert sent == [user_text(decompose), *(user_text(r) for r in steps), user_text(final)]
    assert all(len(r.messages) == 1 for r in llm.requests)  # one user turn, no system prompt: as in the records
    assert [s.fallback for s in trace.steps if s.kind != "search"] == [None, None, None, None]
    assert trace.answer == "Pella"
    assert reply_text(decompose) == "### Q1: Who founded Velmo Guild?\n### Q2: Where was #1 born?"
    assert parse_decomposition(reply_text(decompose))[1] is None  # the agent parses it cleanly
    assert reply_text(final).endswith("<answer>Pella</answer>")
    assert [reply_text(r) for r in steps] == ["Ann Dask", "Pella"]


def test_claim_examples_use_the_fact_variant() -> None:
    example = Example(
        id="c1",
        question="Velmo Guild was founded by a poet.",
        answers=["yes"],
        kind="claim",
        context=[VELMO, ANN],
        supporting_ids=["p1", "p2"],
        decomposition=[
            {"question": "Velmo Guild was founded by Ann Dask.", "answer": "yes", "supporting_ids": ["p1"]},
            {"question": "Ann Dask is a poet.", "answer": "yes", "supporting_ids": ["p2"]},
        ],
    )
    agent = AceSearcherConfig()
    assert "claim" in user_text(decompose_records(example, agent, AceSearcherDocConfig())[0])
    qa = context_qa_records(example, agent, random.Random(0))[0]
    assert "verify whether the claim" in user_text(qa) and reply_text(qa) == "Yes"
    final = final_records(example, agent, random.Random(0))[0]
    assert "passages" not in user_text(final) and reply_text(final).endswith("<answer>Yes</answer>")


def gsm8k_socratic() -> Example:
    rationale = (
        "How many clips did Natalia sell in May? ** Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "How many clips did she sell in all? ** Natalia sold 48+24 = <<48+24=72>>72 clips altogether."
    )
    return Example(
        id="g1",
        question="Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
        answers=["72"],
        kind="math",
        metadata={"rationale": rationale, "format": "gsm8k"},
    )


def tatqa_example() -> Example:
    table = Passage(
        "t", "Table", "| | 2019 | 2018 |\n| --- | --- | --- |\n| Sales | 44.1 | 56.7 |", meta={"type": "table"}
    )
    text = Passage("x", "Paragraph 1", "Sales fell in 2019.", meta={"type": "paragraph"})
    return Example(
        id="t1",
        question="What was the percentage change in sales?",
        answers=["-22.22"],
        kind="math",
        context=[table, text],
        supporting_ids=["t"],
        metadata={"derivation": "(44.1-56.7)/56.7", "scale": "percent", "format": "tatqa"},
    )


@pytest.mark.parametrize("prompts", ["paper", "code"])
@pytest.mark.parametrize("make", [gsm8k_socratic, tatqa_example], ids=["gsm8k", "tatqa"])
def test_document_builders_send_the_doc_agents_prompts(make: Any, prompts: str) -> None:
    example = make()
    doc = AceSearcherDocConfig(prompts=prompts)
    pot = pot_records(example, doc, "s")[0]
    breakdown = breakdown_text(example)  # the gold sub-questions, else the question as Q1
    assert f"{breakdown}." in user_text(pot)
    if example.id == "g1":
        decompose = decompose_records(example, AceSearcherConfig(), doc, "s")[0]
        assert reply_text(decompose) == breakdown  # the breakdown the program prompt gets is the gold decomposition
    llm = ScriptedLLM([breakdown, reply_text(pot)])
    trace = run("acesearcher_doc", [example], Context(llm=llm, config=doc), progress=False)[0]
    assert trace.error is None, trace.meta.get("traceback")
    sent = [r.messages[0]["content"] for r in llm.requests]
    assert sent[1] == user_text(pot)
    if example.id == "g1":
        assert sent[0] == user_text(decompose)
    assert trace.answer in ("72", "-22.22")  # the target program reproduces the gold answer when run


def test_cot_targets_and_their_answer_mark() -> None:
    example = gsm8k_socratic()
    boxed = reply_text(cot_records(example, AceSearcherDocConfig())[0])
    assert boxed.endswith("\\boxed{72}.") and "<<" not in boxed and "Natalia sold 48/2 = 24 clips in May." in boxed
    tagged = reply_text(cot_records(example, AceSearcherDocConfig(), answer_format="answer_tag")[0])
    assert tagged.endswith("<answer>72</answer>.")


def test_pot_falls_back_to_the_answer_without_a_usable_derivation() -> None:
    example = tatqa_example()
    example.metadata["derivation"] = "made up"
    assert "ans = -22.22" in reply_text(pot_records(example, AceSearcherDocConfig())[0])
    example = Example(id="s", question="Which segment?", answers=["Fixed Price"], context=[Passage("a", "", "x")])
    assert "ans = 'Fixed Price'" in reply_text(pot_records(example, AceSearcherDocConfig())[0])


def test_gold_decompositions_from_each_dataset_shape() -> None:
    musique = Example(id="m", question="q", decomposition=[{"question": "#1 >> capital", "answer": "Stanley"}])
    assert gold_steps(musique)[0]["question"] == "What is the capital of #1?"
    wiki = Example(
        id="w",
        question="Where was the director of The Zone born?",
        context=[Passage("z", "The Zone", "..."), Passage("d", "Denys Desjardins", "...")],
        metadata={
            "evidences": [
                ["The Zone", "director", "Denys Desjardins"],
                ["Denys Desjardins", "place of birth", "Montreal"],
            ]
        },
    )
    assert gold_steps(wiki) == [
        {"question": "What is the director of The Zone?", "answer": "Denys Desjardins", "supporting_ids": ["z"]},
        {"question": "What is the place of birth of #1?", "answer": "Montreal", "supporting_ids": ["d"]},
    ]
    assert [s["question"] for s in gold_steps(gsm8k_socratic())][0] == "How many clips did Natalia sell in May?"
    with pytest.raises(Skip, match="no_gold_decomposition"):
        decompose_records(Example(id="n", question="q"), AceSearcherConfig(), AceSearcherDocConfig())
    strategy = Example(id="s", question="q?", answers=["no"], kind="claim", decomposition=[{"question": "a?"}])
    with pytest.raises(Skip, match="no_gold_subanswers"):
        final_records(strategy, AceSearcherConfig(), random.Random(0))


def test_context_qa_shows_gold_then_distractors_within_the_budget() -> None:
    example = bridge_example()
    example.context = [VELMO, NOISE, ANN] + [Passage(f"n{i}", f"N{i}", f"filler {i}.") for i in range(20)]
    records = [context_qa_records(example, AceSearcherConfig(), random.Random(s), passages=4)[0] for s in range(6)]
    for record in records:
        text = user_text(record)
        assert "Velmo Guild was founded" in text and "born in the city of Pella" in text
        assert text.count("filler ") + text.count("Bo Rell") == 2
    assert len({user_text(r) for r in records}) > 1  # the order and the distractors depend on the seed


# --------------------------------------------------------------------------------------------- released data


def test_released_fixture_parses_and_reports_malformed_lines() -> None:
    records, malformed, read = read_released(str(FIXTURE))
    assert read == 12 and len(records) == 6
    lines = [m.split(": ", 1)[0] for m in malformed]
    assert lines == [f"{FIXTURE}:{n}" for n in (6, 7, 8, 9, 11, 13)]
    assert "invalid JSON" in malformed[0] and "output is empty" in malformed[1]
    assert "not the assistant" in malformed[2] and "unsupported role 'tool'" in malformed[3]
    alpaca = records[1]
    assert alpaca["prompt"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert alpaca["prompt"][1]["content"].startswith("You have the following context passages:\nTitanic")
    multi = records[4]
    assert [m["role"] for m in multi["prompt"]] == ["user", "assistant", "user"] and reply_text(multi) == "Paris"
    history = records[5]
    assert [m["content"] for m in history["prompt"]] == [
        "Name an even number.",
        "2",
        "Name a prime number below 5.\nAnswer with one number.",
    ]
    assert all(r["kind"] == "released" for r in records)
    assert len(read_released(str(FIXTURE), limit=3)[0]) == 3
    reply = [{"role": "assistant", "content": "a"}]
    own = {"prompt": [{"role": "user", "content": "q", "name": "x"}], "completion": reply}
    assert released_record(own, "s")["prompt"] == [{"role": "user", "content": "q"}]  # one schema for the dataset
    with pytest.raises(ValueError, match="role"):
        released_record({"prompt": [{"role": "tool", "content": "q"}], "completion": [{"role": "x"}]}, "s")


@needs_trl
def test_released_hub_name_goes_to_datasets_and_missing_files_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load(name: str, split: str) -> list[dict[str, Any]]:
        calls.append((name, split))
        return [{"instruction": "q", "output": "a"}, {"instruction": "q"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    records, malformed, _ = read_released("AceSearcher/Search-SFT")
    assert calls == [("AceSearcher/Search-SFT", "train")] and len(records) == 1
    assert malformed == ["AceSearcher/Search-SFT[train][1]: output should be a string, got NoneType"]
    with pytest.raises(FileNotFoundError):
        read_released("no/such/file.jsonl")


# ------------------------------------------------------------------------------------------------ the mixture


def test_mix_counts() -> None:
    assert mix_counts([100, 10], [1.0, 0.5], None) == [100, 5]
    assert mix_counts([100, 10, 50], [1, 1, 2], 100) == [25, 25, 50]
    assert mix_counts([7, 7, 7], [1, 1, 1], 10) == [4, 3, 3]
    assert mix_counts([0, 10], [5, 1], 6) == [0, 6]  # an empty source's share goes to the others


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sleuth.data.synth import synthesize

    out = tmp_path_factory.mktemp("world")
    knobs = {"train_entities": 60, "dev_entities": 20, "test_entities": 20, "dev_questions": 2, "test_questions": 2}
    synthesize(out, seed=3, train_questions=12, **knobs)
    return out


def test_synthetic_world_mixture_is_seeded_and_summarised(world: Path) -> None:
    train_file = str(world / "train.jsonl")
    config = SFTConfig(
        sources=[
            SFTSource(path=train_file, format="synth", kind="decompose", weight=1.0),
            SFTSource(path=train_file, format="synth", kind="context_qa", steps=True, weight=1.0),
            SFTSource(path=train_file, format="synth", kind="final", weight=2.0),
            SFTSource(path=str(FIXTURE), kind="released", weight=1.0),
        ],
        num_examples=40,
        val_fraction=0.1,
    )
    train, val, summary = build_dataset(config)
    again, _, _ = build_dataset(config)
    assert train == again and len(train) == 40
    assert summary["train_by_kind"] == {"decompose": 8, "context_qa": 8, "final": 16, "released": 8}
    decompose, context_qa, final, released = summary["sources"]
    assert decompose["read"] == 12 and decompose["built"] == 12 and decompose["val"] == 1
    assert context_qa["built"] > 12  # one record per question plus one per gold sub-question
    assert released["malformed"] == 6 and released["malformed_records"][0].startswith(f"{FIXTURE}:6:")
    val_prompts = {user_text(r) for r in val}
    assert not val_prompts & {user_text(r) for r in train}  # held out before mixing
    record = next(r for r in train if r["kind"] == "final")
    assert "You have the following passages:" in user_text(record) and "<answer>" in reply_text(record)
    other = build_dataset(SFTConfig(sources=config.sources, num_examples=40, val_fraction=0.1, seed=7))[0]
    assert other != train


def test_config_file_and_overrides(tmp_path: Path) -> None:
    config = load_sft_config(ROOT / "configs" / "sft_synth.yaml", {"max_steps": "5", "lora_r": "16"})
    assert config.max_steps == 5 and config.lora_r == 16 and config.sources[0].synth == {"seed": 0}
    assert config.sources[1].steps is True and config.learning_rate == 5e-6 and config.adam_beta2 == 0.98
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  - {path: x.jsonl, kind: context_qa, wieght: 2}\n")
    with pytest.raises(ConfigError, match="wieght"):
        load_sft_config(bad)
    bad.write_text("sources:\n  - {path: x.jsonl, kind: summarise}\n")
    with pytest.raises(ConfigError, match="kind"):
        load_sft_config(bad)


# ---------------------------------------------------------------------------------------------------- training


def tiny_config(tiny_model_dir: Path, out: Path, **options: Any) -> SFTConfig:
    base: dict[str, Any] = dict(
        model=str(tiny_model_dir),
        output_dir=str(out),
        sources=[SFTSource(path=str(FIXTURE), kind="released")],
        val_fraction=0.0,
        max_length=256,
        max_steps=2,
        learning_rate=1e-2,
        batch_size=2,
        per_device_batch_size=2,
        warmup_ratio=0.0,
        save_steps=100,
        logging_steps=1,
        bf16=False,
        gradient_checkpointing=False,
    )
    base.update(options)
    return SFTConfig(**base).validate()


@needs_trl
def test_labels_mask_every_prompt_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    from sleuth.train.sft import build_trainer

    config = tiny_config(tiny_model_dir, tmp_path / "out")
    train, _, _ = build_dataset(config)
    trainer = build_trainer(config, train[:2])
    batch = next(iter(trainer.get_train_dataloader()))
    tokenizer = trainer.processing_class
    by_ids = {}
    for record in train[:2]:
        full = tokenizer.apply_chat_template(record["prompt"] + record["completion"], tokenize=True, return_dict=True)
        by_ids[tuple(full["input_ids"])] = record
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        n = int(mask.sum())
        record = by_ids[tuple(ids[:n].tolist())]  # the batch row is exactly the chat-templated record
        prompt = tokenizer.apply_chat_template(
            record["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        p = len(prompt["input_ids"])
        assert (labels[:p] == -100).all()  # system, user and the assistant header: no loss
        assert (labels[p:n] == ids[p:n]).all()  # the completion and its end-of-turn token: trained
        assert (labels[n:] == -100).all()  # padding
        assert tokenizer.decode(ids[p:n]).startswith(reply_text(record))


def _weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@needs_trl
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_changes_the_weights_and_saves_a_loadable_model(
    tiny_model_dir: Path, tmp_path: Path, lora: bool
) -> None:
    from sleuth.llm import Request, Sampling, load_llm
    from sleuth.train.sft import train_sft

    out = tmp_path / "out"
    options: dict[str, Any] = {"lora": True, "learning_rate": 5e-2} if lora else {"val_fraction": 0.2, "eval_steps": 2}
    train_sft(tiny_config(tiny_model_dir, out, **options))
    before, after = _weights(tiny_model_dir), _weights(out)
    assert before.keys() == after.keys()  # LoRA merged: a plain model again
    changed = [k for k in before if not (before[k] == after[k]).all()]
    if lora:  # only the adapted linear layers move
        assert changed and all("proj" in k for k in changed)
    else:
        assert len(changed) > len(before) // 2
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]
    assert [e["step"] for e in log if "eval_loss" in e] == ([] if lora else [2])  # the held-out record
    summary = json.loads((out / "data_summary.json").read_text())
    assert summary["train"] == (6 if lora else 5) and summary["sources"][0]["malformed"] == 6
    llm = load_llm(f"hf:{out}")
    import asyncio

    generation = asyncio.run(llm.generate([Request.chat("hi")], Sampling(max_new_tokens=3)))[0]
    assert generation.completion_tokens[0] <= 3


@needs_trl
def test_lora_adapter_mode_saves_the_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    from sleuth.train.sft import train_sft

    out = tmp_path / "out"
    train_sft(tiny_config(tiny_model_dir, out, lora=True, lora_save="adapter", max_steps=1))
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    from sleuth.llm import load_llm

    llm = load_llm(f"hf:{out}")  # transformers loads the base model recorded in the adapter, then the adapter
    assert getattr(llm.model, "_hf_peft_config_loaded", False)


@needs_trl
def test_an_interrupted_run_resumes_from_its_last_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from sleuth.train.sft import main

    class StopAt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            if state.global_step == 3:
                control.should_training_stop = True  # as if killed after step 3, one step past checkpoint-2
            return control

    out = tmp_path / "out"
    config = tiny_config(tiny_model_dir, out, max_steps=4, save_steps=2, per_device_batch_size=1, batch_size=1)
    from sleuth.train.sft import train_sft

    train_sft(config, callbacks=[StopAt()])
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    logged = [e["step"] for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in e]
    assert logged == [1, 2, 3]
    cfg = tmp_path / "sft.json"
    from sleuth.train.config import to_mapping

    cfg.write_text(json.dumps(to_mapping(config)))
    main(cfg, ["save_total_limit=5"])  # the CLI's entry point: picks up checkpoint-2 by itself
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    steps = [e["step"] for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in e]
    # the second run continued at step 3, it did not start over; step 3 is trained again and logged once
    assert steps == [1, 2, 3, 4]


def test_trim_log_keeps_the_steps_through_the_checkpoint_and_drops_a_line_cut_by_the_kill(tmp_path: Path) -> None:
    from sleuth.train.common import trim_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.2}\n{"step": 4, "lo')
    assert [r["step"] for r in trim_log(log, 2, write=False)] == [1, 2]
    assert log.read_text().endswith('"lo')  # write=False leaves the file to the writing process
    assert [r["step"] for r in trim_log(log, 3)] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    assert trim_log(tmp_path / "absent.jsonl", 5) == []
