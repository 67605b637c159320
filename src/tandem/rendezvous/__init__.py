"""The rendezvous store: where ranks meet before any backend exists.

A launcher (`tandem run`, `td.spawn`, the test harness) *hosts* a `StoreServer` on port 0, so
the operating system picks a free port and keeps it bound: two jobs on one machine can never
race for the same port, and the store outlives any rank that dies. It listens on the address
it is given only (127.0.0.1 for a one-node job), and every client must prove that it holds the
store's key before it can read or write a key (`server`): the launcher makes a key per job
(a multi-node job derives it from the job's secret, `store_key`) and gives it to its ranks
as `TANDEM_STORE_KEY`. Ranks connect with `connect_store`, which gives torch a
`dist.Store`.

Where tandem did not start the job, rank 0 hosts the store (`host_store`): an authenticated
one when the ranks share a key (`TANDEM_STORE_KEY`; under a plain `mpiexec` rank 0 sends a new
one over MPI), else torch's `TCPStore`, which is also what ranks use to join a store that
another launcher hosts (torchrun's agent). Ranks numbered by hand (`td.init(rank=,
world_size=)`) first answer a roll call there (`roll_call`), so that a missing rank, a rank
given twice or another world size is named before any engine connects.

The server and its client are plain Python (no torch), so `tandem run`'s parent never loads
torch; `connect_store`/`host_store` load it, for the ranks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.rendezvous.auth import AuthenticationFailed, derive_key, new_secret
from tandem.rendezvous.client import StoreClient, StoreTimeout
from tandem.rendezvous.roll_call import RendezvousError
from tandem.rendezvous.server import PortInUseError, StoreServer, listen

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["AuthenticationFailed", "PortInUseError", "RendezvousError", "StoreClient",
           "StoreServer", "StoreTimeout", "connect_store", "host_store", "new_key", "store_key"]


def new_key() -> str:
    """A fresh store key, for a job whose ranks all learn it from one launcher."""
    return new_secret()


def store_key(secret: str) -> str:
    """The store's key of a multi-node job: every agent derives it from the job's secret, and
    ranks get this key, never the secret that lets an agent join the control plane."""
    return derive_key(secret, "rendezvous store")


def connect_store(addr: str, port: int, timeout: float = DEFAULT_TIMEOUT_S,
                  key: str | None = None) -> dist.Store:
    """A client of the store someone else hosts (tandem's with `key`, else a torch TCPStore);
    fails with the address after `timeout`."""
    if key is not None:
        from tandem.rendezvous.torch_store import AuthenticatedStore

        return AuthenticatedStore(StoreClient(addr, port, key, timeout))
    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        raise ConnectionError(
            f"cannot reach the rendezvous store at {addr}:{port} within {timeout:.0f} s "
            f"({error}). Is the master address right and the job's rank 0 / agent running?"
        ) from None


def host_store(addr: str, port: int, timeout: float = DEFAULT_TIMEOUT_S,
               key: str | None = None) -> dist.Store:
    """Rank 0 hosts the store on `addr:port` and is its first client (`.port` says where).

    With `key`, tandem's authenticated store; without, torch's TCPStore (the other ranks may be
    plain torch). Either way we bind the socket ourselves, on `addr` only: a TCPStore left to
    bind alone listens on every interface.
    """
    if key is not None:
        from tandem.rendezvous.torch_store import AuthenticatedStore

        server = StoreServer(addr, port, key)
        client = StoreClient("127.0.0.1" if addr in ("0.0.0.0", "") else addr, server.port,
                             key, timeout)
        return AuthenticatedStore(client, server)
    listener = listen(addr, port)
    import torch.distributed as dist

    # detach(): the store owns the socket from now on; Python must not close it under it.
    return dist.TCPStore(
        addr, listener.getsockname()[1], is_master=True, timeout=timedelta(seconds=timeout),
        wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False,
    )
