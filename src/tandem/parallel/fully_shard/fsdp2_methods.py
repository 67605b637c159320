"""FSDP2's per-module methods on a `td.fully_shard` module, so a ported FSDP2 script keeps them.

PyTorch's `fully_shard(module)` turns the module into an `FSDPModule` with methods of its own.
tandem does not change the module's class; it binds the same names on the instance:

    model.set_requires_gradient_sync(False)   # td.fsdp.set_requires_gradient_sync(model, False)
    model.unshard(); ...; model.reshard()     # gather this unit's parameters, free them again
    model.set_modules_to_forward_prefetch([...]), model.set_modules_to_backward_prefetch([...])

`unshard()` gathers this module's own unit (every rank of its group calls it) and registers
the whole parameters, in the policy's `param_dtype` (bf16 under a bf16 MixedPrecisionPolicy),
in place of the fp32 shard until `reshard()` or the next forward, as FSDP2 registers its
unsharded parameters: `module.parameters()` then yields them (the shard is back after), and the
next forward computes with that gather instead of another. `reshard()` frees them. The
prefetch setters check that they are given fully sharded modules and are otherwise
hints: tandem prefetches the next unit in the order the first forward recorded (and the
previous one in backward), which is what FSDP2's default prefetching does.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tandem.parallel.fully_shard.unit import SHARD, Unit, unit_of


def _register_whole(unit: Unit, full) -> None:
    """The gathered parameters as the module's parameters (in `param_dtype`), the shard off."""
    unit.module._parameters.pop(SHARD, None)
    for (owner, attr), view in zip(unit._slots, _views(unit, full), strict=True):
        owner.__dict__.pop(attr, None)
        owner._parameters[attr] = nn.Parameter(view, requires_grad=False)


def _register_shard(unit: Unit) -> None:
    """Back to the shard as the module's one parameter (placeholders in the others' place)."""
    for owner, attr in unit._slots:
        owner._parameters.pop(attr, None)
    unit.module._parameters[SHARD] = unit.shard
    unit._placeholders()


def _views(unit: Unit, full) -> list:
    views, offset = [], 0
    for shape in unit.shapes:
        n = 1
        for d in shape:
            n *= d
        views.append(full[offset : offset + n].view(shape))
        offset += n
    return views


def install(module: nn.Module, unit: Unit) -> None:
    from tandem.parallel.gradient_sync import set_requires_gradient_sync

    def set_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        set_requires_gradient_sync(module, requires_gradient_sync)

    unsharded: list = []  # the gathered flat tensor while unshard()'s parameters are registered

    def unshard(async_op: bool = False) -> None:
        if unit.shard is not None and not unsharded:
            full = unit.wait_gathered()
            _register_whole(unit, full)
            unsharded.append(full)

    def reshard() -> None:
        if unit.shard is not None:
            if unsharded:
                unsharded.clear()
                _register_shard(unit)
            unit._placeholders()

    def before_forward(_module: nn.Module, _args) -> None:
        """The forward after unshard(): the shard is the parameter again, and the forward
        takes the gather unshard() made (no second one)."""
        if unsharded:
            full = unsharded.pop()
            _register_shard(unit)
            if unit._pending is None:
                unit._pending = (None, full)

    module.register_forward_pre_hook(before_forward, prepend=True)

    def prefetch(modules: Sequence[nn.Module]) -> None:
        strangers = [type(m).__name__ for m in modules if unit_of(m) is None]
        if strangers:
            raise ValueError(f"prefetch: {', '.join(strangers)} are not td.fully_shard modules")

    for name, method in (("set_requires_gradient_sync", set_gradient_sync), ("unshard", unshard),
                         ("reshard", reshard), ("set_modules_to_forward_prefetch", prefetch),
                         ("set_modules_to_backward_prefetch", prefetch)):
        object.__setattr__(module, name, method)
