"""The MPI agent's launch port: where each rank's supervisor connects its three sockets.

`tandem run` (MPI) listens on 127.0.0.1 and hands the port to every supervisor on its
command line (`mpi_rank.py --connect 127.0.0.1:PORT`), where any local user can read it in
`ps`. So the port asks every connection for the job's launch token first, with the handshake
of every tandem socket (`rendezvous.auth.authenticate`: HMAC challenge-response, nothing sent
in the clear), each in a thread of its own: a stranger that connects and says nothing, or says
nonsense, is dropped after `HANDSHAKE_S` and never holds up a supervisor behind it, so idle
connections neither delay a job nor fail it.

After the handshake the supervisor says which rank it is and which stream this is (`control`,
`stdout`, `stderr`); from then on the connection is a plain socket (a rank's output is written
to it directly). Each arrival is an event (`events.LaunchConnected`) on the agent's queue,
the same queue that carries signals, so the agent can stop waiting for supervisors when a
person presses Ctrl-C.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection

from tandem.launch.events import LaunchConnected
from tandem.launch.local.output import block_agent_signals
from tandem.rendezvous.auth import HANDSHAKE_S, AuthenticationFailed, authenticate

LAUNCH_GREETING = b"tandem-launch/1 "
KINDS = ("control", "stdout", "stderr")
_BACKLOG = 1024
_HELLO_BYTES = 64


def _plain(conn: Connection) -> socket.socket:
    """The authenticated connection as a plain socket (the `Connection` object is closed)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.settimeout(None)
    return sock


class LaunchPort:
    """Listens on 127.0.0.1 for the supervisors of `np` ranks that hold `token`.

    Each authenticated connection becomes a `LaunchConnected` on `events`; strangers
    are dropped without a word. `close()` stops listening; late arrivals are closed then.
    """

    def __init__(self, token: str, np: int, events: queue.SimpleQueue) -> None:
        self._token, self._np, self._events = token, np, events
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=_BACKLOG)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="tandem-launch-accept", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        try:
            # shutdown() first: close() alone does not wake a thread blocked in accept().
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        block_agent_signals()
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(sock,), name="tandem-launch-greet",
                             daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        block_agent_signals()
        conn = Connection(sock.detach())
        try:
            authenticate(conn, self._token, server=True, greeting=LAUNCH_GREETING,
                         what="a tandem rank supervisor")
            if not conn.poll(HANDSHAKE_S):
                raise AuthenticationFailed("it never said which rank it is")
            words = conn.recv_bytes(_HELLO_BYTES).decode(errors="replace").split()
        except (AuthenticationFailed, EOFError, OSError):
            conn.close()  # a stranger: dropped, whatever it sent
            return
        if (len(words) != 2 or not words[0].isdigit() or not 0 <= int(words[0]) < self._np
                or words[1] not in KINDS or self._closed.is_set()):
            conn.close()
            return
        self._events.put(LaunchConnected(int(words[0]), words[1], _plain(conn)))


def connect(address: tuple[str, int], token: str, rank: int, kind: str,
            timeout: float) -> socket.socket:
    """A supervisor's side: connect, prove the token, say `rank kind`; a plain socket after."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        authenticate(conn, token, server=False, greeting=LAUNCH_GREETING,
                     what="a tandem run agent", timeout=max(0.1, deadline - time.monotonic()))
        conn.send_bytes(f"{rank} {kind}".encode())
    except BaseException:
        conn.close()
        raise
    return _plain(conn)
