"""Metrics: values averaged over the ranks (`td.metrics.Average`, `td.metrics.progress`), and
`td.metrics.MetricLogger` writing them from rank 0; `td.metrics.report(samples=N)` tells `tandem
scale` a step's samples.
`td.metrics` is tandem 1.0's namespace for these names.

What is where:

- `average`: Rank-0 progress bars and metrics averaged over every rank's samples (`td.metrics.progress`,
  `td.metrics.Average`).
- `logger`: `td.metrics.MetricLogger`: scalars averaged over the ranks, written by rank 0 to TensorBoard
  and CSV.
- `means`: Means of named values over the ranks: the one reduction of `td.metrics.Average` and
  `td.metrics.MetricLogger`.
"""

# `td.metrics` (tandem 1.0's namespace for metrics) and what users imported from the one module
# `tandem.metrics` was before issue 39's restructuring, loaded on first use (nothing is imported
# with the package).
_HOME = {
    **dict.fromkeys(("Average", "Group", "T", "group_rank", "progress", "reduce_means"),
                    "tandem.metrics.average"),
    "MetricLogger": "tandem.metrics.logger",
    "MetricMismatchError": "tandem.metrics.means",
    "report": "tandem.diagnostics.steps",
}
__all__ = ["Average", "MetricLogger", "MetricMismatchError", "progress", "report"]


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
