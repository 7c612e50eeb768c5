"""The ARENA GRPO and s3 trainers end to end on a tiny random model: data preparation, rewards in the log, the
cached naive-RAG baseline, the s3 filter, masks of a real s3 trajectory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sleuth.agents.arena import ArenaConfig
from sleuth.agents.s3 import S3Config
from sleuth.llm import Sampling
from sleuth.records import Example, Passage, Trace
from sleuth.train.arena_rl import (
    ArenaRLConfig,
    ArenaTask,
    load_arena_examples,
    relevant_numbers,
    train_arena,
)
from sleuth.train.online_rl import rollout_traces
from sleuth.train.s3_rl import S3RLConfig, train_s3, trajectory_messages
from tests.scripted import ListRetriever, ScriptedLLM

PASSAGES = [
    Passage(id="a", title="Ann", text="Ann lives in Rome."),
    Passage(id="b", title="Bob", text="Bob lives in Oslo."),
    Passage(id="c", title="Paris", text="Paris is in France."),
]


def _write(path: Path, examples: list[Example]) -> str:
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in examples))
    return str(path)


# ------------------------------------------------------------------------------------------------ ARENA


def _arena_examples() -> list[Example]:
    return [
        Example(id="e1", question="Where does Ann live?", answers=["Rome"], context=PASSAGES, supporting_ids=["a"]),
        Example(id="e2", question="Where does Bob live?", answers=["Oslo"], context=PASSAGES, supporting_ids=["b"]),
        Example(id="e3", question="Where is Paris?", answers=["France"], context=PASSAGES, supporting_ids=["zz"]),
    ]


def test_arena_examples_without_supporting_references_are_counted(tmp_path: Path) -> None:
    path = _write(tmp_path / "train.jsonl", _arena_examples())
    kept, report = load_arena_examples([path])
    assert [e.id for e in kept] == ["e1", "e2"] and report[path]["no_supporting_reference"] == 1


def test_arena_examples_whose_supporting_references_are_cut_are_counted(tmp_path: Path) -> None:
    path = _write(tmp_path / "train.jsonl", _arena_examples())
    kept, report = load_arena_examples([path], max_references=1)  # the agent shows only "a"
    assert [e.id for e in kept] == ["e1"]
    assert report[path]["supporting_references_cut"] == 1 and report[path]["no_supporting_reference"] == 1
    kept, _ = load_arena_examples([path], max_references=2)
    assert [e.id for e in kept] == ["e1", "e2"]


def test_relevant_numbers_follow_the_agents_numbering() -> None:
    example = Example(id="x", question="q", answers=["a"], supporting_ids=["c", "a"])
    trace = Trace(example=example, method="arena", meta={"reference_ids": ["a", "b", "c"]})
    assert relevant_numbers(trace) == {1, 3}


def _shuffled_task(shuffle: bool, max_references: int | None = None) -> ArenaTask:
    agent = ArenaConfig(sampling=Sampling(max_new_tokens=64), max_references=max_references)
    config = ArenaRLConfig(train_files=["unused"], group_size=8, seed=3, agent=agent, shuffle_references=shuffle)
    return ArenaTask(config)


def test_arena_shuffled_references_give_each_episode_its_own_seeded_order() -> None:
    example = Example(
        id="e",
        question="q",
        answers=["Rome"],
        supporting_ids=["a"],
        context=[*PASSAGES, Passage(id="d", title="Dan", text="Dan.")],
    )

    def orders(task: ArenaTask, group: str = "0:0:e") -> list[list[str]]:
        copies = [task.episode_example(Example.from_dict(example.to_dict()), group, g) for g in range(8)]
        return [[p.id for p in c.context] for c in copies]

    shuffled = orders(_shuffled_task(True, max_references=3))
    assert all(sorted(o[:3]) == ["a", "b", "c"] and o[3] == "d" for o in shuffled)  # the cut reference stays cut
    assert len({tuple(o) for o in shuffled}) > 2
    assert orders(_shuffled_task(True, max_references=3)) == shuffled  # a resumed step draws the same orders
    assert orders(_shuffled_task(True, max_references=3), "1:0:e") != shuffled  # another step, others
    assert orders(_shuffled_task(False)) == [["a", "b", "c", "d"]] * 8  # the paper: the dataset's order


def test_arena_shuffled_references_contrast_a_reader_that_cites_a_place() -> None:
    """A policy that always cites reference 1 earns the same in every episode of a group that shares one order (no
    advantage, no push away from it); with an order per episode it is right only where 1 is the gold one, so the group
    contrasts it. A reader that cites the reference it read is right in every order."""

    def cites_one(_prompt: str) -> str:
        return "<relevance>\n[1]\n</relevance>\n\n<analysis>\nSee [1].\n</analysis>\n\n<answer>\nRome\n</answer>"

    def reads(prompt: str) -> str:
        lines = prompt.rsplit("<references>", 1)[1].splitlines()
        number = next(line.split(".")[0] for line in lines if "Ann lives" in line)
        return cites_one(prompt).replace("[1]", f"[{number}]")

    example = _arena_examples()[0]
    for shuffle in (False, True):
        task = _shuffled_task(shuffle)
        for respond, varies in ((cites_one, shuffle), (reads, False)):
            agent = task.agent_config(task.config)
            traces = rollout_traces(task, ScriptedLLM(respond), agent, [example], task.config, 0)
            assert (len({tuple(t.meta["reference_ids"]) for t in traces}) > 1) == shuffle
            rewards = [e.reward for e in task.episodes(traces)]
            assert (len(set(rewards)) > 1) == varies, (shuffle, respond.__name__, rewards)
            if respond is reads:
                assert all(t.meta["cited_ids"] == ["a"] for t in traces)


def test_arena_grpo_step_on_a_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = ArenaRLConfig(
        model=str(tiny_model_dir),
        output_dir=str(tmp_path / "arena"),
        train_files=[_write(tmp_path / "train.jsonl", _arena_examples())],
        steps=2,
        prompts_per_step=2,
        group_size=3,
        warmup_steps=0,
        micro_batch=3,
        learning_rate=1e-3,
        save_steps=1,
        progress=False,
        agent=ArenaConfig(sampling=Sampling(max_new_tokens=8)),
    )
    summary = train_arena(config)
    log = [json.loads(line) for line in (tmp_path / "arena" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1] and summary["steps"] == 2
    for key in ("reward/format", "reward/accuracy", "reward/relevance", "reward/bonus", "kl", "entropy"):
        assert key in log[-1], key
    assert (tmp_path / "arena" / "model" / "config.json").exists()
    assert json.loads((tmp_path / "arena" / "data_summary.json").read_text())


# ------------------------------------------------------------------------------------------------ s3


def _generator() -> ScriptedLLM:
    """A frozen 'generator' that answers Paris/France questions from a context that mentions Paris."""

    def respond(prompt: str) -> str:
        return "France" if "Paris is in France" in prompt and "Paris" in prompt.split("Question")[-1] else "unknown"

    return ScriptedLLM(respond)


def _s3_examples() -> list[Example]:
    return [
        Example(id="s1", question="Where is Paris?", answers=["France"]),  # naive RAG answers it: filtered out
        Example(id="s2", question="Where does Carl live?", answers=["Lima"]),
        Example(id="s3", question="Is Ann in Rome?", answers=["yes"]),  # yes/no: filtered out
        Example(id="s4", question="Where does Dana live?", answers=["Quito"]),
    ]


def _s3_config(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> S3RLConfig:
    config = S3RLConfig(
        model=str(tiny_model_dir),
        output_dir=str(tmp_path / "s3"),
        train_file=_write(tmp_path / "train.jsonl", _s3_examples()),
        index="list",
        steps=1,
        prompts_per_step=2,
        micro_batch=2,
        mini_batches=2,
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        save_steps=1,
        progress=False,
        agent=S3Config(k=2, k_initial=3, max_turns=1, sampling=Sampling(max_new_tokens=8)),
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_s3_caches_the_naive_baseline_filters_and_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    generator = _generator()
    config = _s3_config(tmp_path, tiny_model_dir)
    result = train_s3(config, generator=generator, retriever=ListRetriever(PASSAGES))
    data = result["data"]
    assert data["dropped"] == {"naive_rag_correct": 1, "yes_no_answer": 1} and data["kept"] == 2
    assert data["cache"] == {"hits": 0, "misses": 4}
    log = json.loads((tmp_path / "s3" / "log.jsonl").read_text().splitlines()[0])
    for key in ("reward", "reward/acc_s3", "reward/acc_naive", "kl", "value_loss", "searches"):
        assert key in log, key
    rows = (tmp_path / "s3" / "naive_rag_cache.jsonl").read_text().splitlines()
    assert len(rows) == 4

    # a second run (more steps) reuses the cached baselines: the generator never sees a naive-RAG prompt again
    again = _generator()
    config = _s3_config(tmp_path, tiny_model_dir, steps=2)
    result = train_s3(config, generator=again, retriever=ListRetriever(PASSAGES))
    assert result["data"]["cache"]["misses"] == 0 and result["data"]["cache"]["hits"] == 4
    assert len((tmp_path / "s3" / "naive_rag_cache.jsonl").read_text().splitlines()) == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "s3" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # resumed at step 1 from the first run's checkpoint


def test_s3_trajectory_masks_the_retrieved_documents(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from sleuth.train.tokens import tokenize_chat

    transcript = [
        {"source": "model", "text": "<query>Carl home</query>"},
        {"source": "observation", "text": "\n\n<information>Doc 1(Title: Ann) Ann lives in Rome.</information>\n\n"},
        {"source": "model", "text": "<important_info>[1]</important_info><search_complete>True</search_complete>"},
    ]
    trace = Trace(
        example=Example(id="x", question="q", answers=["a"]),
        method="s3",
        meta={"searcher_prompt": "PROMPT", "transcript": transcript},
    )
    messages = trajectory_messages(trace)
    assert messages is not None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = tokenize_chat(tokenizer, messages)
    written = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.model_mask, strict=True) if m])
    assert "Ann lives in Rome" not in written and "PROMPT" not in written
    assert written.startswith("<query>Carl home</query>") and written.endswith("</search_complete><|im_end|>")
    empty = Trace(
        example=trace.example, method="s3", meta={"searcher_prompt": "PROMPT", "transcript": transcript[1:2]}
    )
    assert trajectory_messages(empty) is None


def test_s3_and_arena_prompts_mark_their_documents_as_observations(tiny_model_dir: Path) -> None:
    """The documents inside a prompt (s3's initial naive-RAG block, ARENA's references) are observations: an
    episode over max_episode_tokens loses their text, not the instruction around them."""
    from transformers import AutoTokenizer

    from sleuth.agents.arena import arena_prompt
    from sleuth.agents.s3 import searcher_prompt
    from sleuth.train.arena_rl import _mark_references
    from sleuth.train.tokens import tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    example = Example(id="x", question="Where does Ann live?", answers=["Rome"], context=PASSAGES)
    prompt = searcher_prompt(example.question, PASSAGES, S3Config())
    trace = Trace(
        example=example,
        method="s3",
        meta={
            "searcher_prompt": prompt,
            "naive_rag_passages": [p.to_dict() for p in PASSAGES],
            "transcript": [{"source": "model", "text": "<search_complete>True</search_complete>"}],
        },
    )
    messages = trajectory_messages(trace)
    assert messages is not None
    observed = [s["text"] for s in messages[0]["segments"] if s["source"] == "observation"]
    assert observed == [p.text for p in PASSAGES] and "".join(s["text"] for s in messages[0]["segments"]) == prompt

    prompt = arena_prompt(example.question, PASSAGES)
    trace = Trace(example=example, method="arena", meta={"reference_ids": [p.id for p in PASSAGES]})
    marked = _mark_references([{"role": "user", "content": prompt}], trace)
    observed = [s["text"] for s in marked[0]["segments"] if s["source"] == "observation"]
    assert observed == [p.text for p in PASSAGES]
    chat = tokenize_chat(tokenizer, [*marked, {"role": "assistant", "content": "<answer>Rome</answer>"}])
    text = tokenizer.decode([t for t, o in zip(chat.input_ids, chat.observation_mask, strict=True) if not o])
    assert example.question in text and "Ann lives" not in text and "<answer>Rome</answer>" in text


def test_configs_load_and_validate() -> None:
    from sleuth.train.config import load_config

    repo = Path(__file__).resolve().parents[1]
    arena = load_config(ArenaRLConfig, repo / "configs" / "arena_grpo.yaml", {"group_size": "5"})
    arena.validate()
    assert arena.group_size == 5 and arena.kl == "arena" and arena.agent.sampling.max_new_tokens == 256
    assert arena.max_episode_tokens is None  # the released trainer does not truncate prompts
    s3 = load_config(S3RLConfig, repo / "configs" / "s3_ppo.yaml")
    s3.validate()
    # 8-3-3: 8 documents per search, 3 kept, and the reference's CLI max_turns=3, whose loop runs 3 + 1 = 4 search
    # rounds before the final no-search one: sleuth's max_turns counts the search rounds, so 4
    assert (s3.agent.k, s3.agent.max_selected, s3.agent.k_initial, s3.agent.max_turns) == (8, 3, 3, 4)
    assert s3.agent.max_turns == S3Config().max_turns
    # veRL's PPO: a separate critic at lr 1e-5 warmed up over 1% of 1500 steps, actor at 1e-6, no critic-only steps
    assert (s3.critic, s3.critic_learning_rate, s3.critic_lr_warmup_steps) == ("separate", 1e-5, 15)
    assert (s3.learning_rate, s3.warmup_steps, s3.critic_warmup_steps, s3.max_episode_tokens) == (1e-6, 0, 0, None)
    assert S3RLConfig().critic == "separate" and S3RLConfig().critic_lr_warmup_steps == 15
    s3 = load_config(S3RLConfig, repo / "configs" / "s3_ppo.yaml", {"algorithm": "grpo", "group_size": "4"})
    s3.validate()
    assert s3.algorithm == "grpo" and s3.kl_coef == 0.001 and s3.agent.k == 8
    s3.group_size = 1
    with pytest.raises(ValueError, match="group_size"):
        s3.validate()


@pytest.mark.slow
def test_s3_with_two_processes_builds_the_baseline_once_and_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    """torchrun, gloo on CPU: process 0 computes the naive-RAG cache while process 1 waits, then finds it all
    cached; each process samples one of the two kept questions; one log, one rollout store, one model."""
    import os
    import subprocess
    import sys

    from sleuth.train.config import to_mapping

    repo = Path(__file__).resolve().parents[1]
    config_path = tmp_path / "s3.json"
    config_path.write_text(json.dumps(to_mapping(_s3_config(tmp_path, tiny_model_dir, mini_batches=1))))
    script = tmp_path / "run_s3.py"
    script.write_text(
        "import json, os, sys\n"
        "from sleuth.train.config import load_config\n"
        "from sleuth.train.s3_rl import S3RLConfig, train_s3\n"
        "from tests.scripted import ListRetriever\n"
        "from tests.test_rl_trainers import PASSAGES, _generator\n"
        "config = load_config(S3RLConfig, sys.argv[1])\n"
        "result = train_s3(config, generator=_generator(), retriever=ListRetriever(PASSAGES))\n"
        "with open(sys.argv[2] + '/cache-' + os.environ['RANK'] + '.json', 'w') as f:\n"
        "    json.dump(result['data']['cache'], f)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, str(script), str(config_path), str(tmp_path)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    caches = [json.loads((tmp_path / f"cache-{rank}.json").read_text()) for rank in (0, 1)]  # files: no interleaving
    assert caches == [{"hits": 0, "misses": 4}, {"hits": 4, "misses": 0}]
    out = tmp_path / "s3"
    assert len((out / "naive_rag_cache.jsonl").read_text().splitlines()) == 4
    assert json.loads((out / "data_summary.json").read_text())["kept"] == 2
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0] and "reward/acc_s3" in log[0]
    from sleuth.train.rollouts import RolloutStore

    stored = list(RolloutStore(out / "rollouts" / "step-00000"))
    assert sorted(r.trace.example.id for r in stored) == ["s2", "s4"]  # one question from each process
    assert (out / "model" / "config.json").exists()
