"""Elastic training: a job that loses ranks or gains some and keeps its one-process result.

    tandem run -np 3 --min-np 2 --max-np 4 --host-discovery-script ./slots.sh train.py

    td.init()
    model = Net()
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = td.elastic.State(model=model, optimizer=opt, step=0)

    @td.elastic.run
    def train(state):
        while state.step < steps:
            x, y = batch(state.step)                      # the global batch: seed and step only
            rows = td.elastic.local_rows(len(x))          # this rank's equal share of it
            opt.zero_grad(); loss_fn(model(x[rows]), y[rows]).backward(); opt.step()
            state.step += 1
            state.commit()                                # in memory; a change of world is seen here

    train(state)

`State` holds the model, the optimizer and any extras; `commit()` snapshots them in memory;
`run` restores the newest snapshot a surviving rank holds after a rank fails, and sends it to
the ranks that join (see `state` and `run`; the launcher's side is `tandem.launch.agents.elastic`).
"""

from tandem.elastic.data import local_rows
from tandem.elastic.run import run
from tandem.elastic.state import State, StateMismatchError, WorldChanged

__all__ = ["State", "StateMismatchError", "WorldChanged", "local_rows", "run"]
