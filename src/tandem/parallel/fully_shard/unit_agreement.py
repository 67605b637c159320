"""What the ranks of a fully_shard unit agree on, once, when the unit is made.

The unit's gathers and reduce-scatters are not checked one call at a time (they are hot), so
everything that decides what those calls send must be the same on every rank before the first
one: the unit's tensors (names, shapes, dtypes), its `MixedPrecisionPolicy` (the dtype the
shards are gathered in, the dtype the gradient is reduced in, the casts around forward), its
offload policy, `reshard_after_forward` (whether backward gathers again) and the ranks it
shards and replicates over. A rank that gathers in bf16 while another gathers in fp32 reads
the other's bytes as its own dtype (MPI: inf, then NaN parameters, no error; Gloo: an abort).

One agreement message (`comm/agreement/agree.py`, a few int64: one code per setting) at
`td.fully_shard`, on or off `checks`, as the tensor-parallel plan's: it is paid once per unit,
never per step. On a mismatch every rank raises one error naming each rank's setting and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.comm.agreement import agree as agreement
from tandem.comm.groups import Group, group_ranks, group_size
from tandem.parallel.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy

#: The settings compared, in the order of their codes (after the tensors').
SETTINGS = ("mp_policy", "offload_policy", "reshard_after_forward", "group/mesh")


def describe_policy(policy: MixedPrecisionPolicy) -> str:
    """The policy as the ranks compare it: "none" when it changes no dtype."""
    fields = (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)
    if all(dtype is None for dtype in fields):
        return "none (the parameters' own dtype)"
    names = [str(d).replace("torch.", "") if d is not None else "None" for d in fields]
    return (f"MixedPrecisionPolicy(param_dtype={names[0]}, reduce_dtype={names[1]}, "
            f"output_dtype={names[2]}, cast_forward_inputs={policy.cast_forward_inputs})")


def describe_ranks(group: Group | None, replicate: Group | None) -> str:
    """The same on every rank of the agreement: a group's ranks; a mesh's shape (agreed over
    the world, where each replica shards over ranks of its own)."""
    if replicate is None:
        return f"shards over ranks {list(group_ranks(group))}"
    return (f"mesh of {group_size(replicate)} replicas x {group_size(group)} shards "
            f"(td.mesh(dp={group_size(replicate)}, shard={group_size(group)}))")


def agree(what: str, named: list[tuple[str, torch.Tensor]], policy: MixedPrecisionPolicy,
          offload: CPUOffloadPolicy | None, reshard_after_forward: bool,
          group: Group | None, replicate: Group | None) -> None:
    """Raise on every rank of the unit unless all hold the same tensors and settings.

    HSDP (`replicate`, a mesh of replicas x shards) agrees over the whole world."""
    tensors = agreement.describe_tensors(named)
    mine = {"tensors": tensors, "mp_policy": describe_policy(policy),
            "offload_policy": repr(offload) if offload is not None else "none",
            "reshard_after_forward": repr(bool(reshard_after_forward)),
            "group/mesh": describe_ranks(group, replicate)}
    codes = [agreement.checksum(tensors)] + [agreement.checksum(mine[k]) for k in SETTINGS]
    agreement.agree(mine, None if replicate is not None else group, codes=codes,
                    explain=lambda ranks, said: _explain(what, ranks, said),
                    error=agreement.LayoutMismatchError)


def _explain(what: str, ranks: tuple[int, ...], said: list[dict[str, Any]]) -> str:
    if any(s["tensors"] != said[0]["tensors"] for s in said):
        return agreement.explain_layout(what, ranks, [s["tensors"] for s in said],
                                        "Build the same model on every rank before td.fully_shard.")
    lines = [f"{what}: the ranks passed different settings to td.fully_shard (the unit's "
             f"gathers and reductions would send different things):"]
    for key in SETTINGS:
        values = [s[key] for s in said]
        if len(set(values)) > 1:
            lines.append(f"  {key}:")
            lines += [f"    rank {r}: {v}" for r, v in zip(ranks, values, strict=True)]
    lines.append("Pass the same mp_policy, offload_policy, reshard_after_forward and group/mesh to "
                 "td.fully_shard on every rank (a setting chosen by rank, e.g. `mp_policy=... if "
                 "td.rank() == 0 else None`, must be chosen the same way everywhere).")
    return "\n".join(lines)
