"""Fully sharded data parallelism (ZeRO-3), FSDP2-style: `td.fully_shard(module)` per block.

    for block in model.blocks:
        td.fully_shard(block)                 # each block: one unit, gathered just in time
    td.fully_shard(model)                     # the root: whatever the blocks left
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # steps this rank's shards only
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward()
        td.clip_grad_norm_(model, 1.0)        # the global norm: a reduction over the shards
        opt.step()

Each rank keeps 1/N of every unit's parameters, gradients and optimizer state
(`model.parameters()` are the shards, fp32 masters). A unit is gathered before its forward
(the next one prefetched), freed after it, gathered again for backward, and its gradient is
reduce-scattered (mean) into the shard's `.grad` during backward. Apply it to the inner
blocks first and the root last, on every rank, with the same model.

Options: `mp_policy=td.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=...)`
computes in bf16 into fp32 master shards, FSDP2's fields and defaults (`policies.py`; the older
`param_dtype=torch.bfloat16` alone reduces in fp32 and casts no inputs);
`offload_policy=td.fsdp.CPUOffloadPolicy()` keeps shards, gradients and optimizer state in host
memory; `mesh=td.mesh(dp=R, shard=S)` shards over S ranks and all-reduces the shards'
gradients over the R replicas (HSDP); a model built on the meta device gets its values from
`td.fsdp.materialize(model, seed=...)` (`materialize.py`). `reshard_after_forward=False` keeps a
unit gathered from forward to backward (the root always is, as in FSDP2).
`td.fsdp.set_requires_gradient_sync(model, False)` accumulates gradients locally (unsharded) over
micro-batches; the next synced backward reduces them all.
GradScaler works unchanged: a rank that saw inf makes every rank skip the step.
`td.clip_grad_norm_(model, max_norm)` clips by the global norm; torch's
`nn.utils.clip_grad_norm_` would see this rank's shards only. `td.fsdp.full_state_dict(model)` and
`td.fsdp.load_full_state_dict(model, state)` give and take the ordinary (unsharded) state dict;
sharded checkpoints that load on any world size are `td.checkpoint.save_sharded`/`td.checkpoint.load_sharded`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.collectives import user as collectives
from tandem.comm.groups import Group, Mesh, group_ranks
from tandem.parallel import model_check
from tandem.parallel.fully_shard import dtensor as dtensor_params
from tandem.parallel.fully_shard import fsdp2_methods, muon, policies
from tandem.parallel.fully_shard.pieces import UnitPieces
from tandem.parallel.fully_shard.unit import Unit, attach, taken_by, unit_of
from tandem.parallel.layout import protocol as layout
from tandem.parallel.layout import splits, state_hooks
from tandem.parallel.layout.owner import owner_of


def fully_shard(module: nn.Module, *, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, group: Group | None = None,
                mesh: Mesh | None = None, mp_policy: Any = None,
                offload_policy: Any = None, offload: str | None = None,
                dtensor: bool = False) -> nn.Module:
    """Shard `module`'s parameters (those no inner unit owns) across `group`; returns `module`.

    Collective: every rank of the group calls it, in the same order, on the same model, with
    the same options: the unit's tensors, policies, reshard_after_forward and group/mesh are
    agreed once, here (`unit_agreement.py`); a rank that differs makes every rank raise,
    naming each rank's. An optimizer that holds none of the shards and steps nothing while
    they have gradients (another model's parameters) is refused at its first step
    (the optimizer-step hook of `parallel/layout/splits.py`).

    Args:
        module: the module to shard (its inner blocks sharded first, then the root).
        reshard_after_forward: free the gathered parameters after forward (gather again for
            backward); the root keeps them, as in FSDP2.
        param_dtype: compute in this dtype, reduce in the shards' (older spelling of mp_policy).
        group: the ranks to shard over (default: the world).
        mesh: a `td.mesh(dp=R, shard=S)`: shard over `mesh.shard_group`, all-reduce the
            gradients over `mesh.dp_group` (HSDP; `td.mesh(shard=N)` is plain sharding,
            `td.mesh(dp=N)` plain replication).
        mp_policy: `td.fsdp.MixedPrecisionPolicy` (or torch's FSDP2 one).
        offload_policy: `td.fsdp.CPUOffloadPolicy()` (or torch's FSDP2 one): shards in host memory.
        offload: `"cpu"`, the same as `offload_policy=td.fsdp.CPUOffloadPolicy()`.
        dtensor: keep the shard as FSDP2 does, a `DTensor` parameter (`Shard(0)` over a
            DeviceMesh of the world) with `DTensor` state-dict entries (`dtensor.py`);
            `tandem.fsdp.fully_shard` sets it. Not with group=, mesh= or offload.

    Returns:
        `module` itself, now a fully sharded unit (its `state_dict()` still speaks the unsharded
        model).

    Raises:
        LayoutMismatchError: the ranks sharded other tensors or passed other options (each
            rank's named).
        ValueError: `module` is already sharded, its parameters already belong to a root sharded
            first (shard inner blocks first), it holds tensor-parallel layers, both `group=` and
            `mesh=` (or `param_dtype=` and `mp_policy=`) were given, the mesh has pp or tp > 1,
            or this rank is not a member of `group`, or `dtensor=True` with group=, mesh= or
            offload; each message says the fix.
        TypeError: `module` is not an `nn.Module`, or `mesh`, `mp_policy` or `offload_policy`
            is not of its kind.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if dtensor:
        dtensor_params.refuse_unless_world(group, mesh, offload, offload_policy)
    if unit_of(module) is not None:
        raise ValueError(
            f"fully_shard: {type(module).__name__} is already fully sharded; call fully_shard "
            f"once per module (inner blocks first, then the root)")
    group, replicate = _groups(group, mesh)
    if group is not None and group.rank < 0:
        raise ValueError(f"rank {runtime.rank()} is not a member of {group!r}")
    backend = runtime.get_backend().name if runtime.is_initialized() else "local"
    policy = policies.mixed_precision(mp_policy, param_dtype, backend)
    offload = policies.offload(offload_policy, offload)
    inner = [unit_of(m) for m in module.modules() if unit_of(m) is not None]
    sliced = [name for name, m in module.named_modules() if hasattr(m, "local_pieces")]
    if sliced:
        raise ValueError(
            f"fully_shard: {type(module).__name__} holds tensor-parallel layers "
            f"({sliced[0] or 'itself'}): flattening their slices into one rank's shard would mix "
            f"the ranks' slices. Keep tensor parallelism across mesh.tp_group and shard only "
            f"modules without tensor-parallel layers (fully_shard(..., group=mesh.dp_group))")
    _refuse_taken(module)
    _refuse_sparse(module)
    muon.refuse_over_shards()  # before the user builds an optimizer over the shards
    unit = Unit(module, group, policy, reshard_after_forward, has_inner=bool(inner),
                offload=offload, replicate=replicate)
    for sub in inner:
        sub.is_root = False
    attach(module, unit)
    if dtensor:  # FSDP2's DTensor parameter; state_dict()'s entries DTensors of the whole tensors
        dtensor_params.enable(module, unit, UnitPieces(unit))
    elif unit.shard is not None:  # model.state_dict() / load_state_dict(): the unsharded model
        state_hooks.install(module, UnitPieces(unit))
    fsdp2_methods.install(module, unit)  # model.unshard(), model.set_requires_gradient_sync(...)
    return module


def _groups(group: Group | None, mesh: Mesh | None) -> tuple[Group | None, Group | None]:
    """(the group to shard over, the replicas' group to all-reduce over, or None)."""
    if mesh is None:
        return group, None
    if group is not None:
        raise ValueError("fully_shard: received both group= and mesh=. Choose one: mesh= for "
                         "HSDP (td.mesh(dp=replicas, shard=ranks per replica)), group= for one group")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fully_shard: mesh={mesh!r} is not a td.mesh(...); build one with "
                        f"td.mesh(dp=replicas, shard=ranks per replica)")
    if mesh.pp > 1 or mesh.tp > 1:
        raise ValueError(
            f"fully_shard: mesh= takes a replicas x shards mesh (td.mesh(dp=R, shard=S)); this one "
            f"has pp={mesh.pp}, tp={mesh.tp}. With pipeline or tensor parallelism pass "
            f"group=mesh.dp_group (sharding over the replicas of this stage/slice)")
    if mesh.shard == 1:  # replicas only: each rank holds whole units (a group of itself)
        return Group((runtime.rank(),), None, 0), mesh.dp_group
    return mesh.shard_group, mesh.dp_group


def units(model: nn.Module) -> Iterable[tuple[str, Unit]]:
    """(qualified module name, unit) for every fully sharded module of `model` that holds
    parameters (a root that only holds units has none)."""
    for name, module in model.named_modules():
        unit = unit_of(module)
        if unit is not None and unit.shard is not None:
            yield name, unit


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor | Any,
                    max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm, as `nn.utils.clip_grad_norm_` does in one process.

    Asks each gradient how its parameter is split (`parallel/layout/splits.py`): a fully_shard shard,
    a tensor-parallel slice or branch, a pipeline stage's parameter adds its partial norm over
    the group that holds the pieces; a replicated parameter (as after DDP's backward) counts
    once. Takes a module, a `td.Pipeline`, or parameters. Returns the total norm. Collective
    over those groups when any parameter is split: every rank calls it.

    Args:
        parameters: a module, a `td.Pipeline`, an iterable of parameters, or one tensor; those
            without a gradient are skipped.
        max_norm: the largest total norm the gradients keep.
        norm_type: the p of the p-norm; `float("inf")` for the largest absolute value.

    Returns:
        The total norm of the unclipped gradients, over every piece of the model (a 0-d
        tensor, the same on every rank).

    Raises:
        ValueError: some of the parameters belong to a `ZeroOptimizer` and some do not, or to
            several (clip each with `opt.clip_grad_norm_(max_norm)`).
        CollectiveMismatchError: the ranks hold other split parameters (the norm's all-reduce
            does not match across the group).
    """
    owner = owner_of(parameters)
    if owner.role == "model":  # a module or a td.Pipeline: the parameters this rank holds
        parameters = owner.module().parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    zero = _zero_owner(params)
    if zero is not None:  # its gradients are each rank's own until it averages them
        return owner_of(zero).clip_grad_norm_(max_norm, norm_type)
    device = params[0].grad.device if params else torch.device("cpu")
    inf = norm_type == float("inf")

    def partial(tensors: list[torch.Tensor]) -> torch.Tensor:
        values = [_local(p.grad.detach()).as_subclass(torch.Tensor).float() for p in tensors]
        if not values:
            return torch.zeros(1, device=device)
        if inf:
            peaks = [v.abs().max() if v.numel() else v.new_zeros(()) for v in values]
            return torch.stack(peaks).max().reshape(1)
        return sum(v.abs().pow(norm_type).sum() for v in values).reshape(1)

    by_group: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}
    whole = []
    for p in params:
        split = splits.split_of(p)
        if split is None or split.kind == splits.REPLACED:
            whole.append(p)
        else:  # one reduction per kind and group, in the same order on every rank
            key = (split.kind, tuple(group_ranks(split.group)))
            by_group.setdefault(key, (split.group, []))[1].append(p)
    total = partial(whole)
    distributed = runtime.is_initialized() and runtime.size() > 1
    for _, (group, tensors) in sorted(by_group.items(), key=lambda item: item[0][0]):
        mine = partial(tensors)
        if distributed:
            mine = collectives.allreduce(mine, op="max" if inf else "sum", group=group)
        total = torch.maximum(total, mine) if inf else total + mine
    total = total[0] if inf else total[0].pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        _local(p.grad.detach()).mul_(coefficient.to(p.grad.dtype))
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (tandem.fsdp.fully_shard's shards), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local") \
        else tensor


def _zero_owner(params: list[torch.Tensor]) -> Any:
    """The ZeroOptimizer that holds every one of `params`, None when none holds any; an error
    when only some are, or by several (no one norm of the averaged gradient to take)."""
    from tandem.parallel.zero.optimizer import owner_of

    owners = [owner_of(p) for p in params]
    if all(owner is None for owner in owners):
        return None
    if any(owner is None for owner in owners) or len({id(owner) for owner in owners}) > 1:
        raise ValueError(
            "td.clip_grad_norm_: some of these parameters belong to a ZeroOptimizer (their "
            ".grad is this rank's own until its step() averages it) and some do not, or to "
            "several: clip each ZeroOptimizer with opt.clip_grad_norm_(max_norm)")
    return owners[0]


def full_state_dict(model: nn.Module | Any) -> dict[str, torch.Tensor]:
    """The ordinary state dict of the unsplit model, on every rank (collective): a model sharded
    by `fully_shard` or split by `td.parallelize` (`model.state_dict()`, whose hooks gather the
    shards and slices, `parallel/layout/state_hooks.py`, with tensors of its own), or a `td.Pipeline`
    (every stage's entries, gathered over the pipeline's ranks).

    Args:
        model: a fully sharded or tensor-parallel module, a `td.Pipeline`, or a plain module.

    Returns:
        The full state dict, parameter name to a tensor of the unsplit shape (copies), on every
        rank.

    Raises:
        CollectiveMismatchError: a rank is not in this call, or holds another model (the
            gather's agreement names each rank).
    """
    return owner_of(model).full_state_dict()  # a td.Pipeline: every stage's entries, gathered


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an ordinary (unsplit) state dict: each rank keeps its shard or slice of it.

    A dict for another model is an error listing the missing and unexpected names with shapes.

    Args:
        model: the fully sharded or tensor-parallel module to load into.
        state: the unsplit model's state dict (as `full_state_dict` returns, or one process's).

    Raises:
        ValueError: `state` does not match the model: every missing, unexpected or other-shaped
            name is listed (built a different model?).
    """
    expected = {p.name: p.shape for held in layout.held(model) for p in held.placements}
    check_names(expected, {k: tuple(v.shape) for k, v in state.items()}, "the state dict")
    model.load_state_dict(state)


def check_names(expected: dict[str, tuple], found: dict[str, tuple], what: str) -> None:
    """Raise, naming every parameter that is missing, unexpected or of another shape."""
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in found]
    unexpected = [f"{k} {list(s)}" for k, s in found.items() if k not in expected]
    shapes = [f"{k}: model {list(s)}, saved {list(found[k])}" for k, s in expected.items()
              if k in found and tuple(found[k]) != tuple(s)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from {what}: " + ", ".join(missing))
        if unexpected:
            parts.append(f"in {what} but not in the model: " + ", ".join(unexpected))
        if shapes:
            parts.append("different shapes: " + "; ".join(shapes))
        raise ValueError(f"{what} does not match the model (built a different model?): " + ". ".join(parts))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as the unsharded model's, keyed by parameter name (collective).

    `{"state": {name: {"exp_avg": tensor of the parameter's shape, "step": ...}},
    "param_groups": [{..., "params": [names]}]}`: per-element state is gathered over the
    shards and cut along the unit's parameters; scalars (Adam's step) are taken as they are.

    Args:
        model: the fully sharded model (`td.fully_shard` applied to its root).
        optimizer: the optimizer over its shards.

    Returns:
        The optimizer's state dict keyed by parameter name, with unsharded tensors, on every
        rank.

    Raises:
        DivergedError: a rank is not in this call (every rank calls it).
        ValueError: an optimizer parameter is not a shard of this model's units (apply
            td.fully_shard to the root too).
    """
    model_check.agree_call(model, "full_optimizer_state_dict")  # a rank calling it alone is named
    owner = {id(unit.shard): (prefix, unit) for prefix, unit in units(model)}
    state = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out: dict[str, dict] = {}
    names_of: dict[int, list[str]] = {}
    for i, p in enumerate(params):
        if id(p) not in owner:
            raise ValueError(f"optimizer parameter {i} is not a shard of this model's units; "
                             f"apply td.fully_shard to the root too")
        prefix, unit = owner[id(p)]
        names = [f"{prefix}.{n}" if prefix else n for n in unit.names]
        names_of[i] = names
        entry = state["state"].get(i, {})
        for k, v in entry.items():
            sharded = layout.per_element(k, v, p)
            v = _local(v.detach()) if torch.is_tensor(v) else v
            if sharded and unit.size > 1:
                v = collectives.allgather(v, group=unit.group)
            offset = 0
            for name, shape in zip(names, unit.shapes, strict=True):
                n = int(torch.Size(shape).numel())
                value = v[offset : offset + n].view(shape).clone() if sharded else v
                out.setdefault(name, {})[k] = value
                offset += n
    groups = [{**g, "params": [name for i in g["params"] for name in names_of[i]]}
              for g in state["param_groups"]]
    return {"state": out, "param_groups": groups}


def _refuse_taken(module: nn.Module) -> None:
    """Sharding a block after its root took the block's parameters: say which order works."""
    subtree = {id(m) for m in module.modules()}
    for sub in module.modules():
        outer = taken_by(sub)
        if outer is not None and id(outer) not in subtree:  # not an inner unit's
            which = "" if sub is module else f" (its {type(sub).__name__}'s)"
            raise ValueError(
                f"fully_shard({type(module).__name__}): its parameters{which} already belong to "
                f"the unit of {type(outer).__name__}, which was sharded first. Apply "
                f"fully_shard to the inner blocks first, then the root: `for block in "
                f"model.blocks: td.fully_shard(block)`, then `td.fully_shard(model)`")


def _refuse_sparse(module: nn.Module) -> None:
    """An embedding with sparse gradients (what SparseAdam steps): fully_shard reduce-scatters
    each unit's gradient as one dense flat tensor, which a sparse gradient cannot join (torch
    would fail inside backward, naming nothing)."""
    sparse = [name for name, m in module.named_modules()
              if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and unit_of(m) is None]
    if sparse:
        raise ValueError(
            f"rank {runtime.rank() if runtime.is_initialized() else 0}: fully_shard: "
            f"{type(module).__name__}'s {sparse[0] or 'itself'!r} has sparse=True: its sparse "
            f"gradients (what SparseAdam steps) cannot be reduce-scattered as a flat shard. "
            f"Build it with sparse=False and a dense optimizer such as AdamW, or keep SparseAdam "
            f"with whole parameters on every rank: tandem.horovod's "
            f"hvd.DistributedOptimizer(torch.optim.SparseAdam(...)) averages sparse gradients")
