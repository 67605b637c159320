"""fully_shard's policies as FSDP2 spells them: `MixedPrecisionPolicy`, `CPUOffloadPolicy`.

    td.fully_shard(block, mp_policy=td.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32),
                   offload_policy=td.fsdp.CPUOffloadPolicy())

torch's own `torch.distributed.fsdp.MixedPrecisionPolicy` and `CPUOffloadPolicy` are taken
too (read field by field), so a ported FSDP2 script passes what it already builds.

`param_dtype`: the dtype the unit is gathered and computed in (the shards stay fp32 masters).
`reduce_dtype`: the dtype its gradient is reduce-scattered in; None is `param_dtype`, as in
FSDP2 (so bf16 compute reduces in bf16 unless told `reduce_dtype=torch.float32`).
`output_dtype`: floating outputs of the unit's forward are cast to it. `cast_forward_inputs`:
floating inputs of the unit's forward are cast to `param_dtype` (FSDP2's default, True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

#: What every tandem engine reduces (Gloo natively; MPI float16/bfloat16 through float32; NCCL).
#: Gloo answers "Invalid scalar type" for the float8 dtypes, MPI has no datatype for them.
REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes a fully_shard unit computes, reduces and returns in (FSDP2's fields).

    Args:
        param_dtype: the dtype the gathered parameters compute in (None: the shards').
        reduce_dtype: the dtype gradients are reduced in (None: `param_dtype`, or the shards'
            when that is None too).
        output_dtype: the dtype the unit's forward outputs are cast to (None: left as they are).
        cast_forward_inputs: cast the floating inputs of forward to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Shards, their gradients and the optimizer state live in host memory; each unit is copied
    to the compute device (`td.device()`) for its forward and backward only.

    Args:
        pin_memory: page-locked host shards, so the copies to the GPU overlap (ignored where
            there is no GPU: there is nothing to copy to).
    """

    pin_memory: bool = True


def mixed_precision(policy: Any, param_dtype: torch.dtype | None, backend: str) -> MixedPrecisionPolicy:
    """The policy `fully_shard` was given, checked: `mp_policy=` (tandem's or torch's) or the
    older `param_dtype=` alone, which reduces in the shards' dtype (fp32), as it always did."""
    if policy is not None and param_dtype is not None:
        raise ValueError(
            "fully_shard: received both param_dtype= and mp_policy=. Choose one: "
            "mp_policy=td.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)")
    if policy is None:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, cast_forward_inputs=False)
        if param_dtype is not None:
            _check_dtype("param_dtype", param_dtype, backend)
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if not all(hasattr(policy, f) for f in fields):
        raise TypeError(f"fully_shard: mp_policy={policy!r} is not a MixedPrecisionPolicy; give "
                        f"td.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)")
    policy = MixedPrecisionPolicy(*(getattr(policy, f) for f in fields))
    for field in fields[:3]:
        dtype = getattr(policy, field)
        if dtype is not None:
            _check_dtype(field, dtype, backend)
    return policy


def _check_dtype(field: str, dtype: Any, backend: str) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"fully_shard: {field}={dtype!r}: give a floating torch dtype, "
                         f"e.g. torch.bfloat16")
    if field != "output_dtype" and dtype not in REDUCIBLE:
        verb = "reduce" if field == "reduce_dtype" else "gather"
        raise ValueError(
            f"fully_shard: {field}={dtype}: the {backend} backend cannot {verb} {dtype} (Gloo "
            f"and MPI have no such type). Use torch.bfloat16 (or torch.float16) to save "
            f"memory and bandwidth, or torch.float32")


def offload(policy: Any, shorthand: str | None = None) -> CPUOffloadPolicy | None:
    """The offload policy, checked: None (FSDP2's `OffloadPolicy()`, no offload, too) or a
    `CPUOffloadPolicy` (tandem's or torch's); `offload="cpu"` is `CPUOffloadPolicy()`."""
    if shorthand is not None:
        if shorthand != "cpu":
            raise ValueError(f"fully_shard: offload={shorthand!r}: the one place to offload to "
                             f"is \"cpu\" (or give offload_policy=td.fsdp.CPUOffloadPolicy(...))")
        if policy is not None:
            raise ValueError("fully_shard: give offload=\"cpu\" or offload_policy=, not both")
        return CPUOffloadPolicy()
    if policy is None or type(policy).__name__ == "OffloadPolicy":
        return None
    if isinstance(policy, CPUOffloadPolicy):
        return policy
    if type(policy).__name__ == "CPUOffloadPolicy" and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(bool(policy.pin_memory))
    raise TypeError(f"fully_shard: offload_policy={policy!r}: give td.fsdp.CPUOffloadPolicy() "
                    f"(or None to keep the shards on the compute device)")


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its floating tensors cast to `dtype` (MixedPrecisionPolicy's casts)."""
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return tree_map(cast, tree)
