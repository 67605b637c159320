"""Data parallelism against one process: the central correctness test of tandem.

With op="mean" and equal shards, k ranks with per-rank batch B/k must end with the parameters
of one process trained with batch B. Every check computes that single-process reference
inside the worker (models and data are seeded functions of this module), trains the
distributed version next to it, and returns the largest parameter difference per case; the
test then compares them with the tolerances below. Tiny bucket caps force several buckets,
so the ordering and forced-launch paths are exercised too.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.parallel.data_parallel.compression import PowerSGD
from tandem.parallel.data_parallel.reducer import GradientLayoutError
from tandem.testing import run_distributed

B = 8  # global batch: divisible by 1, 2 and 4 ranks
STEPS = 20
SMALL_BUCKETS = {"bucket_mb": 2 / 1024, "first_bucket_mb": 0.5 / 1024}  # 2 KB / 512 B: many buckets
# float32 rounding (sums over B vs over B/k, in another order) stays below this after 20 steps.
TOL = 1e-5
# bf16 keeps 8 mantissa bits: each averaged gradient element is off by up to 2^-9 of itself,
# i.e. ~0.2% of a step; over 20 steps of lr 0.05 on O(1) gradients the parameters drift by ~1e-3.
TOL_BF16 = 5e-3
# fp16 has 11 mantissa bits, but gradients divided by the group size fall partly below 6e-5,
# where fp16 is subnormal and loses digits: measured ~1.3e-4, so 5e-4 leaves a 4x margin.
TOL_FP16 = 5e-4


# -- models and data: module level, so that every rank and the reference build the same ----


class Branchy(nn.Module):
    """An MLP with a second head that only some samples (or none) go through."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)
        self.extra = nn.Linear(16, 5)

    def forward(self, x, mask=None):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        if mask is not None:  # no sample uses it: `extra` is not in the graph at all
            out = out + self.extra(h) * mask[:, None]
        return out


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def cnn():
    # No conv bias before BatchNorm: its exact gradient is 0, and Adam would turn the rounding
    # noise around that 0 into full-size steps whose sign differs between runs.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def branchy():
    torch.manual_seed(0)
    return Branchy()


def batch(kind, step, size=B):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 3, 6, 6, generator=g) if kind == "cnn" else torch.randn(size, 12, generator=g)
    return x, torch.randint(0, 5, (size,), generator=g)


def shard(tensor, rank, k):
    n = tensor.shape[0] // k
    return tensor[rank * n:(rank + 1) * n]


def extra_users(step, k):
    """Ranks whose samples use Branchy.extra this step: none, only rank 0, or all."""
    return [[], [0], list(range(k))][step % 3]


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=1e-2)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = list(zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)


def run_case(kind, opt_name, *, accumulate=1, compression=None, wrapper="optimizer"):
    """Train distributed and single-process side by side; return the max parameter difference."""
    rank, k = td.rank(), td.size()
    build = {"mlp": mlp, "cnn": cnn, "branchy": branchy}[kind]
    reference, model = build(), build()
    if kind == "cnn":
        model = td.SyncBatchNorm.convert(model)
    ref_opt = make_optimizer(opt_name, reference.parameters())
    if wrapper == "ddp":
        model = td.DistributedDataParallel(model, compression=compression, **SMALL_BUCKETS)
        opt = make_optimizer(opt_name, model.parameters())
    else:
        opt = td.DistributedOptimizer(
            make_optimizer(opt_name, model.parameters()), named_parameters=model.named_parameters(),
            compression=compression, accumulate=accumulate, **SMALL_BUCKETS)
    data_kind = "cnn" if kind == "cnn" else "mlp"
    for step in range(STEPS):
        x, y = batch(data_kind, step)
        mask_all = None
        if kind == "branchy":
            users = extra_users(step, k)
            mask_all = torch.cat([torch.full((B // k,), float(r in users)) for r in range(k)])
            if not users:
                mask_all = None
        ref_opt.zero_grad()
        args = (x,) if mask_all is None else (x, mask_all)
        F.cross_entropy(reference(*args), y).backward()
        ref_opt.step()

        xs, ys = shard(x, rank, k), shard(y, rank, k)
        opt.zero_grad()
        micro = xs.shape[0] // accumulate
        for m in range(accumulate):
            xm, ym = xs[m * micro:(m + 1) * micro], ys[m * micro:(m + 1) * micro]
            if kind == "branchy" and rank in extra_users(step, k):
                out = model(xm, torch.ones(xm.shape[0]))
            else:
                out = model(xm)
            (F.cross_entropy(out, ym) / accumulate).backward()
        opt.step()
    inner = model.module if wrapper == "ddp" else model
    return max_diff(inner, reference)


CASES = {
    "mlp-sgd": dict(kind="mlp", opt_name="sgd"),
    "mlp-adam": dict(kind="mlp", opt_name="adam"),
    "cnn-syncbn-sgd": dict(kind="cnn", opt_name="sgd"),
    "cnn-syncbn-adam": dict(kind="cnn", opt_name="adam"),
    "mlp-sgd-accumulate2": dict(kind="mlp", opt_name="sgd", accumulate=2),
    "unused-param-sgd": dict(kind="branchy", opt_name="sgd"),
    "unused-param-adam": dict(kind="branchy", opt_name="adam"),
    "ddp-wrapper-mlp-sgd": dict(kind="mlp", opt_name="sgd", wrapper="ddp"),
    "ddp-wrapper-cnn-adam": dict(kind="cnn", opt_name="adam", wrapper="ddp"),
    "mlp-sgd-bf16": dict(kind="mlp", opt_name="sgd", compression="bf16"),
    "mlp-sgd-fp16": dict(kind="mlp", opt_name="sgd", compression="fp16"),
}
TOLERANCES = {"mlp-sgd-bf16": TOL_BF16, "mlp-sgd-fp16": TOL_FP16}


def check_equivalence():
    return {name: run_case(**case) for name, case in CASES.items()}


@pytest.mark.timeout(240)
# (A world of one is not a case: there the wrapper adds nothing and would compare SGD with SGD.)
@pytest.mark.parametrize("world_size", [2, 4])
def test_equivalence_with_one_process(world_size):
    results = run_distributed(check_equivalence, world_size=world_size, timeout=200)
    failures = [
        f"rank {rank} {name}: max |difference| {diff:.3g} > {TOLERANCES.get(name, TOL)}"
        for rank, diffs in enumerate(results)
        for name, diff in diffs.items()
        if not diff <= TOLERANCES.get(name, TOL)
    ]
    assert not failures, "\n".join(failures)


# -- PowerSGD: trains, and the replicas stay identical --------------------------------------


def check_powersgd():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    results = {}
    for label, compression in [("rank2", PowerSGD(rank=2, start_iter=2)), ("default", "powersgd")]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      compression=compression, bucket_mb=0.01)
        losses = []
        for step in range(60):
            g = torch.Generator().manual_seed(step * 10 + td.rank())
            x = torch.randn(16, 32, generator=g)
            with torch.no_grad():
                y = 3 * teacher(x)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = td.allgather(flat[None])
        identical = all(torch.equal(gathered[0], row) for row in gathered)
        results[label] = (sum(losses[:5]) / 5, sum(losses[-5:]) / 5, identical)
    return results


@pytest.mark.timeout(120)
def test_powersgd_trains_and_replicas_agree():
    for rank, results in enumerate(run_distributed(check_powersgd, world_size=2, timeout=100)):
        for label, (first, last, identical) in results.items():
            assert identical, f"rank {rank} {label}: replicas differ after PowerSGD steps"
            # Uncompressed training reaches ~0.25x in these 60 steps, rank 1 PowerSGD ~0.35x.
            assert last < 0.6 * first, f"rank {rank} {label}: loss went {first:.4f} -> {last:.4f}"


# -- join: uneven numbers of batches -----------------------------------------------------------

BATCHES = [5, 2, 4, 0]  # per rank (world of 4); per-rank batch 2


def check_join(wrapper):
    rank, k = td.rank(), td.size()
    counts = BATCHES[:k]
    reference, model = mlp(), mlp()
    ref_opt = make_optimizer("sgd", reference.parameters())
    if wrapper == "ddp":
        net = td.DistributedDataParallel(model, **SMALL_BUCKETS)
        opt = make_optimizer("sgd", net.parameters())
        joinable = (net, opt)  # the optimizer too, so that its momentum is synced at the end
    elif wrapper == "horovod":
        return check_join_after_loop(rank, k, counts, reference, ref_opt, model)
    else:
        net = model
        opt = td.DistributedOptimizer(make_optimizer("sgd", model.parameters()), **SMALL_BUCKETS)
        joinable = (opt,)
    # The reference trains on the union of the samples of the ranks that still have data, then
    # one more step with every rank's (the step after the join block).
    steps = [*range(max(counts)), 99]
    for step in steps:
        x, y = batch("mlp", step, size=2 * k)
        active = [r for r in range(k) if counts[r] > step or step == 99]
        ref_opt.zero_grad()
        F.cross_entropy(reference(torch.cat([shard(x, r, k) for r in active])),
                        torch.cat([shard(y, r, k) for r in active])).backward()
        ref_opt.step()
    with td.join(*joinable):
        for step in range(counts[rank]):
            x, y = batch("mlp", step, size=2 * k)
            opt.zero_grad()
            F.cross_entropy(net(shard(x, rank, k)), shard(y, rank, k)).backward()
            opt.step()
    # After the block the replicas (parameters and momentum) are equal again and a plain step
    # works: nothing of the join is left behind.
    x, y = batch("mlp", 99, size=2 * k)
    opt.zero_grad()
    F.cross_entropy(net(shard(x, rank, k)), shard(y, rank, k)).backward()
    opt.step()
    return max_diff(model, reference)


def check_join_after_loop(rank, k, counts, reference, ref_opt, model):
    """`td.join()` after the loop: the ranks out of data count as zero gradients."""
    opt = td.DistributedOptimizer(make_optimizer("sgd", model.parameters()), **SMALL_BUCKETS)
    for step in range(max(counts)):
        x, y = batch("mlp", step, size=2 * k)
        active = [r for r in range(k) if counts[r] > step]
        ref_opt.zero_grad()
        loss = F.cross_entropy(reference(torch.cat([shard(x, r, k) for r in active])),
                               torch.cat([shard(y, r, k) for r in active]))
        (loss * len(active) / k).backward()  # the group's mean, with zeros for the others
        ref_opt.step()
    for step in range(counts[rank]):
        x, y = batch("mlp", step, size=2 * k)
        opt.zero_grad()
        F.cross_entropy(model(shard(x, rank, k)), shard(y, rank, k)).backward()
        opt.step()
    last = td.join()
    return last, max_diff(model, reference)


def check_join_syncbn_refuses():
    model = td.SyncBatchNorm.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with td.join(opt):
            model(torch.randn(4, 4))
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(150)
def test_join_with_uneven_batches():
    for wrapper in ["optimizer", "ddp"]:
        diffs = run_distributed(check_join, world_size=4, args=(wrapper,), timeout=120)
        assert max(diffs) <= TOL, f"{wrapper}: per-rank max |difference| {diffs}"
    # Without arguments, after the loop: only the last rank to join holds the final model.
    results = run_distributed(check_join, world_size=4, args=("horovod",), timeout=120)
    last = BATCHES.index(max(BATCHES))
    assert [r[0] for r in results] == [last] * 4, results
    assert results[last][1] <= TOL, results
    messages = run_distributed(check_join_syncbn_refuses, world_size=2)
    assert all("SyncBatchNorm cannot synchronise inside td.join()" in m for m in messages), messages


# -- misuse: clear errors, not hangs or garbage ------------------------------------------------


def expect_error(kind, fragment, action):
    try:
        action()
    except kind as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return str(error)
    raise AssertionError(f"expected {kind.__name__} containing {fragment!r}")


def check_errors():
    rank = td.rank()
    messages = {}
    model = mlp()
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **SMALL_BUCKETS)
    x, y = batch("mlp", 0, size=4)

    # When backward() returns the gradients are averaged: zero_grad() is legal right after it
    # (discarding the step, as in one process) and leaves nothing in flight.
    F.cross_entropy(model(x), y).backward()
    averaged = [p.grad.clone() for p in model.parameters()]
    gathered = td.allgather(torch.cat([g.reshape(-1) for g in averaged])[None])
    assert torch.equal(gathered[0], gathered[-1]), "gradients differ between ranks after backward()"
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.synchronize()  # nothing left to do: a no-op, not a second reduction
    assert all(p.grad is None for p in model.parameters())

    # A second backward with accumulate=1 reduces again (as torch DDP does): the gradient is the
    # average of both passes' sums, equal on every rank.
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    twice = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    expected = 2 * torch.cat([g.reshape(-1) for g in averaged])
    messages["twice"] = float((twice - expected).abs().max())
    opt.step()

    # A model with another shape on rank 1: an error on every rank, naming both.
    other = nn.Linear(12, 6 if rank == 1 else 5)
    messages["shape"] = expect_error(
        GradientLayoutError, "rank 1",
        lambda: td.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                        named_parameters=other.named_parameters()))
    assert "(6, 12)" in messages["shape"] and "(5, 12)" in messages["shape"], messages["shape"]

    # Arguments checked before any communication.
    expect_error(ValueError, "unknown compression", lambda: td.DistributedOptimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), compression="zip"))
    expect_error(ValueError, "op must be", lambda: td.DistributedOptimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), op="max"))
    expect_error(ValueError, "already reduced", lambda: td.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1)))

    # It is an Optimizer for LR schedulers, and its state dict is the inner one's.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.load_state_dict(opt.state_dict())
    stats = opt.last_step_stats
    assert stats is not None and stats.comm_wait_s >= 0 and stats.optimizer_s >= 0
    assert stats.bytes_reduced > 0
    return messages


def check_no_sync_equals_accumulate():
    """Two backward passes per step, reduced once: accumulate=2, no_sync(), and the wrapper's."""
    rank, k = td.rank(), td.size()
    models = {"accumulate": mlp(), "no_sync": mlp(), "ddp_no_sync": mlp()}
    wrapped = td.DistributedDataParallel(models["ddp_no_sync"], **SMALL_BUCKETS)
    opts = {
        "accumulate": td.DistributedOptimizer(make_optimizer("sgd", models["accumulate"].parameters()),
                                              accumulate=2, **SMALL_BUCKETS),
        "no_sync": td.DistributedOptimizer(make_optimizer("sgd", models["no_sync"].parameters()),
                                           **SMALL_BUCKETS),
        "ddp_no_sync": make_optimizer("sgd", wrapped.parameters()),
    }
    nets = {"accumulate": models["accumulate"], "no_sync": models["no_sync"], "ddp_no_sync": wrapped}
    for step in range(5):
        x, y = batch("mlp", step, size=4 * k)
        xs, ys = shard(x, rank, k), shard(y, rank, k)
        for name, net in nets.items():
            opts[name].zero_grad()
            first_pass = {"accumulate": contextlib.nullcontext(), "no_sync": opts["no_sync"].no_sync(),
                          "ddp_no_sync": wrapped.no_sync()}[name]
            with first_pass:
                F.cross_entropy(net(xs[:2]), ys[:2]).backward()
            F.cross_entropy(net(xs[2:]), ys[2:]).backward()
            opts[name].step()
    return max(max_diff(models["accumulate"], models[name]) for name in ("no_sync", "ddp_no_sync"))


@pytest.mark.timeout(120)
def test_errors_and_no_sync():
    results = run_distributed(check_errors, world_size=2, timeout=100)
    for messages in results:
        assert "rank 0" in messages["shape"] and "rank 1" in messages["shape"]
        assert messages["twice"] <= 1e-6, messages["twice"]
    diffs = run_distributed(check_no_sync_equals_accumulate, world_size=2)
    assert max(diffs) == 0.0, diffs


# -- the same reducer over MPI (mpi4py) ---------------------------------------------------------


def check_over_mpi():
    results = {name: run_case(**CASES[name]) for name in ("mlp-sgd", "cnn-syncbn-sgd", "unused-param-sgd")}
    results["join"] = check_join("optimizer")
    return results


@pytest.mark.timeout(150)
def test_equivalence_over_mpi():
    pytest.importorskip("mpi4py")
    for rank, diffs in enumerate(run_distributed(check_over_mpi, world_size=2, backend="mpi", timeout=120)):
        assert max(diffs.values()) <= TOL, f"rank {rank}: {diffs}"
