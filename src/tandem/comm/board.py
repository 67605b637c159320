"""The rendezvous store as the watchdog's notice board.

When a wait fails or looks stuck, a rank asks every rank where it is through the store the job
met on (a request counter, one answer key per rank), so a report can show every rank's
operation and stack. Everything here has short timeouts and never raises: a board that cannot
be reached only makes the reports poorer, never the job fail.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from tandem import rendezvous

BOARD_TIMEOUT_S = 5.0


class Board:
    """The rendezvous store as the watchdog's notice board: short timeouts, never raises."""

    def __init__(self, store: dist.Store, client: dist.Store | None = None) -> None:
        self._store = store
        self._client = client  # a store written in Python must outlive the PrefixStore over it
        self._lock = threading.Lock()  # the monitor thread and a failing wait share the client

    @classmethod
    def connect(cls, addr: str, port: int, prefix: str, key: str | None) -> Board | None:
        try:
            client = rendezvous.connect_store(addr, port, BOARD_TIMEOUT_S, key)
        except Exception:
            return None  # reports will lack the other ranks; nothing else depends on it
        return cls(dist.PrefixStore(prefix, client), client)

    def add(self, key: str, amount: int) -> int | None:
        try:
            with self._lock:
                return self._store.add(key, amount)
        except Exception:
            return None

    def set(self, key: str, value: str) -> bool:
        try:
            with self._lock:
                self._store.set(key, value)
            return True
        except Exception:
            return False

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent (a plain `get` would block until it appears)."""
        try:
            with self._lock:
                return self._store.get(key) if self._store.check([key]) else None
        except Exception:
            return None

    def delete(self, key: str) -> None:
        try:
            with self._lock:
                self._store.delete_key(key)
        except Exception:
            pass

    def close(self) -> None:
        """Hang up (tandem's store; a TCPStore hangs up when dropped)."""
        if hasattr(self._client, "close"):
            self._client.close()
