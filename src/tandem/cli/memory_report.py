"""`tandem memory`: bytes per rank of a model under each layout, estimated without running it.

    tandem memory mypkg.models:make_model -np 8                  # a module's factory
    tandem memory train.py:Net -np 8 --units blocks              # a class in a file; one unit per block
    tandem memory train.py:Net -np 8 --layout fully_shard --param-dtype bf16 --offload cpu

MODEL is `module:attribute` or `path/to/file.py:attribute`, where the attribute is a class or a
function that takes no arguments and returns the model. It is built on the meta device (shapes
only, no memory), so a model larger than this machine can be estimated. The table comes from
`td.memory.compare_memory` (or `td.memory.estimate_memory` with `--layout`): parameters, gradients, optimizer
state, the wrapper's buffers, the bytes kept between steps, the most added during a step, the
peak, and what `--offload cpu` keeps on the host. Activations are not counted.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DTYPES = ("fp32", "bf16", "fp16", "fp64")


class ModelSpecError(ValueError):
    """MODEL names nothing that builds a model; the message says what to give instead."""


def load_factory(spec: str) -> Callable[[], Any]:
    """The class or function that `spec` ("module:attr" or "file.py:attr") names."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise ModelSpecError(
            f"MODEL {spec!r}: give module:attribute or path/to/file.py:attribute, e.g. "
            f"mypkg.models:make_model or train.py:Net")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ModelSpecError(f"MODEL {spec!r}: no file {target} (from {Path.cwd()})")
        name = f"_tandem_model_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            loader.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise ModelSpecError(f"MODEL {spec!r}: importing {target} failed: "
                                 f"{type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            raise ModelSpecError(
                f"MODEL {spec!r}: cannot import module {target!r} ({error}); run from the "
                f"directory that holds it, add it to PYTHONPATH, or give a file path "
                f"(path/to/file.py:{attribute})") from error
    factory = getattr(module, attribute, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise ModelSpecError(f"MODEL {spec!r}: {target} has no {attribute!r}; it defines "
                             f"{', '.join(public) or 'nothing callable'}")
    if not callable(factory):
        raise ModelSpecError(f"MODEL {spec!r}: {attribute!r} is a {type(factory).__name__}, "
                             f"not a class or function that builds the model")
    return factory


def build_on_meta(factory: Callable[[], Any], spec: str):
    """Call `factory()` with the meta device as the default: shapes and dtypes, no storage."""
    import torch
    from torch import nn

    try:
        with torch.device("meta"):
            model = factory()
    except TypeError as error:
        raise ModelSpecError(
            f"MODEL {spec!r}: calling it with no arguments failed ({error}); give a function "
            f"that takes none, e.g. def make(): return Net(width=1024)") from error
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"MODEL {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _dtype(name: str | None):
    import torch

    return None if name is None else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                      "fp16": torch.float16, "fp64": torch.float64}[name]


def _units(model, name: str | None) -> list | None:
    """`--units NAME`: every child of the submodule NAME ('.' for the model's own children)."""
    if name is None:
        return None
    modules = dict(model.named_modules())
    holder = model if name == "." else modules.get(name)
    if holder is None:
        containers = [n for n, m in modules.items() if n and len(m._modules) > 1][:8]
        raise ModelSpecError(f"--units {name!r}: the model has no submodule of that name; "
                             f"give one whose children are the blocks, e.g. "
                             f"{', '.join(containers) or '.'}")
    return list(holder.children())


def report(spec: str, world_size: int, layout: str | None, optimizer: str, units: str | None,
           param_dtype: str | None, reduce_dtype: str | None, offload: str | None,
           balance: str | None) -> str:
    """The table `tandem memory` prints (ModelSpecError / ValueError on bad input)."""
    from tandem.parallel.memory import compare_memory, estimate_memory

    if world_size < 1:
        raise ValueError(f"-np {world_size}: give the number of ranks, 1 or more")
    model = build_on_meta(load_factory(spec), spec)
    shard = {"units": _units(model, units), "param_dtype": _dtype(param_dtype),
             "reduce_dtype": _dtype(reduce_dtype), "offload": offload}
    shard = {k: v for k, v in shard.items() if v is not None}
    split = None
    if balance is not None:
        try:
            split = balance if balance == "params" else [int(c) for c in balance.split(",")]
        except ValueError:
            raise ValueError(f"--balance {balance!r}: give 'params' or layer counts per stage, "
                             f"e.g. 3,4") from None
    if layout is None:
        options = dict(shard, **({"balance": split} if split is not None else {}))
        return str(compare_memory(model, world_size=world_size, optimizer=optimizer, **options))
    options = shard if layout == "fully_shard" else {}
    if layout == "pipeline" and split is not None:
        options = {"balance": split}
    ignored = [flag for flag, given in (("--units/--param-dtype/--reduce-dtype/--offload",
                                         shard and layout != "fully_shard"),
                                        ("--balance", split is not None and layout != "pipeline"))
               if given]
    if ignored:
        raise ValueError(f"{' and '.join(ignored)} apply to another layout than --layout {layout}: "
                         f"leave them out")
    return str(estimate_memory(model, world_size=world_size, layout=layout, optimizer=optimizer,
                               **options))
