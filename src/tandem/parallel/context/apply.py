"""`parallelize(model, group, style)`: a model's attention made sequence-parallel, unchanged.

While the model's forward runs, a torch function mode catches its calls to
`F.scaled_dot_product_attention` (however the model reached it: `F.` or imported by name) and
runs them over the context-parallel group in the chosen form; `nn.MultiheadAttention`'s call
inside `F.multi_head_attention_forward`, which the mode sees as one call, runs through a copy
of that function whose attention goes to the split (`mha`; nothing in torch is renamed). Every
other operation runs as written, on this rank's part of the sequence. An
`nn.MultiheadAttention` computes its weights by hand unless called with `need_weights=False`:
its calls default to that (no weights over the whole sequence exist on any rank); asking for
the weights is refused.

Under `torch.compile` the same mode is on dynamo's stack while it traces (the model's hooks
open it outside the graph), so dynamo traces the catch with the model and finds every
attention call; `attend` then puts the split's custom operators in the graph (`ops`), which
communicate when the graph runs. The model's other hooks only keep the name of the module
running (traced, no graph break): the root's open and close the mode, one break each, where
the per-forward agreement breaks already. A region that `torch.utils.checkpoint` recomputes
(`td.checkpoint_wrapper`'s blocks) runs outside the graph, eagerly: dynamo traces its body
without the mode, where attention would be torch's on this rank's part alone.

Each forward and each backward of the model opens with one agreement over the group
(`parallel/model_check.py`: a rank that skipped a forward or a backward, or was given a batch
of another shape, is named); inside, each attention call's messages carry its number and
arguments (`wire`), so a rank that skipped one call is named too, compiled or not. No
per-call agreement.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from tandem.comm.agreement import agree as agreement
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_ranks, group_size
from tandem.parallel import activation_checkpoint, model_check
from tandem.parallel.context import layout, mha, ops, ring, ulysses, wire

STYLES = ("ring", "alltoall")
_SDPA = F.scaled_dot_product_attention
_CHECKPOINT = torch.utils.checkpoint.checkpoint


class ContextParallelError(ValueError):
    """An attention call or a model the sequence split cannot take (named, with the fix)."""


class _Split:
    """A converted model's split: its group, its form and the count of attention calls."""

    def __init__(self, model: nn.Module, group: Group | None, style: str) -> None:
        self.group, self.style, self.owner = group, style, type(model).__name__
        self.sp = group_size(group)
        self.calls = 0  # attention calls in this forward (counted as they run, compiled too)
        self.catch = _Catch(self)
        self.mode: _Catch | None = None  # the catch, while open
        self.opener: nn.Module | None = None  # the module whose forward opened `mode`
        self.path: list[str] = []  # the names of the model's modules whose forward runs
        self.check = model_check.check_of(model)
        # a module's code in the messages -> its name (the same on every rank: one model)
        self.names = {agreement.checksum(n or self.owner): n or self.owner
                      for n, _ in model.named_modules()}
        self.key = ops.remember(self)

    def _where(self) -> str:
        return (f"attention call #{self.calls + 1} of {self.owner} (context parallelism, "
                f"{self.style})")

    def header(self, shape: tuple[int, ...], dtype: torch.dtype, causal: bool, scale: float,
               mask: list[int] | tuple[int, ...] | None, module: str, checked: bool
               ) -> torch.Tensor | None:
        """Count one attention call; its messages' header (`wire`) when `checked`."""
        self.calls += 1
        if not checked:
            return None
        code = agreement.checksum(f"{shape} {dtype} {causal} {scale} "
                                  f"{None if mask is None else tuple(mask)}")
        return wire.header_of(self.calls, agreement.checksum(module), code, True)

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False):
        if enable_gqa or key.shape != query.shape or value.shape != query.shape:
            raise ContextParallelError(
                f"{self._where()}: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                f"{tuple(value.shape)} must have one shape (self-attention over the split "
                f"sequence, the same heads: enable_gqa={enable_gqa}); cross-attention to a "
                f"sequence that is not split, and grouped-query attention, are not supported")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        # (see `wire`: no header on a device tensor, as no per-forward agreement there)
        checked = self.check is not None and query.device.type == "cpu"
        module = self.path[-1] if self.path else self.owner  # this call's place in the model
        if self.style == "ring":
            self._ring_only(attn_mask, dropout_p)
            length = query.shape[-2] * self.sp
            if length % (2 * self.sp):
                layout.check_length(length, self.sp, self._where())
        else:
            if query.dim() != 4:
                raise ContextParallelError(f"{self._where()}: the all-to-all form takes (batch, "
                                           f"heads, sequence, head_dim); got query "
                                           f"{tuple(query.shape)}")
            self._whole_mask(attn_mask, query.shape[-2])
        if torch.compiler.is_compiling():  # the operators, in the graph
            header = ops.header(self.key, query, is_causal, scale, attn_mask, module, checked)
            if self.style == "ring":
                return ops.ring_attention(query, key, value, causal=is_causal, scale=scale,
                                          header=header, split=self.key)
            return ops.ulysses_attention(query, key, value, attn_mask=attn_mask,
                                         dropout_p=dropout_p, causal=is_causal, scale=scale,
                                         header=header, split=self.key, group=self.group,
                                         owner=self.owner)
        mask = None if attn_mask is None else tuple(attn_mask.shape)
        header = self.header(tuple(query.shape), query.dtype, is_causal, scale, mask, module,
                             checked)
        if self.style == "ring":
            return ring.ring_attention(query, key, value, causal=is_causal, scale=scale,
                                       group=self.group, header=header, owner=self.owner,
                                       names=self.names)
        return ulysses.ulysses_attention(query, key, value, attn_mask=attn_mask,
                                         dropout_p=dropout_p, causal=is_causal, scale=scale,
                                         group=self.group, header=header, owner=self.owner,
                                         names=self.names)

    def _ring_only(self, attn_mask, dropout_p: float) -> None:
        if attn_mask is not None:
            raise ContextParallelError(
                f"{self._where()}: the ring form takes no attn_mask (got one of shape "
                f"{tuple(attn_mask.shape)}): it builds the causal mask itself from where each "
                f"rank's tokens are (is_causal=True), or attends to every token (no mask). For "
                f"a causal mask pass is_causal=True instead of the mask (nn.MultiheadAttention: "
                f"is_causal=True with its mask); for any other mask (padding, a document mask) "
                f"use style='alltoall' with a mask over the whole sequence")
        if dropout_p:
            raise ContextParallelError(
                f"{self._where()}: the ring form has no attention dropout (dropout_p={dropout_p}); set "
                f"the attention's dropout to 0, or use style='alltoall'")

    def _whole_mask(self, attn_mask, local: int) -> None:
        whole = local * self.sp
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (whole, whole):
            raise ContextParallelError(
                f"{self._where()}: attn_mask of shape {tuple(attn_mask.shape)} must end in the whole "
                f"sequence's (query, key) = ({whole}, {whole}): each rank holds {local} of its "
                f"{whole} tokens, and attention runs over all of them. A mask built from the "
                f"local length (x.shape[1]) is the wrong one: for a causal mask pass "
                f"is_causal=True, else build the mask for the whole sequence, in order")


class _Catch(TorchFunctionMode):
    """Sends the forward's `scaled_dot_product_attention` calls to the split."""

    def __init__(self, split: _Split) -> None:
        super().__init__()
        self.split = split

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return self.split.attend(*args, **(kwargs or {}))
        if func is F.multi_head_attention_forward:
            # (run, as every function the mode sees, with the mode off)
            return mha.forward(*args, **(kwargs or {}))
        if func is _CHECKPOINT and torch.compiler.is_compiling():
            # Dynamo traces a checkpoint's region as a higher-order op whose body sees no torch
            # function mode: its attention would be torch's, on this rank's part alone. The
            # region runs outside the graph instead (a break), eagerly, under the mode.
            return _checkpoint_outside_graph(self, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@torch.compiler.disable
def _checkpoint_outside_graph(catch: _Catch, args: tuple, kwargs: dict):
    if catch in torch.overrides._get_current_function_mode_stack():
        return _CHECKPOINT(*args, **kwargs)
    with catch:
        return _CHECKPOINT(*args, **kwargs)


_converted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its _Split


def parallelize(model: nn.Module, group: Group | None = None, style: str = "ring") -> nn.Module:
    """Make `model`'s attention run over a context-parallel group; returns `model`.

    Each rank then runs the model on its part of every sequence (`td.context.split`): layers
    act token by token as before, and attention (`F.scaled_dot_product_attention`,
    `nn.MultiheadAttention`) sees the whole sequence through the group.

    Args:
        model: the one-process model (its parameters stay whole and replicated).
        group: the context-parallel group (`mesh.cp_group`; None: the world).
        style: "ring" (keys and values passed around; any number of heads; no mask but
            is_causal) or "alltoall" (heads traded for the sequence; heads divisible by the
            group's size; any mask over the whole sequence).

    Returns:
        `model`, converted in place.

    Raises:
        ValueError: an unknown style, or (all-to-all) a `nn.MultiheadAttention` whose heads do
            not divide over the group.

    Gradients: each rank's loss is over its part of the sequence, and the parameters' gradients
    are partial; average them over the context-parallel group (and the data-parallel one),
    e.g. `td.DistributedOptimizer(opt, group=mesh.dp_cp_group)`, with each rank's loss the
    mean over its own tokens: the mean over dp x cp ranks of those gradients is one process's.
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r}: choose 'ring' or 'alltoall'")
    if model in _converted:
        raise ValueError(f"{type(model).__name__} is split already ({_converted[model].style} over "
                         f"{list(group_ranks(_converted[model].group))}): convert a model once")
    sp = group_size(group)
    attention = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    if style == "alltoall":
        for name, m in attention:
            ulysses.heads_per_rank(m.num_heads, sp, f"{name} (nn.MultiheadAttention)")
    if sp == 1:  # no split (a mesh's cp_group when cp is 1)
        return model
    layout_lines = [f"context-parallel {style} over {list(group_ranks(group))}"]
    layout_lines += [f"{n} {tuple(p.shape)}" for n, p in model.named_parameters()]
    agreement.agree_layout("context-parallel model", layout_lines, group, always=True)
    model_check.watch(model, "context-parallel", layout_lines, group)
    split = _converted[model] = _Split(model, group, style)
    for name, m in attention:
        m.register_forward_pre_hook(_no_weights(name), with_kwargs=True)
    # Every module's forward opens the catch if none is open: the model's own forward, and a
    # block's recomputed one (activation checkpointing runs it again during the backward:
    # torch.utils.checkpoint calls the module, td.checkpoint_wrapper its forward alone). Each
    # also keeps its name on `split.path` while it runs (the place an attention call names).
    for name, module in model.named_modules():
        name = name or split.owner
        module.register_forward_pre_hook(functools.partial(_before, split, module is model, name))
        module.register_forward_hook(functools.partial(_after, split, module is model),
                                     always_call=True)
        if activation_checkpoint.is_checkpointed(module):
            module.forward.forward = _Opening(split, module, name, module.forward.forward)
    return model


class _Opening:
    """A recomputed forward (`td.checkpoint_wrapper`'s) that opens the catch as a call would."""

    def __init__(self, split: _Split, module: nn.Module, name: str, forward) -> None:
        self.split, self.module, self.name, self.forward = split, module, name, forward

    def __call__(self, *args, **kwargs):
        _enter(self.split, False, self.module)
        self.split.path.append(self.name)
        try:
            output = self.forward(*args, **kwargs)
        finally:
            self.split.path.pop()
            _leave(self.split, False, self.module, None)
        return output


# Traced under torch.compile: a module inside a compiled forward only keeps its name (the mode
# is open, on dynamo's stack); the root opens and closes the mode outside the graph.
def _before(split: _Split, root: bool, name: str, module: nn.Module, _args) -> None:
    if root or not torch.compiler.is_compiling():
        _enter(split, root, module)
    split.path.append(name)


def _after(split: _Split, root: bool, module: nn.Module, _args, output) -> None:
    if split.path:
        split.path.pop()
    if root or not torch.compiler.is_compiling():
        _leave(split, root, module, output)


# Never traced: the mode is entered and left outside any graph (a graph holds no mode), and
# the check at the end reads the calls counted while the forward ran.
@torch.compiler.disable
def _enter(split: _Split, root: bool, module: nn.Module) -> None:
    if split.mode is not None:  # open already: a module inside the forward
        return
    if root:
        split.calls = 0
        split.path.clear()
    split.mode, split.opener = split.catch, module
    split.mode.__enter__()
    mha.opened(split)


@torch.compiler.disable
def _leave(split: _Split, root: bool, module: nn.Module, output) -> None:
    if split.mode is None or split.opener is not module:
        return
    mode, split.mode, split.opener = split.mode, None, None
    mode.__exit__(None, None, None)
    mha.closed(split)
    if root and split.calls == 0 and output is not None:
        raise ContextParallelError(
            f"context parallelism: the forward of {split.owner} made no attention call the "
            f"split can see: it runs F.scaled_dot_product_attention (directly, or inside "
            f"nn.MultiheadAttention) over the group; attention written by hand "
            f"(softmax(q @ k.transpose(-2, -1)) @ v) would attend only to this rank's part of "
            f"the sequence. Call F.scaled_dot_product_attention in the model, or do not split "
            f"the sequence of a model without attention.")


def _no_weights(name: str):
    def hook(module: nn.MultiheadAttention, args, kwargs):
        asked = kwargs.get("need_weights", args[4] if len(args) > 4 else None)
        if asked:
            raise ContextParallelError(
                f"{name} (nn.MultiheadAttention) was called with need_weights=True: under "
                f"context parallelism no rank holds the attention weights over the whole "
                f"sequence; call it with need_weights=False")
        if asked is None:
            kwargs = {**kwargs, "need_weights": False}
        return args, kwargs
    return hook
