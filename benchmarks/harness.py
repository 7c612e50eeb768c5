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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sleuth.eval.stats import bootstrap_ci, paired_difference_ci
from sleuth.retrieval.building import write_atomic

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"


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


def _sizes(full: dict[str, Any]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in full.items()).replace("%", "%%")


def run_dirs(name: str, args: argparse.Namespace, results: Path) -> tuple[Path, Path]:
    """The working and results directories of benchmark ``name`` (``learn_arena``): ``--work`` / ``--results`` when
    given; else ``runs/learn-arena`` and the committed ``results``, ``runs/learn-arena-smoke`` and a results
    directory inside it with ``--smoke``, ``runs/learn-arena-full`` and ``results/full`` with ``--full`` (a GPU run's
    report sits beside the CPU one and never mixes its stages with the CPU run's)."""
    variant = "-smoke" if args.smoke else "-full" if getattr(args, "full", False) else ""
    work = args.work or REPO / "runs" / (name.replace("_", "-") + variant)
    if args.results:
        return work, args.results
    return work, work / "results" if args.smoke else results / "full" if variant else results


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

    def __init__(self, name: str, work: Path, results: Path, seed: int = 0) -> None:
        self.name, self.work, self.results, self.seed = name, work, results, seed
        self.started = time.perf_counter()
        work.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        self.seconds: dict[str, float] = {}

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
        cached = self._cached(path, key, f"stage {name}")
        if cached is None:
            print(f"[{self.name}] stage {name} ...", flush=True)
            started = time.perf_counter()
            cached = self._store(path, key, run(), time.perf_counter() - started)
        self.seconds[name] = cached["seconds"]
        return cached

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

    def evaluate(self, stage: str, split: str, key: Any, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Evaluation of stage ``stage`` on ``split``: ``run()`` returns ``{"per_example": {metric: [values]}}``
        (plus anything else worth keeping); cached like a stage. Adds ``ci``: a bootstrap CI per metric."""
        # an evaluation is a pure function of its key (model, questions, agent): cached under the key's hash, so
        # trying another setting of a later stage keeps the earlier evaluations and never mixes two settings
        path = self.work / "eval" / split / f"{stage}-{key_hash(key)}.json"
        cached = self._cached(path, key, f"evaluation of {stage} on {split}")
        if cached is None:
            print(f"[{self.name}] evaluating {stage} on {split} ...", flush=True)
            started = time.perf_counter()
            cached = self._store(path, key, run(), time.perf_counter() - started)
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
        """Paired bootstrap CI of ``after - before`` per metric, for each ``(after, before)`` of ``pairs``."""
        return {
            f"{after} - {before}": {
                m: paired_difference_ci(
                    evaluations[before]["per_example"][m], evaluations[after]["per_example"][m], seed=self.seed
                )
                for m in metrics
            }
            for after, before in pairs
            if after in evaluations and before in evaluations
        }

    # -- settings tried on the dev split ---------------------------------------------------------------------------

    def record_trial(self, settings: dict[str, Any], dev: dict[str, dict[str, Any]], metric: str) -> list[dict]:
        """Add this run's settings and its dev-split ``metric`` per stage to ``RESULTS/trials.json``; all trials."""
        path = self.results / "trials.json"
        trials = json.loads(path.read_text()) if path.exists() else []
        entry = {
            "id": key_hash(settings),
            "settings": json.loads(json.dumps(settings, default=str)),
            "dev": {stage: round(100 * e["ci"][metric]["mean"], 1) for stage, e in dev.items()},
            "dev_n": max((self.n(e) for e in dev.values()), default=0),
            "metric": metric,
        }
        trials = [t for t in trials if t["id"] != entry["id"]] + [entry]
        write_atomic(path, (json.dumps(trials, indent=1) + "\n").encode())
        return trials

    # -- report ----------------------------------------------------------------------------------------------------

    def write(self, results: dict[str, Any], markdown: str) -> None:
        results = {
            "benchmark": self.name,
            "command": command_line(),
            "machine": machine(),
            "seconds": {**self.seconds, "this_invocation": round(time.perf_counter() - self.started, 1)},
            **results,
        }
        write_atomic(self.results / "results.json", (json.dumps(results, indent=1, default=str) + "\n").encode())
        write_atomic(self.results / "results.md", markdown.encode())
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
            from sleuth.train.mdpo import engine_spec

            self.llm = load_llm(
                engine_spec(SimpleNamespace(engine=self.engine, llm_options=self.options), self.model_dir)
            )
        return self.llm

    def __exit__(self, *exc: object) -> None:
        if self.llm is not None:
            from sleuth.train.mdpo import close_llm

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
            cells.append(
                f"{pct(d['mean'], True)} [{pct(d['lo'], True)}, {pct(d['hi'], True)}] p {d['p_not_better']:.3f}{mark}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Paired bootstrap over the same questions (1000 resamples); p = share of resamples with a "
        "difference <= 0; ✓ = 95% CI strictly above 0.",
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
    """Markdown rows of every setting tried, with its dev result per stage (only the settings that differ)."""
    if not trials:
        return []
    keys = sorted({k for t in trials for k in _flat(t["settings"])})
    flat = [_flat(t["settings"]) for t in trials]
    if varying_only and len(trials) > 1:
        keys = [k for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1]
    elif varying_only:
        keys = []
    stages = list(dict.fromkeys(s for t in trials for s in t["dev"]))
    metric = trials[-1]["metric"]
    lines = [
        f"Settings tried (dev split, {metric}; the test split was not looked at to choose):",
        "",
        "| trial | " + " | ".join(keys + [f"dev {s}" for s in stages]) + " |",
        "|---" * (len(keys) + len(stages) + 1) + "|",
    ]
    for t, f in zip(trials, flat, strict=True):
        cells = [json.dumps(f.get(k)) for k in keys] + [str(t["dev"].get(s, "–")) for s in stages]
        lines.append(f"| {t['id']} | " + " | ".join(cells) + " |")
    return lines


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
