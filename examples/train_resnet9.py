"""Train the DAWNBench ResNet-9 on CIFAR-10, data-parallel with tandem.

    python examples/train_resnet9.py --data ~/data --epochs 10          # one process
    tandem run -np 4 examples/train_resnet9.py --data ~/data --epochs 10
    tandem run -np 2 examples/train_resnet9.py --steps 20              # synthetic data, smoke test

`--data DIR` is a folder holding `cifar-10-batches-py` (the "python version" archive from
https://www.cs.toronto.edu/~kriz/cifar.html, unpacked). Without it the script trains on random
CIFAR-shaped images and says so: useful for timing, meaningless for accuracy.
`--batch-size` is the global batch; the learning rate follows a one-cycle schedule over the run.
"""

import argparse
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tandem as td
from tandem.bench.models import resnet9
from tandem.metrics.average import Average, progress

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", default=None, help="folder containing cifar-10-batches-py")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--steps", type=int, default=None, help="stop after this many steps in all")
parser.add_argument("--batch-size", type=int, default=512, help="global batch, split over the ranks")
parser.add_argument("--lr", type=float, default=0.4, help="peak learning rate")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint", default=None, help="save the final model and optimizer here")
args = parser.parse_args()

td.init()
device = td.device()
torch.manual_seed(args.seed)
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def read_batches(folder: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's pickled batches -> normalised float images (N, 3, 32, 32) and labels."""
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as file:
            batch = pickle.load(file, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(images)).float().div_(255)
    return (x - MEAN) / STD, torch.from_numpy(np.concatenate(labels))


if args.data:
    folder = Path(args.data).expanduser()
    folder = folder / "cifar-10-batches-py" if (folder / "cifar-10-batches-py").is_dir() else folder
    if not (folder / "data_batch_1").is_file():
        raise SystemExit(f"--data {args.data}: no cifar-10-batches-py/data_batch_1 there; "
                         f"unpack cifar-10-python.tar.gz into it")
    train_x, train_y = read_batches(folder, [f"data_batch_{i}" for i in range(1, 6)])
    test_x, test_y = read_batches(folder, ["test_batch"])
else:
    if td.rank() == 0:
        print("no --data given: training on synthetic CIFAR-shaped data (random images); "
              "accuracy is meaningless")
    generator = torch.Generator().manual_seed(0)  # the same "dataset" on every rank
    train_x, train_y = torch.randn(2048, 3, 32, 32, generator=generator), torch.randint(
        0, 10, (2048,), generator=generator)
    test_x, test_y = torch.randn(256, 3, 32, 32, generator=generator), torch.randint(
        0, 10, (256,), generator=generator)

loader, per_rank_batch = td.partition_dataset(TensorDataset(train_x, train_y),
                                              batch_size=args.batch_size, seed=args.seed,
                                              drop_last=True)

model = resnet9().to(device)
td.broadcast_parameters(model)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                            weight_decay=5e-4)
optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
td.broadcast_optimizer_state(optimizer)

total_steps = args.epochs * len(loader)
if args.steps is not None:
    total_steps = min(total_steps, args.steps)


def learning_rate(step: int) -> float:
    """One cycle: linear warm-up over the first 20% of the steps, then linear decay to 0."""
    warmup = max(1, total_steps // 5)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def augment(x: torch.Tensor) -> torch.Tensor:
    """Random horizontal flips per image, and one random 4-pixel translation per batch."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    dx, dy = torch.randint(-4, 5, (2,)).tolist()
    return torch.roll(F.pad(x, (4, 4, 4, 4)), shifts=(dy, dx), dims=(2, 3))[:, :, 4:-4, 4:-4]


if td.rank() == 0:
    print(f"{td.size()} rank(s), global batch {args.batch_size} = {per_rank_batch} per rank, "
          f"{len(loader)} steps per epoch, {total_steps} steps in all")

step = 0
for epoch in range(1, args.epochs + 1):
    if step >= total_steps:
        break
    model.train()
    metrics = Average()
    started = time.perf_counter()
    for x, y in progress(loader, desc=f"epoch {epoch}", leave=False):
        if step >= total_steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        x, y = augment(x.to(device)), y.to(device)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=0.2)
        loss.backward()
        optimizer.step()
        metrics.update(len(y), loss=loss.item(), accuracy=(logits.argmax(1) == y).float().mean().item())
        step += 1
    elapsed = time.perf_counter() - started
    summary = metrics.compute()
    if td.rank() == 0:
        images = metrics.count * td.size()
        print(f"epoch {epoch:2d}: train loss {summary['loss']:.4f}  accuracy {summary['accuracy']:.4f}  "
              f"{images / elapsed:.0f} images/s")

# Evaluation: each rank scores its own slice of the test set; the counts are combined.
model.eval()
evaluation = Average()
with torch.no_grad():
    mine = range(td.rank(), len(test_y), td.size())
    for start in range(0, len(mine), 256):
        index = torch.tensor(mine[start : start + 256])
        x, y = test_x[index].to(device), test_y[index].to(device)
        logits = model(x)
        evaluation.update(len(y), loss=F.cross_entropy(logits, y).item(),
                          accuracy=(logits.argmax(1) == y).float().mean().item())
result = evaluation.compute()
if td.rank() == 0:
    print(f"final test accuracy: {result['accuracy']:.4f} after {step} steps")

if args.checkpoint:
    td.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": step,
             "test_accuracy": result["accuracy"]}, args.checkpoint)
    if td.rank() == 0:
        print(f"saved checkpoint to {args.checkpoint}")
