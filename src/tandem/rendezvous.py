"""The rendezvous store: where ranks meet before any backend exists.

A launcher (`tandem run`, `td.spawn`, the test harness) *hosts* a `torch.distributed.TCPStore`
on port 0, so the operating system picks a free port and keeps it bound: two jobs on one machine
can never race for the same port, and the store outlives any rank that dies. Ranks connect to it
as clients. Without such a launcher (torchrun without its agent store, SLURM), rank 0 hosts it on
the agreed port.

torch is imported when a store is made, not with this module, so that `tandem run` gets as far
as starting its ranks without it.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from tandem.settings import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    import torch.distributed as dist


class PortInUseError(RuntimeError):
    """The rendezvous port is taken by another program."""


def host_store(addr: str = "127.0.0.1", port: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Start a store server on `addr:port` (0: any free port; read it back from `.port`).

    We bind the listening socket ourselves and hand it to the store: a TCPStore left to bind
    alone listens on every interface, and a single-node job must be reachable on `addr` only.
    """
    try:
        listener = socket.create_server((addr, port), backlog=1024)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"cannot listen on {addr}:{port}: the port is in use by another program. "
                "Pick another port (MASTER_PORT / --master), or let `tandem run` choose a free one."
            ) from None
        raise OSError(f"cannot listen on {addr}:{port}: {error.strerror}") from None
    import torch.distributed as dist

    bound_port = listener.getsockname()[1]
    # detach(): the store owns the socket from now on; Python must not close it under it.
    return dist.TCPStore(
        addr, bound_port, is_master=True, timeout=timedelta(seconds=timeout),
        wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False,
    )


def connect_store(addr: str, port: int, timeout: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Connect to a store that someone else hosts; fails with the address after `timeout`."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:
        raise ConnectionError(
            f"cannot reach the rendezvous store at {addr}:{port} within {timeout:.0f} s "
            f"({error}). Is the master address right and the job's rank 0 / agent running?"
        ) from None
