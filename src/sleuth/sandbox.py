"""Run model-written Python programs in a separate, resource-limited interpreter and read back one variable.

Program-of-thought agents (AceSearcher's document-level variant) ask a model for a program that stores its result
in ``ans``; :func:`run_program` executes it and returns a :class:`ProgramResult`. A timeout, an exception, a memory
blow-up or a forbidden action is a *result* (``ok=False`` with a short ``error``), never an exception in the caller.

Layers, outermost first:

- a fresh ``python -I -S`` process (isolated mode, no ``site``) with an empty environment, its own session (the whole
  process group is killed on timeout) and a fresh scratch directory as its working directory, removed afterwards;
- kernel limits set before ``exec``: ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (output files),
  ``RLIMIT_NPROC`` (no child processes, unless running as root, which the kernel exempts), ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE``; and, where the kernel permits, a private network namespace (no interfaces: no network at all);
- a wall-clock limit in the parent, counted from the moment the program starts (interpreter start-up excluded);
- in the child, before the program runs: the program's builtins get an ``__import__`` that allows only
  :data:`ALLOWED_MODULES` (modules those import for themselves are not checked) and an ``open`` that refuses every
  write and every read outside the scratch directory; ``exit``/``quit`` just end the program;
- an audit hook (``sys.addaudithook``, which cannot be removed) refusing, whoever asks: sockets and other network
  clients, ``subprocess``, ``os.system``/``exec*``/``spawn*``/``posix_spawn``/``fork``/``kill``, ``ctypes``, file
  writes, reads outside the scratch directory and the interpreter's own library, file-system changes (``os.remove``,
  ``shutil.rmtree``, ...), raising resource limits, and loading the modules in :data:`DENIED_MODULES`.

A refused action raises an exception the program cannot catch with ``except Exception`` and is remembered, so the
result reports it even if the program swallowed it. This is a guard against careless or misbehaving generated code,
not a security boundary against a determined attacker (CPython cannot be sandboxed from the inside); run untrusted
workloads in a container or VM as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

#: What a program may import (top-level names; submodules such as ``collections.abc`` follow their package).
ALLOWED_MODULES: frozenset[str] = frozenset(
    {
        "math",
        "cmath",
        "decimal",
        "fractions",
        "statistics",
        "datetime",
        "re",
        "itertools",
        "functools",
        "collections",
        "numbers",
        "operator",
        "string",
        "json",
        "random",
        "heapq",
        "bisect",
        "copy",
        # harmless helpers that generated code often imports for annotations or records
        "__future__",
        "typing",
        "dataclasses",
        "enum",
    }
)

#: Private helpers that C code of the allowed modules imports lazily *from the program's frame* (so through the
#: program's ``__import__``), e.g. ``datetime.strptime`` importing ``_strptime``.
_HELPER_MODULES = frozenset({"_strptime", "_datetime", "_decimal", "_pydecimal", "_json", "_random", "_statistics"})

#: Modules never loaded in the child, whoever imports them (checked by the audit hook on every module load).
DENIED_MODULES: frozenset[str] = frozenset(
    {
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "subprocess",
        "_posixsubprocess",
        "ctypes",
        "_ctypes",
        "multiprocessing",
        "_multiprocessing",
        "_posixshmem",
        "pty",
        "resource",
        "fcntl",
        "termios",
    }
)

STDOUT_LIMIT = 4000  # characters of the program's output kept in ProgramResult.stdout
_FILE_LIMIT = 8 * 1024 * 1024  # RLIMIT_FSIZE: the program's output file cannot grow past this
_RESULT_LIMIT = 1024 * 1024  # bytes read from the result channel; the rest is discarded
_VALUE_LIMIT = 100_000  # characters of a JSON value; a longer value is replaced by its truncated repr
_STARTUP_LIMIT_S = 20.0  # interpreter start-up and module preloading, before the program's own clock starts
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000


@dataclass
class ProgramResult:
    """What running a program gave.

    ``value``: the result variable as JSON data (numbers, strings, booleans, None, lists of those; anything else is its
    ``repr``). ``error``: None when ``ok``, else a short reason: ``"timeout"``, ``"memory"``, ``"network"``,
    ``"forbidden import: os"``, ``"forbidden: os.system"``, ``"forbidden write: /etc/x"``, ``"syntax error: ..."``,
    ``"exception: ZeroDivisionError: division by zero (line 3)"``, ``"missing variable: ans"``, ``"crashed: ..."``.
    ``variable``: the name the value was read from (``ans``, or a fallback such as ``solution()``). ``stdout``: what
    the program printed, truncated to :data:`STDOUT_LIMIT` characters. ``seconds``: wall time of the whole run.
    """

    ok: bool
    value: Any = None
    error: str | None = None
    stdout: str = ""
    seconds: float = 0.0
    variable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# The child: this function's source is sent to a fresh interpreter with ``-c`` (it must not use module globals).
# ---------------------------------------------------------------------------------------------------------------


def _child_main() -> None:  # pragma: no cover - runs in the child interpreter
    import _signal
    import builtins
    import contextlib
    import json
    import math
    import os
    import sys

    config = json.loads(sys.argv[1])
    result_fd: int = config["fd"]
    scratch: str = os.path.realpath(config["scratch"])
    read_roots = tuple(os.path.realpath(p) for p in config["read_roots"]) + (scratch,)
    allowed = frozenset(config["allowed"])
    denied = frozenset(config["denied"])
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # an over-long output fails with an OSError instead of a kill
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # printed lines survive a timeout kill

    for name in config["preload"]:  # load everything a program may use while loading is still unrestricted
        with contextlib.suppress(ImportError):
            __import__(name)
    for name in denied:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]

    def send(payload: dict) -> None:
        data = (json.dumps(payload) + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(result_fd, data) :]

    violations: list[str] = []

    class SandboxViolation(BaseException):
        """Raised for a refused action; a BaseException, so ``except Exception`` in the program does not hide it."""

    def refuse(reason: str) -> None:
        violations.append(reason)
        raise SandboxViolation(reason)

    def inside(path: object, roots: tuple[str, ...]) -> bool:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False
        real = os.path.realpath(os.path.join(scratch, path))
        return any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots)

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    network_prefixes = ("socket.", "urllib.", "http.client.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.")
    forbidden_prefixes = (
        "subprocess.",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "os.startfile",
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.chflags",
        "os.lchflags",
        "os.truncate",
        "os.utime",
        "os.chdir",
        "os.setxattr",
        "os.removexattr",
        "os.putenv",
        "os.unsetenv",
        "shutil.",
        "pty.",
        "ctypes.",
        "resource.",
        "sys.addaudithook",
        "webbrowser.",
        "winreg.",
    )

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path, flags = args[0], args[2]
            if isinstance(path, int) or (isinstance(flags, int) and flags & write_flags):
                refuse(f"forbidden write: {path}")
            if not inside(path, read_roots):
                refuse(f"forbidden read: {path}")
        elif event == "import":
            if str(args[0]).partition(".")[0] in denied:
                refuse(f"forbidden import: {args[0]}")
        elif event.startswith(network_prefixes):
            refuse("network")
        elif event.startswith(forbidden_prefixes):
            refuse(f"forbidden: {event}")

    real_import = builtins.__import__
    real_open = builtins.open

    def guarded_import(
        name: str, globs: object = None, locs: object = None, fromlist: tuple = (), level: int = 0
    ) -> object:
        top = name.partition(".")[0]
        if level != 0 or (top not in allowed and name not in allowed):
            refuse(f"forbidden import: {name if level == 0 else '.' * level + name}")
        return real_import(name, globs, locs, fromlist, level)

    def guarded_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if isinstance(file, int) or any(c in mode for c in "wax+"):
            refuse(f"forbidden write: {file}")
        if not inside(file, (scratch,)):
            refuse(f"forbidden read: {file}")
        return real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]

    def describe(exc: BaseException) -> str:
        try:
            return str(exc)[:300]
        except BaseException:  # an exception whose __str__ fails
            return "?"

    def leave(code: object = None) -> None:
        raise SystemExit(code)

    user_builtins = dict(builtins.__dict__)
    user_builtins.update(__import__=guarded_import, open=guarded_open, exit=leave, quit=leave)
    namespace: dict = {"__name__": "__main__", "__builtins__": user_builtins}

    def jsonable(value: object, depth: int = 0) -> object:
        from decimal import Decimal
        from fractions import Fraction

        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value) if abs(value) < 10**300 else (math.inf if value > 0 else -math.inf)
        if isinstance(value, float | Fraction | Decimal):
            return float(value)
        if isinstance(value, list | tuple) and depth < 8:
            return [jsonable(v, depth + 1) for v in value]
        return repr(value)

    with real_open(config["program"], encoding="utf-8") as f:
        source = f.read()
    error = None
    sys.addaudithook(audit)
    send({"ready": True})
    try:
        code = compile(source, "<program>", "exec")
    except SyntaxError as exc:
        error = f"syntax error: {exc.msg} (line {exc.lineno})"
    except (ValueError, MemoryError, RecursionError) as exc:
        error = f"syntax error: {type(exc).__name__}: {exc}"
    if error is None:
        try:
            exec(code, namespace)
        except SystemExit:
            pass
        except SandboxViolation:
            pass
        except MemoryError:
            error = "memory"
        except BaseException as exc:  # every failure of the program is its result
            tb, line = exc.__traceback__, None
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == "<program>":
                    line = tb.tb_lineno
                tb = tb.tb_next
            where = f" (line {line})" if line else ""
            error = f"exception: {type(exc).__name__}: {describe(exc)}{where}"
    payload: dict = {}
    if error is None and not violations:
        variable = None
        for name in [config["var"], *config["fallbacks"]]:
            try:
                if name.endswith("()") and callable(namespace.get(name[:-2])):
                    value, variable = namespace[name[:-2]](), name
                elif not name.endswith("()") and name in namespace:
                    value, variable = namespace[name], name
                else:
                    continue
                payload["value"] = jsonable(value)
            except SandboxViolation:
                pass
            except MemoryError:
                error = "memory"
            except BaseException as exc:
                error = f"exception: {type(exc).__name__}: {describe(exc)} (reading {name})"
            break
        if variable is None and error is None and not violations:
            error = f"missing variable: {config['var']}"
        payload["variable"] = variable
    if violations:
        error = violations[0]
    payload.update(ok=error is None, error=error)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # a closed or full stdout must not lose the result
        pass
    try:
        encoded = json.dumps(payload)
    except (ValueError, TypeError):  # an int too long to print, a float that is not JSON, ...
        payload["value"] = repr(payload.get("value"))[:1000]
        encoded = json.dumps(payload)
    if len(encoded) > config["value_limit"]:
        payload["value"] = repr(payload.get("value"))[:1000] + "..."
    send(payload)
    os._exit(0)


@functools.cache
def _child_source() -> str:
    return inspect.getsource(_child_main) + "\n_child_main()\n"


@functools.cache
def _interpreter() -> str:
    """The real interpreter behind a virtualenv's ``python`` (with ``-I -S`` only the standard library is needed)."""
    return os.path.realpath(sys.executable)


@functools.cache
def _read_roots() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({paths["stdlib"], paths["platstdlib"], sys.base_prefix, sys.base_exec_prefix}))


@functools.cache
def _unshare() -> Any:
    """libc's ``unshare`` (None where unavailable); looked up in the parent, called in the child before exec."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).unshare
    except (ImportError, OSError, AttributeError):
        return None


def _limits(timeout_s: float, memory_mb: int) -> Any:
    """The ``preexec_fn``: resource limits and, where permitted, a private network namespace."""
    import resource

    cpu = int(math.ceil(timeout_s)) + 2  # start-up CPU included; the parent's wall clock is the precise limit
    memory = memory_mb * 1024 * 1024
    unshare = _unshare()
    newnet = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET

    def apply() -> None:
        for limit, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (memory, memory)),
            (resource.RLIMIT_FSIZE, (_FILE_LIMIT, _FILE_LIMIT)),
            (resource.RLIMIT_NOFILE, (64, 64)),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NPROC, (0, 0)),
        ):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(limit, value)
        if unshare is not None:
            unshare(newnet)  # fails harmlessly (returns -1) where namespaces are not permitted

    return apply


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _read_text(f: Any, limit: int) -> str:
    f.seek(0)
    data = f.read(limit * 4 + 4).decode("utf-8", "replace")
    return data if len(data) <= limit else data[:limit] + "...[truncated]"


def run_program(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    result_var: str = "ans",
    fallback_vars: tuple[str, ...] = (),
) -> ProgramResult:
    """Run ``code`` in a sandboxed child interpreter and read ``result_var`` from its namespace.

    ``timeout_s`` is the program's wall-clock budget (interpreter start-up excluded); ``memory_mb`` its address-space
    limit. ``fallback_vars`` are read, in order, when ``result_var`` is missing: a name (``"result"``) or a function
    to call (``"solution()"``); :attr:`ProgramResult.variable` says which one was used. Never raises for anything the
    program does.

    >>> run_program("ans = sum(range(5))").value
    10
    >>> run_program("import os").error
    'forbidden import: os'
    """
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="sleuth-sandbox-")
    read_fd, write_fd = os.pipe()
    try:
        program = os.path.join(scratch, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        config = {
            "fd": write_fd,
            "scratch": scratch,
            "program": program,
            "var": result_var,
            "fallbacks": list(fallback_vars),
            "read_roots": list(_read_roots()),
            "allowed": sorted(ALLOWED_MODULES | _HELPER_MODULES),
            "denied": sorted(DENIED_MODULES),
            "preload": sorted(ALLOWED_MODULES | _HELPER_MODULES),
            "value_limit": _VALUE_LIMIT,
        }
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [_interpreter(), "-I", "-S", "-X", "utf8", "-c", _child_source(), json.dumps(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=scratch,
                env={},
                pass_fds=(write_fd,),
                start_new_session=True,
                preexec_fn=_limits(timeout_s, memory_mb),
            )
            os.close(write_fd)
            write_fd = -1
            try:
                lines, timed_out = _collect(proc, read_fd, timeout_s)
            except BaseException:  # never leave a running child behind (KeyboardInterrupt included)
                _kill_group(proc)
                proc.wait()
                raise
            returncode = proc.returncode
            stdout, stderr = _read_text(out, STDOUT_LIMIT), _read_text(err, 2000)
    except OSError as exc:  # the child could not be started at all
        return ProgramResult(ok=False, error=f"crashed: {exc}", seconds=time.perf_counter() - started)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(scratch, ignore_errors=True)
    result = _interpret(lines, timed_out, returncode, stderr)
    result.stdout = stdout
    result.seconds = time.perf_counter() - started
    return result


def _collect(proc: subprocess.Popen[bytes], fd: int, timeout_s: float) -> tuple[list[bytes], bool]:
    """Read the child's result lines until it exits; kill its process group when its time is up.

    The first line (``{"ready": true}``) marks the start of the program: the ``timeout_s`` clock starts there.
    """
    buffer = bytearray()
    deadline = time.monotonic() + _STARTUP_LIMIT_S
    ready = timed_out = False
    poller = select.poll()  # not select.select: it fails for descriptors above FD_SETSIZE (1024)
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            timed_out = True
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        if len(buffer) < _RESULT_LIMIT:
            buffer += chunk[: _RESULT_LIMIT - len(buffer)]
        if not ready and b"\n" in buffer:
            ready = True
            deadline = time.monotonic() + timeout_s
    if not timed_out:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # the program closed the result channel and kept running
            timed_out = True
    if timed_out:
        _kill_group(proc)  # before reaping the child, so that its process group id cannot have been reused
    proc.wait()
    return [line for line in bytes(buffer).split(b"\n") if line.strip()], timed_out


def _interpret(lines: list[bytes], timed_out: bool, returncode: int, stderr: str) -> ProgramResult:
    if timed_out:
        return ProgramResult(ok=False, error="timeout")
    payload = None
    for line in reversed(lines):
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and "ok" in data:
            payload = data
            break
    if payload is not None:
        ok = bool(payload.get("ok"))
        return ProgramResult(
            ok=ok,
            value=payload.get("value") if ok else None,
            error=None if ok else str(payload.get("error") or "failed"),
            variable=payload.get("variable"),
        )
    if returncode == -signal.SIGXCPU:  # RLIMIT_CPU
        return ProgramResult(ok=False, error="timeout")
    if returncode == -signal.SIGKILL or "MemoryError" in stderr:  # not our kill (that is a timeout): the OOM killer
        return ProgramResult(ok=False, error="memory")
    if returncode < 0:
        return ProgramResult(ok=False, error=f"crashed: {signal.Signals(-returncode).name}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "no result"
    return ProgramResult(ok=False, error=f"crashed: exit code {returncode}: {last[:200]}")


@functools.cache
def _program_pool() -> ThreadPoolExecutor:
    # Its own pool: waiting programs must not occupy the default executor that the LLM and retriever batchers use.
    return ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="sandbox")


async def arun_program(code: str, **kwargs: Any) -> ProgramResult:
    """:func:`run_program` in a worker thread, at most one program per CPU at a time (the event loop stays free)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_program_pool(), functools.partial(run_program, code, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# Pulling the program out of a model's reply
# ---------------------------------------------------------------------------------------------------------------

_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)```", re.IGNORECASE | re.DOTALL)
_ANY_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_OPEN_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n", re.IGNORECASE)


def _compiles(code: str) -> bool:
    try:
        compile(code, "<program>", "exec")
    except Exception:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return False
    return True


def extract_program(text: str) -> tuple[str, str | None]:
    """The Python program in a model reply, and the fallback taken (None for a ```python fenced block).

    Rules, in order: the last ```python (or ```py) fenced block (AceSearcher's checker takes the last one); the last
    fenced block of any language (``"other_fence"``); the text after an unclosed ```python fence, the reply having
    been cut off (``"unclosed_fence"``); the whole reply when it compiles (``"raw_text"``), else the reply without
    its leading prose lines, from the first line on which the rest compiles (``"raw_text_trimmed"``), else the whole
    reply (``"raw_text"``, which will then fail as a syntax error).

    >>> extract_program("Here:\\n```python\\nans = 1\\n```")
    ('ans = 1', None)
    >>> extract_program("ans = 2")
    ('ans = 2', 'raw_text')
    """
    blocks = _PY_FENCE.findall(text)
    if blocks:
        return blocks[-1].strip("\n"), None
    blocks = _ANY_FENCE.findall(text)
    if blocks:
        return blocks[-1].strip("\n"), "other_fence"
    opened = list(_OPEN_PY_FENCE.finditer(text))
    if opened:
        return text[opened[-1].end() :].strip("\n"), "unclosed_fence"
    raw = text.strip("\n")
    if _compiles(raw):
        return raw, "raw_text"
    lines = raw.splitlines()
    for i in range(1, min(len(lines), 30)):
        rest = "\n".join(lines[i:])
        if rest.strip() and _compiles(rest):
            return rest, "raw_text_trimmed"
    return raw, "raw_text"
