"""Proving a shared secret without sending it: the handshake of every tandem socket.

Both sides send a random nonce; both answer with HMAC-SHA256(secret, peer's nonce + own role);
both check the other's answer. A wrong secret fails on both sides with an error that says so,
and a stranger that connects and says nothing is dropped after `HANDSHAKE_S`. Nothing is read
as a message (nothing is unpickled) before the handshake succeeds. The multi-node control plane
(`launch.agents.control`) and the rendezvous store (`rendezvous.server`) both use it, each with its
own greeting, so a client of the one that reaches the other is told so.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from multiprocessing.connection import Connection

HANDSHAKE_S = 10.0
_NONCE_BYTES = 32


class AuthenticationFailed(ConnectionError):
    """The other side does not know the job's secret (or is not what we expected)."""


def new_secret() -> str:
    return secrets.token_hex(16)


def derive_key(secret: str, purpose: str) -> str:
    """A key for one purpose, derived from the job's secret: holding it reveals nothing of the
    secret, so ranks can get the store's key without being able to act as an agent."""
    return hmac.new(secret.encode(), f"tandem {purpose}".encode(), hashlib.sha256).hexdigest()


def _receive(conn: Connection, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not conn.poll(remaining):
        raise AuthenticationFailed("the peer did not complete the handshake in time")
    try:
        return conn.recv_bytes(256)
    except (EOFError, OSError) as error:
        raise AuthenticationFailed(f"the peer closed the connection during the handshake "
                                   f"({error or 'end of file'})") from None


def authenticate(conn: Connection, secret: str, server: bool, timeout: float = HANDSHAKE_S,
                 greeting: bytes = b"tandem-control/1 ", what: str = "a tandem agent") -> None:
    """Mutual HMAC challenge-response; raises `AuthenticationFailed` unless both know `secret`.

    `greeting` names the protocol; a peer that speaks another one is `not {what}`.
    """
    key = secret.encode()
    deadline = time.monotonic() + timeout
    mine = secrets.token_bytes(_NONCE_BYTES)
    own_role, peer_role = (b"server", b"client") if server else (b"client", b"server")
    try:
        conn.send_bytes(greeting + mine)
    except OSError as error:
        raise AuthenticationFailed(f"the peer closed the connection during the handshake "
                                   f"({error})") from None
    hello = _receive(conn, deadline)
    if not hello.startswith(greeting):
        raise AuthenticationFailed(f"the peer is not {what} (unexpected greeting)")
    theirs = hello[len(greeting):]
    conn.send_bytes(hmac.new(key, theirs + own_role, hashlib.sha256).digest())
    proof = _receive(conn, deadline)
    expected = hmac.new(key, mine + peer_role, hashlib.sha256).digest()
    if not hmac.compare_digest(proof, expected):
        raise AuthenticationFailed("the peer does not know this job's secret")
