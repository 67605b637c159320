"""td.ZeroOptimizer shards an optimizer that is not element-wise by whole parameters (issue 40).

Adafactor, Muon and a hand-written LAMB look at a whole tensor, one tensor at a time: each
parameter is owned whole by one rank (balanced by size), which steps it with the averaged
gradient and sends the new values. Checked at 3 ranks (parameters of unequal sizes, two param
groups with their own learning rates) against one process on the whole batch; its full state
dict is the one-process optimizer's; a checkpoint saved at 2 ranks goes on at 3; an optimizer
that couples its parameters (LBFGS) is refused with the reason. Uneven batches (100 samples
on 3 ranks, `td.partition_dataset(pad=False)`) are weighted by their samples.
"""

import pytest
import torch
from test_optimizer_matrix import Lamb

import tandem as td
from tandem.testing import run_distributed

BATCH = 12
STEPS = 3
optim = torch.optim
MAKERS = {  # over two param groups: the first layer at half the learning rate
    "Adafactor": lambda groups: optim.Adafactor(groups, lr=0.01),
    "Muon": lambda groups: optim.Muon(groups, lr=0.02),
    "Lamb": lambda groups: Lamb(groups, lr=0.01),
    "Adam (flat)": lambda groups: optim.Adam(groups, lr=0.01),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # matrices only (Muon), of three sizes: the ranks' shares differ
    return torch.nn.Sequential(torch.nn.Linear(6, 10, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(10, 7, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3, bias=False))


def _make(name: str, model: torch.nn.Module, groups: bool = True):
    if not groups:
        return MAKERS[name](model.parameters())
    params = list(model.parameters())
    optimizer = MAKERS[name]([{"params": params[:1]}, {"params": params[1:]}])
    optimizer.param_groups[0]["lr"] = optimizer.param_groups[1]["lr"] / 2
    return optimizer


def _batch(step: int):
    generator = torch.Generator().manual_seed(7 + step)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def _train(model, optimizer, rows, first: int, last: int) -> None:
    for step in range(first, last):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def _rows():
    share = BATCH // td.size()
    return slice(td.rank() * share, (td.rank() + 1) * share)


def _difference(a: dict, b: dict) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())


def _state_difference(got: dict, expected: dict) -> float:
    assert got["state"].keys() == expected["state"].keys()
    worst = 0.0
    for i, entry in expected["state"].items():
        assert got["state"][i].keys() == entry.keys(), (i, got["state"][i].keys(), entry.keys())
        for k, v in entry.items():
            if torch.is_tensor(v):
                worst = max(worst, (got["state"][i][k].double() - v.double()).abs().max().item())
    return worst


def check_whole_parameters(name: str):
    td.init()
    reference = _model()
    plain = _make(name, reference)
    _train(reference, plain, slice(None), 0, STEPS)
    model = _model()
    optimizer = td.ZeroOptimizer(_make(name, model))
    _train(model, optimizer, _rows(), 0, STEPS)
    full = optimizer.state_dict()  # collective: every rank gets the one-process state dict
    held = sum(1 for g in optimizer.optimizer.param_groups for _ in g["params"])
    return (optimizer.sharding, _difference(model.state_dict(), reference.state_dict()),
            _state_difference(full, plain.state_dict()), held,
            [g["lr"] for g in full["param_groups"]])


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_adafactor_muon_and_lamb_are_sharded_by_whole_parameters_and_equal_one_process(backend):
    for name in MAKERS:
        results = run_distributed(check_whole_parameters, 3, backend, args=(name,))
        for sharding, difference, state, _, lrs in results:
            assert sharding == ("flat" if name == "Adam (flat)" else "whole"), name
            assert difference < 1e-6, f"{name}: {difference} from one process"
            assert state < 1e-6, f"{name}: optimizer state {state} from one process"
            assert lrs[0] == lrs[1] / 2
        if name != "Adam (flat)":  # three matrices, each stepped by exactly one rank
            assert sorted(held for *_, held, _ in results) == [1, 1, 1], (name, results)


def phase(name: str, directory: str, first: int, last: int) -> float:
    model = _model()
    optimizer = td.ZeroOptimizer(_make(name, model))
    checkpointer = td.Checkpointer(directory, keep=1)
    if first:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)  # the checkpoint, not the seed, must bring the values back
        assert checkpointer.restore(model=model, optimizer=optimizer) == first
    _train(model, optimizer, _rows(), first, last)
    checkpointer.save(last - 1, model=model, optimizer=optimizer)
    reference = _model()
    _train(reference, _make(name, reference), slice(None), 0, last)
    return _difference(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_whole_parameter_checkpoint_saved_at_2_goes_on_at_3(tmp_path, backend):
    for name in ("Muon", "Adafactor"):
        directory = str(tmp_path / name)
        assert max(run_distributed(phase, 2, backend, args=(name, directory, 0, 2))) < 1e-6
        assert max(run_distributed(phase, 3, backend, args=(name, directory, 2, 4))) < 1e-6


def check_coupling_refused():
    td.init()
    model = _model()
    try:
        td.ZeroOptimizer(torch.optim.LBFGS(model.parameters()))
    except ValueError as refusal:
        return str(refusal)
    return None


def test_an_optimizer_that_couples_its_parameters_is_refused_with_the_reason():
    message = run_distributed(check_coupling_refused, 2)[0]
    assert "LBFGS under td.ZeroOptimizer" in message
    assert "keeps a history over all parameters" in message
    assert "td.DistributedOptimizer" in message


# -- uneven batches ------------------------------------------------------------------------


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(100, 6, generator=generator)
        self.y = torch.randn(100, 3, generator=generator)

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def check_uneven(name: str, wrapper: str):
    """100 samples on 3 ranks (34/33/33, no padding), global batch 30: the last step is 4/3/3."""
    td.init()
    data = Rows()
    groups = wrapper != "fully_shard"  # its units' shards are not the layers: one group
    reference = _model()
    plain = _make(name, reference, groups)
    for start in range(0, 100, 30):
        plain.zero_grad()
        x, y = data.x[start:start + 30], data.y[start:start + 30]
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
    model = _model()
    if wrapper == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model)
        optimizer = _make(name, model, groups)
    else:
        optimizer = td.ZeroOptimizer(_make(name, model))
    loader, _ = td.partition_dataset(data, batch_size=30, pad=False, shuffle=False)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return sizes, _difference(td.fsdp.full_state_dict(model), reference.state_dict())


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("wrapper,name", [("ZeroOptimizer", "Adam (flat)"), ("ZeroOptimizer", "Muon"),
                                          ("fully_shard", "Adam (flat)")])
def test_uneven_batches_are_weighted_by_their_samples(backend, wrapper, name):
    """ZeroOptimizer (flat and whole) and fully_shard average the last, uneven step over its
    10 samples, as one process does (not 1/3 per rank: 1e-2 off before)."""
    if True:
        results = run_distributed(check_uneven, 3, backend, args=(name, wrapper))
        assert sum(sizes[-1] for sizes, _ in results) == 10  # the last step: 4 + 3 + 3
        for _, difference in results:
            assert difference < 1e-6, f"{name}: {difference} from one process"


def check_local_sgd_uneven():
    td.init()
    data = Rows()
    model = _model()
    optimizer = td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=1)
    loader, _ = td.partition_dataset(data, batch_size=30, pad=False, shuffle=False)
    stepped = 0
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            optimizer.step()
        except ValueError as refusal:
            return stepped, str(refusal)
        stepped += 1
    return stepped, None


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_local_sgd_refuses_the_uneven_step_naming_the_fix(backend):
    for rank, (stepped, message) in enumerate(run_distributed(check_local_sgd_uneven, 3, backend)):
        assert stepped == 3  # the three even steps ran; the fourth (4/3/3 samples) is refused
        assert f"rank {rank}'s batch was uneven" in message
        assert "of 30 samples" in message and "pad=True" in message
        assert "td.DistributedOptimizer" in message


def check_mixed():
    """Muon's usual recipe: Muon over the matrices, AdamW over the biases, each wrapped."""
    td.init()

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
        matrices = [p for p in model.parameters() if p.dim() == 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        return model, [optim.Muon(matrices, lr=0.02), optim.AdamW(vectors, lr=0.01)]

    reference, plain = build()
    model, inner = build()
    wrapped = [td.ZeroOptimizer(o) for o in inner]
    for step in range(STEPS):
        x, y = _batch(step)
        for m, optimizers, rows in ((reference, plain, slice(None)), (model, wrapped, _rows())):
            for o in optimizers:
                o.zero_grad()
            torch.nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
            for o in optimizers:
                o.step()
    return [o.sharding for o in wrapped], _difference(model.state_dict(), reference.state_dict())


def test_whole_and_flat_sharding_mix_in_one_group():
    for shardings, difference in run_distributed(check_mixed, 3):
        assert shardings == ["whole", "flat"]
        assert difference < 1e-6
