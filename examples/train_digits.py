"""Train a small CNN on scikit-learn's handwritten digits (8x8), data-parallel with tandem.

    python examples/train_digits.py                    # one process
    tandem run -np 2 examples/train_digits.py          # two ranks, same result in about the same steps
    tandem run -np 2 examples/train_digits.py --log-dir runs/digits   # + TensorBoard/CSV metrics

The five lines that make a single-process script distributed are marked `# tandem (n/5)`.
Everything else is ordinary PyTorch. `--batch-size` is the global batch: two ranks read half
of it each, so the run takes the same optimisation steps however many ranks there are.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import tandem as td
from tandem.metrics import Average, progress

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="global batch, split over the ranks")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint", default=None, help="save the final model and optimizer here")
parser.add_argument("--log-dir", default=None,
                    help="write metrics here (metrics.csv, TensorBoard events): tensorboard --logdir DIR")
args = parser.parse_args()

td.init()                                                                       # tandem (1/5)
device = td.device()
torch.manual_seed(args.seed)

# -- data: 1797 images of 8x8 pixels (values 0..16); a fixed 80/20 split ----------------------
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
n_test = len(labels) // 5
test_x, test_y = images[order[:n_test]], labels[order[:n_test]]
train = TensorDataset(images[order[n_test:]], labels[order[n_test:]])
loader, per_rank_batch = td.partition_dataset(train, batch_size=args.batch_size,  # tandem (2/5)
                                              seed=args.seed)

# -- model and optimizer ---------------------------------------------------------------------
model = nn.Sequential(
    nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),       # 64 x 4 x 4
    nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
).to(device)
td.broadcast_parameters(model)                   # every rank starts from rank 0's weights   # tandem (3/5)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # tandem (4/5)
td.broadcast_optimizer_state(optimizer)                                         # tandem (5/5)

if td.rank() == 0:
    print(f"{td.size()} rank(s), global batch {args.batch_size} = {per_rank_batch} per rank, "
          f"{len(train)} training images, {len(loader)} steps per epoch")

# -- training ----------------------------------------------------------------------------------
logger = td.metrics.MetricLogger(args.log_dir) if args.log_dir else None  # rank 0 writes, averaged over ranks
for epoch in range(1, args.epochs + 1):
    model.train()
    metrics = Average()                               # sample-weighted means over all ranks
    for x, y in progress(loader, desc=f"epoch {epoch}", leave=False):   # a bar on rank 0 only
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()                               # gradients are averaged during backward
        optimizer.step()
        metrics.update(len(y), loss=loss.item(), accuracy=(logits.argmax(1) == y).float().mean().item())
    summary = metrics.compute()                       # collective: every rank calls it
    if logger:  # one more reduction: the epoch's samples/s and compute/communication split
        summary = logger.log(epoch, **summary, timing=True)
    if td.rank() == 0:
        line = f"epoch {epoch:2d}: train loss {summary['loss']:.4f}  accuracy {summary['accuracy']:.4f}"
        if logger:
            line += (f"  {summary['samples_per_s']:.0f} samples/s, step {summary['time/compute_s'] * 1e3:.1f}"
                     f" ms compute + {summary['time/comm_s'] * 1e3:.1f} ms comm")
        print(line)

# -- evaluation: each rank scores its own slice of the test set; the counts are combined ------
model.eval()
evaluation = Average()
with torch.no_grad():
    x, y = test_x[td.rank() :: td.size()].to(device), test_y[td.rank() :: td.size()].to(device)
    logits = model(x)
    evaluation.update(len(y), loss=F.cross_entropy(logits, y).item(),
                      accuracy=(logits.argmax(1) == y).float().mean().item())
result = evaluation.compute()
if td.rank() == 0:
    print(f"final test loss {result['loss']:.4f}")
    print(f"final test accuracy: {result['accuracy']:.4f}")

if logger:
    logger.log(args.epochs, **{f"test/{name}": value for name, value in result.items()})
    logger.close()

if args.checkpoint:
    # Every rank calls save; rank 0 writes atomically. Reload with td.load(path).
    td.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": args.epochs,
             "test_accuracy": result["accuracy"]}, args.checkpoint)
    if td.rank() == 0:
        print(f"saved checkpoint to {args.checkpoint}")
