"""The roll call of a job whose ranks were numbered by hand, before any engine connects.

torch.distributed's manual template (`td.init(rank=r, world_size=n)` in each process that a
script starts) leaves the numbering to the user, and its slips all end badly in the engine:
a rank that never starts is a raw store timeout naming a key; two processes given one rank, or
different world sizes, end in a timeout too, or in a world that hangs at its first collective.
So each process first answers a roll call on the store that rank 0 hosts:

- every process takes a ticket (an `add` on the store) and writes who it is under it: its rank,
  its world size, its pid and host;
- rank 0 reads the tickets as they come. As soon as ranks 0..n-1 have each come once with
  rank 0's world size, it writes the verdict: the job is these tickets. A world size that
  differs, or a rank that comes twice, is an error at once (naming each process); ranks still
  missing at the deadline (`timeout`) are an error then: "ranks [1] of 2 did not join within
  20 s";
- every process waits for the verdict (a little longer than rank 0 does) and raises the same
  error; a process whose ticket is not in the job (a second rank 1 that came after the job
  started, or one that joined the store of a job still running at that address) is told so.

Every wait has a deadline, and every error is a `RendezvousError` that names the ranks. Plain
Python over any store with `add`/`set`/`get`/`check` (torch's `TCPStore`, tandem's
authenticated store): nothing here imports torch. It costs a few store round trips at init.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

_PREFIX = "tandem/roll/"
POLL_S = 0.05  # how often a waiting process looks at the store again (init only, never a step)
VERDICT_MARGIN_S = 5.0  # the others wait this much longer than rank 0, to hear its verdict
READ_WAIT_S = 2.0  # how long rank 0 keeps its store up for the others to read an error verdict


class RendezvousError(RuntimeError):
    """The processes that met at a rendezvous are not one job: names the ranks and the fix."""


def _fix(size: int) -> str:
    return (f"Start {size} processes, give each its own rank, td.init(rank=r, "
            f"world_size={size}) for r = 0..{size - 1}, all with the same MASTER_ADDR and "
            "MASTER_PORT (or init_method)")


def _who(entry: dict[str, Any]) -> str:
    return f"pid {entry['pid']} on {entry['host']}"


def port_taken(address: str, size: int) -> RendezvousError:
    """Rank 0 could not listen: someone already hosts a rendezvous at `address`."""
    return RendezvousError(
        f"rank 0 of {size}: another process already hosts rank 0's rendezvous at {address}: two "
        "processes were given rank 0, or a previous job still runs there (or another program "
        f"holds the port). {_fix(size)}; end the previous job, or pick another MASTER_PORT.")


def host_unreachable(rank: int, size: int, address: str, timeout: float) -> RendezvousError:
    """A rank other than 0 found nobody hosting the rendezvous at `address`."""
    return RendezvousError(
        f"rank {rank} of {size}: nobody hosts the rendezvous at {address} (rank 0 does) within "
        f"{timeout:g} s: rank 0 did not start, failed before it, or was given another address. "
        f"{_fix(size)}.")


def reach(host: str, port: int, rank: int, size: int, timeout: float) -> None:
    """Wait until rank 0 listens at `host:port`, or raise `host_unreachable` after `timeout`.

    A plain socket first: torch's `TCPStore` client, left to find out alone, prints a C++ stack
    trace per failed attempt before its own timeout error.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))).close()
            return
        except OSError:
            if left <= 0:
                raise host_unreachable(rank, size, f"{host}:{port}", timeout) from None
            pause.wait(0.1)  # rank 0 may still be starting


def answer(store, rank: int, size: int, timeout: float, address: str) -> None:
    """Answer the roll call of the job at `address`; rank 0 judges it. Raises `RendezvousError`
    on every process unless ranks 0..size-1 have each come once, all with world size `size`."""
    me = {"rank": rank, "size": size, "pid": os.getpid(), "host": socket.gethostname()}
    ticket = store.add(_PREFIX + "count", 1)
    store.set(f"{_PREFIX}{ticket}", json.dumps(me))
    if rank == 0:
        verdict = _judge(store, size, timeout, address)
    else:
        verdict = _await_verdict(store, rank, size, timeout, address)
    if "error" in verdict:
        raise RendezvousError(f"rank {rank} of {size}: {verdict['error']}")
    if ticket not in verdict["tickets"]:
        holder = verdict["ranks"].get(str(rank))
        taken = f"its rank {rank} is {holder}" if holder else f"it has no rank {rank}"
        raise RendezvousError(
            f"rank {rank} of {size}: the job at {address} started without this process "
            f"({taken}): two processes were given rank {rank}, or a previous job still runs "
            f"at that address. {_fix(size)}.")


def _judge(store, size: int, timeout: float, address: str) -> dict[str, Any]:
    """Rank 0: read the tickets until they make the job, or say why they do not."""
    deadline = time.monotonic() + timeout
    entries: dict[int, dict[str, Any]] = {}
    pause = threading.Event()  # never set: bounded pauses between looks at the store
    while True:
        # A process that took a ticket and died before writing it leaves a hole: read every
        # ticket written so far, not just the next one.
        count = store.add(_PREFIX + "count", 0)
        for ticket in range(1, count + 1):
            key = f"{_PREFIX}{ticket}"
            if ticket not in entries and store.check([key]):
                entries[ticket] = json.loads(store.get(key))
        verdict = _verdict(entries, size, timeout, address, late=time.monotonic() > deadline)
        if verdict is not None:
            break
        pause.wait(POLL_S)
    store.set(_PREFIX + "verdict", json.dumps(verdict))
    if "error" in verdict:
        # This process raises and its store goes with it: let the others read why first.
        wait_until = time.monotonic() + READ_WAIT_S
        while store.add(_PREFIX + "read", 0) < len(entries) - 1 and time.monotonic() < wait_until:
            pause.wait(POLL_S)
    return verdict


def _verdict(entries: dict[int, dict[str, Any]], size: int, timeout: float, address: str,
             late: bool) -> dict[str, Any] | None:
    """The job (`tickets`, `ranks`), an `error`, or None: wait on. A pure function of what came."""
    listing = "; ".join(f"rank {e['rank']} ({_who(e)}) world_size={e['size']}"
                        for _, e in sorted(entries.items(), key=lambda item: item[1]["rank"]))
    if any(e["size"] != size for e in entries.values()):
        return {"error": f"the processes were given different world sizes: {listing}. Pass the "
                         "same world_size to td.init in every process (the number of processes "
                         "the job starts)."}
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for _, entry in sorted(entries.items()):
        by_rank.setdefault(entry["rank"], []).append(entry)
    twice = {rank: found for rank, found in by_rank.items() if len(found) > 1}
    if twice:
        named = "; ".join(f"rank {rank} by {' and '.join(map(_who, found))}"
                          for rank, found in sorted(twice.items()))
        return {"error": f"two processes were given one rank: {named}. {_fix(size)}."}
    missing = [rank for rank in range(size) if rank not in by_rank]
    if not missing:
        return {"tickets": sorted(entries),
                "ranks": {str(e["rank"]): _who(e) for e in entries.values()}}
    if not late:
        return None
    return {"error": f"ranks {missing} of {size} did not join within {timeout:g} s (rank 0 hosts "
                     f"the rendezvous at {address}; joined: {listing}). {_fix(size)}; if they "
                     "start late on purpose, raise the timeout (td.init(timeout=...) or "
                     "TANDEM_TIMEOUT)."}


def _await_verdict(store, rank: int, size: int, timeout: float, address: str) -> dict[str, Any]:
    """A rank other than 0: wait for rank 0's verdict, a little longer than rank 0 waits."""
    key = _PREFIX + "verdict"
    deadline = time.monotonic() + timeout + VERDICT_MARGIN_S
    pause = threading.Event()
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rank {rank} of {size}: rank 0 hosts the rendezvous at {address} but did "
                    f"not say within {timeout + VERDICT_MARGIN_S:g} s whether the job is "
                    "complete (is it another program's store?)")
            pause.wait(POLL_S)
        verdict = json.loads(store.get(key))
        if "error" in verdict:
            store.add(_PREFIX + "read", 1)
    except RendezvousError:
        raise
    except (OSError, RuntimeError) as error:  # torch's store errors are RuntimeErrors
        raise RendezvousError(
            f"rank {rank} of {size}: lost the rendezvous at {address} while rank 0 called the "
            f"roll: rank 0 ended before the job started ({type(error).__name__}: {error}); see "
            "rank 0's error") from None
    return verdict
