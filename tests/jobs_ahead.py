"""Fresh jobs a test file needs, run side by side ahead of their tests.

A test about a fresh job (the launcher, `init_process_group` itself, a script run as a user
runs it) needs processes of its own, but it need not wait for the previous test's job to end:
most of a job is a cold `import torch` per rank and waits (a rendezvous, a watchdog's grace),
and a machine holds a few jobs at once. On the first test of a module that asks for its
`jobs` fixture, `Ahead` starts the jobs of every *selected* test of that module that has a
plan (`-k` and `-m` leave the others unstarted), `PARALLEL` at a time, in the tests' order;
each test then takes its own results, waiting for them under each command's deadline, and
asserts on them as before. A job still running when the module ends is killed with its ranks.

    ahead = Ahead()
    jobs = ahead.fixture()                  # the module's fixture, named `jobs`

    @ahead.plan("test_x")                   # test_x's commands, from its parameters
    def _(tmp, backend):                    # tmp: a directory of the test's own
        return [Command([sys.executable, "-m", "tandem", "run", ...], env)]

    @pytest.mark.parametrize("backend", ["gloo", "mpi"])
    def test_x(backend, jobs, request):
        [done], tmp = jobs.take(request.node)   # subprocess.CompletedProcess, in plan order

A plan's commands run side by side; `InOrder(commands)` runs its commands one after another
in one slot, stopping after the first that exits non-zero, and is taken as the list of those
that ran. A command that overruns its deadline is killed with its descendants, and `take` raises
`subprocess.TimeoutExpired` with what it printed, as `subprocess.run(timeout=)` would.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import kill_tree

# Jobs at once: what two pytest-xdist workers gain on the slow tests (their waits overlap),
# without more processes than two cores hold. A command's own deadline is stretched by as much
# (`Command.timeout` x PARALLEL): its jobs share the cores with the others.
PARALLEL = 2


@dataclass(frozen=True)
class Command:
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | Path | None = None
    timeout: float = 150.0


@dataclass(frozen=True)
class InOrder:
    commands: Sequence[Command]


class Ahead:
    """The plans of a test module: test function name -> its commands."""

    def __init__(self, parallel: int = PARALLEL):
        self.parallel = parallel
        self.plans: dict[str, Callable[..., list[Command | InOrder]]] = {}

    def plan(self, test_name: str):
        def register(plan: Callable[..., list[Command | InOrder]]):
            self.plans[test_name] = plan
            return plan
        return register

    def fixture(self):
        ahead = self

        @pytest.fixture(scope="module")
        def jobs(request, tmp_path_factory):
            started = Started(ahead, request, tmp_path_factory)
            try:
                yield started
            finally:
                started.close()
        return jobs


class Started:
    """The jobs of a module's selected tests, running or done."""

    def __init__(self, ahead: Ahead, request, tmp_path_factory):
        self._lock = threading.Lock()
        self._closed = False
        self._running: set[subprocess.Popen] = set()
        self._runs: dict[str, tuple[list[Future], Path]] = {}
        self._parallel = ahead.parallel
        self._pool = ThreadPoolExecutor(ahead.parallel, thread_name_prefix="jobs-ahead")
        for item in request.session.items:
            plan = ahead.plans.get(getattr(item, "originalname", ""))
            if plan is None or getattr(item, "module", None) is not request.module:
                continue
            params = getattr(getattr(item, "callspec", None), "params", {})
            wanted = inspect.signature(plan).parameters
            tmp = tmp_path_factory.mktemp(re.sub(r"\W+", "_", item.name)[:40])
            commands = plan(tmp, **{k: v for k, v in params.items() if k in wanted})
            self._runs[item.nodeid] = ([self._pool.submit(self._run_all, c) for c in commands], tmp)

    def take(self, item) -> tuple[list[subprocess.CompletedProcess], Path]:
        """The test `item`'s finished commands, in its plan's order, and its directory."""
        futures, tmp = self._runs[item.nodeid]
        return [future.result() for future in futures], tmp

    def _run_all(self, command: Command | InOrder):
        if isinstance(command, Command):
            return self._run(command)
        done = []
        for step in command.commands:
            done.append(self._run(step))
            if done[-1].returncode != 0:
                break
        return done

    def _run(self, command: Command) -> subprocess.CompletedProcess:
        with self._lock:
            if self._closed:
                raise RuntimeError("the module's jobs were closed before this one started")
            process = subprocess.Popen(list(command.argv), cwd=command.cwd, env=command.env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._running.add(process)
        try:
            try:
                out, err = process.communicate(timeout=command.timeout * self._parallel)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                out, err = process.communicate(timeout=30)
                raise subprocess.TimeoutExpired(process.args, command.timeout * self._parallel, out,
                                                err) from None
            return subprocess.CompletedProcess(process.args, process.returncode, out, err)
        finally:
            with self._lock:
                self._running.discard(process)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._running)
        for process in running:
            if process.poll() is None:
                kill_tree(process.pid)
        self._pool.shutdown(wait=True, cancel_futures=True)

