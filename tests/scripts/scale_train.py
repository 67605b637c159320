"""A small data-parallel training loop on synthetic data, for `tandem scale` and timeline tests.

    python tests/scripts/scale_train.py --hidden 64 --batch 256 --epochs 5
    --layers 64 --bucket-mb 0.001 --batch 2: one message per gradient, a tiny batch:
                                             communication dominates
    --hidden 256 --batch 8192:               a small model and a big batch: compute dominates
"""

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem as td

parser = argparse.ArgumentParser()
parser.add_argument("--features", type=int, default=32)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--batch", type=int, default=256, help="global batch")
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--bucket-mb", type=float, default=25)
parser.add_argument("--report", action="store_true", help="say the per-rank batch with td.report")
args = parser.parse_args()

td.init()
torch.manual_seed(0)
layers, width = [], args.features
for _ in range(args.layers):
    layers += [nn.Linear(width, args.hidden), nn.ReLU()]
    width = args.hidden
model = nn.Sequential(*layers, nn.Linear(width, 10))
generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(args.samples, args.features, generator=generator),
                     torch.randint(0, 10, (args.samples,), generator=generator))
loader, per_rank = td.partition_dataset(data, batch_size=args.batch, drop_last=True)
opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters(), bucket_mb=args.bucket_mb,
                              first_bucket_mb=min(1.0, args.bucket_mb))
if args.report:
    td.metrics.report(samples=per_rank)
loss_fn = nn.CrossEntropyLoss()
steps = 0
for _ in range(args.epochs):
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        steps += 1
if td.rank() == 0:
    reducer = getattr(opt, "_reducer", None)  # private: the timeline test needs the bucket count
    buckets = len(reducer.buckets) if reducer is not None else 0
    print(f"done: {steps} steps, per-rank batch {per_rank}, {buckets} buckets")
