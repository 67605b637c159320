"""`td.context`: context parallelism, one sequence split over the ranks of a group, the front
door (the code, and its user guide, live in `tandem.parallel.context`).

    model = td.context.parallelize(model, group=mesh.cp_group, style="ring")  # or "alltoall"
    ids, pos, labels = td.context.split(ids, pos, labels, seq_dim=1, group=mesh.cp_group)
    logits = td.context.gather(model(ids, pos), seq_dim=1, group=mesh.cp_group)
"""

from tandem.parallel.context import ContextParallelError, SequenceSplitError, gather, parallelize, split

__all__ = ["ContextParallelError", "SequenceSplitError", "gather", "parallelize", "split"]
