"""Split models whose ranks' code paths diverge: one error on every rank naming each rank's
operation, never a C assertion, an abort, garbage or a hang (MPI and Gloo match collectives by
order).

fully_shard's gathers and reduce-scatters, a pipeline's messages and tensor-parallel layers'
collectives are not checked one call at a time; each forward, backward, pipeline step and
state-dict call opens with one agreement (`parallel/model_check.py`). Each check trains a few
steps in which rank 1 (or rank 0, for the habitual "save on rank 0") takes another path at step
2, catches what tandem raises and returns it: both ranks must raise, naming both ranks'
operations and the fix. Then the clear errors of building such models wrongly: the root sharded
before its blocks, a colwise layer without its rowwise partner, ranks whose Branches or inputs
do not match.
"""

import importlib.util

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, width), nn.Linear(width, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks[1](torch.tanh(self.blocks[0](x))))


def _sharded() -> Net:
    model = Net()
    for block in model.blocks:
        td.fully_shard(block)
    return td.fully_shard(model)


def _parallel() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return td.parallelize(model, {"0": "colwise", "2": "rowwise"})


def _train(model, fault: str, steps: int = 5, call=None):
    """`steps` steps of SGD; at step 2 rank 1 (rank 0 for "save") takes the path `fault`.
    Returns (step, error type, message) of what was raised, or (None, None, final state)."""
    call = call or model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, step = td.rank(), -1
    try:
        for step in range(steps):
            x = torch.full((3, 4), float(step + 1) / 4)
            if fault == "inputs" and rank == 1 and step == 2:
                x = x[:2]
            loss = call(x).pow(2).mean()
            if fault == "nan" and rank == 1 and step == 2:
                loss = loss * float("nan")
            if fault == "nan" and not td.all_finite(loss):
                continue  # the right way: every rank skips together
            if fault in ("eval", "eval_skip"):
                with torch.no_grad():  # every rank evaluates between forward and backward
                    call(x)
            if fault in ("skip", "eval_skip") and rank == 1 and step == 2:
                continue  # the wrong way: this rank alone skips backward and step
            opt.zero_grad()
            loss.backward()
            if fault == "skip_opt" and rank == 1 and step == 2:
                continue  # backward, but no optimizer step on this rank
            opt.step()
            if fault == "save" and rank == 0 and step == 2:
                td.fsdp.full_state_dict(model)  # the habitual "save on rank 0"
        state = {k: v.tolist() for k, v in td.fsdp.full_state_dict(model).items()}
    except td.CollectiveMismatchError as error:
        return step, type(error).__name__, str(error)
    return None, None, state


def check_fully_shard():
    return {fault: _train(_sharded(), fault) for fault in ("skip", "skip_opt", "save", "nan")}


def check_tensor_parallel():
    results = {fault: _train(_parallel(), fault)
               for fault in ("skip", "skip_opt", "inputs", "eval", "eval_skip")}
    branches = td.tensor.Branches([nn.Linear(4, 3), nn.Linear(4, 3)], join="sum")
    results["branches skip"] = _train(branches, "skip")
    wide = 3 if td.rank() == 0 else 5  # join="sum" needs the same shape on every rank
    uneven = td.tensor.Branches([nn.Linear(4, wide), nn.Linear(4, wide)], join="sum")
    results["branches shapes"] = _train(uneven, "none")
    return results


def _assert_named(results, fault, first, second, *words, kind="DivergedError"):
    """Both ranks raised `kind` (at the fault's step, or the next), each message naming both
    ranks' calls."""
    steps = [rank[fault][0] for rank in results]
    assert None not in steps and max(steps) - min(steps) <= 1, (fault, steps)
    for rank in results:
        _, raised, message = rank[fault]
        assert raised == kind, (fault, message)
        for word in (first, second, *words):
            assert word in message, (fault, word, message)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_shard_ranks_that_diverge_are_named(backend):
    results = run_distributed(check_fully_shard, 2, backend, timeout=120)
    _assert_named(results, "skip", "rank 0: fully_shard backward #3 of Net",
                  "rank 1: fully_shard forward #4 of Net", "td.all_finite")
    _assert_named(results, "skip_opt", "rank 0: fully_shard forward #4 of Net (after 3 optimizer",
                  "rank 1: fully_shard forward #4 of Net (after 2 optimizer", "td.all_finite")
    _assert_named(results, "save", "rank 0: state_dict #1 of Net (fully_shard",
                  "rank 1: fully_shard forward #4 of Net", "td.fsdp.full_state_dict(model) too) gathers "
                  "the model from every rank: every rank calls it")
    (s0, _, w0), (s1, _, w1) = results[0]["nan"], results[1]["nan"]
    assert s0 is None and s1 is None and w0 == w1  # skipped together: still one model
    assert torch.isfinite(torch.tensor(w0["head.weight"])).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_and_branches_ranks_that_diverge_are_named(backend):
    results = run_distributed(check_tensor_parallel, 2, backend, timeout=120)
    _assert_named(results, "skip", "rank 0: tensor-parallel backward #3 of Sequential",
                  "rank 1: tensor-parallel forward #4 of Sequential", "td.all_finite")
    _assert_named(results, "skip_opt", "(after 3 optimizer steps)", "(after 2 optimizer steps)")
    _assert_named(results, "inputs", "rank 0: [(3, 4)]", "rank 1: [(2, 4)]",
                  "inputs of different shapes", kind="CollectiveMismatchError")
    assert results[0]["eval"][:2] == (None, None), results[0]["eval"]  # evaluating between
    assert results[0]["eval"][2] == results[1]["eval"][2]  # a forward and its backward is fine
    _assert_named(results, "eval_skip", "rank 0: tensor-parallel backward #3 of Sequential",
                  "rank 1: tensor-parallel forward #7 of Sequential")
    _assert_named(results, "branches skip", "rank 0: Branches backward #3 of [Linear, Linear]",
                  "rank 1: Branches forward #4 of [Linear, Linear]")
    _assert_named(results, "branches shapes", "rank 0: branches 0..0: (3, 3) float32",
                  "rank 1: branches 1..1: (3, 5) float32", "the same shape and dtype (join='sum')",
                  kind="CollectiveMismatchError")


def _pipeline_skips(fault: str):
    """The last stage skips its optimizer step after a NaN loss it alone sees (`fault` "opt"),
    or stage 0 evaluates where the others train ("eval")."""
    torch.manual_seed(0)
    pipe = td.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    step = -1
    try:
        for step in range(5):
            x, y = torch.full((4, 4), float(step)), torch.zeros(4, 1)
            if fault == "eval" and step == 2 and pipe.is_first:
                pipe(x)
            loss = pipe.train_step(x, y, nn.functional.mse_loss)
            if fault == "opt" and step == 2 and pipe.is_last:
                continue  # as `if torch.isnan(loss): continue`, where only this stage has the loss
            opt.step()
            opt.zero_grad()
    except td.CollectiveMismatchError as error:
        return step, type(error).__name__, str(error)
    return None, None, loss


def check_pipeline():
    return {fault: _pipeline_skips(fault) for fault in ("opt", "eval")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pipeline_stage_that_skips_its_step_is_named(backend):
    results = run_distributed(check_pipeline, 2, backend, timeout=120)
    _assert_named(results, "opt", "rank 0: Pipeline train_step #4 of Sequential, stage 0 (after 3 "
                  "optimizer steps)", "rank 1: Pipeline train_step #4 of Sequential, stage 1 (after "
                  "2 optimizer steps)", "broadcast_loss=True")
    _assert_named(results, "eval", "rank 0: Pipeline forward #1 of Sequential, stage 0",
                  "rank 1: Pipeline train_step #3 of Sequential, stage 1")


# -- building a split model wrongly: clear errors -----------------------------------------------

class Custom(nn.Module):
    """A colwise layer read by a plain one, outside any nn.Sequential."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, td.CollectiveMismatchError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_build_errors():
    said = {}

    def root_first():
        model = Net()
        td.fully_shard(model)
        td.fully_shard(model.blocks[0])

    said["root first"] = _error(root_first)
    sequential = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    said["colwise alone"] = _error(lambda: td.parallelize(sequential, {"0": "colwise"}))
    said["untouched"] = [type(m).__name__ for m in sequential]  # refused before any swap
    custom = td.parallelize(Custom(), {"up": "colwise"})
    said["colwise first forward"] = _error(lambda: custom(torch.ones(3, 4)))
    rowwise = td.parallelize(Custom(), {"down": "rowwise"})
    said["rowwise alone"] = _error(lambda: rowwise(torch.ones(3, 4)))
    said["other model"] = _error(lambda: td.fully_shard(Net(width=8 + 2 * td.rank())))
    return said


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_models_built_wrongly_get_errors_that_name_the_fix(backend):
    for said in run_distributed(check_build_errors, 2, backend, timeout=120):
        assert "fully_shard(Linear): its parameters already belong to the unit of Net, which " \
               "was sharded first. Apply fully_shard to the inner blocks first, then the root" \
               in said["root first"], said["root first"]
        for key, consumer in (("colwise alone", "'2'"), ("colwise first forward", "'down'")):
            assert f"ValueError: layer {consumer} (nn.Linear, in_features=8) reads the output of " \
                   "the colwise layer" in said[key], said[key]
            assert "(8 / 2 = 4 features each)" in said[key] and "'colwise_gather'" in said[key]
        assert said["untouched"] == ["Linear", "ReLU", "Linear"]
        assert "RowParallelLinear (in_features=8, 4 on this rank) got inputs of 8 features" \
               in said["rowwise alone"], said["rowwise alone"]
        assert said["other model"].startswith("LayoutMismatchError: fully_shard of Net: the "
                                              "ranks hold different tensors"), said["other model"]
        assert "blocks.0.weight" in said["other model"], said["other model"]
