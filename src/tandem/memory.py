"""`td.memory`: how much memory a model takes per rank, and less of it (the code lives in
`tandem.parallel.memory` and `tandem.parallel.activation_checkpoint`).

    est = td.memory.estimate_memory(model, world_size=8, layout="fully_shard", units=model.blocks)
    print(td.memory.compare_memory(model, world_size=8, units=model.blocks))  # every layout
    td.memory.checkpoint_wrapper(model, policy=nn.TransformerEncoderLayer)    # recompute blocks
"""

from tandem.parallel.activation_checkpoint import checkpoint_wrapper
from tandem.parallel.memory import MemoryComparison, MemoryEstimate, compare_memory, estimate_memory

__all__ = ["MemoryComparison", "MemoryEstimate", "checkpoint_wrapper", "compare_memory",
           "estimate_memory"]
