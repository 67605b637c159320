"""Multi-node jobs: one agent per node, an authenticated control plane, failures forwarded.

Two "nodes" are two agents on this machine over loopback; then two network namespaces joined
by a veth pair (needs root and `ip`; skipped with the reason otherwise), where the link is cut
in the middle of training. The `-H` path is run end to end with local hosts (a local agent
process instead of ssh); the ssh command itself is unit-tested here, and run for real against
an sshd per host in tests/test_cluster.py.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import kill_tree
from streams import Lines

from tandem.cli.command import build_parser, main
from tandem.launch import LaunchConfig, LaunchError, config_from_args
from tandem.launch.agents import control, multinode, ssh
from tandem.launch.agents.hosts import Host
from tandem.launch.config import parse_address

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "fault_train.py")
PYTHON = sys.executable
STOP_BOUND_S = 20.0  # lost-peer detection is 5 s here; two shared cores add the rest


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agent(node: int, port: int, *args: str, secret: str = "s3cret", prefix=(), env=None,
           master: str = "127.0.0.1") -> subprocess.Popen:
    command = [*prefix, PYTHON, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(node),
               "--master", f"{master}:{port}", "--secret", secret, "-np", "1", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env or _env(TANDEM_TIMEOUT="5"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(*agents: subprocess.Popen, timeout: float = 120) -> list[tuple[int, str, str]]:
    results = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=timeout)
        finally:
            if agent.poll() is None:
                agent.kill()
        results.append((agent.returncode, out, err))
    return results


# --- without jobs ---------------------------------------------------------------------------

def _config(*argv: str) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(["run", *argv]), {})


def test_multinode_options_are_checked_before_anything_starts(capsys):
    config = _config("--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.1:29500",
                     "-np", "4", "t.py")
    assert (config.nnodes, config.node_rank, config.master) == (2, 1, ("10.0.0.1", 29500))
    for argv, message in [
        (["--nnodes", "2", "--node-rank", "2", "--master", "h:1"],
         "--node-rank 2 is out of range for --nnodes 2: give 0..1"),
        (["--nnodes", "2"], "--nnodes 2 needs --master ADDR:PORT"),
        (["--nnodes", "2", "--master", "h:1", "-H", "a:1,b:1"], "received both --nnodes and -H"),
        (["--nnodes", "2", "--master", "h:99999"], "the port must be between 1 and 65535"),
        (["-H", "no-such-host.invalid:1,localhost:1"],
         "cannot resolve the host 'no-such-host.invalid'"),
    ]:
        assert main(["run", "-np", "1", *argv, str(ROOT / "tests" / "scripts" / "launch_touch.py"),
                     "/nonexistent/marker"]) == 2
        assert message in capsys.readouterr().err
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="not ADDR:PORT"):
        parse_address("nohost")


def test_ranks_fill_hosts_in_order_and_remote_agents_get_ssh_commands():
    hosts = (Host("a", 2), Host("b", 2), Host("c", 2))
    assert ssh.place(3, hosts) == [(Host("a", 2), 2), (Host("b", 2), 1)]
    config = LaunchConfig(np=4, program="train.py", args=("--lr", "0.1 x"), timeout=30.0,
                          backend="gloo")
    args = ssh.agent_arguments(config, node_rank=1, nnodes=2, master=("10.0.0.1", 29500),
                               nproc=2, python="/venv/bin/python")
    assert args == ["/venv/bin/python", "-m", "tandem", "run", "--nnodes", "2", "--node-rank",
                    "1", "--master", "10.0.0.1:29500", "--secret", "-", "-np", "2",
                    "--backend", "gloo", "--timeout", "30", "train.py", "--lr", "0.1 x"]
    command = ssh.agent_command(Host("node2"), args, "/home/me/my job", environ={})
    assert command[:6] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "node2"]
    assert command[6] == ("cd '/home/me/my job' && exec /venv/bin/python -m tandem run "
                          "--nnodes 2 --node-rank 1 --master 10.0.0.1:29500 --secret - -np 2 "
                          "--backend gloo --timeout 30 train.py --lr '0.1 x'")
    assert "s3cret" not in " ".join(command)  # the secret goes over stdin, never argv
    assert ssh.agent_command(Host("localhost"), args, "/x") == args
    # An ssh session starts with a fresh environment: which tandem runs, the thread limits and
    # the ranks' TANDEM_ settings go along; the secret and tandem run's own options do not.
    environ = {"PYTHONPATH": "/src dir", "TANDEM_DEBUG": "1", "OMP_NUM_THREADS": "2",
               "TANDEM_SECRET": "s3cret", "TANDEM_HOSTS": "a:1,b:1", "TANDEM_NP": "4",
               "HOME": "/home/me", "LD_PRELOAD": "x.so"}
    command = ssh.agent_command(Host("node2"), args, "/w", environ=environ)
    assert command[6].startswith("cd /w && exec env OMP_NUM_THREADS=2 'PYTHONPATH=/src dir' "
                                 "TANDEM_DEBUG=1 /venv/bin/python -m tandem run "), command[6]
    assert "s3cret" not in command[6] and "a:1,b:1" not in command[6] and "HOME" not in command[6]


def test_bad_host_lists_and_masters_are_named_before_anything_starts(capsys, tmp_path):
    script = str(ROOT / "tests" / "scripts" / "launch_touch.py")
    # a host listed twice: two agents on one machine would share its local ranks and GPUs
    assert main(["run", "-np", "2", "-H", "a:1,b:1,A:2", script, "/nonexistent/marker"]) == 2
    assert ("-H a:1,b:1,A:2: host 'A' is listed twice (a:1 and A:2): list it once with all its "
            "slots (A:3)") in capsys.readouterr().err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb\na:2\n")
    assert main(["run", "--hostfile", str(hostfile), script, "/nonexistent/marker"]) == 2
    assert f"the hostfile {str(hostfile)!r}: host 'a' is listed twice" in capsys.readouterr().err
    # slots beyond -np: horovodrun's rule (fill in order) stands, and the idle hosts are named
    assert ssh.unused(2, (Host("a", 2), Host("b", 2), Host("c", 1))) == (
        "tandem run: -np 2 fills the first host(s); b:2, c:1 get(s) no rank and no agent (the "
        "hosts offer 5 slots: give -np 5 to use them all)")
    assert ssh.unused(3, (Host("a", 2), Host("b", 2))) is None
    assert ssh.unused(2, (Host("a", 2), Host("c", 2)), standby=True) == (  # --max-restarts
        "tandem run: -np 2 fills the first host(s); c:2 stand(s) by, to take the place of a "
        "host that is lost (--max-restarts)")
    # this machine by address (asked by binding, nothing sent), never by a DNS lookup
    assert Host("127.0.0.1").is_local and Host("127.0.1.1").is_local
    for address in control.local_addresses().values():
        assert Host(address).is_local, address
    assert not Host("198.51.100.254").is_local  # TEST-NET-2: no machine has it
    # node 0 listens at --master: an address it does not hold is refused with its addresses
    with pytest.raises(LaunchError) as raised:
        multinode.listen_address(("198.51.100.254", 29500), 2)
    assert (f"--master 198.51.100.254:29500: this machine ({socket.gethostname()}) has no "
            "address 198.51.100.254; node 0 hosts the rendezvous there") in str(raised.value)
    assert "127.0.0.1 (lo)" in str(raised.value)
    assert multinode.listen_address(("127.0.0.1", 29500), 2) == "127.0.0.1"
    assert multinode.listen_address(("localhost", 29500), 2) == "localhost"


def _handshake(server_secret: str, client_secret: str) -> list:
    left, right = socket.socketpair()
    from multiprocessing.connection import Connection

    outcomes = [None, None]

    def side(index, sock, secret, server):
        try:
            control.authenticate(Connection(sock.detach()), secret, server=server, timeout=5)
            outcomes[index] = "ok"
        except control.AuthenticationFailed as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=side, args=(0, left, server_secret, True)),
               threading.Thread(target=side, args=(1, right, client_secret, False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return outcomes


def test_agents_prove_the_secret_both_ways():
    assert _handshake("same", "same") == ["ok", "ok"]
    assert _handshake("one", "other") == ["the peer does not know this job's secret"] * 2
    assert control.interface_of("127.0.0.1") == "lo"


# --- two agents on loopback ----------------------------------------------------------------

@pytest.mark.timeout(150)
def test_two_agents_train_together_and_a_failure_on_one_stops_both():
    port = _free_port()
    args = (TRAIN, "kill", "--steps", "20", "--at", "4", "--rank", "1")
    node0 = _agent(0, port, *args)
    node1 = _agent(1, port, *args)
    (code0, out0, err0), (code1, out1, err1) = _finish(node0, node1)
    assert "[0] step 3 loss" in out0  # the two nodes trained together up to the kill
    assert "[1] failing at" in out1
    for code, err in ((code0, err0), (code1, err1)):
        assert code == 137, err
        assert ("tandem run: job failed: rank 1 (pid" in err and "node 1 on" in err
                and "killed by SIGKILL" in err), err
        assert "[1] failing at" in err  # both summaries carry rank 1's last lines


@pytest.mark.timeout(180)
def test_a_lost_node_with_restarts_left_is_replaced_by_an_agent_started_by_hand(tmp_path):
    """--nnodes with --max-restarts: node 1's machine vanishes mid-training; node 0 waits for an
    agent with --node-rank 1, one started with another -np is refused, the one started right
    joins, and the job resumes from its checkpoint with one uninterrupted process's result."""
    train = str(ROOT / "tests" / "scripts" / "cluster_train.py")
    steps = ("--steps", "40")
    reference = tmp_path / "reference.pt"
    done = subprocess.run([PYTHON, train, *steps, "--out", str(reference)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "params.pt"
    port = _free_port()
    args = ("--max-restarts", "1", train, *steps, "--step-seconds", "0.05", "--checkpoint",
            str(tmp_path / "checkpoints"), "--out", str(out))
    env = _env(TANDEM_TIMEOUT="30")
    node0 = _agent(0, port, *args, env=env)
    node1 = _agent(1, port, *args, env=env)
    lines, errors = Lines(node0.stdout), Lines(node0.stderr)
    agents = [node0, node1]
    try:
        assert lines.wait_for("[0] step 3"), errors.text()
        kill_tree(node1.pid)
        assert errors.wait_for("for an agent to take node 1's place"), errors.text()
        wrong = _agent(1, port, "-np", "2", *args, env=env)  # the later -np wins: 2 ranks
        agents.append(wrong)
        (code, _, wrong_err), = _finish(wrong)
        assert code == 2 and "it would run 2 rank(s) in place of node 1, which ran 1: give it " \
                              "-np 1" in wrong_err, wrong_err
        replacement = _agent(1, port, *args, env=env)
        agents.append(replacement)
        (code1, _, err1), = _finish(replacement)
        assert errors.wait_for(None), errors.text()
        node0.wait(30)
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
                agent.wait(10)
    stderr = errors.text()
    assert node0.returncode == 0 and code1 == 0, stderr + err1
    assert "tandem run: job failed (attempt 1 of 2): node 1 (" in stderr, stderr
    assert "tandem run: the job succeeded after 1 restart(s)" in stderr, stderr
    got, expected = torch.load(out), torch.load(reference)
    assert torch.allclose(got, expected, rtol=1e-12, atol=0), (got - expected).abs().max()


@pytest.mark.timeout(120)
def test_a_wrong_secret_is_refused_on_both_sides():
    port = _free_port()
    env = _env(TANDEM_TIMEOUT="4")
    node0 = _agent(0, port, TRAIN, "ok", env=env)
    node1 = _agent(1, port, TRAIN, "ok", secret="wrong", env=env)
    (code0, _, err0), (code1, _, err1) = _finish(node0, node1)
    assert code1 == 2 and "Give every node the same --secret" in err1, err1
    assert "does not know this job's secret (the secrets differ)" in err1
    assert code0 == 1 and "rejected an agent from 127.0.0.1" in err0, err0
    assert "did not join within 4 s" in err0
    assert "[0]" not in err0  # no rank was started


@pytest.mark.timeout(120)
def test_an_unreachable_master_and_a_taken_port_are_clear_errors():
    port = _free_port()
    started = time.monotonic()
    lonely = _agent(1, port, TRAIN, "ok", env=_env(TANDEM_TIMEOUT="3"))
    (code, _, err), = _finish(lonely)
    assert code == 1 and f"node 0 is unreachable: cannot reach the rendezvous store at " \
                         f"127.0.0.1:{port}" in err, err
    assert time.monotonic() - started < 60
    # two jobs on one machine: the second node 0 cannot take the first one's port
    first = _agent(0, port, TRAIN, "ok", env=_env(TANDEM_TIMEOUT="20"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)  # the first agent is starting (a test may poll)
        second = _agent(0, port, TRAIN, "ok", env=_env(TANDEM_TIMEOUT="20"))
        (code, _, err), = _finish(second)
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err
    finally:
        first.kill()
        first.communicate()


AGENT_PROBE = """
import os, torch, tandem as td
td.init()
total = td.allreduce(torch.tensor([1.0]), op="sum").item()
env = os.environ
print(f"probe rank={td.rank()} size={td.size()} local_rank={env['TANDEM_LOCAL_RANK']} "
      f"local_size={env['TANDEM_LOCAL_SIZE']} agent={os.getppid()} total={total:g}", flush=True)
td.shutdown()
"""


@pytest.mark.timeout(150)
def test_hosts_get_one_agent_each(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(AGENT_PROBE)
    script = (
        "import sys; from tandem.launch import LaunchConfig; from tandem.launch.agents import multinode; "
        "from tandem.launch.agents.hosts import Host; "
        f"sys.exit(multinode.launch_hosts(LaunchConfig(np=2, program={str(probe)!r}, "
        "hosts=(Host('localhost', 1), Host('127.0.0.1', 1)))))"
    )
    coordinator = subprocess.Popen([PYTHON, "-c", script], cwd=ROOT, env=_env(TANDEM_TIMEOUT="20"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (code, out, err), = _finish(coordinator)
    assert code == 0, err
    lines = dict(re.findall(r"^\[(\d)\] probe (.*)$", out, re.MULTILINE))
    assert sorted(lines) == ["0", "1"], out
    probes = [dict(field.split("=") for field in lines[r].split()) for r in ("0", "1")]
    # One job of two ranks, each the only rank on its "node" ...
    assert [(p["rank"], p["size"], p["total"]) for p in probes] == [("0", "2", "2"), ("1", "2", "2")]
    assert [(p["local_rank"], p["local_size"]) for p in probes] == [("0", "1"), ("0", "1")]
    # ... started by two agents: rank 0 by the coordinator (this host is the first), rank 1 by
    # the agent it started for the second host. One agent running both would give one parent.
    assert probes[0]["agent"] == str(coordinator.pid), (probes, coordinator.pid)
    assert probes[1]["agent"] != str(coordinator.pid), probes


# --- two network namespaces joined by a veth pair ------------------------------------------

def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"td{os.getpid() % 100000}"
    subnet = f"10.231.{os.getpid() % 200 + 20}"
    names = (f"{tag}a", f"{tag}b")
    links = (f"{tag}va", f"{tag}vb")
    created = []
    try:
        for name in names:
            made = _ip("netns", "add", name)
            if made.returncode:
                pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
            created.append(name)
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for name, link, last in zip(names, links, (1, 2), strict=True):
            steps += [("link", "set", link, "netns", name),
                      ("-n", name, "addr", "add", f"{subnet}.{last}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                pytest.skip(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
        for name in names:  # Gloo would pick the veth's IPv6 link-local address otherwise
            subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw",
                            "net.ipv6.conf.all.disable_ipv6=1"], timeout=20, check=False)
        yield names, links, (f"{subnet}.1", f"{subnet}.2")
    finally:
        for name in created:
            _ip("netns", "del", name)


@pytest.mark.timeout(180)
def test_a_cut_link_stops_both_nodes_with_the_peer_unreachable(two_namespaces):
    names, links, (master, _) = two_namespaces
    port = _free_port()
    args = (TRAIN, "ok", "--steps", "400", "--step-seconds", "0.2")
    nodes = [_agent(node, port, *args, prefix=("ip", "netns", "exec", names[node]),
                    master=master) for node in (0, 1)]
    try:
        for line in nodes[0].stdout:  # train across the link for a few steps
            if line.startswith("[0] step 5 "):
                break
        else:
            pytest.fail(f"no training across namespaces: {nodes[0].stderr.read()[-2000:]}")
        cut = time.monotonic()
        assert _ip("-n", names[0], "link", "set", links[0], "down").returncode == 0
        results = _finish(*nodes)
        elapsed = time.monotonic() - cut
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    (code0, _, err0), (code1, _, err1) = results
    print(f"both nodes stopped {elapsed:.1f} s after the cut")
    assert code0 == 1 and "node 1 (" in err0 and "is unreachable: no word from it" in err0, err0
    assert code1 == 1 and f"node 0 ({master}:{port}) is unreachable" in err1, err1
    assert elapsed < STOP_BOUND_S
