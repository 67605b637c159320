"""One agreement per operation of a split model: ranks whose code paths diverged are named.

fully_shard's gathers and reduce-scatters, a pipeline's messages and the collectives of
tensor-parallel layers go to the engine without an argument check of their own, and MPI and
Gloo match collectives by their order alone: a rank that skips a backward (`if
torch.isnan(loss): continue` on that rank alone) would have its next forward's all-gather
matched with the others' reduce-scatter (garbage, a crash in the engine, or a hang). So, as the
gradient reducer opens each round (`step_check`), each forward, backward, pipeline step and
state-dict call of a split model opens with the same fixed-size agreement message
(`tandem.comm.agreement.agree`), before its first collective. One all-reduce of a few hundred
bytes per operation; none on NCCL, where it would be a host synchronisation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement.agree import DivergedError
from tandem.comm.groups import Group, group_ranks, group_size
from tandem.parallel.data_parallel import compile_split
from tandem.parallel.data_parallel.step_check import user_site

_MODEL_KIND = agreement.checksum("split model operation")
_DETAIL = 5  # the code of what must match within an operation (an input's shapes)
#: The calls every rank must make together, whatever it then does with the result, and the fix.
CALLS = {
    "state_dict": "model.state_dict() (td.fsdp.full_state_dict(model) too) gathers the model from "
                  "every rank: every rank calls it, then rank 0 alone saves (`state = "
                  "model.state_dict()` on every rank, `if td.rank() == 0: torch.save(state, path)`).",
    "full_optimizer_state_dict": "td.fsdp.full_optimizer_state_dict gathers the optimizer's state "
                                 "from every rank: every rank calls it, then rank 0 alone saves.",
}


class ModelCheck:
    """One agreement per operation of a split model: fully_shard's root, a model converted by
    `td.parallelize`, `td.tensor.Branches`, a `td.Pipeline`.

    Their collectives (fully_shard's gathers and reduce-scatters, the pipeline's messages) are
    not checked one by one; each forward, backward, pipeline step and state-dict call opens
    with the fixed-size agreement instead, before its first collective:

        (split model, its layout, the operation, how many of it this rank made before,
         optimizer steps over the model's parameters, a detail that must match)

    A rank that skipped a backward (`if torch.isnan(loss): continue` on that rank alone), an
    optimizer step or a forward, or that calls `model.state_dict()` alone, meets the others in
    another operation or at another count: every rank raises one `DivergedError` naming each
    rank's operation, before any data is sent. Not made (`make` gives None) on a group of one
    rank, with checks off, or where the backend takes no CPU tensor (NCCL: a host
    synchronisation per step that the bare model does not make).
    """

    def __init__(self, wrapper: str, owner: str, layout: int, group: Group | None,
                 params: Sequence[torch.Tensor], advice: str | None = None) -> None:
        self.wrapper, self.owner, self._layout, self._group = wrapper, owner, layout, group
        self._advice = advice  # the fix for a rank that skipped (default: agreement.SKIP_ADVICE)
        self.counts: dict[str, int] = {}  # operation -> how many this rank has agreed on
        self.steps = 0  # optimizer steps over `params` (see `_count_step`)
        self._posted: tuple[str, agreement.Posted] | None = None
        self._backward_due = False
        self.param_ids = frozenset(id(p) for p in params)
        _track(self)

    @staticmethod
    def make(wrapper: str, owner: str, lines: Sequence[str], group: Group | None,
             params: Iterable[torch.Tensor] = (), advice: str | None = None) -> ModelCheck | None:
        state = runtime.state()
        cpu = state.backend.supports_device(torch.device("cpu"))
        if group_size(group) == 1 or not state.checks or not cpu:
            return None
        return ModelCheck(wrapper, owner, agreement.checksum(list(lines)), group, list(params),
                          advice)

    def _codes(self, operation: str, detail: str | None) -> list[int]:
        return [_MODEL_KIND, self._layout, agreement.checksum(operation), self.counts.get(operation, 0),
                self.steps, 0 if detail is None else agreement.checksum(detail)]

    def post(self, operation: str) -> None:
        """Send `operation`'s agreement now, to travel while this rank computes; `agree`
        finishes it, before the operation's first collective."""
        if self._posted is None and runtime.state().checks:
            self._posted = (operation, agreement.post(self._codes(operation, None), self._group,
                                                      runtime.state()))

    def agree(self, operation: str, detail: str | None = None,
              explain_detail: Callable[[tuple[int, ...], list], str] | None = None) -> None:
        """Every rank of the group must be in this same operation, at the same count, after as
        many optimizer steps (and with the same `detail`, else `explain_detail` says why)."""
        engine = runtime.state()
        posted = None
        if self._posted is not None:  # sent: finished whatever happened since (checks turned off)
            (was, posted), self._posted = self._posted, None
            if was != operation:  # posted, then another operation came first: finish it as sent
                self._agree(was, None, None, posted, engine)
                posted = None
        if engine.checks or posted is not None:
            self._agree(operation, detail, explain_detail, posted, engine)

    def _agree(self, operation, detail, explain_detail, posted, engine) -> None:
        number, steps = self.counts.get(operation, 0) + 1, self.steps
        site = user_site() if engine.debug else None

        def mine() -> str:
            call = operation in CALLS
            text = (f"{operation} #{number} of {self.owner}" if call
                    else f"{self.wrapper} {operation} #{number} of {self.owner}")
            notes = [self.wrapper] if call else []
            notes += [f"after {steps} optimizer steps"] if steps else []
            text += f" ({', '.join(notes)})" if notes else ""
            text += f" at {site}" if site else ""
            if call:
                return agreement.Described(text, CALLS[operation])
            return agreement.Described(text, self._advice) if self._advice else text

        codes = None if posted is not None else self._codes(operation, detail)
        try:
            differ = agreement.agree(mine, self._group, error=DivergedError, explain=_explain_model,
                                     codes=codes, tolerated=(_DETAIL,), engine=engine, posted=posted)
        except TimeoutError as error:  # the watchdog's report: who arrived, every rank's stack
            raise type(error)(
                f"{mine()}: rank {engine.world.rank} waited {engine.timeout:g} s (the timeout) for "
                f"the ranks {list(group_ranks(self._group))} to start it too; one did not (it "
                f"failed, stopped, or skipped this call)\n{error}") from None
        self.counts[operation] = number
        if differ:  # the same operation, with what must match differing (an input's shapes)
            details = agreement.everyone(detail, self._group, engine)
            ranks = group_ranks(self._group)
            raise agreement.CollectiveMismatchError(
                explain_detail(ranks, details) if explain_detail else
                f"{self.wrapper} {operation} of {self.owner}: " + "; ".join(
                    f"rank {r}: {d}" for r, d in zip(ranks, details, strict=True)))

    # -- backward: posted at its first gradient, finished before its first collective --------
    def expect_backward(self) -> None:
        """A training forward ended: its backward opens with an agreement."""
        self._backward_due = True

    def backward_starts(self) -> None:
        """The first gradient of the model's output arrived: send the backward's agreement."""
        if self._backward_due:
            self.post("backward")

    def before_backward_collective(self) -> None:
        """About to communicate in backward: finish the backward's agreement (once)."""
        if self._backward_due:
            self._backward_due = False
            self.agree("backward")

    def open_backward(self) -> None:
        """Send and finish the backward's agreement at once (layers whose collectives are
        issued where this check cannot see them)."""
        self.backward_starts()
        self.before_backward_collective()

    def forward_starts(self, detail: str | None = None, explain_detail=None) -> None:
        """A forward: agreed. A training forward also replaces a backward still due (one never
        run); an evaluation forward (no gradients) leaves it due."""
        if torch.is_grad_enabled():
            self._backward_due = False
        self.agree("forward", detail, explain_detail)


def _explain_model(ranks, calls) -> str:
    lines = "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
    return ("the ranks are in different operations of a split model, or at different steps of "
            f"it (nothing was sent):\n{lines}\n{agreement.advice_of(calls)}")


# -- which model a call is about --------------------------------------------------------------

_of_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Module -> ModelCheck
_hooked: weakref.WeakSet = weakref.WeakSet()  # modules whose state_dict() opens with the check


def register(module: torch.nn.Module, check: ModelCheck | None) -> None:
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


def check_of(model: torch.nn.Module) -> ModelCheck | None:
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
    check = ModelCheck.make(wrapper, type(module).__name__, lines, group, module.parameters())
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


def expect_backward_of(check: ModelCheck, output: Any, opens: Callable[[], None] | None = None) -> None:
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


# -- optimizer steps over a checked model ----------------------------------------------------

_checks: weakref.WeakSet = weakref.WeakSet()
_generation = 0  # bumped with every new check: the optimizers' caches are then stale
_per_optimizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook = None


def _track(check: ModelCheck) -> None:
    global _generation, _hook
    _checks.add(check)
    _generation += 1
    if _hook is None:  # one hook for the process; a dictionary look-up per optimizer step
        _hook = register_optimizer_step_post_hook(_count_step)


def _count_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """After any optimizer's step: count it for the checks whose parameters it steps."""
    size = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _per_optimizer.get(optimizer)
    if cached is None or cached[0] != _generation or cached[1] != size:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        cached = (_generation, size, [weakref.ref(c) for c in _checks if c.param_ids & ids])
        _per_optimizer[optimizer] = cached
    for ref in cached[2]:
        check = ref()
        if check is not None:
            check.steps += 1
