"""tandem 1.0's public API: the top level, the namespaces, the 0.x names' warning, one state API
for any split, and the documentation of every public callable.

The state API runs on one shared world per engine (Gloo, MPI): replicated, ZeroOptimizer,
fully_shard, tensor parallel and Pipeline in turn, each taking the state after two Adam steps
(equal to one process's), loading it into the next split (built fresh, its values wiped) and
taking one more step, which must equal one process's third step.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


# -- the names ------------------------------------------------------------------------------------


def test_the_top_level_is_about_fifty_names_and_each_resolves():
    assert 45 <= len(td.__all__) <= 60, len(td.__all__)
    assert len(set(td.__all__)) == len(td.__all__)
    for name in td.__all__:
        assert getattr(td, name) is not None, name
    for namespace in td._NAMESPACES:
        module = getattr(td, namespace)
        assert module is importlib.import_module(f"tandem.{namespace}")
        for name in getattr(module, "__all__", ()):
            assert getattr(module, name) is not None, (namespace, name)
    from tandem.fsdp import MixedPrecisionPolicy
    from tandem.parallel.fully_shard.policies import MixedPrecisionPolicy as home

    assert MixedPrecisionPolicy is td.fsdp.MixedPrecisionPolicy is home


def test_every_moved_name_lives_in_its_namespace():
    for name, namespace in td._MOVED.items():
        assert name not in td.__all__, name
        assert name in importlib.import_module(f"tandem.{namespace}").__all__, (name, namespace)


def test_td_errors_holds_every_public_error_and_warning():
    import pkgutil

    # Horovod's own; run's control flow; the worker pool's, which td.spawn and tandem.testing
    # turn into their own errors (SpawnError, a failed test) before a user sees it
    exempt = {"tandem.horovod", "tandem.launch.local.supervisor", "tandem.launch.local.pool"}
    missing = []
    for info in pkgutil.walk_packages(td.__path__, "tandem."):
        if info.name.endswith("__main__") or any(info.name.startswith(e) for e in exempt):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue  # an optional dependency (lightning) this machine lacks
        for key, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == info.name and not key.startswith("_")):
                if getattr(td.errors, key, None) is not value:
                    missing.append(f"{info.name}.{key}")
    assert not missing, f"not in td.errors: {missing}"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-W", "always::FutureWarning", "-c", code], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def _use_by_attribute(name: str) -> object:
    return getattr(td, name)  # the user's line: the warning must point here


def _use_by_import(name: str) -> object:
    exec(f"from tandem import {name} as value", globals(), found := {})  # the user's line: <string>
    return found["value"]


@pytest.mark.parametrize("name,namespace,use", [
    ("ColumnParallelLinear", "tensor", _use_by_attribute),        # a class
    ("full_state_dict", "fsdp", _use_by_attribute),               # a function
    ("ReplicaStartWarning", "errors", _use_by_attribute),         # an error or warning
    ("save_sharded", "checkpoint", _use_by_attribute),            # into an existing package
    ("Average", "metrics", _use_by_import),                       # imported by name
])
def test_a_0x_name_warns_once_naming_the_new_spelling_at_the_users_line(name, namespace, use):
    vars(td).pop(name, None)  # as in a fresh process: not looked up yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = use(name), use(name)
    assert first is second is getattr(importlib.import_module(f"tandem.{namespace}"), name)
    assert [w.category for w in caught] == [FutureWarning], [str(w.message) for w in caught]
    assert str(caught[0].message) == (f"td.{name} is td.{namespace}.{name} in tandem 1.0; the old "
                                      f"name goes in 1.1")
    user_line = inspect.getsourcelines(use)[1] + 1
    where = (caught[0].filename, caught[0].lineno)
    assert where == ((__file__, user_line) if use is _use_by_attribute else ("<string>", 1)), where


def test_the_new_spellings_warn_nothing_and_import_tandem_stays_light():
    done = _python("import sys, tandem as td, tandem.errors\nassert 'torch' not in sys.modules\n"
                   "td.tensor.ColumnParallelLinear; td.fsdp.full_state_dict; td.errors.SpawnError\n"
                   "td.checkpoint.save_sharded; td.metrics.Average; td.memory.estimate_memory\n"
                   "td.pipeline.PipelineStats; td.context.split; td.get_state_dict\n")
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr


# -- the documentation ----------------------------------------------------------------------------

# Public callables whose docstrings still lack a Google-style section they need (issue 39, item 3:
# all written; a new public callable comes with its sections, and a stale entry fails the test).
UNDOCUMENTED: set[str] = set()


def _public_callables() -> dict[str, object]:
    found = {f"td.{name}": getattr(td, name) for name in td.__all__}
    for namespace in td._NAMESPACES:
        module = getattr(td, namespace)
        for name in getattr(module, "__all__", ()):
            found[f"td.{namespace}.{name}"] = getattr(module, name)
    seen: set[int] = set()  # one object, one entry: under its top-level spelling when it has one
    out = {}
    for name, value in found.items():
        if callable(value) and id(value) not in seen:
            seen.add(id(value))
            out[name] = value
    return out


def _missing_sections(obj: object) -> list[str]:
    """The sections a generated reference needs that `obj`'s docstring lacks."""
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return [] if inspect.getdoc(obj) else ["a docstring"]
        doc = (obj.__doc__ or "") + (obj.__init__.__doc__ or "" if "__init__" in vars(obj) else "")
        target = obj.__init__ if "__init__" in vars(obj) else None
    else:
        doc, target = inspect.getdoc(obj) or "", obj
    missing = [] if doc.strip() else ["a docstring"]
    try:
        params = [p for p in inspect.signature(target).parameters if p not in ("self", "cls")] \
            if target is not None else []
    except (TypeError, ValueError):
        params = []
    if params and "Args:" not in doc:
        missing.append("Args:")
    if not inspect.isclass(obj):
        returns_none = inspect.signature(obj).return_annotation in (None, "None")
        if "Returns:" not in doc and "Yields:" not in doc and not returns_none:
            missing.append("Returns:")
        if "Raises:" not in doc:
            missing.append("Raises:")
    return missing


def test_every_public_callable_documents_its_arguments_returns_and_raises():
    gaps = {name: _missing_sections(obj) for name, obj in _public_callables().items()}
    gaps = {name: missing for name, missing in gaps.items() if missing}
    new = {name: missing for name, missing in gaps.items() if name not in UNDOCUMENTED}
    assert not new, "public callables without Args:/Returns:/Raises: sections:\n" + "\n".join(
        f"  {name}: missing {', '.join(missing)}" for name, missing in sorted(new.items()))
    stale = sorted(UNDOCUMENTED - set(gaps))
    assert not stale, f"documented now, delete from UNDOCUMENTED: {stale}"


# -- one state API for any split ------------------------------------------------------------------

PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise_gather"}
SPLITS = ["replicated", "zero", "fully_shard", "tensor", "pipeline"]
BATCH = 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 6))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 6, generator=generator)


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _one_process(steps: int) -> tuple[dict, dict]:
    """One process's model state and its optimizer state keyed by parameter name."""
    model = _net()
    optimizer = _adam(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    state = optimizer.state_dict()
    return model.state_dict(), {names[i]: value for i, value in state["state"].items()}


def _build(split: str):
    model = _net()
    if split == "tensor":
        td.parallelize(model, PLAN, group=td.mesh(dp=1, tp=td.size()).tp_group)
    elif split == "pipeline":
        model = td.Pipeline(model, chunks=2, balance=[2, 3])
    elif split == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model)
    optimizer = _adam(model.parameters())
    if split == "replicated":
        optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif split == "zero":
        optimizer = td.ZeroOptimizer(optimizer)
    return model, optimizer


def _train(split: str, model, optimizer, step: int) -> None:
    x, y = _batch(step)
    optimizer.zero_grad()
    if split == "pipeline":
        model.train_step(x, y, nn.functional.mse_loss)
    else:
        if split in ("replicated", "zero", "fully_shard"):
            rows = slice(td.rank() * BATCH // td.size(), (td.rank() + 1) * BATCH // td.size())
            x, y = x[rows], y[rows]
        nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _difference(got: tuple[dict, dict], expected: tuple[dict, dict]) -> float:
    (model_state, optim_state), (model_ref, optim_ref) = got, expected
    assert set(model_state) == set(model_ref), sorted(model_state)
    assert set(optim_state["state"]) == set(optim_ref), sorted(optim_state["state"])
    assert sorted(n for g in optim_state["param_groups"] for n in g["params"]) == sorted(optim_ref)
    assert all(g["lr"] == 0.01 for g in optim_state["param_groups"])
    worst = max((model_state[k].cpu() - v).abs().max().item() for k, v in model_ref.items())
    for name, entry in optim_ref.items():
        for key, value in entry.items():
            worst = max(worst, (optim_state["state"][name][key].cpu() - value).abs().max().item())
    return worst


def every_split_in_turn() -> dict[str, float]:
    """Each split: restore the previous split's state (after 2 steps) and take the third step;
    also its own state after 2 steps. The differences from one process."""
    after_two, after_three = _one_process(2), _one_process(3)
    out = {}
    previous = None
    for split in SPLITS:
        model, optimizer = _build(split)
        for step in range(2):
            _train(split, model, optimizer, step)
        state = td.get_state_dict(model, optimizer)
        out[f"{split} after 2 steps"] = _difference(state, after_two)
        model, optimizer = _build(split)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)  # the state, not the seed, must bring the values back
        td.set_state_dict(model, optimizer, *(previous or state))
        _train(split, model, optimizer, 2)
        out[f"{split} restored, one more step"] = _difference(
            td.get_state_dict(model, optimizer), after_three)
        previous = state
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(240)
def test_get_and_set_state_dict_for_every_split_equal_one_process(backend):
    for rank, differences in enumerate(run_distributed(every_split_in_turn, world_size=2,
                                                       backend=backend)):
        assert set(differences) == {f"{s} {w}" for s in SPLITS
                                    for w in ("after 2 steps", "restored, one more step")}
        assert max(differences.values()) < 1e-6, (rank, differences)


def test_one_process_round_trip_continues_as_if_never_stopped():
    """Without a world: a plain model's state, saved and loaded, trains on as one process."""
    model = _net()
    optimizer = _adam(model.parameters())
    for step in range(2):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    model_state, optim_state = td.get_state_dict(model, optimizer)
    fresh = _net()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_optimizer = _adam(fresh.parameters())
    td.set_state_dict(fresh, fresh_optimizer, model_state, optim_state)
    x, y = _batch(2)
    fresh_optimizer.zero_grad()
    nn.functional.mse_loss(fresh(x), y).backward()
    fresh_optimizer.step()
    expected, _ = _one_process(3)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
