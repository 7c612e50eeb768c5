"""Run model-written Python programs in an isolated, resource-limited child process and read back one variable.

Size: one module on purpose (about 1,300 lines): the launcher, the child's set-up and the seccomp filter are one
security boundary, to be read and audited together.

Program-of-thought agents (AceSearcher's document-level variant) ask a model for a program that stores its result
in ``ans``; :func:`run_program` executes it and returns a :class:`ProgramResult`. A timeout, an exception, a memory
blow-up or a forbidden action is a *result* (``ok=False`` with a short ``error``), never an exception in the caller.

The security boundary is the operating system, not Python: code that can reach frame and closure objects can undo
any guard placed inside its own interpreter, so everything below holds with every in-process guard switched off
(the tests do exactly that). Layers, outermost first:

- **namespaces** (``isolation="namespaces"``, the default): a trusted launcher process unshares fresh mount, PID,
  network, IPC and UTS namespaces (plus a user namespace when not started as root), builds a new root file system
  (an empty read-only tmpfs with read-only bind mounts of ``/usr``, the ``/lib*`` and ``/bin`` links and the
  interpreter's own prefix, and as ``/work``, the only writable place, a tmpfs of ``disk_mb`` (64 MiB by default,
  16384 inodes, ``nosuid,nodev,noexec``) holding a copy of the program: what the program writes never reaches the
  host's disk and vanishes with the namespace), pivots into it and detaches the old root. No ``/proc``, ``/etc``,
  ``/home``, ``/root``, ``/tmp`` or ``/dev``: nothing of the parent is visible. The network namespace has no
  interface at all. The program runs as PID 2 under a small PID-1 reaper that dies with the launcher
  (``PR_SET_PDEATHSIG``), and when PID 1 exits the kernel kills every process left in the namespace, so nothing the
  program starts can outlive it.
- **credentials**: started as root, the program drops to ``nobody`` (uid/gid 65534, no supplementary groups); else
  it keeps the caller's uid, mapped into its user namespace, with no capabilities after ``exec``. ``no_new_privs``
  is set, so no set-uid binary can raise them again. The environment is empty. (With ``rlimits`` only, root drops to
  ``nobody`` only where ``nobody`` can reach the interpreter; a pyenv under ``/root`` cannot, and the program then
  keeps root's file access: one more reason that mode is an explicit opt-in.)
- **resource limits** set before ``exec``: ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (one output
  file: 8 MiB or ``disk_mb``, the smaller), ``RLIMIT_NPROC`` = 0 (no child processes), ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE``; and a wall-clock limit in the parent, counted from the moment the program starts (start-up
  excluded), after which the launcher's whole process group is killed (and with it, through the PID namespace,
  everything the program started).
- **a seccomp filter** (:func:`seccomp_filter`, classic BPF, installed by the launcher right before ``exec``, after
  ``no_new_privs``, in both isolation modes): a foreign ABI (``seccomp_data.arch``, e.g. i386 through ``int 0x80``)
  kills the process, the x32 ABI and every call in :data:`DENIED_SYSCALLS` get ``EPERM`` (the kernel keyring,
  System V IPC, ``memfd_create``, namespaces, mounts, ``chroot``, ``ptrace``, ``process_vm_*``, ``bpf``,
  ``perf_event_open``, ``userfaultfd``, io_uring, kernel modules, ``kexec``, ``personality``, clocks, ``reboot``,
  ...), ``clone`` with a namespace flag gets ``EPERM`` and ``clone3`` ``ENOSYS`` (so the C library falls back to
  ``clone``). Memory the program can pin is thus ``RLIMIT_AS`` plus the ``/work`` tmpfs: System V shared memory and
  memfd pages, which ``RLIMIT_AS`` does not count, cannot be had, and the shared kernel keyring cannot carry state
  from one run to the next. Tables for x86_64 and aarch64 only; on any other architecture, or where the kernel
  refuses the filter (seccomp filter mode needs Linux 3.5), the program does not run (``sandbox unavailable:
  seccomp...``). No cgroup memory limit: where this was built the memory controller is on cgroup v1, owned by the
  host's process manager, and cgroup v2 delegates none.
- **Python guards** (defence in depth, not a boundary): an ``__import__`` that allows only :data:`ALLOWED_MODULES`,
  an ``open`` that refuses writes and reads outside the scratch directory, and an audit hook refusing network,
  processes, ``ctypes``, file-system changes and :data:`DENIED_MODULES`. They turn honest mistakes into clear
  errors (``forbidden import: os``) instead of OS-level failures.

Where the kernel refuses namespaces (some container runtimes forbid ``unshare``), :func:`run_program` fails closed
with ``error="sandbox unavailable: ..."``; running anyway with rlimits, the credential drop, the seccomp filter and
the Python guards only is an explicit opt-in: ``SLEUTH_SANDBOX=rlimits`` in the environment or
``run_program(..., isolation="rlimits")``. It weakens: the program sees the host's file system and network as its
uid does, its scratch directory is a host directory (one file is limited by ``RLIMIT_FSIZE``, the total is not), and
nothing reaps processes it starts (``RLIMIT_NPROC`` = 0 forbids starting any).

Every outcome is a :class:`ProgramResult`: an unknown signal is ``crashed: signal 40``, a result line nesting deeper
than 32 brackets is not parsed, and the scratch directory is removed without recursion (:func:`remove_tree`), so a
3000-deep tree neither raises nor stays behind. See docs/design.md, "Security".
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
#: ``isolation`` values: ``namespaces`` (the default, fails closed) or ``rlimits`` (an explicit, weaker opt-in).
ISOLATION_LEVELS = ("namespaces", "rlimits")
NOBODY = 65534  # the uid/gid a program started by root runs as
_RESULT_DEPTH_LIMIT = 32  # brackets a result line may nest (the child sends lists 8 deep at most)
_INODE_LIMIT = 16384  # files and directories the program's /work tmpfs may hold (each costs kernel memory)

# ---------------------------------------------------------------------------------------------------------------
# The seccomp filter: a classic-BPF program, built here and installed by the launcher right before the child's exec
# ---------------------------------------------------------------------------------------------------------------

#: System calls the filter answers with EPERM: (name, x86_64 number, aarch64 number), None where the architecture
#: has no such call (numbers from the kernel's ``asm/unistd_64.h`` and ``asm-generic/unistd.h``; a test compares
#: them with the headers where those are installed). Neither architecture has the multiplexed ``ipc`` call.
DENIED_SYSCALLS: tuple[tuple[str, int | None, int | None], ...] = (
    # the kernel keyring: shared by every process of a user, so state would survive from one run to the next
    ("add_key", 248, 217),
    ("request_key", 249, 218),
    ("keyctl", 250, 219),
    # System V IPC: shared memory is not counted by RLIMIT_AS; messages and semaphores are shared state
    ("shmget", 29, 194),
    ("shmat", 30, 196),
    ("shmctl", 31, 195),
    ("shmdt", 67, 197),
    ("semget", 64, 190),
    ("semop", 65, 193),
    ("semctl", 66, 191),
    ("semtimedop", 220, 192),
    ("msgget", 68, 186),
    ("msgsnd", 69, 189),
    ("msgrcv", 70, 188),
    ("msgctl", 71, 187),
    # anonymous files whose pages RLIMIT_AS does not count either
    ("memfd_create", 319, 279),
    ("memfd_secret", 447, 447),
    # namespaces and mounts: the program's view of the system is fixed by the launcher
    ("unshare", 272, 97),
    ("setns", 308, 268),
    ("mount", 165, 40),
    ("umount2", 166, 39),
    ("pivot_root", 155, 41),
    ("chroot", 161, 51),
    ("open_tree", 428, 428),
    ("move_mount", 429, 429),
    ("fsopen", 430, 430),
    ("fsconfig", 431, 431),
    ("fsmount", 432, 432),
    ("fspick", 433, 433),
    ("mount_setattr", 442, 442),
    ("name_to_handle_at", 303, 264),
    ("open_by_handle_at", 304, 265),
    ("quotactl", 179, 60),
    ("quotactl_fd", 443, 443),
    # other processes' memory and kernel attack surface
    ("ptrace", 101, 117),
    ("process_vm_readv", 310, 270),
    ("process_vm_writev", 311, 271),
    ("kcmp", 312, 272),
    ("pidfd_getfd", 438, 438),
    ("bpf", 321, 280),
    ("perf_event_open", 298, 241),
    ("userfaultfd", 323, 282),
    ("io_uring_setup", 425, 425),
    ("io_uring_enter", 426, 426),
    ("io_uring_register", 427, 427),
    ("fanotify_init", 300, 262),
    ("lookup_dcookie", 212, 18),
    ("syslog", 103, 116),
    ("personality", 135, 92),
    ("uselib", 134, None),
    ("_sysctl", 156, None),
    ("iopl", 172, None),
    ("ioperm", 173, None),
    ("vhangup", 153, 58),
    ("nfsservctl", 180, 42),
    # the machine itself
    ("kexec_load", 246, 104),
    ("kexec_file_load", 320, 294),
    ("init_module", 175, 105),
    ("finit_module", 313, 273),
    ("delete_module", 176, 106),
    ("acct", 163, 89),
    ("swapon", 167, 224),
    ("swapoff", 168, 225),
    ("reboot", 169, 142),
    ("settimeofday", 164, 170),
    ("clock_settime", 227, 112),
    ("clock_adjtime", 305, 266),
    ("adjtimex", 159, 171),
    ("sethostname", 170, 161),
    ("setdomainname", 171, 162),
)
#: Answered with ENOSYS: ``clone3`` passes its flags in memory, which a filter cannot read, so it is refused as if
#: the kernel lacked it; the C library then falls back to ``clone``, whose flags the filter checks.
ENOSYS_SYSCALLS: tuple[tuple[str, int | None, int | None], ...] = (("clone3", 435, 435),)
_CLONE = {"x86_64": 56, "aarch64": 220}
#: ``clone`` with any of these flags (a new mount, cgroup, UTS, IPC, user, PID or network namespace) gets EPERM.
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_* from linux/audit.h
_X32_SYSCALL_BIT = 0x40000000
_EPERM, _ENOSYS = 1, 38
# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_JSET_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_SECCOMP_NR, _SECCOMP_ARCH, _SECCOMP_ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low half: little-endian)


def seccomp_arch() -> str:
    """The system-call table the child interpreter uses: ``x86_64`` or ``aarch64``; ValueError for anything else
    (the sandbox then fails closed)."""
    import platform

    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if machine not in _AUDIT_ARCH or sys.maxsize <= 2**32 or sys.byteorder != "little":
        raise ValueError(f"no seccomp system-call table for {platform.machine()} ({sys.maxsize.bit_length() + 1}-bit)")
    return machine


def seccomp_filter(arch: str) -> list[tuple[int, int, int, int]]:
    """The filter for ``arch`` as ``(code, jt, jf, k)`` instructions (``struct sock_filter``).

    In order: a foreign architecture (``seccomp_data.arch``, e.g. the i386 ABI through ``int 0x80``) kills the
    process; on x86_64 the x32 ABI (numbers from ``0x40000000``) gets EPERM; each of :data:`DENIED_SYSCALLS` gets
    EPERM, each of :data:`ENOSYS_SYSCALLS` ENOSYS; ``clone`` with :data:`CLONE_NAMESPACE_FLAGS` gets EPERM;
    everything else is allowed.
    """
    if arch not in _AUDIT_ARCH:
        raise ValueError(f"no seccomp system-call table for {arch}")
    column = 1 if arch == "x86_64" else 2
    # (code, jump-if-true target, jump-if-false target, k): a target is a label, or 0 for the next instruction
    body: list[tuple[int, str | int, str | int, int]] = [
        (_BPF_LD_W_ABS, 0, 0, _SECCOMP_ARCH),
        (_BPF_JEQ_K, "nr", "kill", _AUDIT_ARCH[arch]),
    ]
    labels = {"nr": len(body)}
    body.append((_BPF_LD_W_ABS, 0, 0, _SECCOMP_NR))
    if arch == "x86_64":
        body.append((_BPF_JGE_K, "eperm", 0, _X32_SYSCALL_BIT))
    for table, target in ((DENIED_SYSCALLS, "eperm"), (ENOSYS_SYSCALLS, "enosys")):
        for row in table:
            nr = row[column]
            if nr is not None:
                body.append((_BPF_JEQ_K, target, 0, nr))  # type: ignore[arg-type]
    body.append((_BPF_JEQ_K, 0, "allow", _CLONE[arch]))
    body.append((_BPF_LD_W_ABS, 0, 0, _SECCOMP_ARG0))
    body.append((_BPF_JSET_K, "eperm", "allow", CLONE_NAMESPACE_FLAGS))
    for label, value in (
        ("allow", SECCOMP_RET_ALLOW),
        ("eperm", SECCOMP_RET_ERRNO | _EPERM),
        ("enosys", SECCOMP_RET_ERRNO | _ENOSYS),
        ("kill", SECCOMP_RET_KILL_PROCESS),
    ):
        labels[label] = len(body)
        body.append((_BPF_RET_K, 0, 0, value))

    def offset(at: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - at - 1
        if not 0 <= jump <= 255:  # a conditional jump's offsets are one byte
            raise ValueError(f"seccomp filter jump out of range: {jump}")
        return jump

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(body)]


def _seccomp_config() -> dict[str, str | None]:
    """What the launcher needs to install the filter: the packed program, or why there is none."""
    import struct

    try:
        program = seccomp_filter(seccomp_arch())
    except ValueError as exc:
        return {"seccomp": None, "seccomp_error": str(exc)}
    return {"seccomp": b"".join(struct.pack("=HBBI", *ins) for ins in program).hex(), "seccomp_error": None}


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
    guards: bool = config["guards"]
    for name in denied if guards else ():
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
    user_builtins.update(exit=leave, quit=leave)
    if guards:
        user_builtins.update(__import__=guarded_import, open=guarded_open)
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
    if guards:
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
def _launcher_source() -> str:
    return inspect.getsource(_launcher_main) + "\n_launcher_main()\n"


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
def _bind_paths() -> tuple[str, ...]:
    """What the new root shows, read-only: the system's libraries and the interpreter's own installation."""
    system = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
    interpreter = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(_interpreter()))}
    extra = sorted(p for p in interpreter if not any(p == s or p.startswith(s + "/") for s in system))
    return (*system, *extra)


def _nobody_can_run(interpreter: str, roots: tuple[str, ...]) -> bool:
    """Whether uid nobody can reach the interpreter and its library (every directory on the way world-searchable):
    without namespaces the program can only drop to nobody then (pyenv under /root cannot)."""
    import stat

    for path in (interpreter, *roots):
        parts = os.path.realpath(path).split("/")
        for i in range(2, len(parts) + 1):
            try:
                mode = os.stat("/".join(parts[:i]) or "/").st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
    return True


_HINT = (
    "; the program was not run. sleuth isolates model-written programs in Linux namespaces (unshare); to run them "
    "with resource limits and Python-level guards only (weaker: the program can read what the user can), set "
    "SLEUTH_SANDBOX=rlimits or pass isolation='rlimits'"
)


def _isolation(isolation: str | None) -> str:
    chosen = isolation or os.environ.get("SLEUTH_SANDBOX") or "namespaces"
    if chosen not in ISOLATION_LEVELS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATION_LEVELS}, got {chosen!r}")
    return chosen


def _clean_text(text: str) -> str:
    """``text`` with lone surrogates replaced, so it can always be encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _clean_value(value: Any) -> Any:
    if isinstance(value, str):
        return _clean_text(value)
    if isinstance(value, list):
        return [_clean_value(v) for v in value]
    return value


def _launcher_main() -> None:  # pragma: no cover - runs in the launcher process, before any program code
    """Isolate, then exec the child interpreter. Trusted code: it never runs or parses the program (it copies the
    program file's bytes into the new ``/work``).

    ``namespaces``: unshare, build and pivot into the new root, fork the PID-1 reaper, which forks the program's
    process; that process drops its credentials, sets ``no_new_privs``, the rlimits and the seccomp filter and execs
    the interpreter. PID 1 reports the program's wait status through a pipe, and the launcher ends the same way
    (exit code, or the same signal). ``rlimits``: the credential drop, ``no_new_privs``, rlimits and the filter only,
    then exec. Any failure is reported on the result channel as ``sandbox unavailable: ...`` and nothing runs.
    """
    import contextlib
    import ctypes
    import json
    import os
    import platform
    import resource
    import signal
    import sys

    config = json.loads(sys.argv[1])
    fd: int = config["fd"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec, ms_remount, ms_bind, ms_rec, ms_private = (
        1,
        2,
        4,
        8,
        32,
        4096,
        16384,
        1 << 18,
    )
    pr_set_pdeathsig, pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 1, 38, 22, 2
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the launcher re-raises the program's fatal signal below
    # pivot_root has no libc wrapper; its syscall number per architecture (None: fall back to chroot)
    sys_pivot_root = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(
        platform.machine()
    )

    def fail(reason: str) -> None:
        hint = "" if config["isolation"] == "rlimits" else config["hint"]
        line = json.dumps({"ok": False, "error": f"sandbox unavailable: {reason}{hint}"}) + "\n"
        os.write(fd, line.encode())
        os._exit(0)

    def check(result: int, what: str) -> None:
        if result != 0:
            fail(f"{what}: {os.strerror(ctypes.get_errno())}")

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = [None if v is None else v.encode() for v in (source, target, fstype)]
        check(libc.mount(enc[0], enc[1], enc[2], flags, None if data is None else data.encode()), f"mount {target}")

    def bind_readonly(source: str, target: str) -> None:
        mount(source, target, None, ms_bind | ms_rec)
        # In a user namespace the source mount's nosuid/nodev/noexec/atime flags are locked: repeat them.
        kept = os.statvfs(source).f_flag & (ms_nosuid | ms_nodev | ms_noexec | 1024 | 2048)
        relatime = (1 << 21) if os.statvfs(source).f_flag & 4096 else 0
        mount(None, target, None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | ms_nodev | kept | relatime)

    def install_filter() -> None:
        """The seccomp filter (built by the parent, checked there: no table for this architecture, no program)."""
        if config["seccomp"] is None:
            fail(f"seccomp: {config['seccomp_error']}")
        program = bytes.fromhex(config["seccomp"])
        instructions = ctypes.create_string_buffer(program, len(program))

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
        check(libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.addressof(fprog), 0, 0), "seccomp filter")

    root_user = os.geteuid() == 0
    uid, gid = (config["nobody"], config["nobody"]) if root_user else (os.getuid(), os.getgid())
    drop = root_user and (config["isolation"] == "namespaces" or config["nobody_can_run"])

    def become_program() -> None:
        """Credentials, no_new_privs, rlimits, then exec the child interpreter (never returns)."""
        if drop:
            try:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            except OSError as exc:
                fail(f"cannot drop root privileges to uid {uid}: {exc}")
            if os.geteuid() == 0 or os.getuid() == 0:
                fail("still root after dropping privileges")
        check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(no_new_privs)")
        memory, cpu = config["memory"], config["cpu"]
        for limit, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (memory, memory)),
            (resource.RLIMIT_FSIZE, (config["file_limit"], config["file_limit"])),
            (resource.RLIMIT_NOFILE, (64, 64)),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NPROC, (config["nproc"], config["nproc"])),
        ):
            try:
                resource.setrlimit(limit, value)
            except (ValueError, OSError) as exc:
                fail(f"setrlimit: {exc}")
        os.chdir(config["workdir"])
        install_filter()  # last: from here on, the denied system calls fail
        os.execve(config["interpreter"], config["argv"], {})

    if config["isolation"] == "rlimits":
        become_program()

    flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000  # NEWNS, NEWPID, NEWNET, NEWIPC, NEWUTS
    if not root_user:
        flags |= 0x10000000  # NEWUSER: the caller's uid mapped to itself, full capabilities inside until exec
    check(libc.unshare(flags | config["fault_flags"]), "unshare (namespaces refused by the kernel)")
    if not root_user:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)

    mount(None, "/", None, ms_rec | ms_private)  # nothing below propagates back to the host
    new_root = config["new_root"]
    mount("tmpfs", new_root, "tmpfs", ms_nosuid | ms_nodev, "size=1m,mode=0755")
    for path in config["binds"]:
        if not os.path.lexists(path):
            continue
        inside = new_root + path
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            if not os.path.lexists(inside):
                os.symlink(os.readlink(path), inside)
            continue
        if os.path.exists(inside):  # already inside an earlier bind (e.g. /usr/local/... under /usr)
            continue
        os.makedirs(inside, exist_ok=True)
        bind_readonly(path, inside)
    # /work: a size-limited tmpfs (its pages count against disk_mb, never against the host's disk), holding a copy of
    # the program file; it vanishes with the mount namespace
    work = new_root + "/work"
    os.makedirs(work, exist_ok=True)
    options = f"size={config['disk']},nr_inodes={config['inodes']},mode=0700,uid={uid},gid={gid}"
    mount("tmpfs", work, "tmpfs", ms_nosuid | ms_nodev | ms_noexec, options)
    with open(os.path.join(config["scratch"], "program.py"), "rb") as source:
        text = source.read()
    target = os.open(work + "/program.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(target, "wb") as copy:
        copy.write(text)
    if root_user:
        os.chown(work + "/program.py", uid, gid)
    mount(None, new_root, None, ms_remount | ms_rdonly | ms_nosuid | ms_nodev)
    os.chdir(new_root)
    if sys_pivot_root is not None:
        check(libc.syscall(sys_pivot_root, b".", b"."), "pivot_root")
        check(libc.umount2(b".", 2), "detaching the old root")  # MNT_DETACH
    else:
        os.chroot(".")
    os.chdir("/")

    status_read, status_write = os.pipe()  # PID 1 reports the program's wait status here (not inherited by exec)
    reaper = os.fork()
    if reaper:  # the launcher: wait for PID 1 and end as the program did
        os.close(fd)
        os.close(status_write)
        reported = b""
        while chunk := os.read(status_read, 64):
            reported += chunk
        os.waitpid(reaper, 0)
        code = int(reported) if reported.strip().lstrip(b"-").isdigit() else 1
        if code < 0:  # killed by signal -code: die of the same signal, so the parent can name it
            with contextlib.suppress(OSError, ValueError):
                signal.signal(-code, signal.SIG_DFL)
            with contextlib.suppress(OSError, ValueError):
                os.kill(os.getpid(), -code)
            os._exit(128 + min(-code, 127))  # a signal that does not end a process (cannot come from wait)
        os._exit(code & 0xFF)

    # PID 1 of the new PID namespace: dies with the launcher, reaps everything, exits when the program does
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    os.close(status_read)
    program = os.fork()
    if program == 0:
        os.close(status_write)
        become_program()
    os.close(fd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == program:  # exiting kills every process left in the namespace
            os.write(status_write, str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)


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
    disk_mb: int = 64,
    result_var: str = "ans",
    fallback_vars: tuple[str, ...] = (),
    isolation: str | None = None,
    python_guards: bool = True,
    _nproc: int = 0,
    _fault_flags: int = 0,
) -> ProgramResult:
    """Run ``code`` in an isolated child interpreter and read ``result_var`` from its namespace.

    ``timeout_s`` is the program's wall-clock budget (interpreter start-up excluded); ``memory_mb`` its address-space
    limit; ``disk_mb`` the size of its writable ``/work`` (a tmpfs; with ``isolation="rlimits"`` only the size of one
    file is limited, to the smaller of ``disk_mb`` and 8 MiB). ``fallback_vars`` are read, in order, when
    ``result_var`` is missing: a name (``"result"``) or a function to call (``"solution()"``);
    :attr:`ProgramResult.variable` says which one was used. ``isolation``: ``"namespaces"`` (default; fails closed
    where the kernel refuses them) or ``"rlimits"`` (opt-in, weaker); None reads ``SLEUTH_SANDBOX``.
    ``python_guards=False`` switches the in-process guards off, leaving only the OS isolation (the tests use it to
    show that the OS layer holds alone). Never raises for anything the program does (a bad ``isolation`` value is
    the caller's ValueError).

    Private, for the tests only: ``_nproc`` allows that many processes (to show that the PID namespace reaps them);
    ``_fault_flags`` are extra ``unshare`` flags that make the kernel refuse (to show that the sandbox fails closed).

    >>> run_program("ans = sum(range(5))").value
    10
    >>> run_program("import os").error
    'forbidden import: os'
    """
    started = time.perf_counter()
    mode = _isolation(isolation)
    try:
        result = _run(
            code, mode, timeout_s, memory_mb, disk_mb, result_var, fallback_vars, python_guards, _nproc, _fault_flags
        )
    except Exception as exc:  # the child could not be started, or its outcome not read: still a result
        result = ProgramResult(ok=False, error=_clean_text(f"crashed: {type(exc).__name__}: {exc}"[:300]))
    result.seconds = time.perf_counter() - started
    return result


def _run(
    code: str,
    mode: str,
    timeout_s: float,
    memory_mb: int,
    disk_mb: int,
    result_var: str,
    fallback_vars: tuple[str, ...],
    python_guards: bool,
    nproc: int,
    fault_flags: int,
) -> ProgramResult:
    code = _clean_text(code)
    base = tempfile.mkdtemp(prefix="sleuth-sandbox-")
    read_fd = write_fd = -1
    try:
        scratch, new_root = os.path.join(base, "work"), os.path.join(base, "root")
        read_fd, write_fd = os.pipe()
        os.mkdir(scratch)
        os.mkdir(new_root)
        program = os.path.join(scratch, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        if os.geteuid() == 0:  # the program runs as nobody: its scratch directory must be its own
            os.chmod(base, 0o755)
            for path in (scratch, program):
                os.chown(path, NOBODY, NOBODY)
        inside = "/work" if mode == "namespaces" else scratch
        child_config = {
            "fd": write_fd,
            "scratch": inside,
            "program": os.path.join(inside, "program.py"),
            "var": result_var,
            "fallbacks": list(fallback_vars),
            "read_roots": list(_read_roots()),
            "allowed": sorted(ALLOWED_MODULES | _HELPER_MODULES),
            "denied": sorted(DENIED_MODULES),
            "preload": sorted(ALLOWED_MODULES | _HELPER_MODULES),
            "value_limit": _VALUE_LIMIT,
            "guards": python_guards,
        }
        interpreter = _interpreter()
        disk = max(1, int(disk_mb * 1024 * 1024))
        launcher_config = {
            "fd": write_fd,
            "isolation": mode,
            "hint": _HINT,
            "nobody": NOBODY,
            "scratch": scratch,
            "new_root": new_root,
            "binds": list(_bind_paths()),
            "workdir": inside,
            "interpreter": interpreter,
            "argv": [interpreter, "-I", "-S", "-X", "utf8", "-c", _child_source(), json.dumps(child_config)],
            "cpu": int(math.ceil(timeout_s)) + 2,  # start-up CPU included; the wall clock is the precise limit
            "memory": memory_mb * 1024 * 1024,
            "disk": disk,
            "inodes": _INODE_LIMIT,
            "file_limit": min(_FILE_LIMIT, disk),
            "nproc": nproc,
            "nobody_can_run": _nobody_can_run(interpreter, _read_roots()),
            "fault_flags": fault_flags,
            **_seccomp_config(),
        }
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [interpreter, "-I", "-S", "-c", _launcher_source(), json.dumps(launcher_config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=base,
                env={},
                pass_fds=(write_fd,),
                start_new_session=True,
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
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        remove_tree(base)
    result = _interpret(lines, timed_out, returncode, stderr)
    result.stdout = stdout
    return result


def remove_tree(path: str) -> bool:
    """Remove the directory ``path`` and everything in it; True when it is gone. Never raises.

    Unlike ``shutil.rmtree`` it does not recurse (a program can build a tree thousands of levels deep), works on
    directory descriptors (so paths longer than ``PATH_MAX`` do not matter), never follows a symbolic link, and
    makes unreadable or unwritable directories accessible to itself (``chmod 0700``) before emptying them. It walks
    back up through ``..``, checking each directory's device and inode against the one it came down from, and stops
    (leaving the rest) if they differ, so a directory moved meanwhile cannot make it delete anything outside ``path``.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def open_dir(name: str, parent: int) -> int:
        try:
            return os.open(name, flags, dir_fd=parent)
        except PermissionError:  # not searchable or readable by us: make it so (it is not a link: O_NOFOLLOW)
            os.chmod(name, 0o700, dir_fd=parent)
            return os.open(name, flags, dir_fd=parent)

    def entries(fd: int) -> list[str]:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)  # writable (to unlink its entries) and readable (to list them) by its owner
        try:
            return os.listdir(fd)
        except OSError:
            return []

    top = os.path.abspath(path)
    try:
        top_parent = os.open(os.path.dirname(top), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return not os.path.lexists(top)
    fd = -1
    try:
        fd = open_dir(os.path.basename(top), top_parent)
        here = os.fstat(fd)
        pending = entries(fd)
        # one row per directory entered below the top: (its parent's device and inode, the parent's entries still to
        # remove, its own name in the parent)
        stack: list[tuple[tuple[int, int], list[str], str]] = []
        while True:
            while pending:
                name = pending.pop()
                try:
                    os.unlink(name, dir_fd=fd)
                    continue
                except IsADirectoryError:
                    pass
                except OSError:
                    continue  # gone already, or not removable by us: left
                try:
                    os.rmdir(name, dir_fd=fd)  # an empty directory
                    continue
                except OSError:
                    pass
                try:
                    child = open_dir(name, fd)
                except OSError:
                    continue
                stack.append(((here.st_dev, here.st_ino), pending, name))
                os.close(fd)
                fd = child
                here, pending = os.fstat(fd), entries(fd)
            if not stack:
                break
            (dev, ino), pending, name = stack.pop()
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            here = os.fstat(fd)
            if (here.st_dev, here.st_ino) != (dev, ino):
                return False  # moved while we were below it: stop rather than delete outside the tree
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=fd)
        os.close(fd)
        fd = -1
        os.rmdir(os.path.basename(top), dir_fd=top_parent)
    except OSError:
        pass
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(top_parent)
    return not os.path.lexists(top)


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
    """The child's outcome as a result; never raises (whatever the program wrote to the result channel)."""
    try:
        return _outcome(lines, timed_out, returncode, stderr)
    except Exception as exc:
        return ProgramResult(ok=False, error=f"crashed: unreadable result ({type(exc).__name__})")


def _outcome(lines: list[bytes], timed_out: bool, returncode: int, stderr: str) -> ProgramResult:
    if timed_out:
        return ProgramResult(ok=False, error="timeout")
    payload = None
    for line in reversed(lines):
        data = _parse_result_line(line)
        if isinstance(data, dict) and "ok" in data:
            payload = data
            break
    if payload is not None:
        ok = payload.get("ok") is True
        variable = payload.get("variable")
        return ProgramResult(
            ok=ok,
            value=_clean_value(payload.get("value")) if ok else None,
            error=None if ok else _clean_text(str(payload.get("error") or "failed")[:1000]),
            variable=_clean_text(variable[:200]) if isinstance(variable, str) else None,
        )
    if returncode == -signal.SIGXCPU:  # RLIMIT_CPU
        return ProgramResult(ok=False, error="timeout")
    if returncode == -signal.SIGKILL or "MemoryError" in stderr:  # not our kill (that is a timeout): the OOM killer
        return ProgramResult(ok=False, error="memory")
    if returncode < 0:
        return ProgramResult(ok=False, error=f"crashed: {_signal_name(-returncode)}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "no result"
    return ProgramResult(ok=False, error=f"crashed: exit code {returncode}: {last[:200]}")


def _signal_name(number: int) -> str:
    """``SIGSEGV`` for a signal Python names, else ``signal 40`` (real-time signals have no name)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _parse_result_line(line: bytes) -> Any:
    """A result line's JSON, or None where it is not JSON or nests deeper than :data:`_RESULT_DEPTH_LIMIT` (the
    program owns the channel and can write anything to it: 200,000 ``[`` must not reach ``json.loads``'s recursion)."""
    if len(line) > _RESULT_LIMIT or _nesting_depth(line) > _RESULT_DEPTH_LIMIT:
        return None
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _nesting_depth(line: bytes) -> int:
    """The deepest bracket nesting in a JSON text (brackets inside strings not counted), in one linear pass; a line
    with no more brackets than the limit gets its bracket count (an upper bound) without the scan."""
    if line.count(b"[") + line.count(b"{") <= _RESULT_DEPTH_LIMIT:  # the usual line: too few brackets to matter
        return line.count(b"[") + line.count(b"{")
    depth = deepest = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


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

_PY_LANGUAGE = re.compile(r"[ \t]*(?:python3?|py)\b", re.IGNORECASE)


def _scan_fences(text: str, python_only: bool) -> list[str]:
    """The bodies of the fenced blocks, as ``re.findall`` of ``FENCE[^\n]*\n(.*?)FENCE`` would find them (a
    python fence: ``[ \t]*(python3?|py)\b`` after the backticks; any fence: no backtick on the header line), in one
    left-to-right pass: a regex tries every backtick triple against the rest of its line, which is quadratic in a
    reply of many fences on one line (a model can write that)."""
    bodies: list[str] = []
    pos, newline = 0, -1
    while (start := text.find("```", pos)) >= 0:
        if newline < start + 3:  # the first newline after the fence (cached while the scan stays on one line)
            newline = text.find("\n", start + 3)
            if newline < 0:
                break
        if python_only:
            valid = _PY_LANGUAGE.match(text, start + 3, newline) is not None
        else:
            valid = text.find("`", start + 3, newline) < 0
        if not valid:
            pos = start + 1
            continue
        end = text.find("```", newline + 1)
        if end < 0:
            break
        bodies.append(text[newline + 1 : end])
        pos = end + 3
    return bodies


def _last_open_python_fence(text: str) -> int | None:
    """Where the text after the last opening python fence line begins (None without one)."""
    last, pos, newline = None, 0, -1
    while (start := text.find("```", pos)) >= 0:
        if newline < start + 3:
            newline = text.find("\n", start + 3)
            if newline < 0:
                break
        if _PY_LANGUAGE.match(text, start + 3, newline) is None:
            pos = start + 1
            continue
        last, pos = newline + 1, newline + 1
    return last


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
    blocks = _scan_fences(text, python_only=True)
    if blocks:
        return blocks[-1].strip("\n"), None
    blocks = _scan_fences(text, python_only=False)
    if blocks:
        return blocks[-1].strip("\n"), "other_fence"
    opened = _last_open_python_fence(text)
    if opened is not None:
        return text[opened:].strip("\n"), "unclosed_fence"
    raw = text.strip("\n")
    if _compiles(raw):
        return raw, "raw_text"
    lines = raw.splitlines()
    for i in range(1, min(len(lines), 30)):
        rest = "\n".join(lines[i:])
        if rest.strip() and _compiles(rest):
            return rest, "raw_text_trimmed"
    return raw, "raw_text"
