"""Horovod's `DistributedOptimizer` and state broadcasts, over tandem's data parallelism."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

import tandem as td
from tandem.comm.groups import Group
from tandem.horovod.basics import (
    Average,
    Compression,
    ProcessSet,
    Sum,
    compressor,
    global_process_set,
    group_of,
)
from tandem.parallel.data_parallel.wrappers import DistributedOptimizer as _TandemOptimizer


class _HorovodOptimizer(_TandemOptimizer):
    """`td.DistributedOptimizer` with the few behaviours Horovod scripts see on top:

    `_parameter_names` ({parameter: name}); a warning when `synchronize()` is followed by a
    `step()` outside `skip_synchronize()` (Horovod would reduce twice there; tandem does not,
    but the script is still written wrong for Horovod).
    """

    def __init__(self, optimizer, named_parameters, **options: Any) -> None:
        # Sparse gradients (nn.Embedding(sparse=True)) are averaged densely, in the buckets
        # with the others, and handed back to the optimizer sparse (SparseAdam needs them so):
        # Horovod's sparse_as_dense, which gives the same average as its allgather. These hooks
        # are registered first, so they run before the reducer's.
        # The hooks hold the optimizer weakly, as the reducer's do: the parameters' hooks live
        # on the C++ side, which the garbage collector cannot see through.
        self._sparse: set[torch.Tensor] = set()
        densify = _densifier(weakref.ref(self))
        for _, param in named_parameters:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(densify)
        super().__init__(optimizer, named_parameters=named_parameters, **options)
        self._parameter_names = {param: name for name, param in named_parameters}
        self._synchronized = False

    def synchronize(self) -> None:
        super().synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        with super().skip_synchronize():
            yield
        self._synchronized = False

    def step(self, closure=None):
        if self._synchronized and not self._skip_sync:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). This can cause training slowdown. You may want to "
                "consider using optimizer.skip_synchronize() context if you use "
                "optimizer.synchronize() in your code.", stacklevel=2,
            )
        self._synchronized = False
        if self._sparse:
            if not self._skip_sync:
                self._finish_open_round()
            for param in self._sparse:
                if param.grad is not None and not param.grad.is_sparse:
                    param.grad = param.grad.to_sparse()
        return super().step(closure)


def _densifier(owner_ref: weakref.ref):
    def densify(param: torch.Tensor) -> None:
        owner = owner_ref()
        if owner is not None and param.grad is not None and param.grad.is_sparse:
            owner._sparse.add(param)
            param.grad = param.grad.to_dense()

    return densify


def _named(optimizer: torch.optim.Optimizer, named_parameters) -> list[tuple[str, Any]]:
    """Horovod's checks on `named_parameters`: a ValueError names the problem."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; found "
                         f"duplicates: {', '.join(duplicates)}")
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in known]
    if missing:
        raise ValueError(f"named_parameters was given but misses {len(missing)} of the "
                         f"optimizer's parameters (positions {missing[:8]}): pass "
                         "model.named_parameters() for every parameter the optimizer steps")
    return named


def DistributedOptimizer(optimizer, named_parameters=None,  # noqa: N802 (Horovod's name)
                         compression=Compression.none, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """Horovod's signature over `td.DistributedOptimizer`: gradients are averaged during
    backward. `gradient_predivide_factor` only moves Horovod's division, which for the average
    is the same result; `num_groups`/`groups` (fusion hints) are accepted and not needed."""
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, not {op!r}"
                         + (" (Adasum is not implemented)" if op == "adasum" else ""))
    named = _named(optimizer, named_parameters)
    if isinstance(process_set, ProcessSet) and process_set.included() is False:
        # A rank outside the set steps on its own gradients, as in Horovod: a group of one
        # (nothing to reduce, so no reducer and no communication).
        group = Group((td.rank(),), None, 0)
    else:
        group = group_of(process_set)
    return _HorovodOptimizer(
        optimizer, named, op=op, compression=compressor(compression).wire,
        accumulate=backward_passes_per_step, group=group,
    )


def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """`model.state_dict()` or `model.named_parameters()`, as Horovod accepts both."""
    if not isinstance(params, dict):
        params = dict(params)
    td.broadcast_parameters(params, root=root_rank, group=group_of(process_set))


def broadcast_optimizer_state(optimizer, root_rank: int, model=None,
                              process_set=global_process_set) -> None:
    """The optimizer's state and hyper-parameters from `root_rank`.

    As Horovod (which initializes an empty state with a step on zero gradients), parameters
    that require grad and have none get a zero gradient.
    """
    inner = optimizer.optimizer if isinstance(optimizer, _TandemOptimizer) else optimizer
    if not inner.state:
        for group in inner.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
    td.broadcast_optimizer_state(inner, root=root_rank, group=group_of(process_set))
