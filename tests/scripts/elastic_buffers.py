"""Each rank trains a BatchNorm model on its own batch under td.elastic.State: the parameters
stay alike (the gradients are averaged), the running statistics do not, and the first commit
names the buffers."""

import torch

import tandem as td

td.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
optimizer = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
state = td.elastic.State(model=model, optimizer=optimizer, step=0)


@td.elastic.run
def train(state):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(td.rank()))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    state.step += 1
    state.commit()


train(state)
