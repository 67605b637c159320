"""A LightningModule CNN on scikit-learn's digits, on tandem: `Trainer(strategy="tandem")`.

    python examples/lightning_digits.py                   # one process
    tandem run -np 2 examples/lightning_digits.py         # two ranks (MPI here; --backend gloo too)
    srun -n 8 python examples/lightning_digits.py --num-nodes 2   # SLURM: examples/slurm/lightning.sbatch
    tensorboard --logdir runs/lightning                   # the curves rank 0 wrote

The tandem lines are marked `# tandem`: importing tandem registers the strategy, and the
Trainer asks for it by name. Everything else is ordinary Lightning. `--batch-size` is the global
batch: each rank reads batch / world of it, so the run takes the same steps on any world.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tandem  # noqa: F401 - registers Trainer(strategy="tandem")                  # tandem

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32, help="global batch, split over the ranks")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--devices", default="auto", help="ranks per node; 'auto': as started")
parser.add_argument("--num-nodes", type=int, default=1)
parser.add_argument("--precision", default="bf16-mixed")
parser.add_argument("--log-dir", default="runs/lightning")
args = parser.parse_args()

# -- data: 1797 images of 8x8 pixels (values 0..16); a fixed 80/20 split ----------------------
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
n_test = len(labels) // 5
test = TensorDataset(images[order[:n_test]], labels[order[:n_test]])
train = TensorDataset(images[order[n_test:]], labels[order[n_test:]])


class DigitsCNN(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),       # 64 x 4 x 4
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
        )

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)     # averaged over the ranks
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True,
                 prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):  # Lightning adds each rank's DistributedSampler
        return DataLoader(train, batch_size=args.batch_size // self.trainer.world_size)

    def val_dataloader(self):
        return DataLoader(test, batch_size=128)


L.seed_everything(0)
trainer = L.Trainer(
    strategy="tandem",                                                                 # tandem
    accelerator="auto",
    devices=int(args.devices) if args.devices.isdigit() else args.devices,
    num_nodes=args.num_nodes,
    precision=args.precision,
    max_epochs=args.epochs,
    logger=TensorBoardLogger(args.log_dir, name="digits"),                 # rank 0 writes
    log_every_n_steps=10,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(DigitsCNN(args.lr))
if trainer.is_global_zero:
    metrics = trainer.callback_metrics
    print(f"{trainer.world_size} rank(s), {args.epochs} epochs: val loss "
          f"{metrics['val/loss']:.4f}, val accuracy {metrics['val/accuracy']:.4f}")
