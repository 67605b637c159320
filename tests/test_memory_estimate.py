"""`td.estimate_memory`: the README's formulas from a model's shapes, checked against the bytes
`benchmarks/sharding.py` measures in real processes; `tandem memory` and its bad inputs."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.cli import command as cli
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def blocks_model(width: int = 64, blocks: int = 3) -> nn.Sequential:
    """benchmarks/sharding.py's model: `blocks` Linear+ReLU blocks and a head."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)],
                         nn.Linear(width, 10))


def meta_model(**kwargs) -> nn.Sequential:
    with torch.device("meta"):
        return blocks_model(**kwargs)


# -- the formulas, from shapes only -----------------------------------------------------------
def test_fp32_adam_gives_the_readme_formulas_on_a_meta_model():
    model = meta_model(width=64, blocks=4)
    p = sum(q.numel() for q in model.parameters())
    tensors = len(list(model.parameters()))
    unit_sizes = [sum(q.numel() for q in block.parameters()) for block in model]
    for n in (1, 2, 4):
        ddp = td.memory.estimate_memory(model, world_size=n, layout="ddp")
        assert (ddp.params, ddp.grads, ddp.optimizer_state) == (4 * p, 4 * p, 8 * p + 4 * tensors)
        assert ddp.total == ddp.peak == 16 * p + 4 * tensors  # 16P, plus Adam's step counters
        zero = td.memory.estimate_memory(model, world_size=n, layout="zero")
        shard = -(-p // n)  # P/N, padded as tandem pads its flat space
        assert zero.states == 8 * p + 8 * shard + 4  # the README's 8P + 8P/N
        assert zero.buffers == 8 * shard  # its shard of the parameters and of the gradient
        assert zero.transient == 4 * n * shard  # the flat gradient step() packs
        fs = td.memory.estimate_memory(model, world_size=n, layout="fully_shard", units=list(model)[:-1])
        shards = sum(-(-size // n) for size in unit_sizes if size)  # each unit padded
        assert fs.states == 16 * shards + 4 * 5  # 16P/N; four blocks and the root: 5 counters
        assert fs.transient > 0 and fs.peak == fs.total + fs.transient
    assert td.memory.estimate_memory(model, world_size=1, layout="ddp", optimizer="sgd").optimizer_state == 0
    assert td.memory.estimate_memory(model, world_size=1, layout="ddp",
                              optimizer="sgd-momentum").optimizer_state == 4 * p


def test_fully_shard_pads_each_unit_to_the_ranks_and_gathers_in_param_dtype():
    model = meta_model(width=5, blocks=2)  # a block holds 30 elements, the head 60
    units = list(model)[:-1]
    est = td.memory.estimate_memory(model, world_size=4, layout="fully_shard", units=units,
                             optimizer="sgd")
    assert est.params == 4 * (8 + 8 + 15)  # ceil(30/4) twice, ceil(60/4) for the root
    wide = meta_model(width=256, blocks=4)
    fp32 = td.memory.estimate_memory(wide, world_size=2, layout="fully_shard", units=list(wide)[:-1])
    bf16 = td.memory.estimate_memory(wide, world_size=2, layout="fully_shard", units=list(wide)[:-1],
                              param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert bf16.states == fp32.states  # fp32 masters either way
    assert bf16.transient * 2 == pytest.approx(fp32.transient, rel=0.01)  # gathered, reduced in bf16
    # gathered in bf16 but reduced in fp32: the bf16 gradient's fp32 copy comes on top
    cast = td.memory.estimate_memory(wide, world_size=2, layout="fully_shard", units=list(wide)[:-1],
                              param_dtype=torch.bfloat16)
    assert cast.transient > bf16.transient
    offloaded = td.memory.estimate_memory(wide, world_size=2, layout="fully_shard",
                                   units=list(wide)[:-1], offload="cpu")
    assert offloaded.host == fp32.states and offloaded.total == 0
    assert offloaded.peak == fp32.transient
    # Without units the whole model is one unit, gathered whole, and the estimate says so.
    whole = td.memory.estimate_memory(wide, world_size=2, layout="fully_shard")
    assert whole.transient > fp32.transient and any("units=" in note for note in whole.notes)


def test_units_by_name_match_units_by_module_and_nest():
    model = meta_model(width=16, blocks=3)
    by_module = td.memory.estimate_memory(model, world_size=2, layout="fully_shard",
                                          units=[model[0], model[1]])
    by_name = td.memory.estimate_memory(model, world_size=2, layout="fully_shard", units=["0", "1"])
    assert by_module == by_name
    # a unit inside a unit owns its own parameters; the outer one keeps the rest
    nested = td.memory.estimate_memory(model, world_size=2, layout="fully_shard", units=["0", "0.0"])
    assert nested.parameters == by_name.parameters


def test_pipeline_reports_the_largest_stage_and_tp_the_split_layers():
    model = meta_model(width=64, blocks=3)
    layers = list(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    est = td.memory.estimate_memory(model, world_size=2, layout="pipeline")  # even: 2 + 2 layers
    assert est.params == 4 * max(sum(sizes[:2]), sum(sizes[2:]))
    counted = td.memory.estimate_memory(model, world_size=2, layout="pipeline", balance=[1, 3])
    assert counted.params == 4 * sum(sizes[1:])
    tp = td.memory.estimate_memory(model, world_size=2, layout="tp",
                                   plan={"0.0": "colwise", "1.0": "rowwise"})
    # colwise: weight and bias halved; rowwise: weight halved, bias whole
    split = (64 * 64 + 64) // 2 + 64 * 64 // 2 + 64
    assert tp.params == 4 * (split + sizes[2] + sizes[3])


def test_compare_memory_prints_one_row_per_layout():
    model = meta_model(width=64, blocks=3)
    table = td.memory.compare_memory(model, world_size=4, units=list(model)[:-1],
                              plan={"0.0": "colwise", "1.0": "rowwise"})
    assert [e.layout for e in table] == ["ddp", "zero", "fully_shard", "pipeline", "tp"]
    # a pipeline of more stages than layers is left out of the default table
    assert [e.layout for e in td.memory.compare_memory(model, world_size=5)] == ["ddp", "zero", "fully_shard"]
    text = str(table)
    assert "4 rank(s)" in text and all(f"\n{e.layout} " in text for e in table)
    fs = table[2]
    assert f"{fs.peak / MiB:.2f}" in text.splitlines()[4]
    assert "peak" in str(fs) and f"{fs.total / MiB:.2f}" in str(fs)


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0, "layout": "ddp"}, "world_size=0: give the number of ranks"),
    ({"world_size": True, "layout": "ddp"}, "world_size=True"),
    ({"world_size": 2, "layout": "fsdp"}, "unknown layout 'fsdp': choose one of 'ddp'"),
    ({"world_size": 2, "layout": "ddp", "optimizer": "lamb"}, "unknown optimizer 'lamb'"),
    ({"world_size": 2, "layout": "ddp", "units": ["0"]}, "units apply to layout='fully_shard' only"),
    ({"world_size": 2, "layout": "fully_shard", "offload": "disk"}, "offload='disk': give None or 'cpu'"),
    ({"world_size": 2, "layout": "fully_shard", "param_dtype": torch.int8}, "param_dtype=torch.int8"),
    ({"world_size": 2, "layout": "fully_shard", "units": ["nope"]}, "no submodule 'nope'"),
    ({"world_size": 2, "layout": "fully_shard", "units": [nn.Linear(2, 2)]}, "not a submodule"),
    ({"world_size": 2, "layout": "zero", "balance": "params"}, "balance applies to layout='pipeline'"),
    ({"world_size": 2, "layout": "tp"}, "needs plan="),
    ({"world_size": 2, "layout": "tp", "plan": {"0.0": "diagonal"}}, "choose one of colwise"),
    ({"world_size": 9, "layout": "pipeline"}, "use at most 4 ranks"),
])
def test_bad_arguments_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        td.memory.estimate_memory(meta_model(), **kwargs)


@pytest.mark.parametrize("units", ["0", nn.Linear(2, 2)])
def test_one_unit_not_in_a_list_is_refused_with_the_fix(units):
    with pytest.raises(TypeError, match="put it in a list"):
        td.memory.estimate_memory(meta_model(), world_size=2, layout="fully_shard", units=units)


def test_pipeline_needs_a_sequential_and_compare_refuses_unknown_options():
    with pytest.raises(ValueError, match="estimates an nn.Sequential"):
        td.memory.estimate_memory(nn.ModuleDict({"a": nn.Linear(2, 2)}), world_size=2, layout="pipeline")
    with pytest.raises(TypeError, match="unknown option"):
        td.memory.compare_memory(meta_model(), world_size=2, unit=["0"])


# -- against the measurement, in real processes -----------------------------------------------
CONFIG = {"blocks": 3, "width": 96, "steps": 1, "warmup": 2}


def _benchmark():
    spec = importlib.util.spec_from_file_location("sharding_benchmark", ROOT / "benchmarks" / "sharding.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_measured_against_estimated(config: dict):
    """benchmarks/sharding.py's worker (every method's bytes per rank), and the estimate of a
    model this world wrapped with td.fully_shard beside the meta model's."""
    threads = torch.get_num_threads()
    try:
        measured = _benchmark().worker(config)
    finally:
        torch.set_num_threads(threads)
    net = blocks_model(config["width"], config["blocks"])
    for block in list(net)[:-1]:
        td.fully_shard(block)
    td.fully_shard(net)
    wrapped = td.memory.estimate_memory(net, world_size=td.size(), layout="fully_shard")
    return measured, wrapped


def test_estimates_are_within_ten_percent_of_the_benchmarks_measurement_at_two_ranks():
    everyone, wrapped = run_distributed(check_measured_against_estimated, world_size=2,
                                        args=(CONFIG,))[0]
    estimated = _benchmark().estimates(CONFIG, 2)
    assert wrapped == estimated["fully_shard"]  # the wrapped model's units are the meta units
    assert not everyone[0]["errors"].get("fsdp2"), everyone[0]["errors"]
    for name, estimate in estimated.items():
        total = max(r["methods"][name]["memory"]["total"] for r in everyone)
        peak = max(r["methods"][name]["memory"]["peak"] for r in everyone)
        assert 0.9 <= total / estimate.total <= 1.1, (name, total, estimate)
        if name != "fsdp2":  # FSDP2's step is not sampled
            assert 0.9 <= peak / estimate.peak <= 1.1, (name, peak, estimate)
    # tandem's own layouts are counted exactly between steps
    for name in ("ddp", "zero", "fully_shard"):
        assert max(r["methods"][name]["memory"]["total"] for r in everyone) == estimated[name].total


# -- tandem memory ------------------------------------------------------------------------------
NET = textwrap.dedent("""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4096, 4096) for _ in range(64)])
            self.head = nn.Linear(4096, 10)

    def needs_width(width):
        return nn.Linear(width, width)

    def not_a_model():
        return 3

    NUMBER = 7
""")


def test_tandem_memory_prints_the_table_of_a_model_too_large_for_this_machine(tmp_path, capsys):
    (tmp_path / "net.py").write_text(NET)
    assert cli.main(["memory", f"{tmp_path}/net.py:Net", "-np", "8", "--units", "blocks"]) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        import_net = _load(tmp_path / "net.py").Net()
    table = td.memory.compare_memory(import_net, world_size=8, units=list(import_net.blocks))
    assert out.strip() == str(table)
    assert "1074.04 M parameters" in out  # 17 GB of Adam state: built on the meta device only
    assert cli.main(["memory", f"{tmp_path}/net.py:Net", "-np", "8", "--layout", "fully_shard",
                     "--units", "blocks", "--param-dtype", "bf16", "--offload", "cpu"]) == 0
    assert "on the host" in capsys.readouterr().out


def test_tandem_memory_imports_a_module_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["memory", "mymodels:Net", "-np", "2", "--layout", "ddp"]) == 0
    assert "ddp over 2 rank(s), adam" in capsys.readouterr().out


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("net_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, match", [
    (["{d}/net.py"], "give module:attribute or path/to/file.py:attribute"),
    (["{d}/missing.py:Net"], "no file"),
    (["no_such_package.models:Net"], "cannot import module 'no_such_package.models'"),
    (["{d}/net.py:Nett"], "has no 'Nett'; it defines Net"),
    (["{d}/net.py:NUMBER"], "'NUMBER' is a int, not a class or function"),
    (["{d}/net.py:needs_width"], "give a function that takes none"),
    (["{d}/net.py:not_a_model"], "returned a int, not an nn.Module"),
    (["{d}/net.py:Net", "-np", "0"], "-np 0: give the number of ranks, 1 or more"),
    (["{d}/net.py:Net", "--layout", "fsdp"], "unknown layout 'fsdp': choose one of"),
    (["{d}/net.py:Net", "--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["{d}/net.py:Net", "--units", "layers"], "--units 'layers': the model has no submodule"),
    (["{d}/net.py:Net", "--layout", "ddp", "--offload", "cpu"], "apply to another layout"),
    (["{d}/net.py:Net", "--balance", "3,x"], "--balance '3,x': give 'params' or layer counts"),
])
def test_tandem_memory_bad_input_names_the_fix(tmp_path, capsys, argv, match):
    (tmp_path / "net.py").write_text(NET)
    argv = [a.format(d=tmp_path) for a in argv]
    if "-np" not in argv:
        argv += ["-np", "2"]
    assert cli.main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem memory: error: ") and match in err, err
