"""Data parallelism: where gradients are reduced (`reducer`), behind `td.DistributedOptimizer` and
`td.DistributedDataParallel`; `td.join`, compression, LocalSGD.

What is where:

- `buckets`: Which gradients travel together: the pure bucket-assignment policy of the reducer.
- `comm_hooks`: The reducer's communication-hook contract: `GradBucket`, `CommHook`, the default
  all-reduce.
- `compile_split`: Communication that still overlaps backward when the model is compiled
  (`torch.compile`).
- `compression`: Gradient compression: communication hooks that send fewer bytes, and
  `compression=` names.
- `join`: `td.join`: data-parallel training when ranks have different numbers of batches.
- `join_rounds`: The reducer's half of `td.join()`: rounds answered by ranks that ran out of
  data.
- `local_sgd`: Local SGD: replicas step on their own and average their parameters every `period`
  steps.
- `reducer`: The gradient reducer behind `DistributedOptimizer` and `DistributedDataParallel`.
- `reducer_front`: What `DistributedOptimizer` and `DistributedDataParallel` share around their
  `Reducer`: argument checks (on this rank, and the ranks' agreement on...
- `samples`: Samples per rank: the weight of each rank's gradient when the ranks' batches
  differ.
- `step_clock`: Per-step timing of the data-parallel wrappers (`last_step_stats`), from host
  clocks only.
- `wrappers`: Synchronous data parallelism: `DistributedOptimizer` and
  `DistributedDataParallel`.
"""
