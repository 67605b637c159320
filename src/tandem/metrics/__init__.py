"""Metrics: values averaged over the ranks (`td.Average`, `td.progress`), and `td.MetricLogger`
writing them from rank 0.

What is where:

- `average`: Rank-0 progress bars and metrics averaged over every rank's samples (`td.progress`,
  `td.Average`).
- `logger`: `td.MetricLogger`: scalars averaged over the ranks, written by rank 0 to TensorBoard
  and CSV.
- `means`: Means of named values over the ranks: the one reduction of `td.Average` and
  `td.MetricLogger`.
"""

# `tandem.metrics` was one module before issue 39's restructuring; what users imported from it keeps
# working, loaded on first use (nothing is imported with the package).
_MOVED = "tandem.metrics.average"
_NAMES = (
    'Average',
    'Group',
    'T',
    'group_rank',
    'progress',
    'reduce_means',
)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_MOVED), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
