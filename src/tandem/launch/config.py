"""`tandem run`'s options: argparse arguments -> `config_from_args()` -> a frozen `LaunchConfig`.

Every option is declared once in `OPTIONS`; the same table makes the argparse flag and names
the `TANDEM_<DEST>` environment variable that supplies it when the flag is absent (the command
line wins); this table is where `tandem run`'s options are read, the settings every process
reads are `tandem.job.settings`. Values are checked here, before anything is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.job.settings import BACKENDS, DEFAULT_TIMEOUT_S, check_backend
from tandem.launch import gpus, torchrun_flags
from tandem.launch.agents.discovery import DEFAULT_TIMEOUT_S as DEFAULT_DISCOVERY_S
from tandem.launch.agents.elastic_options import discovery_problem, elastic_problem
from tandem.launch.agents.hosts import Host, check_unique, parse_hosts, read_hostfile, total_slots
from tandem.launch.local.processes import cores
from tandem.launch.programs import file_problem, is_command, shape_problem


class LaunchError(ValueError):
    """The job cannot be launched as asked; the message says what to change."""


class StartError(LaunchError):
    """A rank's program could not be started (the system refused it); `code` is the exit code
    a shell gives for that: 127 when it is not found, 126 when it cannot be executed."""

    def __init__(self, message: str, code: int = 126) -> None:
        super().__init__(message)
        self.code = code


def _argument(convert: Callable[[str], object], what: str = "") -> Callable[[str], object]:
    """`convert` as an argparse type: its ValueError said as "'text' is not `what`", or as
    it is when `what` is empty."""
    def parse(text: str) -> object:
        try:
            return convert(text)
        except ValueError as error:
            said = f"{text!r} is not {what}" if what else str(error)
            raise argparse.ArgumentTypeError(said) from None
    return parse


_integer = _argument(int, "an integer")
_seconds = _argument(float, "a number of seconds")


def _processes(text: str) -> int | tuple[int, int]:
    """-np N, or -np A:B (an elastic job of A to B ranks, starting with B); --nnodes N, or
    torchrun's MIN:MAX (an elastic job of MIN to MAX machines)."""
    low, sep, high = text.partition(":")
    if not sep:
        return _integer(text)
    return _integer(low), _integer(high)


def parse_address(text: str) -> tuple[str, int]:
    """`10.0.0.1:29500` (or `[::1]:29500`) -> (host, port); a ValueError says what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ValueError(f"{text!r} is not ADDR:PORT (e.g. 10.0.0.1:29500)")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: the port {port!r} is not an integer") from None
    if not 0 < number < 65536:
        raise ValueError(f"{text!r}: the port must be between 1 and 65535")
    return host, number


_address = _argument(parse_address)


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a yes/no value (1 or 0)")


_backend = _argument(check_backend)


@dataclass(frozen=True)
class Option:
    """One `tandem run` option: its flags, its converter, and its `TANDEM_` variable."""

    dest: str
    flags: tuple[str, ...]
    convert: Callable[[str], object]
    metavar: str
    help: str
    flag: bool = False  # a switch without a value (its variable takes 1 or 0)

    @property
    def variable(self) -> str:
        return f"TANDEM_{self.dest.upper()}"


OPTIONS: tuple[Option, ...] = (
    Option("np", ("-np", "-n", "--np"), _processes, "N",
           "number of processes (ranks) to start; A:B is --min-np A --max-np B"),
    Option("min_np", ("--min-np",), _integer, "A",
           "an elastic job: when ranks fail it goes on with the others, down to A ranks "
           "(td.elastic.run restores the last State.commit()); below A it ends"),
    Option("max_np", ("--max-np",), _integer, "B",
           "an elastic job: it grows up to B ranks when --host-discovery-script offers slots "
           "or another node's agent joins (with --nnodes, -np N is each node's slots)"),
    Option("discovery", ("--host-discovery-script",), str, "SCRIPT",
           "an elastic job: a program printing `host:slots` lines, run every second; more "
           "slots than ranks make the job grow (with -H, a listed host gets an agent)"),
    Option("discovery_timeout", ("--discovery-timeout",), _seconds, "S",
           "an elastic job: a run of --host-discovery-script longer than S seconds is killed "
           f"and named, and the job goes on with what it has (default {DEFAULT_DISCOVERY_S:g})"),
    Option("backend", ("--backend",), _backend, "NAME",
           f"communication backend: {' | '.join(BACKENDS)} (default: nccl with GPUs; else mpi "
           "when mpi4py and mpiexec are installed and the job is local without restarts (no "
           "-H/--hostfile/--nnodes/--max-restarts); else gloo)"),
    Option("threads_per_rank", ("--threads-per-rank",), _integer, "T",
           "OMP/MKL threads per rank (default: cores // ranks, unless OMP_NUM_THREADS is set)"),
    Option("timeout", ("--timeout",), _seconds, "S",
           "seconds any rendezvous or collective may wait before failing (default "
           f"{DEFAULT_TIMEOUT_S:g})"),
    Option("hosts", ("-H", "--hosts"), str, "HOST:SLOTS,...",
           "hosts and their slots, horovodrun style; remote hosts get an agent over ssh"),
    Option("hostfile", ("--hostfile",), str, "FILE",
           "file with one `host slots=N` per line"),
    Option("max_restarts", ("--max-restarts", "--max_restarts"), _integer, "K",
           "when a rank fails or a node is lost, stop every rank and restart the whole job, "
           "up to K times (a lost node's place goes to a host of -H without ranks, or to an "
           "agent started with its --node-rank)"),
    Option("resume_on_preempt", ("--resume-on-preempt",), _integer, "N",
           "when the job exits 75 (preempted: its ranks saved at the step they agreed on), "
           "start it again, up to N times, on the same ranks; the script resumes from its "
           "newest checkpoint. A second signal to tandem run (or one while it restarts) stops "
           "it for good"),
    Option("nnodes", ("--nnodes",), _processes, "N",
           "machines in the job, each running its own `tandem run` (an agent); default 1. "
           "MIN:MAX (torchrun's): an elastic job of MIN to MAX machines"),
    Option("node_rank", ("--node-rank", "--node_rank"), _integer, "R",
           "this machine's place in 0..N-1; node R runs ranks R*np .. R*np+np-1"),
    Option("master", ("--master",), _address, "ADDR:PORT",
           "where node 0 hosts the rendezvous store (every node gives the same)"),
    Option("secret", ("--secret",), str, "S",
           "shared secret that authenticates the agents of a multi-node job; - reads stdin"),
    Option("timeline", ("--timeline",), str, "FILE",
           "write a Chrome/Perfetto trace of every rank (compute, data, each bucket) to FILE"),
    Option("require_join", ("--require-join",), _boolean, "",
           "exit 1 when no rank joined the job (no td.init(), no init_process_group): N "
           "independent copies ran (default: a warning)", flag=True),
)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `launch()` needs to start one job; built by `config_from_args` or by hand."""

    np: int
    program: str  # a script path, a module name when `module`, a command when `executable`
    args: tuple[str, ...] = ()
    module: bool = False
    executable: bool = False  # `program` runs as given: `python train.py`, `/abs/python -m x`
    backend: str | None = None
    threads_per_rank: int | None = None  # None: cores // np, unless OMP_NUM_THREADS is set
    timeout: float | None = None  # None: the runtime's default
    hosts: tuple[Host, ...] = ()  # empty: this machine only
    max_restarts: int = 0
    resume_on_preempt: int = 0  # restarts after an exit 75 (preempted), `launcher.launch`
    nnodes: int = 1
    node_rank: int = 0
    master: tuple[str, int] | None = None  # node 0's rendezvous store, for multi-node jobs
    secret: str | None = None
    job_id: str | None = None  # torchrun's --rdzv-id across machines: node 0 admits only its own
    timeline: str | None = None  # a trace file; the ranks get it as TANDEM_TIMELINE
    require_join: bool = False  # a job that no rank joined is an error, not a warning
    min_np: int | None = None  # an elastic job (launch/agents/elastic.py): its range of world sizes
    max_np: int | None = None
    discovery: str | None = None  # --host-discovery-script
    discovery_timeout: float | None = None  # None: discovery.DEFAULT_TIMEOUT_S

    @property
    def elastic(self) -> bool:
        return self.min_np is not None or self.max_np is not None

    def __post_init__(self) -> None:
        if self.np < 1:
            raise LaunchError(
                f"-np {self.np}: a job needs at least one process; give -np 1 or more"
            )
        if not self.program:
            raise LaunchError("no program to run: give a script (train.py) or -m module")
        if self.module and self.executable:
            raise LaunchError(f"-m {self.program}: a module runs under this Python; to run it "
                              f"under another, give `/path/to/python -m {self.program}`")
        problem = shape_problem(self.program, self.args, self.module, self.executable, self.np)
        if problem:
            raise LaunchError(problem)
        if self.backend is not None and self.backend not in BACKENDS:
            raise LaunchError(f"unknown backend {self.backend!r}: choose one of "
                              f"{', '.join(BACKENDS)}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise LaunchError(
                f"--threads-per-rank {self.threads_per_rank}: each rank needs at least 1 thread"
            )
        if self.timeout is not None and not self.timeout > 0:
            raise LaunchError(f"--timeout {self.timeout}: give a positive number of seconds")
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts {self.max_restarts}: give 0 or more")
        if self.resume_on_preempt < 0:
            raise LaunchError(f"--resume-on-preempt {self.resume_on_preempt}: give the most "
                              f"restarts after a preemption, 0 or more (e.g. 3)")
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes {self.nnodes}: a job needs at least one node")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"give 0..{self.nnodes - 1} (node 0 hosts the rendezvous)"
            )
        if self.nnodes > 1 and self.master is None:
            raise LaunchError(
                f"--nnodes {self.nnodes} needs --master ADDR:PORT: the address and port where "
                "node 0 hosts the rendezvous, the same on every node"
            )
        if self.nnodes > 1 and self.hosts:
            raise LaunchError(
                "received both --nnodes and -H/--hostfile: choose one (-H starts the agents "
                "over ssh; --nnodes means you start one `tandem run` per node)"
            )
        self._check_elastic()
        if self.timeline is not None:
            _check_writable(self.timeline)
        if self.hosts:
            try:
                check_unique(self.hosts, "-H/--hostfile")
            except ValueError as error:
                raise LaunchError(str(error)) from None
        if self.hosts and self.np > total_slots(self.hosts):
            listed = ",".join(f"{host.name}:{host.slots}" for host in self.hosts)
            raise LaunchError(
                f"-np {self.np} needs {self.np} slots but the hosts {listed} offer "
                f"{total_slots(self.hosts)}: lower -np or add slots"
            )

    def _check_elastic(self) -> None:
        problem = elastic_problem(self)
        if problem is not None:
            raise LaunchError(problem)

    @property
    def remote_hosts(self) -> tuple[Host, ...]:
        return tuple(host for host in self.hosts if not host.is_local)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `tandem run`'s arguments on `parser` (the CLI's `run` subparser)."""
    for option in OPTIONS:
        if option.flag:
            parser.add_argument(*option.flags, dest=option.dest, action="store_const",
                                const=True, default=None,
                                help=f"{option.help} [{option.variable}=1]")
            continue
        parser.add_argument(
            *option.flags, dest=option.dest, type=option.convert, default=None,
            metavar=option.metavar, help=f"{option.help} [{option.variable}]",
        )
    parser.add_argument(
        "-m", "--module", action="store_true",
        help="run the program as a module, like `python -m module`",
    )
    parser.add_argument("program", metavar="script.py|module", help="what each rank runs: a script, "
                        "a module (-m), or a command run as given (python train.py)")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="arguments passed to every rank unchanged"
    )
    torchrun_flags.add_arguments(parser)


def _from_environment(option: Option, environ: Mapping[str, str] | None) -> object:
    text = (os.environ if environ is None else environ).get(option.variable)
    if text is None or not text.strip():
        return None
    try:
        return option.convert(text)
    except argparse.ArgumentTypeError as error:
        raise LaunchError(f"{option.variable}={text!r}: {error}") from None


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """The `LaunchConfig` for parsed arguments; absent flags come from `TANDEM_*` variables."""
    values = {}
    for option in OPTIONS:
        value = getattr(args, option.dest, None)
        values[option.dest] = value if value is not None else _from_environment(option, environ)

    try:  # torchrun's flags, in tandem's terms
        torchrun = torchrun_flags.translate(args, values)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    if torchrun.notes:
        print(f"tandem run: note: ignored torchrun flag(s): {'; '.join(torchrun.notes)}",
              file=sys.stderr, flush=True)

    if values["hosts"] and values["hostfile"]:
        raise LaunchError("received both -H and --hostfile: choose one")
    try:
        if values["hosts"]:
            hosts = parse_hosts(values["hosts"])
        elif values["hostfile"]:
            hosts = read_hostfile(values["hostfile"])
        else:
            hosts = ()
    except ValueError as error:
        raise LaunchError(str(error)) from None

    np, min_np, max_np = values["np"], values["min_np"], values["max_np"]
    nnodes = values["nnodes"]
    if isinstance(nnodes, tuple):  # torchrun's --nnodes MIN:MAX
        if isinstance(np, tuple) or min_np is not None or max_np is not None:
            raise LaunchError(f"--nnodes {nnodes[0]}:{nnodes[1]} gives the job's range of "
                              "machines already: drop --min-np/--max-np (or -np A:B) and give "
                              "each machine's ranks with -np N (--nproc-per-node N)")
        if np is None:
            np = 1 if torchrun.used else ranks_per_gpu()
        try:
            nnodes, min_np, max_np = torchrun_flags.elastic_nodes(nnodes, np,
                                                                  values["max_restarts"])
        except ValueError as error:
            raise LaunchError(str(error)) from None
    if (nnodes or 1) > 1 and (isinstance(np, tuple) or np is None) \
            and (min_np is not None or max_np is not None or isinstance(np, tuple)):
        raise LaunchError("an elastic job across nodes: give each node's ranks with -np N and "
                          "the job's range of ranks with --min-np A --max-np B")
    if isinstance(np, tuple):
        if min_np is not None or max_np is not None:
            raise LaunchError(f"-np {np[0]}:{np[1]} already gives the range: drop --min-np "
                              "and --max-np, or give -np N")
        (min_np, max_np), np = np, np[1]
    if np is None and max_np is not None:
        np = max_np  # an elastic job starts as large as it may be
    if np is None and hosts:
        np = total_slots(hosts)
    if np is None:  # torchrun's default is one rank a machine; tandem's one a visible GPU
        np = 1 if torchrun.used else ranks_per_gpu()

    executable = not args.module and is_command(args.program)
    return LaunchConfig(
        np=np,
        program=args.program,
        args=tuple(args.args),
        module=bool(args.module),
        executable=executable if torchrun.executable is None else torchrun.executable,
        backend=values["backend"],
        threads_per_rank=values["threads_per_rank"],
        timeout=values["timeout"],
        hosts=hosts,
        max_restarts=values["max_restarts"] or 0,
        resume_on_preempt=values["resume_on_preempt"] or 0,
        nnodes=nnodes or 1,
        node_rank=values["node_rank"] or 0,
        master=values["master"],
        secret=values["secret"],
        job_id=values.get("job_id"),
        timeline=values["timeline"],
        require_join=bool(values["require_join"]),
        min_np=min_np,
        max_np=max_np,
        discovery=os.path.abspath(values["discovery"]) if values["discovery"] else None,
        discovery_timeout=values["discovery_timeout"],
    )


def ranks_per_gpu() -> int:
    """-np when none is given: one rank per GPU the ranks will see (said on stderr); without
    one, a LaunchError that says what to give."""
    variable = os.environ.get("CUDA_VISIBLE_DEVICES")
    machine = gpus.machine_gpus()
    try:
        ranks = gpus.ranks_without_np(len(machine), gpus.visible_count(variable, machine),
                                      variable, cores())
    except ValueError as error:
        raise LaunchError(str(error)) from None
    print(gpus.started_note(ranks, variable), file=sys.stderr, flush=True)
    return ranks


def _check_writable(path: str) -> None:
    """--timeline FILE: a file this process can create, checked before any rank starts."""
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise LaunchError(f"--timeline {path}: {full} is a directory; give a file name, e.g. "
                          f"{os.path.join(path, 'trace.json')}")
    if not os.path.isdir(folder):
        raise LaunchError(f"--timeline {path}: the folder {folder} does not exist; create it "
                          "first or give a path in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LaunchError(f"--timeline {path}: the folder {folder} is not writable; give a "
                          "path in a folder you can write")


def check_program(config: LaunchConfig) -> None:
    """A missing script, or a file the ranks could not run (`programs.file_problem`), is our
    error (nothing starts); a missing module is each rank's. So is a discovery script that
    fails its first run (`elastic_options.discovery_problem`)."""
    problem = discovery_problem(config)
    if problem:
        raise LaunchError(problem)
    if config.module:
        return  # importable only in the ranks' environment, so let them say so
    if not config.executable and not os.path.exists(config.program):
        where = os.path.abspath(config.program)
        hint = ""
        dotted = all(part.isidentifier() for part in config.program.split("."))
        if dotted and not config.program.endswith(".py"):
            hint = f"; if it is a module, run it with -m {config.program}"
        raise LaunchError(f"the script {config.program!r} does not exist ({where}){hint}")
    problem = file_problem(config.program, config.args, config.module, config.executable,
                           config.np)
    if problem:
        raise LaunchError(problem)
