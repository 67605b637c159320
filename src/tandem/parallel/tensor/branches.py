"""Branches of a model on different ranks, run at the same time on the same batch.

    self.branches = td.tensor.Branches([conv_path, pool_path], group=tp_group, join="cat", dim=1)

A model with parallel paths (Inception-style towers, a two-tower encoder, the heads of a
multi-task model) is split by path: group rank r runs its share of the branches (contiguous,
in order, as evenly as possible) on the full input, and the outputs are joined on every rank,
concatenated along `dim` in branch order (`join="cat"`, sizes along `dim` may differ) or summed
(`join="sum"`). Everything before and after runs replicated, so gradients follow the
tensor-parallel convention: the input's gradient is summed over the ranks that used it, and each
branch's parameters get their gradient on the rank that holds them.

Each forward opens its communication with one agreement over the group (after the local
branches ran, so it carries their joined output's shape) and each backward with another
(`parallel/operation_check.py`): a rank that skipped one, or whose branches return another shape,
is named before the join. The join itself then goes straight to the engine (`comm/collectives/direct.py`):
one all-reduce (`join="sum"`) or one all-gather (`join="cat"`) per forward, none backward. The
ranks' sizes along `dim` are exchanged once per shape of this rank's output and cached; the
agreement carries each rank's cached sizes, so ranks whose sizes changed on some ranks only
(sizes that depend on the data, not on the input's shape) are named instead of misjoined.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement import exchange
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_ranks, group_size
from tandem.parallel import model_check
from tandem.parallel.layout import split_grads, splits
from tandem.parallel.layout.owner import local_state, split_of_module
from tandem.parallel.layout.pieces import Held, whole
from tandem.parallel.operation_check import OperationCheck
from tandem.parallel.tensor import region_ops
from tandem.parallel.tensor.regions import copy_to, reduce_from


class Branches(nn.Module):
    """Run `branches` spread over `group`'s ranks and join their outputs on every rank.

    Args:
        branches: the independent sub-modules that read the same input (each rank keeps and runs
            its consecutive share of them); at least as many as the group's ranks.
        group: the ranks to spread them over (default: the world).
        join: "cat" concatenates the branches' outputs along `dim`, in branch order; "sum" adds
            them.
        dim: the dimension "cat" joins along.

    Raises:
        ValueError: a `join` other than "cat" or "sum", or fewer branches than ranks.
    """

    def __init__(self, branches: Sequence[nn.Module], *, group: Group | None = None,
                 join: str = "cat", dim: int = -1) -> None:
        super().__init__()
        n = group_size(group)
        if join not in ("cat", "sum"):
            raise ValueError(f"join={join!r}: choose 'cat' or 'sum'")
        if len(branches) < n:
            raise ValueError(f"{len(branches)} branches cannot keep {n} ranks busy: use a group "
                             f"of at most {len(branches)} ranks")
        rank = group_rank(group)
        first, last = rank * len(branches) // n, (rank + 1) * len(branches) // n
        self.mine = nn.ModuleList(branches[first:last])  # only this rank's branches are kept
        _mark_whole(group, self.mine, branches)  # the ranks of `group` hold different ones, each whole
        self.first_branch, self.count = first, len(branches)
        self.group, self.join, self.dim = group, join, dim
        self._sizes: dict[tuple[int, ...], list[int]] = {}  # this rank's output shape -> all sizes
        names = [type(b).__name__ for b in branches]
        owner = f"[{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}]"
        # model.state_dict() speaks the one-process model (a collective over the group), and
        # load_state_dict takes it back, as for the other split modules (layout/state_hooks.py)
        self.register_state_dict_post_hook(Branches._to_full)
        self.register_load_state_dict_pre_hook(Branches._to_local)
        _checks[self] = OperationCheck.make(
            "Branches", owner, [f"{names} join={join} dim={dim}"], group, self.mine.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with direct.covering(self.group):  # this forward's agreement covers the join
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to(x, self.group)
        outputs = [branch(x) for branch in self.mine]
        local = torch.stack(outputs).sum(0) if self.join == "sum" else torch.cat(outputs, dim=self.dim)
        cat = self.join == "cat" and group_size(self.group) > 1
        dim = self.dim % local.dim()
        sizes = self._sizes.get(tuple(local.shape)) if cat else None
        check = _checks.get(self)
        if check is not None:  # before the join: every rank in this forward, with a shape that joins
            shape = list(local.shape)
            if self.join == "cat":
                shape[dim] = "*"
            detail = f"({', '.join(map(str, shape))}) {str(local.dtype).replace('torch.', '')}"
            if cat:  # the sizes each rank will join with: cached alike, or new on every rank
                detail += f"; sizes along dim {dim}: {sizes or 'new'}"
            check.forward_starts(detail, self._explain_shapes)
        if self.join == "sum":
            out = reduce_from(local, self.group)
        elif not cat:
            return local
        else:
            if sizes is None:
                sizes = exchange.lengths(local.shape[dim], self.group, runtime.state())
                self._sizes[tuple(local.shape)] = sizes
            out = _GatherUneven.apply(local, dim, self.group, sizes)
        if check is not None:
            model_check.expect_backward_of(check, out)
        return out

    def _explain_shapes(self, ranks: tuple[int, ...], details: list) -> str:
        n = group_size(self.group)
        spans = [(r * self.count // n, (r + 1) * self.count // n) for r in range(n)]
        lines = "\n".join(f"  rank {rank}: branches {a}..{b - 1}: {detail}"
                          for rank, detail, (a, b) in zip(ranks, details, spans, strict=True))
        if len({d.split("; ")[0] for d in details}) == 1:  # the same shape: sizes that changed
            return (f"Branches over ranks {list(group_ranks(self.group))}: the branches' sizes "
                    f"along dim {self.dim} changed on some ranks only, for an input of the same "
                    f"shape (nothing was sent):\n{lines}\nThe sizes a branch returns along the "
                    f"joined dim must follow from the input's shape (the ranks agree on them once "
                    f"per shape); pad data-dependent outputs to a size fixed by the input.")
        need = (f"the same dtype and size in every dimension but dim {self.dim} (join='cat')"
                if self.join == "cat" else "the same shape and dtype (join='sum')")
        return (f"Branches over ranks {list(group_ranks(self.group))}: the ranks' branches "
                f"returned outputs that cannot be joined (nothing was sent):\n{lines}\nEvery "
                f"branch must return {need}.")

    # -- the layout protocol (`parallel/layout/pieces.py`): each branch whole, on its rank --------
    def _own(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """This rank's branches' parameters and persistent buffers under the one-process names:
        the local `mine.j.x` is branch `first_branch + j`, `mine.{first_branch + j}.x`."""
        out = []
        for key, tensor in local_state(self.mine).items():
            j, rest = key.split(".", 1)
            out.append((f"{prefix}mine.{self.first_branch + int(j)}.{rest}", tensor))
        return out

    def local_pieces(self, prefix: str) -> list[Held]:
        """Every tensor of this rank's branches, whole, under its one-process name: a checkpoint
        saves each branch once (from the ranks that hold it) and loads it on any group size."""
        nested = [name for name, m in self.mine.named_modules() if name
                  and split_of_module(m) is not None]
        if nested:
            raise ValueError(
                f"Branches over ranks {list(group_ranks(self.group))}: branch module "
                f"{nested[0]!r} is itself split (tensor parallel or fully_shard): a checkpoint "
                f"cannot name its pieces inside a branch. Split the branches' layers outside "
                f"Branches, or keep the branches whole")
        return [Held(tensor, (whole(name, tensor),)) for name, tensor in self._own(prefix)]

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every branch's tensors under the one-process names, on every rank of the group (a
        collective)."""
        mine = {name: tensor.detach().cpu() for name, tensor in self._own(prefix)}
        if group_size(self.group) == 1:
            return mine
        out: dict[str, torch.Tensor] = {}
        for part in collectives.allgather_object(mine, group=self.group):
            out.update(part)
        device = next((t.device for _, t in self._own(prefix)), torch.device("cpu"))
        return {name: tensor.to(device) for name, tensor in out.items()}

    def _to_full(self, state: dict, prefix: str, metadata: Any) -> None:
        for key in local_state(self.mine):
            state.pop(f"{prefix}mine.{key}", None)
        state.update(self.full_tensors(prefix))

    def _to_local(self, state: dict, prefix: str, *rest: Any) -> None:
        """A one-process state dict (every branch's entries) is cut to this rank's branches,
        renamed to their local names; a dict of local entries loads as it is."""
        if self.count == len(self.mine) or not any(
                key.startswith(f"{prefix}mine.{self.count - 1}.") for key in state):
            return  # a world of one, or this rank's own local entries
        keep = {local: state.get(one) for one, local in
                ((name, f"{prefix}mine.{key}") for (name, _), key in
                 zip(self._own(prefix), local_state(self.mine), strict=True))}
        for key in [k for k in state if k.startswith(f"{prefix}mine.")]:
            del state[key]
        state.update({k: v for k, v in keep.items() if v is not None})

    def extra_repr(self) -> str:
        return (f"branches {self.first_branch}..{self.first_branch + len(self.mine) - 1} of "
                f"{self.count} on this rank, join={self.join!r}, dim={self.dim}")


_checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Branches -> its OperationCheck


def _mark_whole(group: Group | None, mine: nn.Module, branches: Sequence[nn.Module]) -> None:
    """Register this rank's branches' parameters as whole tensors held by this rank alone
    (`splits.BRANCH`): any optimizer may step them (Adafactor, Muon and LAMB included: each is
    a whole one-process tensor), while a reduction or broadcast over `group` would mix branches
    and is refused. Their gradients' norms reduce over `group` (`split_grads`), so torch's
    `clip_grad_norm_` sees the whole model's norm when each rank holds as many tensors; when
    they hold different numbers (every rank knows them: each builds every branch), it is
    refused with the fix. A layer already split inside a branch keeps its own split."""
    region_ops.remember(group)  # for the regions' compiled operators (copy_to, reduce_from)
    n = group_size(group)
    counts = {sum(1 for b in branches[r * len(branches) // n:(r + 1) * len(branches) // n]
                  for p in b.parameters() if p.requires_grad and splits.split_of(p) is None)
              for r in range(n)}
    paired = splits.BRANCH if len(counts) == 1 else splits.BRANCH_UNPAIRED
    for param in mine.parameters():
        if splits.split_of(param) is None:
            splits.mark(param, splits.BRANCH, group)
            split_grads.mark_grads(param, splits.Split(paired, group))


class _GatherUneven(torch.autograd.Function):
    """Concatenate every rank's tensor along `dim` (rank i's is `sizes[i]` long there);
    backward keeps this rank's slice (the loss after the join is replicated)."""

    @staticmethod
    def forward(ctx, tensor, dim, group, sizes):
        moved = tensor.movedim(dim, 0).contiguous()
        rank = group_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        return direct.allgather_uneven(moved, sizes, group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None
