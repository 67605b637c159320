"""Whether any rank joined the job, so that `tandem run` can say when none did.

A script that never joins (a single-process example, a library that does not recognise the
launcher) runs N independent copies under `tandem run -np N`, each training alone, and exits 0;
nothing else would say so. A rank joins in one of two ways, and the agent sees both without
touching the ranks:

- tandem's way (`td.init()`, or `init_process_group("tandem" | "mpi")`): the rank connects
  to the job's store, which this agent hosts and which counts the clients that proved its key
  (`StoreServer.clients`);
- torch's way (`dist.init_process_group("gloo")` with the torchrun variables `tandem run`
  exports): rank 0 listens on MASTER_PORT, a port this agent picked; a thread reads the
  kernel's socket table (/proc/net/tcp, tcp6) for that listener, often at first and less
  often later (the listener lives from init to exit), and stops once it saw one.

`JoinWatch.verdict()` is the line printed at the end of a job that exited 0 without anyone
joining: a warning, or with `--require-join` an error (exit code 1).
"""

from __future__ import annotations

import threading

from tandem.rendezvous import StoreServer

FIRST_LOOK_S = 0.02
LATEST_LOOK_S = 0.5
_LISTEN = "0A"  # the state column of a listening socket in /proc/net/tcp


def listening(port: int) -> bool:
    """Whether a socket of this network namespace listens on TCP `port` (IPv4 or IPv6)."""
    suffix = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == _LISTEN and fields[1].endswith(suffix):
                        return True
        except OSError:
            continue
    return False


class JoinWatch:
    """Watches one attempt for a rank that joins: a client of `store`, or a listener on
    `torch_port` (None: torch's rendezvous is not on this machine, only the store counts)."""

    def __init__(self, store: StoreServer, torch_port: int | None) -> None:
        self.store, self.torch_port = store, torch_port
        self._seen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-join-watch", daemon=True)

    def start(self) -> JoinWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = FIRST_LOOK_S
        while not self._stop.wait(delay):
            if self._joined_now():
                self._seen = True
                return
            delay = min(delay * 1.5, LATEST_LOOK_S)

    def _joined_now(self) -> bool:
        return self.store.clients > 0 or (self.torch_port is not None
                                          and listening(self.torch_port))

    def stop(self) -> None:
        self._stop.set()

    def joined(self) -> bool:
        return self._seen or self._joined_now()

    def verdict(self, np: int, program: str, required: bool) -> str | None:
        """None when a rank joined (or there is one rank); else the line to print."""
        self.stop()
        if np < 2 or self.joined():
            return None
        head = "error" if required else "warning"
        tail = ("" if required else " (--require-join or TANDEM_REQUIRE_JOIN=1 makes this an "
                "error)")
        return (f"tandem run: {head}: {np} independent copies of {program} ran: no rank joined "
                "the job (neither td.init() nor torch.distributed's init_process_group was "
                "called), so each one computed alone. Call td.init(), or "
                "dist.init_process_group(), in the script; a script for one process is run with "
                f"-np 1{tail}.")
