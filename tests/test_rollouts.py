"""The rollout store: incremental, resumable, refuses to mix producers, keeps failed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.agents import Context
from sleuth.agents.baselines import DirectConfig
from sleuth.records import Example
from sleuth.train.rollouts import ROLLOUTS_FILE, RolloutStore, RolloutStoreError, collect, model_revision
from tests.scripted import ScriptedLLM


def examples(n: int) -> list[Example]:
    return [Example(id=f"q{i}", question=f"question {i}?", answers=[f"a{i}"]) for i in range(n)]


def test_collect_writes_every_sample_and_resumes_without_repeats(tmp_path: Path) -> None:
    producer = {"method": "direct", "model": "scripted", "sampling": {"temperature": 1.0}}
    store = RolloutStore(tmp_path / "store", producer=producer)
    llm = ScriptedLLM(lambda prompt: "reply to " + prompt.rsplit(" ", 1)[-1])
    ctx = Context(llm=llm, config=DirectConfig())
    assert collect("direct", examples(3), ctx, store, samples=2) == 6
    groups = store.groups()
    assert sorted(groups) == ["q0", "q1", "q2"] and [r.sample for r in groups["q1"]] == [0, 1]
    assert groups["q1"][0].trace.answer == "reply to 1?"
    # simulate a kill: drop the last rollout and tear the line before it
    lines = store.file.read_text().splitlines(keepends=True)
    store.file.write_text("".join(lines[:4]) + lines[4][:20])
    reopened = RolloutStore(tmp_path / "store", producer=producer)
    assert len(reopened) == 4
    calls_before = len(llm.prompts)
    assert collect("direct", examples(3), ctx, reopened, samples=2) == 2
    assert len(llm.prompts) - calls_before == 2 and len(reopened) == 6
    assert len(reopened.keys()) == 6


def test_store_refuses_a_different_producer(tmp_path: Path) -> None:
    RolloutStore(tmp_path / "s", producer={"method": "direct", "revision": "a"})
    with pytest.raises(RolloutStoreError, match="revision"):
        RolloutStore(tmp_path / "s", producer={"method": "direct", "revision": "b"})
    assert RolloutStore(tmp_path / "s").producer["revision"] == "a"  # reading without a producer is fine


def test_failed_runs_are_stored_with_their_error(tmp_path: Path) -> None:
    def explode(prompt: str) -> str:
        raise RuntimeError("backend down")

    store = RolloutStore(tmp_path / "s")
    collect("direct", examples(2), Context(llm=ScriptedLLM(explode), config=DirectConfig()), store)
    rollouts = list(store)
    assert len(rollouts) == 2 and all("backend down" in (r.trace.error or "") for r in rollouts)


def test_unreadable_line_is_reported_with_its_number(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "s")
    (tmp_path / "s" / ROLLOUTS_FILE).write_text('{"key": 1}\n')
    with pytest.raises(RolloutStoreError, match=r"rollouts.jsonl:1"):
        list(store)


def test_model_revision_changes_when_weights_change(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_revision(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert first and model_revision(tmp_path) != first
    assert model_revision(tmp_path / "missing") is None
