"""torch's own rendezvous (`init_process_group` with env:// or tcp://) as tandem runs it.

Two things torch cannot do alone, both set up by `comm.torch_pg.register.register`:

- `bound_c10d_store(module, TCPStore, job_store)` wraps
  `torch.distributed.rendezvous._create_c10d_store`, the one place where rank 0 creates its
  `TCPStore`. Left to itself that store listens on every interface of the machine at
  MASTER_PORT, with no key: anyone who reaches the port reads and writes the job's keys. The
  ranks of a `tandem run` job that rendezvous at the MASTER_ADDR/MASTER_PORT it gave them meet
  on the launcher's store instead, which answers only clients holding the job's key (one node
  or several); nothing listens at MASTER_PORT. For any other address (a script that sets its
  own MASTER_PORT), rank 0 binds the socket itself on the address the ranks were given
  (MASTER_ADDR, when it is an IP address of this machine) and hands it to the store, as
  `rendezvous.host_store` does. A name, an address this machine lacks or a port already bound
  in this process (torch's multi-tenant store) leaves torch to do as it always did.
- `report_joined(job)`: after `init_process_group` returned, a rank of a `tandem run` job tells
  the launcher's store that it joined a world (one authenticated connection, which the store
  counts: `StoreServer.clients`). That is how `tandem run` knows that ranks joined, whichever
  backend and port they used (`launch/local/joined.py`).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from tandem.rendezvous.client import StoreClient

REPORT_TIMEOUT_S = 10.0
_BACKLOG = 1024


def listener_on(host: str, port: int) -> socket.socket | None:
    """A socket listening on `host:port` only, for rank 0's TCPStore; None when `host` is not
    an IP address or cannot be bound here (torch then binds as it always did)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: the other ranks may resolve it to another address than we do
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as error:
        sock.close()
        if error.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            return None  # torch says so itself (EADDRINUSE: tandem run's summary adds the fix)
        raise
    return sock


def bound_c10d_store(module: Any, tcp_store: Callable[..., Any],
                     job_store: Callable[[str, int, Any], Any] | None = None) -> None:
    """Wrap `module._create_c10d_store` (`module`: torch.distributed.rendezvous) so that the
    ranks of a `tandem run` job meet on the launcher's authenticated store (`job_store(host,
    port, timeout)`: a store, or None when the address is not the job's), and any other rank-0
    store, a `tcp_store` (torch's TCPStore), listens on its MASTER_ADDR only; idempotent.
    torch comes from the caller: the store's package itself starts without it."""
    original = module._create_c10d_store
    if getattr(original, "_tandem_bound", False):
        return

    @functools.wraps(original)
    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        store = job_store(hostname, port, timeout) if job_store is not None else None
        if store is not None:  # nothing listens at MASTER_PORT: no door without a key
            return store
        listener = None
        if rank == 0 and not module._torchelastic_use_agent_store():
            listener = listener_on(hostname, port)
        if listener is None:
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        # detach(): the store owns the socket from now on; Python must not close it under it.
        return tcp_store(host_name=hostname, port=port, world_size=world_size, is_master=True,
                         timeout=timeout, multi_tenant=True, master_listen_fd=listener.detach(),
                         use_libuv=use_libuv)

    create._tandem_bound = True  # type: ignore[attr-defined]
    module._create_c10d_store = create


def report_joined(host: str, port: int, key: str, rank: int, size: int) -> None:
    """Tell the store of `tandem run` at `host:port` that `rank` joined a world of `size`.

    Quiet when the store cannot be reached: the launcher is then gone or another one, and a
    rank's training must not fail for a report.
    """
    try:
        client = StoreClient(host, port, key, REPORT_TIMEOUT_S)
    except (ConnectionError, OSError, TimeoutError):
        return
    try:
        client.set(f"tandem/joined/{rank}", str(size))
    except (ConnectionError, OSError, TimeoutError):
        pass
    finally:
        client.close()
