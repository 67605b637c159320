"""torchrun's command line on `tandem run`: its flags, with torchrun's meaning, in tandem's terms.

A command copied from a README runs with `torchrun` replaced by `tandem run` (or
`python -m torch.distributed.run` by `python -m tandem.run`)::

    torchrun --standalone --nproc_per_node=4 train.py
    tandem run --standalone --nproc_per_node=4 train.py

What each flag becomes (`translate`):

- `--nproc-per-node N|gpu|cpu|auto` is `-np`: ranks on this machine (gpu: one per visible GPU,
  cpu: one per core, auto: gpu when there is one, else cpu). A command with torchrun's flags
  and neither starts torchrun's one rank a machine (tandem's own: one per visible GPU).
- `--nnodes N` is tandem's `--nnodes`; `--nnodes MIN:MAX` an elastic job of MIN to MAX
  machines: `--nnodes MAX --min-np MIN*np --max-np MAX*np` (`elastic_nodes`).
- `--node-rank R`, `--max-restarts K`, `-m/--module` are tandem's own flags.
- `--rdzv-endpoint HOST[:PORT]` (c10d's port 29400 by default), or `--master-addr`/
  `--master-port` (static, 29500 by default), is `--master` in a job of several machines. On one
  machine they, `--standalone` and `--rdzv-id` change nothing: tandem hosts the rendezvous on a
  free port itself. `--rdzv-backend` static or c10d: node 0's agent hosts the rendezvous.
- `--rdzv-id ID` is the job's `--secret` across machines when none is given (torchrun's
  rendezvous admits whoever reaches it; tandem's admits holders of the secret, here the id),
  and node 0 admits only agents of the same id even when two jobs share a secret.
- `--no-python` runs the program as given; `--run-path` runs the script under Python.
- `--monitor-interval`, `--start-method`, `--rdzv-conf` and `--log-dir` are accepted with a
  note: tandem's supervisor reacts to a rank's exit at once, starts every rank as a fresh
  process, and prints each rank's output on the console, prefixed by its rank.

Refused, with what to use: `-r/--redirects` and `-t/--tee` other than 0 (pipe the output),
`--role` other than `default`, an `etcd` rendezvous, `--standalone` with several machines,
c10d across machines without `--node-rank`, and torchrun's flags beside tandem's flag for the
same thing (`-np` and `--nproc-per-node`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.launch import gpus
from tandem.launch.local.processes import cores

C10D_PORT = 29400  # torchrun's port for a c10d endpoint given without one
STATIC_PORT = 29500  # torchrun's --master-port default


@dataclass(frozen=True)
class Flag:
    """One torchrun flag `tandem run` takes: its spellings and what it does here."""

    dest: str
    flags: tuple[str, ...]
    metavar: str | None  # None: a switch
    help: str


FLAGS: tuple[Flag, ...] = (
    Flag("nproc_per_node", ("--nproc-per-node", "--nproc_per_node"), "N|gpu|cpu|auto",
         "-np: ranks on this machine (gpu: one per visible GPU; cpu: one per core; auto: gpu "
         "when there is one, else cpu)"),
    Flag("standalone", ("--standalone",), None,
         "a job on this machine alone (tandem's default: its rendezvous is on a free port)"),
    Flag("rdzv_backend", ("--rdzv-backend", "--rdzv_backend"), "static|c10d",
         "either: node 0's agent hosts the rendezvous"),
    Flag("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"), "HOST[:PORT]",
         "--master HOST:PORT (port 29400 if absent) with several machines; unused on one"),
    Flag("rdzv_id", ("--rdzv-id", "--rdzv_id"), "ID",
         "with several machines, the job's --secret when none is given; unused on one"),
    Flag("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"), "K=V,...",
         "accepted and ignored: --timeout bounds tandem's rendezvous"),
    Flag("master_addr", ("--master-addr", "--master_addr"), "ADDR",
         "--master ADDR:PORT with several machines; unused on one"),
    Flag("master_port", ("--master-port", "--master_port"), "PORT",
         "the port of --master-addr (29500 if absent)"),
    Flag("monitor_interval", ("--monitor-interval", "--monitor_interval"), "S",
         "accepted and ignored: tandem reacts to a rank's exit at once"),
    Flag("start_method", ("--start-method", "--start_method"), "METHOD",
         "accepted and ignored: every rank is a fresh process (as spawn)"),
    Flag("role", ("--role",), "NAME", "only `default` (ROLE_NAME)"),
    Flag("log_dir", ("--log-dir", "--log_dir"), "DIR",
         "accepted and ignored: output is on the console, prefixed by rank"),
    Flag("redirects", ("-r", "--redirects"), "0",
         "only 0: pipe the output (tandem run ... 2>&1 | tee job.log) to keep it"),
    Flag("tee", ("-t", "--tee"), "0", "only 0: pipe the output to tee instead"),
    Flag("run_path", ("--run-path", "--run_path"), None, "run the script under Python"),
    Flag("no_python", ("--no-python", "--no_python"), None,
         "run the program as given, not under Python"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare torchrun's flags on `tandem run`'s parser, in a group of their own."""
    group = parser.add_argument_group(
        "torchrun's flags", "taken with torchrun's meaning, so a torchrun command runs with "
        "`torchrun` replaced by `tandem run` (launch/torchrun_flags.py)")
    for flag in FLAGS:
        if flag.metavar is None:
            group.add_argument(*flag.flags, dest=flag.dest, action="store_const", const=True,
                               default=None, help=flag.help)
        else:
            group.add_argument(*flag.flags, dest=flag.dest, default=None, metavar=flag.metavar,
                               help=flag.help)


@dataclass
class Translation:
    """What torchrun's flags make of `tandem run`'s values."""

    executable: bool | None = None  # --no-python: True, --run-path: False; None: tandem decides
    used: bool = False  # a torchrun flag was given: without -np, torchrun's one rank a machine
    notes: list[str] = field(default_factory=list)  # flags accepted without an effect


def translate(args: argparse.Namespace, values: dict,
              visible_gpus: Callable[[], int] = gpus.visible_gpus,
              count_cores: Callable[[], int] = cores) -> Translation:
    """Put what torchrun's flags in `args` mean into `values` (tandem's options by dest, as
    `config.config_from_args` read them); a ValueError says what to use instead."""
    given = {flag.dest: getattr(args, flag.dest, None) for flag in FLAGS}
    given = {dest: value for dest, value in given.items() if value is not None}
    translation = Translation(used=bool(given))
    if "nproc_per_node" in given:
        if values["np"] is not None:
            raise ValueError(f"received both -np and --nproc-per-node "
                             f"{given['nproc_per_node']}: they say the same (ranks on this "
                             "machine); choose one")
        values["np"] = processes_per_node(given["nproc_per_node"], visible_gpus, count_cores)
    most = nodes_at_most(values["nnodes"])
    _rendezvous(given, values, most)
    _program(args, given, translation)
    _output(given, translation)
    return translation


def processes_per_node(text: str, visible_gpus: Callable[[], int],
                       count_cores: Callable[[], int]) -> int:
    """torchrun's --nproc-per-node: N, gpu, cpu or auto."""
    word = text.strip().lower()
    if word.isdigit():
        return int(word)
    if word in ("gpu", "auto"):
        found = visible_gpus()
        if found:
            return found
        if word == "gpu":
            raise ValueError("--nproc-per-node gpu: this machine has no visible GPU (none in "
                             f"{gpus.DRIVER}, or CUDA_VISIBLE_DEVICES hides them); give a "
                             "number of ranks (--nproc-per-node 2) or cpu (one per core)")
    if word in ("cpu", "auto"):
        return count_cores()
    raise ValueError(f"--nproc-per-node {text!r}: give a number of ranks, gpu (one per visible "
                     "NVIDIA GPU), cpu (one per core) or auto")


def nodes_at_most(nnodes: int | tuple[int, int] | None) -> int:
    """The most machines `--nnodes N` or `--nnodes MIN:MAX` allows."""
    if isinstance(nnodes, tuple):
        return nnodes[1]
    return nnodes or 1


def elastic_nodes(nnodes: tuple[int, int], np: int,
                  max_restarts: int | None = None) -> tuple[int, int | None, int | None]:
    """torchrun's `--nnodes MIN:MAX` with `np` ranks a machine, as tandem's (nnodes, min-np,
    max-np): MAX machines of an elastic job of MIN*np to MAX*np ranks (MIN == MAX: fixed)."""
    low, high = nnodes
    if not 0 < low <= high:
        raise ValueError(f"--nnodes {low}:{high}: give MIN:MAX with 1 <= MIN <= MAX machines")
    if low == high:
        return high, None, None
    if max_restarts:
        raise ValueError(f"--nnodes {low}:{high} with --max-restarts {max_restarts}: tandem's "
                         "elastic job goes on without a failed rank (td.elastic.run) instead "
                         "of restarting them all, so it takes no --max-restarts: drop it, or "
                         f"give --nnodes {high} for a fixed job restarted up to {max_restarts} "
                         "times")
    return high, low * np, high * np


def _rendezvous(given: dict, values: dict, most: int) -> None:
    """--standalone, --rdzv-*, --master-addr/--master-port: where node 0 is, across machines."""
    backend = given.get("rdzv_backend", "static").strip().lower()
    if given.get("standalone"):
        if most > 1:
            raise ValueError(f"--standalone is a job on this machine alone, but --nnodes asks "
                             f"for up to {most} machines: drop --standalone and give each "
                             "machine --rdzv-endpoint (or --master) NODE0:PORT and --node-rank R")
        return  # torchrun ignores the other rendezvous flags then; tandem needs none
    if backend not in ("static", "c10d"):
        raise ValueError(f"--rdzv-backend {backend}: tandem needs no rendezvous server, its "
                         "node 0 hosts one (authenticated); give --rdzv-backend c10d "
                         "--rdzv-endpoint NODE0:PORT (or --master NODE0:PORT) and --node-rank R")
    if most == 1:
        return  # tandem hosts a one-machine job's rendezvous on a free port itself
    endpoint = _endpoint(given, backend)
    if endpoint is not None:
        if values["master"] is not None:
            raise ValueError("received both --master and --rdzv-endpoint/--master-addr: they "
                             "say the same (where node 0 hosts the rendezvous); choose one")
        values["master"] = endpoint
    if values["node_rank"] is None and backend == "c10d":
        raise ValueError("--rdzv-backend c10d across machines: torchrun numbers the machines "
                         "as they arrive, tandem by --node-rank: give each machine --node-rank "
                         "R (0 on the machine of the endpoint, which hosts the rendezvous)")
    if given.get("rdzv_id", "none") != "none":
        values["job_id"] = given["rdzv_id"]  # the agents' hello names it (agents.admission)
        if values["secret"] is None:
            values["secret"] = given["rdzv_id"]


def _endpoint(given: dict, backend: str) -> tuple[str, int] | None:
    """Node 0's address: the c10d endpoint, else --master-addr:--master-port (torchrun's
    `get_rdzv_endpoint`), each with torchrun's default port."""
    if "rdzv_endpoint" in given and given["rdzv_endpoint"].strip():
        return _address(given["rdzv_endpoint"], C10D_PORT, "--rdzv-endpoint")
    if "master_addr" in given or "master_port" in given:
        port = given.get("master_port", str(STATIC_PORT))
        return _address(f"{given.get('master_addr', '127.0.0.1')}:{port}", STATIC_PORT,
                        "--master-addr/--master-port")
    return None


def _address(text: str, default_port: int, flag: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or "]" in port:  # no port: torchrun's default
        host, port = text.strip(), str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {text!r} is not HOST:PORT (e.g. 10.0.0.1:{default_port})")
    return host, int(port)


def _program(args: argparse.Namespace, given: dict, translation: Translation) -> None:
    if given.get("no_python") and getattr(args, "module", False):
        raise ValueError("received both --no-python and -m/--module: a module runs under "
                         "Python; choose one")
    if given.get("run_path"):
        translation.executable = False  # torchrun: --run-path wins over --no-python
    elif given.get("no_python"):
        translation.executable = True
    role = given.get("role", "default")
    if role != "default":
        raise ValueError(f"--role {role}: tandem run starts one role, ROLE_NAME=default; to "
                         f"tell your script its role, set a variable of your own (ROLE={role} "
                         "tandem run ...) or pass an argument")


def _output(given: dict, translation: Translation) -> None:
    for dest, flag in (("redirects", "-r/--redirects"), ("tee", "-t/--tee")):
        if given.get(dest, "0").strip() != "0":
            raise ValueError(f"{flag} {given[dest]}: tandem run does not write each rank's "
                             "output to files; it prints every line on the console, prefixed by "
                             "its rank. To keep it, pipe it: tandem run ... 2>&1 | tee job.log")
    ignored = {"monitor_interval": "--monitor-interval (tandem reacts to a rank's exit at once)",
               "start_method": "--start-method (every rank is a fresh process, as spawn)",
               "rdzv_conf": "--rdzv-conf (tandem's --timeout bounds its rendezvous)",
               "log_dir": "--log-dir (output is on the console, prefixed by rank)"}
    translation.notes.extend(text for dest, text in ignored.items() if dest in given)
