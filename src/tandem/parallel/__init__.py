"""Every way of splitting a model, each a folder; the loose modules serve every split (broadcasts,
`td.no_sync`, activation checkpointing, SyncBatchNorm, the per-operation agreement of split
models).

What is where:

- `activation_checkpoint`: Activation checkpointing per block: `td.memory.checkpoint_wrapper(model,
  policy=Block)`.
- `broadcast`: Make replicas start equal: broadcast parameters, buffers and optimizer state from
  one rank.
- `compression`: `tandem.parallel.compression` is now
  `tandem.parallel.data_parallel.compression`.
- `context/`: Context parallelism: one sequence split over the ranks of a group (DESIGN §5).
- `data_parallel/`: Data parallelism: where gradients are reduced (`reducer`), behind
  `td.DistributedOptimizer` and `td.DistributedDataParallel`; `td.join`,...
- `fully_shard/`: Fully sharded data parallelism (ZeRO-3, FSDP2-style); see `api` for the user
  guide.
- `gradient_sync`: One gradient-sync switch for a model, whatever reduces its gradients.
- `layout/`: What each rank holds of a split model: the one owner protocol that checkpoints and
  model-wide calls ask, whatever the split.
- `memory/`: How many bytes each rank holds for a model under each of tandem's layouts, before
  running it.
- `model_check`: Which split model a call is about: the per-operation check of each split
  module, and the hooks that open its forwards, backwards and `state_dict()` calls.
- `operation_check`: One agreement per operation of a model: ranks whose code paths diverged are
  named, not mixed.
- `pipeline/`: Pipeline parallelism: one model split into stages across the ranks of a group.
- `sync_bn`: `SyncBatchNorm`: batch statistics over every rank of the group, not just this
  rank's batch.
- `tensor/`: Tensor parallelism: layers split inside across the ranks of a group, and branches
  of a model run on different ranks at the same time.
- `zero/`: ZeRO stage 1: `td.ZeroOptimizer`, each rank keeping its shard's optimizer state.
"""
