"""A preemption or walltime signal becomes a step boundary that every rank agrees on.

Every allocation ends: a walltime limit, a preemption on a shared partition or a spot instance
sends SIGTERM (or the signal `#SBATCH --signal=B:USR1@120` asks for) minutes before the kill.
With a `td.Checkpointer` in the script (or after the first `td.preempted()`), tandem catches
those signals on every rank and only notes them; nothing is done inside the handler.

    signal heard (one rank is enough)   ->   the next step's agreement carries it
    every rank learns it in the SAME step ->   td.preempted() is True / Checkpointer.save saves
    then: exit with EXIT_PREEMPTED (75, "temporary failure: resume me"); under SLURM rank 0
    first asks `scontrol requeue $SLURM_JOB_ID`, so the requeued job restores the checkpoint.

How the ranks agree without paying per step: the data-parallel reducer already sends one
agreement message per step (`parallel/operation_check.py`); it carries this rank's
flag (`requested()`) as one more code, read with MAX, so every rank sees the same answer in the
same round. Where no such agreement runs (one process, checks off, NCCL, no reducer), the
Checkpointer's save call agrees with one small all-reduce of the flag, only while armed.

What is heard:
- the signals of TANDEM_PREEMPT_SIGNALS (default `TERM,USR1`; e.g. `USR2`, or `TERM,USR1,USR2`);
- a known walltime: SLURM_JOB_END_TIME (seconds since the epoch, set by SLURM 23.02 and later;
  under an older SLURM, the first rank asks `squeue` once for the job's time left), or
  TANDEM_TIME_LIMIT (seconds after arming, e.g. `tandem run`'s time limit), minus the lead
  TANDEM_PREEMPT_LEAD (seconds, default 120: the time a step and a save need).

A second signal means stop now (the same signal again within REPEAT_S is the first one delivered
twice, as SLURM does at a time limit): the process exits at once with EXIT_PREEMPTED, and the
previous checkpoint stands (a save in progress is never published: it is written under a
temporary name). A signal before the first step (start-up: `arm` was called, no step yet)
exits at once with EXIT_PREEMPTED and the reason: there is nothing to save yet.

This module is the standard library only: the launcher and the rank share EXIT_PREEMPTED.
The environment is read here, once, when the handler is armed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run me again
DEFAULT_SIGNALS = ("TERM", "USR1")
DEFAULT_LEAD_S = 120.0
# The same signal again this soon is one signal delivered twice, not a second one: at a time
# limit SLURM signals every task and srun passes the signal on to them too.
REPEAT_S = 2.0


class Preempted(SystemExit):
    """Raised by `Checkpointer.save` after the agreed preemption save: the script exits with
    EXIT_PREEMPTED ("preempted, resume me"). Catch it to do more before exiting."""

    def __init__(self, reason: str, step: int | None = None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.reason = reason
        self.step = step

    def __str__(self) -> str:
        return self.reason


class _State:
    armed = False
    signals: tuple[int, ...] = ()
    heard: str | None = None  # what this rank heard: "SIGUSR1", "walltime"
    heard_at = 0.0  # time.monotonic() when it was heard
    saved = False  # the agreed save is done: the process is on its way out with EXIT_PREEMPTED
    requeueing = False  # rank 0 waits for `scontrol requeue`, whose stop signals this process
    stop_now = False  # a signal came while it waited: exit once the requeue's answer is out
    deadline: float | None = None  # time.time() at which the walltime lead begins
    agreed = False  # the ranks agreed to stop at this step boundary
    boundaries = 0  # step boundaries reached (a signal before the first one: start-up)
    rounds = 0  # per-step agreements that carried the flag (the reducer's)
    seen_rounds = 0  # `rounds` at the last step boundary


_state = _State()


def signal_numbers(text: str | None) -> tuple[int, ...]:
    """`TERM,USR1` -> (SIGTERM, SIGUSR1); a name that is no signal is a ValueError with the fix."""
    names = [n.strip().upper() for n in (text or ",".join(DEFAULT_SIGNALS)).split(",") if n.strip()]
    numbers = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT"):
            raise ValueError(f"TANDEM_PREEMPT_SIGNALS={text!r}: {name!r} is not a signal a "
                             f"scheduler sends before a kill; choose from TERM, USR1, USR2, "
                             f"INT, HUP, CONT (comma-separated)")
        numbers.append(int(getattr(signal, full)))
    return tuple(numbers)


def deadline_of(env: Mapping[str, str], now: float) -> float | None:
    """The moment (time.time()) to stop for the walltime, or None when none is known."""
    lead = float(env.get("TANDEM_PREEMPT_LEAD") or DEFAULT_LEAD_S)
    end = None
    if env.get("SLURM_JOB_END_TIME"):
        end = float(env["SLURM_JOB_END_TIME"])
    if env.get("TANDEM_TIME_LIMIT"):
        limit = now + float(env["TANDEM_TIME_LIMIT"])
        end = limit if end is None else min(end, limit)
    return None if end is None else end - lead


_RANK_VARIABLES = ("TANDEM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def time_left(text: str) -> float | None:
    """squeue's `%L` (`MM:SS`, `H:MM:SS`, `D-HH:MM:SS`) in seconds; None for UNLIMITED and the like."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not days.isdigit() and days or not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return int(days or 0) * 86400 + seconds


def slurm_end_time(env: Mapping[str, str], now: float) -> float | None:
    """The job's end (time.time()) from `squeue -j $SLURM_JOB_ID -o %L`, asked by the first rank
    only (the per-step agreement carries its flag to the others); None when unknown (said once,
    with the fix, when squeue cannot tell)."""
    job = env.get("SLURM_JOB_ID")
    rank = next((env[name] for name in _RANK_VARIABLES if name in env), "0")
    if not job or rank != "0":
        return None
    squeue = shutil.which("squeue")
    try:
        done = subprocess.run([squeue or "squeue", "-h", "-j", job, "-o", "%L"],
                              capture_output=True, text=True, timeout=30, check=False)
        answer = done.stdout.strip() if done.returncode == 0 else (done.stderr.strip()
                                                                   or f"exit {done.returncode}")
    except (OSError, subprocess.TimeoutExpired) as error:
        answer = str(error)
    left = time_left(answer)
    if left is None and answer not in ("UNLIMITED", "NOT_SET"):
        _say(f"SLURM job {job}: its time left is unknown (squeue -j {job} -o %L said "
             f"{answer!r}); its walltime is caught only by a signal: add "
             f"'#SBATCH --signal=B:USR1@120' (or set SLURM_JOB_END_TIME)")
    return None if left is None else now + left


def arm(env: Mapping[str, str] | None = None) -> bool:
    """Catch the preemption signals in this process (once; main thread only). True when armed."""
    if _state.armed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    env = os.environ if env is None else env
    _state.signals = signal_numbers(env.get("TANDEM_PREEMPT_SIGNALS"))
    now = time.time()
    if env.get("SLURM_JOB_ID") and not env.get("SLURM_JOB_END_TIME"):
        end = slurm_end_time(env, now)
        env = env if end is None else {**env, "SLURM_JOB_END_TIME": str(end)}
    _state.deadline = deadline_of(env, now)
    for signum in _state.signals:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _heard)
    _state.armed = True
    return True


def disarm() -> None:
    """Give the signals back to their defaults and forget what was heard (tests, shutdown)."""
    if _state.armed and threading.current_thread() is threading.main_thread():
        for signum in _state.signals:
            if signal.getsignal(signum) is _heard:
                signal.signal(signum, signal.SIG_DFL)
    vars(_state).clear()  # back to _State's defaults


def _say(text: str) -> None:
    try:
        os.write(2, f"tandem: {text}\n".encode())
    except OSError:
        pass


def _heard(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if _state.heard is not None:
        if name == _state.heard and time.monotonic() - _state.heard_at < REPEAT_S:
            return  # the first one, delivered twice
        if _state.saved:  # the save is done: exit now, quietly (the requeue's own SIGTERM)
            if _state.requeueing:
                _state.stop_now = True  # once scontrol has said whether it requeued
                return
            os._exit(EXIT_PREEMPTED)
        _say(f"{name} after {_state.heard}: stopping now (exit {EXIT_PREEMPTED}); the previous "
             f"checkpoint stands")
        os._exit(EXIT_PREEMPTED)
    _state.heard, _state.heard_at = name, time.monotonic()
    if _state.boundaries == 0:
        reason = (f"preempted by {name} during start-up, before the first step: nothing to save "
                  f"yet; exiting with {EXIT_PREEMPTED} (resume me)")
        _say(reason)
        raise Preempted(reason)


def requested() -> int:
    """1 when this rank heard a signal or reached its walltime lead, else 0 (per step: a flag
    read, and a clock read when a walltime is known)."""
    if _state.heard is not None:
        return 1
    if _state.deadline is not None and time.time() >= _state.deadline:
        _state.heard = "walltime"
        return 1
    return 0


def boundary() -> None:
    """A step boundary was reached (a signal from now on waits for the agreement)."""
    _state.boundaries += 1


def carried(agreed: bool) -> None:
    """A per-step agreement carried the flags: `agreed` when some rank's was set."""
    _state.rounds += 1
    if agreed:
        _state.agreed = True


def carried_since_last_boundary() -> bool:
    """Whether a per-step agreement carried the flags since the last time this was asked (the
    same answer on every rank: the reducer's rounds are agreed)."""
    fresh = _state.rounds != _state.seen_rounds
    _state.seen_rounds = _state.rounds
    return fresh


def armed() -> bool:
    return _state.armed


def agreed() -> bool:
    """The ranks agreed to stop at this step boundary."""
    return _state.agreed


def agree_now(value: bool) -> None:
    if value:
        _state.agreed = True


def heard() -> str | None:
    return _state.heard


def _deaf_to_the_stop() -> None:
    """In scontrol's process, before it starts: SIGTERM ignored (kept across exec)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def requeue(env: Mapping[str, str] | None = None) -> str:
    """Under SLURM, ask the scheduler to requeue this job (rank 0 only); what was done, in words."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return f"exit {EXIT_PREEMPTED} asks the launcher to run the job again"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return (f"SLURM job {job}: no scontrol on PATH to requeue it; exit {EXIT_PREEMPTED} "
                f"(sbatch --requeue with a script that requeues on {EXIT_PREEMPTED} resumes it)")
    try:
        # The requeue stops this job at once: SLURM sends SIGTERM to every process of it,
        # scontrol included, which must live to say whether the requeue was taken.
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=30, check=False, preexec_fn=_deaf_to_the_stop)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"SLURM job {job}: scontrol requeue failed ({error}); exit {EXIT_PREEMPTED}"
    if done.returncode:
        return (f"SLURM job {job}: scontrol requeue said {done.stderr.strip() or done.returncode}; "
                f"exit {EXIT_PREEMPTED}")
    return f"SLURM job {job} requeued (scontrol requeue)"


def stop(step: int, rank: int, saved: str) -> Preempted:
    """The exception that ends the script after the agreed save (rank 0 requeues first)."""
    _state.saved = True  # a signal from now on ends the process at once, quietly
    what = f"exit {EXIT_PREEMPTED}"
    if rank == 0:
        _state.requeueing = True  # under SLURM the requeue signals every task of the job
        try:
            what = requeue()
        finally:
            _state.requeueing = False
    reason = (f"rank {rank}: preempted ({_state.heard or 'another rank heard it'}); every rank "
              f"stopped after step {step}; {saved}; {what}")
    if rank == 0:
        print(f"tandem: {reason}", file=sys.stderr, flush=True)
    if _state.stop_now:  # SLURM is stopping this job already (the requeue): no slow exit
        os._exit(EXIT_PREEMPTED)
    return Preempted(reason, step)
