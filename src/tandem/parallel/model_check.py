"""Which split model a call is about: the per-operation check (`parallel/operation_check.py`)
of each split module, and the hooks that open its forwards, backwards and `state_dict()` calls.

fully_shard's gathers and reduce-scatters, a pipeline's messages and the collectives of
tensor-parallel layers go to the engine without an argument check of their own; each forward,
backward, pipeline step and state-dict call of a split model opens with its check's agreement
instead, before its first collective (`OperationCheck`: the same class and message as the
gradient reducer's per-round check). Registered per module (weak references), so a module
still pickles and copies; `watch` adds the hooks for models whose layers communicate on their
own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tandem.comm.groups import Group
from tandem.parallel.data_parallel import compile_split
from tandem.parallel.operation_check import OperationCheck

# -- which model a call is about --------------------------------------------------------------

_of_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Module -> OperationCheck
_hooked: weakref.WeakSet = weakref.WeakSet()  # modules whose state_dict() opens with the check


def register(module: torch.nn.Module, check: OperationCheck | None) -> None:
    """`module`'s check, found by `agree_call`, which also opens its `state_dict()` (a
    collective for a split model: its hooks gather the pieces; None: it has none any more)."""
    if check is None:
        _of_module.pop(module, None)
        return
    _of_module[module] = check
    if module not in _hooked:
        _hooked.add(module)
        module.register_state_dict_pre_hook(_before_state_dict)


def _before_state_dict(module: torch.nn.Module, _prefix: str, _keep_vars: bool) -> None:
    check = _of_module.get(module)
    if check is not None:
        check.agree("state_dict")


def check_of(model: torch.nn.Module) -> OperationCheck | None:
    """The check of `model`, or of its outermost module that has one."""
    for module in model.modules():
        check = _of_module.get(module)
        if check is not None:
            return check
    return None


def agree_call(model: torch.nn.Module, operation: str) -> None:
    """Open a call every rank makes (`full_optimizer_state_dict`) with the model's agreement."""
    check = check_of(model)
    if check is not None:
        check.agree(operation)


def watch(module: torch.nn.Module, wrapper: str, lines: Sequence[str], group: Group | None,
          explain_inputs: Callable[[tuple[int, ...], list], str] | None = None) -> None:
    """Open every forward of `module` with an agreement (carrying its inputs' shapes, which
    must match when `explain_inputs` is given) and its backward with another, at the first
    gradient of its output. Hooks, for models whose layers communicate on their own."""
    if module in _of_module:
        return
    check = OperationCheck.make(wrapper, type(module).__name__, lines, group, module.parameters())
    if check is None:
        return
    register(module, check)
    hooks = _Hooks(explain_inputs)
    module.register_forward_pre_hook(hooks.before, with_kwargs=True)
    module.register_forward_hook(hooks.after)
    compile_split.hooks_outside_graph(module)


class _Hooks:
    """A watched module's hooks. They find its check in the registry, so that the module still
    pickles and copies (a copy is not watched)."""

    def __init__(self, explain_inputs: Callable[[tuple[int, ...], list], str] | None) -> None:
        self.explain_inputs = explain_inputs

    # Eager under torch.compile (a graph break each): the agreement communicates, and its
    # per-step counters would become dynamo guards that change every step.
    @torch.compiler.disable
    def before(self, module: torch.nn.Module, args, kwargs) -> None:
        check = _of_module.get(module)
        if check is None:
            return
        shapes = None
        if self.explain_inputs is not None:
            shapes = str([tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)])
        check.forward_starts(shapes, self.explain_inputs)

    @torch.compiler.disable
    def after(self, module: torch.nn.Module, _args, output) -> None:
        check = _of_module.get(module)
        if check is not None:
            expect_backward_of(check, output)


def expect_backward_of(check: OperationCheck, output: Any, opens: Callable[[], None] | None = None) -> None:
    """When gradients are on, the first gradient of `output` opens the backward's agreement
    (`opens`: by default it is sent and finished at once)."""
    if not torch.is_grad_enabled():
        return
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return
    check.expect_backward()
    opens = opens or check.open_backward

    def hook(_grad: torch.Tensor) -> None:
        opens()

    for tensor in tensors:
        tensor.register_hook(hook)
