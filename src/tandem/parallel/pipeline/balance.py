"""How a `Pipeline` splits its layers into stages: explicit counts, parameter counts or timing.

Pure except `time_costs`, which runs the layers. A split is a list of layer counts, one per
stage, in order; `partition` picks the contiguous split whose most expensive stage is cheapest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

#: Per-layer forward+backward runs timed for balance="time" (after one warm-up run).
TIME_REPEATS = 3


def check_counts(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate an explicit `balance` (layer counts per stage) and return it as a list."""
    counts = list(balance)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise TypeError(f"balance must be a list of layer counts (ints), got {balance!r}")
    if len(counts) != num_stages:
        raise ValueError(
            f"balance={counts} has {len(counts)} entries but the pipeline has {num_stages} "
            f"stages: give one layer count per stage"
        )
    if any(c < 1 for c in counts):
        empty = [s for s, c in enumerate(counts) if c < 1]
        raise ValueError(
            f"balance={counts} gives stage(s) {empty} no layers; every stage needs at least one"
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"balance={counts} sums to {sum(counts)} layers but the model has {num_layers}: "
            f"the counts must add up to the number of layers"
        )
    return counts


def check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        raise ValueError(
            f"the pipeline has {num_stages} stages but the model only {num_layers} layers: "
            f"use at most {num_layers} ranks in the pipeline group, or split the model finer"
        )


def partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layer counts that split `costs` into contiguous, non-empty stages, cheapest bottleneck.

    Ties (common: parameter-free layers cost 0) go to the split whose stage costs, then layer
    counts, are most even, so a ReLU stays beside its Linear rather than trailing alone.
    """
    n = len(costs)
    check_stage_count(n, num_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"), float("inf"))
    # best[k][j]: (bottleneck, sum of squared stage costs, sum of squared counts) for the first
    # j layers in k stages; cut[k][j] the start of the k-th stage in that split.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0, 0.0)
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                stage = prefix[j] - prefix[i]
                score = (max(prev[0], stage), prev[1] + stage * stage, prev[2] + (j - i) ** 2)
                if score < best[k][j]:
                    best[k][j], cut[k][j] = score, i
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameters per layer (a parameter shared by several layers counts once, first use)."""
    seen: set[int] = set()
    costs = []
    for layer in layers:
        total = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        costs.append(float(total))
    return costs


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def starts_in_place(module: nn.Module) -> bool:
    """Whether the first leaf module works in place (`ReLU(inplace=True)`): it must not be fed
    a leaf tensor that requires grad, so callers give it a copy."""
    for sub in module.modules():
        if not any(True for _ in sub.children()):
            return bool(getattr(sub, "inplace", False))
    return False


def _detached(value):
    """The value as a fresh leaf, floating tensors requiring grad (so backward stops here)."""
    def leaf(t):
        if not isinstance(t, torch.Tensor):
            return t
        out = t.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out

    if isinstance(value, (tuple, list)):
        return type(value)(leaf(t) for t in value)
    return leaf(value)


def _copied(value):
    """Copies of the tensors that require grad, for a layer that writes into its input."""
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(t) for t in value)
    return value.clone() if isinstance(value, torch.Tensor) and value.requires_grad else value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_costs(layers: Sequence[nn.Module], sample, device: torch.device) -> list[float]:
    """Median seconds of each layer's forward + backward on `sample` (the model's input).

    Gradients are taken with `torch.autograd.grad`, so no `.grad` is touched.
    """
    value = sample
    costs = []
    for layer in layers:
        runs, copy = [], starts_in_place(layer)
        for _ in range(TIME_REPEATS + 1):
            leaves = _detached(value)
            _sync(device)
            start = time.perf_counter()
            with torch.enable_grad():
                output = layer(_copied(leaves) if copy else leaves)
                outs = [t for t in _flat(output) if t.requires_grad]
                wrt = [t for t in _flat(leaves) if t.requires_grad]
                wrt += [p for p in layer.parameters() if p.requires_grad]
                if outs and wrt:
                    torch.autograd.grad(
                        outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True
                    )
            _sync(device)
            runs.append(time.perf_counter() - start)
        costs.append(statistics.median(runs[1:]))
        with torch.no_grad():
            value = layer(_detached(value))
    return costs
