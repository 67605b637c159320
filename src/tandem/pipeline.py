"""`td.pipeline`: pipeline parallelism, the front door (the code lives in `tandem.parallel.pipeline`).

    pipe = td.Pipeline(model, chunks=4, balance=[2, 3])     # also td.pipeline.Pipeline
    loss = pipe.train_step(x, y, loss_fn)
    stats: td.pipeline.PipelineStats = pipe.stats

A model cut into stages, one per rank of the pipeline's group, each micro-batch passed on as
soon as it is ready (schedules GPipe, 1F1B, interleaved, or a list of actions).
"""

from tandem.parallel.pipeline import Pipeline, PipelineStats

__all__ = ["Pipeline", "PipelineStats"]
