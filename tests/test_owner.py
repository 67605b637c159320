"""One owner per split (issue 40, item 1): every wrapper answers the same questions through
`owner_of`, and the code that asks (layout, checkpoints, elastic, join, clip, gradient sync)
names no wrapper class.

The behaviour the owners changed: a `td.DistributedDataParallel` model's optimizer and a
`td.LocalSGD` record their steps (`tandem scale`, `MetricLogger(timing=True)` read them; both
recorded none), and `td.join(sync_state=True)`, `td.no_sync`, `td.clip_grad_norm_` and the
checkpoint's layout go through the owner of whatever they are given.
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

SRC = Path(__file__).resolve().parent.parent / "src" / "tandem"
# The code that asks the owners: it must not name the classes that answer.
CONSUMERS = ["parallel/layout", "checkpoint", "elastic", "parallel/data_parallel/join.py",
             "parallel/gradient_sync.py", "parallel/state_dict.py", "parallel/fully_shard/api.py",
             # broadcast_parameters/check_replicas, the wrappers' own constructors, resizing,
             # the memory estimator, tandem scale/memory, MetricLogger's timing, step accounting
             "parallel/broadcast.py", "parallel/optimizer_broadcast.py",
             "parallel/data_parallel/local_sgd.py", "parallel/zero/optimizer.py",
             "parallel/fully_shard/resize.py", "parallel/memory",
             "parallel/tensor/branches.py", "cli", "metrics", "diagnostics/steps.py"]
WRAPPERS = r"(Pipeline|ZeroOptimizer|DistributedOptimizer|DistributedDataParallel|LocalSGD|Reducer)"


def _files():
    for consumer in CONSUMERS:
        path = SRC / consumer
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_consumers_ask_the_owner_instead_of_naming_a_wrapper():
    found = []
    patterns = [re.compile(rf"isinstance\([^)]*\b{WRAPPERS}\b"), re.compile(r"hasattr\([^)]*_tandem"),
                re.compile(r"[\"']stage[\"']"), re.compile(r"import [^\n]*\b(Pipeline|ZeroOptimizer|"
                                                           r"DistributedOptimizer|LocalSGD)\b")]
    for path in _files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "ask owner_of(obj) (parallel/layout/owner.py) instead:\n" + "\n".join(found)


def test_one_per_element_rule():
    """Whether optimizer state is per element ("step" is not, unless the parameter has
    dimensions) is decided by `layout.pieces.per_element` (and its shape forms) alone."""
    rule = re.compile(r"""(!=|==) ["']step["']""")
    found = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
             for path in sorted((SRC / "parallel").rglob("*.py")) if path.name != "pieces.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if rule.search(line)]
    assert not found, "use layout.pieces.per_element / per_flat_element:\n" + "\n".join(found)


def test_replica_calls_ask_the_owner_not_the_registry():
    text = (SRC / "parallel" / "broadcast.py").read_text()
    assert "owner_of(" in text and not re.search(r"splits\.(kind_of|mixes_slices|split_of)", text)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def answers() -> dict[str, dict]:
    from tandem.diagnostics import steps
    from tandem.parallel.layout.owner import owner_of

    def ask(obj) -> dict:
        owner = owner_of(obj)
        inner = owner.optimizer()
        return {"role": owner.role, "describe": owner.describe(),
                "optimizer": None if inner is None else type(inner).__name__,
                "sharded": owner.sharded_over_world(), "join": owner.answers_join,
                "kinds": sorted(owner.split_kinds()) if owner.role == "model" else None,
                "refusal": owner.checkpoint_refusal()}

    out = {}
    model = _net()
    out["module"] = ask(model)
    out["sgd"] = ask(torch.optim.SGD(model.parameters(), lr=0.1))
    out["dopt"] = ask(td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters()))
    zero = td.ZeroOptimizer(torch.optim.Adam(_net().parameters(), lr=0.1))
    out["zero"] = ask(zero)
    out["local"] = ask(td.LocalSGD(torch.optim.SGD(_net().parameters(), lr=0.1), period=2))
    sharded = _net()
    td.fully_shard(sharded)
    out["fully_shard"] = ask(sharded)
    out["tp"] = ask(td.parallelize(_net(), {"0": "colwise", "2": "rowwise"}))
    out["pipe"] = ask(td.Pipeline(_net(), chunks=2))
    out["other"] = ask(object())

    # Step accounting: a DDP model's plain optimizer and LocalSGD record their steps.
    recorded = {}
    ddp = td.DistributedDataParallel(_net())
    for name, (model, opt) in {
            "ddp": (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)),
            "local": (_net(), None)}.items():
        opt = opt or td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=2)
        steps.reset()
        for _ in range(4):  # the first step only starts the clock
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        recorded[name] = steps.recorded()
    out["recorded"] = recorded
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_every_split_answers_through_its_owner(backend):
    for got in run_distributed(answers, world_size=2, backend=backend):
        assert got["module"] == {"role": "model", "describe": "Sequential", "optimizer": None,
                                 "sharded": False, "join": False, "kinds": [], "refusal": None}
        assert got["sgd"]["role"] == "optimizer" and got["sgd"]["optimizer"] == "SGD", got["sgd"]
        assert got["dopt"]["optimizer"] == "SGD" and got["dopt"]["join"], got["dopt"]
        assert got["dopt"]["describe"] == "td.DistributedOptimizer over 2 ranks", got["dopt"]
        assert got["zero"]["sharded"] and got["zero"]["optimizer"] == "Adam", got["zero"]
        assert got["zero"]["describe"] == "td.ZeroOptimizer(Adam) over 2 ranks (flat sharding)"
        assert got["local"]["optimizer"] == "SGD" and not got["local"]["sharded"], got["local"]
        assert "td.LocalSGD run cannot be checkpointed" in got["local"]["refusal"], got["local"]
        assert got["fully_shard"]["kinds"] == ["fully_shard"], got["fully_shard"]
        assert got["tp"]["kinds"] == ["tensor parallel"], got["tp"]
        assert got["pipe"]["kinds"] == ["pipeline"], got["pipe"]
        assert got["pipe"]["describe"].startswith("td.Pipeline stage "), got["pipe"]
        assert got["other"]["role"] is None and got["other"]["optimizer"] is None, got["other"]
        assert got["recorded"] == {"ddp": 3, "local": 3}, got["recorded"]


def refused_owners() -> dict[str, str]:
    errors = {}

    def sgd():
        return torch.optim.SGD(_net().parameters(), lr=0.1)

    for name, call in {
            "no_sync of an optimizer": lambda: td.no_sync(sgd()).__enter__(),
            "no_sync of a model nothing reduces": lambda: td.no_sync(_net()).__enter__(),
            "join of a ZeroOptimizer": lambda: td.join(td.ZeroOptimizer(sgd())),
            # a wrapper that reduces or shards under one that does it again: every wrapper's
            # owner says it wraps another optimizer, not a class check per pair
            "ZeroOptimizer over LocalSGD": lambda: td.ZeroOptimizer(td.LocalSGD(sgd(), period=2)),
            "LocalSGD over ZeroOptimizer": lambda: td.LocalSGD(td.ZeroOptimizer(sgd()), period=2),
            "ZeroOptimizer over DistributedOptimizer": lambda: td.ZeroOptimizer(
                td.DistributedOptimizer(sgd())),
    }.items():
        try:
            call()
            errors[name] = "accepted"
        except (TypeError, ValueError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_what_an_owner_cannot_do_is_refused_with_its_description(backend):
    for errors in run_distributed(refused_owners, world_size=2, backend=backend):
        assert errors["no_sync of an optimizer"] == \
            "TypeError: expected an nn.Module or a td.Pipeline, got SGD"
        assert "nothing reduces this model's gradients" in errors["no_sync of a model nothing reduces"]
        assert errors["join of a ZeroOptimizer"].startswith("TypeError: td.join takes "), errors
        assert "got td.ZeroOptimizer(SGD) over 2 ranks" in errors["join of a ZeroOptimizer"], errors
        for name, inner in [("ZeroOptimizer over LocalSGD", "td.LocalSGD(SGD)"),
                            ("LocalSGD over ZeroOptimizer", "td.ZeroOptimizer(SGD) over 2 ranks"),
                            ("ZeroOptimizer over DistributedOptimizer",
                             "td.DistributedOptimizer over 2 ranks")]:
            assert errors[name].startswith("TypeError: "), (name, errors[name])
            assert f"wrap the plain torch optimizer, not {inner}" in errors[name], (name, errors[name])
