"""The sockets an engine opened, so that they can be shut at once when its world is over.

Gloo gives no way to wake a rank blocked in a collective whose peers are gone: its group's
`abort()` neither wakes a local wait nor closes the connections, and a peer that leaves the
collective midway can leave the others waiting until their timeout. Shutting the engine's own
TCP connections (`shutdown(2)` on each) fails every pending operation on them with "Connection
closed", which the watchdog explains. The engine's sockets are told apart from everyone
else's (the rendezvous store's, the script's own) as the ones that appeared while it was
created (`opened_by`). Linux only (`/proc/self/fd`); elsewhere nothing is recorded or shut.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TypeVar

_FDS = "/proc/self/fd"
T = TypeVar("T")


def _socket_fds() -> dict[int, str]:
    """fd -> `socket:[inode]` for this process's sockets."""
    found = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FDS}/{name}")
        except OSError:
            continue  # closed meanwhile (listdir's own fd, among others)
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def opened_by(create: Callable[[], T]) -> tuple[T, set[str]]:
    """`create()`'s result and the sockets that appeared while it ran (by inode)."""
    before = set(_socket_fds().values())
    result = create()
    return result, set(_socket_fds().values()) - before


def shut(inodes: set[str]) -> int:
    """Shut down (both ways) the TCP connections among `inodes`; how many were shut."""
    count = 0
    for fd, inode in _socket_fds().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET,
                                                                  socket.AF_INET6):
                sock.getpeername()  # a listener has none: shutting it would end Gloo's loop
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass  # not connected (a listener), or already shut
        finally:
            sock.close()  # the duplicate only; the engine still owns its fd
    return count
