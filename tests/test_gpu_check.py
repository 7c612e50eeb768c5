"""benchmarks/gpu_check.py (`make gpu-check`) on CPU with the tiny random model: every part (generation, SFT, DPO,
PPO, one-process FSDP2 PPO) runs through the same code as on a GPU and reports a positive tokens/s."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_every_part_runs_on_cpu_and_reports_tokens_per_second(tiny_model_dir: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        pytest.skip("the train extra (trl, datasets) is not installed")
    settings = gpu_check.Settings.for_device("cpu", model=str(tiny_model_dir), steps=1, prompts=4)
    settings.workdir = str(tmp_path / "work")
    results = gpu_check.run_parts(settings)
    assert [r.name for r in results] == list(gpu_check.PARTS)
    for result in results:
        assert result.ok, f"{result.name}: {result.status} {result.error}"
        assert result.tokens > 0 and result.tokens_per_second > 0, result
    by_name = {r.name: r for r in results}
    assert by_name["ppo"].detail["parallelism"] == "none"
    assert by_name["ppo_fsdp"].detail["parallelism"] == "fsdp"


@pytest.mark.slow
def test_main_writes_the_report_only_where_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    code = gpu_check.main(
        ["--device", "cpu", "--model", str(tiny_model_dir), "--parts", "generate", "--prompts", "2", "--out", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [p["name"] for p in report["parts"]] == ["generate"] and report["parts"][0]["tokens_per_second"] > 0
    assert "| generate | ok |" in out.with_suffix(".md").read_text()
