"""Small collectives pay the wire and the check, nothing more: operations counted per call.

A checked call is two messages (the fixed-size agreement, then the data), an unchecked one is
one; `td.allgather` with equal first dims (the usual case) learns that from the check's
message and sends no lengths, so it is two messages checked. Uneven first dims still work
(one exchange of lengths more), in every mode. The allreduce works in place, with no copy.
Counted without patching anything: the watchdog counts every operation the engine issues.
"""

import importlib.util

import pytest
import torch

import tandem as td
from tandem import runtime
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def _issued() -> int:
    return sum(runtime.get_backend().watchdog._issued.values())


def _messages(call) -> tuple[int, object]:
    before = _issued()
    result = call()
    return _issued() - before, result


def check_messages_per_call():
    state, rank, size = runtime.state(), td.rank(), td.size()
    before = (state.checks, state.debug)
    counted = {}
    try:
        for mode, (checks, debug) in {"checks": (True, False), "off": (False, False),
                                      "debug": (True, True)}.items():
            state.checks, state.debug = checks, debug
            x = torch.full((1024,), float(rank + 1))
            n, result = _messages(lambda: td.allreduce(x, op="sum"))  # noqa: B023
            assert result is x and torch.equal(x, torch.full((1024,), size * (size + 1) / 2))
            counted[mode, "allreduce"] = n
            b = torch.full((8,), float(rank))
            n, result = _messages(lambda: td.broadcast(b, root=size - 1))  # noqa: B023
            assert result is b and torch.equal(b, torch.full((8,), float(size - 1)))
            counted[mode, "broadcast"] = n
            n, result = _messages(lambda: td.allgather(torch.full((2, 3), float(rank))))
            assert torch.equal(result, torch.arange(size).repeat_interleave(2)[:, None]
                               .expand(-1, 3).float())
            counted[mode, "allgather"] = n
            # uneven first dims: rank r sends r + 1 rows
            n, result = _messages(lambda: td.allgather(torch.full((rank + 1, 3), float(rank))))
            rows = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
            assert torch.equal(result, rows), (mode, result)
            counted[mode, "allgather uneven"] = n
            # complex: torch's own path on Gloo (its real view), as before
            z = torch.full((4,), complex(rank, 1), dtype=torch.complex64)
            td.allreduce(z, op="sum")
            assert torch.equal(z, torch.full((4,), complex(size * (size - 1) / 2, size),
                                             dtype=torch.complex64))
    finally:
        state.checks, state.debug = before
    return counted


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_calls_send_the_check_and_the_data_only(backend):
    (counted, _) = run_distributed(check_messages_per_call, world_size=2, backend=backend)
    for mode in ("checks", "debug"):
        assert counted[mode, "allreduce"] == counted[mode, "broadcast"] == 2, counted
        assert counted[mode, "allgather"] == 2, counted  # no exchange of lengths
        assert counted[mode, "allgather uneven"] == 3, counted
    assert counted["off", "allreduce"] == counted["off", "broadcast"] == 1, counted
    assert counted["off", "allgather"] == counted["off", "allgather uneven"] == 2, counted


def check_repeated_calls_on_reused_memory():
    """The MPI engine keeps a prepared call per address, count, dtype and op (or root): every
    other tensor at that address must still get its own reduction and its own check."""
    rank, size = td.rank(), td.size()
    state = runtime.state()
    seen = {}
    try:
        for checks in (True, False):
            state.checks = checks
            big = torch.zeros(32, 64)
            flat = big.view(-1)[:1024]  # the memory of big's first 16 rows, contiguous
            for _ in range(3):  # the first call makes the plan; the next ones run it
                flat.fill_(rank + 1.0)
                td.allreduce(flat, op="sum")
                assert torch.equal(flat, torch.full((1024,), size * (size + 1) / 2))
            # The same address, count and dtype, not contiguous: big's first 32 columns.
            big.copy_(torch.arange(2048.0).view(32, 64) + rank)
            columns = big[:, :32]
            td.allreduce(columns, op="sum")
            expected = torch.arange(2048.0).view(32, 64)
            expected[:, :32] = expected[:, :32] * size + size * (size - 1) / 2
            expected[:, 32:] += rank
            seen["columns", checks] = torch.equal(big, expected)
            # The same memory in another shape; a mean of integers rounds down.
            square = flat.view(32, 32)
            for _ in range(2):
                square.fill_(float(rank))
                td.allreduce(square)
            seen["mean", checks] = square[0, 0].item()
            ints = torch.full((8,), 3 * rank + 1, dtype=torch.int64)
            for _ in range(2):
                ints.fill_(3 * rank + 1)
                td.allreduce(ints)
            seen["int mean", checks] = ints.tolist()
            # A broadcast of memory an all-reduce used: its own prepared call.
            for root in (size - 1, 0):
                flat.fill_(float(rank))
                td.broadcast(flat, root=root)
                seen["broadcast", root, checks] = flat.unique().tolist()
        # The check still compares shapes on a prepared call: rank 0 passes the memory as
        # 1024 elements, the others as 32 x 32.
        state.checks = True
        mine = flat if rank == 0 else flat.view(32, 32)
        try:
            td.allreduce(mine, op="sum")
            seen["mismatch"] = None
        except td.CollectiveMismatchError as error:
            seen["mismatch"] = str(error)
    finally:
        state.checks = True
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_on_reused_memory_reduce_each_tensor_and_check_each_call(backend):
    for seen in run_distributed(check_repeated_calls_on_reused_memory, world_size=2,
                                backend=backend):
        for checks in (True, False):
            assert seen["columns", checks], seen
            assert seen["mean", checks] == 0.5, seen
            assert seen["int mean", checks] == [2] * 8, seen  # (1 + 4) // 2
            assert seen["broadcast", 1, checks] == [1.0], seen
            assert seen["broadcast", 0, checks] == [0.0], seen
        assert "rank 0: allreduce(shape=(1024,)" in seen["mismatch"], seen
        assert "rank 1: allreduce(shape=(32, 32)" in seen["mismatch"], seen
