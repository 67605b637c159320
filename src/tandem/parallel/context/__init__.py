"""Context parallelism: one sequence split over the ranks of a group (DESIGN §5).

    mesh = td.mesh(dp=2, cp=2)
    model = td.context.parallelize(model, group=mesh.cp_group, style="ring")  # or "alltoall"
    opt = td.DistributedOptimizer(opt, model.named_parameters(), group=mesh.dp_cp_group)
    ids, pos, labels = td.context.split(ids, pos, labels, seq_dim=1, group=mesh.cp_group)
    loss = F.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten())  # this rank's tokens

- `layout`: the head-tail split (rank i holds chunks i and 2sp-1-i of 2sp), `split` / `gather`
- `apply`: `parallelize(model, group, style)`: the model's attention calls, caught while its
  forward runs, go over the group; the forward/backward agreements of a split model
- `ring`: ring attention (online softmax, explicit backward, causal load balancing)
- `ulysses`: the all-to-all form (heads for the sequence around attention)
- `wire`: the messages, with the header that names a rank that skipped an attention call

The parameters are not split: every rank holds them whole, and a checkpoint is the model's own
state dict. Gradients are partial per rank; average them over dp x cp (`mesh.dp_cp_group`).
"""

from tandem.parallel.context.apply import ContextParallelError, parallelize
from tandem.parallel.context.layout import SequenceSplitError, gather, split

__all__ = ["ContextParallelError", "SequenceSplitError", "gather", "parallelize", "split"]
