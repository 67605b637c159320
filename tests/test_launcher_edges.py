"""`tandem run` at its edges: strangers on its ports, programs it cannot run, Ctrl-C while the
ranks are still importing, and the /dev/shm leftovers of a launcher that was SIGKILLed.

Jobs run through `python -m tandem run` as a user types it; without `--backend` that is MPI on
this machine (mpiexec comes with mpi4py's mpich), and each communication edge runs on Gloo too.
Nothing here is timed: a job that idle connections held up would fail (the old launch port
gave up on them after 41 s), one that they hang runs into the test's deadline.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tandem.cli.command import main
from tandem.launch import LaunchConfig, LaunchError
from tandem.launch.config import check_program
from tandem.launch.mpi import shm
from tandem.launch.programs import python_target
from tandem.testing import still_running

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
JOB_TIMEOUT_S = 90
CPU_DEFAULT = "mpi" if importlib.util.find_spec("mpi4py") else "gloo"
BACKENDS = [pytest.param((), id=CPU_DEFAULT), pytest.param(("--backend", "gloo"), id="gloo")]
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="no mpi4py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(agent: subprocess.Popen) -> tuple[str, str]:
    try:
        return agent.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()


def _read_until(stream, pattern: str, seen: list[str]) -> None:
    """Read `stream` line by line (into `seen`) until a line matches `pattern`."""
    while not any(re.search(pattern, line) for line in seen):
        line = stream.readline()
        assert line, f"the job ended before {pattern!r}:\n" + "".join(seen)
        seen.append(line)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    try:
        for _ in range(4):  # supervisor -> mpiexec(.gforker) -> tandem run
            pid = _parent(pid)
            if pid == ancestor:
                return True
    except (OSError, ValueError):
        pass
    return False


def _pids_of(agent: subprocess.Popen, script: str) -> list[int]:
    """The ranks: processes of our job running `script` under Python (`python -u script`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-u", script.encode()] and _descends_from(int(pid), agent.pid):
            found.append(int(pid))
    return found


# --- strangers on the launcher's ports -----------------------------------------------------


def _ports_in_argv(agent: int) -> dict[str, int]:
    """What `ps` shows any local user: the ports on our job's supervisors' command lines."""
    ports = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "tandem.launch.mpi.rank" in argv and _descends_from(int(pid), agent):
            for flag in ("--connect", "--store"):
                if flag in argv:
                    ports[flag] = int(argv[argv.index(flag) + 1].rsplit(":", 1)[1])
    return ports


def _listening_ports(pid: int) -> set[int]:
    """What `ss -ltnp` shows: the TCP ports this process listens on."""
    try:
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return set()
    ports = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "0A" and f"socket:[{fields[9]}]" in links:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class Strangers:
    """A local attacker: opens idle and junk connections to every port of the job it finds."""

    # Four idle ones (the user trial's: they failed the job after 41 s), then some nonsense.
    JUNK = (b"",) * 4 + (b"GET / HTTP/1.0\r\n\r\n", b"0" * 32 + b" 0 control\n", b"\xff" * 300)

    def __init__(self, agent: subprocess.Popen) -> None:
        self.agent = agent
        self.sockets: list[socket.socket] = []
        self.connected: dict[int, int] = {}  # port -> connections it accepted
        self.launch_port: int | None = None  # the one on the supervisors' command lines
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set() and self.agent.poll() is None:
            argv = _ports_in_argv(self.agent.pid)
            self.launch_port = self.launch_port or argv.get("--connect")
            for port in (set(argv.values()) | _listening_ports(self.agent.pid)) - set(
                    self.connected):
                self.connected[port] = 0
                for junk in self.JUNK:
                    try:
                        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                        sock.sendall(junk)
                    except OSError:
                        continue  # closed already: the job is past its start
                    self.sockets.append(sock)
                    self.connected[port] += 1
            self.done.wait(0.002)  # poll /proc as an attacker would

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        for sock in self.sockets:
            sock.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", BACKENDS)
def test_idle_and_junk_connections_neither_delay_nor_fail_the_job(flags):
    agent = _start("-np", "2", *flags, str(SCRIPTS / "launch_env.py"))
    strangers = Strangers(agent)
    try:
        out, err = _finish(agent)
    finally:
        strangers.close()
    assert agent.returncode == 0, err
    backend = "gloo" if flags else CPU_DEFAULT
    for rank in (0, 1):
        assert f"[{rank}] allreduce=3 backend={backend}" in out, out + err
    # The attack happened while the job was starting: the port the supervisors connect to
    # (MPI's launch port, which closes once every rank is connected; Gloo's store) took every
    # idle and junk connection.
    if backend == "mpi":
        assert strangers.connected.get(strangers.launch_port) == len(Strangers.JUNK), \
            strangers.connected
    assert len(Strangers.JUNK) in strangers.connected.values(), strangers.connected


# --- programs tandem run cannot run --------------------------------------------------------


def _file(path: Path, text: bytes, executable: bool) -> str:
    path.write_bytes(text)
    path.chmod(0o755 if executable else 0o644)
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["python"], "`python` with no script to run: each rank would start Python on an empty"),
    (["python", "-u", "-X", "dev"], "Name the script: `tandem run -np 2 python train.py`"),
    (["-m", "launch_touch.py"], "did you mean `-m launch_touch`?"),
    (["-m", "tests/scripts/launch_touch.py"], "did you mean `-m tests.scripts.launch_touch`?"),
    (["python", "-m", "launch_touch.py"], "did you mean `-m launch_touch`?"),
    (["python", "no_such_script.py"], "the script 'no_such_script.py' does not exist"),
], ids=["python", "python-flags", "-m-file", "-m-path", "python-m-file", "python-missing"])
def test_a_command_with_nothing_sensible_to_run_is_a_usage_error(argv, message, tmp_path,
                                                                  capsys):
    code = main(["run", "-np", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("usage: tandem run")  # a usage error: the usage, then the cause


@pytest.mark.parametrize("name, text, executable, message", [
    ("nosb", b"echo hi\n", True, "is executable but has no #! line, so the system cannot run it"
     " as a command (only a shell would guess `sh`). Name its interpreter: `tandem run -np 2 sh "),
    ("pynosb", b"print('hi')\n", True, "`tandem run -np 2 python {path}` (it compiles as Python)"),
    ("badsb", b"#!/no/such/interpreter\necho hi\n", True,
     "its first line `#!/no/such/interpreter` names /no/such/interpreter, which does not exist"),
    ("crlf", b"#!/bin/sh\r\necho hi\r\n", True, "its first line `#!/bin/sh` ends in a carriage "
     "return (Windows line endings), so the system looks for `/bin/sh\\r`"),
    ("shell", b"echo hi\n", False, "is not a Python file (Python cannot compile it: invalid "
     "syntax at line 1), it is not executable and it has no #! line"),
    ("bashscript", b"#!/bin/bash\necho hi\n", False, "is a `#!/bin/bash` script, not Python, and"
     " it is not executable: `chmod +x {path}`, or name its interpreter: `tandem run -np 2 "
     "/bin/bash {path}`"),
    ("program", b"\x7fELF\x02\x01\x01" + b"\0" * 64, False,
     "is a program (ELF) but it is not executable: `chmod +x {path}`"),
], ids=["sh-no-shebang", "python-no-shebang", "missing-interpreter", "windows-line-endings",
        "shell-not-executable",
        "bash-not-executable", "elf-not-executable"])
def test_a_file_that_cannot_run_is_named_with_the_cause(name, text, executable, message,
                                                        tmp_path, capsys):
    path = _file(tmp_path / name, text, executable)
    marker = tmp_path / "started"
    code = main(["run", "-np", "2", path, str(marker)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(path=path) in err, err
    assert not marker.exists()


def test_files_python_can_run_are_run_by_it_as_torchrun_does(tmp_path):
    """Not executable, yet Python: a script without .py, a `#!python` one, a directory."""
    plain = _file(tmp_path / "train", b"import os\nprint(os.sep)\n", False)
    shebang = _file(tmp_path / "tool", b"#!/usr/bin/env python3\nprint(1)\n", False)
    env_s = _file(tmp_path / "tool2", b"#!/usr/bin/env -S python3 -u\nprint(1)\n", False)
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "__main__.py").write_text("print(1)\n")
    for program in (plain, shebang, env_s, str(folder), str(SCRIPTS / "launch_touch.py")):
        check_program(LaunchConfig(np=2, program=program))  # nothing to say
    with pytest.raises(LaunchError, match="is a directory without __main__.py"):
        check_program(LaunchConfig(np=2, program=str(tmp_path)))


@pytest.mark.parametrize("args, target", [
    ((), None), (("-",), None), (("-u", "-B"), None), (("-X", "dev", "-W", "error"), None),
    (("-Wignore", "-u"), None), (("--check-hash-based-pycs", "never"), None),
    (("train.py", "--lr", "1"), ("script", "train.py")), (("-u", "-m", "pkg.x"), ("-m", "pkg.x")),
    (("-mpkg.x",), ("-m", "pkg.x")), (("-uc", "print(1)"), ("-c", "print(1)")),
    (("-X", "dev", "t.py"), ("script", "t.py")), (("--version",), ("option", "--version")),
])
def test_what_a_python_command_line_runs(args, target):
    assert python_target(args) == target


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", BACKENDS)
def test_a_program_the_system_refuses_is_named_without_the_usage(flags, tmp_path):
    # Executable, neither ELF nor `#!` nor text: the system has the last word, and says no.
    program = _file(tmp_path / "blob", b"\0\1\2 not a program", True)
    agent = _start("-np", "2", *flags, program)
    out, err = _finish(agent)
    assert agent.returncode == 126, err  # as a shell says it: found, but cannot be executed
    assert re.search(rf"could not start {re.escape(program)}: Exec format error$", err, re.M), err
    assert "usage:" not in err and "[]" not in err and "Traceback" not in err, err


# --- Ctrl-C during start-up ----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", BACKENDS)
def test_ctrl_c_during_start_up_prints_one_line_and_exits_130(flags):
    script = str(SCRIPTS / "launch_importing.py")
    agent = _start("-np", "2", *flags, script)
    seen: list[str] = []
    try:
        _read_until(agent.stderr, r"^\[0\] importing", seen)
        _read_until(agent.stderr, r"^\[1\] importing", seen)
        ranks = _pids_of(agent, script)
        agent.send_signal(signal.SIGINT)
    finally:
        out, err = _finish(agent)
    assert agent.returncode == 130, err
    assert err == "tandem run: interrupted during start-up (SIGINT); stopped 2 rank(s)\n", err
    assert out == "", out
    assert len(ranks) == 2 and not still_running(ranks), ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", BACKENDS)
def test_ctrl_c_reaches_started_ranks_and_spares_importing_ones_a_traceback(flags):
    """Rank 0 runs its code (it may catch KeyboardInterrupt); rank 1 is still importing."""
    script = str(SCRIPTS / "launch_importing.py")
    agent = _start("-np", "2", *flags, script, "rank0-ready")
    seen: list[str] = []
    try:
        _read_until(agent.stdout, r"^\[0\] ready", [])
        _read_until(agent.stderr, r"^\[1\] importing", seen)
        agent.send_signal(signal.SIGINT)
    finally:
        _, err = _finish(agent)
    assert agent.returncode == 130, err
    assert "tandem run: received SIGINT; stopping all ranks" in err, err
    assert "[0] KeyboardInterrupt" in err, err  # rank 0 got the SIGINT itself
    assert not [line for line in err.splitlines() if line.startswith("[1]")], err


# --- /dev/shm after a SIGKILLed launcher ---------------------------------------------------


def _hold_shared_memory() -> tuple[subprocess.Popen, set[str], list[int]]:
    """An MPI job whose ranks map their segments and wait: (launcher, segments, rank pids)."""
    script = str(SCRIPTS / "mpi_shm_hold.py")
    agent = _start("-np", "2", "--backend", "mpi", script)
    seen: list[str] = []
    try:
        _read_until(agent.stdout, r"^\[0\] rank 0 maps", seen)
        _read_until(agent.stdout, r"^\[1\] rank 1 maps", seen)
        names = {name for line in seen for name in line.split(" maps ", 1)[-1].split()}
        segments = {name for name in names
                    if any(fnmatch.fnmatch(name, pattern) for pattern in shm.PATTERNS)}
        assert segments, seen  # the ranks use shared memory that outlives MPI's init
        return agent, segments, _pids_of(agent, script)
    except BaseException:
        agent.kill()
        agent.communicate()
        raise


def _kill_launcher(agent: subprocess.Popen, ranks: list[int]) -> str:
    """SIGKILL `tandem run` itself (it can clean nothing up); its stderr."""
    agent.kill()
    _, err = agent.communicate(timeout=JOB_TIMEOUT_S)
    assert not still_running(ranks), ranks  # the supervisors end the ranks with their agent
    return err


def _present(names: set[str]) -> set[str]:
    return {name for name in names if (shm.SHM_DIR / name).exists()}


def _doctor_clean() -> str:
    done = subprocess.run([sys.executable, "-m", "tandem", "doctor", "--clean"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _removal_named(said: str, names: set[str]) -> bool:
    """Whether one line of `said` reports removing `names` (among others, perhaps)."""
    return any(re.search(r"removed \d+ stale MPI segment\(s\) from /dev/shm", line)
               and all(name in line for name in names) for line in said.splitlines())


# Other MPI jobs on this shared machine may remove a leftover first (a job ends by removing
# the unused segments that appeared while it ran: `shm.remove_new`). Such an attempt proves
# nothing either way; it is tried again, and the test is skipped if none is conclusive.
ATTEMPTS = 3


def _next_run_and_doctor_clean_remove_leftovers() -> bool:
    """One attempt; True when it was conclusive (and every assertion held)."""
    first, first_segments, first_ranks = _hold_shared_memory()
    _kill_launcher(first, first_ranks)
    left = _present(first_segments)  # nobody could remove them: its ranks died with it

    # The next `tandem run` removes them as it starts; its own, in use, stay while it runs,
    # and `tandem doctor --clean` leaves those alone too.
    second, second_segments, second_ranks = _hold_shared_memory()
    try:
        assert not _present(first_segments)
        said = _doctor_clean()
        assert _present(second_segments) == second_segments, said
    finally:
        err = _kill_launcher(second, second_ranks)
    if not left or not _removal_named(err, left):
        return False  # someone else's job removed them before ours started
    assert err.startswith("tandem run: removed "), err  # before anything else

    left = _present(second_segments)
    said = _doctor_clean()
    assert not _present(second_segments), said
    if not left:
        return False
    assert said.startswith("clean") and _removal_named(said.splitlines()[0], left), said
    return True


@pytest.mark.timeout(300)
@needs_mpi
@pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_killed_launchers_shared_memory_goes_with_the_next_run_and_doctor_clean():
    for _ in range(ATTEMPTS):
        if _next_run_and_doctor_clean_remove_leftovers():
            return
    pytest.skip(f"in {ATTEMPTS} attempts, other MPI jobs on this machine removed the leftovers "
                "before tandem run or tandem doctor --clean could")


def test_only_segments_no_process_uses_are_stale(tmp_path):
    stale_file = tmp_path / "mpich_shm_0badf00d"
    live_file = tmp_path / "mpich_shm_1badf00d"
    open_file = tmp_path / "sm_segment.host.0.1"
    for path in (stale_file, live_file, open_file):
        path.write_bytes(b"\0" * 4096)
    (tmp_path / "not_mpi").write_bytes(b"x")
    with open(live_file, "r+b") as handle, mmap.mmap(handle.fileno(), 4096), \
            open(open_file, "rb"):
        removed, size = shm.remove_stale(tmp_path)
    assert removed == [stale_file.name] and size == 4096
    assert live_file.exists() and open_file.exists() and (tmp_path / "not_mpi").exists()
