"""The program sandbox: results come back, and runaway or harmful programs are stopped without side effects.

Every test runs a real child interpreter (about 0.1 s each); time limits are kept small.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
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
