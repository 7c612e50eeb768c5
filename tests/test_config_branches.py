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
