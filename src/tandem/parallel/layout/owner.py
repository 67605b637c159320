"""One owner per split: the object every model-wide call asks, whatever wraps the model.

    owner = owner_of(obj)          # a model, a td.Pipeline, an optimizer or one of tandem's wrappers
    owner.held()                   # the local tensors and the one-process pieces each holds
    owner.optimizer()              # the torch optimizer that keeps the state (None: not one)
    owner.set_gradient_sync(False) # accumulate locally (False: nothing to switch here)
    owner.leave(); owner.rejoin()  # a change of world (td.elastic)
    owner.not_replicated(group)    # what group's ranks hold different parts of (not broadcast)
    owner.describe()               # for messages: "td.ZeroOptimizer over 3 ranks (flat shards)"

Each way of splitting (the data-parallel reducer behind `DistributedOptimizer` and
`DistributedDataParallel`, `ZeroOptimizer`, `LocalSGD`, `Pipeline`; fully_shard units and
tensor-parallel layers through the pieces of `parallel/layout/pieces.py` that the module owner
walks) registers its owner class for its own class in its own module, with `register`, as
`parallel/layout/splits.py` registers split tensors. A consumer (checkpoints, clip, no_sync,
join, elastic state, broadcast_parameters and check_replicas, the memory estimator, the
wrappers' own constructors) calls `owner_of(obj)` and never names a wrapper class: FSDP2's
`fully_shard.state(module)` and DCP's one `get_state_dict` are the models. What an object
nobody registered gets: `ModuleOwner` for an `nn.Module` (whole tensors and the split modules
inside it), `OptimizerOwner` for a torch optimizer (per-element state follows its parameters'
pieces, the one rule of `pieces.per_element`), `Owner` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from tandem.parallel.layout import splits
from tandem.parallel.layout.pieces import Held, Placement, whole

Params = list[tuple[torch.Tensor, tuple[Placement, ...]]]

_REGISTRY: dict[type, Callable[[Any], Owner]] = {}


def register(cls: type, make: Callable[[Any], Owner]) -> None:
    """Instances of `cls` (and of its subclasses) are answered by `make(instance)`."""
    _REGISTRY[cls] = make


def owner_of(obj: Any) -> Owner:
    """The owner that answers for `obj`: the one registered for its class (the nearest in its
    MRO), else the default for a module, a torch optimizer, or anything else."""
    for cls in type(obj).__mro__:
        make = _REGISTRY.get(cls)
        if make is not None:
            return make(obj)
    if isinstance(obj, nn.Module):
        return ModuleOwner(obj)
    if isinstance(obj, torch.optim.Optimizer):
        return OptimizerOwner(obj)
    return Owner(obj)


class Owner:
    """The questions every split answers, with the answers of an object that splits nothing:
    every rank holds all of it, nothing to switch, nothing to do on a change of world.

    Subclasses override what their split changes. `obj` is the object asked about."""

    #: "model", "optimizer" or None (neither: refused where one is needed)
    role: str | None = None
    #: the split's name in messages and `split_kinds` ("pipeline", "ZeroOptimizer", ...)
    kind: str = "replicated"

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    # -- for messages ----------------------------------------------------------------------
    def describe(self) -> str:
        return type(self.obj).__name__

    @property
    def group(self) -> Any:
        """The group the split is over (None: the world)."""
        return getattr(self.obj, "group", None)

    # -- what each rank holds --------------------------------------------------------------
    def module(self) -> nn.Module | None:
        """The module this rank holds (a pipeline's stage), None when `obj` is no model."""
        return None

    def prefix(self) -> str:
        """The one-process names of `module()`'s entries start with this."""
        return ""

    def held(self) -> list[Held]:
        """Every local tensor of the model with the one-process pieces it holds."""
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {self.describe()}")

    def split_kinds(self) -> set[str]:
        """How the model is split, as names (empty: whole on every rank)."""
        return set()

    def not_replicated(self, group: Any) -> dict[int, str]:
        """The local tensors of the model (by id) that the ranks of `group` hold different parts
        of, with the split's kind: `td.broadcast_parameters` and `td.check_replicas` leave them
        alone (or refuse) instead of copying or comparing pieces as replicas."""
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {self.describe()}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The one-process model's state dict, on every rank (copies; a collective where the
        model is split)."""
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {self.describe()}")

    def load_own_state(self, state: dict[str, torch.Tensor]) -> bool:
        """Load this rank's part of the one-process state dict `state` when the split needs
        its own way (a pipeline's stage); False: `module()` loads it as a module does."""
        return False

    # -- optimizer state -------------------------------------------------------------------
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer that keeps the state (under every wrapper), None: not one."""
        return None

    def state_placements(self, placements: dict[int, tuple[Placement, ...]]) -> Params:
        """Each tensor `optimizer()` steps, in order, with the one-process pieces it holds,
        given the model's (by id of the local tensor): per-element state follows them."""
        inner = self.optimizer()
        if inner is None:
            raise TypeError(f"expected a torch optimizer or one of tandem's wrappers, got "
                            f"{self.describe()}")
        out = []
        for i, p in enumerate(q for g in inner.param_groups for q in g["params"]):
            if id(p) not in placements:
                raise ValueError(
                    f"optimizer parameter {i} {tuple(p.shape)} is not a parameter of the "
                    f"model(s) saved with it: pass the model the optimizer steps (after "
                    f"td.fully_shard or td.parallelize, build the optimizer over "
                    f"model.parameters() again)")
            out.append((p, placements[id(p)]))
        return out

    def checkpoint_refusal(self) -> str | None:
        """Why a checkpoint of one copy per tensor cannot hold this (None: it can)."""
        return None

    # -- gradient sync, clipping, step accounting ------------------------------------------
    def set_gradient_sync(self, on: bool) -> bool:
        """Switch the reduction of gradients in backward; False when this reduces none."""
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        """Clip by the global norm when this owner must do it itself (gradients it alone
        knows how to average); None: the per-tensor rule of `td.clip_grad_norm_` does."""
        return None

    def accounts_steps(self) -> bool:
        """Whether `obj` records its steps itself (`tandem scale`, MetricLogger timing)."""
        return False

    # -- joining uneven ranks (td.join) ----------------------------------------------------
    #: whether `td.join` can stand in for this split's collectives on a rank out of data
    answers_join = False

    def reducer(self) -> Any:
        """The data-parallel reducer whose reductions `td.join` answers (None: none here)."""
        return None

    def copy_from(self, root: int, group: Any) -> None:
        """Take rank `root`'s parameters and optimizer state (`td.join(sync_state=True)`)."""

    # -- a change of world (td.elastic) ----------------------------------------------------
    def leave(self) -> None:
        """This world is over: drop every operation in flight on it."""

    def rejoin(self) -> None:
        """A new world: reduce over it, cut shards for its size."""

    def sharded_over_world(self) -> bool:
        """Whether each rank holds only its part of this state, cut again at each change."""
        return False


class ModuleOwner(Owner):
    """An `nn.Module`: whole tensors, plus the split modules inside it (fully_shard units,
    tensor-parallel layers), each answering through the pieces protocol."""

    role = "model"

    def module(self) -> nn.Module:
        return self.obj

    def held(self) -> list[Held]:
        return module_held(self.module(), self.prefix())

    def split_kinds(self) -> set[str]:
        return module_split_kinds(self.module())

    def not_replicated(self, group: Any) -> dict[int, str]:
        # the local tensors themselves, not `held()`: a DTensor-sharded model refuses to say
        # its pieces, yet its shards must still be left alone
        out = {}
        for tensor in local_state(self.module()).values():
            kind = split_across(tensor, group)
            if kind is not None:
                out[id(tensor)] = kind
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.module().state_dict().items()}

    def set_gradient_sync(self, on: bool) -> bool:
        module = self.module()
        switched = False
        for split in _MODULE_SPLITS:  # fully_shard's units: FSDP2's set_requires_gradient_sync
            for m in module.modules():
                switched = split.set_sync(m, bool(on)) or switched
        reducers: dict[int, Any] = {}
        for param in module.parameters():
            reducer = splits.reducer_of(param)
            if reducer is not None and not reducer.closed:
                reducers[id(reducer)] = reducer
        for reducer in reducers.values():
            reducer.set_sync(bool(on))
        return bool(switched or reducers)


class OptimizerOwner(Owner):
    """A plain torch optimizer: its state follows its parameters' pieces."""

    role = "optimizer"

    def optimizer(self) -> torch.optim.Optimizer:
        return self.obj

    def copy_from(self, root: int, group: Any) -> None:
        from tandem.parallel.optimizer_broadcast import broadcast_optimizer_state

        broadcast_optimizer_state(self.obj, root=root, group=group)


class WrapperOwner(OptimizerOwner):
    """One of tandem's optimizer wrappers that keeps a torch optimizer as `.optimizer`."""

    kind = "wrapper"

    def optimizer(self) -> torch.optim.Optimizer | None:
        return owner_of(self.obj.optimizer).optimizer()

    def describe(self) -> str:
        inner = self.optimizer()
        over = "" if inner is None else f"({type(inner).__name__})"
        return f"td.{type(self.obj).__name__}{over}"

    def accounts_steps(self) -> bool:
        return True

    def leave(self) -> None:
        owner_of(self.obj.optimizer).leave()

    def rejoin(self) -> None:
        owner_of(self.obj.optimizer).rejoin()


# -- what a module holds: whole tensors and the split modules inside it ---------------------------


class ModuleSplit(NamedTuple):
    """A way of splitting modules in place (fully_shard's units), registered by its own module
    with `register_module_split`; tensor-parallel layers need none (they are their own pieces)."""

    kind: str
    #: the pieces object (`local_pieces`, `full_tensors`) for what `module` itself splits, or None
    find: Callable[[nn.Module], Any]
    #: whether `module` takes part in this split at all (a root unit that holds no shard does)
    marks: Callable[[nn.Module], bool]
    #: switch `module`'s gradient reduction in backward; False when it reduces none
    set_sync: Callable[[nn.Module, bool], bool]
    #: names of local tensors that are no one-process tensor of their own (a unit's flat shard)
    hidden: frozenset[str]


_MODULE_SPLITS: list[ModuleSplit] = []


def register_module_split(split: ModuleSplit) -> None:
    _MODULE_SPLITS.append(split)


def split_of_module(module: nn.Module) -> Any:
    """The object that implements the layout protocol (`local_pieces`, `full_tensors`) for what
    `module` itself splits: its fully_shard unit's pieces, or the module (a tensor-parallel
    layer)."""
    for split in _MODULE_SPLITS:
        found = split.find(module)
        if found is not None:
            return found
    if hasattr(module, "local_pieces") and hasattr(module, "full_tensors"):
        return module
    return None


def own_held(module: nn.Module, prefix: str) -> list[Held]:
    """The local tensors that `module` itself splits, under one-process names after `prefix`."""
    split = split_of_module(module)
    return [] if split is None else split.local_pieces(prefix)


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `model.state_dict(keep_vars=True)` holds before tandem's hooks make it the
    one-process state dict: the parameters and persistent buffers this rank keeps."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, param in module._parameters.items():
            if param is not None:
                out[prefix + key] = param
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                out[prefix + key] = buffer
    return out


def module_held(model: nn.Module, base: str) -> list[Held]:
    """`model`'s local tensors, under one-process names after `base`."""
    hidden = frozenset().union(*(split.hidden for split in _MODULE_SPLITS))
    out: list[Held] = []
    special: set[int] = set()
    for name, module in model.named_modules():
        pieces = own_held(module, f"{base}{name}." if name else base)
        out.extend(pieces)
        special.update(id(h.tensor) for h in pieces)
    for key, tensor in local_state(model).items():
        if id(tensor) in special or key.split(".")[-1] in hidden:
            continue
        out.append(Held(tensor, (whole(base + key, tensor),)))
    return out


def module_split_kinds(model: nn.Module) -> set[str]:
    """'fully_shard', 'tensor parallel' and 'branch' (td.tensor.Branches: each branch whole on
    one rank), for the split modules inside `model`."""
    kinds = set()
    for module in model.modules():
        marked = [split.kind for split in _MODULE_SPLITS if split.marks(module)]
        if marked:
            kinds.update(marked)
        elif split_of_module(module) is not None:  # its tensors say how (the splits registry)
            found = {splits.kind_of(p) for p in module.parameters()} & splits.NOT_REPLICAS
            kinds.update(found or {splits.TENSOR_PARALLEL})
    return kinds


def split_across(tensor: torch.Tensor, group: Any) -> str | None:
    """How the ranks of `group` hold different parts of `tensor` (None: each that holds it
    holds the same tensor, a replica): a fully_shard shard always; a tensor-parallel slice (or
    a `td.tensor.Branches` branch: whole, but other ranks hold other branches under its local
    name) when `group` reaches ranks that hold other slices (branches) of it."""
    kind = splits.kind_of(tensor)
    if kind == splits.FULLY_SHARD or splits.mixes_slices(tensor, group):
        return kind
    return None
