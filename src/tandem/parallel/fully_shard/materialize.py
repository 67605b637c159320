"""A model built on the meta device, fully sharded, then given values one unit at a time.

    with torch.device("meta"):
        model = Net()                         # shapes only: no memory
    for block in model.blocks:
        td.fully_shard(block)
    td.fully_shard(model)
    td.fsdp.materialize(model, seed=0)             # each rank: its shards, equal to one process's

`materialize` replays the initialisation a one-process model gets, `model.apply(init)`:
`init(module)` on every module, children before their parent, with the global RNG seeded
the same on every rank. A unit's parameters exist in full only while the modules that hold
them are initialised: the unit's flat tensor is made when its first module comes, and cut to
this rank's shard (the rest freed) when the unit's own module has run. Peak memory is one
unit (plus the units around it that are still open: the root's own parameters stay open
until the end), not the model; every rank runs the whole initialisation (the RNG is one
sequence), so the compute is one process's.

The default `init` is each module's `reset_parameters()` (or `_reset_parameters()`, as
`nn.MultiheadAttention` has): what torch's layers run in their constructors, in the order
they are built for a model whose layers are built in the order they are registered. Such a
model (every `torch.nn` layer, stacks of them, transformer blocks) materialised with
`seed=s` equals `torch.manual_seed(s); Net()` in one process, exactly. What differs, and why:
an `__init__` that draws random numbers outside `reset_parameters` (`nn.Parameter(torch.randn
(...))`) needs `init=` (it cannot be replayed; such a module without `reset_parameters` is an
error that names it); an init run from a parent over parameters of *inner units* (nanoGPT's
`self.apply(self._init_weights)` in the model's constructor) must instead be the `init=`
function itself, called on each module (those units are already cut to shards when the
parent comes); the temporaries are made on `device`, so on a GPU the values come from the
GPU's generator (equal to one process that builds the model on that GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.parallel.fully_shard.unit import SHARD, Unit, unit_of


def materialize(model: nn.Module, init: Callable[[nn.Module], None] | None = None, *,
                seed: int | None = None, device: torch.device | str | None = None) -> nn.Module:
    """Give a model built on the meta device and fully sharded its values (collective: every
    rank of the job calls it, with the same seed).

    Args:
        model: built under `with torch.device("meta")`, then `td.fully_shard` applied (as with
            FSDP2; a `model.to_empty(device=...)` before this call is fine, and not needed).
        init: called on every module, children first, as `model.apply(init)` does; default:
            the module's `reset_parameters()`. It must set every parameter its module holds.
        seed: `torch.manual_seed(seed)` first, the same on every rank (agreed: ranks that
            pass different seeds all raise, naming each rank's); None: every rank takes rank
            0's RNG state. Either way the RNG ends where one process's would.
        device: where the parameters are initialised and computed (default `td.device()`);
            shards offloaded by `CPUOffloadPolicy` are kept in host memory.

    Returns:
        `model`, each unit holding this rank's shard of the one-process initialisation.

    Raises:
        CollectiveMismatchError: the ranks passed different seeds (each rank's named).
        ValueError: nothing in `model` was built on the meta device, a module has no
            `reset_parameters()` and no `init` was given, or `init` left a tensor without values.
    """
    device = torch.device(device) if device is not None else (
        runtime.device() if runtime.is_initialized() else torch.device("cpu"))
    pending = {id(u): u for m in model.modules() if (u := unit_of(m)) is not None and u.on_meta}
    meta = [n for n, t in _tensors(model) if t.device.type == "meta"]
    if not pending and not meta:
        raise ValueError(
            "td.fsdp.materialize: nothing in this model was built on the meta device; build it under "
            "`with torch.device(\"meta\"): model = Net()`, then td.fully_shard, then materialize")
    slots = _slots(model)  # module -> (its unit, the names it holds there)
    if init is None:
        _check_resettable(model, slots)
    _agree_on_rng(seed, device)
    made = _materialize_tensors(model, device)
    with torch.no_grad():
        open_units: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pool: list[torch.Tensor] = []  # one temporary per nesting depth, reused unit after unit
        for name, module in _post_order(model):
            unit = slots[module][0] if module in slots else _unit_above(model, name)
            if unit is not None and id(unit) in pending and id(unit) not in open_units \
                    and _holds(module, unit):
                open_units[id(unit)] = _open(unit, device, pool, len(open_units))
            (init or _reset)(module)
            mine = unit_of(module)
            if mine is not None and id(mine) in open_units:
                _close(mine, open_units.pop(id(mine)), name)
    unset = [n for n, t in made if t.is_floating_point() and bool(torch.isnan(t).any())]
    if unset:
        raise ValueError(f"td.fsdp.materialize: {', '.join(unset)} still hold no values after init; "
                         f"make init set them (a buffer computed in __init__ must be computed by "
                         f"init too)")
    for m in model.modules():  # the roots' per-step checks now watch the real shards
        unit = unit_of(m)
        if unit is not None and unit.is_root:
            unit.is_root = True
    return model


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for key, tensor in kind.items():
                if tensor is not None and key != SHARD:
                    yield f"{prefix}.{key}" if prefix else key, tensor


def _materialize_tensors(model: nn.Module, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers outside units that are still meta: on `device`, floats NaN (so
    that one no init sets is found); the list of them."""
    made = []
    for prefix, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for key, tensor in list(kind.items()):
                if tensor is None or key == SHARD or tensor.device.type != "meta":
                    continue
                real = torch.empty_like(tensor, device=device)
                if real.is_floating_point():
                    real.fill_(float("nan"))
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                kind[key] = real
                made.append((f"{prefix}.{key}" if prefix else key, real))
    return made


def _slots(model: nn.Module) -> dict[nn.Module, tuple[Unit, list[str]]]:
    """Module -> (the unit that took its parameters, their names in the module)."""
    out: dict[nn.Module, tuple[Unit, list[str]]] = {}
    for m in model.modules():
        unit = unit_of(m)
        if unit is None or unit.shard is None:
            continue
        for owner, attr in unit._slots:
            out.setdefault(owner, (unit, []))[1].append(attr)
    return out


def _unit_above(model: nn.Module, name: str) -> Unit | None:
    """The unit of the nearest fully sharded module at or above `name`."""
    parts = name.split(".") if name else []
    found = unit_of(model)
    module = model
    for part in parts:
        module = module._modules[part]
        found = unit_of(module) or found
    return found


def _holds(module: nn.Module, unit: Unit) -> bool:
    """Whether `module` or a module below it (inside `unit`) holds parameters of `unit`."""
    owners = {id(owner) for owner, _ in unit._slots}
    return any(id(m) in owners for m in module.modules())


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Children before their parent, as `nn.Module.apply` visits them."""
    for name, child in module._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def _check_resettable(model: nn.Module, slots: dict) -> None:
    """Without init=, every module that holds parameters needs a reset_parameters()."""
    names = {m: n for n, m in model.named_modules()}
    for m, name in names.items():
        held = list(slots[m][1]) if m in slots else []
        held += [k for k, p in m._parameters.items() if p is not None and k != SHARD]
        if held and not callable(getattr(m, "reset_parameters", None) or
                                 getattr(m, "_reset_parameters", None)):
            unit = slots[m][0] if m in slots else None
            where = (f" (unit {type(unit.module).__name__} "
                     f"'{names.get(unit.module) or 'the root'}')" if unit is not None else "")
            raise ValueError(
                f"td.fsdp.materialize: module '{name or 'the root'}' ({type(m).__name__}){where} holds "
                f"{', '.join(held)} but has no reset_parameters() to initialise them from the "
                f"meta device. Give init=fn (called on every module, children first, as "
                f"model.apply(fn)), or add reset_parameters() to {type(m).__name__}")


def _agree_on_rng(seed: int | None, device: torch.device) -> None:
    """Every rank starts the initialisation from the same RNG state: the seed they agree on,
    or (no seed) rank 0's state. A seed per rank (`seed=td.rank()`) would give each rank its
    shard of another model, with nothing to see but a loss that trains worse than one process's:
    the seeds are agreed first (one small message, on or off `checks`; collective either way)."""
    distributed = runtime.is_initialized() and runtime.size() > 1
    if distributed and not runtime.joins_running_job():
        said = f"seed={seed!r}" if seed is not None else "seed=None (rank 0's RNG state)"
        agreement.agree(said, None, explain=_explain_seeds)
    if seed is not None:
        torch.manual_seed(seed)
        return
    if not distributed:
        return
    from tandem.comm.collectives import user as collectives

    states = collectives.broadcast_object(
        (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None))
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _explain_seeds(ranks: tuple[int, ...], said: list[str]) -> str:
    lines = "\n".join(f"  rank {r}: {s}" for r, s in zip(ranks, said, strict=True))
    return (f"td.fsdp.materialize: the ranks passed different seeds:\n{lines}\nEach rank would keep "
            f"its shard of a different initialisation (a model no process ever had): "
            f"pass the same seed on every rank (`td.fsdp.materialize(model, seed=0)`), or none "
            f"on every rank (each then takes rank 0's RNG state).")


def _open(unit: Unit, device: torch.device, pool: list[torch.Tensor],
          depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's shard, still empty; the unit's full parameters, NaN until init sets them,
    viewed in place on their modules). The full parameters live in `pool[depth]`, one buffer
    per nesting depth kept for the next unit: a fresh temporary per unit, freed after it,
    was not always given back by glibc (some ranks' resident memory grew by a unit per unit)."""
    shard = torch.empty(unit.shard_numel, dtype=unit.shard.dtype, device=device)
    n = unit.space.padded_numel
    if depth == len(pool):
        pool.append(torch.empty(0, dtype=unit.shard.dtype, device=device))
    if pool[depth].numel() < n or pool[depth].dtype != unit.shard.dtype:
        pool[depth] = torch.empty(0, dtype=unit.shard.dtype, device=device)  # the old one first
        pool[depth] = torch.empty(n, dtype=unit.shard.dtype, device=device)
    flat = pool[depth][:n]
    flat[: unit.numel].fill_(float("nan"))
    flat[unit.numel:].zero_()
    unit._set_views(flat)
    return shard, flat


def _close(unit: Unit, opened: tuple[torch.Tensor, torch.Tensor], name: str) -> None:
    """Keep this rank's shard of the unit's parameters and free the rest."""
    shard, flat = opened
    offset, unset = 0, []
    for param, shape in zip(unit.names, unit.shapes, strict=True):
        n = torch.Size(shape).numel()
        if bool(torch.isnan(flat[offset : offset + n]).any()):
            unset.append(f"{param} {list(shape)}")
        offset += n
    if unset:
        raise ValueError(
            f"td.fsdp.materialize: unit {type(unit.module).__name__} '{name or 'the root'}': init left "
            f"{', '.join(unset)} without values; init must set every parameter of the module it "
            f"is called on (it is called on every module, children first)")
    lo = unit.rank * unit.shard_numel
    unit.set_shard(shard.copy_(flat[lo : lo + unit.shard_numel]))
    unit.on_meta = False
    unit._placeholders()
