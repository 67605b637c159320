"""The rendezvous store as a `torch.distributed.Store`, for `init_process_group` and the watchdog.

torch calls a Python subclass of `dist.Store` through its C++ trampoline; Gloo and NCCL use
only get/set/add/wait/check/compare_set (and multi_get/multi_set/append where present) while
they connect. The C++ side holds no reference to the Python object: whoever passes it to
torch must keep it alive for as long as the process group lives (`TorchBackend` does).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tandem.rendezvous.client import StoreClient, StoreTimeout

# The longest wait a store call takes: `poll` takes milliseconds in a C int (24.8 days), and
# torch's callers ask for "infinite" waits (Lightning's barrier group: 10,000 days).
LONGEST_WAIT_S = 20 * 24 * 3600.0


def _seconds(timeout) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return min(seconds, LONGEST_WAIT_S)


class AuthenticatedStore(dist.Store):
    """A `dist.Store` over a `StoreClient`; `server`, when given, is kept alive with it."""

    def __init__(self, client: StoreClient, server=None) -> None:
        super().__init__()
        self._client = client
        self._server = server  # rank 0 hosting the store: it lives as long as we do

    @property
    def port(self) -> int:
        return self._client.port

    def clone(self) -> AuthenticatedStore:
        """A store of its own connection (torch's Gloo asks one per process group)."""
        return AuthenticatedStore(self._client.another())

    def _wait_s(self) -> float:
        # set_timeout() on this store (init_process_group's timeout) sets the C++ side's value.
        seconds = _seconds(self.timeout)
        return self._client.timeout if not seconds or seconds <= 0 else seconds

    def _call(self, method, *args):
        try:
            return method(*args)
        except StoreTimeout as error:
            raise dist.DistStoreError(f"timeout: {error}") from None

    def set(self, key, value) -> None:
        self._call(self._client.set, key, value)

    def get(self, key) -> bytes:
        return self._call(self._client.get, key, self._wait_s())

    def add(self, key, amount) -> int:
        return self._call(self._client.add, key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(self._client.compare_set, key, expected, desired)

    def check(self, keys) -> bool:
        return self._call(self._client.check, list(keys))

    def wait(self, keys, timeout=None) -> None:
        self._call(self._client.wait, list(keys), _seconds(timeout) or self._wait_s())

    def delete_key(self, key) -> bool:
        return self._call(self._client.delete_key, key)

    def num_keys(self) -> int:
        return self._call(self._client.num_keys)

    def multi_get(self, keys) -> list[bytes]:
        return self._call(self._client.multi_get, list(keys), self._wait_s())

    def multi_set(self, keys, values) -> None:
        self._call(self._client.multi_set, list(keys), list(values))

    def append(self, key, value) -> None:
        self._call(self._client.append, key, value)

    def close(self) -> None:
        self._client.close()
        if self._server is not None:
            self._server.close()
