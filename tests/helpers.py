"""Deterministic per-rank data and a NumPy reference, shared by the collective tests; and
`kill_tree`, a machine vanishing, for the multi-node tests."""

import os
import signal

import numpy as np
import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "mean", "min", "max", "product"]
# Only "mean" is compared with a tolerance. `rank_data` holds small integers, and their sums,
# minima, maxima and products stay below 2^8 in magnitude (|sum| <= 4 * 3, |product| <= 2^4),
# which every dtype here holds exactly (bfloat16 has 8 significant bits): any difference there
# is a bug, however small. A float mean is that exact sum divided by n and rounded once to the
# dtype, so it is within half a unit in the last place: a relative eps / 2 (2^-9 for bfloat16,
# 2^-12 for float16). Integer means round down, as NumPy's `//` does: exact.
MEAN_TOLERANCE = {
    dtype: (torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0) for dtype in DTYPES
}


def rank_data(rank: int, dtype: torch.dtype, shape=(5, 3), op: str = "sum") -> torch.Tensor:
    """Small integers (exact in every dtype); {-2,-1,1,2} for products so nothing overflows."""
    generator = torch.Generator().manual_seed(1000 + rank)
    if op == "product":
        values = torch.tensor([-2.0, -1.0, 1.0, 2.0])[torch.randint(0, 4, shape, generator=generator)]
    else:
        values = torch.randint(-3, 4, shape, generator=generator).double()
    return values.to(dtype)


def reference(arrays: list[np.ndarray], op: str, integer: bool) -> np.ndarray:
    stack = np.stack(arrays).astype(np.float64)
    if op == "sum":
        return stack.sum(0)
    if op == "mean":
        return np.floor_divide(stack.sum(0), len(arrays)) if integer else stack.mean(0)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    return stack.prod(0)


def mismatch(label: str, actual, expected: np.ndarray, dtype: torch.dtype,
             op: str | None = None) -> str | None:
    """None when `actual` equals `expected` (within `MEAN_TOLERANCE` for op="mean"), else a
    description of the difference."""
    if isinstance(actual, torch.Tensor):
        got = actual.double().cpu().numpy()
    else:
        got = np.asarray(actual, np.float64)
    if got.shape != expected.shape:
        return f"{label}: shape {got.shape} != expected {expected.shape}"
    tol = MEAN_TOLERANCE[dtype] if op == "mean" else 0.0
    if not np.allclose(got, expected, rtol=tol, atol=0.0):
        worst = int(np.argmax(np.abs(got - expected)))
        return (f"{label}: got {got.ravel()[:6]} expected {expected.ravel()[:6]}; worst at "
                f"{worst}: {float(got.ravel()[worst])!r} != {float(expected.ravel()[worst])!r} "
                f"(rtol {tol:g})")
    return None


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (ranks run in sessions of their own): a machine
    that vanished, as the other agents see it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo.extend(children.get(doomed[-1], []))
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_compiled_like_eager(results_per_rank, tolerance: float,
                               exact: dict[str, tuple[int, int]]) -> None:
    """Each rank's {name: {"difference", "breaks", "graphs", "recompiled"}} of a compiled run
    against the eager one: within `tolerance`, something compiled, nothing recompiled after
    the second step, and the names in `exact` with exactly their (breaks, graphs)."""
    for rank, results in enumerate(results_per_rank):
        for name, result in results.items():
            assert result["difference"] <= tolerance, (rank, name, result)
            assert result["graphs"] >= 1, (rank, name, "nothing was compiled", result)
            assert result["recompiled"] == 0, (rank, name, result)
        for name, (breaks, graphs) in exact.items():
            assert (results[name]["breaks"], results[name]["graphs"]) == (breaks, graphs), (
                rank, name, results[name])
