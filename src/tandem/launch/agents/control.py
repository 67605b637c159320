"""The control plane between the agents of a multi-node job: authenticated messages, heartbeats.

Node 0 takes the other agents at its one port, the rendezvous store's (`--master`): an agent
connects as a store client, proving the store's key, and asks the store to hand its connection
over (`join`), which node 0's agent takes (`greet`). Before anything is read as a message, each
side proves it knows the job's secret without sending it (`rendezvous.auth.authenticate`; the
store's key is derived from it and held by the ranks too, so it admits no agent); a wrong secret
fails on both sides with an error that says so, and a stranger that connects and says nothing
is dropped after `HANDSHAKE_S`. Only then are messages (small tuples, pickled by
`multiprocessing.connection`) exchanged.

A cut network link produces no error by itself, TCP just goes quiet, so each side sends a ping
every `HEARTBEAT_S`, and a peer that says nothing for `lost_after` seconds is reported as
unreachable (an event on the agent's queue, like everything else the agent reacts to).

Also here: which local address and network interface lead to a given host, so that an agent
can advertise an address its peers can reach and point Gloo at the right interface; and the
address an accepted connection reached this machine at (`reached_at`): node 0 points its own
ranks' Gloo at that interface, the one the other nodes demonstrably reach it through, even
where its own name resolves to loopback (Debian's `127.0.1.1 <hostname>` line).
"""

from __future__ import annotations

import fcntl
import os
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection

from tandem.launch.events import Joined, Lost, Rejected
from tandem.launch.events import message as heard
from tandem.rendezvous.auth import HANDSHAKE_S, AuthenticationFailed, authenticate, new_secret
from tandem.rendezvous.client import StoreClient

HEARTBEAT_S = 0.5  # a lost peer is named after `lost_after` (4 s) of silence: 8 missed beats
_SIOCGIFADDR = 0x8915

__all__ = ["AuthenticationFailed", "Peer", "authenticate", "greet", "interface_of", "join",
           "local_address_towards", "local_addresses", "new_secret", "reached_at"]


class Peer:
    """One authenticated connection: thread-safe `send`, and a reader that reports to `events`.

    Events: a `Message` for each message, `Lost` (tag, reason) once, when the
    peer closes the connection or has been silent for `lost_after` seconds.
    """

    def __init__(self, conn: Connection, tag: object, events: queue.SimpleQueue,
                 lost_after: float) -> None:
        self.conn, self.tag, self._events, self.lost_after = conn, tag, events, lost_after
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._read, "reader"), (self._beat, "heartbeat")):
            thread = threading.Thread(target=target, name=f"tandem-control-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def send(self, message: tuple) -> bool:
        if self._closed.is_set():
            return False
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._closed.set()
        try:
            self.conn.close()
        except OSError:
            pass

    def _lost(self, reason: str) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._events.put(Lost(self.tag, reason))

    def _read(self) -> None:
        from tandem.launch.local.output import block_agent_signals

        block_agent_signals()
        while not self._closed.is_set():
            try:
                if not self.conn.poll(self.lost_after):
                    self._lost(f"no word from it for {self.lost_after:g} s (the network between "
                               "the nodes is cut, or its machine is down)")
                    return
                message = self.conn.recv()
            except (EOFError, OSError, ValueError):
                self._lost("its connection closed (its agent exited or was killed)")
                return
            if message != ("ping",):
                self._events.put(heard(self.tag, message))

    def _beat(self) -> None:
        from tandem.launch.local.output import block_agent_signals

        block_agent_signals()
        while not self._closed.wait(HEARTBEAT_S):
            self.send(("ping",))


def greet(conn: Connection, where: str, secret: str, events: queue.SimpleQueue) -> None:
    """Node 0: an agent's connection, handed over by the store (`StoreServer.on_hand_over`):
    it proves the job's secret (the store's key is not enough: ranks hold that one) and says
    hello. Events: `Joined` with its first message, or `Rejected` with the reason."""
    try:
        authenticate(conn, secret, server=True)
        if not conn.poll(HANDSHAKE_S):
            raise AuthenticationFailed("it authenticated but never said which node it is")
        hello = conn.recv()
    except (AuthenticationFailed, EOFError, OSError) as error:
        conn.close()
        events.put(Rejected(where, str(error)))
        return
    events.put(Joined(conn, hello, where))


def join(store: StoreClient, secret: str) -> Connection:
    """Another agent: node 0's control plane, on the store's connection (`hand_over`), once
    both sides proved the job's secret."""
    conn = store.hand_over()
    try:
        authenticate(conn, secret, server=False)
    except AuthenticationFailed:
        conn.close()
        raise
    return conn


def local_address_towards(host: str, port: int = 9) -> str:
    """The address of this machine that packets to `host` leave from (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(host), port))  # UDP connect: only a route lookup
        return probe.getsockname()[0]
    finally:
        probe.close()


def local_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address (its first), by name: {"lo": "127.0.0.1", ...}."""
    found = {}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(reply[20:24])
    finally:
        probe.close()
    return found


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` (`lo`, `eth0`...), or None."""
    return next((name for name, held in local_addresses().items() if held == address), None)


def reached_at(conn: Connection) -> str | None:
    """The local address an accepted connection came in at (None if it cannot be read)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            return sock.getsockname()[0]
    except (OSError, ValueError):
        return None
