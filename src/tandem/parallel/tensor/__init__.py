"""Tensor parallelism: layers split over the ranks of a group, and branches placed on ranks.

- `regions`: Megatron's conjugate autograd functions (copy/reduce, gather/scatter).
- `layers`: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelAttention.
- `loss`: vocab_parallel_cross_entropy.
- `plan`: parallelize(model, plan, group), by layer name.
- `branches`: Branches, a model's branches run on different ranks at the same time.
- `state`: full_state_dict / load_full_state_dict (consolidate on save, reshard on load).
"""

from tandem.parallel.tensor.branches import Branches
from tandem.parallel.tensor.layers import (
                                           ColumnParallelLinear,
                                           ParallelAttention,
                                           RowParallelLinear,
                                           VocabParallelEmbedding,
)
from tandem.parallel.tensor.loss import vocab_parallel_cross_entropy
from tandem.parallel.tensor.plan import parallelize
from tandem.parallel.tensor.regions import (
                                           copy_to_group,
                                           gather_from_group,
                                           reduce_from_group,
                                           scatter_to_group,
)
from tandem.parallel.tensor.state import full_state_dict, load_full_state_dict

__all__ = ["Branches", "ColumnParallelLinear", "ParallelAttention", "RowParallelLinear",
           "VocabParallelEmbedding", "copy_to_group", "full_state_dict", "gather_from_group",
           "load_full_state_dict", "parallelize", "reduce_from_group", "scatter_to_group",
           "vocab_parallel_cross_entropy"]
