"""What each rank holds of a split model: the one owner protocol that checkpoints and model-wide
calls ask, whatever the split.

What is where:

- `elementwise`: Whether an optimizer may step flat shards of a parameter: is its update
  element-wise?
- `flat_shard`: One flat space cut into equal shards: the arithmetic ZeroOptimizer and
  fully_shard share.
- `owner`: One owner per split: the object every model-wide call asks, whatever wraps the
  model (`owner_of`).
- `pieces`: Pieces of one-process tensors held by a rank: the vocabulary of tandem's one layout
  protocol.
- `protocol`: What each rank holds of a split model: the one protocol behind checkpoints and
  model-wide calls.
- `state_pieces`: State as boxes of one-process tensors, from any layout into any other: the
  one resharding path.
- `split_grads`: Gradients of split parameters that give torch's own norm functions the global
  answer.
- `splits`: Which tensors are split across ranks, how, and over which group: the registry every
  model-wide call asks (instead of markers set on the tensors).
- `state_hooks`: `model.state_dict()` and `model.load_state_dict()` of a split model speak the
  one-process model.
"""
