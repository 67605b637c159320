"""What `DistributedOptimizer` and `DistributedDataParallel` share around their `Reducer`:
argument checks (on this rank, and the ranks' agreement on the bucket layout, once), the named
parameters in order, `no_sync()`, and following an elastic job's change of world."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement.agree import CollectiveMismatchError
from tandem.comm.groups import Group, group_ranks
from tandem.parallel.data_parallel.buckets import explain_layout

MB = 1 << 20


def check_common(op: str, bucket_mb: float, first_bucket_mb: float, group: Group | None, who: str) -> None:
    if op not in ("mean", "sum"):
        raise ValueError(f"{who}: op must be 'mean' or 'sum' for gradients, got {op!r}")
    if not bucket_mb > 0 or not first_bucket_mb > 0:
        raise ValueError(
            f"{who}: bucket_mb and first_bucket_mb must be positive, got {bucket_mb} and {first_bucket_mb}")
    if group is not None and group.rank < 0:
        raise ValueError(
            f"{who}: rank {runtime.rank()} is not a member of {group!r}; build it on members only")


class GradientLayoutError(CollectiveMismatchError):
    """Ranks built different models (or reducer options), so gradients cannot be averaged."""


def agree_layout(owner: str, lines: list[str], group: Group | None, timeout: float) -> None:
    """The ranks check once, when the reducer is built, that their bucket layouts agree."""
    try:
        agreement.agree(lines, group, error=GradientLayoutError,
                        explain=functools.partial(explain_layout, owner))
    except TimeoutError as error:
        raise TimeoutError(
            f"{owner}: rank {runtime.rank()} waited {timeout:.0f} s for the ranks "
            f"{list(group_ranks(group))} to build it; one of them did not (it failed "
            f"earlier, or builds it at a different point of the script)"
        ) from error


def leave(wrapper: Any) -> None:
    """Drop the reducer with its operations in flight: a failed world's engine is released
    only when nothing holds its work any more (a Gloo peer still waiting on this rank then
    sees the connection close at once)."""
    if wrapper._reducer is not None:
        wrapper._reducer.close()
    wrapper._reducer = None


def rejoin(wrapper: Any, who: str) -> None:
    if wrapper.group is not None:
        raise ValueError(f"{who} over {wrapper.group!r} cannot follow an elastic job's new world: "
                         "its group's ranks are gone. Reduce over the world (group=None)")
    leave(wrapper)
    wrapper._reducer = wrapper._make_reducer()


@contextlib.contextmanager
def unsynced(reducer) -> Iterator[None]:
    """`no_sync()` of both wrappers: hold the reducer's reductions back (none in a world of one)."""
    if reducer is None:
        yield
        return
    reducer.set_sync(False)
    try:
        yield
    finally:
        reducer.set_sync(True)


def ordered_named_params(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's trainable parameters in registration order, with names."""
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if named_parameters is None:
        return [(f"param{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
        raise TypeError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    names = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(
            f"named_parameters does not name {len(missing)} of the optimizer's parameters "
            f"(positions {missing[:5]}); pass the named_parameters() of the model whose "
            f"parameters the optimizer holds, or omit it"
        )
    order = {id(p): k for k, (_, p) in enumerate(named)}
    return sorted(((names[id(p)], p) for p in params), key=lambda item: order[id(item[1])])
