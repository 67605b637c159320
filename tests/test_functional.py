"""Differentiable collectives (`tandem.functional`) against autograd in one process.

Every rank builds every rank's input, so it can compute the one-process reference: the
gradient, with respect to its own input, of the sum over ranks of each rank's loss
(`loss_r = sum(weight_r * output_r)`), with the collective replaced by the local operation it
stands for. The distributed gradient must equal it exactly up to float rounding.
"""

import pytest
import torch

import tandem as td
from tandem import functional as F
from tandem.testing import run_distributed


def _input(rank: int, shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _weight(rank: int, shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _splits(rank: int, n: int) -> list[int]:
    """Rows rank `rank` sends to each rank in all_to_all: uneven, some zero."""
    return [(rank + j) % 3 for j in range(n)]


def _cases(n: int):
    """(name, input shape of rank r, distributed op, reference op over all inputs -> rank r's output)."""
    yield ("all_reduce sum", lambda r: (3, 2),
           lambda x: F.all_reduce(x, "sum"), lambda xs, r: sum(xs))
    yield ("all_reduce mean", lambda r: (3, 2),
           lambda x: F.all_reduce(x, "mean"), lambda xs, r: sum(xs) / n)
    yield ("all_gather dim 1 uneven", lambda r: (2, r + 1),
           lambda x: F.all_gather(x, dim=1), lambda xs, r: torch.cat(xs, dim=1))
    yield ("all_gather dim 0 even", lambda r: (2, 3),
           lambda x: F.all_gather(x), lambda xs, r: torch.cat(xs))
    yield ("reduce_scatter sum", lambda r: (2 * n, 3),
           lambda x: F.reduce_scatter(x, "sum"), lambda xs, r: sum(xs)[2 * r : 2 * r + 2])
    yield ("reduce_scatter mean dim 1", lambda r: (3, 2 * n),
           lambda x: F.reduce_scatter(x, "mean", dim=1),
           lambda xs, r: (sum(xs) / n)[:, 2 * r : 2 * r + 2])
    yield ("broadcast root 1", lambda r: (4,),
           lambda x: F.broadcast(x, root=1), lambda xs, r: xs[1])

    def alltoall_reference(xs, r):
        pieces = []
        for j, x in enumerate(xs):
            start = sum(_splits(j, n)[:r])
            pieces.append(x[start : start + _splits(j, n)[r]])
        return torch.cat(pieces)

    yield ("all_to_all uneven", lambda r: (sum(_splits(r, n)), 2),
           lambda x: F.all_to_all(x, _splits(td.rank(), n)), alltoall_reference)
    # Equal parts of each rank's rows, where ranks hold different numbers of rows: rank j
    # sends j + 1 rows to each rank.
    yield ("all_to_all equal parts of uneven rows", lambda r: (n * (r + 1), 2),
           lambda x: F.all_to_all(x),
           lambda xs, r: torch.cat([x[r * (j + 1) : (r + 1) * (j + 1)] for j, x in enumerate(xs)]))


def check_gradients():
    n, me = td.size(), td.rank()
    errors = []
    for name, shape, distributed, local in _cases(n):
        x = _input(me, shape(me)).requires_grad_()
        out = distributed(x)
        (_weight(me, out.shape) * out).sum().backward()

        xs = [_input(r, shape(r)).requires_grad_() for r in range(n)]
        outputs = [local(xs, r) for r in range(n)]
        sum((_weight(r, o.shape) * o).sum() for r, o in enumerate(outputs)).backward()
        if not torch.allclose(out.detach(), outputs[me].detach(), rtol=1e-12, atol=1e-12):
            errors.append(f"rank {me} {name}: forward {out} != {outputs[me]}")
        # No path from this rank's input to any loss (broadcast from another root): zero.
        expected = xs[me].grad if xs[me].grad is not None else torch.zeros_like(x)
        if not torch.allclose(x.grad, expected, rtol=1e-12, atol=1e-12):
            errors.append(f"rank {me} {name}: gradient {x.grad} != {expected}")
    return errors


def check_send_recv():
    """The first rank sends to the last; the last rank's loss flows back to the first's input."""
    n, me = td.size(), td.rank()
    x = _input(0, (3,)).requires_grad_()
    if me == 0:
        token = F.send(x * 2.0, dst=n - 1)
        (token + (x ** 2).sum()).backward()
        expected = 2 * x.detach() + 2.0 * _weight(n - 1, (3,))
        return torch.allclose(x.grad, expected, rtol=1e-12, atol=0)
    if me == n - 1:
        received = F.recv((3,), src=0, dtype=torch.float64)
        (_weight(n - 1, (3,)) * received).sum().backward()
        return torch.allclose(received.detach(), 2 * x.detach())
    return True


def check_bad_op():
    try:
        F.all_reduce(torch.ones(2, requires_grad=True), "max")
    except ValueError as error:
        return "op='sum' or op='mean'" in str(error)
    return False


@pytest.mark.parametrize("backend,world_size", [("gloo", 2), ("gloo", 3), ("mpi", 3)])
def test_gradients_equal_one_process(backend, world_size):
    results = run_distributed(check_gradients, world_size=world_size, backend=backend)
    assert results == [[]] * world_size, "\n".join(e for errs in results for e in errs)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_send_recv_carry_the_gradient_back(backend):
    assert run_distributed(check_send_recv, world_size=2, backend=backend) == [True, True]


def test_min_max_are_refused_with_the_fix():
    assert run_distributed(check_bad_op, world_size=2) == [True, True]
