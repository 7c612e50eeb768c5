"""The rollout store every trainer shares: Traces produced by the inference agents with sampling on.

A store is a directory::

    STORE/store.json      what produced the rollouts: method, method config (with its sampling), policy model spec
                          and revision, iteration; reopening with a different producer is refused
    STORE/rollouts.jsonl  one line per rollout: {"key", "group", "sample", "trace", "extra"}

Rollouts are appended (and fsynced) one complete line at a time as they finish, so a killed collection loses at
most the rollouts in flight: :func:`collect` skips every key already in the file and a torn last line is cut off.

>>> store = RolloutStore("runs/iter0/rollouts", producer={"method": "acesearcher"})  # doctest: +SKIP
>>> collect("acesearcher", examples, ctx, store, samples=4)  # doctest: +SKIP
>>> groups = store.groups()  # example id -> its rollouts  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.agents import Context
from sleuth.records import Example, Trace

STORE_MANIFEST = "store.json"
ROLLOUTS_FILE = "rollouts.jsonl"


class RolloutStoreError(RuntimeError):
    """A store was reopened for a different producer, or its files are unreadable."""


@dataclass
class Rollout:
    """One sampled run of an agent. ``group`` ties rollouts compared with each other (the example id by default),
    ``sample`` numbers them inside the group; ``extra`` holds what a trainer adds (rewards, weights)."""

    key: str
    group: str
    sample: int
    trace: Trace
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "key": self.key,
                "group": self.group,
                "sample": self.sample,
                "trace": self.trace.to_dict(),
                "extra": self.extra,
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, line: str) -> Rollout:
        data = json.loads(line)
        return cls(data["key"], data["group"], data["sample"], Trace.from_dict(data["trace"]), data.get("extra", {}))


def rollout_producer(method: str, agent: Any, model: Path, iteration: int, **settings: Any) -> dict[str, Any]:
    """What produced an iteration's rollouts, as a store records it: the agent ``method`` with config ``agent``,
    the model directory and its revision, the iteration, then the trainer's sampling ``settings`` (in order)."""
    from sleuth.train.config import to_mapping

    return {
        "method": method,
        "config": to_mapping(agent),
        "model": str(model),
        "model_revision": model_revision(model),
        "iteration": iteration,
        **settings,
    }


def model_revision(path: str | Path) -> str | None:
    """A cheap fingerprint of a local model directory: sha256 over the names, sizes and mtimes of its weight and
    config files (hashing gigabytes of weights per iteration would cost more than sampling). ``None`` for
    non-directories (a remote endpoint's revision is whatever its spec says)."""
    root = Path(path)
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(root.iterdir()):
        if file.suffix in (".safetensors", ".bin", ".json", ".model") and file.is_file():
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


class RolloutStore:
    """An append-only, resumable set of rollouts in a directory (see the module docstring)."""

    def __init__(self, path: str | Path, producer: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.path / STORE_MANIFEST
        producer = json.loads(json.dumps(producer or {}, default=str))
        if manifest.exists():
            previous = json.loads(manifest.read_text())
            if producer and previous != producer:
                changed = sorted(k for k in set(previous) | set(producer) if previous.get(k) != producer.get(k))
                raise RolloutStoreError(
                    f"{self.path} holds rollouts of a different producer (differs in {changed}); use another path"
                )
            self.producer = previous
        else:
            manifest.write_text(json.dumps(producer, indent=2) + "\n")
            self.producer = producer
        self.file = self.path / ROLLOUTS_FILE
        self._repair()

    def _repair(self) -> None:
        """Cut a torn last line left by a kill in the middle of a write."""
        if not self.file.exists():
            return
        data = self.file.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.file, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def __iter__(self) -> Iterator[Rollout]:
        if not self.file.exists():
            return
        with open(self.file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield Rollout.from_json(line)
                    except (ValueError, KeyError) as exc:
                        raise RolloutStoreError(f"{self.file}:{number}: unreadable rollout ({exc})") from exc

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys(self) -> set[str]:
        return {r.key for r in self}

    def append(self, rollouts: Iterable[Rollout]) -> None:
        with open(self.file, "a", encoding="utf-8") as f:
            for rollout in rollouts:
                f.write(rollout.to_json() + "\n")  # one write per complete line
            f.flush()
            os.fsync(f.fileno())

    def groups(self) -> dict[str, list[Rollout]]:
        """Rollouts by group, each group ordered by sample number."""
        out: dict[str, list[Rollout]] = {}
        for rollout in self:
            out.setdefault(rollout.group, []).append(rollout)
        return {g: sorted(rs, key=lambda r: r.sample) for g, rs in out.items()}


def collect(
    method: str,
    examples: Iterable[Example],
    ctx: Context,
    store: RolloutStore,
    samples: int = 1,
    concurrency: int = 32,
    progress: bool = False,
    on_rollout: Callable[[Rollout], None] | None = None,
) -> int:
    """Run ``method`` ``samples`` times per example (the config's sampling should be stochastic) and append every
    finished run to ``store``; keys already there are skipped, so re-running after a kill resumes. Failed runs are
    stored too (``trace.error`` set): a trainer counts and reports them rather than losing them. Returns the number
    of new rollouts."""
    import asyncio

    from sleuth.runner import arun

    done = store.keys()
    jobs: list[tuple[str, str, int, Example]] = []
    for example in examples:
        for sample in range(samples):
            key = f"{example.id}#{sample}"
            if key not in done:
                jobs.append((key, example.id, sample, example))
    if not jobs:
        return 0
    by_trace: dict[int, tuple[str, str, int]] = {}
    copies: list[Example] = []
    for key, group, sample, example in jobs:
        copy = Example.from_dict(example.to_dict())
        by_trace[id(copy)] = (key, group, sample)
        copies.append(copy)

    def write(trace: Trace) -> None:
        key, group, sample = by_trace[id(trace.example)]
        rollout = Rollout(key=key, group=group, sample=sample, trace=trace)
        store.append([rollout])
        if on_rollout is not None:
            on_rollout(rollout)

    asyncio.run(arun(method, copies, ctx, concurrency=concurrency, on_trace=write, progress=progress))
    return len(jobs)
