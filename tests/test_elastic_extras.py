"""td.elastic.State keeps objects, not copies: a scheduler (any object with state_dict() and
load_state_dict()) given as an extra acts on the real optimizer, is restored in place, and is
compared by value across ranks. The 3 -> 2 -> 3 journey with a scheduler is in test_elastic.py."""

import threading
import warnings

import pytest
import torch

import tandem as td
from tandem.elastic import extras
from tandem.testing import run_distributed

STEPS = 24


def _schedulers(optimizer):
    lr = torch.optim.lr_scheduler
    return {
        "steplr": lambda: lr.StepLR(optimizer, step_size=5, gamma=0.5),
        "onecycle": lambda: lr.OneCycleLR(optimizer, max_lr=0.1, total_steps=STEPS),
        "lambda": lambda: lr.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)),
    }


def _learning_rates(kind: str, elastic: bool) -> list[float]:
    """The learning rate after each of STEPS steps, the scheduler kept in a State (or not)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = _schedulers(optimizer)[kind]()
    rates = []
    if not elastic:
        for _ in range(STEPS):
            optimizer.step()
            scheduler.step()
            rates.append(optimizer.param_groups[0]["lr"])
        return rates
    state = td.elastic.State(model=model, optimizer=optimizer, step=0, scheduler=scheduler)

    @td.elastic.run
    def train(state):
        while state.step < STEPS:
            optimizer.step()
            state.scheduler.step()
            rates.append(optimizer.param_groups[0]["lr"])
            state.step += 1
            state.commit()

    train(state)
    assert state.scheduler is scheduler, "the State replaced the scheduler with a copy"
    return rates


def check_schedulers_act_on_the_real_optimizer():
    td.init()
    return {kind: (_learning_rates(kind, elastic=True), _learning_rates(kind, elastic=False))
            for kind in ("steplr", "onecycle", "lambda")}


def test_a_scheduler_kept_as_an_extra_steps_the_real_learning_rate_in_one_process():
    for per_kind in run_distributed(check_schedulers_act_on_the_real_optimizer, 1):
        for kind, (elastic, plain) in per_kind.items():
            assert elastic == plain, kind
    assert per_kind["steplr"][0][-1] == pytest.approx(0.000625)  # the 0.01 before


def check_restore_puts_the_state_back_into_the_same_objects():
    td.init()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = td.elastic.State(model=model, optimizer=optimizer, scheduler=scheduler, epoch=0)
    state.commit()
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state.epoch = 7
    state.restore()
    return (state.scheduler is scheduler, scheduler.last_epoch, state.epoch,
            optimizer.param_groups[0]["lr"])


def test_restore_loads_the_snapshot_into_the_scheduler_in_place():
    for same, last_epoch, epoch, lr in run_distributed(
            check_restore_puts_the_state_back_into_the_same_objects, 1):
        assert same and last_epoch == 0 and epoch == 0 and lr == pytest.approx(0.1)


def test_extras_are_compared_by_value_not_identity():
    def scheduler():
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)

    one, other = scheduler(), scheduler()
    assert extras.digest_bytes({"s": one, "step": 3}) == extras.digest_bytes({"s": other, "step": 3})
    other.optimizer.step()
    other.step()
    assert extras.digest_bytes({"s": one}) != extras.digest_bytes({"s": other})


@pytest.mark.parametrize(("value", "named"), [
    (lambda: 0, "it cannot be pickled and has no state_dict()"),
    (threading.Lock(), "it cannot be pickled and has no state_dict()"),
    (torch.optim.SGD, "is a class"),
])
def test_an_extra_that_can_be_neither_copied_nor_state_dicted_is_named(value, named):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="extra 'thing'") as error:
        td.elastic.State(model=model, thing=value)
    assert named in str(error.value)
    state = td.elastic.State(model=model, step=0)
    with pytest.raises(TypeError, match="extra 'thing'"):
        state.thing = value
    assert state.step == 0  # nothing was lost


def check_a_plain_loader_is_warned_once_and_left_out():
    td.init()
    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    plain = torch.utils.data.DataLoader(data, batch_size=2)
    kept, _ = td.partition_dataset(data, batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = td.elastic.State(model=model, loader=plain, kept=kept, step=0)
        for _ in range(3):
            state.step += 1
            state.commit()
        state.restore()
    return ([str(w.message) for w in caught], sorted(extras.values(state._extras)),
            state.loader is plain)


def test_a_loader_without_state_in_an_elastic_state_is_warned_once_and_left_out():
    """A plain DataLoader keeps no position: one warning, and the commits leave it out (no
    copy of its dataset per commit); td.partition_dataset's loader is kept by its position."""
    for messages, names, same in run_distributed(check_a_plain_loader_is_warned_once_and_left_out, 1):
        assert len(messages) == 1, messages
        assert "loader=DataLoader keeps no data position" in messages[0]
        assert "td.elastic.State's commits" in messages[0] and "epoch's start" in messages[0]
        assert names == ["kept", "step"] and same
