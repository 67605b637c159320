"""Multi-host jobs for real: hosts are network namespaces with an sshd each, on one machine.

A module-wide cluster of two hosts, h1 and h2 (scripts/netns-cluster.sh through
tests/netns_cluster.py: each host its own address, hostname, /etc/hosts and sshd), runs every
way tandem starts a job across machines, each checked against one process: `tandem run -H`
over ssh, one `tandem run --nnodes` agent per host, a SLURM-style job whose first node-list
host is the rendezvous, and MPICH's Hydra over ssh. Then what goes wrong between machines:
a link cut mid-step, a host whose processes die, a slow and lossy link that then goes silent,
an agent with the wrong secret, and bad input (an unreachable host, a master address no host
has). Skipped with the reason where namespaces or sshd cannot be had (not root, no
openssh-server). Every test ends with nothing left running on the hosts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from netns_cluster import ROOT, Cluster, Unavailable, environment
from streams import Lines

PYTHON = sys.executable
TRAIN = str(ROOT / "tests" / "scripts" / "cluster_train.py")
JOB_S = 90  # a job's deadline on two shared cores (a few seconds when the machine is idle)
TIMEOUT = "5"  # the job's timeout: an agent silent this long is lost, a collective gives up
STOP_BOUND_S = 25.0  # fault to exit: 5 s to notice, 2 + 2 s to stop ranks, the rest slack
RTOL = 1e-12  # float64 sums in another order: a few units in the last place, far below this


@pytest.fixture(scope="module")
def cluster():
    try:
        built = Cluster.up(3)  # h3 has no ranks but when it takes a lost host's place
    except Unavailable as reason:
        pytest.skip(f"no network-namespace cluster here: {reason}")
    with built:
        yield built


@pytest.fixture
def hosts(cluster):
    """The cluster, restored after each test: links up, no netem, nothing left running."""
    yield cluster
    for host in cluster.hosts:
        cluster.link(host, up=True)
        cluster.shape(host)
        cluster.kill_processes(host)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters one process ends with (no launcher: a world of one)."""
    out = tmp_path_factory.mktemp("reference") / "params.pt"
    done = subprocess.run([PYTHON, TRAIN, "--out", str(out)], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=JOB_S)
    assert done.returncode == 0, done.stderr
    return torch.load(out)


def _finish(*jobs: subprocess.Popen, timeout: float = JOB_S) -> list[tuple[int, str, str]]:
    results = []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            out, err = job.communicate()
            pytest.fail(f"a job did not end within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
        results.append((job.returncode, out, err))
    return results


def _where(out_file: Path) -> dict[int, dict]:
    """Each rank's `where` record (see cluster_train.py), by rank: read from the files the ranks
    wrote beside `out_file`, since a launcher may join two ranks' output lines into one."""
    found = [json.loads(path.read_text())
             for path in out_file.parent.glob(f"{out_file.name}.where.*.json")]
    return {entry["rank"]: entry for entry in found}


def _equal_to_one_process(out_file: Path, reference: torch.Tensor) -> None:
    params = torch.load(out_file)
    assert torch.allclose(params, reference, rtol=RTOL, atol=0), (params - reference).abs().max()


# --- every way to start a job across hosts, against one process ------------------------------

@pytest.mark.timeout(150)
def test_hosts_over_ssh_train_as_one_process_on_their_own_addresses(hosts, reference, tmp_path):
    out = tmp_path / "params.pt"
    job = hosts.popen("h1", PYTHON, "-m", "tandem", "run", "-np", "4", "-H", "h1:2,h2:2",
                      TRAIN, "--out", str(out))
    (code, stdout, stderr), = _finish(job)
    assert code == 0, stderr
    _equal_to_one_process(out, reference)
    where = _where(out)
    assert sorted(where) == [0, 1, 2, 3], stdout
    assert [where[r]["host"] for r in range(4)] == ["h1", "h1", "h2", "h2"]
    for rank, entry in where.items():
        # h2's agent came over ssh, yet imports this checkout (PYTHONPATH went along)
        assert entry["tandem"] == str(ROOT / "src" / "tandem" / "__init__.py"), entry
        assert entry["backend"] == "gloo" and entry["size"] == 4
        # every socket of every rank, listening or connected, is on its host's address
        mine = hosts.address(entry["host"])
        assert entry["sockets"], entry
        for sock in entry["sockets"]:
            assert sock["local"].split(":")[0] == mine, (rank, sock)
            if sock["state"] == "01":  # established: to a rank or the store, on h1 or h2
                assert sock["remote"].split(":")[0] in (hosts.address("h1"),
                                                         hosts.address("h2")), (rank, sock)


def _agents(hosts: Cluster, port: int, *args: str, secrets=("s3cret", "s3cret"),
            master: str = "h1") -> list[subprocess.Popen]:
    return [hosts.popen(f"h{node + 1}", PYTHON, "-m", "tandem", "run", "--nnodes", "2",
                        "--node-rank", str(node), "--master", f"{master}:{port}", "--secret",
                        secrets[node], "-np", "1", *args,
                        env=environment(TANDEM_TIMEOUT=TIMEOUT))
            for node in (0, 1)]


@pytest.mark.timeout(150)
def test_one_agent_per_host_trains_as_one_process(hosts, reference, tmp_path):
    out = tmp_path / "params.pt"
    (code0, out0, err0), (code1, out1, err1) = _finish(*_agents(hosts, 29400, TRAIN, "--out",
                                                                 str(out)))
    assert code0 == 0 and code1 == 0, err0 + err1
    _equal_to_one_process(out, reference)
    where = _where(out)
    assert [where[r]["host"] for r in (0, 1)] == ["h1", "h2"]
    for entry in where.values():
        mine = hosts.address(entry["host"])
        assert all(sock["local"].split(":")[0] == mine for sock in entry["sockets"]), entry


@pytest.mark.timeout(150)
def test_a_slurm_style_job_meets_at_its_first_host(hosts, reference, tmp_path):
    """What `srun` starts, one task per host: no tandem agent anywhere; rank 0 hosts the store
    on the first host of the node list, the others find it by that name."""
    out = tmp_path / "params.pt"
    jobs = []
    for rank in (0, 1):
        env = environment(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID="0",
                          SLURM_JOB_NODELIST="h[1-2]", SLURM_TASKS_PER_NODE="1(x2)",
                          SLURM_JOB_ID="4242", TANDEM_TIMEOUT="20", TANDEM_BACKEND="gloo")
        jobs.append(hosts.popen(f"h{rank + 1}", PYTHON, TRAIN, "--out", str(out), env=env))
    (code0, out0, err0), (code1, out1, err1) = _finish(*jobs)
    assert code0 == 0 and code1 == 0, err0 + err1
    _equal_to_one_process(out, reference)
    where = _where(out)
    assert [where[r]["host"] for r in (0, 1)] == ["h1", "h2"]
    store = f"{hosts.address('h1')}:{20000 + 4242}"  # SLURM's port: 20000 + job id % 20000
    assert {"local": store, "remote": "0.0.0.0:0", "state": "0A"} in where[0]["sockets"], where
    for entry in where.values():
        mine = hosts.address(entry["host"])
        assert all(sock["local"].split(":")[0] == mine for sock in entry["sockets"]), entry


@pytest.mark.timeout(150)
def test_mpich_hydra_runs_ranks_on_both_hosts_over_ssh(hosts, reference, tmp_path):
    from tandem.launch.config import LaunchError
    from tandem.launch.mpi.mpiexec import find_mpiexec, is_open_mpi

    try:
        mpiexec = find_mpiexec()
    except LaunchError as error:
        pytest.skip(str(error))
    if is_open_mpi(mpiexec):
        pytest.skip("Open MPI's mpirun: this test runs MPICH's Hydra (-launcher ssh)")
    out = tmp_path / "params.pt"
    job = hosts.popen("h1", mpiexec, "-launcher", "ssh", "-hosts", "h1,h2", "-n", "2",
                      PYTHON, TRAIN, "--out", str(out),
                      env=environment(TANDEM_TIMEOUT="20"))
    (code, stdout, stderr), = _finish(job)
    assert code == 0, stderr
    _equal_to_one_process(out, reference)
    where = _where(out)
    assert [(where[r]["host"], where[r]["backend"]) for r in (0, 1)] == [("h1", "mpi"),
                                                                        ("h2", "mpi")]


def test_doctor_names_the_interface_that_reaches_each_host(hosts):
    # a second network on h1 that leads nowhere else (a veth pair within h1, the first
    # interface after lo): the route to h2 is still eth0
    hosts.ip("h1", "link", "add", "mgmt0", "type", "veth", "peer", "name", "mgmt1")
    try:
        hosts.ip("h1", "addr", "add", "10.213.250.1/24", "dev", "mgmt0")
        hosts.ip("h1", "link", "set", "mgmt0", "up")
        hosts.ip("h1", "link", "set", "mgmt1", "up")
        done = hosts.run("h1", PYTHON, "-m", "tandem", "doctor", "--hosts", "h2,h1,nohost",
                         timeout=JOB_S)
    finally:
        hosts.ip("h1", "link", "del", "mgmt0")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("route")]
    a1, a2 = hosts.address("h1"), hosts.address("h2")
    assert lines[:2] == [f"route      h2 ({a2}): via eth0 from {a1}",
                         f"route      h1 ({a1}): this machine (eth0)"], done.stdout
    assert lines[2].startswith("route      nohost: cannot resolve it (") and lines[2].endswith(
        ") -- fix: check the name, or give its address"), done.stdout


@pytest.mark.timeout(150)
def test_a_master_name_that_is_loopback_on_node_0_still_joins_the_hosts(reference, tmp_path):
    """Debian's installer maps a machine's own name to 127.0.1.1: on h1, `h1` is loopback, on
    h2 it is h1's address. Node 0 listens where h2 reaches it, and its ranks' Gloo uses the
    interface h2 came in on, not loopback (the job used to wait for a store h2 could not
    reach)."""
    try:
        debian = Cluster.up(2, debian_hosts=True)
    except Unavailable as reason:
        pytest.skip(f"no network-namespace cluster here: {reason}")
    with debian:
        out = tmp_path / "params.pt"
        (code0, out0, err0), (code1, out1, err1) = _finish(*_agents(debian, 29403, TRAIN,
                                                                     "--out", str(out)))
        doctor = debian.run("h1", PYTHON, "-m", "tandem", "doctor", "--hosts", "h1",
                            timeout=JOB_S)
    assert code0 == 0 and code1 == 0, err0 + err1
    _equal_to_one_process(out, reference)
    where = _where(out)
    a1, a2 = debian.address("h1"), debian.address("h2")
    gloo = [sock for sock in where[0]["sockets"] if sock["remote"].startswith(a2 + ":")]
    assert gloo and all(sock["local"].startswith(a1 + ":") for sock in gloo), where[0]
    assert "route      h1 (127.0.1.1): this machine (lo) -- fix: other hosts cannot reach " \
           "this machine at a loopback address" in doctor.stdout, doctor.stdout


# --- what goes wrong between machines --------------------------------------------------------

def _long_job(hosts: Cluster) -> tuple[subprocess.Popen, Lines, Lines]:
    job = hosts.popen("h1", PYTHON, "-m", "tandem", "run", "-np", "2", "-H", "h1:1,h2:1",
                      TRAIN, "--steps", "400", "--step-seconds", "0.1",
                      env=environment(TANDEM_TIMEOUT=TIMEOUT))
    return job, Lines(job.stdout), Lines(job.stderr)


def _ends_naming_h2(hosts: Cluster, fault) -> str:
    """Start a long job over h1 and h2, wait for training across them, apply `fault` (given
    the job's stdout), and return the job's stderr once it ended (within STOP_BOUND_S), having
    said that node 1, h2 (rank 1), went silent."""
    job, out, err = _long_job(hosts)
    try:
        if not out.wait_for("[0] step 3"):
            err.wait_for(None, 5)
            pytest.fail(f"no training across the hosts:\n{out.text()[-2000:]}"
                        f"{err.text()[-3000:]}")
        fault(out)
        faulted = time.monotonic()
        ended = err.wait_for(None, STOP_BOUND_S + 30)
        elapsed = time.monotonic() - faulted
        assert ended, f"the job did not end within {STOP_BOUND_S + 30} s of the fault"
        job.wait(10)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    print(f"the job ended {elapsed:.1f} s after the fault")
    stderr = err.text()
    assert job.returncode == 1, stderr
    assert "tandem run: job failed: node 1 (h2, rank 1) is unreachable" in stderr, stderr
    assert elapsed < STOP_BOUND_S, stderr
    return stderr


@pytest.mark.timeout(150)
def test_a_cut_link_ends_the_job_naming_the_silent_host(hosts):
    err = _ends_naming_h2(hosts, lambda _: hosts.link("h2", up=False))
    assert "(the network between the nodes is cut" in err
    # h2, cut off, ends its side too: its agent hears nothing from node 0 and stops its rank
    deadline = time.monotonic() + STOP_BOUND_S
    while (left := hosts.job_processes("h2")) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling another machine's process table: nothing to wait on
    assert not left, left


@pytest.mark.timeout(150)
def test_a_host_whose_processes_die_is_named(hosts):
    killed = []
    err = _ends_naming_h2(hosts, lambda _: killed.extend(hosts.kill_processes("h2")))
    assert killed  # the agent, its ssh session and the rank
    assert "its connection closed (its agent exited or was killed)" in err


def _cut_h2_mid_training(hosts: Cluster, host_list: str, *args: str) -> tuple[int, str]:
    """`tandem run -np 2 -H host_list --max-restarts 1 cluster_train.py args...` from h1, h2's
    link cut once training runs across the hosts; the job's exit code and stderr."""
    job = hosts.popen("h1", PYTHON, "-m", "tandem", "run", "-np", "2", "-H", host_list,
                      "--max-restarts", "1", TRAIN, "--step-seconds", "0.1", *args,
                      env=environment(TANDEM_TIMEOUT=TIMEOUT))
    lines, errors = Lines(job.stdout), Lines(job.stderr)
    try:
        assert lines.wait_for("[0] step 3"), errors.text()[-3000:]
        hosts.link("h2", up=False)
        assert errors.wait_for(None, JOB_S), "the job did not end"
        job.wait(10)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    return job.returncode, errors.text()


@pytest.mark.timeout(200)
def test_a_lost_host_with_restarts_left_is_replaced_and_the_job_ends_as_one_process(hosts,
                                                                                    tmp_path):
    """`--max-restarts` across hosts: h2's link is cut mid-training; node 1 goes on at h3, the
    host of -H without ranks, and the job resumes from its checkpoint with the result of one
    uninterrupted process."""
    steps = ("--steps", "40")
    reference = tmp_path / "reference.pt"
    done = subprocess.run([PYTHON, TRAIN, *steps, "--out", str(reference)], cwd=ROOT,
                          env=environment(), capture_output=True, text=True, timeout=JOB_S)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "params.pt"
    code, stderr = _cut_h2_mid_training(hosts, "h1:1,h2:1,h3:1", *steps, "--checkpoint",
                                        str(tmp_path / "checkpoints"), "--out", str(out))
    assert code == 0, stderr
    assert "tandem run: job failed (attempt 1 of 2): node 1 (h2, rank 1) is unreachable" in stderr
    assert "tandem run: node 1 goes on at h3: starting its agent there" in stderr
    assert "h3:1 stand(s) by, to take the place of a host that is lost" in stderr
    # h3's agent prints to this terminal (over ssh): the notes are not sent to it, to be twice
    assert stderr.count("tandem run: restarting the whole job: attempt 2 of 2") == 1, stderr
    assert "tandem run: the job succeeded after 1 restart(s)" in stderr
    _equal_to_one_process(out, torch.load(reference))
    where = _where(out)  # written by the attempt that finished
    assert [where[r]["host"] for r in (0, 1)] == ["h1", "h3"], where


def test_a_lost_host_without_a_spare_ends_the_job_saying_so(hosts):
    """The same loss with restarts left but no host to take h2's place: named, not waited on."""
    code, stderr = _cut_h2_mid_training(hosts, "h1:1,h2:1", "--steps", "400")
    assert code == 1, stderr
    assert "no host of -H/--hostfile is left to take its place (one without ranks and with " \
           "1 slot(s) or more)" in stderr, stderr


@pytest.mark.timeout(150)
def test_a_slow_lossy_link_trains_on_and_a_silent_one_ends_the_job(hosts):
    def slow_then_silent(job_out: Lines) -> None:
        # mid-collective, what h2 sends turns 100 ms late and 5% of it is lost: the job goes
        # on, slower, and no agent is taken for lost; then everything h2 sends is lost
        try:
            hosts.shape("h2", delay_ms=100.0, loss_pct=5.0)
        except Unavailable as reason:
            pytest.skip(str(reason))
        assert job_out.wait_for("[0] step 6"), job_out.text()[-2000:]
        hosts.shape("h2", loss_pct=100.0)

    err = _ends_naming_h2(hosts, slow_then_silent)
    assert re.search(r"no word from it for [0-9.]+ s", err), err


@pytest.mark.timeout(120)
def test_a_wrong_secret_from_another_host_is_refused(hosts):
    node0, node1 = _agents(hosts, 29401, TRAIN, secrets=("s3cret", "wrong"))
    (code0, _, err0), (code1, _, err1) = _finish(node0, node1)
    assert code1 == 2 and "Give every node the same --secret" in err1, err1
    assert f"rejected an agent from {hosts.address('h2')}" in err0, err0
    assert code0 == 1 and "did not join within 5 s" in err0
    assert "where" not in err0 + err1  # no rank started


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_an_unreachable_host_is_named_with_its_address_and_the_ssh_error(hosts):
    nobody = hosts.address("h2").rsplit(".", 1)[0] + ".99"  # in the cluster, held by no host
    done = hosts.run("h1", PYTHON, "-m", "tandem", "run", "-np", "2", "-H",
                     f"h1:1,{nobody}:1", TRAIN, timeout=JOB_S)
    assert done.returncode == 2, done.stderr
    assert f"cannot reach {nobody} over ssh:\n  {nobody} ({nobody}): ssh exited with code 255: " \
           f"ssh: connect to host {nobody} port 22: No route to host" in done.stderr, done.stderr
    assert "where" not in done.stdout  # nothing started


@pytest.mark.timeout(120)
def test_a_master_address_no_host_has_is_refused(hosts):
    nobody = hosts.address("h2").rsplit(".", 1)[0] + ".77"
    a1 = hosts.address("h1")
    for argv in (["--nnodes", "2", "--node-rank", "0", "-np", "1"], ["-H", "h1:1,h2:1", "-np", "2"]):
        done = hosts.run("h1", PYTHON, "-m", "tandem", "run", *argv, "--master",
                         f"{nobody}:29402", TRAIN, timeout=JOB_S)
        assert done.returncode == 2, done.stderr
        assert (f"--master {nobody}:29402: this machine (h1) has no address {nobody}; node 0 "
                f"hosts the rendezvous there, so --master must name one of node 0's addresses "
                f"(here: 127.0.0.1 (lo), {a1} (eth0))") in done.stderr, done.stderr
        assert "this job's secret is" not in done.stderr  # refused before one is made
