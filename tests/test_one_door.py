"""One check, one optimizer-step hook, one door to the engine (issue 40), asserted.

- Every torch optimizer's step passes tandem's one pre-step and one post-step hook, however many
  splits and checked models a process builds: the hook refuses, records the step for `tandem
  scale`, and counts it for the per-operation checks whose parameters it steps.
- The split-model code (parallel/, checkpoint/, elastic/) and the metrics reach the engine through
  `tandem.comm.collectives.direct` (unchecked, under an agreement) or the checked collectives,
  never by calling an engine's operation itself; the one exception is the data-parallel comm
  hooks, whose `bucket.backend` is the engine a user's `hook(bucket) -> Work` is handed.
"""

import ast
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

import tandem as td
from tandem.diagnostics import steps
from tandem.parallel import model_check
from tandem.parallel.tensor import branches as branches_module
from tandem.testing import run_distributed

SRC = Path(__file__).resolve().parents[1] / "src" / "tandem"
# The engine's operations (comm/engines/backend.py's Backend).
ENGINE_OPS = {"allreduce", "allreduce_now", "allgather_into", "reducescatter_into", "broadcast",
              "reduce", "send", "recv", "alltoall_into", "barrier"}
# `hook(bucket) -> Work`: a comm hook is handed the engine (`bucket.backend`), as DDP's are.
COMM_HOOKS = {"parallel/data_parallel/comm_hooks.py", "parallel/data_parallel/compression.py"}


def _engine_calls(path: Path) -> list[str]:
    """`<...>backend.<op>(` calls in `path`: an engine operation called by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ENGINE_OPS):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name in ("backend", "_backend"):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node.func)}(...)")
    return found


def test_split_model_code_reaches_the_engine_through_one_door():
    calls = [call for folder in ("parallel", "checkpoint", "elastic", "metrics")
             for path in sorted((SRC / folder).rglob("*.py"))
             if str(path.relative_to(SRC)) not in COMM_HOOKS
             for call in _engine_calls(path)]
    assert not calls, ("call the engine through tandem.comm.collectives.direct (under an "
                       "agreement) or the checked collectives:\n" + "\n".join(calls))


def _tandem_hooks(hooks) -> int:
    return sum(1 for hook in hooks.values() if hook.__module__.startswith("tandem."))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def one_hook_for_every_split() -> dict:
    x = torch.randn(4, 4)
    sharded = _net()
    td.fully_shard(sharded)
    models = {"fully_shard": sharded,
              "ddp": td.DistributedDataParallel(_net()),
              "tensor": td.parallelize(_net(), {"0": "colwise", "2": "rowwise"}),
              "branches": td.tensor.Branches([nn.Linear(4, 3), nn.Linear(4, 5)], join="cat")}
    steps.step_done()  # a step's time runs from the previous step's end: one is on record
    steps_before = steps.recorded()
    counted = {}
    for name, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        check = model_check.check_of(model) or branches_module._checks.get(model)
        counted[name] = None if check is None else check.steps
    return {"pre": _tandem_hooks(torch_optimizer._global_optimizer_pre_hooks),
            "post": _tandem_hooks(torch_optimizer._global_optimizer_post_hooks),
            "counted": counted, "recorded": steps.recorded() - steps_before}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_every_split_and_check_shares_one_optimizer_step_hook(backend):
    for result in run_distributed(one_hook_for_every_split, 2, backend):
        assert (result["pre"], result["post"]) == (1, 1), result
        # The per-operation checks of the split models count the plain optimizer's steps
        # (the DDP reducer's check is counted by its wrapper, not here: it has none of its own).
        assert result["counted"] == {"fully_shard": 2, "ddp": None, "tensor": 2,
                                     "branches": 2}, result
        # Every plain optimizer over split or data-parallel parameters records its steps.
        assert result["recorded"] == 8, result
