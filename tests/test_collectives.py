"""Every collective, op and dtype against a NumPy reference, at world sizes 1 to 4.

Each check runs on every rank of a real Gloo world and loops over dtypes, ops and the
variants (new tensor, in place, async, NumPy in and out, a sub-group), collecting every
mismatch so that one failing run shows all of them.
"""

import numpy as np
import pytest
import torch
from helpers import DTYPES, OPS, mismatch, rank_data, reference

import tandem as td
from tandem.testing import run_distributed

SIZES = [1, 2, 3, 4]
_groups: dict[tuple[int, ...], td.Group] = {}


def _subgroup() -> td.Group:
    """Every rank but 0 (all of a world of one): a group whose ranks do not start at 0."""
    ranks = tuple(range(1, td.size())) or (0,)
    if ranks not in _groups:
        _groups[ranks] = td.new_group(ranks)
    return _groups[ranks]


def _scopes():
    """(label, group, member ranks) for the world and the sub-group."""
    group = _subgroup()
    yield "world", None, list(range(td.size()))
    if group.rank >= 0:
        yield "subgroup", group, list(group.ranks)


def _variants(call, data: torch.Tensor):
    """Run `call(tensor, **flags)` as plain, in place, async and NumPy; yield (label, result)."""
    yield "plain", call(data.clone())
    inplace = data.clone()
    returned = call(inplace, inplace=True)
    yield "inplace", inplace
    yield "inplace-returned", returned
    yield "async", call(data.clone(), async_op=True).wait()
    if data.dtype != torch.bfloat16:  # NumPy has no bfloat16
        yield "numpy", torch.from_numpy(np.asarray(call(data.clone().numpy())))


def check_allreduce():
    errors = []
    for scope, group, members in _scopes():
        for dtype in DTYPES:
            for op in OPS:
                data = rank_data(td.rank(), dtype, op=op)
                expected = reference(
                    [rank_data(r, dtype, op=op).double().numpy() for r in members],
                    op, integer=not dtype.is_floating_point,
                )
                call = lambda t, **kw: td.allreduce(t, op=op, group=group, **kw)  # noqa: B023
                for variant, result in _variants(call, data):
                    errors.append(mismatch(f"{scope} {dtype} {op} {variant}", result, expected,
                                           dtype, op))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_broadcast():
    errors = []
    for scope, group, members in _scopes():
        root = members[-1]
        for dtype in DTYPES:
            data = rank_data(td.rank(), dtype)
            expected = rank_data(root, dtype).double().numpy()
            call = lambda t, **kw: td.broadcast(t, root=root, group=group, **kw)  # noqa: B023
            for variant, result in _variants(call, data):
                errors.append(mismatch(f"{scope} {dtype} {variant}", result, expected, dtype))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_reduce():
    errors = []
    for scope, group, members in _scopes():
        root = members[0]
        for dtype in DTYPES:
            for op in OPS:
                data = rank_data(td.rank(), dtype, op=op)
                expected = reference(
                    [rank_data(r, dtype, op=op).double().numpy() for r in members],
                    op, integer=not dtype.is_floating_point,
                )
                rounded = op  # only a root's mean is rounded
                if td.rank() != root:
                    expected, rounded = data.double().numpy(), None  # non-roots keep their input
                call = lambda t, **kw: td.reduce(t, root=root, op=op, group=group, **kw)  # noqa: B023
                for variant, result in _variants(call, data):
                    errors.append(mismatch(f"{scope} {dtype} {op} {variant}", result, expected,
                                           dtype, rounded))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_allgather():
    """First dims differ by rank: rank r contributes r + 1 rows."""
    errors = []
    for scope, group, members in _scopes():
        for dtype in DTYPES:
            data = rank_data(td.rank(), dtype, shape=(td.rank() + 1, 2))
            expected = np.concatenate(
                [rank_data(r, dtype, shape=(r + 1, 2)).double().numpy() for r in members]
            )
            results = [("plain", td.allgather(data, group=group)),
                       ("async", td.allgather(data, group=group, async_op=True).wait())]
            if dtype != torch.bfloat16:
                results.append(("numpy", torch.from_numpy(td.allgather(data.numpy(), group=group))))
            for variant, result in results:
                errors.append(mismatch(f"{scope} {dtype} {variant}", result, expected, dtype))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_reducescatter():
    errors = []
    for scope, group, members in _scopes():
        n = len(members)
        me = members.index(td.rank())
        for dtype in DTYPES:
            for op in OPS:
                shape = (2 * n, 3)
                data = rank_data(td.rank(), dtype, shape=shape, op=op)
                full = reference(
                    [rank_data(r, dtype, shape=shape, op=op).double().numpy() for r in members],
                    op, integer=not dtype.is_floating_point,
                )
                expected = full[2 * me : 2 * me + 2]
                for variant, result in [
                    ("plain", td.reducescatter(data, op=op, group=group)),
                    ("async", td.reducescatter(data, op=op, group=group, async_op=True).wait()),
                ]:
                    errors.append(mismatch(f"{scope} {dtype} {op} {variant}", result, expected,
                                           dtype, op))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_alltoall():
    """Uneven splits: rank r sends j + 1 rows to member j."""
    errors = []
    for scope, group, members in _scopes():
        n = len(members)
        me = members.index(td.rank())
        for dtype in DTYPES:
            splits = [j + 1 for j in range(n)]
            rows = sum(splits)
            data = rank_data(td.rank(), dtype, shape=(rows, 2))
            # Member i sends rows [sum(splits[:me]), +me+1) to me.
            start = sum(splits[:me])
            expected = np.concatenate(
                [rank_data(r, dtype, shape=(rows, 2)).double().numpy()[start : start + me + 1]
                 for r in members]
            )
            for variant, result in [
                ("plain", td.alltoall(data, splits=splits, group=group)),
                ("async", td.alltoall(data, splits=splits, group=group, async_op=True).wait()),
            ]:
                errors.append(mismatch(f"{scope} {dtype} {variant}", result, expected, dtype))
            even = rank_data(td.rank(), dtype, shape=(n, 2))
            expected_even = np.stack(
                [rank_data(r, dtype, shape=(n, 2)).double().numpy()[me] for r in members]
            )
            errors.append(mismatch(f"{scope} {dtype} even", td.alltoall(even, group=group),
                                   expected_even, dtype))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_send_recv_ring():
    """Each rank sends its data to the next and receives from the previous, every dtype."""
    n, me = td.size(), td.rank()
    if n == 1:
        return
    errors = []
    for tag, dtype in enumerate(DTYPES):
        out = rank_data(me, dtype)
        into = torch.zeros_like(out)
        handle = td.recv(into, src=(me - 1) % n, tag=tag, async_op=True)
        td.send(out, dst=(me + 1) % n, tag=tag)
        handle.wait()
        expected = rank_data((me - 1) % n, dtype).double().numpy()
        errors.append(mismatch(f"{dtype}", into, expected, dtype))
    assert not any(errors), "\n".join(e for e in errors if e)


def check_objects():
    obj = {"rank": td.rank(), "payload": list(range(td.rank() * 10))}
    gathered = td.allgather_object(obj)
    assert gathered == [{"rank": r, "payload": list(range(r * 10))} for r in range(td.size())]
    root = td.size() - 1
    assert td.broadcast_object(obj if td.rank() == root else None, root=root) == {
        "rank": root, "payload": list(range(root * 10))
    }
    td.barrier()
    td.barrier(group=_subgroup()) if _subgroup().rank >= 0 else None


CHECKS = [check_allreduce, check_broadcast, check_reduce, check_allgather, check_reducescatter,
          check_alltoall, check_send_recv_ring, check_objects]


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matches_numpy(check, world_size):
    run_distributed(check, world_size=world_size)


def check_seed_program():
    """The classic first program: rank 0 sends [1, -1], rank 1 receives it; then all-reduce."""
    if td.rank() == 0:
        td.send(torch.tensor([1.0, -1.0]), dst=1)
        received = None
    else:
        received = td.recv(torch.zeros(2), src=0).tolist()
    total = td.allreduce(torch.tensor([float(td.rank() + 1)]), op="sum").item()
    return received, total


def test_seed_program():
    results = run_distributed(check_seed_program, world_size=2)
    assert results == [(None, 3.0), ([1.0, -1.0], 3.0)]


def check_handle_polls():
    handle = td.allreduce(torch.ones(1000), op="sum", async_op=True)
    result = handle.wait()
    assert handle.done()
    assert result[0].item() == td.size()
    assert handle.wait() is result  # waiting twice returns the same result


def test_handle_done_and_wait_twice():
    run_distributed(check_handle_polls, world_size=2)
