"""The watchdog's monitor: no wait lasts for ever, and a desync is named, not hung.

`watch` wraps the engine `td.init` created in the `WatchedBackend` of `watchdog` (every
world larger than one, every engine: Gloo, NCCL, MPI) and starts this rank's `Watchdog`: the
counters of `watchdog.Ledger` plus a background thread that looks at the waits once per tick
(1 s, 0.25 s in debug mode) and polls one counter on the rendezvous store to see whether a
peer asked where everybody is. The store is touched by that thread only, and by a wait that
failed; nothing here runs on the hot path.

When a wait fails, the rank asks every rank where it is (a request counter on the store; each
rank's thread answers with what it has issued, what it waits for, and its Python stack), and:

- a timeout becomes `WatchdogTimeout` (a `TimeoutError`): which ranks arrived at the
  operation, what the others are doing, every rank's stack. The lowest rank that timed out
  includes the stacks; the others say so and give it time to print them before raising.
- a connection that broke ("Connection closed by peer" from Gloo) becomes
  `PeerUnreachableError` naming the peer that no longer answers, or that left the job.
- a wait past its deadline that the engine does not end (a backstop, `BACKSTOP_MARGIN_S`
  later) is reported by the thread, which then ends the process with exit code 1.

The thread also acts early: a wait older than `DESYNC_GRACE_S` (`DEBUG_GRACE_S` in debug mode)
makes it ask every rank, and a *provable* desync (ranks waiting for each other around a cycle,
two ranks waiting on one place of a stream with different operations, or a wait for a rank that
left; see `waitgraph`) seen twice in a row is reported by the lowest rank involved, which ends
its process: the job stops within seconds instead of at the timeout (a rank that skipped a
`recv`, pipeline stages out of step). A rank that is merely slow (computing) never closes a
cycle, so it is reported only at the timeout, with its stack. Outside debug mode the checks of
one long wait back off (at ages of about 2, 4, 8 ... s, then once a minute): a rank that waits
an hour in a barrier while rank 0 evaluates asks its peers a few dozen times, never per step.

Without a rendezvous store (an MPI job started by plain `mpiexec`) the reports say what this
rank waited for, and the other ranks' states are unknown; MPI jobs of `tandem run` get the
agent's store and report every rank, as Gloo jobs do. `TANDEM_WATCHDOG=0` turns it off.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from itertools import count
from typing import NoReturn

from tandem.comm.agreement import fingerprints
from tandem.comm.engines.backend import Backend
from tandem.comm.watchdog import waitgraph
from tandem.comm.watchdog.board import Board
from tandem.comm.watchdog.watched import (
    WAIT_LIMIT,
    WAIT_OP,
    WAIT_SERIAL,
    WAIT_START,
    Ledger,
    PeerUnreachableError,
    WatchdogTimeout,
    WatchedBackend,
    op_dict,
)
from tandem.job import settings
from tandem.job.environments.adapters import meeting_tag
from tandem.rendezvous import elastic_rounds

TICK_S = 1.0
DEBUG_TICK_S = 0.25
DESYNC_GRACE_S = 2.0  # a wait this old makes the watchdog look for a desync
DESYNC_RECHECK_MAX_S = 60.0  # ...and again after as long as it has lasted, at most this long
DEBUG_GRACE_S = 1.0  # debug mode: sooner
DEBUG_RECHECK_S = 0.5  # ...and again this often while it lasts
DESYNC_CONFIRM_S = 0.3  # a desync must be seen twice, this far apart, before it is reported
ANSWER_S = 3.0  # how long a query waits for every rank's answer
QUERY_POLL_S = 0.05  # store checks while a query waits (a failure path, never the hot path)
REPORTER_WAIT_S = 8.0  # how long a rank that is not the reporter lets the report get out
BACKSTOP_MARGIN_S = 10.0
STACK_FRAMES = 14
EXIT_CODE = 1
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "connection refused", "socket closed")
# Frames of these files are left out of the stacks in reports: they are the watchdog itself.
_OWN_FILES = tuple(os.path.join("comm", "watchdog", name)
                   for name in ("board.py", "monitor.py", "waitgraph.py", "watched.py"))

_generation = count()


def _stack(frame) -> str:
    entries = [e for e in traceback.extract_stack(frame)
               if not e.filename.endswith(_OWN_FILES)]
    return "".join(traceback.format_list(entries[-STACK_FRAMES:]))


def _write_stderr(text: str) -> None:
    data = (text.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        sys.stdout.flush()
    except Exception:
        pass
    while data:
        try:
            written = os.write(2, data)
        except OSError:
            return
        data = data[written:]


class Watchdog(Ledger):
    """One rank's watchdog: the ledger's counters, the monitor thread, queries and reports."""

    def __init__(self, rank: int, size: int, timeout: float, debug: bool,
                 board: Board | None, agent: int | None = None) -> None:
        super().__init__(rank, size, timeout)
        self.debug = debug
        self.board = board
        self.agent = agent  # pid of the tandem agent (under MPI: supervisor) that started this rank
        self._next_check: dict[int, float] = {}  # wait serial -> when to look for a desync again
        self._grace = DEBUG_GRACE_S if debug else DESYNC_GRACE_S
        self._asked: set[int] = set()
        self._served = 0  # requests made while this rank was still starting get answers too
        self._serving = threading.Lock()
        self._left = False
        self._stop = threading.Event()
        self._pause = threading.Event()  # never set: bounded pauses between store checks
        self._ending = threading.Lock()
        self._tick = DEBUG_TICK_S if debug else TICK_S
        self._thread: threading.Thread | None = None
        # An elastic job's world can be over while a rank still waits in it (its launcher
        # formed a later round without one of its workers: a peer died or was dropped): then
        # the engine's connections are shut (`abort_engine`) and the wait fails now, not at the
        # timeout. A round that only grew leaves this world going (`elastic_rounds.publish`).
        self.world_over: Callable[[], bool] | None = None
        self.abort_engine: Callable[[], None] | None = None
        self._abandoned = False
        self._explaining = 0  # failed waits being explained (by `failed`) right now
        self._host = socket.gethostname()

    # -- answers and queries --------------------------------------------------------------
    def answer(self) -> dict:
        """Where this rank is: what it issued, what it waits for, its Python stacks."""
        now = time.monotonic()
        frames = sys._current_frames()
        waits, threads = [], []
        for tid, wait in list(self._waiting.items()):
            threads.append(tid)
            frame = frames.get(tid)
            entry = fingerprints.entry_point(frame)
            mark = fingerprints.last(tid) if self.debug else None
            named = mark is not None and entry == f"td.{mark.collective}"
            op = op_dict(wait[WAIT_OP], self.size)
            if entry and fingerprints.in_argument_check(frame):
                op["detail"] = f"{op['detail']}: the argument check of {entry}"
            waits.append({
                "op": op, "age": now - wait[WAIT_START],
                "timeout": wait[WAIT_LIMIT], "serial": wait[WAIT_SERIAL], "entry": entry,
                "site": fingerprints.site_of(fingerprints.user_frame(frame)),
                "fingerprint": f"{entry} #{mark.seq} at {mark.site}" if named else None,
            })
        main = threading.main_thread().ident
        # Not waiting on a counted operation is not "computing" when the stack is in tandem
        # (a blocking engine call, the agreement's exchange): say where it is.
        inside = None if waits else fingerprints.entry_point(frames.get(main))
        if inside is not None:
            inside += f" (called at {fingerprints.site_of(fingerprints.user_frame(frames[main]))})"
        parts = [_stack(frames[main])] if main in frames else []
        for tid in threads:
            if tid != main and tid in frames:
                parts.append(f"(thread {tid})\n" + _stack(frames[tid]))
        return {"rank": self.rank, "pid": os.getpid(), "host": self._host,
                "state": "left" if self._left else "running", "issued": dict(self._issued),
                "waits": waits, "inside": inside, "stack": "".join(parts)}

    def query(self, again: bool = False) -> dict[int, dict | None]:
        """Every rank's answer (None for ranks that did not answer within `ANSWER_S`).

        `again`: a second look right after a first one, which already gave the ranks that left
        `ANSWER_S` to end their processes: a rank that left counts as answered (its `left`
        answer), so the second look does not wait for it once more."""
        answers: dict[int, dict | None] = {self.rank: self.answer()}
        board = self.board
        if board is None:
            return answers
        generation = board.add("req", 1)
        if generation is None:
            return answers
        self._asked.add(generation)  # our own thread must not answer it (we did, above)
        others = [r for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + ANSWER_S
        while (board.add(f"ans/{generation}/count", 0) or 0) < len(others):
            if time.monotonic() > deadline:
                break
            # A rank that an elastic job's launcher saw die will not answer. (Not so for ranks
            # that left: waiting for them lets a rank that raised and left end its process
            # first, so that its launcher names it rather than the ranks it left waiting.)
            if all(board.get(f"ans/{generation}/{r}") is not None
                   or board.get(f"died/{r}") is not None
                   or (again and board.get(f"left/{r}") is not None) for r in others):
                break
            if self.world_over is not None and self.world_over():
                break  # a later round left out a peer of this world: it will not answer
            self._serve()  # peers may be asking us at the same moment: answer while we wait
            self._pause.wait(QUERY_POLL_S)
        for rank in others:
            text = board.get(f"ans/{generation}/{rank}")
            if text is None:
                text = board.get(f"left/{rank}") or board.get(f"died/{rank}")
            answers[rank] = json.loads(text) if text else None
            board.delete(f"ans/{generation}/{rank}")
        return answers

    def _serve(self) -> None:
        """Answer the requests made since the last call (from any thread: one at a time)."""
        if self.board is None:
            return
        with self._serving:
            latest = self.board.add("req", 0)
            if latest is None or latest <= self._served:
                return
            text = json.dumps(self.answer())
            for generation in range(self._served + 1, latest + 1):
                if generation in self._asked:
                    continue
                self.board.set(f"ans/{generation}/{self.rank}", text)
                self.board.add(f"ans/{generation}/count", 1)
            self._served = latest

    # -- failures -------------------------------------------------------------------------
    def failed(self, wait: tuple, error: BaseException) -> None:
        """Called by a failing `wait`: raise a better error, or return to re-raise `error`.
        While it explains the failure, the monitor thread reports no desync of its own: the
        error raised here (e.g. `PeerUnreachableError` naming a peer that left) is the report."""
        self._explaining += 1
        try:
            self._explain(wait, error)
        finally:
            self._explaining -= 1

    def _explain(self, wait: tuple, error: BaseException) -> None:
        text = str(error).lower()
        # In an elastic job whose launcher already formed the next round, a failed wait needs no
        # inquiry: the peers are dead or gone to that round (asking would wait for them).
        self._raise_if_abandoned(wait, error)
        if isinstance(error, TimeoutError) or "timed out" in text:
            raise self._timeout_error(wait, error, self.query()) from None  # text in message
        if any(marker in text for marker in _LOST_PEER):
            answers = self.query()
            self._raise_if_abandoned(wait, error)  # the launcher moved on while we asked
            mine = self._mine(answers, wait)
            if any(waitgraph.unreachable_peers(mine["op"], self.rank, answers)):
                raise self._unreachable_error(mine, answers, error) from error
            # Every peer still answers: one of them gave up (its own timeout) and hung up.
            raise self._timeout_error(wait, error, answers) from None

    def _raise_if_abandoned(self, wait: tuple, error: BaseException) -> None:
        if self._abandoned or (self.world_over is not None and self.world_over()):
            raise PeerUnreachableError(
                f"rank {self.rank}: {waitgraph.describe_op(op_dict(wait[WAIT_OP], self.size))} "
                f"was abandoned: the elastic job's launcher formed a later round without one of "
                f"this world's workers (it died or was dropped) while this rank waited") from error

    def _mine(self, answers, wait: tuple) -> dict:
        mine = answers[self.rank]
        return next((w for w in mine["waits"] if w["serial"] == wait[WAIT_SERIAL]), {
            "op": op_dict(wait[WAIT_OP], self.size), "age": time.monotonic() - wait[WAIT_START],
            "timeout": wait[WAIT_LIMIT], "serial": wait[WAIT_SERIAL], "entry": None, "site": None,
            "fingerprint": None})

    def _timeout_error(self, wait: tuple, error: BaseException, answers) -> WatchdogTimeout:
        mine = self._mine(answers, wait)
        late = [r for r, a in answers.items()
                if a and any(w["age"] >= w["timeout"] - 0.5 for w in a.get("waits") or [])]
        reporter = min([*late, self.rank])
        if reporter == self.rank:
            report = waitgraph.timeout_report(self.rank, mine, answers)
            if self.board is not None:  # the others may go now: this report is out first
                self.board.add(f"reported/{self.rank}", 1)
        else:
            report = (waitgraph.timeout_report(self.rank, mine, answers, with_stacks=False)
                      + f"\n(rank {reporter} timed out too and reports every rank's stack)")
            self._await_report(reporter)
        if self.board is None:
            report += "\n(no rendezvous store: the other ranks could not be asked where they are)"
        members = set(mine["op"]["members"])
        silent = tuple(sorted(r for r, a in answers.items()
                              if a is None and r != self.rank and r in members))
        return WatchdogTimeout(f"{error}\n{report}", silent)

    def _await_report(self, reporter: int) -> None:
        """Let the reporting rank print before this one exits (and its launcher stops the job)."""
        deadline = time.monotonic() + REPORTER_WAIT_S
        while self.board and self.board.get(f"reported/{reporter}") is None:
            if time.monotonic() > deadline or self.board.get(f"left/{reporter}") is not None:
                return
            self._serve()
            self._pause.wait(QUERY_POLL_S)

    def _unreachable_error(self, mine: dict, answers, error: BaseException
                           ) -> PeerUnreachableError:
        silent, left = waitgraph.unreachable_peers(mine["op"], self.rank, answers)
        reasons = [f"rank {r} is unreachable: it {waitgraph.NO_ANSWER}" for r in silent]
        reasons += [f"rank {r} has left the job (td.shutdown or exit) and will not take part"
                    for r in left]
        call = mine.get("fingerprint") or f"{mine.get('entry') or ''} at {mine.get('site')}"
        hint = f"\n{waitgraph.LEFT_EARLY_HINT}" if left else ""
        return PeerUnreachableError(
            f"rank {self.rank}: {waitgraph.describe_op(mine['op'])} (called as {call}) failed: "
            + "; ".join(reasons) + f".{hint}\nThe engine said: {error}"
        )

    def _end_job(self, report: str) -> NoReturn:
        """Print the report and end this process: its launcher stops the rest of the job."""
        with self._ending:
            _write_stderr(report)
            os._exit(EXIT_CODE)

    # -- the monitor thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave the job: say so on the board (peers waiting for us learn why), stop the thread."""
        self._left = True
        if self.board is not None:
            self.board.set(f"left/{self.rank}", json.dumps(self.answer()))
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if self.board is not None:
            self.board.close()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            if self.agent is not None and os.getppid() != self.agent:
                self._end_job(f"tandem watchdog: rank {self.rank}: the agent (or MPI supervisor) "
                              f"that started it (pid {self.agent}) is gone; ending this rank so "
                              "that it does not outlive its job")
            try:
                self._serve()
                self._inspect()
            except Exception as error:  # diagnostics must never take the job down themselves
                _write_stderr(f"tandem watchdog (rank {self.rank}): internal error: {error!r}")

    def _inspect(self) -> None:
        now = time.monotonic()
        for wait in list(self._waiting.values()):
            age = now - wait[WAIT_START]
            if age > wait[WAIT_LIMIT] + BACKSTOP_MARGIN_S:
                answers = self.query()
                self._end_job(
                    waitgraph.timeout_report(self.rank, self._mine(answers, wait), answers)
                    + "\n(the engine itself did not give up on this wait: the watchdog ends "
                    "the process)"
                )
            if (age >= self._tick and self.world_over is not None and not self._abandoned
                    and self.world_over()):
                self._abandoned = True
                self.abort_engine()
                return
            serial = wait[WAIT_SERIAL]
            if age >= self._grace and now >= self._next_check.get(serial, 0.0):
                recheck = DEBUG_RECHECK_S if self.debug else min(age, DESYNC_RECHECK_MAX_S)
                self._next_check = {serial: now + recheck}  # only the waits of the moment matter
                self._look_for_desync()

    def _look_for_desync(self) -> None:
        if self._explaining:
            return  # a failed wait is being explained: its error is the report
        answers = self.query()
        desync = waitgraph.find_desync(answers, self._grace)
        if desync is None or desync.reporter != self.rank:
            return
        # Seen twice, a short while apart, with the same waits: not a snapshot artefact.
        self._pause.wait(DESYNC_CONFIRM_S)
        again_answers = self.query(again=True)
        again = waitgraph.find_desync(again_answers, self._grace)
        if (again is not None and set(again.ranks) == set(desync.ranks)
                and self._still_waiting(again_answers)):
            self._end_job(waitgraph.desync_report(self.rank, again, again_answers))

    def _still_waiting(self, answers) -> bool:
        """This rank still waits in a wait of its answer, none of them failed and explained (the
        error raised for it, e.g. `PeerUnreachableError`, is then the report)."""
        if self._explaining:
            return False
        serials = {w["serial"] for w in answers[self.rank]["waits"]}
        return any(wait[WAIT_SERIAL] in serials for wait in list(self._waiting.values()))


def enabled() -> bool:
    return settings.current().watchdog


def watch(engine: Backend, job, timeout: float, debug: bool) -> Backend:
    """The engine wrapped by a started watchdog (or unchanged: a world of one, TANDEM_WATCHDOG=0)."""
    fingerprints.reset()
    if job.size == 1 or not enabled():
        return engine
    board = None
    if job.master_port is not None:
        tag = meeting_tag(job, settings.current().restart, next(_generation))
        prefix = f"tandem/watchdog/{tag}/"
        board = Board.connect(job.master_addr or "127.0.0.1", job.master_port, prefix,
                              job.store_key)
    # Ranks of `tandem run` end with their agent even if it is killed without a word. The parent
    # is the agent itself, or under MPI the rank's supervisor (launch/mpi/rank.py), which kills
    # its rank when the agent goes: watching the parent covers both.
    agent = os.getppid() if job.source == "tandem" and job.store_hosted else None
    dog = Watchdog(job.rank, job.size, float(timeout), bool(debug), board, agent)
    if job.elastic is not None and board is not None:
        dog.world_over = lambda: board.get(elastic_rounds.OVER) is not None
        dog.abort_engine = engine.abort
    dog.start()
    return WatchedBackend(engine, dog)
