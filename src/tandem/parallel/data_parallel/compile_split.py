"""Communication that still overlaps backward when the model is compiled (`torch.compile`).

Eager backward hands each gradient to the reducer as soon as autograd computes it, so the
bucket holding the last layers is reduced while the first layers' gradients are still being
computed. A compiled model is different: dynamo captures the forward as one graph and
AOTAutograd turns it into one forward and ONE backward function, which the autograd engine runs
as a single node. Every parameter's gradient becomes ready when that node returns, at the very
end of backward, and every bucket is launched then: nothing overlaps.

The fix is the one torch uses for its own DDP (Note [DDPOptimizer] in
`torch/_dynamo/backends/distributed.py`): split the captured graph at bucket boundaries before
the backend compiles it. Walking the graph backwards, parameters are counted into pieces of
a cap (the first one small, as the reducer's first bucket; `BucketCaps.of` sizes the others so
that pieces end inside or at the end of the reducer's buckets); each piece's nodes become a
subgraph compiled on its own (by inductor, or whichever backend was asked for), and each
subgraph gets its own backward node. Autograd then runs the subgraphs' backwards one after
the other, and the gradients of a bucket are ready, and its reduction under way, while the
backward of the layers before it still runs. The split is not a graph break: dynamo still
traces the whole forward once, with no fallback to Python between the pieces.

How tandem asks for it: torch's dynamo swaps in that splitting compiler when it compiles a
frame while a DDP module is active (`DistributedDataParallel._get_active_ddp_module()`, read at
compile time, with `torch._dynamo.config.optimize_ddp`, on by default). `td.DistributedDataParallel`
runs its forward outside dynamo (as torch's DDP does) and, around the call of its inner
module, publishes its bucket cap there (`bucket_boundaries`); the inner module is called
through `call_module`, a frame of tandem's own, because dynamo does not start a graph at the
frames of `torch.nn` (an `nn.Sequential`'s forward would otherwise run uncompiled). The
published object is a small record with the one attribute dynamo reads (`bucket_bytes_cap`),
never a torch DDP. Eager runs pay one attribute store and restore per forward.

`td.DistributedOptimizer` never sees the model's forward (it only holds the parameters), so it
cannot publish its cut around one. Its cut *stands* instead (`stand_for`): from its
construction until it is garbage-collected, every frame dynamo compiles outside a DDP wrapper's
forward is split at its buckets. A graph without its parameters (another model, an evaluation
step) is split too, harmlessly: the splitter counts parameters, so a graph with few makes one
or a few pieces, and each piece is still compiled by the backend asked for. The latest live
optimizer's cut stands; a DDP wrapper's forward publishes its own and restores the standing one.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP


@dataclass(frozen=True)
class BucketCaps:
    """What dynamo's graph splitter reads of the active data-parallel module."""

    bucket_bytes_cap: int

    @staticmethod
    def of(bucket_bytes: list[int]) -> BucketCaps:
        """The cap that makes the splitter's pieces end no later than the reducer's buckets.

        The splitter closes a piece once it holds `cap` bytes (the first at 1 MB, as the
        reducer's first bucket); the reducer closes a bucket before it would exceed its cap, so
        its buckets are smaller than the cap, and pieces of the cap itself would end later and
        later. Pieces of the smallest full bucket (neither the small first nor the small last)
        end inside or at the end of each bucket, so a bucket's last gradient is ready no later
        than it would be with pieces cut exactly at the buckets. Never under 1 MB: the splitter
        requires its first piece to be no larger than the others.
        """
        full = bucket_bytes[1:-1] if len(bucket_bytes) > 2 else bucket_bytes[1:]
        return BucketCaps(max(min(full, default=_FIRST_PIECE_BYTES), _FIRST_PIECE_BYTES))

    @staticmethod
    def of_reducer(reducer: Any) -> BucketCaps:
        """`of` the reducer's buckets, in parameter bytes as the splitter counts them (no
        padding, no flags)."""
        return BucketCaps.of([sum(v.nbytes for v in b.views) for b in reducer.buckets])


_FIRST_PIECE_BYTES = 1 << 20  # torch's splitter's first piece (torch.distributed's default)

# Torch's hook point; without it (another torch) there is nothing to publish to, and compiled
# models are one graph (correct, without overlap).
_SUPPORTED = hasattr(_TorchDDP, "_active_ddp_module") and hasattr(_TorchDDP, "_get_active_ddp_module")


@contextlib.contextmanager
def bucket_boundaries(caps: BucketCaps | None) -> Iterator[None]:
    """While inside: a frame that dynamo compiles is split at buckets of `caps` (None: not)."""
    if caps is None or not _SUPPORTED:
        yield
        return
    previous = _TorchDDP._active_ddp_module
    _TorchDDP._active_ddp_module = caps  # restored below, also for nested wrappers
    try:
        yield
    finally:
        _TorchDDP._active_ddp_module = previous


# owner (a DistributedOptimizer) -> its cut, oldest first; an owner leaves when collected.
_standing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stand_for(owner: object, caps: BucketCaps | None) -> None:
    """While `owner` lives (or until it stands again), split every frame dynamo compiles at
    `caps` (None: withdraw `owner`'s cut)."""
    if not _SUPPORTED:
        return
    first = owner not in _standing
    _standing.pop(owner, None)
    if caps is not None:
        _standing[owner] = caps
        if first:  # (an elastic job's new world stands again: one finalizer is enough)
            weakref.finalize(owner, _publish_standing)
    _publish_standing()


def _publish_standing() -> None:
    current = _TorchDDP._active_ddp_module
    if current is not None and not isinstance(current, BucketCaps):
        return  # a torch DDP forward is running: it restores what it found
    live = list(_standing.values())
    _TorchDDP._active_ddp_module = live[-1] if live else None


def call_module(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """`module(*args, **kwargs)` in a frame dynamo compiles (it skips `torch.nn`'s own frames)."""
    return module(*args, **kwargs)


def hooks_outside_graph(module: nn.Module) -> None:
    """Make `torch.compile(module)` run `module`'s hooks outside its graph, also when its
    class is one of torch's own (`nn.Sequential`).

    torch.compile runs a module's hooks before dynamo picks up its forward's frame, except
    when that forward is torch.nn's code: dynamo starts no frame there, so it inlines the
    whole call, hooks included, and a hook that must stay eager (an agreement that
    communicates) breaks the graph at its entry. Such a module gets its class's forward as
    a method of its own, from this file (an instance attribute: the class, the state dict,
    copies and pickles are unchanged), which gives dynamo a frame to start at.
    """
    forward = type(module).forward
    if "forward" not in vars(module) and getattr(forward, "__module__", "").startswith("torch.nn"):
        module.forward = types.MethodType(_class_forward, module)


def _class_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(module).forward(module, *args, **kwargs)

