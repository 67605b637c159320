"""One pipeline step on one stage: run the stage's action list, keep the counters.

The executor does exactly what `schedules` lists, in order. Receives are posted when listed and
waited for by the compute that needs them; sends go out asynchronously (the stage computes while
they travel) and are waited for at the end of the step. It knows its stage only through the
`StageSetup` the `Pipeline` hands it, and the per-signature shape caches passed with each step. With
`TANDEM_TIMELINE` set, every forward (`F3`), backward (`B3`) and wait for a neighbour
(`wait 3`) is drawn on the rank's compute track.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from tandem.diagnostics import timeline
from tandem.parallel.layout.splits import reducer_of
from tandem.parallel.pipeline.edges import (
    SPEC_WORDS,
    EdgeSpec,
    Link,
    act_tag,
    grad_tag,
    spec_tag,
)
from tandem.parallel.pipeline.schedules import Action, ActionKind


@dataclass(frozen=True)
class StageSetup:
    """What the executor needs of its stage, fixed when the `Pipeline` is built."""

    module: nn.Module
    index: int
    ranks: tuple[int, ...]
    device: torch.device
    link: Link
    #: The stage starts with an in-place op: it gets copies of the received tensors.
    copy_inputs: bool

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.ranks) - 1


@dataclass
class PipelineStats:
    """Counters of the last step on this stage.

    `peak_live_microbatches`: most micro-batches forwarded and not yet backwarded at once (1F1B:
    at most stages - stage_index; GPipe: chunks). `peak_activation_bytes`: the most bytes that
    autograd held saved for backward at once, over those micro-batches (parameters excluded,
    storages counted once). `compute_s`: time in forward/backward; `wait_s`: time blocked on
    receives (this stage's share of the bubble); `step_s`: the whole step.

    Made by `td.Pipeline` (its `stats`, filled at each step), not by users.

    Args:
        peak_live_microbatches: as above.
        peak_activation_bytes: as above.
        compute_s: as above.
        wait_s: as above.
        step_s: as above.
    """

    peak_live_microbatches: int = 0
    peak_activation_bytes: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    step_s: float = 0.0

    @property
    def idle_fraction(self) -> float:
        """The share of the step not spent computing: the measured bubble on this stage."""
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


class _Micro:
    """What a stage holds for one micro-batch between its forward and its backward."""

    __slots__ = ("spec", "act", "inputs", "outputs", "loss", "grads", "in_grads", "nbytes")

    def __init__(self) -> None:
        self.spec = self.act = self.inputs = self.outputs = None
        self.loss = self.grads = self.in_grads = None
        self.nbytes = 0


class StepRunner:
    """Runs one step's actions for `stage`. Built per step; `result()` at the end.

    `specs_in` / `specs_out`: the cached edge specs of this step's shape signature, one slot per
    micro-batch (None until learned); a fresh signature's are filled in here.
    """

    def __init__(self, stage: StageSetup, specs_in: list, specs_out: list, fresh: bool,
                 train: bool, micro_x, targets, loss_fn, weights: list[float]) -> None:
        self.stage, self.link, self.train, self.fresh = stage, stage.link, train, fresh
        s, ranks = stage.index, stage.ranks
        self.prev = ranks[s - 1] if s > 0 else None
        self.next = ranks[s + 1] if s < len(ranks) - 1 else None
        self.specs_in, self.specs_out = specs_in, specs_out
        self.micro_x, self.targets, self.loss_fn, self.weights = micro_x, targets, loss_fn, weights
        self.mb = [_Micro() for _ in weights]
        self.stats = PipelineStats()
        self.live = self.live_bytes = 0
        self.loss_total: torch.Tensor | None = None
        self.outputs: list = []
        self.param_ptrs = {p.data_ptr() for p in stage.module.parameters()}
        # Data × pipeline: a DistributedOptimizer (or DDP) over this stage reduces once per step,
        # after the last micro-batch's backward; the earlier ones run as inside its no_sync(),
        # adding up in .grad, so users need no `accumulate=chunks` (which still works).
        self.reducers = _reducers_of(stage.module) if train else []
        self.backwards_left = len(weights)
        self._handlers = {
            ActionKind.RECV_ACT: self.recv_act,
            ActionKind.F: self.forward,
            ActionKind.SEND_ACT: self.send_act,
            ActionKind.RECV_GRAD: self.recv_grad,
            ActionKind.B: self.backward,
            ActionKind.SEND_GRAD: self.send_grad,
        }

    def run(self, actions: list[Action]) -> None:
        for action in actions:
            self._handlers[action.kind](action.microbatch)

    def result(self):
        if not self.stage.is_last:
            return None
        return self.loss_total if self.train else _concat(self.outputs)

    # -- waiting, with the time counted as bubble ----------------------------------------
    def _wait(self, pending: list, i: int) -> list[torch.Tensor]:
        start = time.perf_counter_ns()
        tensors = [p.wait() for p in pending]
        end = time.perf_counter_ns()
        self.stats.wait_s += (end - start) * 1e-9
        if timeline.ENABLED:
            timeline.complete(f"wait {i}", start, end)
        return tensors

    def _computed(self, name: str, start: int) -> None:
        end = time.perf_counter_ns()
        self.stats.compute_s += (end - start) * 1e-9
        if timeline.ENABLED:
            timeline.complete(name, start, end)

    # -- activations forward ------------------------------------------------------------
    def recv_act(self, i: int) -> None:
        mb = self.mb[i]
        if self.fresh:  # shapes not known yet: the sender describes the edge first
            mb.spec = self.link.recv((SPEC_WORDS,), torch.int64, self.stage.device, self.prev,
                                     spec_tag(i), f"the shapes of micro-batch {i}")
        else:
            mb.act = self._post_act(i, self.specs_in[i])

    def _post_act(self, i: int, spec: EdgeSpec) -> list:
        return [
            self.link.recv(shape, dtype, self.stage.device, self.prev, act_tag(i, k),
                           f"activation {k} of micro-batch {i}")
            for k, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True))
        ]

    def forward(self, i: int) -> None:
        mb, stage = self.mb[i], self.stage
        if stage.is_first:
            value = self.micro_x[i]
        else:
            if self.fresh:
                spec = self.specs_in[i] = EdgeSpec.unpack(self._wait([mb.spec], i)[0].cpu())
                mb.act = self._post_act(i, spec)
            spec = self.specs_in[i]
            tensors = self._wait(mb.act, i)
            mb.act = None
            feed = tensors
            if self.train:
                for k in spec.floating:
                    tensors[k].requires_grad_(True)
                mb.inputs = tensors
                if stage.copy_inputs:
                    feed = [t.clone() if t.requires_grad else t for t in tensors]
            value = spec.build(feed)
        start = time.perf_counter_ns()
        if self.train:
            with torch.autograd.graph.saved_tensors_hooks(self._counter(mb), _identity):
                output = stage.module(value)
                if stage.is_last:
                    mb.loss = self._loss(output, i)
        else:
            output = stage.module(value)
        if stage.is_last:
            if not self.train:
                self.outputs.append(output)
        else:
            spec, mb.outputs = EdgeSpec.describe(output, stage.index)
            known = self.specs_out[i]
            if known is None:
                self.specs_out[i] = spec
            elif spec != known:
                raise ValueError(
                    f"pipeline stage {stage.index} output for micro-batch {i} is {spec} but "
                    f"was {known} for the same input shapes: edges between stages need shapes "
                    f"that depend only on the input's shape"
                )
        self._computed(f"F{i}", start)
        if self.train:
            self.live += 1
            self.live_bytes += mb.nbytes
            self.stats.peak_live_microbatches = max(self.stats.peak_live_microbatches, self.live)
            self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self.live_bytes)

    def _loss(self, output, i: int) -> torch.Tensor:
        loss = self.loss_fn(output, self.targets[i])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return a scalar tensor (the mean loss of its micro-batch), got "
                f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
            )
        scaled = loss.reshape(()) * self.weights[i]
        detached = scaled.detach()
        self.loss_total = detached if self.loss_total is None else self.loss_total + detached
        return scaled

    def send_act(self, i: int) -> None:
        mb = self.mb[i]
        if self.fresh:
            packed = self.specs_out[i].pack().to(self.stage.device)
            self.link.send(packed, self.next, spec_tag(i), f"the shapes of micro-batch {i}")
        for k, tensor in enumerate(mb.outputs):
            self.link.send(tensor, self.next, act_tag(i, k), f"activation {k} of micro-batch {i}")
        if not self.train:
            mb.outputs = None

    # -- gradients backward ---------------------------------------------------------------
    def recv_grad(self, i: int) -> None:
        spec = self.specs_out[i]
        self.mb[i].grads = [
            self.link.recv(spec.shapes[k], spec.dtypes[k], self.stage.device, self.next,
                           grad_tag(i, k), f"gradient {k} of micro-batch {i}")
            for k in spec.floating
        ]

    def backward(self, i: int) -> None:
        mb, stage = self.mb[i], self.stage
        grads = None if stage.is_last else self._wait(mb.grads, i)
        start = time.perf_counter_ns()
        self.backwards_left -= 1
        held = [r for r in self.reducers if r.sync_enabled] if self.backwards_left else []
        for reducer in held:
            reducer.set_sync(False)
        try:
            self._backward(mb, grads, i)
        finally:
            for reducer in held:
                reducer.set_sync(True)
        if not stage.is_first:
            # An input the stage did not use has no gradient: send zeros, the receiver waits for it.
            mb.in_grads = [
                mb.inputs[k].grad if mb.inputs[k].grad is not None else torch.zeros_like(mb.inputs[k])
                for k in self.specs_in[i].floating
            ]
        self._computed(f"B{i}", start)
        mb.inputs = mb.outputs = mb.loss = mb.grads = None  # the micro-batch's graph is freed
        self.live -= 1
        self.live_bytes -= mb.nbytes

    def _backward(self, mb: _Micro, grads, i: int) -> None:
        if self.stage.is_last:
            if mb.loss.requires_grad:
                mb.loss.backward()
            return
        pairs = [
            (mb.outputs[k], g)
            for k, g in zip(self.specs_out[i].floating, grads, strict=True)
            if mb.outputs[k].requires_grad
        ]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def send_grad(self, i: int) -> None:
        mb = self.mb[i]
        for k, grad in zip(self.specs_in[i].floating, mb.in_grads, strict=True):
            self.link.send(grad, self.prev, grad_tag(i, k), f"gradient {k} of micro-batch {i}")
        mb.in_grads = None

    # -- memory accounting ----------------------------------------------------------------
    def _counter(self, mb: _Micro):
        """A saved-tensor pack hook that adds each new saved activation's bytes to `mb`.

        A tensor saved by several ops counts once; parameters (and views of them, such as the
        transposed weight a Linear saves) do not count. A view counts its own size, not its
        storage's: a micro-batch sliced from the batch is not charged the whole batch.
        """
        seen: set[tuple[int, int]] = set()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            try:
                key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            except RuntimeError:  # no plain storage (sparse, nested): not counted
                return tensor
            if key not in seen and key[0] not in self.param_ptrs:
                seen.add(key)
                mb.nbytes += key[1]
            return tensor

        return pack


def _identity(tensor):
    return tensor


def _concat(outputs: list):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
        return type(first)(torch.cat([o[k] for o in outputs]) for k in range(len(first)))
    return outputs


def _reducers_of(stage: torch.nn.Module) -> list:
    """The live gradient reducers over `stage`'s parameters that reduce every backward pass."""
    found = []
    for param in stage.parameters():
        reducer = reducer_of(param)
        if reducer is not None and not reducer.closed and reducer.accumulate == 1:
            if reducer not in found:
                found.append(reducer)
    return found
