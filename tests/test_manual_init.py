"""td.init(rank=, world_size=): torch.distributed's manual template joins a job, in real processes.

The parent starts the ranks with `multiprocessing` (no launcher variables), each calls
`td.init(rank=r, world_size=n)` and sends what it saw back through a queue. Every wait has a
deadline, and the children are killed whatever happens.
"""

import multiprocessing as mp
import os
import queue
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch

import tandem as td
from tandem.rendezvous import roll_call

DEADLINE_S = 120.0
# What a launcher sets; none of it may reach the children, which must be placed by arguments only.
LAUNCHER_PREFIXES = ("TANDEM_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _is_launcher_variable(name: str) -> bool:
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES


@pytest.fixture
def no_launcher(monkeypatch):
    """This process's environment without any launcher's variables (restored afterwards)."""
    for name in [n for n in os.environ if _is_launcher_variable(n)]:
        monkeypatch.delenv(name)
    return monkeypatch


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _context():
    """Processes forked from one server process that imported torch, tandem and this module
    once, for the whole file: `spawn` imported torch again in every process (2-4 s of CPU each,
    ~15 processes here), and a fork of the pytest process itself is unsafe (threads in it).
    The server does not see later changes to this process's environment: `_environment` is
    handed to each child, which takes it as its own (as a spawned child would inherit it)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tandem", __name__])
    return context


def _environment() -> dict[str, str]:
    return dict(os.environ)


def _take_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def template_rank(rank: int, n: int, results, init_kwargs: dict, env: dict[str, str]) -> None:
    """The template's `run(rank, n)`: join, all-reduce, report to the parent."""
    _take_environment(env)
    try:
        world = td.init(rank=rank, world_size=n, timeout=60, **init_kwargs)
        total = td.allreduce(torch.tensor([float(rank + 1)]), op="sum").item()
        assert td.init(rank=rank, world_size=n) is world  # idempotent, as without arguments
        try:
            td.init(rank=(rank + 1) % n, world_size=n)
            raise AssertionError("init with another rank did not raise")
        except ValueError as error:
            assert f"already initialised as rank {rank} of {n}" in str(error), error
        results.put(("ok", rank, (world.rank, world.size, world.local_rank, world.local_size,
                                  world.backend, total)))
    except BaseException:
        results.put(("err", rank, traceback.format_exc()))
    finally:
        td.shutdown()


def _run_template(n: int, **init_kwargs) -> list:
    """Start `n` ranks as the template does and return what each reported, in rank order."""
    context = _context()
    results = context.Queue()
    env = _environment()
    processes = [context.Process(target=template_rank, args=(rank, n, results, init_kwargs, env),
                                 daemon=True) for rank in range(n)]
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        for process in processes:
            process.start()
        while len(reports) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"ranks {sorted(set(range(n)) - set(reports))} did not report "
                            f"within {DEADLINE_S:.0f} s")
            try:
                status, rank, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = {rank: p.exitcode for rank, p in enumerate(processes)
                        if rank not in reports and p.exitcode not in (None, 0)}
                if dead:
                    pytest.fail(f"ranks died without reporting (rank: exit code): {dead}")
                continue
            if status == "err":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            reports[rank] = payload
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
        assert [p.exitcode for p in processes] == [0] * n
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        results.close()
    return [reports[rank] for rank in range(n)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3])
def test_the_manual_template_joins_a_gloo_job(no_launcher, n):
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", str(_free_port()))
    total = float(sum(range(1, n + 1)))
    assert _run_template(n) == [(rank, n, rank, n, "gloo", total) for rank in range(n)]


@pytest.mark.timeout(180)
def test_init_method_tcp_instead_of_master_variables(no_launcher):
    reports = _run_template(2, init_method=f"tcp://127.0.0.1:{_free_port()}")
    assert reports == [(0, 2, 0, 2, "gloo", 3.0), (1, 2, 1, 2, "gloo", 3.0)]


@pytest.mark.timeout(180)
def test_the_template_as_a_script(tmp_path):
    """The template as users write it: `__main__`, the default start method, MASTER_* set."""
    script = tmp_path / "template.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.multiprocessing as mp, tandem as td

        def run(rank, n):
            td.init(rank=rank, world_size=n)
            total = td.allreduce(torch.ones(1) * (rank + 1), op="sum").item()
            print(f"rank {td.rank()} of {td.size()} total {total}", flush=True)
            td.shutdown()

        if __name__ == "__main__":
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = os.environ["TEST_PORT"]
            procs = [mp.Process(target=run, args=(r, 2)) for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(90)
            codes = [p.exitcode for p in procs]
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise SystemExit(0 if codes == [0, 0] else f"exit codes {codes}")
    """))
    clean = {k: v for k, v in os.environ.items() if not _is_launcher_variable(k)}
    done = subprocess.run([sys.executable, str(script)], env={**clean, "TEST_PORT": str(_free_port())},
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    # Two processes print to one pipe: their lines may interleave, so find them, not split them.
    reports = sorted(re.findall(r"rank \d+ of \d+ total [\d.]+", done.stdout))
    assert reports == ["rank 0 of 2 total 3.0", "rank 1 of 2 total 3.0"], done.stdout


def test_a_rank_outside_the_world_is_an_error_before_any_communication(no_launcher):
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=5, world_size=2): rank 5 is not a rank of a world of 2 processes")):
        td.init(rank=5, world_size=2)
    assert not td.is_initialized()


def test_a_rendezvous_without_a_rank_is_an_error_not_a_world_of_one(no_launcher):
    no_launcher.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError) as raised:
        td.init()
    assert not td.is_initialized()  # not a world of one
    assert "MASTER_PORT=29500 is set but RANK and WORLD_SIZE are not" in str(raised.value)
    assert "Pass td.init(rank=r, world_size=n), or start the script with `tandem run -np N` / " \
        "torchrun" in str(raised.value)


def test_mpi_cannot_join_a_job_named_by_arguments(no_launcher):
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="backend 'mpi' cannot join a job named by "
                                         r"td.init\(rank=0, world_size=2\).*mpiexec.*"
                                         "`tandem run -np N --backend mpi"):
        td.init(rank=0, world_size=2, backend="mpi")
    assert not td.is_initialized()


def test_missing_rendezvous_is_an_error_before_any_communication(no_launcher):
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT are not set"):
        td.init(rank=1, world_size=2)
    assert not td.is_initialized()


# -- the roll call: numbering mistakes are named, within the timeout -----------------------------

def _entry(rank, size, pid):
    return {"rank": rank, "size": size, "pid": pid, "host": "h"}


def test_the_roll_call_verdict_is_a_pure_function_of_who_came():
    verdict = roll_call._verdict
    came = {1: _entry(0, 2, 10), 2: _entry(1, 2, 11)}
    assert verdict(came, 2, 5, "a:1", late=False) == {
        "tickets": [1, 2], "ranks": {"0": "pid 10 on h", "1": "pid 11 on h"}}
    assert verdict({1: _entry(0, 3, 10)}, 3, 5, "a:1", late=False) is None  # wait on
    missing = verdict({1: _entry(0, 3, 10), 2: _entry(2, 3, 12)}, 3, 5, "a:1", late=True)
    assert missing["error"].startswith("ranks [1] of 3 did not join within 5 s (rank 0 hosts the "
                                       "rendezvous at a:1; joined: rank 0 (pid 10 on h)")
    sizes = verdict({1: _entry(0, 2, 10), 2: _entry(1, 3, 11)}, 2, 5, "a:1", late=False)
    assert "rank 0 (pid 10 on h) world_size=2; rank 1 (pid 11 on h) world_size=3" in sizes["error"]
    twice = verdict({1: _entry(0, 3, 10), 2: _entry(1, 3, 11), 3: _entry(1, 3, 12)}, 3, 5, "a:1",
                    late=False)
    assert "rank 1 by pid 11 on h and pid 12 on h" in twice["error"]


def test_a_process_that_comes_after_the_job_started_is_told_so():
    from tandem import rendezvous

    server = rendezvous.StoreServer("127.0.0.1", 0)
    stores = [rendezvous.StoreClient("127.0.0.1", server.port, server.key, 10.0) for _ in range(3)]
    try:
        address = f"127.0.0.1:{server.port}"
        rank_1 = threading.Thread(target=roll_call.answer, args=(stores[1], 1, 2, 10.0, address))
        rank_1.start()
        roll_call.answer(stores[0], 0, 2, 10.0, address)  # returns: the job is complete
        rank_1.join(10)
        with pytest.raises(roll_call.RendezvousError,
                           match=rf"rank 1 of 2: the job at {address} started without this "
                                 r"process \(its rank 1 is pid \d+ on \S+\): two processes were "
                                 "given rank 1, or a previous job still runs at that address"):
            roll_call.answer(stores[2], 1, 2, 10.0, address)
    finally:
        for store in stores:
            store.close()
        server.close()


def roll_call_rank(rank: int, n: int, results, slot: int, env: dict[str, str]) -> None:
    """One process of a mis-numbered template: report how its init ended."""
    _take_environment(env)
    try:
        td.init(rank=rank, world_size=n)
        total = td.allreduce(torch.ones(1), op="sum").item()
        results.put((slot, "ok", total))
    except BaseException as error:
        results.put((slot, type(error).__name__, str(error)))
    finally:
        td.shutdown()


def _start_numbered(specs: list[tuple[int, int]], env: dict[str, str]):
    """Start one process per (rank, world_size) with the environment `env`."""
    context = _context()
    results = context.Queue()
    processes = [context.Process(target=roll_call_rank, args=(rank, n, results, slot, env),
                                 daemon=True) for slot, (rank, n) in enumerate(specs)]
    for process in processes:
        process.start()
    return processes, results


def _collect_numbered(processes, results) -> list[tuple[str, str]]:
    """How each process of `_start_numbered` ended, in its order; then they are gone."""
    reports: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(reports) < len(processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"processes {sorted(set(range(len(processes))) - set(reports))} did not "
                            f"report within {DEADLINE_S:.0f} s: a hang")
            try:
                slot, kind, text = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            reports[slot] = (kind, text)
    finally:
        _end(processes, results)
    return [reports[slot] for slot in range(len(processes))]


def _end(processes, results) -> None:
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
    results.close()


# Each mis-numbered template below waits for its TANDEM_TIMEOUT (3 s) or is named at once; they
# run side by side, each at a port of its own, started together on the first of these tests that
# runs (only those selected): (specs, TANDEM_TIMEOUT) per test.
NUMBERED = {
    "test_two_processes_given_rank_0_are_named": ([(0, 2), (0, 2)], 3),
    "test_a_missing_rank_is_named_on_every_rank_that_came": ([(0, 3), (2, 3)], 3),
    "test_different_world_sizes_are_named_per_rank": ([(0, 2), (1, 3)], 30),  # named at once
    "test_a_rank_given_twice_is_named": ([(0, 3), (1, 3), (1, 3)], 30),
    "test_a_job_without_rank_0_is_named": ([(1, 2)], 3),
}


class Numbered:
    """The mis-numbered templates of the selected tests, started together."""

    def __init__(self, names: list[str]):
        clean = {k: v for k, v in os.environ.items() if not _is_launcher_variable(k)}
        self.started = {}
        probes = [socket.socket() for _ in names]  # held together: a port each
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        ports = [probe.getsockname()[1] for probe in probes]
        for probe in probes:
            probe.close()
        try:
            for name, port in zip(names, ports, strict=True):
                specs, timeout_s = NUMBERED[name]
                address = f"127.0.0.1:{port}"
                env = {**clean, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TANDEM_TIMEOUT": str(timeout_s)}
                self.started[name] = (address, _start_numbered(specs, env))
        except BaseException:
            self.close()
            raise

    def take(self, name: str) -> tuple[str, list[tuple[str, str]]]:
        """The rendezvous address of test `name`'s template, and how each process ended."""
        address, (processes, results) = self.started.pop(name)
        return address, _collect_numbered(processes, results)

    def close(self) -> None:
        for _, (processes, results) in self.started.values():
            _end(processes, results)
        self.started.clear()


@pytest.fixture(scope="module")
def numbered(request):
    names = [item.originalname for item in request.session.items
             if getattr(item, "module", None) is request.module
             and getattr(item, "originalname", "") in NUMBERED]
    started = Numbered(names)
    try:
        yield started
    finally:
        started.close()


def _no_raw_store_errors(reports):
    for kind, text in reports:
        assert kind == "RendezvousError", (kind, text)
        assert "DistStoreError" not in text and "wait timeout" not in text, text


@pytest.mark.timeout(120)
def test_two_processes_given_rank_0_are_named(numbered):
    template_env, (first, second) = numbered.take("test_two_processes_given_rank_0_are_named")
    _no_raw_store_errors([first, second])
    taken = (f"rank 0 of 2: another process already hosts rank 0's rendezvous at {template_env}: "
             "two processes were given rank 0, or a previous job still runs")
    missing = "rank 0 of 2: ranks [1] of 2 did not join within 3 s"
    # Whichever started first hosts the rendezvous and waits for rank 1; the other cannot host.
    texts = sorted([first[1], second[1]], key=lambda text: not text.startswith(taken))
    assert texts[0].startswith(taken) and texts[1].startswith(missing), texts


@pytest.mark.timeout(120)
def test_a_missing_rank_is_named_on_every_rank_that_came(numbered):
    template_env, reports = numbered.take("test_a_missing_rank_is_named_on_every_rank_that_came")
    _no_raw_store_errors(reports)
    for rank, (_, text) in zip((0, 2), reports, strict=True):
        assert text.startswith(f"rank {rank} of 3: ranks [1] of 3 did not join within 3 s "
                               f"(rank 0 hosts the rendezvous at {template_env}"), text
        assert "td.init(rank=r, world_size=3) for r = 0..2" in text


@pytest.mark.timeout(120)
def test_different_world_sizes_are_named_per_rank(numbered):
    _, reports = numbered.take("test_different_world_sizes_are_named_per_rank")
    _no_raw_store_errors(reports)
    for (_, text), prefix in zip(reports, ("rank 0 of 2", "rank 1 of 3"), strict=True):
        assert text.startswith(f"{prefix}: the processes were given different world sizes"), text
        assert re.search(r"rank 0 \(pid \d+ on [^)]+\) world_size=2; "
                         r"rank 1 \(pid \d+ on [^)]+\) world_size=3", text), text


@pytest.mark.timeout(120)
def test_a_rank_given_twice_is_named(numbered):
    _, reports = numbered.take("test_a_rank_given_twice_is_named")
    _no_raw_store_errors(reports)
    for _, text in reports:
        assert re.search(r"two processes were given one rank: rank 1 by pid \d+ on \S+ and "
                         r"pid \d+ on \S+", text), text


@pytest.mark.timeout(120)
def test_a_job_without_rank_0_is_named(numbered):
    template_env, [(kind, text)] = numbered.take("test_a_job_without_rank_0_is_named")
    assert kind == "RendezvousError"
    assert text.startswith(f"rank 1 of 2: nobody hosts the rendezvous at {template_env} (rank 0 "
                           "does) within 3 s"), text
