"""What the watchdog concludes from the ranks' answers: who arrived, who deadlocked, and the report.

Pure functions over plain data, tested without processes. Each rank's answer (see
`monitor.Watchdog.answer`) says how many operations it has *issued* on each stream and which
operations it is *waiting* for. A stream is what an engine orders operations on: the
collectives of one group (`world`, `[0, 1]`), or the messages from one rank to another with one
tag (`world 1->0 tag 3`). Engines match the n-th operation of a stream on one rank with the
n-th on the others, so:

- a peer has *arrived* at operation #n of a stream when it has issued n operations there;
- a rank that waits for #n depends on the members of the stream that have not arrived;
- ranks that wait, each for the next one around a cycle, can never finish: a desync;
- two ranks waiting on the same #n of a stream with different operations disagree: a desync;
- a rank that waits for a peer that has left the job (`td.shutdown`) waits for ever.

An answer is a dict: ``{"rank", "pid", "host", "state": "running" | "left", "issued": {stream:
n}, "waits": [{"op", "age", "timeout", "serial", "site", "entry", "fingerprint"}], "stack"}``;
an op is ``{"kind", "stream", "members", "index", "detail", "peer", "tag"}``. A rank that did
not answer is `None`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Answer = Mapping | None
Answers = Mapping[int, Answer]

NO_ANSWER = "did not answer the watchdog (its process died, its machine cannot be reached, or it " \
            "is stuck in native code that holds the GIL)"


LEFT_EARLY_HINT = (
    "A rank that leaves while its peers still communicate ran fewer operations: did it skip a "
    "step alone (`if not torch.isfinite(loss): continue` on one rank; skip together with "
    "`if not td.all_finite(loss): continue`), or run out of data first (`with td.join():`)?"
)


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_op(op: Mapping) -> str:
    """`allreduce #12 on the world (float32[3])`, `recv #1 from rank 1 (tag 3, float32[4])`."""
    detail = op.get("detail") or ""
    kind, index, stream = op["kind"], op["index"], op["stream"]
    if kind in ("send", "recv"):
        where = f"to rank {op['peer']}" if kind == "send" else f"from rank {op['peer']}"
        extra = ", ".join(part for part in (f"tag {op['tag']}", detail) if part)
        return f"{kind} #{index} {where} ({extra})"
    place = "the world" if stream == "world" else f"group {stream}"
    return f"{kind} #{index} on {place}" + (f" ({detail})" if detail else "")


def describe_wait(wait: Mapping) -> str:
    """One waiting operation with where the user's code called it and for how long."""
    text = describe_op(wait["op"])
    call = wait.get("fingerprint") or " ".join(
        part for part in (wait.get("entry"), f"at {wait.get('site')}") if part)
    return f"{text}, called as {call}, waiting {wait['age']:.1f} s"


def issued(answer: Answer, stream: str) -> int:
    return int(answer["issued"].get(stream, 0)) if answer else 0


def arrival(op: Mapping, me: int, answers: Answers) -> tuple[list[int], list[int], list[int]]:
    """(arrived, not arrived, unknown) members of `op`'s stream, as rank `me` waits for it."""
    arrived, missing, unknown = [], [], []
    for member in op["members"]:
        answer = answers.get(member)
        if member == me:
            arrived.append(member)
        elif answer is None:
            unknown.append(member)
        elif issued(answer, op["stream"]) >= op["index"]:
            arrived.append(member)
        else:
            missing.append(member)
    return arrived, missing, unknown


def state_of(rank: int, answer: Answer, stream: str | None = None) -> str:
    """What a rank is doing, in words, for the lines of a report."""
    if answer is None:
        return NO_ANSWER
    progress = f" (it has issued {issued(answer, stream)} operation(s) on that stream)" if stream else ""
    if answer.get("state") == "left":
        return f"left the job (td.shutdown or exit){progress}"
    waits = answer.get("waits") or []
    if waits:
        return "waiting in " + "; and in ".join(describe_wait(w) for w in waits) + progress
    if answer.get("inside"):
        return f"inside {answer['inside']}, not waiting on a message{progress}"
    return f"computing, not in any tandem operation{progress}"


@dataclass(frozen=True)
class Desync:
    """Ranks that can never finish their waits, and why; `lines` explain each rank."""

    kind: str  # "cycle" | "mismatch" | "left"
    ranks: tuple[int, ...]
    lines: tuple[str, ...]

    @property
    def reporter(self) -> int:
        return min(self.ranks)


def _waiting(answers: Answers, grace: float) -> dict[int, list[Mapping]]:
    found = {}
    for rank, answer in answers.items():
        if answer and answer.get("state") != "left":
            waits = [w for w in answer.get("waits") or [] if w["age"] >= grace]
            if waits:
                found[rank] = waits
    return found


def _mismatch(waiting: dict[int, list[Mapping]]) -> Desync | None:
    by_slot: dict[tuple[str, int], dict[int, Mapping]] = {}
    for rank, waits in waiting.items():
        for wait in waits:
            op = wait["op"]
            if op["kind"] in ("send", "recv"):
                continue  # a send and its recv differ by design
            by_slot.setdefault((op["stream"], op["index"]), {})[rank] = wait
    for waits in by_slot.values():
        kinds = {(w["op"]["kind"], w["op"].get("detail")) for w in waits.values()}
        if len(kinds) > 1:
            lines = tuple(f"rank {r}: {describe_wait(w)}" for r, w in sorted(waits.items()))
            return Desync("mismatch", tuple(sorted(waits)), lines)
    return None


def _edges(waiting: dict[int, list[Mapping]], answers: Answers) -> dict[int, dict[int, Mapping]]:
    """rank -> {peer it waits for: the wait}, over ranks that wait."""
    edges: dict[int, dict[int, Mapping]] = {}
    for rank, waits in waiting.items():
        for wait in waits:
            _, missing, _ = arrival(wait["op"], rank, answers)
            for peer in missing:
                edges.setdefault(rank, {}).setdefault(peer, wait)
    return edges


def _cycle(edges: dict[int, dict[int, Mapping]]) -> list[int] | None:
    """A cycle in the wait-for graph (each rank waiting for the next), or None."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    path: list[int] = []

    def visit(node: int) -> list[int] | None:
        state[node] = 1
        path.append(node)
        for peer in sorted(edges.get(node, {})):
            if state.get(peer) == 1:
                return path[path.index(peer):]
            if peer in edges and state.get(peer) is None:
                found = visit(peer)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def find_desync(answers: Answers, grace: float) -> Desync | None:
    """A provable desync among ranks that have waited at least `grace` seconds, or None.

    Only waits count: a rank that computes may still arrive, so it never closes a cycle.
    """
    waiting = _waiting(answers, grace)
    mismatch = _mismatch(waiting)
    if mismatch:
        return mismatch
    edges = _edges(waiting, answers)
    for rank, peers in sorted(edges.items()):
        gone = [p for p in peers if answers.get(p) and answers[p].get("state") == "left"]
        if gone:
            wait = peers[gone[0]]
            lines = (f"rank {rank}: {describe_wait(wait)}",
                     *(f"rank {p}: {state_of(p, answers[p], wait['op']['stream'])}" for p in gone))
            return Desync("left", (rank, *gone), lines)
    cycle = _cycle(edges)
    if not cycle:
        return None
    lines = []
    for position, rank in enumerate(cycle):
        peer = cycle[(position + 1) % len(cycle)]
        wait = edges[rank][peer]
        stream = wait["op"]["stream"]
        lines.append(
            f"rank {rank}: {describe_wait(wait)}; rank {peer} has not reached it "
            f"(it has issued {issued(answers[peer], stream)} operation(s) on that stream)"
        )
    return Desync("cycle", tuple(cycle), tuple(lines))


def stacks(answers: Answers, ranks: Iterable[int] | None = None) -> str:
    """Each rank's Python stack, ranks with identical stacks listed together."""
    grouped: dict[str, list[int]] = {}
    chosen = sorted(answers) if ranks is None else sorted(ranks)
    for rank in chosen:
        answer = answers.get(rank)
        if not answer or not answer.get("stack"):
            continue
        grouped.setdefault(answer["stack"], []).append(rank)  # dicts keep the first rank's order
    parts = []
    for text, members in grouped.items():
        where = ", ".join(
            f"{r} (pid {answers[r].get('pid')} on {answers[r].get('host')})" for r in members
        )
        parts.append(f"--- {'rank' if len(members) == 1 else 'ranks'} {where}:\n{text.rstrip()}")
    return "\n".join(parts)


def timeout_report(me: int, wait: Mapping, answers: Answers, with_stacks: bool = True) -> str:
    """Which ranks arrived at the operation `me` gave up on, what the others do, their stacks."""
    op = wait["op"]
    arrived, missing, unknown = arrival(op, me, answers)
    elsewhere = {rank: other for rank in arrived if rank != me
                 for other in _same_place(op, answers.get(rank))}
    lines = [
        f"tandem watchdog: rank {me} waited {wait['age']:.1f} s for {describe_op(op)}, called "
        f"as {wait.get('fingerprint') or (wait.get('entry') or '') + ' at ' + str(wait.get('site'))}"
        f" (timeout {wait['timeout']:g} s).",
        f"  arrived:     {ranks_text(set(arrived) - set(elsewhere))}",
        f"  not arrived: {ranks_text(missing + unknown)}",
    ]
    for rank in sorted(missing + unknown):
        lines.append(f"    rank {rank}: {state_of(rank, answers.get(rank), op['stream'])}")
    if elsewhere:
        lines.append(f"  in a different operation at the same place (a desync): "
                     f"{ranks_text(elsewhere)}")
        lines.extend(f"    rank {rank}: {describe_wait(other)}" for rank, other in
                     sorted(elsewhere.items()))
    if with_stacks:
        text = stacks(answers)
        if text:
            lines.append("Python stacks (innermost call last):")
            lines.append(text)
    # A rank that never arrived (stopped, hung, computing) holds everyone up, whatever the
    # others wait in: a rank stuck in an operation it cannot finish is waiting too, not the
    # cause. A desync is the answer only when every member reached the place.
    if missing or unknown:
        why = (f"waiting for {ranks_text(missing + unknown)}. If this wait is legitimate, raise "
               "the timeout (td.init(timeout=...), TANDEM_TIMEOUT or tandem run --timeout)")
    else:
        why = (f"{ranks_text(elsewhere)} called a different operation there: make every rank "
               "call the same collectives in the same order (TANDEM_DEBUG=1 names the lines)")
    lines.append(f"tandem watchdog: rank {me} gives up on {describe_op(op)} after "
                 f"{wait['timeout']:g} s; {why}.")
    return "\n".join(lines)


def _same_place(op: Mapping, answer: Answer) -> list[Mapping]:
    """The waits of `answer` on `op`'s place of its stream that are a different operation."""
    if not answer or op["kind"] in ("send", "recv"):
        return []
    return [w for w in answer.get("waits") or []
            if (w["op"]["stream"], w["op"]["index"]) == (op["stream"], op["index"])
            and (w["op"]["kind"], w["op"].get("detail")) != (op["kind"], op.get("detail"))][:1]


def desync_report(me: int, desync: Desync, answers: Answers) -> str:
    """The debug-mode report: the ranks that wait for each other, and everyone's stack."""
    why = {
        "cycle": "these ranks wait for each other in different operations and can never finish",
        "mismatch": "these ranks wait in different operations at the same place of one stream",
        "left": "a rank waits for a peer that has left the job",
    }[desync.kind]
    lines = [f"tandem watchdog: desync: {why}:"]
    lines.extend(f"  {line}" for line in desync.lines)
    text = stacks(answers)
    if text:
        lines.append("Python stacks (innermost call last):")
        lines.append(text)
    if desync.kind == "left":
        lines.append(LEFT_EARLY_HINT)
    lines.append(
        f"tandem watchdog: ending the job from rank {me}: desync among "
        f"{ranks_text(desync.ranks)} (make every rank call the same collectives in the same order)"
    )
    return "\n".join(lines)


def unreachable_peers(op: Mapping, me: int, answers: Answers) -> tuple[list[int], list[int]]:
    """(members that did not answer, members that left) of `op`'s stream, excluding `me`."""
    silent = [m for m in op["members"] if m != me
              and (answers.get(m) is None or answers[m].get("state") == "died")]
    left = [m for m in op["members"]
            if m != me and answers.get(m) and answers[m].get("state") == "left"]
    return silent, left
