"""A job stopped mid-epoch resumes at the exact sample, on any number of ranks (issue 44, item 3).

`td.partition_dataset`'s loader keeps its position (epoch, place in the epoch's order) as a state
dict that `td.Checkpointer` saves with the model. A job of 2 ranks stopped after step k and
resumed on 3 ranks reads the rest of the epoch split three ways: every sample once per epoch,
the global batches of one process, and the parameters of one uninterrupted process. The
sampler's arithmetic is tested without processes first.
"""

import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tandem as td
from tandem.data import ShardSampler, epoch_order
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]
N, BATCH, EPOCHS, SEED = 100, 30, 2, 3  # steps of 30, 30, 30, 10: the last one uneven on 3 ranks


# -- the sampler's position, without processes --------------------------------------------------


def read_steps(samplers, steps=None):
    """The global batches (one list of ids per step) that `samplers` (one per rank) read."""
    per_rank = BATCH // len(samplers)
    shards = [iter(s) for s in samplers]
    batches = []
    while steps is None or len(batches) < steps:
        parts = [[i for _, i in zip(range(per_rank), shard, strict=False)] for shard in shards]
        if not any(parts):
            break
        batches.append(parts)
        for s in samplers:
            s.batch_taken()
    return batches


def one_process_batches(epoch):
    order = epoch_order(N, epoch, SEED).tolist()
    return [sorted(order[s:s + BATCH]) for s in range(0, N, BATCH)]


@pytest.mark.parametrize("pad", [False, True])
def test_the_rest_of_an_epoch_is_resplit_over_another_number_of_ranks(pad):
    two = [ShardSampler(N, r, 2, batch_size=BATCH, seed=SEED, pad=pad) for r in range(2)]
    first = read_steps(two, steps=2)
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert (state["epoch"], state["position"]) == (0, 2 * BATCH)
    three = [ShardSampler(N, r, 3, batch_size=BATCH, seed=SEED, pad=pad) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    assert sum(len(s) for s in three) == (N - 2 * BATCH if not pad else 42)
    rest = read_steps(three)
    steps = [sorted(i for part in parts for i in part) for parts in first + rest]
    expected = one_process_batches(0)
    if pad:  # the padded last step repeats the first samples of the epoch's order on 3 ranks
        assert steps[:3] == expected[:3] and set(expected[3]) <= set(steps[3])
    else:
        assert steps == expected
    for s in three:
        s.pass_finished()
    assert [s.state_dict()["epoch"] for s in three] == [1, 1, 1]
    assert three[0].state_dict()["position"] == 0


def test_the_last_batch_taken_moves_the_state_to_the_next_epoch():
    samplers = [ShardSampler(N, r, 2, batch_size=BATCH, seed=SEED, pad=False) for r in range(2)]
    read_steps(samplers)  # all four steps, no end-of-pass seen yet
    assert (samplers[0].state_dict()["epoch"], samplers[0].state_dict()["position"]) == (1, 0)


def test_set_epoch_of_the_restored_epoch_keeps_the_position():
    sampler = ShardSampler(N, 0, 2, batch_size=BATCH, seed=SEED)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 1, "position": 60})
    sampler.set_epoch(1)  # a script's `loader.set_epoch(epoch)` at the top of the epoch
    assert len(sampler) == 20 and sampler.indices(1, 60) == list(sampler)
    sampler.set_epoch(1)  # a new pass of the same epoch: from its start
    assert len(sampler) == 50


@pytest.mark.parametrize("changed", [{"length": 120}, {"batch_size": 60}])
def test_a_position_from_another_dataset_or_batch_is_refused_by_name(changed):
    saved = {**ShardSampler(N, 0, 2, batch_size=BATCH).state_dict(), **changed}
    sampler = ShardSampler(N, 1, 3, batch_size=BATCH)
    with pytest.raises(ValueError) as caught:
        sampler.load_state_dict(saved)
    message = str(caught.value)
    (key, value), = changed.items()
    now = getattr(sampler, key)  # both values named: the saved job's and this one's
    assert "rank 1" in message and f"{key}={value}" in message and f"{key}={now}" in message
    assert "leave data= out of restore" in message


# -- a real job: 2 ranks stopped at step k, resumed on 3 ------------------------------------------


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))


def dataset():
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(N, 12, generator=g), torch.randint(0, 5, (N,), generator=g),
                         torch.arange(N))


def one_process(until=None):
    """The uninterrupted one-process run: the same batches of the same orders."""
    x, y, _ = dataset().tensors
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(EPOCHS):
        order = torch.as_tensor(epoch_order(N, epoch, seed=SEED))
        for start in range(0, N, BATCH):
            rows = order[start:start + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows], reduction="sum").div(len(rows)).backward()
            opt.step()
    return model


def train(directory, stop_after=None):
    """Train from the newest checkpoint in `directory` (if any); with `stop_after`, save after
    that global step and stop there. Returns the sample ids read, per epoch, and the largest
    parameter difference from one uninterrupted process."""
    model = mlp()
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader, _ = td.partition_dataset(dataset(), batch_size=BATCH, seed=SEED, pad=False)
    checkpointer = td.Checkpointer(directory, keep=1)
    step = checkpointer.restore(model=model, optimizer=opt, data=loader)
    seen = {}
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for xb, yb, ids in loader:
            seen.setdefault(epoch, []).extend(ids.tolist())
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            if step == stop_after:
                checkpointer.save(step, model=model, optimizer=opt, data=loader)
                return seen, None
            step += 1
    reference = one_process()
    return seen, max((a - b).abs().max().item() for a, b in
                     zip(model.state_dict().values(), reference.state_dict().values(), strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_stopped_on_2_ranks_resumes_on_3_as_one_process(tmp_path, backend):
    directory = str(tmp_path / "ck")
    stop_after = 5  # epoch 1, its second step
    before = run_distributed(train, 2, backend, args=(directory, stop_after), timeout=150)
    after = run_distributed(train, 3, backend, args=(directory,), timeout=150)
    for _, difference in after:
        assert difference < 1e-6
    for epoch in range(EPOCHS):
        ids = [i for seen, _ in before + after for i in seen.get(epoch, [])]
        assert sorted(ids) == list(range(N)), f"epoch {epoch}: each sample once"
    assert 1 in before[0][0] and 1 in after[0][0]  # stopped mid-epoch 1


def check_plain_loader(directory):
    model = mlp()
    loader = DataLoader(dataset(), batch_size=5)
    checkpointer = td.Checkpointer(directory, keep=1)
    # The warning is said once per name and place in a process, and this world's ranks may have
    # saved a plain loader as `data` for an earlier test: a name of this test's own keeps it first.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer.save(0, model=model, plain_loader_once=loader)
        checkpointer.save(1, model=model, plain_loader_once=loader)
        step = checkpointer.restore(model=model, plain_loader_once=loader)
    return step, [str(w.message) for w in caught]


def test_a_loader_without_state_is_warned_once_and_left_out(tmp_path):
    for step, messages in run_distributed(check_plain_loader, 2, args=(str(tmp_path / "ck"),)):
        assert step == 2
        assert len(messages) == 1 and "keeps no data position" in messages[0]
        assert "epoch's start" in messages[0]
