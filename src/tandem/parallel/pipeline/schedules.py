"""Pipeline schedules as data: a list of actions per stage, validated by simulation.

    >>> schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    >>> print(format_grid(schedule))
    step     0    1    2    3    4    5    6    7    8
    stage 0  0F0  0F1  .    0B0  0F2  0B1  0F3  0B2  0B3
    stage 1  .    1F0  1B0  1F1  1B1  1F2  1B2  1F3  1B3

An `Action` is (stage, kind, micro-batch), printed `1F3` (stage 1, forward, micro-batch 3).
Compute kinds are `F` and `B`; communication kinds say what moves: `SA`/`RA` send/receive an
activation to/from the next/previous stage, `SG`/`RG` a gradient to/from the previous/next.
A receive action *posts* the receive (it does not wait); the compute that needs the data
waits for it. The executor (`pipeline.executor`) only runs these lists.

`validate` checks a schedule once: every micro-batch forwarded then backwarded exactly once on
each stage, each receive posted before the compute that consumes it, each send matched by one
receive on the neighbour — and that it cannot deadlock, by simulating it under the strictest
transport (a send completes only once the peer has posted the matching receive, as with a
rendezvous protocol). A schedule that passes runs on any engine that is at least that lenient.
Errors show the rank × step grid.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

KINDS = ("1f1b", "gpipe", "forward")


class ActionKind(enum.Enum):
    F = "F"
    B = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B)


F, B = ActionKind.F, ActionKind.B
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD


@dataclass(frozen=True)
class Action:
    """One step of one stage: `1F3` is stage 1, forward, micro-batch 3."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__


Schedule = dict[int, list[Action]]


class ScheduleError(ValueError):
    """A schedule that is malformed or would deadlock; the message shows the grid."""


def compute_order(kind: str, num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """The order of forward and backward passes on one stage."""
    p, s, m = num_stages, stage, num_microbatches
    if kind == "forward":
        return [Action(s, F, i) for i in range(m)]
    if kind == "gpipe":
        return [Action(s, F, i) for i in range(m)] + [Action(s, B, i) for i in range(m)]
    # 1F1B: enough forwards to fill the pipeline below this stage, then alternate, then drain.
    # The last stage starts alternating at once; stage s keeps at most p - s forwards alive.
    warmup = min(p - s - 1, m)
    order = [Action(s, F, i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order += [Action(s, F, forward), Action(s, B, backward)]
        forward, backward = forward + 1, backward + 1
    order += [Action(s, B, i) for i in range(backward, m)]
    return order


def _receives(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage, action.microbatch
    if action.kind is F and s > 0:
        return [Action(s, RECV_ACT, i)]
    if action.kind is B and s < num_stages - 1:
        return [Action(s, RECV_GRAD, i)]
    return []


def _sends(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage, action.microbatch
    if action.kind is F and s < num_stages - 1:
        return [Action(s, SEND_ACT, i)]
    if action.kind is B and s > 0:
        return [Action(s, SEND_GRAD, i)]
    return []


def with_communication(order: list[Action], num_stages: int) -> list[Action]:
    """Insert sends and receives around a stage's compute order.

    Each receive is posted one compute ahead of the pass that needs it, and *before* the sends
    of the pass in between: the neighbour's matching send can then complete while this stage
    computes, and two neighbours never both wait in a send for the other's receive (the
    classic 1F1B deadlock when a send-activation and a send-gradient cross).
    """
    if not order:
        return []
    actions = _receives(order[0], num_stages)
    for k, compute in enumerate(order):
        actions.append(compute)
        if k + 1 < len(order):
            actions += _receives(order[k + 1], num_stages)
        actions += _sends(compute, num_stages)
    return actions


def build_schedule(kind: str, num_stages: int, num_microbatches: int) -> Schedule:
    """`{stage: [Action, ...]}` for "1f1b", "gpipe" or "forward" (inference: F only); validated."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a schedule needs num_stages >= 1 and num_microbatches >= 1, got "
            f"num_stages={num_stages}, num_microbatches={num_microbatches}"
        )
    schedule = {
        s: with_communication(compute_order(kind, num_stages, s, num_microbatches), num_stages)
        for s in range(num_stages)
    }
    validate(schedule, num_microbatches, backward=kind != "forward")
    return schedule


# -- validation ---------------------------------------------------------------------------

def _peer(action: Action) -> tuple[int, ActionKind]:
    """The stage and kind of the action that matches a send or receive."""
    s = action.stage
    return {
        SEND_ACT: (s + 1, RECV_ACT),
        RECV_ACT: (s - 1, SEND_ACT),
        SEND_GRAD: (s - 1, RECV_GRAD),
        RECV_GRAD: (s + 1, SEND_GRAD),
    }[action.kind]


def _check_structure(schedule: Schedule, num_microbatches: int, backward: bool) -> list[str]:
    problems = []
    stages = sorted(schedule)
    if stages != list(range(len(stages))):
        return [f"stages must be numbered 0..{len(stages) - 1}, got {stages}"]
    p, everything = len(stages), range(num_microbatches)
    for s in stages:
        position: dict[tuple[ActionKind, int], int] = {}
        for index, action in enumerate(schedule[s]):
            key = (action.kind, action.microbatch)
            if action.stage != s:
                problems.append(f"{action} is listed under stage {s}")
            if key in position:
                problems.append(f"{action} appears twice on stage {s}")
            if not 0 <= action.microbatch < num_microbatches:
                problems.append(f"{action}: micro-batch outside 0..{num_microbatches - 1}")
            if not action.kind.is_compute:
                peer, _ = _peer(action)
                if not 0 <= peer < p:
                    problems.append(f"{action} talks to stage {peer}, which does not exist")
            position[key] = index
        for i in everything:
            if (F, i) not in position:
                problems.append(f"stage {s} never runs {Action(s, F, i)}")
            if backward and (B, i) not in position:
                problems.append(f"stage {s} never runs {Action(s, B, i)}")
            if not backward and (B, i) in position:
                problems.append(f"{Action(s, B, i)} in a forward-only schedule")
            if (F, i) in position and (B, i) in position and position[(B, i)] < position[(F, i)]:
                problems.append(f"{Action(s, B, i)} comes before {Action(s, F, i)}")
            needs = [(RECV_ACT, F)] if s > 0 else []
            needs += [(RECV_GRAD, B)] if backward and s < p - 1 else []
            for recv, compute in needs:
                if (recv, i) not in position:
                    problems.append(f"stage {s} never posts {Action(s, recv, i)}")
                elif (compute, i) in position and position[(recv, i)] > position[(compute, i)]:
                    problems.append(f"{Action(s, recv, i)} is posted after {Action(s, compute, i)}")
            sends = [(SEND_ACT, F)] if s < p - 1 else []
            sends += [(SEND_GRAD, B)] if backward and s > 0 else []
            for send, compute in sends:
                if (send, i) not in position:
                    problems.append(f"stage {s} never runs {Action(s, send, i)}")
                elif (compute, i) in position and position[(send, i)] < position[(compute, i)]:
                    problems.append(f"{Action(s, send, i)} comes before {Action(s, compute, i)}")
    return problems


def simulate(schedule: Schedule) -> tuple[list[dict[int, Action]], dict[int, str]]:
    """Run the schedule in rounds; return (rounds, stuck).

    In each round, communication that can proceed happens at once (receives are posted, sends
    complete when the peer has posted the receive), then every stage whose next action is a
    compute with its input delivered runs it: compute takes one round, so the rounds form the
    time-aligned grid. `stuck` maps each unfinished stage to why it cannot continue (empty when
    the schedule ran to the end).
    """
    pc = dict.fromkeys(schedule, 0)
    posted: set[tuple[int, ActionKind, int]] = set()
    delivered: set[tuple[int, ActionKind, int]] = set()  # (receiving stage, RECV kind, mb)
    done: set[Action] = set()
    rounds: list[dict[int, Action]] = []

    def ready(action: Action) -> bool:
        s, i = action.stage, action.microbatch
        if action.kind in (RECV_ACT, RECV_GRAD):
            return True
        if action.kind in (SEND_ACT, SEND_GRAD):
            peer, recv = _peer(action)
            return Action(s, F if action.kind is SEND_ACT else B, i) in done and (
                (peer, recv, i) in posted
            )
        need = RECV_ACT if action.kind is F else RECV_GRAD
        has_input = (s, need, i) in delivered or not any(
            a.kind is need and a.microbatch == i for a in schedule[s]
        )
        return has_input

    while True:
        progress = True
        while progress:  # communication is instantaneous: run it to a fixed point
            progress = False
            for s, actions in schedule.items():
                while pc[s] < len(actions) and not actions[pc[s]].kind.is_compute:
                    action = actions[pc[s]]
                    if not ready(action):
                        break
                    if action.kind in (RECV_ACT, RECV_GRAD):
                        posted.add((s, action.kind, action.microbatch))
                    else:
                        peer, recv = _peer(action)
                        delivered.add((peer, recv, action.microbatch))
                    done.add(action)
                    pc[s] += 1
                    progress = True
        step = {
            s: actions[pc[s]]
            for s, actions in schedule.items()
            if pc[s] < len(actions) and ready(actions[pc[s]])
        }
        if not step:
            break
        rounds.append(step)
        for s, action in step.items():
            done.add(action)
            pc[s] += 1
    stuck = {}
    for s, actions in schedule.items():
        if pc[s] < len(actions):
            action = actions[pc[s]]
            if action.kind in (SEND_ACT, SEND_GRAD):
                peer, recv = _peer(action)
                why = f"waits for stage {peer} to post {Action(peer, recv, action.microbatch)}"
            else:
                source = action.stage - 1 if action.kind is F else action.stage + 1
                why = f"waits for its input from stage {source}"
            stuck[s] = f"stage {s} stuck at {action} ({why})"
    return rounds, stuck


def validate(schedule: Schedule, num_microbatches: int, backward: bool = True) -> None:
    """Raise `ScheduleError` (with the grid) unless the schedule is complete and deadlock-free."""
    problems = _check_structure(schedule, num_microbatches, backward)
    if not problems:
        _, stuck = simulate(schedule)
        if stuck:
            problems = ["deadlock:", *stuck.values()]
    if problems:
        numbered = sorted(schedule) == list(range(len(schedule)))
        # The grid is drawn by simulating the stages in order: only for stages 0..p-1.
        shown = f"\n{format_grid(schedule)}\n{format_actions(schedule)}" if numbered else ""
        raise ScheduleError("invalid pipeline schedule:\n  " + "\n  ".join(problems[:20]) + shown)


# -- inspection ---------------------------------------------------------------------------

def _table(rows: list[tuple[str, list[str]]], header: list[str], corner: str) -> str:
    width = max([len(c) for _, cells in rows for c in cells] + [len(h) for h in header] + [3])
    label = max(len(name) for name, _ in rows + [(corner, [])])
    lines = ["  ".join([f"{corner:<{label}}", *(f"{h:<{width}}" for h in header)]).rstrip()]
    for name, cells in rows:
        lines.append("  ".join([f"{name:<{label}}", *(f"{c:<{width}}" for c in cells)]).rstrip())
    return "\n".join(lines)


def format_grid(schedule: Schedule) -> str:
    """The compute passes as a stage × time-step grid (one unit per pass, `.` = idle)."""
    rounds, stuck = simulate(schedule)
    header = [str(t) for t in range(len(rounds))]
    rows = [
        (f"stage {s}", [str(r[s]) if s in r else "." for r in rounds]) for s in sorted(schedule)
    ]
    text = _table(rows, header, "step") if rounds else "(no step could run)"
    if stuck:
        text += "\n" + "\n".join(stuck.values())
    return text


def format_actions(schedule: Schedule) -> str:
    """Every action of every stage in list order, communication included."""
    longest = max((len(a) for a in schedule.values()), default=0)
    rows = [
        (f"stage {s}", [str(a) for a in schedule[s]] + [""] * (longest - len(schedule[s])))
        for s in sorted(schedule)
    ]
    return _table(rows, [str(k) for k in range(longest)], "action")


def peak_inflight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches forwarded and not yet backwarded at any point."""
    peaks = {}
    for s, actions in schedule.items():
        live = peak = 0
        for action in actions:
            live += 1 if action.kind is F else -1 if action.kind is B else 0
            peak = max(peak, live)
        peaks[s] = peak
    return peaks


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step with equal stages: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def compute_steps(schedule: Schedule) -> int:
    """How many unit-time steps the simulated schedule takes (the length of its grid)."""
    return len(simulate(schedule)[0])


def actions_of(schedule: Schedule, kinds: Iterable[ActionKind]) -> Schedule:
    """The schedule restricted to some kinds (e.g. compute only), for tests and printing."""
    wanted = set(kinds)
    return {s: [a for a in actions if a.kind in wanted] for s, actions in schedule.items()}
