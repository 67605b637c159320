"""This rank's rows of a global batch, the same on every world size."""

from __future__ import annotations

from tandem import runtime


def local_rows(global_batch: int) -> slice:
    """The rows of a `global_batch`-row batch this rank trains on: an equal, contiguous share.

    Averaging equal shares' mean gradients is the global batch's mean gradient, whatever the
    world size, which is what keeps an elastic job's result the one-process result. Unequal
    shares would weigh some rows more than others, so a batch the world cannot split evenly
    is an error: pick a global batch divisible by every size between --min-np and --max-np.

    Args:
        global_batch: the rows of the whole step's batch, over every rank.

    Returns:
        The slice of the global batch's rows this rank trains on (`batch[td.elastic.local_rows(n)]`).

    Raises:
        ValueError: `global_batch` does not split evenly over the world's ranks.
        RuntimeError: `td.init()` has not been called.
    """
    size, rank = runtime.size(), runtime.rank()
    if global_batch % size:
        raise ValueError(
            f"td.elastic.local_rows({global_batch}): {global_batch} rows do not split evenly over "
            f"{size} ranks, and unequal shares would change the averaged gradient. Give a global "
            f"batch divisible by every world size the job may have (e.g. a multiple of 12 for "
            f"2 to 4 ranks)")
    share = global_batch // size
    return slice(rank * share, (rank + 1) * share)
