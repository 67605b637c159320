"""ZeRO stage 1: `td.ZeroOptimizer`, each rank keeping its shard's optimizer state.

What is where:

- `optimizer`: ZeRO stage 1: each rank keeps the optimizer state of only its shard of the
  parameters.
"""
