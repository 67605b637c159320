"""`td.tensor`: tensor parallelism, the front door (the code lives in `tandem.parallel.tensor`).

    model = td.tensor.parallelize(model, {"0": "colwise", "2": "rowwise"}, group=mesh.tp_group)
    attn = td.tensor.ParallelSelfAttention(embed_dim, heads, group=mesh.tp_group)

Layers split inside across the ranks of a group (column- and row-parallel `Linear`, a
vocabulary-parallel embedding and its cross-entropy, self-attention with its heads split),
`parallelize` converting an existing model's layers by name, and `Branches`, a model's
parallel paths placed on the ranks of a group. `td.parallelize` is the same function.
"""

from tandem.parallel.tensor import (
    Branches,
    ColumnParallelLinear,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallelize,
    vocab_parallel_cross_entropy,
)

__all__ = ["Branches", "ColumnParallelLinear", "ParallelSelfAttention", "RowParallelLinear",
           "VocabParallelEmbedding", "parallelize", "vocab_parallel_cross_entropy"]
