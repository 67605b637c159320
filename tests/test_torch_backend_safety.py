"""torch.distributed on tandem's engines never returns garbage (issue 42, items 4 and 10).

- an `all_reduce(async_op=True)` whose shapes differ between ranks raises at `wait()`, each
  rank's call named (its check travels with the work);
- a `dist.barrier()` completes the collectives issued before it, waited for or not, as Gloo
  does (MPI left an async all-reduce half reduced);
- a `recv` into a tensor of another size or dtype than the `send`'s raises at the receiver,
  naming the sender, what it sent and what was expected (MPI and tandem's Gloo engine);
- torch's own DDP on tandem's group: a rank that skips one backward and step is named at the
  next backward, with one agreement per backward, not one per bucket.

In the harness's MPI worlds `td.init()` made torch's default group tandem's (MPI engine). For
tandem's Gloo engine (what `init_process_group("tandem")` gets outside MPI) each rank of the
shared Gloo world builds one `TandemProcessGroup` over a `C10dEngine` on the world's store, and
calls its methods as torch's functions do (DDP takes it as `process_group=`).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tandem.testing import run_distributed

needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                               reason="the MPI engine needs mpi4py")
ENGINES = [pytest.param("mpi", marks=needs_mpi), "gloo"]
_GROUPS: dict = {}


def _group(engine: str):
    """The process group under test on this rank (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if engine == "mpi":
        return c10d._get_default_group()
    if "gloo" not in _GROUPS:
        from tandem.comm.engines.c10d_engine import C10dEngine
        from tandem.comm.torch_pg.process_group import TandemProcessGroup

        store = dist.PrefixStore("torch-backend-safety/", c10d._get_default_store())
        cpu = torch.device("cpu")
        engine_ = C10dEngine.create("gloo", store, dist.get_rank(), dist.get_world_size(),
                                    60.0, cpu)
        _GROUPS["gloo"] = TandemProcessGroup(engine_, None, "tandem", 60.0, cpu)
    return _GROUPS["gloo"]


# --- 4a: an asynchronous all-reduce of different shapes ---------------------------------------


def async_shapes() -> str:
    import torch
    import torch.distributed as dist

    from tandem.comm.agreement.agree import CollectiveMismatchError

    t = torch.ones(1000 + dist.get_rank())
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait()
    except CollectiveMismatchError as error:
        said = str(error)
    else:
        return f"no error; the last element is {t[-1].item()}"
    t = torch.ones(4)
    dist.all_reduce(t, async_op=True).wait()  # the group goes on
    assert t.tolist() == [2.0] * 4, t
    return said


@needs_mpi
def test_an_async_all_reduce_of_other_shapes_raises_at_wait_naming_each_rank():
    for said in run_distributed(async_shapes, 2, backend="mpi"):
        assert "ranks called a collective with different arguments" in said, said
        assert "rank 0: all_reduce(shape=(1000,), dtype=float32, op='sum') (async_op=True)" in said
        assert "rank 1: all_reduce(shape=(1001,), dtype=float32, op='sum') (async_op=True)" in said
        assert "(async_op=True) at test_torch_backend_safety.py:" in said, said  # the line


# --- 4b: a barrier completes earlier work ----------------------------------------------------


def barrier_after_async() -> list[bool]:
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    complete = []
    for _ in range(3):
        t = torch.full((1 << 20,), float(rank + 1))  # 4 MB, never waited for
        dist.all_reduce(t, async_op=True)
        dist.barrier()
        complete.append(bool(torch.all(t == size * (size + 1) / 2)))
    return complete


@needs_mpi
def test_a_barrier_completes_the_async_all_reduce_before_it():
    assert run_distributed(barrier_after_async, 2, backend="mpi") == [[True] * 3] * 2


# --- 4c: point to point ----------------------------------------------------------------------


def mismatched_messages(engine: str) -> list[str]:
    import torch

    from tandem.comm.torch_pg.p2p import MessageMismatchError

    pg = _group(engine)
    rank = pg.rank()
    said = []
    sent = [torch.arange(3.0), torch.arange(3.0), torch.arange(3.0)]
    into = [torch.full((5,), -1.0), torch.zeros(3, dtype=torch.float64), torch.zeros(3)]
    for message, tensor in zip(sent, into, strict=True):
        if rank == 0:
            pg.send([message], 1, 7).wait()
            continue
        try:
            pg.recv([tensor], 0, 7).wait()
        except MessageMismatchError as error:
            said.append(str(error))
        else:
            said.append(f"received {tensor.tolist()}")
    return said


@pytest.mark.parametrize("engine", ENGINES)
def test_a_recv_of_another_size_or_dtype_names_the_sender_and_both_messages(engine):
    said = run_distributed(mismatched_messages, 2, backend=engine, args=(engine,))[1]
    assert said[0].startswith("recv on rank 1 from rank 0 (tag 7): rank 0 sent 3 elements of "
                              "float32 (shape (3,)), but this rank expected 5 elements of "
                              "float32 (shape (5,))"), said[0]
    assert ("rank 0 sent 3 elements of float32 (shape (3,)), but this rank expected 3 elements "
            "of float64 (shape (3,))") in said[1], said[1]
    assert "Receive into a tensor of the sent size and dtype" in said[1]
    assert said[2] == "received [0.0, 1.0, 2.0]"  # nothing stale left between the two ranks


# --- 10: torch's DDP, one rank skips a backward ----------------------------------------------


def ddp_skip(engine: str) -> str:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    pg = _group(engine)
    rank = pg.rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=pg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Rank 1 skips step 1 (its loss "is not finite") and runs one step more, so that both
    # make four backwards: without the check they would finish, one step apart.
    for step in range(5 if rank == 1 else 4):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if rank == 1 and step == 1:
            continue
        try:
            loss.backward()
        except Exception as error:  # noqa: BLE001 - what backward raised, shown as it is
            return f"step {step}: {type(error).__name__}: {error}"
        optimizer.step()
    return "trained on"


@pytest.mark.parametrize("engine", ENGINES)
def test_torch_ddp_names_the_rank_that_skipped_a_backward(engine):
    said = run_distributed(ddp_skip, 2, backend=engine, args=(engine,))
    assert said[0].startswith("step 1: DivergedError") and said[1].startswith("step 2: "), said
    for text in said:
        assert "the ranks are reducing the gradients of different steps" in text, text
        # The counts are the group's since it was made: a shared world may have run DDP before.
        zero = re.search(r"rank 0: torch DDP gradient reduction #(\d+) after (\d+) training "
                         r"forwards", text)
        one = re.search(r"rank 1: torch DDP gradient reduction #(\d+) after (\d+) training "
                        r"forwards", text)
        assert zero and one, text
        assert zero.group(1) == one.group(1) and int(one.group(2)) == int(zero.group(2)) + 1, text
        assert "rank 1 skipped the backward (and optimizer step) of its training forward #" in text
        assert "td.all_finite(loss)" in text


def ddp_operations(engine: str) -> list[int]:
    """(DDP's buckets, engine operations of each of four steps), counted by the watchdog."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from tandem import runtime

    pg = _group(engine)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    model = DistributedDataParallel(layers, process_group=pg, bucket_cap_mb=0.017)
    issued = []
    for _ in range(4):  # (DDP rebuilds its buckets at the second forward)
        before = sum(runtime.get_backend().watchdog._issued.values())
        model(torch.randn(4, 64)).sum().backward()
        issued.append(sum(runtime.get_backend().watchdog._issued.values()) - before)
    return [len(model.reducer._get_zeros_like_grad_buckets()), *issued]


@needs_mpi
def test_torch_ddp_agrees_once_per_backward_not_once_per_bucket():
    buckets, *issued = run_distributed(ddp_operations, 2, backend="mpi", args=("mpi",))[0]
    assert buckets >= 2, buckets
    assert issued[2:] == [buckets + 1] * 2, (buckets, issued)  # the buckets and one agreement
