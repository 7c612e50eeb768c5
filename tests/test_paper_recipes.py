"""The papers' recipes (``configs/paper/*.yaml``) rehearsed for one step on CPU before a GPU is rented.

Each recipe is read with the loader ``sleuth train`` uses (:func:`sleuth.train.config.load_config`), with
``--set``-style overrides of the *size* knobs only (steps, batch, lengths, number of questions), of the data paths
(a tiny synthetic world instead of the paper's files) and of the model: a tiny random model of the paper model's
family, built offline (Qwen2: tied embeddings, grouped-query attention, ChatML with Qwen2.5's default system
message; Llama: Llama-3's header template and no pad token). Every test asserts that exactly the declared keys
differ from the recipe, then runs the real trainer and checks that parameters moved and that the checkpoint layout
is the one the docs promise. Everything else (β, KL, group size, turns, retrieval depth, schedules, masks, prompt
templates, sharding mode, gradient checkpointing) runs as the recipe says.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sleuth.records import Example, Passage
from sleuth.train.config import load_config, to_mapping

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "configs" / "paper"
FIREACT = REPO.parent / "shared" / "data" / "fireact" / "hotpotqa_react_trajectories.jsonl"

QWEN_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEXT = [
    "Which river flows through the city where Ann was born? Ann was born in Paris. The Seine flows through Paris.",
    "<THINK>Where was Ann born?</THINK> <SEARCH> <RECORD>Paris</RECORD> <FINAL> <answer>Seine</answer>",
    "<query>Ann birthplace</query> <important_info>[1, 2]</important_info> <search_complete>True</search_complete>",
    "<relevance>[1, 3]</relevance> <analysis>The references say so.</analysis> ### Q1: Who? ### Q2: Where #1?",
] * 10


def build_tiny(out: Path, family: str) -> Path:
    """A ~0.1M-parameter random model of ``family`` ("qwen2" or "llama3") with a byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if family == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    else:  # Llama-3.1-Instruct: eos <|eot_id|>, no pad token
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        kwargs = {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **kwargs)
    tokenizer.chat_template = QWEN_TEMPLATE if family == "qwen2" else LLAMA3_TEMPLATE
    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16384,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if family == "qwen2":
        config = Qwen2Config(**shape, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
        model: Any = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-llama3"), "llama3")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sleuth.data.synth import synthesize

    out = tmp_path_factory.mktemp("world") / "world"
    sizes = {"train_entities": 40, "dev_entities": 20, "test_entities": 20}
    synthesize(out, seed=0, train_questions=4, dev_questions=2, test_questions=1, max_hops=2, **sizes)
    return out


def _flat(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value and key != "synth":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_recipe(cls: type, name: str, overrides: dict[str, Any]) -> Any:
    """The recipe through ``sleuth train``'s loader with ``overrides``; asserts that exactly the overridden keys
    differ from the recipe as shipped (so nothing else was changed behind the rehearsal's back)."""
    path = RECIPES / name
    shipped = load_config(cls, path)
    config = load_config(cls, path, overrides)
    changed = {k for k, v in _flat(to_mapping(config)).items() if _flat(to_mapping(shipped)).get(k) != v}
    assert changed <= set(overrides), f"keys changed that were not overridden: {changed - set(overrides)}"
    assert set(overrides) - changed <= {k for k, v in overrides.items() if v is None or v == ""}, (
        "an override repeats the recipe's value: drop it from the list"
    )
    return config


def _weights(path: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _moved(before: Path, after: Path) -> bool:
    import torch

    old, new = _weights(before), _weights(after)
    assert old.keys() == new.keys(), "the saved model's parameter names differ from the base's"
    return any(not torch.equal(old[k], new[k]) for k in old)


def _write(path: Path, examples: list[Example]) -> str:
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in examples))
    return str(path)


# ---------------------------------------------------------------------------------------------- AceSearcher


def test_acesearcher_sft_recipe_one_step(tmp_path: Path, tiny_llama: Path) -> None:
    from sleuth.train.sft import SFTConfig, train_sft

    overrides = {
        "model": str(tiny_llama),
        "output_dir": str(tmp_path / "sft"),
        "max_steps": 2,  # 2, not 1: the 5% warm-up makes step 1's learning rate 0
        "batch_size": 2,
        "per_device_batch_size": 2,
        "max_length": 256,
        "save_steps": 1,
        "logging_steps": 1,
    }
    config = load_recipe(SFTConfig, "acesearcher_sft.yaml", overrides).validate()
    assert [s.kind for s in config.sources] == ["released"]
    assert config.learning_rate == 1e-6 and config.adam_beta2 == 0.98
    # data: the released LLaMA-Factory record shapes (alpaca, sharegpt) from a local file instead of the hub
    rows = [
        {"instruction": f"Please break down the question {i}.", "input": "", "output": f"### Q1: Who is {i}?"}
        for i in range(6)
    ] + [
        {
            "conversations": [
                {"from": "human", "value": f"Answer {i}."},
                {"from": "gpt", "value": f"<answer>{i}</answer>"},
            ]
        }
        for i in range(6)
    ]
    local = tmp_path / "search_sft.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.sources = [dataclasses.replace(s, path=str(local)) for s in config.sources]
    out = train_sft(config.validate())
    assert (out / "checkpoint-2" / "trainer_state.json").exists() and (out / "checkpoint-1").exists()
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    assert json.loads((out / "data_summary.json").read_text())["gradient_accumulation_steps"] == 1
    assert _moved(tiny_llama, out)


def test_acesearcher_mdpo_recipe_one_step(tmp_path: Path, tiny_llama: Path, world: Path) -> None:
    from sleuth.train.mdpo import MDPOConfig, train_mdpo
    from tests.scripted import ScriptedLLM
    from tests.test_mdpo import QUESTION, scripted_policy

    questions = [Example(id=f"q{i}", question=QUESTION, answers=["France"]) for i in range(3)]
    overrides = {
        "model": str(tiny_llama),
        "output_dir": str(tmp_path / "mdpo"),
        "train_file": _write(tmp_path / "train.jsonl", questions[:2]),
        "dev_file": _write(tmp_path / "dev.jsonl", questions[2:]),
        "index": "",
        "corpus": str(world / "corpus.jsonl"),  # BM25 of the tiny world, built into OUT/index
        "iterations": 1,
        "max_steps": 2,  # 2: the 5% warm-up makes step 1's learning rate 0
        "batch_size": 2,
        "per_device_batch_size": 1,  # 2 pairs per step by accumulation, as the recipe's 2 x 32 on one GPU
        "max_length": 512,
        "progress": False,
    }
    config = load_recipe(MDPOConfig, "acesearcher_mdpo.yaml", overrides)
    assert (config.decompositions, config.solutions, config.beta, config.engine) == (3, 4, 0.1, "vllm")
    seen: list[Path] = []

    def factory(path: Path) -> ScriptedLLM:  # the sampler: a scripted policy (a random model earns no pairs)
        seen.append(Path(path))
        return ScriptedLLM(scripted_policy(seed=len(seen)))

    summary = train_mdpo(config, llm_factory=factory)
    it = tmp_path / "mdpo" / "iter1"
    stats = json.loads((it / "stats.json").read_text())
    assert stats["rollouts"] == 2 * 3 * 4 and stats["pairs"]["total"] > 0
    assert stats["dpo"]["trained"] and stats["dpo"]["steps"] == 2
    assert summary["final_model"] == str(it / "model") and (it / "pairs.jsonl").exists()
    assert (it / "model" / "config.json").exists() and not (it / "trainer").exists()  # checkpoints removed
    assert _moved(tiny_llama, it / "model")


# ---------------------------------------------------------------------------------------------- ExSearch


@pytest.mark.skipif(not FIREACT.exists(), reason="needs ../shared/data/fireact (the recipe's warm-up data)")
def test_exsearch_em_recipe_one_step(
    tmp_path: Path, tiny_qwen: Path, world: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sleuth.train.exsearch_em import EMConfig, train_exsearch

    monkeypatch.chdir(REPO)  # the recipe's fireact path is relative to the repository
    overrides = {
        "model": str(tiny_qwen),
        "output_dir": str(tmp_path / "em"),
        "train_file": str(world / "train.jsonl"),
        "dev_file": str(world / "dev.jsonl"),
        "index": "",
        "corpus": str(world / "corpus.jsonl"),
        "engine": "hf",  # no vLLM server on a CPU
        "train_limit": 2,
        "dev_limit": 1,
        "fireact_limit": 2,
        "iterations": 1,
        "max_steps": 2,  # per stage; 2: the 10% warm-up makes step 1's learning rate 0
        "batch_size": 2,
        "per_device_batch_size": 1,
        "agent.sampling.max_new_tokens": 8,
        "agent.answer_max_new_tokens": 4,
        "progress": False,
    }
    config = load_recipe(EMConfig, "exsearch_em.yaml", overrides)
    assert (config.samples, config.best_of, config.agent.k, config.agent.max_steps) == (2, 8, 5, 5)
    summary = train_exsearch(config)
    out = tmp_path / "em"
    warm = out / "warmup" / "model"
    assert (warm / "config.json").exists() and _moved(tiny_qwen, warm)
    assert json.loads((out / "warmup" / "data_summary.json").read_text())["records"] == 2
    stats = json.loads((out / "iter0" / "stats.json").read_text())
    assert stats["policy"] == str(warm) and stats["trajectories"]["n"] + sum(stats["degenerate"].values()) == 2 * 2
    assert (out / "iter0" / "model" / "config.json").exists() and (out / "iter0" / "weighted.jsonl").exists()
    assert [it["iteration"] for it in summary["iterations"]] == [0]


# ---------------------------------------------------------------------------------------------- s3


def test_s3_ppo_recipe_one_step(tmp_path: Path, tiny_qwen: Path, world: Path) -> None:
    from sleuth.train.s3_rl import S3RLConfig, train_s3

    questions = [e for e in map(Example.from_dict, map(json.loads, (world / "train.jsonl").read_text().splitlines()))]
    overrides = {
        "model": str(tiny_qwen),
        "generator": f"hf:{tiny_qwen}",  # frozen generator and judge: the tiny model instead of a vLLM server
        "judge": f"hf:{tiny_qwen}",
        "output_dir": str(tmp_path / "s3"),
        "train_file": _write(tmp_path / "train.jsonl", questions),
        "index": "",
        "corpus": str(world / "corpus.jsonl"),
        "train_limit": 2,
        "prompts_per_step": 2,  # fewer rollouts than the recipe's 4 mini-batches: the mini-batches shrink
        "steps": 1,
        "save_steps": 1,
        "agent.sampling.max_new_tokens": 8,
        "agent.generator_sampling.max_new_tokens": 4,
        "progress": False,
    }
    config = load_recipe(S3RLConfig, "s3_ppo.yaml", overrides)
    assert (config.agent.k, config.agent.max_turns, config.mini_batches, config.sharding) == (8, 4, 4, "fsdp")
    result = train_s3(config)
    out = tmp_path / "s3"
    assert result["data"]["kept"] >= 1
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0] and "value_loss" in log[0] and "kl" in log[0]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1
    assert (out / "model" / "config.json").exists() and _moved(tiny_qwen, out / "model")


# ---------------------------------------------------------------------------------------------- ARENA


def test_arena_grpo_recipe_one_step(tmp_path: Path, tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sleuth.train import rewards
    from sleuth.train.arena_rl import ArenaRLConfig, train_arena

    real = rewards.arena_reward

    def varied(output: str, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The real reward plus 0 / 0.5 / 1 by the completion's length: a random model's seven completions all
        score 0, so every GRPO advantage (and at step 0 the KL gradient) would be 0 and nothing would move."""
        scores = dict(real(output, *args, **kwargs))
        scores["total"] = float(scores["total"]) + 0.5 * (len(output) % 3)
        return scores

    monkeypatch.setattr(rewards, "arena_reward", varied)

    docs = [
        Passage(id="a", title="Ann", text="Ann was born in Paris."),
        Passage(id="b", title="Paris", text="The Seine flows through Paris."),
        Passage(id="c", title="Bob", text="Bob lives in Oslo."),
    ]
    examples = [
        Example(
            id="e1",
            question="Which river flows where Ann was born?",
            answers=["Seine"],
            context=docs,
            supporting_ids=["a", "b"],
        ),
        Example(id="e2", question="Where does Bob live?", answers=["Oslo"], context=docs, supporting_ids=["c"]),
    ]
    overrides = {
        "model": str(tiny_qwen),
        "output_dir": str(tmp_path / "arena"),
        "train_files": [_write(tmp_path / "train.jsonl", examples)],
        "steps": 1,
        "prompts_per_step": 2,
        "save_steps": 1,
        "agent.sampling.max_new_tokens": 8,
        "progress": False,
    }
    config = load_recipe(ArenaRLConfig, "arena_grpo.yaml", overrides)
    assert (config.group_size, config.beta, config.kl, config.sharding) == (7, 0.04, "arena", "fsdp")
    summary = train_arena(config)
    out = tmp_path / "arena"
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 1 and [r["step"] for r in log] == [0]
    for key in ("reward/format", "reward/accuracy", "reward/relevance", "reward/bonus", "kl"):
        assert key in log[0], key
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1
    assert (out / "model" / "config.json").exists() and _moved(tiny_qwen, out / "model")
