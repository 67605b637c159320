"""What node 0 says to the other agents of a multi-node job, fixed (`coordinator`) or elastic
(`elastic_nodes`): whether one is let in (`refusal`, `refuse`), and, at the end, waiting for
them to hang up after the finish (`await_hang_ups`)."""

from __future__ import annotations

import queue
import time

FINISH_S = 5.0  # how long node 0 waits for the other agents to hang up at the end


def await_hang_ups(events: queue.SimpleQueue, waiting: set[int]) -> None:
    """After the finish message: let the agents `waiting` read it and hang up first (closing a
    socket with unread input resets the connection, which could lose the message), for at most
    `FINISH_S`."""
    deadline = time.monotonic() + FINISH_S
    while waiting:
        try:
            event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        if event[0] == "lost":
            waiting.discard(event[1])


def unwrap_hello(hello) -> dict:
    """An agent's first message, ("hello", {...}) or the dict itself; {} when it is neither."""
    if isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "hello":
        hello = hello[1]
    return hello if isinstance(hello, dict) else {}


def refusal(hello: dict, nnodes: int, joined: set[int], *, elastic: bool) -> str | None:
    """Why node 0 turns an authenticated agent away, or None to let it in."""
    node = hello.get("node_rank")
    if not isinstance(node, int) or not 0 <= node < nnodes:
        return f"node rank {node!r} is out of range: this job has nodes 0..{nnodes - 1}"
    if hello.get("nnodes") != nnodes:
        return (f"it says the job has {hello.get('nnodes')} nodes, node 0 says {nnodes}: give "
                "every node the same --nnodes")
    if bool(hello.get("elastic", False)) != elastic:
        return ("node 0 runs an elastic job (--min-np/--max-np): give every node the same "
                "--min-np/--max-np" if elastic else "node 0 runs a job of a fixed size: drop "
                "--min-np/--max-np here, or give them to node 0 too")
    if node in joined:
        return f"node {node} has joined already (two agents with the same --node-rank?)"
    return None


def refuse(conn, reason: str, where: str, output) -> None:
    """Tell an agent why it is turned away (it prints that and exits 2), then hang up."""
    try:
        conn.send(("refused", {"reason": reason}))
    except OSError:
        pass
    conn.close()
    output.message(f"tandem run: refused the agent from {where}: {reason}")
