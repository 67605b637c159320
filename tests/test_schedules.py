"""Pipeline schedules as data: shapes of GPipe and 1F1B, validation, grids — no processes."""

import pytest

from tandem.parallel.pipeline.schedules import (
    KINDS,
    Action,
    ActionKind,
    ScheduleError,
    actions_of,
    bubble_fraction,
    build_schedule,
    compute_order,
    compute_steps,
    format_actions,
    format_grid,
    peak_inflight,
    simulate,
    validate,
)

F, B = ActionKind.F, ActionKind.B
COMPUTE = (F, B)


def kinds(actions):
    return "".join(a.kind.value for a in actions)


def test_action_prints_compactly():
    assert str(Action(1, F, 3)) == "1F3"
    assert str(Action(0, ActionKind.SEND_ACT, 2)) == "0SA2"
    assert repr([Action(2, ActionKind.RECV_GRAD, 0)]) == "[2RG0]"


def test_gpipe_is_all_forwards_then_all_backwards():
    schedule = actions_of(build_schedule("gpipe", 3, 5), COMPUTE)
    for s, actions in schedule.items():
        assert actions == [Action(s, F, i) for i in range(5)] + [Action(s, B, i) for i in range(5)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 1), (5, 7)])
def test_1f1b_warms_up_then_alternates(p, m):
    schedule = actions_of(build_schedule("1f1b", p, m), COMPUTE)
    for s, actions in schedule.items():
        warmup = min(p - s - 1, m)
        steady = m - warmup
        assert kinds(actions) == "F" * warmup + "FB" * steady + "B" * warmup, (s, actions)
        forwards = [a.microbatch for a in actions if a.kind is F]
        backwards = [a.microbatch for a in actions if a.kind is B]
        assert forwards == backwards == list(range(m))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 8), (4, 3), (8, 16)])
def test_peak_inflight_activations(p, m):
    gpipe = peak_inflight(build_schedule("gpipe", p, m))
    one_f_one_b = peak_inflight(build_schedule("1f1b", p, m))
    for s in range(p):
        assert gpipe[s] == m
        assert one_f_one_b[s] == min(p - s, m)


def test_every_size_validates_and_takes_the_textbook_number_of_steps():
    for kind in KINDS:
        for p in range(1, 9):
            for m in range(1, 17):
                schedule = build_schedule(kind, p, m)  # validates, deadlock simulation included
                steps = compute_steps(schedule)
                assert steps == (m + p - 1) * (1 if kind == "forward" else 2), (kind, p, m)
                idle = sum(steps - len(actions_of(schedule, COMPUTE)[s]) for s in schedule)
                if kind != "forward":  # idle share of the grid is the textbook bubble
                    assert idle / (steps * p) == pytest.approx(bubble_fraction(p, m))


def test_receives_are_posted_before_the_sends_that_could_cross_them():
    actions = build_schedule("1f1b", 2, 4)[0]
    text = " ".join(map(str, actions))
    # Stage 0 posts the receive for gradient 0 before it sends activation 1.
    assert text.index("0RG0") < text.index("0SA1")


def test_grid_is_time_aligned():
    assert format_grid(build_schedule("1f1b", 2, 4)) == (
        "step     0    1    2    3    4    5    6    7    8    9\n"
        "stage 0  0F0  0F1  .    0B0  0F2  0B1  0F3  0B2  .    0B3\n"
        "stage 1  .    1F0  1B0  1F1  1B1  1F2  1B2  1F3  1B3  ."
    )
    assert format_grid(build_schedule("gpipe", 2, 2)) == (
        "step     0    1    2    3    4    5\n"
        "stage 0  0F0  0F1  .    .    0B0  0B1\n"
        "stage 1  .    1F0  1F1  1B0  1B1  ."
    )
    listing = format_actions(build_schedule("gpipe", 2, 1))
    assert listing.splitlines()[1].split()[2:] == ["0F0", "0RG0", "0SA0", "0B0"]


def _naive_1f1b(p, m):
    """1F1B with each receive posted just before its compute: sends can cross and deadlock."""
    schedule = {}
    for s in range(p):
        actions = []
        for c in compute_order("1f1b", p, s, m):
            i = c.microbatch
            if c.kind is F:
                actions += [Action(s, ActionKind.RECV_ACT, i)] if s > 0 else []
                actions += [c] + ([Action(s, ActionKind.SEND_ACT, i)] if s < p - 1 else [])
            else:
                actions += [Action(s, ActionKind.RECV_GRAD, i)] if s < p - 1 else []
                actions += [c] + ([Action(s, ActionKind.SEND_GRAD, i)] if s > 0 else [])
        schedule[s] = actions
    return schedule


def test_crossing_sends_are_caught_as_a_deadlock_with_the_grid():
    schedule = _naive_1f1b(2, 4)
    _, stuck = simulate(schedule)
    assert set(stuck) == {0, 1}
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 4)
    message = str(info.value)
    assert "deadlock" in message
    assert "stage 0 stuck at 0SA1 (waits for stage 1 to post 1RA1)" in message
    assert "stage 1 stuck at 1SG0 (waits for stage 0 to post 0RG0)" in message
    assert "stage 0  0F0" in message  # the grid of what did run


def test_malformed_schedules_are_rejected():
    good = build_schedule("gpipe", 2, 2)
    cases = {
        "0B0 comes before 0F0": {0: [Action(0, B, 0)] + [a for a in good[0] if a != Action(0, B, 0)],
                                 1: good[1]},
        "never runs 0B1": {0: [a for a in good[0] if a != Action(0, B, 1)], 1: good[1]},
        "appears twice": {0: good[0] + [Action(0, F, 0)], 1: good[1]},
        "1RA0 is posted after 1F0": {
            0: good[0], 1: [Action(1, F, 0)] + [a for a in good[1] if a != Action(1, F, 0)]
        },
        "talks to stage -1": {0: good[0] + [Action(0, ActionKind.SEND_GRAD, 0)], 1: good[1]},
    }
    for expected, schedule in cases.items():
        with pytest.raises(ScheduleError, match=expected):
            validate(schedule, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        build_schedule("1f1b", 2, 0)


def test_bubble_fraction():
    assert bubble_fraction(2, 1) == 0.5
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(1, 8) == 0.0
