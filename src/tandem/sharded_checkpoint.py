"""Sharded checkpoints that load on any world size.

    td.save_sharded("ckpt/step-100", model=model, optimizer=opt, step=StepCounter(...))
    td.load_sharded("ckpt/step-100", model=model, optimizer=opt)   # on any number of ranks

`path` becomes a directory: every rank writes `shard-<r>-of-<n>.pt`, the unpadded part of its
shard of each fully sharded unit's parameters and of the optimizer's per-element state (Adam's
moments, momentum) over that unit; rank 0 writes `manifest.pt`, which lists the files, the
range of the flat space each holds, each unit's parameter names and shapes, and everything
that is the same on every rank (buffers, hyper-parameters, scalar state such as Adam's step,
and the `state_dict()` of any other object: a `ZeroOptimizer` or `DistributedOptimizer`
gives its full state, which loads on any world size too). The directory is written under a
temporary name and renamed into place once every rank's file and the manifest are on disk:
a crash mid-save leaves the previous checkpoint as it was.

Loading reads the manifest on every rank (the directory must be visible to every rank, a
shared file system, as for torch's distributed checkpoints), checks that every file is there
and that the model's units have the saved names and shapes, and only then reads, from the
files that overlap it, the range of each unit that this rank now owns. `td.Checkpointer` uses
this format when any object it saves is fully sharded.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm import collectives
from tandem.files import CheckpointError, fsync_directory
from tandem.parallel.fully_shard import units
from tandem.parallel.fully_shard.api import check_names
from tandem.parallel.fully_shard.unit import SHARD

FORMAT = "tandem-sharded-1"
MANIFEST = "manifest.pt"
# Test hook: called on rank 0 with the temporary directory once every file is written, just
# before it is renamed into place. The crash test SIGKILLs its own process there.
_before_publish: Callable[[Path], None] | None = None


def is_sharded(obj: Any) -> bool:
    """A module with fully sharded units (an optimizer over them is found through it)."""
    return isinstance(obj, nn.Module) and any(True for _ in units(obj))


def _rank_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _all(obj: Any) -> list[Any]:
    return collectives.allgather_object(obj) if _rank_size()[1] > 1 else [obj]


def _shard_keys(objects: dict[str, Any]) -> dict[int, str]:
    """id(shard parameter) -> its key '<object>/<unit path>' for every sharded model."""
    keys = {}
    for name, obj in objects.items():
        if is_sharded(obj):
            for path, unit in units(obj):
                keys[id(unit.shard)] = f"{name}/{path}"
    return keys


def _collect(objects: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(this rank's flat pieces, what goes to the manifest) for everything in `objects`."""
    pieces: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"flat": {}, "layouts": {}, "replicated": {}}
    keys = _shard_keys(objects)
    unit_of = {}
    for name, obj in objects.items():
        if is_sharded(obj):
            layout = {}
            for path, unit in units(obj):
                key = f"{name}/{path}"
                unit_of[key] = unit
                lo, hi = unit.my_range()
                pieces[key] = unit.shard.detach()[: hi - lo].cpu()
                meta["flat"][key] = unit.numel
                layout.update({(f"{path}.{n}" if path else n): tuple(s)
                               for n, s in zip(unit.names, unit.shapes, strict=True)})
            meta["layouts"][name] = layout
            meta["replicated"][name] = {k: v for k, v in obj.state_dict().items()
                                        if k.split(".")[-1] != SHARD}
        elif isinstance(obj, torch.optim.Optimizer) and any(
                id(p) in keys for g in obj.param_groups for p in g["params"]):
            state = obj.state_dict()
            params = [p for g in obj.param_groups for p in g["params"]]
            scalars, index = {}, []
            for i, p in enumerate(params):
                if id(p) not in keys:
                    raise ValueError(
                        f"{name}: parameter {i} of the optimizer is not a fully sharded shard; "
                        f"apply td.fully_shard to the root module too, so every parameter is in a unit")
                key = keys[id(p)]
                index.append(key)
                lo, hi = unit_of[key].my_range()
                scalars[key] = {}
                for k, v in state["state"].get(i, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and k != "step":
                        pieces[f"{name}/{key}/{k}"] = v.detach()[: hi - lo].cpu()
                        meta["flat"][f"{name}/{key}/{k}"] = unit_of[key].numel
                    else:
                        scalars[key][k] = v
            meta["replicated"][name] = {"param_groups": state["param_groups"], "scalars": scalars,
                                        "index": index}
        else:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name}={type(obj).__name__} has no state_dict()/load_state_dict()")
            meta["replicated"][name] = obj.state_dict()  # collective for ZeroOptimizer
    return pieces, meta


def _write(obj: Any, path: Path) -> None:
    with open(path, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def save_sharded(path: str | os.PathLike, **objects: Any) -> None:
    """Write a sharded checkpoint directory at `path` (every rank calls it; atomic)."""
    if not objects:
        raise ValueError("nothing to save: pass the objects, e.g. save_sharded(path, model=model)")
    rank, size = _rank_size()
    path = Path(os.fspath(path))
    pieces, meta = _collect(objects)
    token = secrets.token_hex(6) if rank == 0 else None
    if size > 1:
        token = collectives.broadcast_object(token, root=0)
    temporary = path.parent / f".{path.name}.tmp-{token}"
    problem = None
    if rank == 0:
        try:
            temporary.mkdir(parents=False)
        except OSError as error:
            problem = f"rank 0 could not create {str(temporary)!r}: {error}"
    if size > 1:
        problem = collectives.broadcast_object(problem, root=0)
    if problem is not None:
        raise CheckpointError(f"cannot save sharded checkpoint {str(path)!r}: {problem}")
    files = [f"shard-{r:05d}-of-{size:05d}.pt" for r in range(size)]
    try:
        _write(pieces, temporary / files[rank])
        mine = None
    except OSError as error:
        mine = f"rank {rank} could not write {files[rank]}: {error}"
    ranges = _all((mine, {key: _range_of(objects, key) for key in pieces}))
    failures = [failure for failure, _ in ranges if failure is not None]
    if not failures and rank == 0:
        try:
            meta.update(format=FORMAT, world_size=size, files=files,
                        ranges=[r for _, r in ranges])
            _write(meta, temporary / MANIFEST)
            fsync_directory(temporary)
            if _before_publish is not None:
                _before_publish(temporary)
            _publish(temporary, path)
        except OSError as error:
            failures.append(f"rank 0 could not publish the checkpoint: {error}")
    if size > 1:
        failures = collectives.broadcast_object(failures, root=0)
    if failures:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(f"could not save sharded checkpoint {str(path)!r}: " + "; ".join(failures))


def _range_of(objects: dict[str, Any], key: str) -> tuple[int, int]:
    model_name, rest = key.split("/", 1)
    if not is_sharded(objects.get(model_name)):  # an optimizer key: '<opt>/<model>/<unit>/<k>'
        model_name, rest = rest.split("/", 1)
    unit_path = rest.split("/", 1)[0]
    return dict(units(objects[model_name]))[unit_path].my_range()


def _publish(temporary: Path, path: Path) -> None:
    """Rename the finished directory into place; an older one at `path` goes after."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{secrets.token_hex(6)}"
        os.replace(path, old)
    os.replace(temporary, path)
    fsync_directory(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # from saves that crashed
        shutil.rmtree(leftover, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, after checking that every shard file it lists is there (all ranks agree)."""
    problem = None
    try:
        manifest = torch.load(path / MANIFEST, map_location="cpu", weights_only=True)
        if manifest.get("format") != FORMAT:
            problem = f"{MANIFEST} is not a {FORMAT} manifest"
        else:
            missing = [f for f in manifest["files"] if not (path / f).is_file()]
            if missing:
                problem = (f"the manifest lists {len(manifest['files'])} shard files but "
                           f"{', '.join(missing)} is missing; the checkpoint is incomplete "
                           f"(copy every shard file, or load an earlier checkpoint)")
    except FileNotFoundError:
        problem = f"no {MANIFEST} (not a sharded checkpoint, or its save did not complete)"
    except Exception as error:  # a truncated or foreign file
        problem = f"{MANIFEST} is unreadable ({type(error).__name__}: {error})"
    problems = [p for p in _all(problem) if p is not None]
    if problems:
        raise CheckpointError(f"cannot load sharded checkpoint {str(path)!r}: {problems[0]}")
    return manifest


class _Reader:
    """Reads, from the files that overlap it, any range of a flat key."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest, self._open = path, manifest, {}

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        for r, ranges in enumerate(self.manifest["ranges"]):
            if key not in ranges:
                continue
            a, b = ranges[key]
            x, y = max(a, lo), min(b, hi)
            if x < y:
                if r not in self._open:
                    self._open[r] = torch.load(self.path / self.manifest["files"][r],
                                               map_location="cpu", weights_only=True, mmap=True)
                out[x - lo : y - lo].copy_(self._open[r][key][x - a : y - a])


def load_sharded(path: str | os.PathLike, **objects: Any) -> None:
    """Load a `save_sharded` checkpoint into `objects`, on any world size (every rank calls it).

    Nothing is modified unless the whole checkpoint is there and matches the objects.
    """
    path = Path(os.fspath(path))
    manifest = read_manifest(path)
    saved = manifest["replicated"]
    absent = sorted(set(objects) - set(saved))
    if absent:
        raise KeyError(f"sharded checkpoint {str(path)!r} has no state for {absent}; it holds "
                       f"{sorted(saved)}: restore the names you saved")
    for name, obj in objects.items():
        if name in manifest["layouts"] and not is_sharded(obj):
            raise CheckpointError(
                f"{name} was saved fully sharded in {path}: apply td.fully_shard to the model as "
                f"when it was saved (on any number of ranks), then load; td.full_state_dict(model) "
                f"then gives the ordinary state dict")
        if is_sharded(obj):
            if name not in manifest["layouts"]:
                raise CheckpointError(f"{name} is fully sharded but was saved unsharded in {path}")
            layout = {(f"{p}.{n}" if p else n): tuple(s)
                      for p, unit in units(obj) for n, s in zip(unit.names, unit.shapes, strict=True)}
            check_names(layout, manifest["layouts"][name], f"checkpoint {str(path)!r} ({name})")
    reader = _Reader(path, manifest)
    keys = _shard_keys(objects)
    with torch.no_grad():
        for name, obj in objects.items():
            if is_sharded(obj):
                for unit_path, unit in units(obj):
                    lo, hi = unit.my_range()
                    unit.shard.zero_()
                    reader.read(f"{name}/{unit_path}", lo, hi, unit.shard[: hi - lo])
                obj.load_state_dict(saved[name], strict=False)
            elif isinstance(obj, torch.optim.Optimizer) and any(
                    id(p) in keys for g in obj.param_groups for p in g["params"]):
                _load_optimizer(name, obj, saved[name], keys, reader, objects)
            else:
                obj.load_state_dict(saved[name])


def _load_optimizer(name, optimizer, saved, keys, reader, objects) -> None:
    groups = saved["param_groups"]
    mine = optimizer.state_dict()["param_groups"]
    if len(groups) != len(mine) or any(len(a["params"]) != len(b["params"])
                                       for a, b in zip(groups, mine, strict=True)):
        raise CheckpointError(f"{name}: the optimizer's param groups differ from the saved ones "
                              f"({[len(g['params']) for g in mine]} vs "
                              f"{[len(g['params']) for g in groups]} parameters per group)")
    state = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        key = keys[id(p)]
        model_name, unit_path = key.split("/", 1)
        unit = dict(units(objects[model_name]))[unit_path]
        lo, hi = unit.my_range()
        entry = dict(saved["scalars"].get(key, {}))
        for flat_key in reader.manifest["flat"]:
            prefix = f"{name}/{key}/"
            if flat_key.startswith(prefix) and "/" not in flat_key[len(prefix):]:
                value = torch.zeros_like(p)
                reader.read(flat_key, lo, hi, value[: hi - lo])
                entry[flat_key[len(prefix):]] = value
        if entry:
            state[i] = entry
    optimizer.load_state_dict({"state": state, "param_groups": [
        {**g, "params": m["params"]} for g, m in zip(groups, mine, strict=True)]})
