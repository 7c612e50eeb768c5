"""Training curves (sleuth.train.tracking): the TensorBoard events each trainer writes hold the numbers of its own
logs, ``report_to: []`` writes none, and a wrong or uninstalled backend fails before any training."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sleuth.agents.base import parse_options
from sleuth.train.config import ConfigError, load_config
from sleuth.train.online_rl import RLConfig, train_online
from sleuth.train.tracking import Tracker, check_report_to, hf_reporting
from tests.test_online_rl import DirectTask, _config, _examples


def _events(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files directly in ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list(directory.glob("events.out.tfevents.*")), f"no event file in {directory}"
    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _event_files(root: Path) -> list[Path]:
    return list(root.rglob("events.out.tfevents.*"))


# ------------------------------------------------------------------------------------------------------ report_to


def test_report_to_spellings() -> None:
    assert check_report_to(["tensorboard"]) == ["tensorboard"]
    assert check_report_to("none") == check_report_to([]) == check_report_to(None) == []
    assert check_report_to("tensorboard, TensorBoard") == ["tensorboard"]
    assert check_report_to(["none"]) == []
    for option, names in (("none", []), ("tensorboard", ["tensorboard"]), ("tensorboard,none", ["tensorboard"])):
        config = load_config(RLConfig, None, parse_options([f"report_to={option}"]))  # --set report_to=...
        assert check_report_to(config.report_to) == names


def test_an_unknown_backend_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown backend 'tensorbord'.*tensorboard, wandb, mlflow, trackio"):
        check_report_to(["tensorbord"])
    path = tmp_path / "rl.yaml"
    path.write_text("report_to: [tensorboard, neptune]\n")
    config = load_config(RLConfig, path)
    with pytest.raises(ConfigError, match="neptune"):
        Tracker(config.report_to, tmp_path, "run")
    with pytest.raises(ConfigError, match="unknown backend"):
        hf_reporting(["neptune"], tmp_path)


@pytest.mark.parametrize("backend", ["wandb", "mlflow", "trackio"])
def test_a_backend_whose_package_is_missing_fails_before_training_naming_the_pip_package(
    tmp_path: Path, tiny_model_dir: Path, backend: str
) -> None:
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here")
    config = _config(tmp_path, tiny_model_dir, report_to=["tensorboard", backend])
    with pytest.raises(ConfigError, match=rf"{backend} needs the '{backend}' package.*pip install {backend}"):
        train_online(config, DirectTask(lambda t: 1.0), _examples())
    assert not (tmp_path / "rl" / "model").exists() and not _event_files(tmp_path)  # nothing trained or written
    with pytest.raises(ConfigError, match=f"pip install {backend}"):
        hf_reporting([backend], tmp_path)


def test_the_hf_trainers_get_tensorboard_through_a_callback_in_the_run_directory(tmp_path: Path) -> None:
    report_to, callbacks = hf_reporting(["tensorboard"], tmp_path / "run", "iter1")
    assert report_to == "none" and [type(c).__name__ for c in callbacks] == ["TensorBoardCallback"]
    assert callbacks[0].logging_dir == str(tmp_path / "run" / "tb" / "iter1")
    assert hf_reporting([], tmp_path) == ("none", [])


def test_tracker_writes_numbers_only(tmp_path: Path) -> None:
    with Tracker(["tensorboard"], tmp_path, "run", {"lr": 1e-3}) as tracker:
        tracker.log(0, {"loss": 2.0, "pairs": {"final": 3}, "note": "text", "missing": None, "ok": True})
        tracker.log(1, {"loss": 1.5})
    events = _events(tmp_path / "tb")
    assert events == {"loss": [(0, 2.0), (1, 1.5)], "pairs/final": [(0, 3.0)], "ok": [(0, 1.0)]}
    with Tracker([], tmp_path / "off", "run") as tracker:
        tracker.log(0, {"loss": 1.0})
    assert not (tmp_path / "off").exists()


# ------------------------------------------------------------------------------------------------------ online RL


def test_online_rl_writes_every_step_log_number_to_tensorboard(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir, steps=2, beta=0.04, kl="arena")
    train_online(config, DirectTask(lambda t: float(len(t.answer or "") % 3)), _examples())
    log = [json.loads(line) for line in (tmp_path / "rl" / "log.jsonl").read_text().splitlines()]
    events = _events(tmp_path / "rl" / "tb")
    for tag in ("loss", "reward", "reward/score", "kl", "entropy", "clip_fraction", "learning_rate"):
        assert tag in events, tag
    assert "tokens_per_second" in events and "advantage_abs" in events
    renamed = {"lr": "learning_rate"}
    for key in log[0]:
        if key == "step" or not isinstance(log[0][key], int | float):
            continue
        tag = renamed.get(key, key)
        expected = [(entry["step"], float(entry[key])) for entry in log if key in entry]
        assert [s for s, _ in events[tag]] == [s for s, _ in expected], tag
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert (tmp_path / "rl" / "curves.png").exists()  # the PNG curves stay


def test_online_rl_with_report_to_empty_writes_no_events(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir, report_to=[])
    train_online(config, DirectTask(lambda t: 1.0), _examples())
    assert (tmp_path / "rl" / "log.jsonl").exists() and not (tmp_path / "rl" / "tb").exists()
    assert not _event_files(tmp_path)


# ------------------------------------------------------------------------------------------------------------ SFT


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the train extra is not installed")
def test_sft_writes_the_trainers_losses_to_tensorboard(tmp_path: Path, tiny_model_dir: Path) -> None:
    from sleuth.train.sft import train_sft
    from tests.test_sft import tiny_config

    out = tmp_path / "out"
    train_sft(tiny_config(tiny_model_dir, out))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    events = _events(out / "tb")
    expected = [(e["step"], e["loss"]) for e in log if "loss" in e]
    assert [s for s, _ in events["train/loss"]] == [s for s, _ in expected] == [1, 2]
    assert [v for _, v in events["train/loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert "train/learning_rate" in events

    off = tmp_path / "off"
    train_sft(tiny_config(tiny_model_dir, off, report_to=[], max_steps=1))
    assert (off / "log.jsonl").exists() and not _event_files(off)


# ----------------------------------------------------------------------------------------------------------- mDPO


def test_mdpo_iteration_statistics_and_dpo_losses_reach_tensorboard(tmp_path: Path, tiny_model_dir: Path) -> None:
    from sleuth.train.mdpo import train_mdpo
    from tests.scripted import ListRetriever, passages
    from tests.test_mdpo import Factory, _run_config

    config = _run_config(tmp_path, tiny_model_dir, iterations=1, eval_initial=False)
    train_mdpo(config, llm_factory=Factory(), retriever=ListRetriever(passages("Ann was born in Paris.")))
    run = tmp_path / "run"
    stats = json.loads((run / "iter1" / "stats.json").read_text())
    events = _events(run / "tb")
    assert events["pairs/total"] == [(1, float(stats["pairs"]["total"]))]
    assert events["dev/n"] == [(1, 2.0)] and events["mean_reward"] == [(1, pytest.approx(stats["mean_reward"]))]
    assert events["dpo/accuracy"] == [(1, pytest.approx(stats["dpo"]["accuracy"]))]
    dpo = _events(run / "tb" / "iter1")  # the DPO trainer's own curves, one TensorBoard run per iteration
    assert [s for s, _ in dpo["train/loss"]] == [1] and "train/rewards/accuracies" in dpo


# ----------------------------------------------------------------------------------------------------- ExSearch EM


def test_em_iteration_statistics_and_m_step_losses_reach_tensorboard(tmp_path: Path, tiny_model_dir: Path) -> None:
    from sleuth.train.exsearch_em import train_exsearch
    from tests.test_exsearch_em import _loop_config

    train_exsearch(_loop_config(tmp_path, tiny_model_dir, warmup=False, iterations=1))
    run = tmp_path / "run"
    stats = json.loads((run / "iter0" / "stats.json").read_text())
    events = _events(run / "tb")
    weight = stats["trajectories"]["weight"]
    assert events["trajectories/weight/ess"] == [(0, pytest.approx(weight["ess"], rel=1e-6))]
    assert 0 < weight["ess"] <= stats["trajectories"]["n"]
    assert events["trajectories/weight/mean"] == [(0, pytest.approx(weight["mean"], rel=1e-6))]
    assert events["dev/n"] == [(0, 2.0)]
    m_step = _events(run / "tb" / "iter0")  # the M-step trainer's own curves
    assert "train/loss" in m_step and "train/learning_rate" in m_step
