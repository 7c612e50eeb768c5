"""Supervisor that runs a vLLM server for sleuth and takes it down when sleuth goes, however sleuth goes.

Run by the vLLM interpreter (which need not have sleuth installed, so this file imports only the standard
library), as the leader of a new process group::

    PYTHON vllm_launcher.py PARENT_PID GRACE_S -- PYTHON -m vllm.entrypoints.openai.api_server ARGS...

It asks the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``), starts the server as its child in
its own process group, and watches. When sleuth stops it (SIGTERM, SIGINT, SIGHUP), when sleuth dies (even by
``kill -9``: the parent-death signal, or the parent pid changing, seen within a fraction of a second), or when the
server exits, it sends SIGTERM to the whole group (the server and every process the server started: vLLM's engine
core and workers), gives it ``GRACE_S`` seconds, then SIGKILLs whatever is left of the group and exits.

The parent-death signal fires when the *thread* that started the launcher exits, not only the process, so the
signal handler checks that the parent really changed before acting.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.2


def _set_parent_death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the parent-pid poll below still works
        return False


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` other than this one, read from /proc (zombies do not count)."""
    me, members = os.getpid(), []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
                    members.append(int(name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    members = _group_members(pgid)
    if not members and not os.path.isdir("/proc"):
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)
        return
    for pid in members:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: vllm_launcher.py PARENT_PID GRACE_S -- COMMAND...\n")
        return 2
    parent, grace, command = int(argv[0]), float(argv[1]), argv[3:]
    stop_reason: list[str] = []

    def on_stop(signum: int, _frame: object) -> None:
        stop_reason.append(signal.Signals(signum).name)

    def on_parent_death(_signum: int, _frame: object) -> None:
        if os.getppid() != parent:
            stop_reason.append("parent died")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_stop)
    signal.signal(signal.SIGUSR2, on_parent_death)
    _set_parent_death_signal(signal.SIGUSR2)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 1
    pgid = os.getpgid(0)
    server = subprocess.Popen(command)
    sys.stderr.write(f"[sleuth launcher] server pid {server.pid} in process group {pgid}, watching parent {parent}\n")
    sys.stderr.flush()
    while server.poll() is None and not stop_reason:
        if os.getppid() != parent:
            stop_reason.append("parent died")
            break
        time.sleep(POLL_S)
    code = server.poll()
    why = stop_reason[0] if stop_reason else f"server exited with code {code}"
    sys.stderr.write(f"[sleuth launcher] stopping ({why})\n")
    sys.stderr.flush()
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (server.poll() is None or _group_members(pgid)):
        time.sleep(POLL_S)
    left = _group_members(pgid)
    if server.poll() is None or left:
        sys.stderr.write(f"[sleuth launcher] {len(left)} process(es) still up after {grace:g} s: SIGKILL\n")
        _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=5)
    return server.returncode if server.returncode is not None and server.returncode >= 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
