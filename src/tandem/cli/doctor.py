"""`tandem doctor`: what this machine offers a distributed job, one line each, with the fix.

    $ tandem doctor
    tandem     0.1.0 (python 3.12.3, torch 2.13.0, numpy 2.3.1, mpi4py 4.1.2)
    Gloo       available
    NCCL       not available: no CUDA GPU visible (NCCL needs one); use gloo on CPUs
    ...

Every check is a small function returning `Check(name, ok, detail, fix)`; none of them
communicates, starts MPI or changes anything, so it is safe to run anywhere, any time. The
command always exits 0: it reports, it does not judge. `tandem doctor --clean` changes one
thing first: it removes the MPI shared-memory segments in /dev/shm that killed jobs left
(`launch.mpi.shm.remove_stale`: only those no process maps or holds open).

`tandem doctor --hosts node1,node2` adds one `route` line per host: its address, and the
interface and local address this machine reaches it from (a routing-table lookup, no packet
sent), the interface `tandem run`'s agents point Gloo at; or that the name is this machine, or
does not resolve, or has no route.

    route      node2 (10.0.0.2): via eth0 from 10.0.0.1
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

# torchrun's and tandem's conventional rendezvous ports; `tandem run` itself lets the
# operating system pick a free port, but MASTER_PORT-style jobs (SLURM, torchrun) use these.
DEFAULT_PORTS = (29500, 29501, 29502, 29503)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self, width: int = 11) -> str:
        text = f"{self.name:<{width}}{self.detail}"
        return f"{text} -- fix: {self.fix}" if self.fix else text


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> Check:
    parts = [f"python {platform.python_version()}"]
    for package in ("torch", "numpy", "mpi4py", "matplotlib"):
        parts.append(f"{package} {_version(package) or 'missing'}")
    return Check("tandem", True, f"{_version('tandem') or 'unknown'} ({', '.join(parts)})")


def check_gloo() -> Check:
    import torch.distributed as dist

    if dist.is_available() and dist.is_gloo_available():
        return Check("Gloo", True, "available")
    return Check("Gloo", False, "not available in this torch build",
                 "install a stock torch wheel from pytorch.org (they all include Gloo)")


def check_nccl() -> Check:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return Check("NCCL", False, "not available: no CUDA GPU visible",
                     "none needed on CPUs (MPI or Gloo is used); for GPUs install a CUDA build "
                     "of torch")
    if not dist.is_nccl_available():
        return Check("NCCL", False, "not available in this torch build",
                     "install a CUDA build of torch from pytorch.org")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Check("NCCL", True, f"available (NCCL {version})")


def check_mpi() -> Check:
    if importlib.util.find_spec("mpi4py") is None:
        return Check("MPI", False, "not available: mpi4py is not installed",
                     "pip install mpi4py mpich   (or mpi4py against your system MPI)")
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        # Reading the library version is allowed before MPI_Init: do not start MPI here.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as error:
        return Check("MPI", False, f"mpi4py {mpi4py.__version__} cannot load an MPI library "
                     f"({error})", "pip install mpich (or point mpi4py at a system MPI)")
    # Open MPI's answer holds NUL bytes (seen with Open MPI 4.1.6): text readers take the
    # report for binary.
    library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
    major, minor = MPI.Get_version()
    return Check("MPI", True,
                 f"available: {' '.join(library.split())} (MPI {major}.{minor}, mpi4py "
                 f"{mpi4py.__version__})")


def check_cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda
        detail = "none visible" + (f" (torch built for CUDA {build})" if build else
                                   " (CPU-only torch build)")
        return Check("CUDA", False, detail, "")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("CUDA", True, f"{len(names)} device(s): {', '.join(names)}")


def check_cores() -> Check:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    total = os.cpu_count()
    detail = f"{usable} usable" + (f" of {total}" if total and total != usable else "")
    detail += f"; `tandem run -np N` gives each rank {usable} // N threads"
    return Check("cores", True, detail)


def _interfaces() -> list[tuple[str, str]]:
    """(name, state) of each network interface, from /sys where Linux has it."""
    names = sorted(name for _, name in socket.if_nameindex())
    found = []
    for name in names:
        state = "?"
        with contextlib.suppress(OSError):
            with open(f"/sys/class/net/{name}/operstate") as file:
                state = file.read().strip()
        found.append((name, state))
    return found


def check_network() -> Check:
    try:
        interfaces = _interfaces()
    except OSError as error:
        return Check("network", False, f"cannot list interfaces ({error})")
    up = [name for name, state in interfaces if state in ("up", "unknown") and name != "lo"]
    listed = ", ".join(f"{name} ({state})" for name, state in interfaces)
    if not up:
        return Check("network", False, f"only loopback is up: {listed}",
                     "fine for one machine; several hosts need a NIC that is up")
    return Check("network", True, listed)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def check_ports(ports: tuple[int, ...] = DEFAULT_PORTS) -> Check:
    busy = [port for port in ports if not _port_free(port)]
    span = f"{ports[0]}-{ports[-1]}"
    if busy:
        return Check("ports", False, f"{span}: in use: {', '.join(map(str, busy))}",
                     "tandem run picks a free port itself; for torchrun/SLURM set MASTER_PORT "
                     "to a free one")
    return Check("ports", True, f"{span} free (rendezvous ports of torchrun-style jobs)")


def check_shm() -> Check:
    from tandem.launch.mpi import shm

    found = shm.describe_stale()
    if found is None:
        return Check("shm", True, f"no stale MPI segments in {shm.SHM_DIR}")
    what, command = found
    return Check("shm", False, what, command)


def check_route(name: str) -> Check:
    """How this machine reaches host `name` (see the module docstring)."""
    import ipaddress

    from tandem.launch.agents import control
    from tandem.launch.agents.hosts import holds_address

    try:
        address = socket.gethostbyname(name)
    except OSError as error:
        return Check("route", False, f"{name}: cannot resolve it ({error.strerror or error})",
                     "check the name, or give its address")
    label = name if name == address else f"{name} ({address})"
    if holds_address(address):
        loopback = ipaddress.ip_address(address).is_loopback
        interface = "lo" if loopback else control.interface_of(address) or "?"
        if loopback and name not in (address, "localhost"):
            return Check("route", True, f"{label}: this machine ({interface})",
                         "other hosts cannot reach this machine at a loopback address: for "
                         "jobs without `tandem run` agents (torchrun, srun) give MASTER_ADDR a "
                         "network address of this machine, or map its name to one in /etc/hosts")
        return Check("route", True, f"{label}: this machine ({interface})")
    try:
        local = control.local_address_towards(address)
    except OSError as error:
        return Check("route", False, f"{label}: no route to it ({error.strerror or error})",
                     "this machine has no network that reaches it: check its address and the "
                     "interfaces above")
    return Check("route", True, f"{label}: via {control.interface_of(local) or '?'} from {local}")


CHECKS: tuple[Callable[[], Check], ...] = (
    check_versions, check_gloo, check_nccl, check_mpi, check_cuda, check_cores,
    check_network, check_ports, check_shm,
)


def run_checks(hosts: tuple[str, ...] = ()) -> list[Check]:
    """Every check (and a route to each of `hosts`); one that breaks becomes a failed `Check`
    naming the error."""
    results = []
    for check in (*CHECKS, *(functools.partial(check_route, host) for host in hosts)):
        try:
            results.append(check())
        except Exception as error:  # a broken probe must not hide the other lines
            name = getattr(check, "__name__", "route").removeprefix("check_")
            results.append(Check(name, False, f"check failed: {type(error).__name__}: {error}"))
    return results


def clean() -> str:
    """Remove stale MPI segments; say what went."""
    from tandem.launch.mpi import shm

    names, size = shm.remove_stale()
    return shm.describe_removed(names, size) if names else f"nothing stale in {shm.SHM_DIR}"


def main(clean_first: bool = False, hosts: tuple[str, ...] = ()) -> int:
    """Print one line per check (after `clean()` when asked, a route to each of `hosts`);
    always 0."""
    if clean_first:
        print(Check("clean", True, clean()).line(), flush=True)
    for check in run_checks(hosts):
        print(check.line(), flush=True)
    return 0
