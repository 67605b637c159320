"""State on disk: where a checkpoint is written and read, in one file (`td.save`/`td.load`,
`td.Checkpointer`) or in PyTorch's DCP format (`td.checkpoint.save_sharded`/`load_sharded`),
published atomically. `td.checkpoint` is tandem 1.0's namespace for these names.

What is where:

- `checkpointer`: Checkpoints that survive crashes: `td.save`/`td.load` for one file,
  `td.Checkpointer` for a run.
- `checksums`: Checksums of a distributed checkpoint's bytes: computed by the writer, checked
  before a load.
- `dcp_files`: The files of a distributed checkpoint: PyTorch's DCP writer and reader driven by
  tandem's engine.
- `dir_owner`: One running job per checkpoint directory: the owner file, and who may take it
  over.
- `durable`: What the checkpoint modules share: their errors, making a rename durable, naming a
  full disk.
- `exit`: The last async checkpoint is published when the script ends without `wait()`.
- `sharded`: Checkpoints of split models in PyTorch's Distributed Checkpoint (DCP) format, any
  layout to any.
- `steps_on_disk`: The step directories of a `Checkpointer`: which exist, which go, and what to
  say when the newest is damaged (the older ones a user can fall back...
"""

# `td.checkpoint` (tandem 1.0's namespace for state on disk) and what users imported from the one
# module `tandem.checkpoint` was before issue 39's restructuring, loaded on first use (nothing is
# imported with the package).
_HOME = {
    **dict.fromkeys(("CheckpointError", "Checkpointer", "CorruptCheckpointError", "PathLike", "load",
                     "no_space", "save"), "tandem.checkpoint.checkpointer"),
    **dict.fromkeys(("load_sharded", "save_sharded"), "tandem.checkpoint.sharded"),
}
__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointError", "load", "load_sharded", "save",
           "save_sharded"]


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
