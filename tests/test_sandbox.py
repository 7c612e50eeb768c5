"""The program sandbox: results come back, and runaway or harmful programs are stopped without side effects.

Every test runs a real child interpreter (about 0.1 s each); time limits are kept small.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sleuth import sandbox
from sleuth.sandbox import ProgramResult, arun_program, extract_program, run_program

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX resource limits")


# -- results ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "value"),
    [
        ("ans = 6 * 7", 42),
        ("r = [120.5, 130.25]\nans = (r[1] - r[0]) / r[0] * 100", (130.25 - 120.5) / 120.5 * 100),
        ("import math\nans = [math.floor(2.5), 2.5, 'x', True]", [2, 2.5, "x", True]),
        ("from fractions import Fraction\nans = Fraction(1, 4)", 0.25),
        ("ans = {'a': 1}", "{'a': 1}"),  # not a number, string or list: its repr
    ],
)
def test_the_result_variable_is_read(code: str, value: object) -> None:
    result = run_program(code, timeout_s=2)
    assert result.ok and result.error is None
    assert result.value == value
    assert result.variable == "ans"


def test_printed_output_is_captured_and_truncated() -> None:
    result = run_program("print('hello')\nprint('x' * 10000)\nans = 1", timeout_s=2)
    assert result.ok and result.stdout.startswith("hello\n")
    assert len(result.stdout) < 5000 and result.stdout.endswith("[truncated]")


def test_fallback_variables_when_ans_is_missing() -> None:
    assert run_program("x = 1").error == "missing variable: ans"
    result = run_program("def solution():\n    return 2 + 3", fallback_vars=("result", "solution()"))
    assert (result.ok, result.value, result.variable) == (True, 5, "solution()")
    result = run_program("result = 9", fallback_vars=("result", "solution()"))
    assert (result.value, result.variable) == (9, "result")


def test_syntax_errors_and_exceptions_are_results() -> None:
    syntax = run_program("def f(:\n    pass")
    assert not syntax.ok and syntax.error.startswith("syntax error: ") and "line 1" in syntax.error
    raised = run_program("x = 1\nans = x / 0")
    assert not raised.ok
    assert raised.error == "exception: ZeroDivisionError: division by zero (line 2)"
    assert run_program("ans = undefined_name").error.startswith("exception: NameError")


def test_allowed_standard_library_modules_work() -> None:
    code = (
        "import statistics, decimal, datetime, json, re, collections, itertools\n"
        "d = datetime.datetime.strptime('2020-03-01', '%Y-%m-%d') - datetime.datetime(2020, 2, 1)\n"
        "ans = [statistics.mean([1, 2, 3]), str(decimal.Decimal('1.10') + decimal.Decimal('2.20')), d.days]"
    )
    result = run_program(code, timeout_s=2)
    assert result.ok, result.error
    assert result.value == [2, "3.30", 29]


# -- limits -------------------------------------------------------------------------------------------------------


def test_an_endless_loop_is_stopped() -> None:
    result = run_program("while True:\n    pass", timeout_s=0.5)
    assert (result.ok, result.error) == (False, "timeout")
    assert result.seconds < 5


def test_a_loop_that_swallows_every_exception_is_still_stopped() -> None:
    code = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
    assert run_program(code, timeout_s=0.5).error == "timeout"


def test_allocating_10_gb_is_stopped() -> None:
    result = run_program("block = bytearray(10 * 1024 ** 3)\nans = len(block)", memory_mb=256)
    assert (result.ok, result.error) == (False, "memory")
    assert run_program("x = [0] * (10 ** 10)", memory_mb=256).error == "memory"


def test_runaway_output_is_cut_off() -> None:
    result = run_program("while True:\n    print('x' * 10000)", timeout_s=5)
    assert not result.ok and "File too large" in (result.error or "")


# -- refused actions ----------------------------------------------------------------------------------------------


def test_opening_a_socket_is_refused() -> None:
    assert run_program("import socket\ns = socket.socket()").error == "forbidden import: socket"
    # through the real importer, reached via a module the program may use: the audit hook refuses the load
    backdoor = "import random\nimp = random._os.sys.modules['builtins'].__import__\ns = imp('socket').socket()"
    assert run_program(backdoor).error == "forbidden import: socket"
    # a socket event is refused by the audit hook whoever raises it
    event = "import random\nrandom._os.sys.audit('socket.connect', None, ('1.1.1.1', 80))"
    assert run_program(event).error == "network"


def test_writing_outside_the_scratch_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "written.txt"
    result = run_program(f"with open({str(target)!r}, 'w') as f:\n    f.write('x')\nans = 1")
    assert result.error == f"forbidden write: {target}"
    low_level = f"import random\nos = random._os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)"
    assert run_program(low_level).error == f"forbidden write: {target}"
    assert not target.exists()


def test_reading_outside_the_scratch_directory_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    assert run_program(f"ans = open({str(secret)!r}).read()").error == f"forbidden read: {secret}"


def test_shell_commands_are_refused_without_side_effect(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    assert run_program(f"import os\nos.system('touch {marker}')").error == "forbidden import: os"
    assert run_program("import subprocess").error == "forbidden import: subprocess"
    # the os module is reachable through random._os; the calls themselves are refused by the audit hook
    assert run_program(f"import random\nrandom._os.system('touch {marker}')").error == "forbidden: os.system"
    execv = f"import random\nrandom._os.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])"
    assert run_program(execv).error == "forbidden: os.exec"
    assert run_program("import random\nrandom._os.fork()").error == "forbidden: os.fork"
    spawn = "import random\nimp = random._os.sys.modules['builtins'].__import__\nimp('subprocess').run(['true'])"
    assert run_program(spawn).error == "forbidden import: subprocess"
    assert not marker.exists()


def test_a_caught_violation_is_still_reported() -> None:
    result = run_program("try:\n    import os\nexcept BaseException:\n    pass\nans = 1")
    assert (result.ok, result.error, result.value) == (False, "forbidden import: os", None)


def test_fresh_directory_and_empty_environment() -> None:
    result = run_program("import random\nos = random._os\nans = [os.getcwd(), sorted(os.environ)]")
    assert result.ok, result.error
    cwd, env = result.value
    assert cwd == "/work"  # the scratch directory, mounted as /work in the program's own root file system
    assert set(env) <= {"LC_CTYPE"}  # Python's own C-locale coercion at most; nothing from the parent


def test_async_runs_do_not_block_each_other() -> None:
    async def both() -> list[ProgramResult]:
        return list(await asyncio.gather(arun_program("ans = 1"), arun_program("ans = 2")))

    assert [r.value for r in asyncio.run(both())] == [1, 2]


# -- extracting the program from a reply --------------------------------------------------------------------------


def test_extract_program_from_fenced_blocks() -> None:
    reply = "First try:\n```python\nans = 1\n```\nBetter:\n```python\nx = 2\nans = x * 3\n```\nDone."
    assert extract_program(reply) == ("x = 2\nans = x * 3", None)
    assert extract_program("```\nans = 4\n```") == ("ans = 4", "other_fence")
    assert extract_program("Program:\n```python\nans = 5\nprint(ans)") == ("ans = 5\nprint(ans)", "unclosed_fence")


def test_extract_program_from_raw_text() -> None:
    assert extract_program("a = 1\nans = a + 1\n") == ("a = 1\nans = a + 1", "raw_text")
    assert extract_program("Here is the program:\nans = 3") == ("ans = 3", "raw_text_trimmed")
    code, fallback = extract_program("no code at all, just words")
    assert fallback == "raw_text" and not run_program(code).ok


# -- the OS layer alone: every attack below runs with the in-process Python guards switched off ----------------------
# (python_guards=False: no import/open guards, no audit hook), as a program that has disabled them would.

UNGUARDED = {"python_guards": False, "timeout_s": 3}


def _probe(expression: str) -> str:
    """Program text that stores ``expression``'s value, or the name of the exception it raised, in ``ans``."""
    return f"import os, sys\ntry:\n    ans = {expression}\nexcept BaseException as exc:\n    ans = type(exc).__name__"


def test_the_closure_exploit_gains_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported escape: the guards' shared closure cell is overwritten, then the program runs as it likes."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN-FILE")
    monkeypatch.setenv("SLEUTH_TEST_SECRET", "TOKEN-ENV")
    code = f"""
imp = __builtins__['__import__']
dict(zip(imp.__code__.co_freevars, imp.__closure__))['refuse'].cell_contents = lambda r: None
os = __import__('os')
rc = os.system('id > {tmp_path}/pwned.txt')
seen = []
for path in ['/etc/passwd', '/etc/shadow', '/proc/%d/environ' % os.getppid(), {str(secret)!r}]:
    try:
        seen.append(open(path, 'rb').read()[:200].decode('latin-1'))
    except BaseException as exc:
        seen.append(type(exc).__name__)
ans = [rc, seen, os.getuid(), dict(os.environ)]
"""
    result = run_program(code, timeout_s=3)
    assert result.ok, result.error  # the guards really were disabled: the program ran to the end
    rc, seen, uid, env = result.value
    assert rc != 0  # os.system could not start a shell: no child processes
    assert seen == ["FileNotFoundError"] * 4  # none of these paths exists in the program's root
    assert "TOKEN" not in str(result.value) and "SLEUTH_TEST_SECRET" not in env
    assert not (tmp_path / "pwned.txt").exists()
    if os.geteuid() == 0:
        assert uid == sandbox.NOBODY


def test_the_file_system_is_the_programs_own(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("TOKEN")
    listing = run_program(_probe("sorted(os.listdir('/'))"), **UNGUARDED).value
    tops = {"work"} | {p.strip("/").split("/")[0] for p in sandbox._bind_paths()}
    assert set(listing) <= tops and "etc" not in listing and "proc" not in listing and "tmp" not in listing
    for path in ("/etc/shadow", "/etc/passwd", "/proc/self/status", str(tmp_path / "secret.txt"), "/dev/mem"):
        assert run_program(_probe(f"os.stat({path!r})"), **UNGUARDED).value == "FileNotFoundError", path
    assert run_program(_probe("os.listdir('/root')"), **UNGUARDED).value in ("FileNotFoundError", [".pyenv"], [])
    for target in ("/usr/pwned", "/pwned", "/lib/pwned", sys.base_prefix + "/pwned"):
        value = run_program(_probe(f"open({target!r}, 'w').write('x')"), **UNGUARDED).value
        assert value in ("OSError", "PermissionError"), (target, value)  # EROFS / EACCES
        assert not os.path.exists(target)
    # the scratch directory is writable, and gone afterwards
    assert run_program(_probe("open('/work/out.txt', 'w').write('abc')"), **UNGUARDED).value == 3


def test_the_environment_and_the_parent_are_out_of_sight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_TEST_SECRET", "TOKEN")
    value = run_program(_probe("[dict(os.environ), os.getppid(), os.getpid()]"), **UNGUARDED).value
    env, ppid, pid = value
    assert "SLEUTH_TEST_SECRET" not in env and "TOKEN" not in str(env)
    assert (ppid, pid) == (1, 2)  # its own PID namespace: PID 1 is the sandbox's reaper, no host process is visible
    # the reaper runs as root (the program cannot signal it) or, unprivileged, as init (which ignores the signal)
    assert run_program(_probe("os.kill(1, 9) or 'sent'"), **UNGUARDED).value in ("PermissionError", "sent")
    assert run_program(_probe("os.setuid(0)"), **UNGUARDED).value == "PermissionError"


@pytest.fixture
def listener() -> Iterator[tuple[int, list[object]]]:
    """A TCP server on 127.0.0.1 that records the connections it accepts (bounded: it stops with the test)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    accepted: list[object] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    done.set()
    thread.join(2)
    server.close()


def test_there_is_no_network(listener: tuple[int, list[object]]) -> None:
    port, accepted = listener
    for expression in (
        f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=1)",
        "__import__('socket').create_connection(('1.1.1.1', 53), timeout=1)",
        "__import__('socket').getaddrinfo('localhost', 80)",
    ):
        value = run_program(_probe(expression), **UNGUARDED).value
        assert value in ("OSError", "ConnectionRefusedError", "gaierror", "TimeoutError"), (expression, value)
    interfaces = run_program(_probe("[name for _, name in __import__('socket').if_nameindex()]"), **UNGUARDED).value
    assert interfaces in (["lo"], [], "OSError")  # a fresh network namespace: a loopback that is down at most
    assert accepted == []


def test_no_child_processes_and_no_shell(tmp_path: Path) -> None:
    assert run_program(_probe("os.fork()"), **UNGUARDED).value == "BlockingIOError"
    code = _probe(f"__import__('subprocess').run(['touch', '{tmp_path}/pwned']).returncode")
    assert run_program(code, **UNGUARDED).value == "BlockingIOError"
    assert not (tmp_path / "pwned").exists()


def _processes_with(argv: list[str]) -> list[int]:
    wanted = "\0".join(argv).encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _orphan_program(seconds: int) -> str:
    # a child that leaves the program's session and sleeps on; the program itself then spins until its timeout
    return (
        "import os\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{seconds}'])\nwhile True:\n    pass"
    )


def test_nothing_the_program_starts_outlives_it() -> None:
    seconds = random.randint(50_000, 90_000)  # a marker no other process on the machine has in its command line
    # _nproc: allow processes, to show the namespace reaps them
    result = run_program(_orphan_program(seconds), python_guards=False, timeout_s=1, _nproc=64)
    assert result.error == "timeout"
    deadline = time.monotonic() + 5
    while _processes_with(["sleep", str(seconds)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(["sleep", str(seconds)]) == []


def test_without_the_pid_namespace_the_orphan_would_survive() -> None:
    """The test above can fail: with only rlimits (and processes allowed) the same orphan outlives the timeout."""
    seconds = random.randint(50_000, 90_000)
    run_program(_orphan_program(seconds), python_guards=False, timeout_s=1, isolation="rlimits", _nproc=64)
    survivors = []
    deadline = time.monotonic() + 5
    while not survivors and time.monotonic() < deadline:
        survivors = _processes_with(["sleep", str(seconds)])
        time.sleep(0.05)
    for pid in survivors:
        os.kill(pid, 9)
    assert survivors


def test_memory_and_time_limits_hold_without_the_guards() -> None:
    assert run_program("ans = len(bytearray(10 * 1024 ** 3))", python_guards=False, memory_mb=256).error == "memory"
    assert run_program("while True:\n    pass", python_guards=False, timeout_s=0.5).error == "timeout"
    spin = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    assert run_program(spin, python_guards=False, timeout_s=0.5).error == "timeout"


def test_it_fails_closed_where_namespaces_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # an invalid unshare flag makes the kernel refuse the call, as a container that forbids unshare would
    result = run_program("print('ran')\nans = 1", _fault_flags=0x1)
    assert not result.ok and result.error.startswith("sandbox unavailable: unshare")
    assert "SLEUTH_SANDBOX=rlimits" in result.error and result.stdout == ""  # the program never ran
    # the documented opt-in runs it with the weaker isolation
    assert run_program("ans = 1", isolation="rlimits").value == 1
    monkeypatch.setenv("SLEUTH_SANDBOX", "rlimits")
    assert run_program("ans = 2").value == 2
    monkeypatch.setenv("SLEUTH_SANDBOX", "none")
    with pytest.raises(ValueError, match="isolation must be one of"):
        run_program("ans = 3")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to set up the case")
def test_unprivileged_callers_get_a_user_namespace() -> None:
    """Run by a non-root uid (here inside a user namespace, uid 1000): the program gets its own user namespace and
    the same isolation."""
    script = (
        "from sleuth.sandbox import run_program\n"
        "import os\n"
        "probe = \"import os\\nans = [os.getuid(), sorted(os.listdir('/')), os.getpid()]\"\n"
        "r = run_program(probe, python_guards=False)\n"
        "print(os.geteuid(), r.ok, r.value, r.error)"
    )
    out = subprocess.run(
        ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.startswith("1000 True [1000, ")
        and "'etc'" not in out.stdout
        and out.stdout.rstrip().endswith("2] None")
    )


def test_text_the_program_cannot_encode_comes_back_clean() -> None:
    result = run_program("ans = 'ANS-7 \ud800'")  # a lone surrogate in the source (as a model may write it)
    assert result.ok and "\ud800" not in result.value
    result.value.encode("utf-8")
    value = run_program("ans = ['x' + chr(0xD800)]").value  # made inside the program
    assert value[0].startswith("x") and "\ud800" not in value[0]


def _seconds(fn: object, text: str) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.thread_time()
        fn(text)  # type: ignore[operator]
        best = min(best, time.thread_time() - started)
    return best


@pytest.mark.parametrize(
    "unit", ["```py", "```", "```python\n", "``` x", "```python\nans = 1\n", "a\n", "`` `\n"], ids=repr
)
def test_extract_program_is_linear_time(unit: str) -> None:
    """A regex that tries every backtick triple against the rest of its line was quadratic ('```py' * 40000: 8 s);
    four times the input must cost about four times the time (a quadratic scan gives ~16)."""
    n = 2000
    while _seconds(extract_program, unit * n) < 0.005 and n < 2_000_000:
        n *= 2
    small, large = _seconds(extract_program, unit * n), _seconds(extract_program, unit * 4 * n)
    assert large / max(small, 1e-6) < 8, (n, small, large)


# -- the seccomp filter, the /work tmpfs and outcomes that must stay results (all with the Python guards off) -------


def _skip_without_namespaces() -> None:
    probe = run_program("ans = 1", python_guards=False)
    if not probe.ok and (probe.error or "").startswith("sandbox unavailable: unshare"):
        pytest.skip(f"the kernel refuses namespaces here: {probe.error[:120]}")


@pytest.fixture
def fast_tmp() -> Iterator[Path]:
    """A directory on a tmpfs (/dev/shm) where there is one, searchable by nobody (unlike pytest's tmp_path): a
    3000-deep tree costs a few seconds on a disk file system, milliseconds there."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="sleuth-test-tmp-", dir=shm))
    path.chmod(0o711)
    yield path
    sandbox.remove_tree(str(path))


@pytest.fixture
def private_tmp(fast_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of its own for run_program, to count its leftovers in."""
    monkeypatch.setattr(tempfile, "tempdir", str(fast_tmp))
    return fast_tmp


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("sleuth-sandbox-"))


def _syscall_program(calls: list[tuple[str, int, tuple[int, ...]]]) -> str:
    """A program that makes each raw system call ``(name, number, args)`` and stores ``{name: [rc, errno]}``."""
    return (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\nans = []\n"
        f"for name, nr, args in {calls!r}:\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
        "    ans.append([name, rc, ctypes.get_errno()])\n"
    )


def _bpf_run(program: list[tuple[int, int, int, int]], arch: int, nr: int, arg0: int = 0) -> int:
    """What the classic-BPF ``program`` returns for one system call (the few instructions the filter uses)."""
    data = struct.pack("<IIQ6Q", nr & 0xFFFFFFFF, arch, 0, arg0, 0, 0, 0, 0, 0)
    acc, pc = 0, 0
    for _ in range(len(program)):  # no backward jumps in classic BPF: each instruction runs at most once
        code, jt, jf, k = program[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # JEQ, JGE, JSET with a constant
            taken = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("ran off the end of the filter")


EPERM_RET = sandbox.SECCOMP_RET_ERRNO | 1


@pytest.mark.parametrize(("arch", "column", "audit"), [("x86_64", 1, 0xC000003E), ("aarch64", 2, 0xC00000B7)])
def test_the_filter_program(arch: str, column: int, audit: int) -> None:
    program = sandbox.seccomp_filter(arch)
    assert program[0] == (0x20, 0, 0, 4)  # first: load seccomp_data.arch ...
    assert program[1][0] == 0x15 and program[1][3] == audit  # ... and compare it with the table's architecture
    assert program[2 + program[1][2]] == (0x06, 0, 0, sandbox.SECCOMP_RET_KILL_PROCESS)  # a foreign one is killed
    assert len(program) < 100 and all(0 <= jt <= 255 and 0 <= jf <= 255 for _, jt, jf, _ in program)
    assert _bpf_run(program, 0x40000003, 20) == sandbox.SECCOMP_RET_KILL_PROCESS  # i386 ABI (int 0x80)
    for name, *numbers in sandbox.DENIED_SYSCALLS:
        if numbers[column - 1] is not None:
            assert _bpf_run(program, audit, numbers[column - 1]) == EPERM_RET, name
    clone3 = sandbox.ENOSYS_SYSCALLS[0][column]
    assert _bpf_run(program, audit, clone3) == sandbox.SECCOMP_RET_ERRNO | 38
    clone = {"x86_64": 56, "aarch64": 220}[arch]
    assert _bpf_run(program, audit, clone, 17) == sandbox.SECCOMP_RET_ALLOW  # fork: clone(SIGCHLD)
    assert _bpf_run(program, audit, clone, 0x3D0F00) == sandbox.SECCOMP_RET_ALLOW  # a thread
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert _bpf_run(program, audit, clone, flag | 17) == EPERM_RET, hex(flag)
    read, getpid = (0, 39) if arch == "x86_64" else (63, 172)
    assert _bpf_run(program, audit, read) == _bpf_run(program, audit, getpid) == sandbox.SECCOMP_RET_ALLOW
    x32 = _bpf_run(program, audit, 0x40000000 + getpid)
    assert x32 == (EPERM_RET if arch == "x86_64" else sandbox.SECCOMP_RET_ALLOW)
    with pytest.raises(ValueError, match="no seccomp system-call table"):
        sandbox.seccomp_filter("sparc64")


def _header_numbers(path: str, prefixes: tuple[str, ...]) -> dict[str, int]:
    numbers: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[2].isdigit():
            for prefix in prefixes:
                if parts[1].startswith(prefix):
                    numbers.setdefault(parts[1][len(prefix) :], int(parts[2]))
    return numbers


@pytest.mark.parametrize(
    ("column", "header", "prefixes"),
    [
        (1, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", ("__NR_",)),
        (2, "/usr/include/asm-generic/unistd.h", ("__NR_", "__NR3264_")),
    ],
    ids=["x86_64", "aarch64"],
)
def test_the_system_call_tables_match_the_kernel_headers(column: int, header: str, prefixes: tuple[str, ...]) -> None:
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed (apt-get install linux-libc-dev)")
    known = _header_numbers(header, prefixes)
    for row in (*sandbox.DENIED_SYSCALLS, *sandbox.ENOSYS_SYSCALLS):
        name, number = row[0], row[column]
        if number is None:
            assert name not in known, name
        elif name in known:  # a call newer than the installed headers is checked where they have it
            assert known[name] == number, name
    assert known.get("clone") == {1: 56, 2: 220}[column]


def test_every_denied_system_call_fails_with_eperm() -> None:
    _skip_without_namespaces()
    arch = sandbox.seccomp_arch()
    column = 1 if arch == "x86_64" else 2
    calls = [(row[0], row[column], (0, 0, 0, 0, 0, 0)) for row in sandbox.DENIED_SYSCALLS if row[column] is not None]
    calls.append(("clone3", sandbox.ENOSYS_SYSCALLS[0][column], (0, 0)))
    clone = {"x86_64": 56, "aarch64": 220}[arch]
    calls.append(("clone(CLONE_NEWNET)", clone, (0x40000000 | 17, 0, 0, 0, 0)))
    if arch == "x86_64":
        calls.append(("x32 getpid", 0x40000000 + 39, ()))
    result = run_program(_syscall_program(calls), **UNGUARDED)
    assert result.ok, result.error
    got = {name: (rc, errno) for name, rc, errno in result.value}
    expected = {name: (-1, 1) for name, _, _ in calls} | {"clone3": (-1, 38)}
    assert got == expected
    # the same program's ordinary calls still work; fork is refused by RLIMIT_NPROC (EAGAIN), not by the filter
    assert run_program(_probe("[os.getpid(), os.getuid() >= 0]"), **UNGUARDED).value == [2, True]
    assert run_program(_probe("os.fork()"), **UNGUARDED).value == "BlockingIOError"


def test_system_v_shared_memory_cannot_hold_memory_past_the_limit() -> None:
    """The reported bypass: eight 100 MB segments attached and filled with memory_mb=128 (RLIMIT_AS does not count
    them). The filter refuses shmget, and memfd_create (whose pages it does not count either)."""
    _skip_without_namespaces()
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, errors = 0, []
for _ in range(8):
    segment = libc.shmget(0, 100 << 20, 0o1600)
    if segment < 0:
        errors.append(ctypes.get_errno())
        continue
    address = libc.shmat(segment, None, 0)
    ctypes.memset(address, 1, 100 << 20)
    held += 100
    libc.shmdt(ctypes.c_void_p(address))
memfd = libc.memfd_create(b'x', 0)
ans = [held, errors, memfd, ctypes.get_errno()]
"""
    result = run_program(code, memory_mb=128, **UNGUARDED)
    assert result.ok, result.error
    assert result.value == [0, [1] * 8, -1, 1]


def test_the_kernel_keyring_carries_nothing_between_runs() -> None:
    _skip_without_namespaces()
    add = "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
    add += "rc = l.syscall(248, b'user', b'sleuth-covert', b'PAYLOAD-1234', 12, -4)\nans = [rc, ctypes.get_errno()]"
    assert run_program(add, **UNGUARDED).value == [-1, 1]  # add_key: EPERM
    search = "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
    search += "rc = l.syscall(250, 10, -4, b'user', b'sleuth-covert', 0)\nans = [rc, ctypes.get_errno()]"
    assert run_program(search, **UNGUARDED).value == [-1, 1]  # keyctl(KEYCTL_SEARCH): EPERM, nothing found


def test_no_new_namespaces_and_no_mounts() -> None:
    _skip_without_namespaces()
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
results = []
results.append([libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno()])
results.append([libc.mount(b'none', b'/work', b'tmpfs', 0, b'size=1m'), ctypes.get_errno()])
results.append([libc.umount2(b'/work', 2), ctypes.get_errno()])
results.append([libc.chroot(b'/work'), ctypes.get_errno()])
ans = results
"""
    assert run_program(code, **UNGUARDED).value == [[-1, 1]] * 4


def test_the_filter_also_applies_with_rlimits_only() -> None:
    # calls without side effects where they were allowed: a search for a key no one added, shmget of a key that
    # does not exist (no IPC_CREAT), memfd_create, a user namespace for the process itself
    calls = [
        ("keyctl", 250, (10, -4, 0, 0, 0)),
        ("shmget", 29, (0x5E1E07, 4096, 0)),
        ("memfd_create", 319, (0, 0)),
        ("unshare", 272, (0x10000000,)),
    ]
    if sandbox.seccomp_arch() != "x86_64":
        pytest.skip("the call numbers below are x86_64's")
    result = run_program(_syscall_program(calls), isolation="rlimits", **UNGUARDED)
    assert result.ok, result.error
    assert [row[1:] for row in result.value] == [[-1, 1]] * 4


def test_the_sandbox_fails_closed_without_a_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    # an architecture without a table: the program does not run, in either mode
    no_table = {"seccomp": None, "seccomp_error": "no seccomp system-call table for sparc64 (64-bit)"}
    monkeypatch.setattr(sandbox, "_seccomp_config", lambda: no_table)
    for isolation in ("namespaces", "rlimits"):
        result = run_program("print('ran')\nans = 1", isolation=isolation)
        assert result.error.startswith("sandbox unavailable: seccomp: no seccomp system-call table for sparc64")
        assert result.stdout == ""
    # a filter the kernel refuses (an invalid opcode): PR_SET_SECCOMP fails, and so does the run
    invalid = {"seccomp": struct.pack("=HBBI", 0xFF, 0, 0, 0).hex(), "seccomp_error": None}
    monkeypatch.setattr(sandbox, "_seccomp_config", lambda: invalid)
    for isolation in ("namespaces", "rlimits"):
        result = run_program("print('ran')\nans = 1", isolation=isolation)
        assert result.error == "sandbox unavailable: seccomp filter: Invalid argument" + (
            sandbox._HINT if isolation == "namespaces" else ""
        ), result.error
        assert result.stdout == ""


def test_work_is_a_size_limited_tmpfs(private_tmp: Path) -> None:
    """The reported bypass wrote 960 MB to the host's temp disk in many files (RLIMIT_FSIZE limits one file)."""
    _skip_without_namespaces()
    code = """
import os
stat = os.statvfs('/work')
written, error = 0, None
chunk = b'x' * (1 << 20)
try:
    for i in range(100):
        with open(f'/work/f{i}', 'wb') as f:
            for _ in range(4):
                f.write(chunk)
                f.flush()
                written += 1
except OSError as exc:
    error = exc.errno
ans = [stat.f_blocks * stat.f_frsize, os.stat('/work').st_dev, written, error]
"""
    result = run_program(code, disk_mb=16, **UNGUARDED)
    assert result.ok, result.error
    size, device, written, error = result.value
    assert size == 16 << 20 and error == 28  # ENOSPC
    assert 8 <= written <= 16  # MiB: the limit was reached, not passed
    assert device != os.stat(private_tmp).st_dev  # not the host temp dir's file system
    assert _leftovers(private_tmp) == []


def test_ordinary_programs_still_work_under_the_filter() -> None:
    code = """
import math, json, re, datetime, decimal, statistics, collections, fractions, random
numbers = list(range(2_000_000))
ans = [
    math.isqrt(10 ** 12), json.loads(json.dumps({'a': [1, 2]}))['a'], re.findall(r'\\d+', 'a1b22c333'),
    (datetime.date(2024, 3, 1) - datetime.date(2024, 2, 1)).days, str(decimal.Decimal('0.1') * 3),
    statistics.median([3, 1, 2]), collections.Counter('abca').most_common(1)[0][0],
    str(fractions.Fraction(3, 6)), len(numbers), sum(numbers), random.Random(1).randint(1, 1),
]
"""
    expected = [10**6, [1, 2], ["1", "22", "333"], 29, "0.3", 2, "a", "1/2", 2_000_000, 1999999000000, 1]
    for guards in (True, False):
        result = run_program(code, python_guards=guards, memory_mb=512, timeout_s=5)
        assert result.ok, (guards, result.error)
        assert result.value == expected


# -- run_program never raises: each of these once turned a whole AceSearcher example into an exception ------------


def test_a_real_time_signal_or_a_high_exit_code_is_a_result(private_tmp: Path) -> None:
    signalled = run_program("import os\nos.kill(os.getpid(), 40)", **UNGUARDED)
    assert (signalled.ok, signalled.error) == (False, "crashed: signal 40")
    exited = run_program("import os\nos._exit(167)", **UNGUARDED)
    assert (exited.ok, exited.error) == (False, "crashed: exit code 167: no result")
    segv = run_program("import os\nos.kill(os.getpid(), 11)", **UNGUARDED)
    assert (segv.ok, segv.error) == (False, "crashed: SIGSEGV")
    rlimits = run_program("import os\nos.kill(os.getpid(), 40)", isolation="rlimits", **UNGUARDED)
    assert (rlimits.ok, rlimits.error) == (False, "crashed: signal 40")
    assert _leftovers(private_tmp) == []


def test_a_deeply_nested_result_line_is_a_result(private_tmp: Path) -> None:
    code = (
        "import json, os, sys\nfd = json.loads(sys.argv[1])['fd']\n"
        "os.write(fd, b'{\"ok\":true,\"value\":' + b'[' * 200000 + b'\\n')\nos._exit(0)"
    )
    result = run_program(code, **UNGUARDED)
    assert (result.ok, result.error) == (False, "crashed: exit code 0: no result")
    # a well-formed line that nests too deep is not read either
    deep = "import json, os, sys\nfd = json.loads(sys.argv[1])['fd']\n"
    deep += "os.write(fd, ('{\"ok\": true, \"value\": ' + '[' * 100 + ']' * 100 + '}\\n').encode())\nos._exit(0)"
    assert run_program(deep, **UNGUARDED).error == "crashed: exit code 0: no result"
    assert _leftovers(private_tmp) == []


def test_result_lines_are_parsed_with_bounded_nesting() -> None:
    assert sandbox._parse_result_line(b'{"ok": true, "value": [[1], "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]}') == {
        "ok": True,
        "value": [[1], "[" * 37],
    }
    assert sandbox._parse_result_line(b'{"ok": true, "value": ' + b"[" * 40 + b"]" * 40 + b"}") is None
    assert sandbox._parse_result_line(b'{"a": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == {"a": '"' + "[" * 35}
    assert sandbox._parse_result_line(b"[" * 200_000) is None
    assert sandbox._interpret([b"[" * 200_000, b"\xff{"], False, 0, "").error == "crashed: exit code 0: no result"


def _deep_tree_program(depth: int) -> str:
    return (
        "import os\ntop = os.getcwd()\nos.mkdir('locked')\nopen('locked/f', 'w').close()\nos.chmod('locked', 0)\n"
        f"for _ in range({depth}):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "open('f', 'w').close()\nos.chmod('.', 0o500)\nos.chdir(top)\nans = 1"
    )


@pytest.mark.parametrize("isolation", ["rlimits", "namespaces"])
def test_a_3000_deep_directory_tree_is_cleaned_up(isolation: str, private_tmp: Path) -> None:
    if isolation == "namespaces":
        _skip_without_namespaces()
    result = run_program(_deep_tree_program(3000), isolation=isolation, **UNGUARDED)
    assert result.ok, result.error
    assert _leftovers(private_tmp) == []


def test_remove_tree_handles_depth_permissions_and_links(fast_tmp: Path) -> None:
    tmp_path = fast_tmp
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("kept")
    tree = tmp_path / "tree"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):  # deeper than PATH_MAX allows as a path, and than Python's recursion limit
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.symlink(str(outside), "link", dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        os.fchmod(fd, 0o500)
    finally:
        os.close(fd)
    (tree / "locked").mkdir()
    (tree / "locked" / "f").write_text("x")
    (tree / "locked").chmod(0)
    (tree / "top-link").symlink_to(outside)
    assert sandbox.remove_tree(str(tree))
    assert not tree.exists() and (outside / "keep.txt").read_text() == "kept"
    assert sandbox.remove_tree(str(tmp_path / "never-was"))  # nothing to remove: done, no exception
    with pytest.raises(RecursionError):  # what the cleanup used before: the test above can fail
        _rmtree_depth(tmp_path / "again", 3000)


def _rmtree_depth(path: Path, depth: int) -> None:
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        sandbox.remove_tree(str(path))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to set up the case")
def test_remove_tree_as_an_unprivileged_owner(tmp_path: Path) -> None:
    """As an ordinary uid (1000, in a user namespace) directories of mode 000 and 500 are not removable as they
    are: remove_tree makes them so first."""
    script = (
        "import os, sys\nfrom sleuth.sandbox import remove_tree\n"
        "top = sys.argv[1]\nos.makedirs(top + '/a/b')\nopen(top + '/a/b/f', 'w').close()\n"
        "os.makedirs(top + '/c')\nopen(top + '/c/g', 'w').close()\n"
        "os.chmod(top + '/a/b', 0o500)\nos.chmod(top + '/a', 0)\nos.chmod(top + '/c', 0o300)\n"
        "print(os.geteuid(), remove_tree(top), os.path.exists(top))"
    )
    out = subprocess.run(  # root outside is uid 1000 inside: tmp_path is its own, and it has no capabilities
        [
            "unshare",
            "--user",
            "--map-user=1000",
            "--map-group=1000",
            sys.executable,
            "-c",
            script,
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1000", "True", "False"]
