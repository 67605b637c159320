"""A cluster of hosts on this machine, for tests: scripts/netns-cluster.sh driven from Python.

    with Cluster.up(2) as cluster:                     # hosts h1, h2: namespaces, sshd each
        job = cluster.popen("h1", PYTHON, "-m", "tandem", "run", "-H", "h1:2,h2:2", ...)
        cluster.link("h2", up=False)                   # the cable is pulled
        cluster.shape("h2", delay_ms=100, loss_pct=5)  # a slow, lossy link (what h2 sends)
        cluster.kill_processes("h2")                   # everything on h2 but its sshd dies

`Cluster.up` raises `Unavailable` with the reason where the cluster cannot be built (not root,
no iproute2, no sshd: the caller skips with it). Each cluster has a name prefix of its own
(from this process's id and a counter), so concurrent test runs never share namespaces; `down`
(also on leaving the `with`) kills every process in its namespaces by pid and removes them.
Every address is inside the cluster's own namespaces: nothing is sent anywhere else.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns-cluster.sh"
UP_S = 120  # building the cluster: namespaces, keys, sshds, an ssh round between every pair
_numbers = itertools.count()


class Unavailable(Exception):
    """This machine cannot build the cluster; the message says why."""


def environment(**extra: str) -> dict[str, str]:
    """Ours without TANDEM_* (a test's settings come in `extra`), importing this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class Cluster:
    """Hosts h1..hN: `hosts[name] = (namespace, address)`."""

    def __init__(self, prefix: str, hosts: dict[str, tuple[str, str]]) -> None:
        self.prefix, self.hosts = prefix, hosts
        self.state = Path(f"/tmp/tandem-netns-{prefix}")

    @classmethod
    def up(cls, count: int, *, debian_hosts: bool = False) -> Cluster:
        if os.geteuid() != 0:
            raise Unavailable("needs root to create network namespaces and start sshd")
        for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                raise Unavailable(f"needs `{tool}` (iproute2, util-linux, openssh-client)")
        if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
            raise Unavailable("needs sshd: apt-get install openssh-server (scripts/setup.sh "
                              "does it when run as root)")
        prefix = f"t{os.getpid() % 100000}n{next(_numbers)}"
        command = ["bash", str(SCRIPT), "up", str(count), "--prefix", prefix]
        if debian_hosts:
            command.append("--debian-hosts")
        try:
            made = subprocess.run(command, capture_output=True, text=True, timeout=UP_S)
        except subprocess.TimeoutExpired:
            subprocess.run(["bash", str(SCRIPT), "down", "--prefix", prefix], timeout=60)
            raise Unavailable(f"scripts/netns-cluster.sh up {count} took over {UP_S} s") from None
        if made.returncode:
            raise Unavailable(made.stderr.strip() or f"netns-cluster.sh exited {made.returncode}")
        hosts = {}
        for line in made.stdout.splitlines():
            name, namespace, address = line.split()
            hosts[name] = (namespace, address)
        return cls(prefix, hosts)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down", "--prefix", self.prefix],
                       capture_output=True, timeout=60)

    # -- running things on a host ----------------------------------------------------------
    def address(self, host: str) -> str:
        return self.hosts[host][1]

    def command(self, host: str, *argv: str) -> list[str]:
        """`argv` run on `host`: its network, its hostname, its /etc (hosts, ssh)."""
        return ["bash", str(SCRIPT), "exec", host, "--prefix", self.prefix, "--", *argv]

    def popen(self, host: str, *argv: str, env: dict[str, str] | None = None,
              **options) -> subprocess.Popen:
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **options}
        return subprocess.Popen(self.command(host, *argv), cwd=ROOT,
                                env=env or environment(), start_new_session=True, **options)

    def run(self, host: str, *argv: str, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, *argv), cwd=ROOT, env=env or environment(),
                              capture_output=True, text=True, timeout=timeout)

    # -- what goes wrong with hosts and links ------------------------------------------------
    def ip(self, host: str, *args: str) -> None:
        done = subprocess.run(["ip", "-n", self.hosts[host][0], *args], capture_output=True,
                              text=True, timeout=20)
        if done.returncode:
            raise RuntimeError(f"ip -n {self.hosts[host][0]} {' '.join(args)}: {done.stderr}")

    def link(self, host: str, up: bool) -> None:
        """Take the host's one network link down (a pulled cable) or up again."""
        self.ip(host, "link", "set", "eth0", "up" if up else "down")

    def shape(self, host: str, *, delay_ms: float | None = None, loss_pct: float | None = None,
              rate_mbit: int | None = None) -> None:
        """Shape what the host sends (netns-cluster.sh `shape`); no option: unshaped again.
        `Unavailable` when this machine lacks what it takes (iptables for delay and loss)."""
        options = []
        for flag, value in (("--delay-ms", delay_ms), ("--loss", loss_pct),
                            ("--rate-mbit", rate_mbit)):
            if value is not None:
                options += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        done = subprocess.run(["bash", str(SCRIPT), "shape", host, "--prefix", self.prefix,
                               *options], capture_output=True, text=True, timeout=60)
        if done.returncode:
            if "need iptables" in done.stderr:
                raise Unavailable(done.stderr.strip())
            raise RuntimeError(f"shape {host} {' '.join(options)}: {done.stderr}")

    def pids(self, host: str) -> set[int]:
        done = subprocess.run(["ip", "netns", "pids", self.hosts[host][0]], capture_output=True,
                              text=True, timeout=20)
        return {int(pid) for pid in done.stdout.split()}

    def job_processes(self, host: str) -> dict[int, str]:
        """The host's processes that are tandem's or a job's (Python), by pid: command line."""
        found = {}
        for pid in self.pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            line = " ".join(part.decode(errors="replace") for part in argv if part)
            if "python" in line:
                found[pid] = line
        return found

    def kill_processes(self, host: str) -> set[int]:
        """SIGKILL every process on the host except its sshd (the machine dies, its ssh
        service stays for the tests after); returns the pids killed."""
        sshd = self.state / f"sshd-{host}.pid"
        keep = {int(sshd.read_text())} if sshd.exists() else set()
        killed = self.pids(host) - keep
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed
