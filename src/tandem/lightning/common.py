"""What the Trainer's and Fabric's tandem strategies share: collectives through tandem, the
check of `devices`/`num_nodes` against the launcher, and the check that nobody replaced the
world the strategy joined.

Lightning's own DDP strategies reduce through torch.distributed; these go through tandem's
collectives instead, so every one of them is argument-checked and watched on every backend
(MPI included), and a rank that diverged is named instead of waited for.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import tandem as td
from tandem import runtime
from tandem.lightning.environment import TandemEnvironment

# Lightning passes reduce ops as strings ("mean", "avg", "sum"...) or torch's ReduceOp.
_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
        "product": "product", "prod": "product"}


def op_name(reduce_op: Any) -> str:
    """Lightning's `reduce_op` as one of tandem's op names; a ValueError naming it otherwise."""
    if reduce_op is None:
        return "mean"
    name = reduce_op if isinstance(reduce_op, str) else str(getattr(reduce_op, "name", reduce_op))
    name = name.lower().rsplit(".", 1)[-1]
    if name not in _OPS:
        raise ValueError(f"strategy 'tandem' cannot reduce with op {reduce_op!r}; use one of "
                         f"{sorted(_OPS)}")
    return _OPS[name]


def all_reduce(tensor: Any, group: Any, reduce_op: Any) -> Any:
    """Lightning's `reduce`: tensors are reduced over the group, anything else returned as is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    op = op_name(reduce_op)
    if op == "mean" and not tensor.is_floating_point():
        tensor = tensor.float()  # an integer mean would round down (tandem's integer rule)
    return td.allreduce(tensor, op=op, inplace=False, group=tandem_group(group, "reduce"))


def all_gather(tensor: torch.Tensor, group: Any, sync_grads: bool) -> torch.Tensor:
    """Lightning's `all_gather`: a new first dimension of size world, in rank order."""
    tgroup = tandem_group(group, "all_gather")
    one = tensor.unsqueeze(0).contiguous()
    if sync_grads:
        return td.functional.all_gather(one, group=tgroup)
    return td.allgather(one, group=tgroup)


def broadcast(obj: Any, src: int) -> Any:
    return td.broadcast_object(obj, root=src)


def barrier() -> None:
    if td.is_initialized():
        td.barrier()


def save(checkpoint: dict[str, Any], path: Any) -> None:
    """Every rank calls it; rank 0 writes atomically into a directory it makes, as Lightning's
    own CheckpointIO does (ModelCheckpoint's `checkpoints/` does not exist before the first)."""
    if td.rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    td.save(checkpoint, path)  # rank 0's failure is raised on every rank


def own_checkpoints(checkpoint_io: Any) -> bool:
    """True when tandem writes the checkpoints: no CheckpointIO plugin of the user's.

    Lightning's Strategy makes its default TorchCheckpointIO lazily, the first time anything
    asks for it (rank 0's remove_checkpoint does, the others' never): its presence says nothing,
    its type does.
    """
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    return checkpoint_io is None or type(checkpoint_io) is TorchCheckpointIO


def tandem_group(group: Any, name: str) -> td.Group | None:
    """The tandem group Lightning's `group=` means: None and torch's default group (Fabric
    passes `group.WORLD`) are every rank. Another torch group describes no tandem group: an
    error, rather than a reduction over the wrong ranks."""
    if group is None or isinstance(group, td.Group):
        return group
    dist = torch.distributed
    if dist.is_initialized() and group is dist.group.WORLD:
        return None
    raise ValueError(f"strategy 'tandem': {name}(group={group!r}) is not a tandem group; pass "
                     "group=None (all ranks) or a group made by td.new_group(ranks)")


def root_device(devices: list[torch.device] | None, environment: TandemEnvironment) -> torch.device:
    """This rank's device: cuda:<local rank> with CUDA devices, else the CPU."""
    if devices and devices[0].type == "cuda":
        return torch.device("cuda", environment.local_rank())
    return devices[0] if devices else torch.device("cpu")


def check_layout(devices: list[torch.device] | None, num_nodes: int,
                 environment: TandemEnvironment, accelerator: str) -> None:
    """Refuse `devices`/`num_nodes` that disagree with the job the launcher started.

    `devices` is the number of ranks per node, as in Lightning. What Lightning makes of
    `devices="auto"` (1 on the CPU, every GPU with CUDA) means "the launcher's layout".
    """
    job = environment.job
    count = len(devices) if devices else 1
    auto = count == 1 if accelerator == "cpu" else count == torch.cuda.device_count()
    if auto and num_nodes == 1:
        return
    if count * num_nodes == job.size and count == job.local_size:
        return
    nodes = -(-job.size // max(job.local_size, 1))
    asked = "'auto'" if auto else str(count)
    per_node = job.local_size if auto else count
    wrong = [f"{num_nodes} node(s), the job has {nodes}"] if num_nodes != nodes else []
    if not auto and count != job.local_size:
        wrong.append(f"{count} rank(s) per node, the job has {job.local_size}")
    start = (f"`tandem run -np {per_node}`" if num_nodes == 1 else
             f"`tandem run --nnodes {num_nodes} -np {per_node}` on each node")
    raise ValueError(
        f"strategy 'tandem': Trainer/Fabric(devices={asked}, num_nodes={num_nodes}) does not "
        f"match the job the launcher ({job.source}) started, {job.size} rank(s) on {nodes} "
        f"node(s), {job.local_size} per node: it asks for {'; '.join(wrong)}. Pass "
        f"devices='auto', num_nodes={nodes} (or devices={job.local_size}), or start the job "
        f"as {start}.")


def join(environment: TandemEnvironment) -> runtime.RuntimeState:
    """td.init() (idempotent), checked against what Lightning was told; returns the state."""
    world = td.init()
    job = environment.job
    if (world.rank, world.size) != (job.rank, job.size):
        raise RuntimeError(
            f"strategy 'tandem': tandem's world is rank {world.rank} of {world.size}, but the "
            f"launcher ({job.source}) says rank {job.rank} of {job.size}; call td.init() with "
            "no rank/world_size arguments (or not at all: the strategy calls it)")
    return runtime.state()


def check_same_world(joined: runtime.RuntimeState | None, where: str) -> None:
    """Raise when the world the strategy joined was shut down or replaced since (`where` did)."""
    if joined is None:
        return
    now = runtime.state() if runtime.is_initialized() else None
    if now is joined and torch.distributed.is_initialized():
        return
    if now is None:
        change = "tandem was shut down (td.shutdown())"
    elif now is not joined:
        change = (f"tandem was shut down and joined again (now rank {now.world.rank} of "
                  f"{now.world.size} on {now.world.backend})")
    else:
        change = "torch.distributed's default group was destroyed"
    raise RuntimeError(
        f"strategy 'tandem': {change} inside {where}. The strategy joined the job (rank "
        f"{joined.world.rank} of {joined.world.size} on {joined.world.backend}) before it "
        f"called {where}, and trains on that world; build the model in {where}, but leave "
        "td.init()/td.shutdown()/init_process_group()/destroy_process_group() to the strategy.")


def shard_model(model: torch.nn.Module, classes: tuple[type, ...],
                options: dict[str, Any]) -> torch.nn.Module:
    """`td.fully_shard` every module of `classes` inside `model`, the innermost first (as
    fully_shard asks), then `model` itself as the root; returns `model`."""
    inner = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    for unit in reversed(inner):
        td.fully_shard(unit, **options)
    return td.fully_shard(model, **options)
