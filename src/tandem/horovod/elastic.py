"""`hvd.elastic`: Horovod's elastic API over `td.elastic` (`tandem run --min-np/--max-np`).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0))

`TorchState`, `ObjectState` and `State` are `td.elastic.State` (the model and the optimizer
are optional; every other keyword is an attribute), `run` is `td.elastic.run`, and
`HostsUpdatedInterrupt` is `td.elastic.WorldChanged`. What Horovod has and this does not:
`ElasticSampler` (it re-splits an epoch's remaining samples by the new world size, so the data
order depends on it; tandem's elastic result is exact when each step's global batch depends on
the step only: `td.elastic.local_rows`), and horovodrun's blacklisting of failed hosts.
"""

from __future__ import annotations

from tandem.elastic import State, WorldChanged, run

TorchState = State
ObjectState = State
HostsUpdatedInterrupt = WorldChanged

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
