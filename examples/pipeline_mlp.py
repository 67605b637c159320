"""Pipeline parallelism: an MLP split into one stage per rank, trained with the 1F1B schedule.

    tandem run -np 2 examples/pipeline_mlp.py

Every rank builds the same model; each keeps only its own stage's layers (the others are
freed). The first stage reads the inputs, the last stage the targets and computes the loss;
activations go forward and gradients back between ranks, eight micro-batches per step.
"""

import torch
from torch import nn

import tandem as td

td.init()
torch.manual_seed(0)

# Synthetic regression: y = sin(x @ w), 4 096 samples of 32 features.
w = torch.randn(32, 4) / 4
x_all = torch.randn(4096, 32)
y_all = torch.sin(x_all @ w)

model = nn.Sequential(
    nn.Linear(32, 256), nn.ReLU(),
    nn.Linear(256, 256), nn.ReLU(),
    nn.Linear(256, 256), nn.ReLU(),
    nn.Linear(256, 4),
)
pipe = td.Pipeline(model, chunks=8, schedule="1f1b")
optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)

if td.rank() == 0:
    print(f"{td.size()} stages, layers per stage {pipe.balance}; the schedule:")
    print(pipe.format_schedule())
print(f"rank {td.rank()} keeps {[name for name, _ in pipe.named_parameters()]}")

for epoch in range(5):
    total = 0.0
    for batch in range(0, len(x_all), 256):
        x, y = x_all[batch : batch + 256], y_all[batch : batch + 256]
        optimizer.zero_grad()
        # x matters on the first stage only, y on the last only; passing both everywhere is fine.
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        optimizer.step()
        if pipe.is_last:
            total += loss.item()
    if pipe.is_last:
        print(f"epoch {epoch}: mean loss {total / (len(x_all) // 256):.4f}")

stats = pipe.stats
print(f"rank {td.rank()}: activations of at most {stats.peak_live_microbatches} micro-batch(es) "
      f"alive ({stats.peak_activation_bytes / 1024:.0f} KiB), idle {stats.idle_fraction:.0%} of the step")
