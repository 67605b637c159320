"""Activation checkpointing per block: `td.memory.checkpoint_wrapper(model, policy=Block)`.

    td.memory.checkpoint_wrapper(model, policy=nn.TransformerEncoderLayer)  # every such block
    td.memory.checkpoint_wrapper(model, policy=lambda m: m in set(model.blocks))  # torch's check_fn
    td.memory.checkpoint_wrapper(block)                                     # this one module

Each chosen module's forward runs under `torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`: the block keeps only its inputs during forward and runs its forward
again in backward to get the activations back (less memory, one more forward of compute).
It is torch's `apply_activation_checkpointing(model, check_fn=...)` with two differences that
matter in tandem:

- In place, no wrapper module: the module's `forward` is replaced on the instance, so parameter
  and state-dict names stay the model's (torch's `CheckpointWrapper` inserts
  `_checkpoint_wrapped_module.` and needs hooks to take it out again), and tandem's layout
  protocol, `Checkpointer` and `full_state_dict` see the same model as before.
- Only `forward` is recomputed, never the module's hooks. A `td.fully_shard` unit's hooks run
  once in forward (gather, then free) and once before the block's backward (gather again);
  the recomputation reads that second gather, which is freed after the block's gradient is
  reduce-scattered: the gathers happen again for the recomputation and are freed after. So the
  order of `fully_shard` and `checkpoint_wrapper` does not matter, and DistributedOptimizer's
  and DDP's gradient hooks (on parameters) fire once per backward as without checkpointing.

The recomputation replays the random state (`preserve_rng_state=True`), so dropout drops the
same elements twice. Works under `torch.compile` (dynamo traces non-reentrant checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

Policy = Callable[[nn.Module], bool] | type | tuple


class _CheckpointedForward:
    """The replacement `forward`: the original one, recomputed in backward."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward  # the bound original: deepcopy rebinds it to the copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module`'s forward is recomputed in backward (by `checkpoint_wrapper`)."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _matcher(policy: Policy) -> Callable[[nn.Module], bool]:
    if isinstance(policy, type) or (isinstance(policy, tuple) and policy
                                    and all(isinstance(t, type) for t in policy)):
        return lambda module: isinstance(module, policy)
    if callable(policy):
        return policy
    raise TypeError(
        f"checkpoint_wrapper: policy must be a module class (or a tuple of them), or a "
        f"function module -> bool (torch's check_fn), got {policy!r}")


def checkpoint_wrapper(module: nn.Module, policy: Policy | None = None) -> nn.Module:
    """Recompute activations in backward: `module` itself, or each submodule `policy` picks.

    Args:
        module: the model (or one block) to change in place.
        policy: None checkpoints `module`'s own forward. A class or tuple of classes picks every
            submodule of those types; a function `module -> bool` picks those it returns True
            for. A picked module inside another picked one is left alone (the outer one
            already recomputes it).

    Returns:
        `module` itself, with the picked forwards replaced; names and state dict unchanged.

    Raises:
        TypeError: `module` is not an `nn.Module`, or `policy` is neither a class (or tuple of
            classes) nor a function.
        ValueError: `policy` picked no module, or a picked module is already checkpointed.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper takes an nn.Module, got {type(module).__name__}")
    if policy is None:
        chosen = [("", module)]
    else:
        picks = _matcher(policy)
        chosen = []
        for name, sub in module.named_modules():
            if any(name.startswith(f"{outer}.") or outer == "" for outer, _ in chosen):
                continue  # inside a module already chosen
            if picks(sub):
                chosen.append((name, sub))
        if not chosen:
            raise ValueError(
                f"checkpoint_wrapper: policy {policy!r} picked no module of "
                f"{type(module).__name__}; give the class of its blocks (e.g. "
                f"policy=nn.TransformerEncoderLayer) or a function that returns True for them")
    again = [name or type(sub).__name__ for name, sub in chosen if is_checkpointed(sub)]
    if again:
        raise ValueError(
            f"checkpoint_wrapper: {', '.join(again)} is already checkpointed; apply "
            f"checkpoint_wrapper once per module (recomputing twice would only cost time)")
    for _, sub in chosen:
        sub.forward = _CheckpointedForward(sub.forward)
    return module
