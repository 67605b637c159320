"""FSDP2's per-module methods on a `td.fully_shard` module, so a ported FSDP2 script keeps them.

PyTorch's `fully_shard(module)` turns the module into an `FSDPModule` with methods of its own.
tandem does not change the module's class; it binds the same names on the instance:

    model.set_requires_gradient_sync(False)   # td.set_requires_gradient_sync(model, False)
    model.unshard(); ...; model.reshard()     # gather this unit's parameters, free them again
    model.set_modules_to_forward_prefetch([...]), model.set_modules_to_backward_prefetch([...])

`unshard()` gathers this module's own unit (every rank of its group calls it) and puts views
of the whole parameters in place until `reshard()` or the next forward; `reshard()` frees
them. The prefetch setters check that they are given fully sharded modules and are otherwise
hints: tandem prefetches the next unit in the order the first forward recorded (and the
previous one in backward), which is what FSDP2's default prefetching does.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tandem.parallel.fully_shard.unit import Unit, unit_of


def install(module: nn.Module, unit: Unit) -> None:
    from tandem.parallel.gradient_sync import set_requires_gradient_sync

    def set_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        set_requires_gradient_sync(module, requires_gradient_sync)

    def unshard(async_op: bool = False) -> None:
        if unit.shard is not None:
            unit._set_views(unit.wait_gathered())

    def reshard() -> None:
        if unit.shard is not None:
            unit._placeholders()

    def prefetch(modules: Sequence[nn.Module]) -> None:
        strangers = [type(m).__name__ for m in modules if unit_of(m) is None]
        if strangers:
            raise ValueError(f"prefetch: {', '.join(strangers)} are not td.fully_shard modules")

    for name, method in (("set_requires_gradient_sync", set_gradient_sync), ("unshard", unshard),
                         ("reshard", reshard), ("set_modules_to_forward_prefetch", prefetch),
                         ("set_modules_to_backward_prefetch", prefetch)):
        object.__setattr__(module, name, method)
