"""Deterministic per-rank data and a NumPy reference, shared by the collective tests."""

import numpy as np
import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "mean", "min", "max", "product"]
TOLERANCE = {
    torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2,
    torch.int32: 0, torch.int64: 0,
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


def mismatch(label: str, actual, expected: np.ndarray, dtype: torch.dtype) -> str | None:
    """None when `actual` matches `expected` to the dtype's tolerance, else a description."""
    if isinstance(actual, torch.Tensor):
        got = actual.double().cpu().numpy()
    else:
        got = np.asarray(actual, np.float64)
    if got.shape != expected.shape:
        return f"{label}: shape {got.shape} != expected {expected.shape}"
    tol = TOLERANCE[dtype]
    if not np.allclose(got, expected, rtol=tol, atol=tol):
        return f"{label}: got {got.ravel()[:6]} expected {expected.ravel()[:6]}"
    return None
