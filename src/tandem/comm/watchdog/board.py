"""The rendezvous store as the watchdog's notice board.

When a wait fails or looks stuck, a rank asks every rank where it is through the store the job
met on (a request counter, one answer key per rank), so a report can show every rank's
operation and stack. Everything here has short timeouts and never raises: a board that cannot
be reached only makes the reports poorer, never the job fail.
"""

from __future__ import annotations

import threading

from tandem import rendezvous

BOARD_TIMEOUT_S = 5.0


class Board:
    """The rendezvous store as the watchdog's notice board: short timeouts, never raises.

    Keys live under `prefix`. The store is a `rendezvous.StoreClient` when the job has a key
    (plain Python: the monitor thread never re-enters Python through torch's C++, which could
    crash a process that exits while the thread waits), else a torch `TCPStore`.
    """

    def __init__(self, store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self._lock = threading.Lock()  # the monitor thread and a failing wait share the client

    @classmethod
    def connect(cls, addr: str, port: int, prefix: str, key: str | None) -> Board | None:
        try:
            if key is not None:
                store = rendezvous.StoreClient(addr, port, key, BOARD_TIMEOUT_S)
            else:
                store = rendezvous.connect_store(addr, port, BOARD_TIMEOUT_S)
        except Exception:
            return None  # reports will lack the other ranks; nothing else depends on it
        return cls(store, prefix)

    def add(self, key: str, amount: int) -> int | None:
        try:
            with self._lock:
                return self._store.add(self._prefix + key, amount)
        except Exception:
            return None

    def set(self, key: str, value: str) -> bool:
        try:
            with self._lock:
                self._store.set(self._prefix + key, value)
            return True
        except Exception:
            return False

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent (a plain `get` would block until it appears)."""
        key = self._prefix + key
        try:
            with self._lock:
                return self._store.get(key) if self._store.check([key]) else None
        except Exception:
            return None

    def delete(self, key: str) -> None:
        try:
            with self._lock:
                self._store.delete_key(self._prefix + key)
        except Exception:
            pass

    def close(self) -> None:
        """Hang up (tandem's store; a TCPStore hangs up when dropped)."""
        if isinstance(self._store, rendezvous.StoreClient):
            self._store.close()
