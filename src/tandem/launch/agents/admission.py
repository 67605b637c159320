"""What node 0 says to an agent of a multi-node job, fixed or elastic, that asks to join
(`nodes.Nodes.admit`): why it is turned away (`refusal`), and telling it so (`refuse`).

Every agent says which tandem it runs in its hello (`versions`): tandem's version and the
version of the agents' protocol (the messages on the control plane and what they carry). Node 0
lets in only an agent whose versions equal its own: a node with another tandem would otherwise
join without a word and fail later in ways that name neither version. The hello also names the
job (`--rdzv-id`, "job"): two jobs that share a `--secret` would otherwise look like one.
"""

from __future__ import annotations

import sys

PROTOCOL = 4  # the agents' protocol: bump it when a message or what it carries changes


def tandem_version() -> str:
    """The version of the tandem this agent runs: its package's `__version__`, read when asked.

    The package is imported before any module of it, this one included; it is looked up rather
    than imported, since `import tandem` would make launch/ depend on the package's front door
    (which reaches torch.distributed's hooks in comm/).
    """
    return str(sys.modules[__name__.partition(".")[0]].__version__)


def versions() -> dict[str, object]:
    """What an agent tells node 0 about itself: tandem's version and the protocol's."""
    return {"version": tandem_version(), "protocol": PROTOCOL}


def version_refusal(hello: dict) -> str | None:
    """Why an agent with another tandem (or protocol) than node 0's is turned away, or None."""
    mine = versions()
    theirs = {name: hello.get(name) for name in mine}
    if theirs == mine:
        return None

    def said(found: dict) -> str:
        if found["version"] is None:
            return "a tandem older than the version check (it names no version)"
        return f"tandem {found['version']} (agent protocol {found['protocol']})"

    return (f"node {hello.get('node_rank')!r} runs {said(theirs)}, node 0 runs {said(mine)}: "
            f"install the same tandem on every node (pip install tandem=={mine['version']} "
            "there, or the same checkout), then start its agent again")


def unwrap_hello(hello) -> dict:
    """An agent's first message, ("hello", {...}) or the dict itself; {} when it is neither."""
    if isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "hello":
        hello = hello[1]
    return hello if isinstance(hello, dict) else {}


def refusal(hello: dict, nnodes: int, joined: set[int], *, elastic: bool,
            job: str | None = None) -> str | None:
    """Why node 0 turns an authenticated agent away, or None to let it in. `job`: node 0's
    job id (--rdzv-id), which two jobs that share a secret differ in."""
    mismatch = version_refusal(hello)  # first: another tandem may mean anything below
    if mismatch is not None:
        return mismatch
    node = hello.get("node_rank")
    if hello.get("job") != job:
        def named(found):
            return "no --rdzv-id" if found is None else f"--rdzv-id {found}"
        return (f"node {node!r} is an agent of another job ({named(hello.get('job'))}; node 0 "
                f"runs {named(job)}) that knows the same secret: give every node of one job the "
                f"same --rdzv-id, and each job a --secret of its own")
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
