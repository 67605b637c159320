"""The rendezvous store's server: a key-value store that only the job can reach.

A launcher (`tandem run`, `td.spawn`, the test harness) hosts it; rank 0 hosts it where no
launcher does. Ranks keep their addresses in it while their backend connects, and the
watchdog uses it as a notice board. torch's own `TCPStore` answers any client (and lists its
keys), so tandem hosts this one instead: every connection first proves that it holds the
store's key (`auth.authenticate`, HMAC challenge-response), and a client that cannot is
disconnected before it can read or write anything. Plain Python and the standard library:
`tandem run`'s parent hosts it without importing torch.

One thread accepts; each authenticated connection gets a thread that answers its requests in
order. Requests that wait (`get` of a missing key, `wait`) wait on one condition variable with
the client's deadline, so a waiting connection never holds up another.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from tandem.rendezvous.auth import AuthenticationFailed, authenticate, new_secret

STORE_GREETING = b"tandem-store/1 "
_BACKLOG = 1024


class PortInUseError(RuntimeError):
    """The rendezvous port is taken by another program."""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` only (0: any free port), or a clear error."""
    try:
        return socket.create_server((host, port), backlog=_BACKLOG)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"cannot listen on {host}:{port}: the port is in use by another program. "
                "Pick another port (MASTER_PORT / --master), or let `tandem run` choose a free one."
            ) from None
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None


class StoreServer:
    """The store, listening on `host:port`; clients must hold `key` (a new one when None).

    Runs in daemon threads until `close()`. `set`/`get` here read and write it directly.
    `on_refused(where, why)` hears of each client refused (a multi-node agent reports them).
    `on_hand_over(conn, where)` takes the connection of a client that asks for it (`hand_over`):
    node 0's agent, whose control plane the other agents reach at the store's one port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: str | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 on_hand_over: Callable[[Connection, str], None] | None = None) -> None:
        self.key = key or new_secret()
        self._on_refused = on_refused  # (where, why) for each client that failed the handshake
        self._on_hand_over = on_hand_over
        self.host = host
        self._listener = listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._connections: set[Connection] = set()
        self._closed = False
        # Clients that proved the key so far: `tandem run` learns from it that a rank joined
        # (td.init, the "tandem" torch.distributed backend), see `launch/local/joined.py`.
        self.clients = 0
        threading.Thread(target=self._accept, name="tandem-store-accept", daemon=True).start()

    # -- in this process --------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._serve(("set", key, value), time.monotonic())

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is absent (never waits)."""
        with self._changed:
            return self._data.get(key)

    def wait_for(self, keys: list[str], timeout: float) -> bool:
        """Whether every key is set within `timeout` seconds (False also once closed)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._closed or all(key in self._data for key in keys),
                timeout) and not self._closed

    def close(self) -> None:
        """Stop listening and drop every client (their next request fails)."""
        with self._changed:
            self._closed = True
            for conn in self._connections:  # each still open: its thread closes it after us
                _hang_up(conn)
            self._changed.notify_all()
        try:
            # shutdown() first: on Linux a plain close() neither wakes the thread blocked in
            # accept() nor stops the port from taking connections while it is blocked there.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the network side -------------------------------------------------------------------
    def _accept(self) -> None:
        # Threads inherit the signal mask of the thread that made the server: a launcher makes
        # it inside `launch.local.output.signals_blocked()`, so signals stay with its main thread.
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(sock, address),
                             name="tandem-store-client", daemon=True).start()

    def _answer(self, sock: socket.socket, address) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
        try:
            authenticate(conn, self.key, server=True, greeting=STORE_GREETING,
                         what="a tandem rendezvous client")
        except (AuthenticationFailed, OSError) as error:
            conn.close()  # a stranger: it learns nothing, not even a key's name
            if self._on_refused is not None:
                self._on_refused(f"{address[0]}:{address[1]}", str(error))
            return
        with self._changed:
            if self._closed:
                conn.close()
                return
            self._connections.add(conn)
            self.clients += 1
        where = f"{address[0]}:{address[1]}"
        try:
            while True:
                request = conn.recv()
                if request == ("hand_over",) and self._on_hand_over is not None:
                    conn.send(("ok", None))
                    with self._changed:
                        self._connections.discard(conn)
                    return self._on_hand_over(conn, where)  # no longer a store client's
                conn.send(self._serve(request, time.monotonic()))
        except (EOFError, OSError, ValueError):
            pass  # the client hung up, or we were closed
        with self._changed:  # out of the set before it is closed: see close()
            self._connections.discard(conn)
        conn.close()

    def _serve(self, request: tuple, now: float) -> tuple:
        """One request -> ("ok", result) | ("timeout", missing keys) | ("error", text)."""
        op, *args = request
        data, changed = self._data, self._changed
        with changed:
            if op == "set":
                data[args[0]] = _bytes(args[1])
                changed.notify_all()
                return "ok", None
            if op == "multi_set":
                data.update((k, _bytes(v)) for k, v in zip(args[0], args[1], strict=True))
                changed.notify_all()
                return "ok", None
            if op == "append":
                data[args[0]] = data.get(args[0], b"") + _bytes(args[1])
                changed.notify_all()
                return "ok", None
            if op == "add":
                value = int(data.get(args[0], b"0")) + int(args[1])
                data[args[0]] = str(value).encode()
                changed.notify_all()
                return "ok", value
            if op == "compare_set":
                key, expected, desired = args[0], _bytes(args[1]), _bytes(args[2])
                current = data.get(key)
                if current is None and expected:
                    return "ok", expected  # torch's TCPStore answers so too
                if current is None or current == expected:
                    data[key] = desired
                    changed.notify_all()
                    return "ok", desired
                return "ok", current
            if op == "check":
                return "ok", all(k in data for k in args[0])
            if op == "delete":
                return "ok", data.pop(args[0], None) is not None
            if op == "num_keys":
                return "ok", len(data)
            if op in ("get", "multi_get", "wait"):
                keys = [args[0]] if op == "get" else list(args[0])
                deadline = now + float(args[1])
                while not all(k in data for k in keys):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return "timeout", [k for k in keys if k not in data]
                    changed.wait(left)
                values = [data[k] for k in keys]
                return "ok", (values[0] if op == "get" else values if op == "multi_get" else None)
        return "error", f"unknown request {op!r}"


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _hang_up(conn: Connection) -> None:
    """Wake the thread reading `conn` (it sees the end of the stream and closes it itself)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as same:
            same.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
