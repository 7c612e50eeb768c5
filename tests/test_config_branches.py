"""The non-default branch of config fields that no shipped config, benchmark or other test sets: each option is
shown to do what its docstring says, so none is dead weight (the rest of the audit: every field of every config is
set somewhere in configs/, benchmarks/ or tests/)."""

from __future__ import annotations

import json
from pathlib import Path

from sleuth.agents.s3 import S3Config, format_docs, observation_text, task_question
from sleuth.eval.evaluate import EvalConfig, evaluate, read_traces
from sleuth.eval.metrics import judge_key
from sleuth.records import Example, Passage
from tests.test_evaluate import write_dataset

PASSAGES = [Passage(id="1", title="Jaws (film)", text="A 1975 film."), Passage(id="2", title="Jaws", text="A fish.")]


def test_s3_titles_quoted_by_default_and_bare_when_asked() -> None:
    assert format_docs(PASSAGES).splitlines()[0] == 'Doc 1 (Title: "Jaws (film)") A 1975 film.'
    assert format_docs(PASSAGES, quote_titles=False).splitlines()[0] == "Doc 1 (Title: Jaws (film)) A 1975 film."


def test_s3_observation_title_space_puts_the_space_back() -> None:
    # the code writes "Doc 1(Title: ...)" in search observations; the option restores the space
    assert "Doc 1(Title:" in observation_text(PASSAGES, S3Config())
    spaced = observation_text(PASSAGES, S3Config(observation_title_space=True))
    assert "Doc 1 (Title:" in spaced and "Doc 1(Title:" not in spaced


def test_s3_question_mark_is_the_codes_preprocessing_and_can_be_turned_off() -> None:
    example = Example(id="q", question="who directed Jaws", answers=["Spielberg"])
    assert task_question(example, S3Config()).startswith("who directed Jaws?")
    assert task_question(example, S3Config(question_mark=False)).startswith("who directed Jaws")
    assert "?" not in task_question(example, S3Config(question_mark=False))


def test_eval_judge_variant_reaches_the_judge(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``judge_variant`` picks the judge prompt: the cached verdicts are keyed by it."""
    data = write_dataset(tmp_path / "toy" / "dev.jsonl", 2)
    config = EvalConfig(
        method="direct",
        data=[str(data)],
        out=str(tmp_path / "run"),
        llm=f"hf:{tiny_model_dir}",
        max_new_tokens=4,
        judge="same",
        judge_variant="paper_text",
    )
    evaluate(config, progress=False)
    traces = read_traces(tmp_path / "run" / "traces.jsonl")
    keys = {json.loads(line)["key"] for line in (tmp_path / "run" / "judge-cache.jsonl").read_text().splitlines()}
    spec = f"hf:{tiny_model_dir}"
    for t in traces:
        assert judge_key("paper_text", t.answer or "", t.example.answers, spec) in keys
        assert judge_key("paper", t.answer or "", t.example.answers, spec) not in keys


def test_sft_cot_answer_reaches_the_cot_records(tmp_path: Path) -> None:
    """``SFTConfig.cot_answer`` decides how a ``cot`` source's targets mark their answer."""
    from sleuth.train.sft import SFTConfig, SFTSource, build_source
    from tests.test_sft import gsm8k_socratic, reply_text

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps(gsm8k_socratic().to_dict()) + "\n")
    source = SFTSource(path=str(data), format="synth", kind="cot")
    boxed, _ = build_source(source, SFTConfig())
    tagged, _ = build_source(source, SFTConfig(cot_answer="answer_tag"))
    assert reply_text(boxed[0]).endswith("\\boxed{72}.")
    assert reply_text(tagged[0]).endswith("<answer>72</answer>.")


def test_acesearcher_subanswer_cleanup_off_substitutes_the_raw_sub_answer() -> None:
    """``subanswer_cleanup: false`` (the released code) keeps a sub-answer as written, trailing period included."""
    from sleuth.agents.acesearcher import AceSearcherConfig
    from tests.test_acesearcher import QUESTION, run_one

    example = Example(id="q", question=QUESTION, answers=["Ridley Scott"])
    for cleanup, alien in ((True, "Ridley Scott"), (False, "Ridley Scott.")):
        trace, llm, _ = run_one(example, AceSearcherConfig(subanswer_cleanup=cleanup))
        parsed = [s.parsed for s in trace.steps if s.kind == "subanswer"]
        assert parsed[:2] == ["Steven Spielberg", alien]
        assert any(f"Who is older, Steven Spielberg or {alien}?" in p for p in llm.prompts)  # #2 substituted
        assert cleanup != any("Steven Spielberg or Ridley Scott.?" in p for p in llm.prompts)


def test_exsearch_select_max_new_tokens_budgets_only_the_selection_call() -> None:
    from sleuth.agents.exsearch import ExSearchConfig
    from sleuth.llm import Sampling
    from tests.test_exsearch import run_one

    replies = ["<THINK> q1\n", "<RECORD> e1\n<FINAL>", "four"]

    def respond(prompt: str) -> str:
        return "[1]" if "select the useful documents" in prompt else replies.pop(0)

    config = ExSearchConfig(
        max_steps=2, select=True, k=3, select_max_new_tokens=7, sampling=Sampling(max_new_tokens=40)
    )
    trace, llm, _ = run_one(respond, config)
    assert trace.answer == "four"
    marker = "select the useful documents"
    budgets = [(marker in p, s.max_new_tokens) for p, s in zip(llm.prompts, llm.samplings, strict=True)]
    assert (True, 7) in budgets and all(b == 7 for select, b in budgets if select)
    assert (False, 40) in budgets and all(b != 7 for select, b in budgets if not select)


def test_vllm_spec_generation_config_and_args_reach_the_server_command() -> None:
    from sleuth.llm import vllm_server as vs

    default = vs.server_config("m", {}, python="p").arguments(1)
    assert default[default.index("--generation-config") + 1] == "vllm"
    options = {"generation_config": "auto", "args": "--seed 3 --enforce-eager"}
    args = vs.server_config("m", options, python="p").arguments(1)
    assert args[args.index("--generation-config") + 1] == "auto"
    assert args[-3:] == ["--seed", "3", "--enforce-eager"]


def test_sft_length_sorted_off_is_the_plain_random_sampler(tiny_model_dir: Path, tmp_path: Path) -> None:
    from sleuth.train import packing
    from sleuth.train.sft import build_dataset, build_trainer
    from tests.test_sft import tiny_config

    config = tiny_config(tiny_model_dir, tmp_path / "out", batch_size=4, per_device_batch_size=2, length_sorted=False)
    train, _, _ = build_dataset(config)
    sampler = build_trainer(config, train[:4])._get_train_sampler()
    assert not isinstance(sampler, packing.LengthSortedSampler)


def test_sft_doc_agent_prompts_reach_the_program_records(tmp_path: Path) -> None:
    """``SFTConfig.doc_agent`` is the document agent whose prompts a ``pot`` source's records are built with."""
    from sleuth.agents.acesearcher_doc import AceSearcherDocConfig
    from sleuth.train.sft import SFTConfig, SFTSource, build_source, pot_records
    from tests.test_sft import tatqa_example, user_text

    example = tatqa_example()
    data = tmp_path / "tatqa.jsonl"
    data.write_text(json.dumps(example.to_dict()) + "\n")
    source = SFTSource(path=str(data), format="synth", kind="pot")
    paper, _ = build_source(source, SFTConfig())
    code, _ = build_source(source, SFTConfig(doc_agent=AceSearcherDocConfig(prompts="code")))
    assert user_text(paper[0]) != user_text(code[0])
    assert user_text(code[0]) == user_text(pot_records(example, AceSearcherDocConfig(prompts="code"), "s")[0])


def test_rl_rollout_adapter_dir_is_where_the_served_adapters_are_written(tmp_path: Path, tiny_model_dir: Path) -> None:
    from sleuth.train.online_rl import train_online
    from tests.test_online_rl import DirectTask, _config, _examples, _LoraServer

    server = _LoraServer()
    try:
        spec = f"openai:tiny@{server.url}?timeout=5&max_retries=0&backoff=0.01"
        shared = tmp_path / "shared-disk"
        config = _config(
            tmp_path,
            tiny_model_dir,
            lora=True,
            lora_r=4,
            rollout_server=spec,
            steps=1,
            rollout_adapter_dir=str(shared),
        )
        train_online(config, DirectTask(lambda t: 0.0), _examples())
        assert [p.name for p in shared.iterdir()] == ["step-00000"]
        assert not (tmp_path / "rl" / "served").exists()
        (loaded,) = server.history
        assert loaded.endswith("step-00000")
    finally:
        server.close()
