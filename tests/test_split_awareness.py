"""Every tandem call that touches a split model asks how it is split: never a silent wrong model.

The bugs these guard against (2 ranks, SGD): `broadcast_parameters` after `fully_shard`
overwrote every rank's shard with rank 0's; after `parallelize` it copied rank 0's slices
everywhere; a world-wide `DistributedOptimizer` on a tensor-parallel or `Branches` model
averaged different slices; an optimizer built before `fully_shard` stepped the replaced
parameters and trained nothing while the loss printed as usual.
"""

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model, optimizer, steps: int, rows: slice) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def broadcast_after_fully_shard() -> float:
    model = _net()
    td.fully_shard(model[0])
    td.fully_shard(model)
    td.broadcast_parameters(model)  # step 3 of the five-line change: must leave the shards alone
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optimizer, 3, slice(4 * td.rank(), 4 * td.rank() + 4))
    reference = _net()
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), 3, slice(0, 8))
    got = td.fsdp.full_state_dict(model)
    return max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_broadcast_parameters_after_fully_shard_keeps_every_shard(backend):
    assert max(run_distributed(broadcast_after_fully_shard, world_size=2, backend=backend)) < 1e-6


def refusals() -> dict[str, str]:
    errors = {}

    def attempt(name, call):
        try:
            call()
            errors[name] = "accepted"
        except ValueError as error:
            errors[name] = str(error)

    model = td.parallelize(_net(), {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
    attempt("broadcast", lambda: td.broadcast_parameters(model))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt("optimizer", lambda: td.DistributedOptimizer(sgd, named_parameters=model.named_parameters()))
    branches = td.tensor.Branches([nn.Linear(4, 3), nn.Linear(4, 3)], join="cat")
    attempt("branches", lambda: td.DistributedOptimizer(
        torch.optim.SGD(branches.parameters(), lr=0.1), named_parameters=branches.named_parameters()))
    plain = _net()
    early = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before fully_shard
    td.fully_shard(plain)
    plain(torch.ones(2, 4)).sum().backward()
    attempt("stale optimizer", early.step)
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_calls_that_would_mix_slices_or_step_replaced_parameters_are_refused(backend):
    for errors in run_distributed(refusals, world_size=2, backend=backend):
        assert "would copy rank 0's tensor-parallel slice of '0.weight'" in errors["broadcast"], errors
        assert "group=mesh.dp_group" in errors["broadcast"], errors
        assert "would average different tensor-parallel slices (or branches)" in errors["optimizer"]
        assert "group=mesh.dp_group" in errors["optimizer"], errors
        assert "slices (or branches) of 'mine.0.weight'" in errors["branches"], errors
        assert "SGD holds 4 of 4 parameters that td.fully_shard replaced" in errors["stale optimizer"]
        assert "Build the optimizer after fully_shard" in errors["stale optimizer"], errors


def _clipped_reference(steps: int, max_norm: float) -> dict[str, torch.Tensor]:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return model.state_dict()


def clipping(layout: str, clip: str) -> float:
    """10 steps with a small max_norm (every step clips) in `layout`, clipped by `clip`."""
    model = _net()
    rows = slice(0, 8)
    if layout == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model)
        rows = slice(4 * td.rank(), 4 * td.rank() + 4)
    elif layout == "tp":
        td.parallelize(model, {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
    elif layout == "pp":
        model = td.Pipeline(model, chunks=2, balance=[2, 1])
    elif layout == "zero":  # each rank's own .grad until step() averages it
        rows = slice(4 * td.rank(), 4 * td.rank() + 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if layout == "zero":
        optimizer = td.ZeroOptimizer(optimizer)
    clip_fn = torch.nn.utils.clip_grad_norm_ if clip == "torch" else td.clip_grad_norm_
    for step in range(10):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        if layout == "pp":
            model.train_step(x, y, nn.functional.mse_loss)
        else:
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if clip == "torch":
            clip_fn(model.parameters(), 0.05)
        else:
            clip_fn(model, 0.05)
        optimizer.step()
    got = td.fsdp.full_state_dict(model)  # a pipeline's: every stage's entries, gathered
    return max((got[k] - v).abs().max().item() for k, v in _clipped_reference(10, 0.05).items())


@pytest.mark.parametrize("layout,clip,backend", [
    ("fully_shard", "torch", "gloo"), ("fully_shard", "torch", "mpi"), ("fully_shard", "td", "gloo"),
    ("tp", "torch", "gloo"), ("tp", "td", "mpi"), ("pp", "td", "gloo"), ("pp", "td", "mpi"),
    ("zero", "td", "gloo"), ("zero", "td", "mpi")])
def test_clipping_a_split_model_uses_the_global_norm(layout, clip, backend):
    """PyTorch's FSDP2 example keeps `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`:
    ported to td.fully_shard it must clip by the global norm, as FSDP2's DTensors do."""
    assert max(run_distributed(clipping, world_size=2, backend=backend, args=(layout, clip))) < 1e-6


def torch_clip_of_a_pipeline_stage() -> str:
    pipe = td.Pipeline(_net(), chunks=2, balance=[2, 1])
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe.train_step(x, y, nn.functional.mse_loss)
    try:
        torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1.0)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_torch_clip_of_a_pipeline_stage_is_refused_with_the_fix():
    for message in run_distributed(torch_clip_of_a_pipeline_stage, world_size=2):
        assert "clip a td.Pipeline with td.clip_grad_norm_(pipe, max_norm)" in message, message


def parallelize_unseeded() -> float:
    """Each rank builds its model from a seed of its own: parallelize slices rank 0's."""
    torch.manual_seed(td.rank())
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    td.parallelize(model, {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
    got = model.state_dict()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).state_dict()
    return max((got[k] - v).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_parallelize_slices_one_model_whatever_seed_each_rank_used(backend):
    """Measured before: 0.62 from rank 0's model, a mix of the two ranks' layers, silently (and
    broadcast_parameters, the five-line change's fix, is refused once the model is split)."""
    assert max(run_distributed(parallelize_unseeded, world_size=2, backend=backend)) == 0.0


def replicas_of_split_models() -> str:
    """check_replicas leaves a split model's pieces out, and still finds a replica that differs."""
    sharded = _net()
    td.fully_shard(sharded[0])
    td.fully_shard(sharded)
    td.check_replicas(sharded)  # every tensor a shard: nothing to compare, nothing to report
    split = _net()
    td.parallelize(split, {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
    td.check_replicas(split)  # the slices differ by design; the row-parallel bias is whole
    if td.rank() == 1:
        with torch.no_grad():
            split[2].bias.add_(1.0)
    try:
        td.check_replicas(split)
    except td.errors.ReplicaMismatchError as error:
        return str(error)
    return "no difference found"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_check_replicas_knows_how_a_model_is_split(backend):
    """It reported a correct tensor-parallel model as diverged (its slices), and named
    fully_shard's internal shards, both with the advice to broadcast_parameters (refused there)."""
    for message in run_distributed(replicas_of_split_models, world_size=2, backend=backend):
        assert "2.bias" in message and "0.weight" not in message, message


def torch_clip_under_zero() -> str:
    model = _net()
    optimizer = td.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2)).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except ValueError as error:
        optimizer.step()  # still usable: nothing was clipped
        return str(error)
    return "accepted"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_torch_clip_under_zero_is_refused_with_the_fix(backend):
    """ZeroOptimizer averages the gradients in step(): torch's clip would clip each rank by its
    own gradient's norm (measured: 2.7e-3 from one process after 4 steps), silently."""
    for message in run_distributed(torch_clip_under_zero, world_size=2, backend=backend):
        assert "clip with opt.clip_grad_norm_(max_norm)" in message, message


def localsgd_checkpoint(directory: str) -> str:
    model = _net()
    optimizer = td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), period=2)
    _train(model, optimizer, 1, slice(4 * td.rank(), 4 * td.rank() + 4))
    try:
        td.Checkpointer(directory).save(0, model=model, optimizer=optimizer)
    except td.CheckpointError as error:
        return str(error)
    return "saved"


def test_a_localsgd_run_is_not_checkpointed_as_one_replica(tmp_path):
    """Between averagings each rank's parameters and momentum are its own: one copy of each
    would restore another run (measured before: parameter sums -1.95 / -1.57 on the two ranks
    after 3 + 3 steps, against -1.66 on both uninterrupted)."""
    for message in run_distributed(localsgd_checkpoint, world_size=2, args=(str(tmp_path),)):
        assert "a td.LocalSGD run cannot be checkpointed with td.Checkpointer" in message, message
        assert "f'ckpt-rank{td.rank()}.pt'" in message, message
    assert not any(tmp_path.iterdir())


def torch_state_dict_idioms(layout: str) -> float:
    """`model.state_dict()` of a split model is the one-process state dict (every rank calls
    it), and `model.load_state_dict(one_process_dict)` puts each rank's piece in place."""
    model = _net()
    if layout == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model)
    elif layout == "pp":  # a pipeline's state_dict() is every stage's, never one stage's
        model = td.Pipeline(model, chunks=2, balance=[2, 1])
    else:
        td.parallelize(model, {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
    reference = _net().state_dict()
    got = model.state_dict()
    assert list(got) == list(reference) or set(got) == set(reference), sorted(got)
    worst = max((got[k] - v).abs().max().item() for k, v in reference.items())
    if layout == "pp":
        return worst
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).state_dict()
    model.load_state_dict(other)
    again = model.state_dict()
    return max(worst, max((again[k] - v).abs().max().item() for k, v in other.items()))


@pytest.mark.parametrize("layout,backend", [("fully_shard", "gloo"), ("fully_shard", "mpi"),
                                            ("tp", "gloo"), ("tp", "mpi"), ("pp", "gloo"),
                                            ("pp", "mpi")])
def test_model_state_dict_of_a_split_model_is_the_one_process_state_dict(layout, backend):
    assert max(run_distributed(torch_state_dict_idioms, world_size=2, backend=backend,
                               args=(layout,))) == 0.0


def accumulation(layout: str) -> float:
    """4 micro-batches per step through td.no_sync(model) equal one process on the full batch."""
    model = _net()
    if layout == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)
        mine = slice(8 * td.rank(), 8 * td.rank() + 8)
        optimizer.zero_grad()
        for micro in range(4):
            rows = slice(mine.start + 2 * micro, mine.start + 2 * micro + 2)
            if micro < 3:
                with td.no_sync(model):
                    (nn.functional.mse_loss(model(x[rows]), y[rows]) / 4).backward()
            else:
                (nn.functional.mse_loss(model(x[rows]), y[rows]) / 4).backward()
        optimizer.step()
    reference = _net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
    got = td.fsdp.full_state_dict(model)
    return max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("layout,backend", [("fully_shard", "gloo"), ("dp", "mpi")])
def test_no_sync_accumulates_for_every_wrapper(layout, backend):
    assert max(run_distributed(accumulation, world_size=2, backend=backend, args=(layout,))) < 1e-6


def test_no_sync_on_a_model_nothing_reduces_says_so():
    with pytest.raises(ValueError, match="nothing reduces this model's gradients"):
        with td.no_sync(_net()):
            pass


def steps_recorded() -> dict[str, int]:
    """Every wrapper's optimizer steps reach the step records (`tandem scale`,
    MetricLogger(timing=True)), each exactly once."""
    from tandem.diagnostics import steps

    counts = {}
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    steps.step_done()  # the first step of a process only starts the clock
    for kind in ("fully_shard", "zero", "distributed", "tp"):
        model = _net()
        if kind == "fully_shard":
            td.fully_shard(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        elif kind == "zero":
            optimizer = td.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        elif kind == "distributed":
            optimizer = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                named_parameters=model.named_parameters())
        else:
            td.parallelize(model, {"0": "colwise", "2": "rowwise"}, group=td.mesh(dp=1, tp=2).tp_group)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = steps.recorded()
        for _ in range(4):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        counts[kind] = steps.recorded() - before
    return counts


def test_every_wrapper_records_its_steps_once():
    for counts in run_distributed(steps_recorded, world_size=2):
        assert counts == {"fully_shard": 4, "zero": 4, "distributed": 4, "tp": 4}, counts


def test_join_over_a_fully_sharded_model_is_refused_with_the_fix():
    td.init(backend="gloo")
    try:
        model = _net()
        td.fully_shard(model)
        with pytest.raises(TypeError, match=r"td.join cannot stand in for a rank out of data in a "
                                            r"fully_shard model(.|\n)*drop_last=True"):
            td.join(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        td.shutdown()


def evaluation_between_forward_and_backward() -> float:
    """A no_grad evaluation pass between a training forward and its backward (a validation
    check before loss.backward()) leaves the backward, and so training, as in one process."""
    model = _net()
    td.fully_shard(model[0])
    td.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = _net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[4 * td.rank():4 * td.rank() + 4]),
                                      y[4 * td.rank():4 * td.rank() + 4])
        with torch.no_grad():
            model(x)  # evaluation in between
        loss.backward()
        optimizer.step()
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
    got = td.fsdp.full_state_dict(model)
    return max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_an_evaluation_between_forward_and_backward_of_a_sharded_model(backend):
    assert max(run_distributed(evaluation_between_forward_and_backward, world_size=2,
                               backend=backend)) < 1e-6


def fsdp2_methods() -> float:
    """A ported FSDP2 script's own calls: model.set_requires_gradient_sync for accumulation,
    unshard()/reshard() to read whole parameters, the prefetch setters."""
    model = _net()
    td.fully_shard(model[0])
    td.fully_shard(model)
    model.set_modules_to_forward_prefetch([model[0]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
    mine = slice(4 * td.rank(), 4 * td.rank() + 4)
    optimizer.zero_grad()
    model.set_requires_gradient_sync(False)
    (nn.functional.mse_loss(model(x[mine][:2]), y[mine][:2]) / 2).backward()
    model.set_requires_gradient_sync(True)
    (nn.functional.mse_loss(model(x[mine][2:]), y[mine][2:]) / 2).backward()
    optimizer.step()
    model[0].unshard()
    whole = model[0].weight.detach().clone()  # the whole (4 -> 8) weight, gathered
    model[0].reshard()
    reference = _net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    plain.step()
    got = td.fsdp.full_state_dict(model)
    worst = max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return max(worst, (whole - reference[0].weight).abs().max().item())


def test_fsdp2_module_methods_work_on_td_fully_shard():
    assert max(run_distributed(fsdp2_methods, world_size=2)) < 1e-6
