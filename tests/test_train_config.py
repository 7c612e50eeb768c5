"""The trainer configs' shared base (sleuth.train.common) and the old option spellings the loader still reads."""

from __future__ import annotations

import dataclasses
import platform
import sys
from pathlib import Path

import pytest

from sleuth.train.arena_rl import ArenaRLConfig
from sleuth.train.common import HFTrainConfig, TrainConfig, WorldConfig
from sleuth.train.config import ConfigError, load_config
from sleuth.train.exsearch_em import EMConfig
from sleuth.train.mdpo import MDPOConfig
from sleuth.train.s3_rl import S3RLConfig
from sleuth.train.sft import SFTConfig

# old key (YAML text), new key (YAML text): the same setting
RENAMED = [
    ("lr: 2.0e-5", "learning_rate: 2.0e-5"),
    ("use_lora: true", "lora: true"),
    ("lora: {r: 16}", "lora_r: 16"),
    ("lora: {alpha: 32}", "lora_alpha: 32"),
    ("lora: {dropout: 0.1}", "lora_dropout: 0.1"),
    ("lora: {target_modules: [q_proj, v_proj]}", "lora_target: q_proj,v_proj"),
    ("lora: {save: adapter}", "lora_save: adapter"),
]


def test_every_renamed_key_is_covered() -> None:
    assert sorted(SFTConfig.renamed) == sorted(
        old.split(":")[0] + ("." + old.split("{")[1].split(":")[0] if "{" in old else "") for old, _ in RENAMED
    )


@pytest.mark.parametrize(("old", "new"), RENAMED, ids=[new.split(":")[0] for _, new in RENAMED])
def test_an_old_spelling_loads_with_a_warning_naming_the_new_one(tmp_path: Path, old: str, new: str) -> None:
    (tmp_path / "old.yaml").write_text(old + "\n")
    (tmp_path / "new.yaml").write_text(new + "\n")
    new_key = new.split(":")[0]
    with pytest.warns(DeprecationWarning, match=repr(new_key)):
        from_old = load_config(SFTConfig, tmp_path / "old.yaml")
    assert from_old == load_config(SFTConfig, tmp_path / "new.yaml") != SFTConfig()


def test_old_spellings_together_and_as_overrides(tmp_path: Path) -> None:
    (tmp_path / "old.yaml").write_text("use_lora: true\nlora: {r: 16, alpha: 32, save: adapter}\n")
    with pytest.warns(DeprecationWarning):
        config = load_config(SFTConfig, tmp_path / "old.yaml", {"lr": "3e-6", "lora.dropout": "0.05"})
    assert (config.lora, config.lora_r, config.lora_alpha, config.lora_save) == (True, 16, 32, "adapter")
    assert (config.learning_rate, config.lora_dropout) == (3e-6, 0.05)


def test_an_old_and_a_new_spelling_of_one_option_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "both.yaml").write_text("lr: 1.0e-5\nlearning_rate: 2.0e-5\n")
    with pytest.raises(ConfigError, match="old name of 'learning_rate'"):
        load_config(SFTConfig, tmp_path / "both.yaml")


def test_the_trainer_configs_share_one_base_with_one_spelling() -> None:
    for cls in (SFTConfig, MDPOConfig, EMConfig):
        assert issubclass(cls, HFTrainConfig)
    for cls in (MDPOConfig, EMConfig):
        assert issubclass(cls, WorldConfig)
    for cls in (S3RLConfig, ArenaRLConfig):
        assert issubclass(cls, TrainConfig)
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {"learning_rate", "lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target", "report_to"} <= shared
    assert SFTConfig().learning_rate == 5e-6 and SFTConfig().lora_targets() == "all-linear"
    assert SFTConfig(lora_target="q_proj, v_proj").lora_targets() == ["q_proj", "v_proj"]


def test_exsearch_refuses_lora() -> None:
    with pytest.raises(ValueError, match="trains all weights"):
        EMConfig(lora=True).validate()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's"
)
def test_free_memory_gives_the_freed_heap_back_to_the_system() -> None:
    """Tensors freed between kept ones stay resident in glibc's heap after ``gc``; ``free_memory`` returns them."""
    import gc

    import torch

    from sleuth.train.common import free_memory, resident_bytes

    mib = 2**20
    start = resident_bytes()
    assert start is not None
    released = torch.ones(4 * mib)  # freeing a 16 MB mapping raises glibc's mmap threshold above 4 MB
    del released
    blocks = [torch.ones(mib) for _ in range(100)]  # 4 MB each, 400 MB on the heap now
    kept = blocks[::25]
    del blocks
    gc.collect()
    before = resident_bytes()
    free_memory()
    after = resident_bytes()
    assert before is not None and after is not None
    assert after < start + 100 * mib, (start / mib, before / mib, after / mib)  # 384 MB freed; 4 x 4 MB kept
    assert len(kept) == 4
