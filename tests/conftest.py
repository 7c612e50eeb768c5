"""Shared fixtures: a tiny random Llama with a real BPE tokenizer and chat template, built offline in a second."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TRAINING_TEXT = [
    "The capital of France is Paris. Paris is a city on the Seine.",
    "Who wrote Hamlet? William Shakespeare wrote Hamlet in London.",
    "Question: what is the answer? Answer: forty two. <answer>42</answer>",
    "Search the corpus, read the passages, and answer with evidence.",
] * 20


def build_tiny_model(out: Path, seed: int = 0, initializer_range: float = 0.5) -> Path:
    """Save a ~0.1M-parameter Llama and a byte-level BPE tokenizer (vocab ~350) with a chat template to ``out``.

    A large ``initializer_range`` makes the random logits peaked, so greedy decoding has no near-ties and batched
    and unbatched runs agree exactly.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An "interpreter with vLLM": this Python with the stand-in ``vllm`` package first on its path."""
    from tests.test_vllm_server import FAKE_SERVER

    root = tmp_path_factory.mktemp("fakevllm")
    package = root / "site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for level in (package, package.parent, package.parent.parent):
        (level / "__init__.py").write_text("")
    (package / "api_server.py").write_text(FAKE_SERVER)
    python = root / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return str(python)


def model_params(path: Path) -> dict[str, Any]:
    """A copy of every weight of the transformers model in ``path``, by name."""
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def two_process_rl_config(model_dir: Path, out: Path, algorithm: str, **overrides: Any) -> Any:
    """The RLConfig the one-process vs two-process comparisons train (tests/test_online_rl.py, tests/test_fsdp.py):
    a fast rate, both KL terms by algorithm, an entropy bonus, one micro-batch per pass; ``overrides`` on top."""
    import dataclasses

    from sleuth.train.online_rl import RLConfig

    config = RLConfig(
        model=str(model_dir),
        output_dir=str(out),
        algorithm=algorithm,  # type: ignore[arg-type]
        steps=1,
        prompts_per_step=3,
        group_size=2 if algorithm == "grpo" else 1,
        micro_batch=1,
        micro_batch_tokens=0,  # fixed rows: both runs sum the same micro-batches (the budget path: test_packing.py)
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        beta=0.04 if algorithm == "grpo" else 0.0,
        kl_coef=0.01 if algorithm == "ppo" else 0.0,
        entropy_coef=0.01,
        save_steps=1,
        temperature=1.0,
        progress=False,
    )
    return dataclasses.replace(config, **overrides)
