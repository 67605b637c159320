"""`tandem.horovod` keeps Horovod's names and semantics, across real processes."""

import pytest
import torch

import tandem as td
import tandem.horovod as hvd
from tandem import runtime
from tandem.testing import run_distributed


def check_horovod_collectives():
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (me, n, 0, 1)
    mine = torch.tensor([float(me), 10.0])
    mean = (n - 1) / 2

    assert hvd.allreduce(mine).tolist() == [mean, 10.0]  # Average is the default
    assert hvd.allreduce(mine, op=hvd.Sum).tolist() == [sum(range(n)), 10.0 * n]
    assert hvd.allreduce(mine, average=False).tolist() == [sum(range(n)), 10.0 * n]
    assert hvd.allreduce(mine, compression=hvd.Compression.fp16).dtype == torch.float32
    scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert scaled.tolist() == [sum(range(n)), 10.0 * n]
    assert mine.tolist() == [float(me), 10.0]  # out-of-place calls leave the input alone

    inplace = mine.clone()
    hvd.allreduce_(inplace)
    assert inplace.tolist() == [mean, 10.0]
    handle = hvd.allreduce_async(mine, op=hvd.Max)
    assert hvd.synchronize(handle).tolist() == [n - 1.0, 10.0] and hvd.poll(handle)
    handle = hvd.allreduce_async_(mine.clone(), op=hvd.Sum, postscale_factor=2.0)
    assert hvd.synchronize(handle).tolist() == [2.0 * sum(range(n)), 20.0 * n]

    assert [t.tolist() for t in hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)] == [
        [sum(range(n)), 10.0 * n], [2.0 * sum(range(n)), 20.0 * n]]
    assert hvd.allgather(torch.full((me + 1,), float(me))).tolist() == [
        float(r) for r in range(n) for _ in range(r + 1)]
    root = n - 1
    assert hvd.broadcast(mine, root_rank=root).tolist() == [float(root), 10.0]
    into = mine.clone()
    hvd.broadcast_(into, root_rank=root)
    assert into.tolist() == [float(root), 10.0]

    rows = torch.arange(2 * n, dtype=torch.float32) + 100 * me
    output = hvd.alltoall(rows)  # without splits: the tensor alone, as in Horovod
    assert output.tolist() == [100.0 * r + 2 * me + k for r in range(n) for k in range(2)]
    splits = torch.tensor([1 + (j == me) for j in range(n)], dtype=torch.int32)
    output, received = hvd.alltoall(torch.arange(n + 1.0) + 100 * me, splits)
    assert received.tolist() == [1 + (j == me) for j in range(n)]  # what each rank sent here
    assert output.shape[0] == n + 1
    reduced = hvd.reducescatter(torch.ones(2 * n) * (me + 1))
    assert reduced.tolist() == [(n + 1) / 2] * 2
    # A first dimension not divisible by the size: the first rows % n ranks get one row more.
    uneven = hvd.reducescatter(torch.arange(2 * n + 1.0).unsqueeze(1), op=hvd.Sum)
    start = 3 * me if me == 0 else 2 * me + 1
    assert uneven.squeeze(1).tolist() == [float(n * k) for k in range(start, start + 2 + (me == 0))]
    # Integers: int16 widened for Gloo; pre/postscale in float64, then truncated, as Horovod.
    shorts = hvd.allreduce(torch.tensor([300, -7], dtype=torch.int16), op=hvd.Sum)
    assert shorts.dtype == torch.int16 and shorts.tolist() == [300 * n, -7 * n]
    scaled = hvd.allreduce(torch.tensor([10, -10]), op=hvd.Sum, prescale_factor=0.55)
    assert scaled.tolist() == [5 * n, -5 * n]
    assert hvd.allreduce(torch.tensor([n - 1 + me]), op=hvd.Average).tolist() == [(3 * n - 3) // 2]
    grouped = hvd.grouped_reducescatter([torch.ones(n, 2), torch.ones(2 * n)], op=hvd.Sum)
    assert [g.tolist() for g in grouped] == [[[float(n)] * 2], [float(n)] * 2]
    gathered = hvd.grouped_allgather([torch.tensor([me]), torch.tensor([[me, me]])])
    assert gathered[0].tolist() == list(range(n)) and gathered[1].shape == (n, 2)

    assert hvd.broadcast_object({"me": me}, root_rank=root) == {"me": root}
    assert hvd.allgather_object(me) == list(range(n))
    hvd.barrier()


def test_horovod_collectives():
    run_distributed(check_horovod_collectives, world_size=2)
    run_distributed(check_horovod_collectives, world_size=3)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator)


def check_horovod_training_script():
    """A typical horovod.torch script, unchanged but for the import, equals one process."""
    hvd.init()
    model = _model(seed=hvd.rank())  # different starts: broadcast fixes them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, op=hvd.Sum)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = _model(seed=0)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    n, me = hvd.size(), hvd.rank()
    for step in range(5):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for half in range(2):  # backward_passes_per_step=2: reduce once per two passes
            x, y = _batch(10 * step + half, rows=4 * n)
            shard = slice(4 * me, 4 * me + 4)
            # op=Sum of per-rank means: scale each rank's loss by 1/n to get the global mean.
            (torch.nn.functional.mse_loss(model(x[shard]), y[shard]) / n).backward()
            torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        ref_optimizer.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6), name

    # hvd.join(): the last rank runs out of data one step after the others, which answer its
    # reductions from join() until it joins too; every rank learns who was last.
    if me == n - 1:
        for half in range(2):
            x, y = _batch(100 + half, rows=4)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert hvd.join() == n - 1

    # hvd.SyncBatchNorm: the statistics of the whole batch, as one process would compute them.
    # float32 sums in a different order: ~1e-7 apart (tests/test_sync_batchnorm.py: the hard cases).
    torch.manual_seed(0)
    full = torch.randn(4 * n, 3) * 3 + 1
    sync_bn, plain_bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    out = sync_bn(full[4 * me : 4 * me + 4])
    expected = plain_bn(full)[4 * me : 4 * me + 4]
    assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()
    assert torch.allclose(sync_bn.running_mean, plain_bn.running_mean, atol=1e-6)
    assert torch.allclose(sync_bn.running_var, plain_bn.running_var, atol=1e-5)


def test_horovod_training_script_matches_one_process():
    run_distributed(check_horovod_training_script, world_size=2)


def check_horovod_contracts():
    """Horovod's contracts beyond the arithmetic: errors, names, posting order, join, sets."""
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    assert hvd.gloo_built() and not hvd.ccl_built() and not hvd.nccl_built()
    assert hvd.mpi_enabled() == (runtime.get_backend().name == "mpi") != hvd.gloo_enabled()

    # int16, which Gloo lacks, works in tandem's own collectives (carried as int32 on Gloo).
    shorts = torch.tensor([me, -300], dtype=torch.int16)
    assert td.allgather(shorts).tolist() == [v for r in range(n) for v in (r, -300)]
    assert td.broadcast(shorts, root=n - 1).tolist() == [n - 1, -300]
    assert td.allreduce(shorts, op="max").dtype == torch.int16
    assert td.reducescatter(torch.full((n,), 2, dtype=torch.int16)).tolist() == [2 * n]
    assert td.alltoall(torch.arange(n, dtype=torch.int16)).tolist() == [me] * n

    # A mismatch is a RuntimeError (Horovod's contract) and a td.CollectiveMismatchError.
    for bad in (lambda: hvd.allreduce(torch.zeros(3 + me)),
                lambda: hvd.allgather(torch.zeros(2, 1 + me)),
                lambda: hvd.broadcast(torch.zeros(2), root_rank=me)):
        with pytest.raises(RuntimeError, match="different arguments") as raised:
            bad()
        assert isinstance(raised.value, td.CollectiveMismatchError)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]  # the job goes on

    # name=: a second operation with the name of one in flight is refused on this rank. Posted
    # operations start only when needed, so rank 0 may post one and then meet the others in a
    # barrier before they post theirs.
    if me == 0:
        first = hvd.allreduce_async(torch.ones(2), name="grads")
        with pytest.raises(ValueError, match="'grads' is already in flight"):
            hvd.allreduce_async(torch.ones(2), name="grads")
    hvd.barrier()
    if me != 0:
        first = hvd.allreduce_async(torch.ones(2), name="grads")
    assert hvd.synchronize(first).tolist() == [1.0, 1.0]
    hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="grads"))  # free again

    # join: the ranks that joined answer allreduces with zeros; other collectives fail on the
    # ranks still running, with the reason; every rank learns the last rank to join.
    for first_out in range(n):
        if me == first_out:
            last = hvd.join()
        else:
            assert hvd.allreduce(torch.full((3,), 6.0 * n), op=hvd.Sum).tolist() == [6.0 * n * (n - 1)] * 3
            with pytest.raises(RuntimeError, match="called hvd.join"):
                hvd.allgather(torch.ones(1))
            last = hvd.join()
        assert last != first_out and hvd.allgather_object(last) == [last] * n

    # Process sets: a td.new_group each; every rank adds and removes them.
    evens = hvd.add_process_set(range(0, n, 2))
    odds = hvd.add_process_set(range(1, n, 2))
    mine = evens if me % 2 == 0 else odds
    assert mine.included() and mine.size() == len(mine.ranks) and mine.ranks.index(me) == mine.rank()
    assert hvd.allreduce(torch.tensor([me]), op=hvd.Sum, process_set=mine).tolist() == [sum(mine.ranks)]
    assert hvd.allgather_object(me, process_set=mine) == mine.ranks
    with pytest.raises(ValueError, match="not in"):
        hvd.allreduce(torch.ones(1), process_set=odds if mine is evens else evens)
    assert hvd.remove_process_set(odds) and hvd.remove_process_set(evens)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=evens)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)


def check_horovod_timeline(path):
    """hvd.start_timeline: Horovod's trace format, one file per rank here."""
    import json

    hvd.init()
    mine = f"{path}.{hvd.rank()}"
    hvd.start_timeline(mine, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="loss")
    hvd.stop_timeline()
    with open(mine) as trace:
        text = trace.read()
    events = json.loads(text)
    assert {"allreduce.loss"} <= {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= {e["name"] for e in events}
    assert "start_time_since_epoch_in_micros" in text


def check_horovod_gradients():
    """Backward through the collectives follows Horovod's conventions, not the local derivative."""
    hvd.init()
    n, me = hvd.size(), hvd.rank()

    def grad_of(collective, rows=2 * n):
        x = torch.full((rows, 2), float(me + 1), requires_grad=True)
        out = collective(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * (me + 1)).sum().backward()  # a different upstream gradient on every rank
        return x.grad[:, 0].tolist()

    weights = sum(range(1, n + 1))
    assert grad_of(lambda x: hvd.allreduce(x, op=hvd.Sum)) == [float(weights)] * (2 * n)
    assert grad_of(lambda x: hvd.allreduce(x)) == [weights / n] * (2 * n)
    # allgather and broadcast average the gradient over the ranks (Horovod's choice).
    assert grad_of(lambda x: hvd.allgather(x)) == [weights / n] * (2 * n)
    root = n - 1
    expected = [weights / n if me == root else 0.0] * (2 * n)
    assert grad_of(lambda x: hvd.broadcast(x, root_rank=root)) == expected
    # alltoall sends each gradient row back where its row came from.
    assert grad_of(lambda x: hvd.alltoall(x)) == [float(j // 2 + 1) for j in range(2 * n)]
    # reducescatter: allgather of the gradient, times the size (Horovod's convention).
    assert grad_of(lambda x: hvd.reducescatter(x, op=hvd.Sum)) == [
        float(n * (j // 2 + 1)) for j in range(2 * n)]


def test_horovod_contracts_and_gradients(tmp_path):
    for world_size in (2, 3):
        run_distributed(check_horovod_contracts, world_size=world_size)
    run_distributed(check_horovod_gradients, world_size=3)
    run_distributed(check_horovod_timeline, world_size=2, args=(str(tmp_path / "trace.json"),))


def test_horovod_on_mpi():
    pytest.importorskip("mpi4py")
    run_distributed(check_horovod_collectives, world_size=2, backend="mpi")
    run_distributed(check_horovod_contracts, world_size=2, backend="mpi")


def test_tandem_run_takes_horovodrun_command_forms(tmp_path):
    """`tandem run -np 2 /abs/python script.py` (a command run as given) and HOROVOD_* variables."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tandem.launch.config import is_command

    root = Path(__file__).resolve().parents[1]
    plain = tmp_path / "train"
    plain.write_text("print('hi')\n")
    assert is_command(sys.executable) and is_command("python3") and is_command("env")
    assert not is_command("train.py") and not is_command(str(plain))
    assert not is_command("no_such_program_here")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo", sys.executable,
         str(root / "tests" / "scripts" / "horovod_script.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for r in range(2):
        assert f"[{r}] horovod rank {r} of 2: sum 3" in done.stdout, done.stdout


def check_horovod_optimizer_details():
    """What Horovod scripts touch on the optimizer besides step(): names, warnings, sparse grads."""
    import warnings

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    net1, net2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    both = torch.optim.SGD([*net1.parameters(), *net2.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="duplicates: bias, weight"):
        hvd.DistributedOptimizer(both, named_parameters=[*net1.named_parameters(),
                                                         *net2.named_parameters()])
    with pytest.raises(ValueError, match="misses 2 of the optimizer's parameters"):
        hvd.DistributedOptimizer(both, named_parameters=net1.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net1.parameters(), lr=0.1))
    assert sorted(opt._parameter_names.values()) == ["allreduce.noname.0", "allreduce.noname.1"]

    # synchronize() then step() outside skip_synchronize() warns, as in Horovod.
    net1(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        net1(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()

    # Compression objects: compress/decompress as Horovod's, integers untouched.
    wire, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert wire.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(wire, ctx).dtype == torch.float64
    assert hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.int32))[0].dtype == torch.int32

    # Sparse gradients (nn.Embedding(sparse=True) with SparseAdam): averaged, handed back sparse.
    embedding = torch.nn.Embedding(4, 1, sparse=True)
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters())),
                                          named_parameters=embedding.named_parameters())
    embedding(torch.tensor([me % 4, 3])).sum().backward()
    sparse_opt.step()
    grad = embedding.weight.grad
    assert grad.is_sparse
    expected = [sum((r % 4 == row) + (row == 3) for r in range(n)) / n for row in range(4)]
    assert grad.to_dense()[:, 0].tolist() == expected


def test_horovod_optimizer_details():
    run_distributed(check_horovod_optimizer_details, world_size=2)
