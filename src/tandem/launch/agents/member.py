"""The agent of node 1, 2... of every multi-node job, fixed or elastic: one loop for both.

It joins node 0 (`_join`: at the store's port, authenticated with the store's key, then on
the same connection with the job's secret: `control.join`), then runs what node 0 gives it
until node 0 says the job is over:

- `("workers", ...)`: a fixed job's attempt (every rank of the attempt here), or an elastic
  round's new workers. Every exit, 0 included, is reported (`"exit"`, once the rank's output is
  drained, with its last lines); a fixed job's failure also stops this node's ranks at once,
  and node 0 then restarts or finishes the job once every rank is down; an elastic one's forms
  the next round, and nothing stops here unless node 0 says so (`"stop"`, `"kill"` for a stuck
  worker);
- `"finish"`: the job's code and summary, printed here; the agent stops what is left and exits
  with that code. A lost node 0 stops this node's ranks and exits 1; Ctrl-C here tells node 0
  (`"interrupted"`) and stops them (an elastic job goes on without this machine).
"""

from __future__ import annotations

import socket
from typing import TextIO

from tandem import rendezvous
from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents import control
from tandem.launch.agents.admission import versions
from tandem.launch.agents.nodes import lost_after
from tandem.launch.config import LaunchConfig
from tandem.launch.local.ranks import Placement
from tandem.launch.local.supervisor import DRAIN_S, Agent, Supervisor


class Member(Agent):
    """The agent of node 1, 2...: joins node 0, runs the ranks it is given, reports their exits,
    stops when told; `run()` returns the job's code (node 0's)."""

    def __init__(self, config: LaunchConfig, secret: str, interface: str | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__(config, stdout=stdout, stderr=stderr)
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
            conn = control.join(rendezvous.StoreClient(
                host, port, rendezvous.store_key(self.secret), timeout), self.secret)
        except control.AuthenticationFailed as error:  # at the store or the control plane
            self.say(f"cannot join node 0 at {self.master}: {error} (the secrets differ). "
                     "Give every node the same --secret (or TANDEM_SECRET)")
            return 2
        except RuntimeError as error:  # a store that takes no agents
            self.say(f"the rendezvous store at {self.master} has no tandem control plane "
                     f"({error}); is node 0 a `tandem run --nnodes` agent of this job?")
            return 1
        except ConnectionError as error:
            self.say(f"node 0 is unreachable: {error}")
            return 1
        conn.send(("hello", {"node_rank": self.config.node_rank, "nnodes": self.config.nnodes,
                             "nproc": self.config.np, "host": socket.gethostname(),
                             "elastic": self.config.elastic, "job": self.config.job_id,
                             **versions()}))
        self.peer = control.Peer(conn, 0, self.events, lost_after(self.config))
        self.peer.start()
        return None

    def _run(self) -> int:
        code = self._join()
        if code is not None:
            return code
        watch = Supervisor(self.ranks, self.events, self.output, node=self.config.node_rank,
                           host=socket.gethostname(), member=self)
        watch.run()
        self.output.join(DRAIN_S)
        return watch.verdict()

    def start(self, body: dict) -> None:
        """Node 0's word `workers` (`Coordinator.start_on`): a fixed attempt's ranks, or an
        elastic round's new workers, on this machine."""
        placement = Placement(**{**body["placement"], "store": tuple(body["placement"]["store"]),
                                 "store_key": rendezvous.store_key(self.secret),
                                 "gloo_interface": self.interface})
        self.ranks.start(placement, body["workers"], body["slots"], body["round"])


__all__ = ["Member"]
