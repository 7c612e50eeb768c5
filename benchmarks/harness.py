"""What the four learning benchmarks (``learn_*.py``) share: stages that run once and resume, evaluations cached per
stage and split, bootstrap CIs, paired differences, the list of settings tried on the dev split, and the report
(``results.json``, ``results.md``, ``curve.png``).

A benchmark is a sequence of stages (build a world, SFT, mDPO, ...) and evaluations of the models they produce::

    exp = Experiment("learn_acesearcher", work, results, seed=0)
    sft = exp.stage("sft", {"lr": 1e-4, ...}, lambda: {"model": str(train_sft(...))})
    test = exp.evaluate("sft", "test", {"model": sft["model"]}, lambda: {"per_example": {"em": [...]}})

Each stage's result is cached in ``WORK/stages/<name>.json`` with the settings it ran with (its *key*), and each
evaluation in ``WORK/eval/<split>/<stage>-<hash of its key>.json``. A rerun after a kill skips what finished and
calls the rest again, so a stage's function must itself resume (the trainers do: they restart from their last
checkpoint). A cached stage whose key differs from this run's is an error naming the files to remove: results of
one setting are never mixed with another's. A benchmark that wants settings side by side names the stage (and its
output directory) after :func:`key_hash` of its key.

Hyper-parameters are chosen on the dev split only: :meth:`Experiment.record_trial` appends each run's settings and
dev metrics to ``RESULTS/trials.json`` (kept across work directories), and the report lists them all.
:meth:`Experiment.choose` is the rule that picks a group's setting on dev (best dev value of one stage, ties to the
earliest trial); it records the choice with a timestamp in ``trials.json``, and an evaluation on ``test`` that names
its group (``evaluate(..., group=G)``) is refused until G's choice is recorded. Every tried setting's test result
is still reported; the report marks the chosen one.

**Results accumulate.** The working directory defaults to ``$SLEUTH_RUNS/learn-NAME[-smoke|-full]``
(``$SLEUTH_RUNS`` defaults to ``$SLEUTH_HOME/runs``, see :func:`sleuth.assets.sleuth_home`; ``--work`` overrides
both), outside any checkout, so a later run on the same machine continues where the last stopped. Each evaluation
record carries an ``eval_key``: its key with every path replaced by the content hash of what it names
(:func:`content_hash`: a model's weight, config and tokenizer files, any other directory's files), the split, and
the data settings (the ``world`` stage's key); it is written into ``results.json``. On a miss in the working
directory, :meth:`Experiment.evaluate` looks the ``eval_key`` up in the committed ``RESULTS/results.json`` and reads
a match back as a cache hit, so a committed evaluation is never recomputed, whatever checkout or work directory a
run starts from. A small trained artifact that later stages consume (a LoRA adapter of at most
``ARTIFACT_MAX_BYTES``) may be committed under ``RESULTS/artifacts/<stage>/`` with its content hash
(:func:`save_artifact`) and reused (:func:`load_artifact`, which refuses files that do not match the hash).

**Claims.** A benchmark declares its claims as data (``CLAIMS`` in each ``learn_*.py``: name, metric, the stage
before and the stage after, on ``test``); :meth:`Experiment.write` adds them to ``results.json`` (:func:`claims`)
and a table to ``results.md``: better / worse questions, the one-sided exact p (:func:`sleuth.eval.stats.paired_test`),
*shown* by the standard of :func:`sleuth.eval.stats.shown` (p < 0.05 on >= 100 test questions) and Holm's
correction across the benchmark's claims (``p_holm``, ``shown_holm``). ``benchmarks/recompute_claims.py`` rewrites
them in the committed results from their per-question scores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sleuth.eval.stats import (
    ALPHA,
    MIN_QUESTIONS,
    bootstrap_ci,
    detectable_difference,
    holm,
    paired_difference_ci,
    paired_test,
    questions_needed,
    shown,
)
from sleuth.retrieval.base import INDEX_MANIFEST
from sleuth.retrieval.building import write_atomic
from sleuth.train.tracking import flatten

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"


ARTIFACT_MAX_BYTES = 10 * 2**20
"""The largest trained artifact (all its files) :func:`save_artifact` commits beside a benchmark's results."""

HASH_CACHE = ".sleuth-sha256.json"
"""The file beside a hashed directory's files that caches :func:`content_hash` (by each file's size and mtime)."""

#: what a model loader reads from a model directory: weights, configs, tokenizer and chat template (a trainer's
#: own records beside them, such as ``sft_config.json`` or ``data_summary.json``, name the directories they were
#: written in)
_MODEL_SUFFIXES = (".safetensors", ".bin", ".model", ".jinja")
_MODEL_NAMES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
)

COMMITTED_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
"""Where the benchmarks' reports are committed (``docs/results/<benchmark>/``)."""

HASH_RULE = 3
"""The version of what :func:`content_hash` covers, kept with every cached hash and evaluation key (a hash or key
of another rule is computed again). 2: an index manifest's provenance (``INDEX_PROVENANCE``) is left out; 3: of a
model directory only what a loader reads (a trainer's records in it hold paths)."""

INDEX_PROVENANCE = ("corpus", "built_at")
"""Fields of an index manifest (``sleuth-index.json``) that say where and when it was built, not what it holds: the
corpus path differs per checkout, the time per build, and the passages themselves are hashed in the index's files.
With them two builds of one corpus never had the same hash, so no committed evaluation was ever found again."""


_OFFLINE_FLAG = (b'"local_files_only": true', b'"local_files_only": false')
"""transformers writes ``local_files_only`` into a saved ``tokenizer_config.json`` from ``HF_HUB_OFFLINE``: a loader
flag, not content. A model saved offline hashes as the one saved online (the H100 run, offline, converted SmolLM2
to a directory whose hash differed from the 2-core machine's in that line); the bytes of a directory saved online are
hashed unchanged, so the rule (``HASH_RULE``) and every committed key stay as they were."""


TIE_BREAKS = ("earliest", "fewest_changed")
"""How :meth:`Experiment.choose` breaks a tie on dev."""


def runs_home() -> Path:
    """Where the benchmarks' working directories live by default: ``$SLEUTH_RUNS``, else ``$SLEUTH_HOME/runs``."""
    from sleuth.assets import sleuth_home

    env = os.environ.get("SLEUTH_RUNS")
    return Path(env).expanduser() if env else sleuth_home() / "runs"


def _hashed_files(root: Path) -> list[Path]:
    """The files whose content :func:`content_hash` covers: of a model directory (``config.json`` or
    ``adapter_config.json`` in it) its top-level weight, config, tokenizer and chat-template files
    (``training_args.bin`` aside: it names the output directory), of any other directory every file below it."""
    if (root / "config.json").is_file() or (root / "adapter_config.json").is_file():
        return sorted(
            f
            for f in root.iterdir()
            if f.is_file()
            and (f.suffix in _MODEL_SUFFIXES or f.name in _MODEL_NAMES)
            and f.name not in (HASH_CACHE, "training_args.bin")
        )
    return sorted(f for f in root.rglob("*") if f.is_file() and f.name != HASH_CACHE)


def _index_content(manifest: Path) -> dict[str, Any] | None:
    """An index manifest without its provenance (``INDEX_PROVENANCE``); None when the file is not a JSON object (it
    is then hashed byte for byte, like any other file)."""
    try:
        data = json.loads(manifest.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return None
    return {k: v for k, v in data.items() if k not in INDEX_PROVENANCE} if isinstance(data, dict) else None


def content_hash(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (:func:`_hashed_files`: names and bytes), cached for a
    directory in ``HASH_CACHE`` beside them, keyed by each file's size and mtime (a changed file is hashed again;
    an unwritable directory is hashed every time)."""
    root = Path(path)
    if root.is_file():
        return hashlib.sha256(root.read_bytes()).hexdigest()
    files = _hashed_files(root)
    stamp = {str(f.relative_to(root)): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    cache = root / HASH_CACHE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("files") == stamp and cached.get("rule") == HASH_RULE:
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root)).encode() + b"\0")
        manifest = _index_content(f) if f.name == INDEX_MANIFEST else None
        if manifest is not None:
            digest.update(json.dumps(manifest, sort_keys=True).encode())
        elif f.name == "tokenizer_config.json":
            digest.update(f.read_bytes().replace(*_OFFLINE_FLAG))
        else:
            with open(f, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        digest.update(b"\0")
    value = digest.hexdigest()
    with contextlib.suppress(OSError):  # unwritable: hashed again next time
        write_atomic(cache, (json.dumps({"sha256": value, "files": stamp, "rule": HASH_RULE}) + "\n").encode())
    return value


def portable(key: Any) -> Any:
    """``key`` with every string that names an existing file or directory (it contains a ``/``) replaced by
    ``sha256:<content_hash>``: what an evaluation depends on, wherever the files lie."""
    if isinstance(key, dict):
        return {k: portable(v) for k, v in key.items()}
    if isinstance(key, list | tuple):
        return [portable(v) for v in key]
    if isinstance(key, str) and "/" in key and Path(key).expanduser().exists():
        return "sha256:" + content_hash(Path(key).expanduser())
    return key


def save_artifact(results: Path, stage: str, source: Path, max_bytes: int = ARTIFACT_MAX_BYTES) -> str:
    """Copy the trained artifact ``source`` (a directory, e.g. a LoRA adapter) to ``RESULTS/artifacts/<stage>/``
    to be committed, with ``ARTIFACT.json`` holding its content hash; refused above ``max_bytes``. Its hash."""
    files = _hashed_files(source)
    size = sum(f.stat().st_size for f in files)
    if size > max_bytes:
        raise ValueError(f"{source}: {size} bytes, over the {max_bytes} an artifact may have to be committed")
    target = results / "artifacts" / stage
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for f in files:
        (target / f.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target / f.relative_to(source))
    value = content_hash(source)
    (target / HASH_CACHE).unlink(missing_ok=True)
    manifest = {"stage": stage, "sha256": value, "bytes": size, "source": short(source)}
    write_atomic(target / "ARTIFACT.json", (json.dumps(manifest, indent=1) + "\n").encode())
    if _artifact_hash(target) != value:
        raise ValueError(f"{target}: the copy's content hash differs from {source}'s")
    return value


def _artifact_hash(target: Path) -> str:
    """The content hash of an artifact directory's files but its manifest (no cache file: always computed)."""
    digest = hashlib.sha256()
    for f in _hashed_files(target):
        if f.name != "ARTIFACT.json":
            digest.update(str(f.relative_to(target)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def load_artifact(results: Path, stage: str, sha256: str | None = None) -> Path | None:
    """The committed artifact of ``stage`` (``RESULTS/artifacts/<stage>/``), or None when there is none; an error
    when its files do not match the hash in its ``ARTIFACT.json``, or ``sha256`` when given (another setting's)."""
    target = results / "artifacts" / stage
    manifest = target / "ARTIFACT.json"
    if not manifest.exists():
        return None
    recorded = json.loads(manifest.read_text())["sha256"]
    actual = _artifact_hash(target)
    if actual != recorded or (sha256 is not None and recorded != sha256):
        raise ValueError(
            f"{target}: content hash {actual[:12]}, recorded {recorded[:12]}"
            + (f", wanted {sha256[:12]}" if sha256 else "")
            + ": refusing a mismatched artifact"
        )
    return target


def key_hash(key: Any) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def machine() -> str:
    return f"{platform.machine()} {platform.system()}, python {platform.python_version()}"


def command_line() -> str:
    return shlex.join(["python", *[_relative(a) for a in sys.argv]])


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO)) if "/" in path else path
    except ValueError:
        return path


def short(path: str | Path) -> str:
    """A model directory for a table: relative to the repository when inside it."""
    return _relative(str(path))


def copy_tree_atomic(source: Path, target: Path, ignore: Callable[[str, list[str]], list[str]] | None = None) -> None:
    """Copy the directory ``source`` to ``target`` through ``target.copying`` and a rename, so a killed copy leaves
    no half-filled ``target`` (a stage that finds ``target`` trusts it)."""
    partial = target.with_name(target.name + ".copying")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, ignore=ignore)
    partial.rename(target)


def parse_sized(parser: argparse.ArgumentParser, full: dict[str, Any]) -> argparse.Namespace:
    """Parse the command line of a benchmark that has ``--smoke`` and ``--full``: with ``--full`` the defaults of
    the flags in ``full`` (argparse destinations) become its GPU sizes, while a flag given on the command line still
    wins (``--full --steps 20``)."""
    parser.add_argument(
        "--full", action="store_true", help="sized for a GPU (not run on the 2-core CPU): " + _sizes(full)
    )
    args = parser.parse_args()
    if args.full:
        if args.smoke:
            parser.error("--smoke and --full exclude each other")
        parser.set_defaults(**full)
        args = parser.parse_args()
    return args


def add_sweep_arguments(parser: argparse.ArgumentParser, chosen_by: str) -> None:
    """``--group``, ``--dev-only`` and ``--choose``: a setting as one trial of a sweep chosen on dev
    (:meth:`Experiment.record_trial`, :meth:`Experiment.choose`); ``chosen_by`` says what the choice ranks."""
    parser.add_argument(
        "--group",
        default=None,
        help="a sweep's name: this setting is one of its trials, evaluated on dev first and recorded in trials.json; "
        "its test evaluation is refused until the group's dev choice is recorded (--choose)",
    )
    parser.add_argument(
        "--dev-only", action="store_true", help="with --group: record the trial on dev and stop (no test, no report)"
    )
    parser.add_argument(
        "--choose",
        action="store_true",
        help=f"with --group: first record the group's dev choice (Experiment.choose: {chosen_by} among the recorded "
        "trials), then evaluate this setting on test",
    )


def _sizes(full: dict[str, Any]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in full.items()).replace("%", "%%")


def run_dirs(name: str, args: argparse.Namespace, results: Path) -> tuple[Path, Path]:
    """The working and results directories of benchmark ``name`` (``learn_arena``): ``--work`` / ``--results`` when
    given; else ``RUNS/learn-arena`` and the committed ``results``, ``RUNS/learn-arena-smoke`` and a results
    directory inside it with ``--smoke``, ``RUNS/learn-arena-full`` and ``results/full`` with ``--full`` (a GPU run's
    report sits beside the CPU one and never mixes its stages with the CPU run's), likewise ``-world`` / ``world``
    with ``--world`` (``-full-world`` / ``full-world`` with both). ``RUNS`` is :func:`runs_home`
    (``$SLEUTH_RUNS``, else ``$SLEUTH_HOME/runs``): outside the checkout, so runs accumulate across checkouts."""
    parts = [v for v in ("smoke", "full", "world") if getattr(args, v, False) is True]  # flags only
    variant = "".join(f"-{v}" for v in parts)
    work = args.work or runs_home() / (name.replace("_", "-") + variant)
    if args.results:
        return work, args.results
    return work, work / "results" if args.smoke else results / "-".join(parts) if parts else results


def _without_steps(key: dict[str, Any], group: str) -> dict[str, Any]:
    return {**key, group: {k: v for k, v in key[group].items() if k != "steps"}}


def _after(name: str, done: int) -> bool:
    """Whether ``name`` is the rollout directory of a step after the first ``done`` (``step-00006`` is step 7)."""
    return name.startswith("step-") and name[5:].isdigit() and int(name[5:]) >= done


def continue_online_rl(exp: Experiment, out: Path, key: dict[str, Any], group: str) -> str | None:
    """Start an online-RL stage (s3's PPO, ARENA's GRPO: :mod:`sleuth.train.online_rl`) from the furthest checkpoint
    of a sibling stage ``group-*`` whose key equals ``key`` on every setting but ``key[group]["steps"]`` and that has
    trained at most this run's steps (``--steps 10`` after a ``--steps 4`` run; ``--steps 6`` from a ``--steps 8``
    run killed after its step-6 checkpoint): copy its checkpoint, log and rollouts into ``out`` and the trainer
    resumes at that step. Step t of the loop depends only on those settings and steps 1..t-1 (the learning rates are
    constant after their warm-ups, the questions of a step come from one seeded order, the checkpoint carries the
    random streams), so the copy is what this run would train. Returns the source directory, or None when no
    sibling fits or ``out`` already has a checkpoint of its own."""
    if (out / "checkpoint" / "state.json").exists():
        return None
    key = json.loads(json.dumps(key, default=str))  # as the stage records store it
    best: tuple[int, Path] | None = None
    for name, theirs in exp.stage_keys(group, unfinished=True).items():
        source = exp.work / name
        state = source / "checkpoint" / "state.json"
        if name == out.name or _without_steps(theirs, group) != _without_steps(key, group) or not state.exists():
            continue
        done = json.loads(state.read_text())["step"]
        if 0 < done <= key[group]["steps"] and (best is None or done > best[0]):
            best = (done, source)
    if best is None:
        return None
    done, source = best
    print(f"[{exp.name}] {group}: continuing from step {done} of {source} (the same settings but the step count)")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("checkpoint", "rollouts"):
        # a killed run's rollouts of the steps after its checkpoint are redone here, not copied
        copy_tree_atomic(source / name, out / name, ignore=lambda _, names: [n for n in names if _after(n, done)])
    for name in ("log.jsonl", "naive_rag_cache.jsonl"):
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
    return str(source)


def online_rl_result(out: Path, summary: dict[str, Any], continued: str | None) -> dict[str, Any]:
    """An online-RL stage's record: its directory and model, the trainer's summary, its per-step log and the run
    its first steps were continued from (:func:`continue_online_rl`), if any."""
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {"dir": str(out), "model": str(out / "model"), "summary": summary, "log": log, "continued_from": continued}


class Experiment:
    """One benchmark run: its working directory (stage outputs, caches) and its results directory (the report)."""

    def __init__(
        self, name: str, work: Path, results: Path, seed: int = 0, claims: Sequence[dict[str, Any]] = ()
    ) -> None:
        self.name, self.work, self.results, self.seed = name, work, results, seed
        self.claim_specs = list(claims)
        self.started = time.perf_counter()
        work.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        self.seconds: dict[str, float] = {}
        self.data: dict[str, Any] = {}  # the data settings every evaluation depends on (the world stage's key)
        self._committed: dict[str, dict[str, Any]] | None = None

    # -- stages ----------------------------------------------------------------------------------------------------

    def _cached(self, path: Path, key: Any, what: str) -> dict[str, Any] | None:
        """The cached record at ``path`` when its key is ``key``; an error when it holds another key."""
        key = json.loads(json.dumps(key, default=str))
        pending = path.with_suffix(".key.json")
        for file in (path, pending):
            if file.exists():
                stored = json.loads(file.read_text())
                if stored.get("key") != key:
                    raise SystemExit(
                        f"{what}: {file} was made with other settings than this run's; remove it (and the stages "
                        f"after it) or pass --work DIR.\n  stored: {json.dumps(stored.get('key'))}\n  now:    "
                        f"{json.dumps(key)}"
                    )
        if path.exists():
            return json.loads(path.read_text())
        path.parent.mkdir(parents=True, exist_ok=True)
        # a killed stage resumes only as itself
        write_atomic(pending, (json.dumps({"key": key}, default=str) + "\n").encode())
        return None

    def _store(self, path: Path, key: Any, result: dict[str, Any], seconds: float) -> dict[str, Any]:
        record = {"key": json.loads(json.dumps(key, default=str)), "seconds": round(seconds, 1), **result}
        write_atomic(path, (json.dumps(record, indent=1, default=str) + "\n").encode())
        path.with_suffix(".key.json").unlink(missing_ok=True)
        return record

    def stage(self, name: str, key: Any, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``run()``'s result (a JSON object) for stage ``name``, computed once per ``key``; seconds recorded."""
        path = self.work / "stages" / f"{name}.json"
        if name == "world":
            self.data["world"] = json.loads(json.dumps(key, default=str))
        cached = self._cached(path, key, f"stage {name}")
        if cached is None:
            print(f"[{self.name}] stage {name} ...", flush=True)
            started = time.perf_counter()
            cached = self._store(path, key, run(), time.perf_counter() - started)
            self._release(name)
        self.seconds[name] = cached["seconds"]
        return cached

    def _release(self, name: str) -> None:
        """Give a finished stage's freed memory back to the system before the next stage starts its servers (a
        learn_s3 process with 10.8 GB resident after PPO was OOM-killed beside two vLLM servers); say how much."""
        from sleuth.train.common import free_memory, resident_bytes

        before = resident_bytes()
        free_memory()
        after = resident_bytes()
        if before is not None and after is not None:
            gib = 2**30
            print(f"[{self.name}] stage {name} done: resident {before / gib:.1f} GiB, {after / gib:.1f} after freeing")

    def stage_dir(self, name: str, key: Any) -> Path:
        """The output directory of stage ``name`` run with ``key``: a new key trains into a new directory, so a stage
        rerun after its cached record was removed never resumes another setting's checkpoints."""
        return self.work / f"{name}-{key_hash(key)}"

    def stage_keys(self, prefix: str, unfinished: bool = False) -> dict[str, Any]:
        """The keys of the finished stages named ``prefix-*`` (``stage_dir``'s siblings), by stage name; with
        ``unfinished``, also those of stages started and not finished (killed)."""
        keys = {}
        for path in sorted((self.work / "stages").glob(f"{prefix}-*.json")):
            pending = path.name.endswith(".key.json")
            if unfinished or not pending:
                keys.setdefault(
                    path.name.removesuffix(".key.json").removesuffix(".json"), json.loads(path.read_text())["key"]
                )
        return keys

    def synthetic_world(self, settings: dict[str, Any]) -> tuple[Path, str]:
        """Stage ``world``: a synthetic world made with ``settings`` (``synthesize``'s keyword arguments) and a BM25
        index of its corpus; its directory and the index spec."""

        def make() -> dict[str, Any]:
            from sleuth.data.synth import synthesize
            from sleuth.retrieval.bm25 import build_bm25_index

            out = self.stage_dir("world", settings)
            if not (out / "world.json").exists():
                synthesize(out, **settings)
            if not (out / "index").exists():
                build_bm25_index(out / "corpus.jsonl", out / "index")
            return {"world": str(out), "index": str(out / "index")}

        record = self.stage("world", settings, make)
        return Path(record["world"]), record["index"]

    def eval_key(self, split: str, key: Any) -> dict[str, Any]:
        """What an evaluation depends on, wherever its files lie: the split, the data settings and ``key`` with
        paths replaced by content hashes (:func:`portable`); committed in ``results.json`` and looked up there."""
        return {"split": split, "data": self.data, "settings": portable(json.loads(json.dumps(key, default=str)))}

    def committed(self) -> dict[str, dict[str, Any]]:
        """The committed evaluations that carry an ``eval_key``, by that key: those of ``RESULTS/results.json``,
        then of every ``results.json`` under the benchmark's committed results (``docs/results/<name>/``: its
        diagnosis and sweep runs evaluate the same base and SFT models). An evaluation is a pure function of its key,
        so where it was committed does not matter."""
        if self._committed is None:
            self._committed = {}
            found = [self.results / "results.json", *sorted((COMMITTED_RESULTS / self.name).rglob("results.json"))]
            for path in dict.fromkeys(p.resolve() for p in found if p.exists()):
                for record in _evaluation_records(json.loads(path.read_text())):
                    if "eval_key" in record:
                        found_in = {"committed_in": short(path)}
                        self._committed.setdefault(json.dumps(record["eval_key"], sort_keys=True), record | found_in)
        return self._committed

    def evaluate(
        self, stage: str, split: str, key: Any, run: Callable[[], dict[str, Any]], group: str | None = None
    ) -> dict[str, Any]:
        """Evaluation of stage ``stage`` on ``split``: ``run()`` returns ``{"per_example": {metric: [values]}}``
        (plus anything else worth keeping); cached like a stage, and read back from the committed results when
        they hold one with the same :meth:`eval_key` (``from_committed``). Adds ``ci``: a bootstrap CI per metric.
        ``group``: the dev choice (:meth:`choose`) this stage's setting belongs to; on ``test`` it must be recorded
        first."""
        if group is not None and split == "test":
            choice = self.choice(group)
            if choice is None:
                raise SystemExit(
                    f"[{self.name}] {stage} on test: the dev choice of group {group!r} is not recorded yet "
                    "(Experiment.choose after the dev evaluations): the test split is looked at only after it"
                )
        # an evaluation is a pure function of its key (model, questions, agent): cached under the key's hash, so
        # trying another setting of a later stage keeps the earlier evaluations and never mixes two settings
        path = self.work / "eval" / split / f"{stage}-{key_hash(key)}.json"
        cached = self._cached(path, key, f"evaluation of {stage} on {split}")
        if cached is None:
            started = time.perf_counter()
            portable_key = self.eval_key(split, key)
            hit = self.committed().get(json.dumps(portable_key, sort_keys=True))
            if hit is not None:
                print(f"[{self.name}] {stage} on {split}: the committed evaluation (same eval_key)", flush=True)
                result = {k: v for k, v in hit.items() if k not in ("key", "seconds", "ci", "committed_in")}
                result["from_committed"] = hit["committed_in"]
                cached = self._store(path, key, result, float(hit.get("seconds", 0.0)))
            else:
                print(f"[{self.name}] evaluating {stage} on {split} ...", flush=True)
                result = {**run(), "eval_key": portable_key, "eval_key_rule": HASH_RULE}
                cached = self._store(path, key, result, time.perf_counter() - started)
        if cached.get("eval_key_rule") != HASH_RULE:  # evaluated before eval keys existed, or under another rule
            cached["eval_key"], cached["eval_key_rule"] = self.eval_key(split, key), HASH_RULE
            write_atomic(path, (json.dumps(cached, indent=1, default=str) + "\n").encode())
        if group is not None:
            cached["group"] = group
        self.seconds[f"eval {split} {stage}"] = cached["seconds"]
        cached["ci"] = {m: bootstrap_ci(v, seed=self.seed) for m, v in cached["per_example"].items()}
        shown = ", ".join(f"{m} {100 * c['mean']:.1f}" for m, c in cached["ci"].items())
        print(f"[{self.name}] {stage} on {split} (n={self.n(cached)}): {shown}", flush=True)
        return cached

    @staticmethod
    def n(evaluation: dict[str, Any]) -> int:
        return len(next(iter(evaluation["per_example"].values()), []))

    def differences(
        self, evaluations: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]], metrics: Sequence[str]
    ) -> dict[str, dict[str, dict[str, float]]]:
        """Paired bootstrap CI of ``after - before`` per metric, for each ``(after, before)`` of ``pairs``, with
        the one-sided exact test of "after > before" (:func:`compare`: ``better``, ``worse``, ``p_exact``)."""
        return {
            f"{after} - {before}": {
                m: compare(evaluations[before]["per_example"][m], evaluations[after]["per_example"][m], self.seed)
                for m in metrics
            }
            for after, before in pairs
            if after in evaluations and before in evaluations
        }

    # -- settings tried on the dev split ---------------------------------------------------------------------------

    def _trials_file(self) -> list[dict[str, Any]]:
        path = self.results / "trials.json"
        return json.loads(path.read_text()) if path.exists() else []

    def record_trial(
        self,
        settings: dict[str, Any],
        dev: dict[str, dict[str, Any]],
        metric: str,
        group: str | None = None,
        test: dict[str, dict[str, Any]] | None = None,
        reference: str | None = None,
    ) -> list[dict]:
        """Add this run's settings and its dev-split ``metric`` per stage to ``RESULTS/trials.json`` (``group``:
        the settings compared with each other by :meth:`choose`); all entries (trials, then recorded choices).
        ``test``: the trial's test evaluations, once allowed, so that every tried setting's test value is listed
        beside its dev value, chosen or not (a later record without them keeps the earlier ones). ``reference``: a
        stage in ``dev`` (the model the trials start from): each stage's count of dev questions whose ``metric``
        differs from it is recorded as ``dev_changed`` (the size of the update, :meth:`choose`'s
        ``fewest_changed`` tie-break)."""
        entries = self._trials_file()
        entry = {
            "id": key_hash(settings),
            "settings": json.loads(json.dumps(settings, default=str)),
            "dev": {stage: round(100 * e["ci"][metric]["mean"], 1) for stage, e in dev.items()},
            "dev_n": max((self.n(e) for e in dev.values()), default=0),
            "metric": metric,
            **({"group": group} if group is not None else {}),
            "at": _now(),
        }
        if reference is not None:
            base = dev[reference]["per_example"][metric]
            entry["dev_changed"] = {
                stage: sum(a != b for a, b in zip(e["per_example"][metric], base, strict=True))
                for stage, e in dev.items()
                if stage != reference
            }
        if test:
            entry["test"] = {stage: round(100 * e["ci"][metric]["mean"], 1) for stage, e in test.items()}
            entry["test_n"] = max(self.n(e) for e in test.values())
        old = next((t for t in entries if t.get("id") == entry["id"] and "settings" in t), None)
        if old is not None and old.get("at"):
            entry["at"] = old["at"]  # first recorded
        if old is not None and not test and "test" in old:
            entry["test"], entry["test_n"] = old["test"], old.get("test_n")
        if old is None:
            entries.append(entry)
        else:  # in place: a rerun keeps its row, and choose's tie-break (the earliest recorded) its order
            entries[entries.index(old)] = entry
        write_atomic(self.results / "trials.json", (json.dumps(entries, indent=1) + "\n").encode())
        return entries

    def choose(
        self, group: str, stage: str, higher_is_better: bool = True, tie_break: str = "earliest"
    ) -> dict[str, Any]:
        """The rule that picks a setting on dev: of the trials of ``group`` (``record_trial``'s ``group``), the one
        with the best dev value of ``stage`` (its recorded metric). Ties: ``earliest``, the earliest recorded;
        ``fewest_changed``, the smallest update (fewest dev questions changed from ``record_trial``'s reference, then
        the earliest): among settings that dev cannot tell apart, the one that moved the starting model least (the
        mDPO lr sweep's tie at 29.0 was between 24 and 4 changed dev questions). The choice, with its tie-break, is
        appended to ``trials.json`` with a timestamp (unless the same choice among the same trials is there), and
        from then on test evaluations of the group are allowed (:meth:`evaluate`). Returns the choice."""
        if tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break={tie_break!r}; expected one of {TIE_BREAKS}")
        entries = self._trials_file()
        candidates = [t for t in entries if "settings" in t and t.get("group") == group and stage in t["dev"]]
        if not candidates:
            raise SystemExit(f"[{self.name}] choose {group!r}: no trial of the group has a dev value of {stage!r}")
        if tie_break == "fewest_changed":
            unmeasured = [t["id"] for t in candidates if stage not in t.get("dev_changed", {})]
            if unmeasured:
                raise SystemExit(
                    f"[{self.name}] choose {group!r} by fewest_changed: trials {unmeasured} have no dev_changed "
                    f"for {stage!r} (record_trial(..., reference=...))"
                )
        sign = 1 if higher_is_better else -1

        def rank(t: dict[str, Any]) -> tuple[float, float, int]:
            changed = t["dev_changed"][stage] if tie_break == "fewest_changed" else 0
            return (sign * t["dev"][stage], -changed, -candidates.index(t))

        best = max(candidates, key=rank)
        choice = {
            "choice": group,
            "id": best["id"],
            "stage": stage,
            "metric": best["metric"],
            "higher_is_better": higher_is_better,
            "dev": best["dev"][stage],
            "among": [t["id"] for t in candidates],
        }
        if tie_break != "earliest":  # a choice recorded before tie-breaks were named was by the earliest
            choice["tie_break"] = tie_break
        for old in entries:
            if (
                "choice" in old
                and {k: old.get(k) for k in choice} == choice
                and (old.get("tie_break", "earliest") == tie_break)
            ):
                return old
        choice["at"] = _now()
        write_atomic(self.results / "trials.json", (json.dumps([*entries, choice], indent=1) + "\n").encode())
        print(f"[{self.name}] dev choice of {group}: {best['id']} ({stage} {best['dev'][stage]})", flush=True)
        return choice

    def choice(self, group: str) -> dict[str, Any] | None:
        """The latest recorded dev choice of ``group``, or None."""
        return next((t for t in reversed(self._trials_file()) if t.get("choice") == group), None)

    # -- report ----------------------------------------------------------------------------------------------------

    def write(self, results: dict[str, Any], markdown: str) -> None:
        """Write ``results.json`` and ``results.md``; with the benchmark's claims (``Experiment(claims=...)``),
        both get them (:func:`claims`, :func:`claims_table`)."""
        results = {
            "benchmark": self.name,
            "command": command_line(),
            "machine": machine(),
            "seconds": {**self.seconds, "this_invocation": round(time.perf_counter() - self.started, 1)},
            **results,
        }
        if self.claim_specs:
            results["claims"] = claims(results, self.claim_specs, self.seed)
            markdown = with_claims_table(markdown, results["claims"])
        write_atomic(self.results / "results.json", (json.dumps(results, indent=1, default=str) + "\n").encode())
        write_atomic(self.results / "results.md", markdown.encode())
        self._committed = None
        print(f"results in {self.results}", flush=True)

    def header(self, title: str, summary: str) -> list[str]:
        minutes = sum(v for k, v in self.seconds.items()) / 60
        return [
            f"# {title}",
            "",
            f"`{command_line()}` on {machine()}; recorded compute {minutes:.0f} min in all (per stage below; "
            "a resumed run keeps the earlier runs' timings).",
            "",
            summary,
            "",
        ]

    def seconds_line(self) -> str:
        return "Seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items()) + "."


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def declare(
    path: Path, declared: dict[str, Any], fixed: Callable[[dict[str, Any]], Any] = lambda d: d
) -> dict[str, Any]:
    """A confirmation's declaration, written once before any evaluation (with the time and the commit): the claim,
    the rule and what is tested. A later run whose ``fixed(declaration)`` differs from the stored one's is refused, so
    what a confirmation tests cannot change once evaluation has begun; ``fixed`` drops what may differ (where the
    files lie). Returns the stored declaration."""
    if path.exists():
        old = json.loads(path.read_text())
        if fixed(old) != fixed(json.loads(json.dumps(declared, default=str))):
            raise SystemExit(f"{path} declares another test; a confirmation cannot change once declared")
        return old
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    record = {**declared, "declared_at": _now(), "commit": commit}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(record, indent=1, default=str) + "\n").encode())
    return record


def compare(before: Sequence[float], after: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """``after - before`` on the same questions: the paired bootstrap CI and its share of resamples <= 0
    (:func:`sleuth.eval.stats.paired_difference_ci`) with the one-sided exact test of "after > before"
    (:func:`sleuth.eval.stats.paired_test`): ``better``, ``worse``, ``p_exact``, ``test``."""
    test = paired_test(before, after, seed=seed)
    return {
        **paired_difference_ci(list(before), list(after), seed=seed),
        "better": test["better"],
        "worse": test["worse"],
        "p_exact": test["p"],
        "test": test["test"],
    }


def _evaluation_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every evaluation record (a dict with ``per_example``) anywhere in a ``results.json``."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "per_example" in node:
                found.append(node)
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(results)
    return found


def split_evaluations(results: dict[str, Any], split: str) -> dict[str, dict[str, Any]]:
    """The evaluations of ``split`` by stage in a ``results.json``: ``results["evaluations"][split]``, or
    ``results[split]`` (learn_acesearcher's layout)."""
    holder = results.get("evaluations", results)
    return holder.get(split, {}) if isinstance(holder, dict) else {}


def claims(results: dict[str, Any], specs: Sequence[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """The claims ``specs`` (each ``{name, metric, before, after}``, optional ``split`` (default ``test``) and
    ``before_metric`` (compare ``after``'s metric with another metric, e.g. s3's naive RAG accuracy)) tested on
    the per-question scores in ``results``: ``{name, metric, split, before, after, n, better, worse, mean, lo, hi,
    p_exact, test, shown}``, then Holm across them (``p_holm``, ``shown_holm``). A claim whose stages are not in
    ``results`` is left out."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        split = spec.get("split", "test")
        evals = split_evaluations(results, split)
        if spec["before"] not in evals or spec["after"] not in evals:
            continue
        before = evals[spec["before"]]["per_example"][spec.get("before_metric", spec["metric"])]
        after = evals[spec["after"]]["per_example"][spec["metric"]]
        c = compare(before, after, seed)
        out.append(
            {
                "name": spec["name"],
                "metric": spec["metric"],
                **({"before_metric": spec["before_metric"]} if "before_metric" in spec else {}),
                "split": split,
                "before": spec["before"],
                "after": spec["after"],
                "n": len(after),
                "better": c["better"],
                "worse": c["worse"],
                "mean": c["mean"],
                "lo": c["lo"],
                "hi": c["hi"],
                "p_exact": c["p_exact"],
                "test": c["test"],
                "shown": shown(c["p_exact"], len(after)),
                **power(c["test"], len(after), c["better"], c["worse"]),
            }
        )
    for claim, p in zip(out, holm([c["p_exact"] for c in out]), strict=True):
        claim["p_holm"] = p
        claim["shown_holm"] = shown(p, claim["n"])
    return out


def power(test: str, n: int, better: int, worse: int, target: float = 0.8) -> dict[str, Any]:
    """What the test questions could show (exact McNemar claims only; ``{}`` otherwise): ``detectable`` the smallest
    difference (a share) the test detects with ``target`` power at the observed rate of changed questions (None when
    even all of them turning better would not be enough), ``needed`` the questions the observed rates would need
    (None when the run was not better). :func:`sleuth.eval.stats.detectable_difference`, ``questions_needed``."""
    if test != "exact McNemar" or n == 0:
        return {}
    changed = (better + worse) / n
    return {
        "power_target": target,
        "detectable": detectable_difference(n, changed, target) if changed > 0 else None,
        "needed": questions_needed(better / n, worse / n, target) if better > worse else None,
    }


def power_cell(claim: dict[str, Any]) -> str:
    """The claims tables' power column: ``+7.3 / 335`` (detectable difference in points / questions needed)."""
    if "power_target" not in claim:
        return "-"
    detectable = "not at this rate" if claim["detectable"] is None else f"{100 * claim['detectable']:+.1f}"
    needed = "-" if claim["needed"] is None else f"{claim['needed']:,}"
    return f"{detectable} / {needed}"


def claims_table(found: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: the claims section (:func:`claims`), its rule first."""
    lines = [
        "## Claims",
        "",
        f"A claim is **shown** when its one-sided exact p < {ALPHA} on >= {MIN_QUESTIONS} test questions (exact "
        "McNemar on the questions that changed for 0-1 metrics, exact or 100,000-draw sign-flip test otherwise); "
        "Holm's correction across this benchmark's claims is the last column. The difference's paired bootstrap "
        "95% CI is shown beside it, not used for the verdict. Power (exact McNemar claims): the smallest "
        "difference the test detects with 80% power at the observed rate of changed questions, and the test "
        "questions the observed rates would need for 80% power (`-`: the run was not better).",
        "",
        "| claim | metric | n | better / worse | difference [95% CI] | exact p | shown | Holm p | shown (Holm) "
        "| power: detectable / questions needed |",
        "|---|---|---:|---|---|---:|---|---:|---|---|",
    ]
    for c in found:
        metric = c["metric"] + (f" vs {c['before_metric']}" if "before_metric" in c else "")
        lines.append(
            f"| {c['name']} ({c['after']} vs {c['before']}) | {metric} | {c['n']} | {c['better']} / {c['worse']} "
            f"| {pct(c['mean'], True)} [{pct(c['lo'], True)}, {pct(c['hi'], True)}] | {_p(c['p_exact'])} "
            f"| {'yes' if c['shown'] else 'no'} | {_p(c['p_holm'])} | {'yes' if c['shown_holm'] else 'no'} "
            f"| {power_cell(c)} |"
        )
    return lines


CLAIMS_BEGIN, CLAIMS_END = "<!-- claims: benchmarks/harness.py -->", "<!-- /claims -->"


def with_claims_table(markdown: str, found: Sequence[dict[str, Any]]) -> str:
    """``markdown`` with its claims section (between ``CLAIMS_BEGIN`` and ``CLAIMS_END``) replaced by, or else
    followed by, :func:`claims_table` of ``found``."""
    block = "\n".join([CLAIMS_BEGIN, *claims_table(found), CLAIMS_END])
    if CLAIMS_BEGIN in markdown and CLAIMS_END in markdown:
        head, rest = markdown.split(CLAIMS_BEGIN, 1)
        return head + block + rest.split(CLAIMS_END, 1)[1]
    return markdown.rstrip("\n") + "\n\n" + block + "\n"


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


class ModelServer:
    """The LLM of one model, opened on first use and shared by its evaluations (one vLLM server start per model,
    not per split)."""

    def __init__(self, model_dir: Path, engine: str, options: str) -> None:
        self.model_dir, self.engine, self.options, self.llm = model_dir, engine, options, None

    def __enter__(self) -> ModelServer:
        return self

    def get(self) -> Any:
        if self.llm is None:
            from types import SimpleNamespace

            from sleuth.llm import load_llm
            from sleuth.train.common import engine_spec

            self.llm = load_llm(
                engine_spec(SimpleNamespace(engine=self.engine, llm_options=self.options), self.model_dir)
            )
        return self.llm

    def __exit__(self, *exc: object) -> None:
        if self.llm is not None:
            from sleuth.train.common import close_llm

            close_llm(self.llm)


def base_model(smoke: bool, work: Path) -> Path:
    """The model a benchmark starts from: the embedded SmolLM2, or with ``--smoke`` the tiny random test model
    (built once in ``work``)."""
    if smoke:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_model

        target = work / "tiny-model"
        return target if (target / "config.json").exists() else build_tiny_model(target)
    from sleuth.assets import ensure_default_model

    return ensure_default_model()


def settings_block(settings: Any) -> list[str]:
    """Markdown lines: the run's settings as a JSON block."""
    return ["Settings:", "", "```json", json.dumps(settings, indent=1, default=str), "```", ""]


def pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def stage_table(evaluations: dict[str, dict[str, Any]], metrics: Sequence[str], extra: dict[str, str] | None = None):
    """Markdown rows: one per stage, each metric as ``mean [lo, hi]``; ``extra`` maps a stage to a last cell."""
    head = "| stage | n | " + " | ".join(metrics) + (" | model |" if extra else " |")
    lines = [head, "|---" * (len(metrics) + 2 + bool(extra)) + "|"]
    for stage, e in evaluations.items():
        cells = [f"{pct(e['ci'][m]['mean'])} [{pct(e['ci'][m]['lo'])}, {pct(e['ci'][m]['hi'])}]" for m in metrics]
        tail = f" | {extra.get(stage, '')} |" if extra else " |"
        lines.append(f"| {stage} | {Experiment.n(e)} | " + " | ".join(cells) + tail)
    return lines


def difference_table(differences: dict[str, dict[str, dict[str, float]]], metrics: Sequence[str]) -> list[str]:
    """Markdown rows: one per comparison, each metric as ``+d [lo, hi] p``; a CI strictly above 0 is marked ✓."""
    lines = ["| comparison | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for name, per_metric in differences.items():
        cells = []
        for m in metrics:
            d = per_metric[m]
            mark = " ✓" if d["lo"] > 0 else ""
            cell = (
                f"{pct(d['mean'], True)} [{pct(d['lo'], True)}, {pct(d['hi'], True)}] p {d['p_not_better']:.3f}{mark}"
            )
            if "p_exact" in d:
                cell += f"; {d['better']}/{d['worse']} exact p {_p(d['p_exact'])}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Paired bootstrap over the same questions (1000 resamples); p = share of resamples with a "
        "difference <= 0; ✓ = 95% CI strictly above 0 (anti-conservative when few questions changed); b/w = "
        "questions better / worse and the one-sided exact p (exact McNemar, or sign-flip for continuous metrics): "
        "the claims table's verdict rests on it.",
    ]
    return lines


def rollout_steps(out: Path, log: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per online-RL step, from the rollouts it trained on (``OUT/rollouts/step-*``): episodes, reward mean and
    (population) std, the share of episodes with a reward other than 0 and above 0, the groups and how many of them
    are *mixed* (rewards not all equal: GRPO's advantages are non-zero only there; a one-episode group never is),
    and the mean of each reward component; with the trainer's ``log``, also the step's KL and seconds."""
    from statistics import fmean, pstdev

    from sleuth.train.rollouts import RolloutStore

    logged = {r["step"]: r for r in log or []}
    rows = []
    for step_dir in sorted((out / "rollouts").glob("step-*")):
        rollouts = list(RolloutStore(step_dir))
        if not rollouts:
            continue
        rewards = [float(r.extra.get("reward", 0.0)) for r in rollouts]
        groups: dict[str, set[float]] = {}
        for r, reward in zip(rollouts, rewards, strict=True):
            groups.setdefault(r.group, set()).add(reward)
        components: dict[str, list[float]] = {}
        for r in rollouts:
            for key, value in (r.extra.get("components") or {}).items():
                if isinstance(value, int | float):
                    components.setdefault(key, []).append(float(value))
        step = int(step_dir.name.split("-")[1])
        entry = logged.get(step, {})
        rows.append(
            {
                "step": step,
                "episodes": len(rewards),
                "mean": fmean(rewards),
                "std": pstdev(rewards),
                "nonzero": sum(r != 0 for r in rewards) / len(rewards),
                "positive": sum(r > 0 for r in rewards) / len(rewards),
                "groups": len(groups),
                "mixed_groups": sum(len(v) > 1 for v in groups.values()),
                "components": {k: fmean(v) for k, v in components.items()},
                "kl": entry.get("kl"),
                "seconds": entry.get("seconds"),
            }
        )
    return rows


def step_table(rows: list[dict[str, Any]], components: Sequence[tuple[str, str]], groups: bool) -> list[str]:
    """Markdown rows of :func:`rollout_steps`: ``components`` are (column title, component key) pairs; ``groups``
    adds the mixed-group count (for group-relative advantages; PPO has one episode a group)."""
    titles = [t for t, _ in components] + (["groups with non-zero advantage"] if groups else [])
    head = ["step", "episodes", "reward mean", "reward std", "reward ≠ 0", "reward > 0", *titles, "KL", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [str(r["step"]), str(r["episodes"]), f"{r['mean']:+.3f}", f"{r['std']:.3f}"]
        cells += [f"{100 * r['nonzero']:.0f}%", f"{100 * r['positive']:.0f}%"]
        cells += [f"{r['components'][k]:.3f}" if k in r["components"] else "–" for _, k in components]
        if groups:
            cells.append(f"{r['mixed_groups']} / {r['groups']}")
        cells.append(f"{r['kl']:.4f}" if r.get("kl") is not None else "–")
        cells.append(f"{r['seconds']:.0f}" if r.get("seconds") is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def trials_table(trials: list[dict[str, Any]], varying_only: bool = True) -> list[str]:
    """Markdown rows of every setting tried, with its dev result per stage (only the settings that differ); the
    entries of ``trials.json`` that are dev choices (:meth:`Experiment.choose`) mark their trial as chosen."""
    latest = {t["choice"]: t for t in trials if "choice" in t}  # a group's later choice supersedes its earlier
    choices = {t["id"]: t for t in latest.values()}
    trials = [t for t in trials if "settings" in t]
    if not trials:
        return []
    keys = sorted({k for t in trials for k in flatten(t["settings"])})
    flat = [flatten(t["settings"]) for t in trials]
    if varying_only and len(trials) > 1:
        keys = [k for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1]
    elif varying_only:
        keys = []
    stages = list(dict.fromkeys(s for t in trials for s in t["dev"]))
    tested = list(dict.fromkeys(s for t in trials for s in t.get("test") or {}))
    metric = trials[-1]["metric"]
    rule = (
        "the chosen trial was picked by the harness's rule (best dev value, recorded before its test evaluations)"
        if choices
        else "no dev choice was recorded by the harness (Experiment.choose): the reported setting was picked by hand"
    )
    lines = [
        f"Settings tried (dev split, {metric}; {rule}"
        + ("; the test columns: every trial evaluated on test, chosen or not" if tested else "")
        + "):",
        "",
        "| trial | " + " | ".join(keys + [f"dev {s}" for s in stages] + [f"test {s}" for s in tested]) + " |",
        "|---" * (len(keys) + len(stages) + len(tested) + 1) + "|",
    ]
    for t, f in zip(trials, flat, strict=True):
        cells = [json.dumps(f.get(k)) for k in keys] + [str(t["dev"].get(s, "–")) for s in stages]
        cells += [str((t.get("test") or {}).get(s, "–")) for s in tested]
        chosen = choices.get(t["id"])
        mark = f" (chosen: {chosen['choice']}, dev {chosen['stage']}, {chosen['at']})" if chosen else ""
        lines.append(f"| {t['id']}{mark} | " + " | ".join(cells) + " |")
    return lines


def plot(lines: dict[str, list[tuple[str, dict[str, float]]]], path: Path, ylabel: str, title: str) -> bool:
    """One error-bar line per entry of ``lines`` (label -> [(stage, ci)]), CIs as error bars; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'sleuth[report]'): no curve.png")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names: list[str] = []
    for points in lines.values():
        for stage, _ in points:
            if stage not in names:
                names.append(stage)
    for (label, points), style in zip(lines.items(), ("o-", "s--", "^-.", "d:"), strict=False):
        xs = [names.index(stage) for stage, _ in points]
        means = [100 * ci["mean"] for _, ci in points]
        err = [
            [100 * (ci["mean"] - ci["lo"]) for _, ci in points],
            [100 * (ci["hi"] - ci["mean"]) for _, ci in points],
        ]
        ax.errorbar(xs, means, yerr=err, fmt=style, capsize=4, label=label, alpha=0.85)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
