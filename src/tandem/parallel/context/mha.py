"""`nn.MultiheadAttention`'s function, its attention call sent to the split (eager and compiled).

`nn.MultiheadAttention` runs `F.multi_head_attention_forward`, which calls
`scaled_dot_product_attention` by its global name in `torch.nn.functional`: the split's torch
function mode sees the outer call only. This module holds a copy of that function (torch's own
code object) whose globals are this module's: every name of `torch.nn.functional`, except
`scaled_dot_product_attention`, which here sends the call to the split whose model's forward
runs (`opened` by the split's hooks, outside any graph: a traced forward mutates nothing here,
as the region a checkpoint recomputes may not).

- Eager, nothing in torch is renamed for the length of a call: other threads and other models
  keep torch's own function.
- Compiled, dynamo inlines the copy (its code is torch's, its globals a module's, so its guards
  read this module) and meets the split's call inside, where torch's own function would be one
  opaque node of the graph whose attention the split never sees.
"""

from __future__ import annotations

import types
from typing import Any

import torch.nn.functional as F

globals().update({name: value for name, value in vars(F).items() if not name.startswith("__")})

_running: list[Any] = []  # the splits whose model's forward runs (innermost last)


def _attend(*args: Any, **kwargs: Any) -> Any:
    return _running[-1].attend(*args, **kwargs)


scaled_dot_product_attention = _attend  # the name the copy calls

_torch_own = F.multi_head_attention_forward
#: `F.multi_head_attention_forward`, its attention sent to the split on top of `_running`
forward = types.FunctionType(_torch_own.__code__, globals(), _torch_own.__name__,
                             _torch_own.__defaults__, _torch_own.__closure__)
forward.__kwdefaults__ = _torch_own.__kwdefaults__


def opened(split: Any) -> None:
    """`split`'s model's forward starts (called outside any graph: when traced, `_running` is
    read as it is then, and the copy's attention goes to that split)."""
    _running.append(split)


def closed(split: Any) -> None:
    if split in _running:
        _running.remove(split)
