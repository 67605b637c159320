"""The argument check compares the user's call site: a rank that skipped one of two same-shaped
collectives in a row is named before anything is sent, for td.* and for torch's dist.* on
backend "tandem"; code that branches on the rank runs as before.

    if rank == 0: a = td.allreduce(x, op="sum")     # rank 1 skips this one
    b = td.allreduce(y, op="sum")                   # was: both ranks get x + y, rc 0

The judge of two lines (`comm.agreement.call_sites.verdict`) is a pure function, tested without
processes; the shared worlds (Gloo and MPI, default and debug mode) check what the ranks do
with it; one job covers `init_process_group("tandem")` on the Gloo engine, which no shared
world has (its torch group is Gloo's own there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tandem as td
from tandem.comm.agreement import call_sites, fingerprints
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(not HAVE_MPI, reason="no mpi4py"))]
DEBUG = {"TANDEM_DEBUG": "1"}  # the world test_debug.py uses too

# --- the judge of two lines, one process ------------------------------------------------------

VERDICTS = {
    "a skip (the issue's example)": ("""
        if rank == 0: a = td.allreduce(x, op="sum")
        b = td.allreduce(y, op="sum")
        """, call_sites.SKIP),
    "a skip in a loop": ("""
        for batch in data:
            if rank == 0:
                td.allreduce(x)
            td.allreduce(y)
        """, call_sites.SKIP),
    "one more batch on one rank": ("""
        for batch in data:
            td.allreduce(x)
        td.allreduce(y)
        """, call_sites.SKIP),
    "a skip before a with block": ("""
        if rank == 0:
            td.allreduce(x)
        with torch.no_grad():
            td.allreduce(y)
        """, call_sites.SKIP),
    "if / else": ("""
        if rank == 0:
            td.broadcast(x)
        else:
            td.broadcast(y)
        """, call_sites.BRANCHES),
    "if / elif / else": ("""
        if rank == 0:
            td.broadcast(x)
        elif rank == 1:
            td.broadcast(y)
        else:
            td.broadcast(z)
        """, call_sites.BRANCHES),
    "two ifs": ("""
        if rank == 0:
            td.broadcast(x)
        if rank != 0:
            td.broadcast(y)
        """, call_sites.UNKNOWN),
    "an early return": ("""
        def f():
            if rank == 0:
                td.broadcast(x)
                return x
            td.broadcast(y)
        """, call_sites.UNKNOWN),
    "a continue": ("""
        for batch in data:
            if rank == 0:
                td.allreduce(x)
                continue
            td.allreduce(y)
        """, call_sites.UNKNOWN),
    "two functions": ("""
        def f():
            td.allreduce(x)
        def g():
            td.allreduce(y)
        """, call_sites.UNKNOWN),
    "a conditional later call": ("""
        td.allreduce(x)
        if rank == 1:
            td.allreduce(y)
        """, call_sites.UNKNOWN),
}


@pytest.mark.parametrize("case", list(VERDICTS))
def test_two_lines_are_judged_from_the_syntax_alone(case):
    source, expected = VERDICTS[case]
    source = textwrap.dedent(source).strip("\n") + "\n"
    lines = [n for n, text in enumerate(source.splitlines(), 1) if "td." in text]
    verdict, pair = call_sites.verdict(source, lines)
    assert verdict == expected, (case, verdict)
    assert pair == ((lines[0], lines[-1]) if expected == call_sites.SKIP else None)


def test_the_call_site_is_the_users_line_not_torchs_or_tandems():
    assert fingerprints.call_site() == f"test_call_sites.py:{sys._getframe().f_lineno}"
    key = torch.no_grad()(lambda: fingerprints.site_key())()  # torch's wrapper is skipped
    assert key[0] == __file__ and fingerprints.site_code(key) == fingerprints.site_code(key)


# --- ranks, default mode ----------------------------------------------------------------------


def _line() -> int:
    return sys._getframe(1).f_lineno


def _error(call) -> str:
    try:
        call()
    except td.DivergedError as error:
        return str(error)
    raise AssertionError("the ranks should have been refused")


def check_skip_is_named_and_branches_run():
    rank = td.rank()
    x, y = torch.ones(1) * (rank + 1), torch.ones(1) * 10 * (rank + 1)
    found = {}

    def skip():
        if rank == 0: td.allreduce(x, op="sum")  # noqa: E701 - the issue's example, as written
        td.allreduce(y, op="sum")
    found["skip"] = _error(skip)
    found["skip_at"] = skip.__code__.co_firstlineno + 1

    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() in ("tandem", "mpi"):  # the MPI world

        def torch_skip():
            if rank == 0: dist.all_reduce(x)  # noqa: E701
            dist.all_reduce(y)
        found["torch_skip"] = _error(torch_skip)
        found["torch_skip_at"] = torch_skip.__code__.co_firstlineno + 1

    def branches():
        if rank == 0:
            return td.broadcast(x, root=0).item()
        else:
            return td.broadcast(torch.zeros(1), root=0).item()

    def two_ifs():
        if rank == 0:
            out = td.broadcast(x * 7, root=0)
        if rank != 0:
            out = td.broadcast(torch.zeros(1), root=0)
        return out.item()
    found["branches"] = [branches() for _ in range(3)]
    found["two_ifs"] = two_ifs()
    judged = len(fingerprints.judged)
    found["again"] = [branches(), two_ifs()]
    found["judged_again"] = len(fingerprints.judged) - judged  # no second exchange
    found["sum"] = td.allreduce(torch.ones(1), op="sum").item()  # the world is still usable
    return found


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_collective_is_named_before_any_value_and_branches_run(backend):
    results = run_distributed(check_skip_is_named_and_branches_run, world_size=2, backend=backend)
    for found in results:
        at = found["skip_at"]
        skip = found["skip"].splitlines()
        assert skip[0].startswith(f"ranks reached one collective from different lines, and "
                                  f"test_call_sites.py:{at + 1} comes after test_call_sites.py:"
                                  f"{at} in the same block: rank(s) 1, at "), skip[0]
        assert skip[1] == ("  rank 0: allreduce(shape=(1,), dtype=float32, op='sum') at "
                           f"test_call_sites.py:{at}")
        assert skip[2] == ("  rank 1: allreduce(shape=(1,), dtype=float32, op='sum') at "
                           f"test_call_sites.py:{at + 1}")
        assert f"Make every rank call the collective at test_call_sites.py:{at}" in skip[3]
        if backend == "mpi":  # torch's dist.all_reduce on backend "tandem": the user's lines
            at = found["torch_skip_at"]
            assert (f"rank 0: all_reduce(shape=(1,), dtype=float32, op='sum') at "
                    f"test_call_sites.py:{at}\n") in found["torch_skip"], found["torch_skip"]
            assert f"rank 1: all_reduce(shape=(1,), dtype=float32, op='sum') at " \
                   f"test_call_sites.py:{at + 1}\n" in found["torch_skip"]
        assert found["branches"] == [1.0, 1.0, 1.0]
        assert found["two_ifs"] == 7.0 and found["again"] == [1.0, 7.0]
        assert found["judged_again"] == 0
        assert found["sum"] == 2.0


# --- ranks, debug mode: strict ----------------------------------------------------------------


def check_debug_mode_is_strict():
    rank = td.rank()
    found = {}

    def two_ifs():
        if rank == 0:
            td.broadcast(torch.ones(1), root=0)
        if rank != 0:
            td.broadcast(torch.zeros(1), root=0)
    found["two_ifs"] = _error(two_ifs)

    def skip():
        if rank == 0: td.allreduce(torch.ones(2))  # noqa: E701
        td.allreduce(torch.ones(2))
    found["skip"] = _error(skip)

    def branches():
        if rank == 0:
            return td.broadcast(torch.ones(1), root=0).item()
        else:
            return td.broadcast(torch.zeros(1), root=0).item()
    found["branches"] = branches()
    return found


@pytest.mark.timeout(150)
def test_debug_mode_refuses_lines_it_cannot_prove_are_branches():
    for found in run_distributed(check_debug_mode_is_strict, world_size=2, env=DEBUG):
        assert found["two_ifs"].startswith("ranks reached one collective from different lines "
                                           "that are not the branches of one if/else")
        assert "rank 0: #" in found["two_ifs"] and "broadcast(shape=(1,)" in found["two_ifs"]
        assert "choose the tensor first" in found["two_ifs"]
        assert "went past the collective at" in found["skip"]
        assert "rank 1: #" in found["skip"]
        assert found["branches"] == 1.0


# --- a job: init_process_group("tandem") on the Gloo engine ----------------------------------

TORCH_SKIP = """\
import torch, torch.distributed as dist, tandem
dist.init_process_group("tandem")
rank = dist.get_rank()
x, y = torch.ones(1) * (rank + 1), torch.ones(1) * 10 * (rank + 1)
if rank == 0: dist.all_reduce(x)
dist.all_reduce(y)
print("summed", y.item(), flush=True)
"""


@pytest.mark.timeout(150)
def test_torch_all_reduce_on_backend_tandem_over_gloo_names_the_skip(tmp_path):
    script = tmp_path / "torch_skip.py"
    script.write_text(TORCH_SKIP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "DivergedError: ranks reached one collective from different lines" in text, text
    assert "rank 0: all_reduce(shape=(1,), dtype=float32, op='sum') at torch_skip.py:5" in text
    assert "rank 1: all_reduce(shape=(1,), dtype=float32, op='sum') at torch_skip.py:6" in text
    assert "summed" not in text
