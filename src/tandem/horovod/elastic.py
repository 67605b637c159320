"""`hvd.elastic`: Horovod's elastic API over `td.elastic` (`tandem run --min-np/--max-np`).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0))

`TorchState`, `ObjectState` and `State` are `td.elastic.State` with Horovod's semantics (the
model and the optimizer are optional; every other keyword is an attribute): a commit compares
neither the extras nor the model across ranks (each rank may keep its own timings, and its own
BatchNorm running statistics), and every change of world takes the model (parameters and
buffers), the optimizer and the extras from one rank (rank 0 when all hold the same number of
commits), as Horovod's `sync()` broadcasts them from rank 0. `td.elastic.State` keeps its
stricter checks. `run` is `td.elastic.run`, and `HostsUpdatedInterrupt` is
`td.elastic.WorldChanged`. What Horovod has and this does not:
`ElasticSampler` (it re-splits an epoch's remaining samples by the new world size, so the data
order depends on it; tandem's elastic result is exact when each step's global batch depends on
the step only: `td.elastic.local_rows`), and horovodrun's blacklisting of failed hosts.
"""

from __future__ import annotations

from tandem.elastic import WorldChanged, run
from tandem.elastic import state as tandem_state


class State(tandem_state.State):
    """Horovod's elastic state: `td.elastic.State` without the comparison of the ranks' extras
    and model at each commit; a change of world gives every rank the source rank's model
    (buffers too), optimizer and extras."""

    compare_replicas = False


TorchState = State
ObjectState = State
HostsUpdatedInterrupt = WorldChanged

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
