"""`td.Pipeline` against a single-process run of the same seeded model, on real Gloo ranks.

Each rank builds the reference model and data from the same seeds, computes the full-batch
loss and gradients in-process, then runs the pipeline and compares its own stage. Models are
float64: micro-batching reorders the batch sums, which in float32 moves gradients by ~1e-7
relative; in float64 the two agree to ~1e-15, so the 1e-9 tolerance checks the algorithm, not
the rounding. One `run_distributed` per world size loops over every configuration and reports
all mismatches at once.
"""

import itertools
import time

import pytest
import torch
from torch import nn

import tandem as td
from tandem.parallel.pipeline.balance import (
    TIME_REPEATS,
    _copied,
    _detached,
    check_counts,
    param_costs,
    partition,
    starts_in_place,
    time_costs,
)
from tandem.parallel.pipeline.edges import EdgeSpec
from tandem.testing import run_distributed

TOL = 1e-9


# -- models -------------------------------------------------------------------------------

class Fork(nn.Module):
    """Returns a tuple: two tensors that carry gradient, one unused downstream (its gradient is
    zero), one that does not require grad, and an integer tensor."""

    def forward(self, x):
        rows = (x[:, 0] > 0).long()  # per row, so micro-batching does not change it
        return torch.tanh(x), x * 2.0, x * 3.0, x.detach() + 1.0, rows


class Join(nn.Module):
    def forward(self, parts):
        a, b, _unused, constant, rows = parts
        return a + b * (rows.unsqueeze(1) + 1) * constant


def mlp(layers: int = 6, width: int = 8, seed: int = 0) -> nn.Sequential:
    """Linear / activation layers (ReLU in place, so a stage may start with an in-place op)."""
    torch.manual_seed(seed)
    modules, fan_in = [], 4
    for k in range(layers - 1):
        if k % 2 == 0:
            modules.append(nn.Linear(fan_in, width))
            fan_in = width
        else:
            modules.append(nn.ReLU(inplace=True) if k % 4 == 1 else nn.Tanh())
    modules.append(nn.Linear(fan_in, 3))
    return nn.Sequential(*modules).double()


def forked(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), Fork(), Join(), nn.Linear(8, 3)).double()


def tied() -> nn.Sequential:
    shared = nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(4, 8), shared, nn.ReLU(), shared, nn.Linear(8, 3))


def data(batch: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(batch, 3, generator=generator, dtype=torch.float64)
    return x, y


def reference(build, x, y):
    model = build()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        out = model(x)
    return model, loss.item(), out


def compare(label, pipe, ref_model, ref_loss, loss, problems):
    ref = dict(ref_model.named_parameters())
    for name, param in pipe.named_parameters():
        if name not in ref:
            problems.append(f"{label}: unknown parameter name {name}")
            continue
        err = (param.grad.cpu() - ref[name].grad).abs().max().item()  # stages may be on a GPU
        if err > TOL:
            problems.append(f"{label}: {name}.grad differs by {err:.2e}")
    if pipe.is_last and abs(float(loss) - ref_loss) > TOL:
        problems.append(f"{label}: loss {float(loss)} != {ref_loss}")
    if not pipe.is_last and loss is not None:
        problems.append(f"{label}: stage {pipe.stage_index} returned a loss")


def run_config(build, schedule, chunks, batch, problems, **kwargs):
    label = f"{build.__name__} {schedule} chunks={chunks} batch={batch} {kwargs or ''}"
    x, y = data(batch)
    ref_model, ref_loss, ref_out = reference(build, x, y)
    pipe = td.Pipeline(build(), chunks=chunks, schedule=schedule, **kwargs)
    first, last = pipe.is_first, pipe.is_last
    loss = pipe.train_step(x if first else None, y if last else None, nn.functional.mse_loss)
    compare(label, pipe, ref_model, ref_loss, loss, problems)
    stats = pipe.stats
    out = pipe.forward(x if first else None)
    if last and (out.cpu() - ref_out).abs().max().item() > TOL:
        problems.append(f"{label}: forward output differs")
    if not last and out is not None:
        problems.append(f"{label}: forward returned output on stage {pipe.stage_index}")
    return pipe, stats


# -- equivalence, 2 and 4 stages ------------------------------------------------------------

def check_equivalence():
    p, s = td.size(), td.rank()
    problems, peaks = [], {}
    for schedule in ("1f1b", "gpipe"):
        for chunks in (1, 2, 4, 8):
            for batch in (16, 10):  # 10 rows in 4 or 8 chunks: uneven micro-batches
                pipe, stats = run_config(mlp, schedule, chunks, batch, problems)
                expected = chunks if schedule == "gpipe" else min(p - s, chunks)
                if stats.peak_live_microbatches != expected:
                    problems.append(f"{schedule} chunks={chunks}: peak live "
                                    f"{stats.peak_live_microbatches} != {expected}")
                if batch == 16:
                    peaks[(schedule, chunks)] = stats.peak_activation_bytes
        run_config(forked, schedule, 4, 10, problems)
    # Activation memory: equal micro-batches of 2 rows -> bytes proportional to the live count.
    for chunks in (1, 2, 4, 8):
        per_micro = peaks[("gpipe", chunks)] / chunks
        if per_micro <= 0 or peaks[("1f1b", chunks)] != per_micro * min(p - s, chunks):
            problems.append(f"chunks={chunks}: activation bytes gpipe {peaks[('gpipe', chunks)]} "
                            f"1f1b {peaks[('1f1b', chunks)]}")
    # Balancing by parameters and by time, and an explicit split.
    for balance in ("params", "time", [1] * (p - 1) + [6 - p + 1]):
        kwargs = {"balance": balance}
        if balance == "time":
            kwargs["sample"] = data(8)[0] if s == 0 else None
        pipe, _ = run_config(mlp, "1f1b", 4, 12, problems, **kwargs)
        if sum(pipe.balance) != 6 or len(pipe.balance) != p:
            problems.append(f"balance={balance!r} gave {pipe.balance}")
    # The loss on every rank.
    x, y = data(12)
    pipe = td.Pipeline(mlp(), chunks=3)
    loss = pipe.train_step(x, y, nn.functional.mse_loss, broadcast_loss=True)
    if abs(float(loss) - reference(mlp, x, y)[1]) > TOL:
        problems.append(f"broadcast loss {float(loss)} on stage {s}")
    return problems, pipe.balance


def stage_factories(seed=0):
    """Two stages as factories; only this rank's is built."""
    def first():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double()

    def second():
        torch.manual_seed(seed + 1)
        return nn.Sequential(nn.Linear(8, 3)).double()

    return [first, second]


def check_factories_and_names():
    x, y = data(8)
    built = [f() for f in stage_factories()]
    ref = nn.Sequential(*built)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_loss = ref_loss.item()
    pipe = td.Pipeline(stage_factories(), chunks=2, schedule="gpipe")
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    problems = []
    compare("factories", pipe, ref, ref_loss, loss, problems)
    seq = td.Pipeline(mlp(), chunks=2)
    meta = [n for n, q in mlp().named_parameters()]
    return problems, [n for n, _ in pipe.named_parameters()], [n for n, _ in seq.named_parameters()], meta


@pytest.mark.timeout(240)
def test_two_stages_match_single_process():
    results = run_distributed(check_equivalence, world_size=2, timeout=200)
    for problems, _ in results:
        assert not problems, "\n".join(problems)
    assert results[0][1] == results[1][1]


@pytest.mark.timeout(240)
def test_two_stages_over_mpi():
    pytest.importorskip("mpi4py")
    for problems, _ in run_distributed(check_equivalence, world_size=2, backend="mpi", timeout=200):
        assert not problems, "\n".join(problems)


def test_factories_and_original_names():
    results = run_distributed(check_factories_and_names, world_size=2)
    assert not results[0][0] and not results[1][0], results
    assert results[0][1] == ["0.0.weight", "0.0.bias"]
    assert results[1][1] == ["1.0.weight", "1.0.bias"]
    # Even split of 6 layers: stage 0 keeps 0..2, stage 1 keeps 3..5, with their own names.
    all_names = results[0][3]
    assert results[0][2] + results[1][2] == all_names
    assert results[1][2] == ["4.weight", "4.bias", "5.weight", "5.bias"]


# -- errors -----------------------------------------------------------------------------------

def _error(call):
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def check_errors():
    x, y = data(3)
    first_x = x if td.rank() == 0 else None
    last_y = y if td.rank() == 1 else None
    errors = {
        "sum": _error(lambda: td.Pipeline(mlp(), balance=[2, 2])),
        "zero": _error(lambda: td.Pipeline(mlp(), balance=[6, 0])),
        "entries": _error(lambda: td.Pipeline(mlp(), balance=[2, 2, 2])),
        "layers": _error(lambda: td.Pipeline(nn.Sequential(nn.Linear(4, 3)))),
        "schedule": _error(lambda: td.Pipeline(mlp(), schedule="zigzag")),
        "chunks": _error(lambda: td.Pipeline(mlp(), chunks=0)),
        "time": _error(lambda: td.Pipeline(mlp(), balance="time")),
        "disagree": _error(lambda: td.Pipeline(mlp(), chunks=2 + td.rank())),
        "tied": _error(lambda: td.Pipeline(tied())),
        "factory": _error(lambda: td.Pipeline([lambda: nn.Linear(4, 3), lambda: 3])),
    }
    pipe = td.Pipeline(mlp(), chunks=4)
    errors["small batch"] = _error(lambda: pipe.train_step(first_x, last_y, nn.functional.mse_loss))
    # The refusal reached every stage before anything else was sent: the pipeline still works.
    x, y = data(8)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    return errors, None if loss is None else float(loss)


def test_bad_arguments_raise_on_every_rank():
    results = run_distributed(check_errors, world_size=2)
    for errors, _ in results:
        assert "balance=[2, 2] sums to 4 layers but the model has 6" in errors["sum"], errors
        assert "balance=[6, 0] gives stage(s) [1] no layers" in errors["zero"]
        assert "has 3 entries but the pipeline has 2 stages" in errors["entries"]
        assert "2 stages but the model only 1 layers" in errors["layers"]
        assert "unknown schedule 'zigzag'" in errors["schedule"]
        assert "chunks must be a positive int" in errors["chunks"]
        assert "pass sample=" in errors["time"]
        assert "rank 0 chunks=2, rank 1 chunks=3" in errors["disagree"]
        assert "shares a layer or parameter with another stage" in errors["tied"]
        assert errors["factory"].startswith("TypeError") and "stage 1 returned int" in errors["factory"]
        assert errors["small batch"].startswith("ValueError")
        assert "3 rows" in errors["small batch"] and "chunks=4" in errors["small batch"]
    assert "fewer than chunks=4" in results[0][0]["small batch"]
    assert "stage 0 (rank 0) rejected the input batch" in results[1][0]["small batch"]
    assert results[1][1] == pytest.approx(reference(mlp, *data(8))[1], abs=TOL)


# -- 4 stages, and data × pipeline ------------------------------------------------------------

_meshes = {}


def _distributed_optimizer():
    """tandem's data-parallel optimizer, where it is available."""
    try:
        from tandem.parallel.data_parallel.wrappers import DistributedOptimizer
    except ImportError:
        return None
    return DistributedOptimizer


def check_hybrid(averaging):
    """dp=2 × pp=2: 10 SGD steps equal 10 single-process steps on the whole batch."""
    if "2x2" not in _meshes:
        _meshes["2x2"] = td.mesh(dp=2, pp=2)
    mesh = _meshes["2x2"]
    ref = mlp(layers=4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pipe = td.Pipeline(mlp(layers=4), chunks=2, group=mesh.pp_group)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if averaging.startswith("DistributedOptimizer"):
        # One backward pass per micro-batch; the pipeline has the optimizer reduce after the
        # last by itself, and an explicit accumulate=chunks (the older way) still works.
        extra = {"accumulate": pipe.chunks} if averaging.endswith("chunks") else {}
        opt = _distributed_optimizer()(opt, named_parameters=pipe.named_parameters(),
                                       group=mesh.dp_group, **extra)
    for step in range(10):
        x, y = data(16, seed=100 + step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        # Each replica takes its half of the global batch.
        rows = slice(mesh.dp_rank * 8, (mesh.dp_rank + 1) * 8)
        opt.zero_grad()
        pipe.train_step(x[rows], y[rows], nn.functional.mse_loss)
        if averaging == "allreduce":
            for param in pipe.parameters():
                td.allreduce(param.grad, op="mean", inplace=True, group=mesh.dp_group)
        opt.step()
    reference_params = dict(ref.named_parameters())
    return {n: (q - reference_params[n]).abs().max().item() for n, q in pipe.named_parameters()}


@pytest.mark.timeout(300)
def test_four_stages_and_hybrid_2x2():
    results = run_distributed(check_equivalence, world_size=4, timeout=260)
    for problems, _ in results:
        assert not problems, "\n".join(problems)
    ways = ["allreduce"] + (["DistributedOptimizer", "DistributedOptimizer accumulate=chunks"]
                            if _distributed_optimizer() else [])
    for averaging in ways:
        results = run_distributed(check_hybrid, world_size=4, args=(averaging,))
        names = set()
        for errors in results:
            names |= set(errors)
            assert max(errors.values()) < TOL, (averaging, errors)
        assert names == {f"{k}.{w}" for k in (0, 2, 3) for w in ("weight", "bias")}


# -- pure helpers ------------------------------------------------------------------------------

def test_partition_balances_costs():
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([10, 0, 10, 0], 2) == [2, 2]  # a free layer stays with its neighbour
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]
    assert sum(partition([0.0] * 7, 3)) == 7
    assert param_costs([nn.Linear(4, 8), nn.ReLU()]) == [40.0, 0.0]
    with pytest.raises(ValueError, match="3 stages but the model only 2 layers"):
        partition([1, 1], 3)
    with pytest.raises(TypeError, match="list of layer counts"):
        check_counts(["a", 1], 2, 2)


def _best_split(costs, stages):
    """Brute force: every contiguous split, the lowest (bottleneck, sum of squared stage costs,
    sum of squared counts) first, as `partition` promises."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        parts = [costs[a:b] for a, b in itertools.pairwise(bounds)]
        sums = [sum(part) for part in parts]
        score = (max(sums), sum(c * c for c in sums), sum(len(part) ** 2 for part in parts))
        if best is None or score < best[0]:
            best = (score, [len(part) for part in parts])
    return best


def test_partition_finds_the_cheapest_bottleneck_then_the_most_even_split():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 9, (1,), generator=generator))
        stages = int(torch.randint(1, n + 1, (1,), generator=generator))
        # Quarter units: sums are exact, so ties are real ties; zeros are free layers.
        costs = (torch.randint(0, 6, (n,), generator=generator) / 4).tolist()
        score, _ = _best_split(costs, stages)
        counts = partition(costs, stages)
        assert len(counts) == stages and min(counts) >= 1 and sum(counts) == n, (costs, counts)
        bounds = list(itertools.accumulate([0, *counts]))
        sums = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        got = (max(sums), sum(c * c for c in sums), sum(c * c for c in counts))
        assert got == score, (trial, costs, stages, counts)
    assert partition([0.1, 0.5, 0.2, 0.3], 2) == [2, 2]  # costs below 1 are not rounded up


def test_partition_checks_its_arguments():
    assert partition([1.0, 2.0, 3.0], 3) == [1, 1, 1]  # as many stages as layers is fine
    with pytest.raises(ValueError, match="4 stages but the model only 3 layers: use at most 3"):
        partition([1, 1, 1], 4)
    assert check_counts((2, 1), 3, 2) == [2, 1]
    for balance, message in [
        ([True, 2], "balance must be a list of layer counts"),
        ([1, 2], r"balance=\[1, 2\] has 2 entries but the pipeline has 3 stages"),
        ([2, 0, 1], r"balance=\[2, 0, 1\] gives stage\(s\) \[1\] no layers"),
        ([1, 1, 2], r"balance=\[1, 1, 2\] sums to 4 layers but the model has 3"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            check_counts(balance, 3, 3)
    with pytest.raises(ValueError, match=r"gives stage\(s\) \[0, 2\] no layers"):
        check_counts([0, 3, -1], 2, 3)


def test_costs_of_layers_count_shared_parameters_once():
    shared = nn.Linear(4, 4)
    assert param_costs([shared, nn.ReLU(), shared, nn.Linear(4, 2)]) == [20.0, 0.0, 0.0, 10.0]


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _CountBackward.calls += 1
        return grad


class _Probe(nn.Module):
    """Counts forward calls and leaf inputs; has an unused parameter (allow_unused)."""

    def __init__(self, weighted: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1)) if weighted else None
        self.unused = nn.Parameter(torch.zeros(1))
        self.calls = self.leaf_inputs = 0

    def forward(self, x):
        self.calls += 1
        self.leaf_inputs += int(x.is_leaf)
        return _CountBackward.apply(x * self.weight if self.weight is not None else x)


def test_costs_of_layers_by_timing_touch_no_gradient():
    # Timing (balance="time") runs each layer's forward and backward; the times themselves are
    # never compared, only bounded by the time the whole call took.
    layers = [nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)]
    started = time.perf_counter()
    costs = time_costs(layers, torch.randn(3, 4), torch.device("cpu"))
    elapsed = time.perf_counter() - started
    assert len(costs) == 3 and all(isinstance(c, float) and 0 < c <= elapsed for c in costs)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert starts_in_place(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2)))
    assert not starts_in_place(nn.Sequential(nn.ReLU(), nn.ReLU(inplace=True)))
    assert not starts_in_place(nn.Sequential())


def test_timing_runs_forward_and_backward_of_every_layer():
    weighted, free = _Probe(weighted=True), _Probe(weighted=False)
    ints = nn.Flatten(0)  # then an output without gradient: nothing to run backward on
    _CountBackward.calls = 0
    time_costs([weighted, free, _ArgMax(), ints], torch.randn(3, 4), torch.device("cpu"))
    runs = TIME_REPEATS + 1  # one warm-up, then the timed runs
    # Each timed run, plus one more to hand the output to the next layer; always on a leaf.
    assert (weighted.calls, free.calls) == (runs + 1, runs + 1)
    assert (weighted.leaf_inputs, free.leaf_inputs) == (runs + 1, runs + 1)
    # Backward through both (the parameter-free one too: the input is differentiated).
    assert _CountBackward.calls == 2 * runs
    assert weighted.weight.grad is None and free.unused.grad is None


class _ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=1)


def test_timing_inputs_are_fresh_leaves_and_copies_only_for_in_place_layers():
    x, n = torch.randn(2, requires_grad=True), torch.arange(3)
    value = (x * 2, n, "label")
    leaves = _detached(value)
    assert type(leaves) is tuple and leaves[2] == "label" and leaves[1] is not n
    assert leaves[0].is_leaf and leaves[0].requires_grad and torch.equal(leaves[0], x * 2)
    assert not leaves[1].requires_grad and torch.equal(leaves[1], n)
    assert type(_detached([x])) is list and _detached(x).is_leaf
    copied = _copied([leaves[0], leaves[1], (leaves[0],)])
    assert type(copied) is list and type(copied[2]) is tuple
    assert copied[0] is not leaves[0] and torch.equal(copied[0], leaves[0])
    assert copied[1] is leaves[1] and copied[2][0] is not leaves[0]  # no grad: no copy


@pytest.mark.parametrize("container", ["tuple", "list", "tensor"])
def test_edge_spec_round_trips_and_refuses_non_tensors(container):
    items = [torch.zeros(2, 3), torch.ones(2, dtype=torch.int64), torch.zeros(2, 1, 4).bool(),
             torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 5, dtype=torch.complex64)]
    value = {"tuple": tuple(items), "list": list(items), "tensor": items[0]}[container]
    sent = items if container != "tensor" else items[:1]
    spec, tensors = EdgeSpec.describe(value, stage=0)
    assert len(tensors) == len(sent) and all(a is b for a, b in zip(tensors, sent, strict=True))
    assert spec.container == container
    assert spec.shapes == tuple(tuple(t.shape) for t in sent)
    assert spec.dtypes == tuple(t.dtype for t in sent)
    # The receiver only has the packed words: it must rebuild the same structure, shapes and
    # dtypes (the bool mask stays bool), and send gradients back for the floating ones only.
    received = EdgeSpec.unpack(spec.pack())
    assert received == spec
    assert received.floating == [k for k in (0, 3, 4) if k < len(sent)]
    buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in
               zip(received.shapes, received.dtypes, strict=True)]
    rebuilt = received.build(buffers)
    if container == "tensor":
        assert rebuilt is buffers[0]
    else:
        assert type(rebuilt) is type(value) and len(rebuilt) == len(sent)
        for got, want in zip(rebuilt, sent, strict=True):
            assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_edge_spec_refuses_what_cannot_travel():
    with pytest.raises(TypeError, match=r"non-tensor items \(\[1\] int\)"):
        EdgeSpec.describe((torch.zeros(1), 3), stage=1)
    with pytest.raises(TypeError, match="returned dict"):
        EdgeSpec.describe({"a": torch.zeros(1)}, stage=1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        EdgeSpec.describe(torch.zeros(1, dtype=torch.uint16), stage=1)
    with pytest.raises(TypeError, match="of 0 tensors"):
        EdgeSpec.describe((), stage=1)
    with pytest.raises(ValueError, match="over the limit"):
        EdgeSpec.describe(tuple(torch.zeros([1] * 6) for _ in range(40)), stage=1)[0].pack()


# -- deadlines -----------------------------------------------------------------------------------

def check_deadline():
    pipe = td.Pipeline(mlp(), chunks=2)
    if td.rank() == 1:
        return None  # stage 1 never joins the step
    x, y = data(4)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except TimeoutError as error:
        waited = str(error)
    else:
        waited = "no timeout"
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except RuntimeError as error:
        again = str(error)
    else:
        again = "no error"
    return waited, again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checks", ["1", "0"])
def test_a_missing_stage_ends_in_a_timeout_that_names_it(checks):
    # A pool of its own (short timeout), as this test leaves unreceived messages behind.
    env = {"TANDEM_TIMEOUT": "3", "TANDEM_TEST_POOL": "pipeline-deadline", "TANDEM_CHECKS": checks}
    waited, again = run_distributed(check_deadline, world_size=2, env=env)[0]
    if checks == "1":  # the step's agreement waits first: it names the call, and who is missing
        assert "Pipeline train_step #1 of Sequential, stage 0: rank 0 waited 3 s (the timeout) " \
               "for the ranks [0, 1] to start it too" in waited, waited
        assert "not arrived: rank 1" in waited, waited
    else:
        assert "pipeline stage 0 (rank 0) waited 3 s (the timeout) receiving gradient 0 of " \
               "micro-batch 0 from stage 1 (rank 1)" in waited, waited
    assert "an earlier step failed" in again
