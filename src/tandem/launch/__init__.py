"""`tandem run`: start a job of N processes (ranks) on this machine.

Usage
-----


    tandem run -np 4 train.py --lr 0.1        # four ranks of `python train.py --lr 0.1`
    tandem run -np 2 -m mypackage.train       # a module, like `python -m`
    tandem run -np 2 python train.py          # mpiexec's and horovodrun's form: any command
    tandem run -np 2 /opt/py/bin/python -m pytest tests/   # ... run as given, under that Python
    tandem run -np 4 --backend gloo --threads-per-rank 2 train.py
    tandem run -H localhost:4 train.py        # horovodrun's spelling; -np defaults to the slots
    tandem run -np 4 --backend mpi train.py   # ranks started through mpiexec (launch/mpi/mpiexec.py)
    tandem run -np 2 --max-restarts 3 train.py          # restart the job when a rank fails
    tandem run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -np 2 train.py   # one agent a node
    tandem run -np 8 -H node1:4,node2:4 train.py        # remote agents started over ssh
    python -m tandem run ...                  # the same command
    tandem run train.py                       # no -np: one rank per visible GPU (it says how many)
    tandem run --standalone --nproc_per_node=4 train.py   # torchrun's flags, torchrun's meaning
    python -m tandem.run --nproc-per-node 2 train.py      # as `python -m torch.distributed.run`

Without -np (or TANDEM_NP, -H, --max-np) a job has one rank per GPU the ranks will see
(launch/gpus.py: the driver's list, CUDA_VISIBLE_DEVICES respected; torch is not imported),
and a machine without one is told what to give. torchrun's flags are taken with torchrun's
meaning (launch/torchrun_flags.py says what each becomes), so a command from a README runs with
`torchrun` replaced by `tandem run`; a command with torchrun's flags and no --nproc-per-node
starts one rank a machine, as torchrun does. What tandem cannot honour (--redirects/--tee files,
an etcd rendezvous, --role) is refused with what to use.

Everything after the script (or module) is passed to every rank unchanged. A program that
is not a `.py` file and is an executable (a path, or a name on PATH: `python`, `./a.out`) is
a command, run as given, with its arguments, instead of by this Python; a file that is not
executable is run by this Python, as torchrun runs it, when it is Python. Each rank calls
td.init() and finds its place in the job from the variables set for it.

The backend, unless --backend names one: nccl with GPUs; else mpi when mpi4py and mpiexec
are installed and the job is local without restarts (no -H/--hostfile, --nnodes or
--max-restarts); else gloo. `--backend gloo` keeps Gloo where MPI would be the default.

What every rank gets
--------------------
- TANDEM_RANK, TANDEM_SIZE, TANDEM_LOCAL_RANK, TANDEM_LOCAL_SIZE,
  TANDEM_MASTER_ADDR/TANDEM_MASTER_PORT (a rendezvous store the launcher hosts on a
  port the operating system picked, so two jobs on one machine never collide) and
  TANDEM_STORE_KEY (what a client proves to that store; without it the store answers nothing),
  TANDEM_BACKEND (the backend chosen above), TANDEM_TIMEOUT with --timeout. MPI ranks get
  the same, plus TANDEM_UNDER_MPI=1, from their supervisor (launch/mpi/rank.py).
- HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, as horovodrun sets them,
  for Horovod scripts that read them.
- torchrun's variables (environments.torchrun_variables), so an unchanged torchrun script runs:
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*,
  MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT,
  TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE=False. MASTER_PORT is a free port of
  its own for rank 0's torch TCPStore (torch's env:// rendezvous), never tandem's store, which is
  authenticated and speaks its own protocol.
- OMP_NUM_THREADS and MKL_NUM_THREADS: --threads-per-rank, by default
  cores // ranks, so N ranks do not each start one thread per core. Values already in the
  environment are kept unless --threads-per-rank is given.
- PYTHONUNBUFFERED=1, so output arrives as it is printed.

Options from the environment
----------------------------
Every option can come from a TANDEM_ variable named after it: TANDEM_NP,
TANDEM_BACKEND, TANDEM_THREADS_PER_RANK, TANDEM_TIMEOUT, TANDEM_HOSTS,
TANDEM_HOSTFILE, TANDEM_MAX_RESTARTS, TANDEM_REQUIRE_JOIN. A flag on the command line wins.

Output
------
Each line a rank prints, on stdout or stderr, appears on the same stream prefixed with its
rank: [1] epoch 3 loss 0.25. Lines of different ranks never mix.

Failures and exit code
----------------------
The exit code is 0 when every rank exits 0, else the first failing rank's (a rank killed by a
signal counts as 128 + the signal number, as in a shell). When a rank fails, the others get
SIGTERM and, 2 seconds later, SIGKILL; then a summary on stderr names the rank, its exit code
or signal, and the last 20 lines it printed. Ctrl-C or SIGTERM to tandem run is passed on
to every rank (a second one kills them at once). A rank still starting (none of its processes
has reached the job's store, as td.init() does, and it printed nothing on stdout) gets SIGTERM
instead of SIGINT: it would only print a KeyboardInterrupt traceback from inside an import.
When every rank is still starting, the job ends with one line, `tandem run: interrupted during
start-up (SIGINT); stopped N rank(s)`, and exit code 130. Each rank runs in its own process
group, which is killed when the job ends, so processes the ranks started do not outlive it.

A job that exits 0 although no rank joined it (no td.init(), no init_process_group: N
independent copies ran) ends with a warning that says so; with --require-join (or
TANDEM_REQUIRE_JOIN=1) it is an error, exit code 1 (launch/local/joined.py).

Bad input (-np 0, a script that does not exist, an unknown backend) is reported with exit
code 2 before anything starts, and so is a program the ranks could not run (launch/programs.py):
`python` with no script (it would exit 0 having run nothing), `-m train.py` (did you mean
`-m train`), an executable without a #! line or whose #! names a missing interpreter, a file
that is neither executable nor Python. A program the system still refuses to start is named
with the system's reason and exit code 126 (127: not found). A module that does not exist is
reported by the ranks.

MPI's shared memory in /dev/shm: a job removes the segments its ranks left when it ends, and
every `tandem run` first removes the ones a killed `tandem run` could not (those no process
maps or holds open, so never a live job's); `tandem doctor --clean` does the same.

Restarts (launch/agents/coordinator.py): with --max-restarts K a failed job is stopped and started
again, up to K times, each rank seeing TANDEM_RESTART=<attempt>; td.Checkpointer or
td.save/td.load resume it. A lost node is restarted too, once another agent takes its place
(same node rank and -np): a host of -H/--hostfile that had no ranks stands by for that, and a
--nnodes job waits up to the timeout for one started by hand. Several nodes
(launch/agents/multinode.py): node 0's agent hosts the
rendezvous at --master and a control plane that authenticates agents with the job's secret
(--secret / TANDEM_SECRET); a failure on any node stops every node. docs/failures.md shows
each failure report.

From Python
-----------
launch(LaunchConfig(np=2, program="train.py")) runs a job and returns its exit code.
"""

from tandem.launch.config import (
    LaunchConfig,
    LaunchError,
    StartError,
    add_run_arguments,
    config_from_args,
)
from tandem.launch.launcher import launch

__all__ = ["LaunchConfig", "LaunchError", "StartError", "add_run_arguments", "config_from_args",
           "launch"]
