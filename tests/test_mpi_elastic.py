"""Elastic jobs on MPI (issue 41, item 5): `tandem run --backend mpi -np N --min-np A` runs where
the MPI can shrink a world (Open MPI 5 with ULFM: a rank that fails is dropped, the survivors
shrink the world, restore the last commit and end with the one-process result), and is refused
before anything starts elsewhere (MPICH), naming the MPI installed here and what shrinking
would need; an MPI world cannot grow, so --max-np above -np is refused on both. Run under MPICH
(.venv) and Open MPI (scripts/test-openmpi.sh)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")
KILL_POINTS = str(ROOT / "tests" / "scripts" / "elastic_kill_points.py")


def _version_of_mpiexec() -> tuple[str, str]:
    """(MPI, version) as this Python's mpiexec says it, asked here, not through tandem."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60,
                          env=env).stdout
    if "HYDRA" in said:
        return "MPICH", re.search(r"Version:\s*(\S+)", said).group(1)
    return "Open MPI", re.search(r"\(Open MPI\)\s*(\S+)", said).group(1)


def _env(timeout: str = "60") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), TANDEM_TIMEOUT=timeout,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _tandem_run(*args: str, timeout: float = 120, rank_timeout: str = "60"
                ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", "run", "--backend", "mpi", *args],
                          cwd=ROOT, env=_env(rank_timeout), capture_output=True, text=True,
                          timeout=timeout)


def _skip_without_ulfm() -> None:
    mpi, version = _version_of_mpiexec()
    if mpi != "Open MPI":
        pytest.skip(f"{mpi} {version} never reports a lost rank (scripts/test-openmpi.sh runs "
                    "this on Open MPI 5 with ULFM)")


def _one_process(tmp_path_factory, script: str, name: str) -> dict:
    """`script`'s result in one process: the reference of the jobs that run it."""
    _skip_without_ulfm()
    reference = tmp_path_factory.mktemp("reference") / name
    done = subprocess.run([sys.executable, script, str(reference)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return torch.load(reference)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """elastic_train.py's one-process result (SGD), the reference of every job here."""
    return _one_process(tmp_path_factory, TRAIN, "sgd.pt")


@pytest.fixture(scope="module")
def one_process_adam(tmp_path_factory) -> dict:
    """elastic_kill_points.py's one-process result (Adam), the reference of the sharded jobs."""
    return _one_process(tmp_path_factory, KILL_POINTS, "adam.pt")


def _same_as_one_process(got: dict, want: dict) -> None:
    assert got["sizes"] == [3] * 5 + [2] * 7 and got["step"] == 12, got["sizes"]
    for name, value in want["params"].items():
        assert torch.allclose(got["params"][name], value, rtol=0, atol=1e-6), name


def _refusal_of_mpich(said: str, version: str) -> None:
    assert "an elastic job cannot run on MPI" in said
    assert ("needs Open MPI >= 5 built with its fault-tolerance extension (`ompi_info` says "
            "\"FT MPI support: yes\"; ranks started with `mpiexec --with-ft ulfm`)") in said
    assert "Use --backend gloo (or nccl) for an elastic job" in said
    assert f"this MPICH {version} (" in said
    assert "a lost rank is never reported to the others" in said
    assert "MPIR_CVAR_ENABLE_FT=1 aborts MPI_Init" in said


def test_an_elastic_mpi_job_that_would_grow_is_refused_naming_why(tmp_path):
    """--max-np above -np: an MPI world can only shrink (MPICH: cannot even do that)."""
    done = _tandem_run("-np", "2", "--min-np", "1", "--max-np", "3", TRAIN,
                       str(tmp_path / "out.pt"))
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    mpi, version = _version_of_mpiexec()
    if mpi == "MPICH":
        _refusal_of_mpich(said, version)
    else:
        assert ("--max-np 3 is above -np 2: an MPI job cannot grow back, its world can only "
                "shrink when ranks fail (no rank can join an MPI world once mpiexec started "
                "it). Give --max-np 2 (or leave it out) to go on down to --min-np, or use "
                "--backend gloo for a job that grows again") in said
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.parametrize("option", ["--max-restarts", "--host-discovery-script"])
def test_what_an_elastic_mpi_job_cannot_do_is_refused_naming_why(tmp_path, option):
    """Restarts (an elastic job goes on instead) and a discovery script (it offers slots to
    grow into) are refused before anything starts."""
    if option == "--max-restarts":
        extra, why = ("--max-restarts", "1"), ("an elastic job (--min-np) replaces "
                                                "--max-restarts: it goes on without a failed "
                                                "rank instead of restarting them all")
    else:
        script = tmp_path / "slots.sh"
        script.write_text("#!/bin/sh\necho localhost:3\n")
        script.chmod(0o755)
        extra, why = (option, str(script)), ("--host-discovery-script offers slots to grow the "
                                             "job, and an MPI world cannot grow: drop it")
    done = _tandem_run("-np", "3", "--min-np", "2", *extra, TRAIN, str(tmp_path / "out.pt"))
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    mpi, version = _version_of_mpiexec()
    if mpi == "MPICH":
        _refusal_of_mpich(said, version)
    else:
        assert why in said
    assert not (tmp_path / "out.pt").exists()


def test_an_elastic_mpi_job_is_refused_where_the_mpi_cannot_shrink_naming_what_it_needs(tmp_path):
    mpi, version = _version_of_mpiexec()
    if mpi != "MPICH":
        pytest.skip(f"{mpi} {version} can shrink a world: the job runs (test below)")
    done = _tandem_run("-np", "3", "--min-np", "2", TRAIN, str(tmp_path / "out.pt"))
    assert done.returncode == 2, done.stderr
    _refusal_of_mpich(" ".join(done.stderr.split()), version)
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(600)  # ~20 s idle; minutes on 2 cores at a load of 20 (3 ranks + torch)
def test_an_mpi_job_that_loses_a_rank_shrinks_and_ends_as_one_process(tmp_path, one_process):
    """`tandem run --backend mpi -np 3 --min-np 2` under Open MPI with ULFM: worker 2 exits in
    step 5; the survivors' next collective fails with MPI_ERR_PROC_FAILED, td.elastic.run
    shrinks the world (`runtime.shrink`), td.elastic.State rolls both back to commit 5, they
    train on as 2 ranks to the one-process result, and the job exits 0, naming the lost rank
    (mpiexec's own view of the lost rank is no failure of the job)."""
    out = tmp_path / "out.pt"
    job = _tandem_run("-np", "3", "--min-np", "2", TRAIN, str(out), "--die", "2:5",
                      timeout=420)
    said = job.stderr
    assert job.returncode == 0, said
    assert re.search(r"tandem run: elastic: world 3 -> 2: rank 2 \(pid \d+\) exit code 9; the "
                     r"other ranks shrink the MPI world and go on \(--min-np 2\)", said), said
    assert ("tandem elastic: world 3 -> 2 (the MPI world shrank without rank(s) 2: MPI "
            "allreduce(") in said, said
    # rank 0 met the loss itself, or rank 1's revoke of the world after it had met it
    assert re.search(r"failed: MPI_ERR_(PROC_FAILED|REVOKED)\b.*\); resumed from commit 5 "
                     r"\(step 5\)", said), said
    assert re.search(r"tandem run: elastic: the job ended on 2 of 3 ranks \(--min-np 2\), "
                     r"without rank 2 \(pid \d+\) exit code 9", said), said
    _same_as_one_process(torch.load(out), one_process)


@pytest.mark.timeout(600)  # the watchdog's 10 s, then as the test above
def test_a_stopped_rank_of_an_mpi_job_is_the_one_dropped_and_the_job_ends_as_one_process(
        tmp_path, one_process):
    """Worker 2 stops itself (SIGSTOP) in step 5: for MPI it has not failed, so the others wait
    until their watchdog's timeout (10 s), which names it silent; td.elastic.run reports it to
    the agent, which kills it, and the world shrinks without it (not without the two healthy
    ranks that timed out waiting)."""
    out = tmp_path / "out.pt"
    job = _tandem_run("-np", "3", "--min-np", "2", TRAIN, str(out), "--stop", "2:5",
                      timeout=420, rank_timeout="10")
    said = job.stderr
    assert job.returncode == 0, said
    assert re.search(r"tandem run: elastic: rank 2 \(pid \d+\) did not answer rank [01]'s "
                     r"watchdog after a 10 s wait: killing it \(SIGKILL\)", said), said
    assert re.search(r"tandem run: elastic: world 3 -> 2: rank 2 \(pid \d+\) stopped "
                     r"answering", said), said
    # rank 0 timed out itself, or met the other survivor's revoke first
    assert re.search(r"the MPI world shrank without rank\(s\) 2: (rank\(s\) 2 did not answer "
                     r"rank [01]'s watchdog and were stopped|.*MPI_ERR_REVOKED\b.*)\); resumed "
                     r"from commit 5", said), said
    _same_as_one_process(torch.load(out), one_process)


@pytest.mark.timeout(600)  # ~10-25 s idle; minutes on 2 cores under load
@pytest.mark.parametrize("sharding, np, kills, resumed", [
    ("--zero", 3, [(2, 5, "step")], [(5,)]),
    ("--fsdp", 4, [(1, 3, "backward"), (3, 7, "commit")], [(3,), (7, 8)])], ids=["zero", "fsdp"])
def test_sharded_state_with_a_peer_backup_is_restored_from_memory_when_the_mpi_world_shrinks(
        tmp_path, one_process_adam, sharding, np, kills, resumed):
    """td.elastic.State(..., peer_backup=True), no checkpointer, on `tandem run --backend mpi
    --min-np 2`: each killed worker's part of the sharded state lived only on it and, by the
    peer backup, on the next rank; the survivors shrink the world, reshard from their own parts
    and the backup of the lost worker's, and end as one process.

    zero: td.ZeroOptimizer(Adam) on 3 ranks, worker 2 SIGKILLs itself inside optimizer.step
    (after the reduce-scatter); its backup is on rank 0, around the ring. fsdp: a td.fully_shard
    model on 4 ranks shrinks twice: worker 1 dies in the backward, then worker 3 (rank 2 of the
    3 left, so a part names its worker, not its rank) inside the commit, after the backup
    exchange: the survivors hold that commit or, where one's exchange failed, the one before."""
    out = tmp_path / "out.pt"
    kill = ",".join(f"{worker}:{step}:{point}" for worker, step, point in kills)
    job = _tandem_run("-np", str(np), "--min-np", "2", KILL_POINTS, str(out), sharding,
                      "--kill", kill, timeout=420)
    said = job.stderr
    assert job.returncode == 0, said
    for lost, (worker, _, _) in enumerate(kills):
        assert re.search(rf"tandem run: elastic: world {np - lost} -> {np - lost - 1}: rank "
                         rf"{worker} \(pid \d+\) killed by SIGKILL", said), said
    commits = [int(c) for c in re.findall(r"the MPI world shrank without rank\(s\) \d: .*\); "
                                          r"resumed from commit (\d+) \(step \1\)", said)]
    assert len(commits) == len(kills), said
    assert all(c in allowed for c, allowed in zip(commits, resumed, strict=True)), said
    assert "checkpoint" not in said and "held only by the rank(s) that left" not in said, said
    got, want = torch.load(out), one_process_adam
    sizes = [np - sum(c <= step for c in commits) for step in range(12)]
    assert got["sizes"] == sizes and got["step"] == 12, (got["sizes"], said)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5)
