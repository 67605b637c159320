"""The agent of node 1, 2... of every multi-node job, fixed or elastic: one loop for both.

It joins node 0 (`_join`: the store, then the control plane, authenticated with the job's
secret), then runs what node 0 gives it until node 0 says the job is over:

- a fixed job's attempt (`("start", placement)`): every rank of the attempt; a rank's failure
  is reported at once (`"exit"`) and stops this node's ranks, and once they are all down the
  agent says so (`"done"`, with the failed ranks' last lines) and waits for node 0's word: the
  next attempt, or the finish;
- an elastic round's new workers (`("workers", ...)`): every worker's exit, 0 included, is
  reported (`"exit"`) and node 0 forms the next round; nothing stops here unless node 0 says so
  (`"stop"`, `"kill"` for a stuck worker);
- `"finish"`: the job's code and summary, printed here; the agent stops what is left and exits
  with that code. A lost node 0 stops this node's ranks and exits 1; Ctrl-C here tells node 0
  (`"interrupted"`) and stops them (an elastic job goes on without this machine).
"""

from __future__ import annotations

import signal
import socket
from typing import TextIO

from tandem import rendezvous
from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents import control
from tandem.launch.agents.admission import versions
from tandem.launch.agents.nodes import ElasticRanks, lost_after
from tandem.launch.config import LaunchConfig
from tandem.launch.events import Event, JobState, Lost, Message
from tandem.launch.local.ranks import Placement
from tandem.launch.local.supervisor import DRAIN_S, Agent, Failure, Supervisor


class Member(Agent):
    """The agent of node 1, 2...: joins node 0, runs the ranks it is given, reports their exits,
    stops when told; `run()` returns the job's code (node 0's)."""

    def __init__(self, config: LaunchConfig, secret: str, interface: str | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__(config, ranks=ElasticRanks, stdout=stdout, stderr=stderr)
        self.secret, self.interface = secret, interface
        self.peer: control.Peer | None = None
        self.master = "{}:{}".format(*config.master)

    def say(self, text: str) -> None:
        self.output.message(f"tandem run (node {self.config.node_rank}): {text}")

    def close(self) -> None:
        super().close()
        if self.peer is not None:
            self.peer.close()

    def _join(self) -> int | None:
        """Connect and authenticate; None when joined, else the exit code (after saying why)."""
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S
        host, port = self.config.master
        try:
            store = rendezvous.StoreClient(host, port, rendezvous.store_key(self.secret), timeout)
            try:
                address = store.get("tandem/control").decode()
            finally:
                store.close()
            control_host, control_port = address.rsplit(":", 1)
            conn = control.connect((control_host, int(control_port)), self.secret, timeout)
        except control.AuthenticationFailed as error:  # at the store or the control plane
            self.say(f"cannot join node 0 at {self.master}: {error} (the secrets differ). "
                     "Give every node the same --secret (or TANDEM_SECRET)")
            return 2
        except rendezvous.StoreTimeout as error:  # a store without the control plane's address
            self.say(f"the rendezvous store at {self.master} has no tandem control plane "
                     f"({error}); is node 0 a `tandem run --nnodes` agent of this job?")
            return 1
        except ConnectionError as error:
            self.say(f"node 0 is unreachable: {error}")
            return 1
        conn.send(("hello", {"node_rank": self.config.node_rank, "nnodes": self.config.nnodes,
                             "nproc": self.config.np, "host": socket.gethostname(),
                             "elastic": self.config.elastic, **versions()}))
        self.peer = control.Peer(conn, 0, self.events, lost_after(self.config))
        self.peer.start()
        return None

    def _run(self) -> int:
        code = self._join()
        if code is not None:
            return code
        watch = _MemberWatch(self)
        watch.run()
        self.output.join(DRAIN_S)
        return watch.verdict()


class _MemberWatch(Supervisor):
    """Node k's side of the job, over all its attempts or rounds: every exit goes to node 0,
    which decides; node 0's stop, its finish or its loss ends this node's ranks."""

    def __init__(self, member: Member) -> None:
        super().__init__(member.ranks, member.events, member.output,
                         node=member.config.node_rank, host=socket.gethostname())
        self.member = member
        self.elastic = member.config.elastic
        self.attempt: int | None = None  # a fixed job's attempt whose ranks run here
        self.failed: dict[int, int] = {}  # ... and its ranks that failed
        self.ended: tuple[str, object] | None = None  # ("finish", body) / ("lost", why) / ...
        self.what = "workers" if self.elastic else "ranks"

    def others_running(self) -> bool:
        return self.ended is None

    def rank_exited(self, rank: int, returncode: int) -> None:
        self.failed[rank] = returncode
        self.member.peer.send(("exit", {"attempt": self.attempt, "rank": rank, "worker": rank,
                                        "returncode": returncode,
                                        "pid": self.ranks.pids.get(rank),
                                        "tail": list(self.output.tail(rank))}))
        if not self.elastic:  # a fixed job stops at its first failure: here at once
            self.stop(self.rank_failure(rank, returncode))
        self._settled()

    def rank_finished(self, rank: int) -> None:
        if self.elastic:
            self.member.peer.send(("exit", {"worker": rank, "returncode": 0}))
        self._settled()

    def _settled(self) -> None:
        """Once this node's ranks are all down: a fixed job's attempt is over here (say so, with
        the failed ranks' last lines); a stop node 0 asked for is over. Wait for node 0's word
        (the next attempt or round, or the finish) without a deadline again."""
        if self.ranks.live:
            return
        if self.attempt is not None:
            self.output.join(DRAIN_S)
            tails = {rank: self.output.tail(rank) for rank in self.failed}
            self.member.peer.send(("done", {"attempt": self.attempt, "tails": tails}))
            self.attempt = None
        if self.ended is None and self.stopping:
            self.advance(JobState.RUNNING)

    def interrupted(self, signum: int) -> None:
        """Ctrl-C here: node 0 hears of it. An elastic job goes on without this machine; a fixed
        job's node 0 stops the attempt and ends the job, whose code this agent waits for."""
        self.member.peer.send(("interrupted", {"attempt": self.attempt, "signum": signum}))
        if self.elastic:
            super().interrupted(signum)
        elif self.ranks.live:
            self.stop(Failure(node=self.node, host=self.host, interrupt=signum), signum)
        if self.elastic or not self.ranks.live:
            self.ended = ("signal", signum)

    def _stop_ranks(self) -> None:
        if self.ranks.live and not self.stopping:
            self.stop(None)

    def other(self, event: Event) -> None:
        if isinstance(event, Lost):
            self.member.say(f"node 0 ({self.member.master}) is unreachable: {event.why}; "
                            f"stopping this node's {self.what}")
            self.ended = ("lost", event.why)
            self.attempt = None  # node 0 is gone: nobody to tell
            self._stop_ranks()
            return
        if not isinstance(event, Message):
            return
        kind, body = event.kind, event.body
        if kind == "start" and self.ended is None:  # a fixed job's attempt
            self.attempt, self.failed, self.failure = body["attempt"], {}, None
            self.ranks.start(Placement(
                body["attempt"], body["offset"], body["world"], tuple(body["store"]),
                rendezvous.store_key(self.member.secret), self.member.interface,
                torch_port=body.get("torch_port"), run_id=body.get("run_id", ""),
                node=body.get("node", 0), nodes=body.get("nodes", 1)))
        elif kind == "workers" and self.ended is None and not self.stopping:  # elastic
            self.ranks.start_workers(body["workers"], body["slots"], body["first_rank"],
                                     body["size"], body["round"], tuple(body["store"]),
                                     rendezvous.store_key(self.member.secret),
                                     self.member.interface)
        elif kind == "stop" and body.get("attempt", self.attempt) == self.attempt:
            self._stop_ranks()
        elif kind == "kill":  # a stuck worker (`elastic._ElasticWatch._silent`)
            self.ranks.signal(signal.SIGKILL, set(body["workers"]))
        elif kind == "finish":
            self.ended = ("finish", body)
            self._stop_ranks()
        elif kind == "refused":
            self.member.say(f"node 0 refused this agent: {body['reason']}")
            self.ended = ("refused", body)
        elif kind == "note":
            self.output.message(body["text"])

    def give_up(self) -> None:
        self.member.say(f"{self.what} {sorted(self.ranks.live)} did not exit after SIGKILL")

    def verdict(self) -> int:
        kind, body = self.ended or ("lost", None)
        if kind == "finish":
            if body.get("summary"):
                self.output.message(body["summary"])
            return int(body["code"])
        if kind == "signal":
            return 128 + int(body)
        return 2 if kind == "refused" else 1


__all__ = ["Member"]
