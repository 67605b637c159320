"""torch.distributed calls checked on a world whose default group is tandem's (each rank runs
`check_every_call()`): exact values for every collective DDP, FSDP2, DTensor and pipelining use.

Shared by tests/test_torch_backend.py (in the harness's MPI worlds, where `td.init()` made the
default group) and tests/scripts/torch_calls.py (a job of `init_process_group("tandem")`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


def _values(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 10 * rank + 1).to(dtype)


def check_reductions(rank: int, size: int) -> None:
    everyone = torch.stack([_values(r, dtype=torch.float64) for r in range(size)])
    expected = {ReduceOp.SUM: everyone.sum(0), ReduceOp.PRODUCT: everyone.prod(0),
                ReduceOp.MIN: everyone.min(0).values, ReduceOp.MAX: everyone.max(0).values,
                ReduceOp.AVG: everyone.mean(0)}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for op, want in expected.items():
            if dtype is torch.bfloat16 and op == ReduceOp.PRODUCT:
                continue  # not exact in 8 bits
            t = _values(rank, dtype=dtype)
            dist.all_reduce(t, op=op)
            assert torch.allclose(t.double(), want.to(dtype).double(), rtol=1e-6), (dtype, op, t)
    bits = torch.tensor([1 << rank, 3, rank], dtype=torch.int64)
    for op, fold in ((ReduceOp.BAND, lambda a, b: a & b), (ReduceOp.BOR, lambda a, b: a | b),
                     (ReduceOp.BXOR, lambda a, b: a ^ b)):
        t = bits.clone()
        dist.all_reduce(t, op=op)
        want = torch.tensor([1 << 0, 3, 0])
        for r in range(1, size):
            want = fold(want, torch.tensor([1 << r, 3, r]))
        assert torch.equal(t, want), (op, t, want)
    # async, then the future, on a non-contiguous view
    base = torch.stack([_values(rank), _values(rank)], dim=1)
    view = base[:, 0]
    work = dist.all_reduce(view, async_op=True)
    assert work.get_future().wait() is not None
    work.wait()
    assert torch.equal(base[:, 0], everyone.sum(0).float()) and torch.equal(base[:, 1], _values(rank))
    # reduce to the last rank
    t = _values(rank)
    dist.reduce(t, dst=size - 1, op=ReduceOp.MAX)
    if rank == size - 1:
        assert torch.equal(t, everyone.max(0).values.float())


def check_movement(rank: int, size: int) -> None:
    t = _values(rank)
    dist.broadcast(t, src=size - 1)
    assert torch.equal(t, _values(size - 1))
    parts = [torch.empty(6) for _ in range(size)]
    dist.all_gather(parts, _values(rank))
    assert all(torch.equal(p, _values(r)) for r, p in enumerate(parts))
    out = torch.empty(size, 6)
    dist.all_gather_into_tensor(out, _values(rank))
    assert torch.equal(out, torch.stack([_values(r) for r in range(size)]))
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(size)]
    # reduce-scatter: rank r gets the sum of everyone's chunk r
    chunks = [torch.full((3,), float(rank + 10 * j)) for j in range(size)]
    out = torch.empty(3)
    dist.reduce_scatter(out, chunks)
    assert torch.equal(out, torch.full((3,), float(sum(range(size)) + 10 * rank * size)))
    flat = torch.cat(chunks)
    dist.reduce_scatter_tensor(out, flat, op=ReduceOp.AVG)
    assert torch.allclose(out, torch.full((3,), sum(range(size)) / size + 10 * rank))
    # gather to 0, scatter from the last rank
    gathered = [torch.empty(6) for _ in range(size)] if rank == 0 else None
    dist.gather(_values(rank), gathered, dst=0)
    if rank == 0:
        assert all(torch.equal(g, _values(r)) for r, g in enumerate(gathered))
    scattered = torch.empty(6)
    dist.scatter(scattered, [_values(100 + r) for r in range(size)] if rank == size - 1 else None,
                 src=size - 1)
    assert torch.equal(scattered, _values(100 + rank))
    objects = [rank * 7] if rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [0]


def check_all_to_all(rank: int, size: int) -> None:
    # equal splits: rank r sends row j (value 100r + j) to rank j
    input = torch.tensor([[100.0 * rank + j] for j in range(size)])
    output = torch.empty(size, 1)
    dist.all_to_all_single(output, input)
    assert torch.equal(output, torch.tensor([[100.0 * r + rank] for r in range(size)]))
    # uneven: rank r sends j+1 rows to rank j
    input = torch.cat([torch.full((j + 1, 2), float(rank)) for j in range(size)])
    output = torch.empty(size * (rank + 1), 2)
    dist.all_to_all_single(output, input, [rank + 1] * size, [j + 1 for j in range(size)])
    assert torch.equal(output, torch.cat([torch.full((rank + 1, 2), float(r)) for r in range(size)]))
    outputs = [torch.empty(2) for _ in range(size)]
    dist.all_to_all(outputs, [torch.full((2,), float(10 * rank + j)) for j in range(size)])
    assert all(torch.equal(o, torch.full((2,), float(10 * r + rank))) for r, o in enumerate(outputs))


def check_point_to_point(rank: int, size: int) -> None:
    after, before = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(4)
    if rank % 2 == 0:
        dist.send(_values(rank, 4), dst=after)
        dist.recv(got, src=before)
    else:
        dist.recv(got, src=before)
        dist.send(_values(rank, 4), dst=after)
    assert torch.equal(got, _values(before, 4))
    ops = [dist.P2POp(dist.isend, _values(rank, 4) * 2, after),
           dist.P2POp(dist.irecv, got, before)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(got, _values(before, 4) * 2)
    dist.barrier()


def check_groups(rank: int, size: int) -> None:
    ends = [0, size - 1]
    group = dist.new_group(ends)
    t = torch.ones(2) * (rank + 1)
    if rank in ends:
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((2,), float(1 + size)))
        assert dist.get_rank(group) == ends.index(rank) and dist.get_world_size(group) == 2
        dist.broadcast(t, src=size - 1, group=group)  # a global rank, as in torch
    else:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
    mine, _ = dist.new_subgroups(group_size=1)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=mine)
    assert t.item() == rank


def check_every_call() -> str:
    rank, size = dist.get_rank(), dist.get_world_size()
    for check in (check_reductions, check_movement, check_all_to_all, check_point_to_point,
                  check_groups):
        check(rank, size)
    return dist.get_backend()


# --- torch's parallel wrappers on tandem's group: equal to one process ----------------------
STEPS = 10
BATCH = 12  # divides among 2 and 3 ranks


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)


def _train(model, inputs, targets, steps: int = STEPS) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def _difference(full: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    expected = reference.state_dict()
    assert full.keys() == expected.keys(), (full.keys(), expected.keys())
    return max((full[k] - expected[k]).abs().max().item() for k in expected)


def _reference() -> torch.nn.Module:
    model = _model()
    _train(model, *_data())
    return model


def train_ddp() -> float:
    """torch's DDP, each rank on its part of the batch, against one process on all of it."""
    from torch.nn.parallel import DistributedDataParallel

    rank, size = dist.get_rank(), dist.get_world_size()
    model = _model()
    inputs, targets = _data()
    part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    _train(DistributedDataParallel(model), inputs[part], targets[part])
    return _difference(model.state_dict(), _reference())


def train_fsdp2() -> float:
    """FSDP2's fully_shard (each layer, then the model), each rank on its part of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inputs, targets = _data()
    part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    _train(model, inputs[part], targets[part])
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return _difference(full, _reference())


def train_dtensor() -> float:
    """DTensor tensor parallelism (`parallelize_module`: column- then row-wise), the whole
    batch on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _train(model, *_data())
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}
    return _difference(full, _reference())


def train_pipeline() -> float:
    """torch.distributed.pipelining (GPipe, 4 micro-batches): rank r holds layer r of a chain of
    `size` Linear layers; the gradients of each stage against one process's."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(size)]
    inputs = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(2))
    reference = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(size)])
    reference.load_state_dict(torch.nn.Sequential(*layers).state_dict())
    torch.nn.functional.mse_loss(reference(inputs), targets).backward()

    stage = PipelineStage(layers[rank], stage_index=rank, num_stages=size,
                          device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    if rank == 0:
        schedule.step(inputs)
    elif rank == size - 1:
        schedule.step(target=targets)
    else:
        schedule.step()
    # the schedule scales the summed micro-batch gradients by 1/4 (scale_grads): the mean
    return (layers[rank].weight.grad - reference[rank].weight.grad).abs().max().item()
