"""Training curves: every trainer's scalars to TensorBoard (the default) and, when asked, W&B / trackio / MLflow.

``report_to`` is spelled as in TRL and veRL: a list of backend names (``["tensorboard"]`` by default, ``[]`` or
``"none"`` for no curves; a string is one name or several separated by commas). Two ways in, one layout:

* :class:`Tracker` (the online RL loop's steps, the mDPO and ExSearch EM iterations): open one per run,
  ``.log(step, scalars)``, ``.close()``. TensorBoard events go to ``LOG_DIR/tb``.
* :func:`hf_reporting` (the transformers ``Trainer`` behind SFT, each DPO iteration and each EM M-step): the
  ``report_to`` value for ``TrainingArguments`` and the callbacks that write TensorBoard events to
  ``RUN/tb`` (SFT) or ``RUN/tb/STAGE`` (``iter1``, ``warmup``: one TensorBoard run per training stage), with the
  Trainer's tags (``train/loss``, ``train/learning_rate``, ``eval/loss``, ...).

``tensorboard --logdir RUN/tb`` shows them. A backend whose package is missing is a :class:`ConfigError` naming
the pip package, raised by :func:`check_report_to` (each trainer config's ``validate``) before anything loads.
Offline: W&B with ``WANDB_MODE=offline`` (files under ``LOG_DIR/wandb``), MLflow with a file store under
``LOG_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set, trackio always writes locally.

>>> check_report_to("none"), check_report_to([]), check_report_to("tensorboard")
([], [], ['tensorboard'])
>>> scalars({"reward": 0.5, "pairs": {"final": 3, "note": "x"}, "trained": True, "dev": {"em": None}})
{'reward': 0.5, 'pairs/final': 3.0, 'trained': 1.0}
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.train.config import ConfigError

__all__ = ["BACKENDS", "TB_DIR", "Tracker", "check_report_to", "flatten", "hf_reporting", "scalars"]

# backend name -> (module imported, pip package that provides it)
BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
TB_DIR = "tb"


def check_report_to(report_to: str | Sequence[str] | None) -> list[str]:
    """The backend names of ``report_to`` (deduplicated, in order); :class:`ConfigError` for an unknown name or a
    backend whose package is not installed (naming the pip package)."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"report_to: got {item!r}, expected backend names ({', '.join(BACKENDS)})")
        name = item.strip().lower()
        if name in ("", "none"):
            continue
        if name not in BACKENDS:
            raise ConfigError(f"report_to: unknown backend {item!r}; known: {', '.join(BACKENDS)} (or none)")
        if name not in names:
            names.append(name)
    for name in names:
        module, package = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"report_to: {name} needs the {package!r} package, which is not installed "
                f"(pip install {package}; or leave {name} out of report_to)"
            )
    return names


def scalars(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``mapping`` as ``{tag: float}``: nested mappings give ``outer/inner`` tags, booleans 0/1;
    strings, lists, None and non-finite numbers are left out."""
    out: dict[str, float] = {}
    for key, value in mapping.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{tag}/"))
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[tag] = float(value)
    return out


class Tracker:
    """One run's curves: ``Tracker(report_to, log_dir, run_name, config)``, then ``log(step, scalars)`` and
    ``close()`` (also a context manager). ``enabled=False`` (processes other than the main one) logs nothing."""

    def __init__(
        self,
        report_to: str | Sequence[str] | None,
        log_dir: str | Path,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        enabled: bool = True,
    ) -> None:
        self.names = check_report_to(report_to) if enabled else []
        self.log_dir = Path(log_dir)
        self.run_name = run_name
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: Any = None
        self._trackio: Any = None
        config = dict(config or {})
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir / TB_DIR))
            self._tb.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        if "wandb" in self.names:
            import wandb

            self.log_dir.mkdir(parents=True, exist_ok=True)
            project = os.environ.get("WANDB_PROJECT", "sleuth")
            self._wandb = wandb.init(project=project, name=run_name, dir=str(self.log_dir), config=config)
        if "mlflow" in self.names:
            import mlflow

            mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or _mlflow_store(self.log_dir))
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "sleuth"))
            self._mlflow = mlflow.start_run(run_name=run_name)
            mlflow.log_params({k: str(v)[:500] for k, v in flatten(config).items()})
        if "trackio" in self.names:
            import trackio

            self._trackio = trackio.init(
                project=os.environ.get("TRACKIO_PROJECT", "sleuth"), name=run_name, config=config
            )

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Write ``values`` (numbers; anything else is left out, see :func:`scalars`) at ``step``."""
        if not self.names:
            return
        numbers = scalars(values)
        if self._tb is not None:
            for tag, value in numbers.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()  # a killed run keeps its curves up to the last step
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({_mlflow_key(k): v for k, v in numbers.items()}, step=step)
        if self._trackio is not None:
            import trackio

            trackio.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()
            self._mlflow = None
        if self._trackio is not None:
            import trackio

            trackio.finish()
            self._trackio = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hf_reporting(report_to: str | Sequence[str] | None, run_dir: str | Path, stage: str = "") -> tuple[Any, list]:
    """``(report_to, callbacks)`` for a transformers ``Trainer`` of the run in ``run_dir``: pass the first as
    ``TrainingArguments(report_to=...)`` and add the callbacks. TensorBoard events go to ``run_dir/tb/stage``
    (transformers 5 has no ``logging_dir`` argument: the callback is given its directory); W&B and MLflow use
    transformers' own callbacks, with W&B's files and MLflow's file store under ``run_dir`` unless
    ``WANDB_DIR`` / ``MLFLOW_TRACKING_URI`` say otherwise (set in this process's environment)."""
    names = check_report_to(report_to)
    run_dir = Path(run_dir)
    callbacks: list[Any] = []
    if "tensorboard" in names:
        from transformers.integrations import TensorBoardCallback

        callback = TensorBoardCallback()
        callback.logging_dir = str(run_dir / TB_DIR / stage) if stage else str(run_dir / TB_DIR)
        callbacks.append(callback)
    if "wandb" in names:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(run_dir.resolve()))
        os.environ.setdefault("WANDB_PROJECT", "sleuth")
    if "mlflow" in names:
        os.environ.setdefault("MLFLOW_TRACKING_URI", _mlflow_store(run_dir))
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "sleuth")
    others = [n for n in names if n != "tensorboard"]
    return (others or "none"), callbacks


def _mlflow_store(log_dir: Path) -> str:
    return (log_dir / "mlruns").resolve().as_uri()


def _mlflow_key(tag: str) -> str:
    """MLflow metric names allow letters, digits, ``_ - . / :`` and spaces."""
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in tag)


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
