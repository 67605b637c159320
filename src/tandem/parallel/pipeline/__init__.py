"""Pipeline parallelism: one model split into stages across the ranks of a group.

Layers, each importing only the ones below it:

- `stage`: `Pipeline`, this rank's stage; the public entry (`td.Pipeline`).
- `build`: splitting the model (balance, argument checks shared by every rank) at construction.
- `executor`: one step on one stage: runs its action list, keeps `PipelineStats`.
- `schedules`: GPipe and 1F1B as plain per-stage action lists (pure, tested without processes).
- `edges`: what crosses an edge between stages (`EdgeSpec`) and the point-to-point `Link`.
- `balance`: pure cost models and partitioning for `balance=`.
"""

from tandem.parallel.pipeline.executor import PipelineStats
from tandem.parallel.pipeline.stage import Pipeline

__all__ = ["Pipeline", "PipelineStats"]
