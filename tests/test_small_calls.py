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
