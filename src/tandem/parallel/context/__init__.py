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
- `ops`: the attention calls as torch custom operators, for a compiled model
- `mha`: `F.multi_head_attention_forward` with its attention call sent to the split

The parameters are not split: every rank holds them whole, and a checkpoint is the model's own
state dict (`td.Checkpointer` saves and restores it as any replicated model's). Gradients are
partial per rank: with each rank's loss the mean over its own tokens, their mean over dp x cp
(`mesh.dp_cp_group`) is one process's (the same as summing, over the cp ranks, the gradients of
each rank's sum over its tokens divided by the whole sequence's count). Losses that count
tokens unevenly (an ignore_index) need that second form, with the count all-reduced.

Works with activation checkpointing (`td.checkpoint_wrapper`, `torch.utils.checkpoint`): a
recomputed block attends over the group again. Works under `torch.compile` (`ops`: the attention
calls are custom operators in the graph; `mha`: nn.MultiheadAttention's function with its
attention sent to the split); a checkpointed region runs outside the graph. Refused with the
reason: attention dropout in the ring form, masks other than is_causal in the ring form (the
all-to-all form takes a mask over the whole sequence), cross-attention and grouped-query
attention.
"""

from tandem.parallel.context.apply import ContextParallelError, parallelize
from tandem.parallel.context.layout import SequenceSplitError, gather, split

__all__ = ["ContextParallelError", "SequenceSplitError", "gather", "parallelize", "split"]
