"""Tensor parallelism: layers split inside across the ranks of a group, and branches of a model
run on different ranks at the same time.

- `regions`: the conjugate communication pairs (copy_to / reduce_from, gather_from / scatter_to)
- `region_ops`: the same pairs as torch custom operators, for graphs that `torch.compile` traces
- `layers`: column- and row-parallel `Linear`, vocabulary-parallel embedding and cross-entropy
- `attention`: self-attention with its heads split
- `plan`: `parallelize(model, plan, group)` converts an existing model's layers by name;
  `full_state_dict(model)` gathers the one-process state back (also `td.fsdp.full_state_dict`)
- `branches`: `Branches`, a model's parallel paths placed on the ranks of a group

Compose with data parallelism through `td.mesh(dp=, tp=)`: the tp group splits the layers,
the dp group averages the gradients (`td.DistributedOptimizer(..., group=mesh.dp_group)`).
"""

from tandem.parallel.tensor.attention import ParallelSelfAttention
from tandem.parallel.tensor.branches import Branches
from tandem.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tandem.parallel.tensor.plan import full_state_dict, parallelize

__all__ = [
    "Branches",
    "ColumnParallelLinear",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "full_state_dict",
    "parallelize",
    "vocab_parallel_cross_entropy",
]
