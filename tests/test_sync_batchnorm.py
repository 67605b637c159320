"""td.SyncBatchNorm against one process's BatchNorm on the whole batch, where precision is hard.

Each channel's mean is 100 times its spread (and the spreads differ by 10^5 between channels):
there, a variance computed as E[x²] − E[x]² in float32 loses ~3e-3 of itself. Ranks hold
equal, uneven and empty batches. Every quantity (output, input / weight / bias gradients,
running mean and variance) is compared with `nn.BatchNorm2d` run in float64 on the whole
batch, relative to its largest magnitude. The float32 one-process BatchNorm is measured against
the same float64 reference too: its own CPU kernel computes x·(invstd·w) + (b − mean·invstd·w),
which at mean/std = 100 is a few 1e-6 away (the numbers are in the assertion messages).
"""

import pytest
import torch
from torch import nn

import tandem as td
from tandem.parallel.sync_bn import merge
from tandem.testing import run_distributed

RATIO = 100.0  # mean / std of every channel
SPREADS = (1.0, 1e-3, 1e2)  # per-channel std: scale invariance across 5 orders of magnitude
TOL = 1e-6  # float32 against the float64 truth (measured: ~1e-7)
TOL_FP64 = 1e-12  # float64 against float64 (measured: ~1e-15)
CASES = {"even": (16, 16), "uneven": (5, 27), "empty": (0, 32)}  # per-rank batch of 2 ranks


def _data(n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    spread = torch.tensor(SPREADS, dtype=torch.float64).view(1, -1, 1, 1)
    x = (torch.randn(n, len(SPREADS), 3, 3, generator=g, dtype=torch.float64) + RATIO) * spread
    dy = torch.randn(n, len(SPREADS), 3, 3, generator=g, dtype=torch.float64)
    weight = torch.rand(len(SPREADS), generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(len(SPREADS), generator=g, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype), weight.to(dtype), bias.to(dtype)


def _one_step(module: nn.Module, x, dy, weight, bias, steps: int = 2) -> dict[str, torch.Tensor]:
    """Two training forwards (the running statistics move twice) and one backward."""
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    for _ in range(steps - 1):
        module(x.detach())
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    (out * dy).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "grad_w": module.weight.grad,
            "grad_b": module.bias.grad, "running_mean": module.running_mean,
            "running_var": module.running_var}


def _relative(mine: torch.Tensor, truth: torch.Tensor) -> float:
    if truth.numel() == 0:
        return 0.0
    return ((mine.double() - truth.double()).abs().max() / truth.double().abs().max()).item()


def check_against_one_process(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    rank = td.rank()
    errors = {}
    for case, counts in CASES.items():
        n = sum(counts)
        x, dy, weight, bias = _data(n, dtype)
        channels = len(SPREADS)
        truth = _one_step(nn.BatchNorm2d(channels).double(), *(t.double() for t in (x, dy, weight, bias)))
        start, stop = sum(counts[:rank]), sum(counts[: rank + 1])
        mine = _one_step(td.SyncBatchNorm(channels).to(dtype), x[start:stop], dy[start:stop], weight, bias)
        # The weight and bias gradients are this rank's share: the reducer sums (averages) them.
        for name in ("grad_w", "grad_b"):
            mine[name] = td.allreduce(mine[name], op="sum")
        for name in ("out", "grad_x"):
            truth[name] = truth[name][start:stop]
        errors[case] = {name: _relative(mine[name], truth[name]) for name in truth}
        if dtype == torch.float32:  # how far one float32 process is from the same truth
            single = _one_step(nn.BatchNorm2d(channels), x, dy, weight, bias)
            single["out"] = single["out"][start:stop]
            single["grad_x"] = single["grad_x"][start:stop]
            errors[case]["one process, float32"] = max(_relative(single[k], truth[k]) for k in truth)
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_large_mean_uneven_and_empty_batches_match_one_process(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    for dtype, tol in (("float32", TOL), ("float64", TOL_FP64)):
        for rank, errors in enumerate(run_distributed(check_against_one_process, world_size=2,
                                                      backend=backend, args=(dtype,))):
            for case, per_quantity in errors.items():
                single = per_quantity.pop("one process, float32", None)
                worst = max(per_quantity.values())
                assert worst <= tol, (f"{backend} {dtype} rank {rank} {case}: {per_quantity} "
                                      f"(one float32 process: {single})")


def test_merge_is_chans_update_and_ignores_empty_rows():
    """The merge on its own: the union's count, mean and M2, rows of count 0 ignored."""
    torch.manual_seed(0)
    parts = [torch.randn(n, 2, dtype=torch.float64) * 3 + 1e4 for n in (3, 0, 11, 1)]
    rows = []
    for p in parts:
        var, mean = torch.var_mean(p, 0, correction=0) if len(p) else (torch.zeros(2), torch.zeros(2))
        rows.append(torch.cat([torch.tensor([float(len(p))]), mean, var * len(p)]).double())
    total, mean, m2 = merge(torch.stack(rows), 2)
    union = torch.cat(parts)
    assert total.item() == len(union)
    assert torch.allclose(mean, union.mean(0), rtol=1e-15, atol=0)
    assert torch.allclose(m2, union.var(0, correction=0) * len(union), rtol=1e-12, atol=0)
    nothing = merge(torch.zeros(2, 5, dtype=torch.float64), 2)
    assert nothing[0].item() == 0 and not nothing[1].any() and not nothing[2].any()
