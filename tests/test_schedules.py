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
    with_communication,
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


# -- every problem named exactly (found by mutation testing: scripts/mutation.sh) ------------

SA, RA, SG, RG = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD,
                  ActionKind.RECV_GRAD)


def _problems(schedule, m, backward=True) -> list[str]:
    """The problem lines of the ScheduleError that `validate` raises (before the grid)."""
    with pytest.raises(ScheduleError) as info:
        validate(schedule, m, backward)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid pipeline schedule:"
    return [line[2:] for line in lines[1:] if line.startswith("  ")]


def _without(actions, *dropped):
    return [a for a in actions if a not in dropped]


def test_each_malformation_is_named_with_the_action_and_stage():
    two = build_schedule("gpipe", 2, 2)
    three = build_schedule("gpipe", 3, 1)  # stage 1 is in the middle: it sends and receives both ways
    cases = [
        ({0: [Action(0, F, 0)], 2: [Action(2, F, 0)]}, 1, False,
         ["stages must be numbered 0..1, got [0, 2]"]),
        ({0: two[0], 2: two[1]}, 2, True,  # with communication: no grid is simulated for it
         ["stages must be numbered 0..1, got [0, 2]"]),
        ({0: two[0][:-1] + [Action(1, B, 1)], 1: two[1]}, 2, True,  # 0B1 misnamed 1B1
         ["1B1 is listed under stage 0"]),
        ({0: two[0] + [Action(0, ActionKind.F, 2)], 1: two[1]}, 2, True,
         ["0F2: micro-batch outside 0..1"]),
        ({0: two[0], 1: two[1] + [Action(1, SA, 0)]}, 2, True,
         ["1SA0 talks to stage 2, which does not exist"]),
        ({0: _without(two[0], Action(0, F, 1)), 1: two[1]}, 2, True, ["stage 0 never runs 0F1"]),
        ({0: [Action(0, F, 0), Action(0, B, 0)]}, 1, False, ["0B0 in a forward-only schedule"]),
        ({0: three[0], 1: _without(three[1], Action(1, RG, 0)), 2: three[2]}, 1, True,
         ["stage 1 never posts 1RG0"]),
        ({0: three[0], 1: _without(three[1], Action(1, SA, 0)), 2: three[2]}, 1, True,
         ["stage 1 never runs 1SA0"]),
        ({0: three[0], 1: _without(three[1], Action(1, SG, 0)), 2: three[2]}, 1, True,
         ["stage 1 never runs 1SG0"]),
        ({0: [Action(0, SA, 0), Action(0, F, 0), Action(0, RG, 0), Action(0, B, 0)],
          1: build_schedule("gpipe", 2, 1)[1]}, 1, True, ["0SA0 comes before 0F0"]),
    ]
    for schedule, m, backward, expected in cases:
        assert _problems(schedule, m, backward) == expected, schedule


def test_at_most_twenty_problems_are_listed():
    schedule = {0: [Action(0, F, i) for i in range(30)]}
    problems = _problems(schedule, 30)
    assert problems == [f"stage 0 never runs 0B{i}" for i in range(20)]


def test_a_stuck_compute_says_whose_input_it_waits_for():
    _, stuck = simulate({0: [Action(0, F, 0)], 1: [Action(1, RA, 0), Action(1, F, 0)]})
    assert stuck == {1: "stage 1 stuck at 1F0 (waits for its input from stage 0)"}
    _, stuck = simulate({0: [Action(0, F, 0), Action(0, SA, 0), Action(0, RG, 0), Action(0, B, 0)],
                         1: [Action(1, RA, 0), Action(1, F, 0)]})
    assert stuck == {0: "stage 0 stuck at 0B0 (waits for its input from stage 1)"}


def test_a_gradient_is_sent_only_after_its_backward():
    # 1SG0 listed before 1B0: the simulation must not send a gradient that does not exist yet.
    schedule = {0: [Action(0, F, 0), Action(0, SA, 0), Action(0, RG, 0), Action(0, B, 0)],
                1: [Action(1, RA, 0), Action(1, F, 0), Action(1, SG, 0), Action(1, B, 0)]}
    _, stuck = simulate(schedule)
    assert stuck == {0: "stage 0 stuck at 0B0 (waits for its input from stage 1)",
                     1: "stage 1 stuck at 1SG0 (waits for stage 0 to post 0RG0)"}
    assert format_grid(schedule) == (
        "step     0    1\n"
        "stage 0  0F0  .\n"
        "stage 1  .    1F0\n"
        "stage 0 stuck at 0B0 (waits for its input from stage 1)\n"
        "stage 1 stuck at 1SG0 (waits for stage 0 to post 0RG0)")
    # validate() finds the malformation before it simulates anything.
    assert _problems(schedule, 1) == ["1SG0 comes before 1B0"]
    # A well-formed schedule that deadlocks: the simulation says so, stage by stage.
    assert _problems(_naive_1f1b(2, 4), 4) == [
        "deadlock:", "stage 0 stuck at 0SA1 (waits for stage 1 to post 1RA1)",
        "stage 1 stuck at 1SG0 (waits for stage 0 to post 0RG0)"]


def test_grids_of_nothing_and_listings_are_exact():
    assert format_grid({0: [Action(0, SA, 0), Action(0, F, 0)]}) == (
        "(no step could run)\nstage 0 stuck at 0SA0 (waits for stage 1 to post 1RA0)")
    assert format_actions(build_schedule("gpipe", 3, 1)) == (  # shorter stages are padded
        "action   0     1     2     3     4     5\n"
        "stage 0  0F0   0RG0  0SA0  0B0\n"
        "stage 1  1RA0  1F0   1RG0  1SA0  1B0   1SG0\n"
        "stage 2  2RA0  2F0   2B0   2SG0")
    assert format_actions({}) == "action"


def test_peak_inflight_counts_a_backward_as_one():
    schedule = {0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, F, 2)]}
    assert peak_inflight(schedule) == {0: 2}


def test_a_backward_first_order_posts_its_gradient_receive_first():
    assert with_communication([Action(0, B, 0)], 2) == [Action(0, RG, 0), Action(0, B, 0)]
    assert with_communication([], 2) == []


def test_unknown_kinds_are_listed():
    with pytest.raises(ValueError, match="choose one of 1f1b, gpipe, forward$"):
        build_schedule("zigzag", 2, 2)
