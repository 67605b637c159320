"""A client of the rendezvous store (`rendezvous.server`), in plain Python.

Each thread gets a connection of its own, opened and authenticated on its first request: the
watchdog's monitor thread can read the notice board while the main thread waits in a `get`,
as each would with a torch `TCPStore` of its own. Every request has a deadline; a store that
went away (its launcher was killed) is a `ConnectionError` naming its address, never a hang;
a wrong key is its subclass `AuthenticationFailed`.
"""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

from tandem.rendezvous.auth import AuthenticationFailed, authenticate
from tandem.rendezvous.server import STORE_GREETING

CONNECT_RETRY_S = 0.1


class StoreTimeout(TimeoutError):
    """Keys that did not appear in the store within the deadline."""


class StoreClient:
    """Requests to the store at `host:port`, authenticated with `key`.

    `timeout` bounds connecting (the store may still be starting: rank 0 hosts it in some jobs),
    is the default wait of `get`/`wait`, and bounds how long any answer may take beyond that.
    The method names are `torch.distributed.Store`'s, so code can take either.
    """

    def __init__(self, host: str, port: int, key: str, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, float(timeout)
        self._key = key
        self._local = threading.local()
        self._connections: list[Connection] = []
        self._lock = threading.Lock()
        self._connection()  # fail here, with the address, rather than at first use

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def another(self) -> StoreClient:
        """A client of its own to the same store, with the same key."""
        return StoreClient(self.host, self.port, self._key, self.timeout)

    # -- requests ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._request(("set", key, value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value, waiting until it is set (at most `timeout`, default the client's)."""
        return self._waiting("get", key, timeout)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self._waiting("wait", list(keys), timeout)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        return self._waiting("multi_get", list(keys), timeout)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._request(("multi_set", list(keys), list(values)))

    def add(self, key: str, amount: int) -> int:
        return self._request(("add", key, int(amount)))

    def append(self, key: str, value: bytes | str) -> None:
        self._request(("append", key, value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._request(("compare_set", key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._request(("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return self._request(("delete", key))

    def num_keys(self) -> int:
        return self._request(("num_keys",))

    def hand_over(self) -> Connection:
        """This thread's authenticated connection, taken out of the store's service by the
        server's `on_hand_over` (a multi-node agent's control plane); a RuntimeError from a
        store that takes none."""
        self._request(("hand_over",))
        conn = self._connection()
        self._local.conn = None
        with self._lock:
            self._connections.remove(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    # -- the wire ---------------------------------------------------------------------------
    def _waiting(self, op: str, keys, timeout: float | None):
        wait = self.timeout if timeout is None else float(timeout)
        return self._request((op, keys, wait), wait)

    def _request(self, request: tuple, wait: float = 0.0):
        conn = self._connection()
        try:
            conn.send(request)
            if not conn.poll(wait + self.timeout):
                raise ConnectionError(f"the rendezvous store at {self.address} did not answer "
                                      f"a {request[0]} within {wait + self.timeout:g} s")
            status, result = conn.recv()
        except (EOFError, OSError) as error:
            self._forget(conn)
            raise ConnectionError(
                f"lost the rendezvous store at {self.address} ({error or 'connection closed'}): "
                "the process that hosted it (the launcher, or rank 0) has exited"
            ) from None
        if status == "ok":
            return result
        if status == "timeout":
            raise StoreTimeout(f"the rendezvous store at {self.address}: keys {result} were not "
                               f"set within {wait:g} s (did every rank start?)")
        raise RuntimeError(f"the rendezvous store at {self.address}: {result}")

    def _connection(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _forget(self, conn: Connection) -> None:
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        conn.close()

    def _connect(self) -> Connection:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.1, min(left, 10.0)))
                break
            except OSError as error:
                if left <= 0:
                    raise ConnectionError(
                        f"cannot reach the rendezvous store at {self.address} within "
                        f"{self.timeout:.0f} s ({error.strerror or error}). Is the master "
                        "address right and the job's rank 0 / agent running?"
                    ) from None
                threading.Event().wait(CONNECT_RETRY_S)  # its host may still be starting
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
        try:
            authenticate(conn, self._key, server=False, greeting=STORE_GREETING,
                         what="a tandem rendezvous store")
        except AuthenticationFailed as error:
            conn.close()
            raise AuthenticationFailed(
                f"the rendezvous store at {self.address} refused the handshake: {error}"
            ) from None
        return conn
