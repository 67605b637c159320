"""`td.all_finite(loss)`: skip a step on every rank together, or on none.

`if not torch.isfinite(loss): continue` on one rank only makes the ranks' code paths diverge:
that rank skips the gradient reduction the others enter (tandem then stops every rank with a
`DivergedError`). Deciding together costs one tiny all-reduce:

    if not td.all_finite(loss):
        continue  # every rank skips this step
"""

from __future__ import annotations

import torch

from tandem.comm.collectives import user as collectives
from tandem.comm.engines.backend import Group


def all_finite(*tensors: torch.Tensor, group: Group | None = None) -> bool:
    """True on every rank when every value of `tensors` on every rank is finite, else False on
    every rank (one all-reduce of one number).

    Args:
        *tensors: this rank's tensors to check (a loss, gradients); at least one.
        group: the ranks that decide together (None: the world).

    Returns:
        The same answer on every rank: whether no rank holds an inf or NaN.

    Raises:
        ValueError: no tensor was given.
        TypeError: a value is not a torch tensor (pass `torch.as_tensor(value)`).
    """
    if not tensors:
        raise ValueError("all_finite needs at least one tensor, e.g. td.all_finite(loss)")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_finite takes torch tensors, got {type(t).__name__}; pass "
                            "torch.as_tensor(value)")
    finite = all(bool(torch.isfinite(t).all()) for t in tensors)
    flag = torch.tensor([1.0 if finite else 0.0])
    return bool(collectives.allreduce(flag, op="min", group=group)[0] == 1.0)
