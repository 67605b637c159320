"""Whether any rank joined the job, so that `tandem run` can say when none did.

A script that never joins (a single-process example, a library that does not recognise the
launcher) runs N independent copies under `tandem run -np N`, each training alone, and exits 0;
nothing else would say so. Every way of joining ends with the rank connecting to the job's
store, which this agent hosts and which counts the clients that proved its key
(`StoreServer.clients`, a count that only grows):

- tandem's way (`td.init()`): the rank uses that store;
- torch's way (`dist.init_process_group` on any backend, with the torchrun variables
  `tandem run` exports or a MASTER_PORT of the script's own): once the group exists, the rank
  says so to the store (`rendezvous.torch_rendezvous.report_joined`). tandem's `sitecustomize`
  (`launch/rank_site`) imports tandem into every rank, so this holds for a script that never
  imports tandem too.

So the verdict is read from what the ranks did, once they are all gone: nothing is polled, and
no port is watched (a listener on MASTER_PORT could come and go between two looks, and a script
that picks its own port has none to watch).

`JoinWatch.verdict()` is the line printed at the end of a job that exited 0 without anyone
joining: a warning, or with `--require-join` an error (exit code 1).
"""

from __future__ import annotations

from tandem.rendezvous import StoreServer

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
    """Whether a rank of the attempt about to start joined: a client of `store` from now on
    (see the module's docstring). Made before the attempt's ranks start."""

    def __init__(self, store: StoreServer) -> None:
        self.store = store
        # Earlier clients (the other nodes' agents, ranks of earlier attempts) do not count.
        self._clients_before = store.clients

    def joined(self) -> bool:
        return self.store.clients > self._clients_before

    def verdict(self, np: int, program: str, required: bool) -> str | None:
        """None when a rank joined (or there is one rank); else the line to print."""
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
