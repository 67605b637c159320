# ruff: noqa: I001  (tandem is imported before lightning on purpose: see below)
"""Lightning runs on strategy="tandem" that must fail fast, each with a clear message.

    tandem run -np 2 lightning_fail.py validation   # rank 1 raises in validation_step
    tandem run -np 2 lightning_fail.py devices      # Trainer(devices=3) under -np 2
    python lightning_fail.py configure_model        # configure_model() replaces the world

tandem is imported before lightning here: the strategy is registered when lightning loads.
"""

import sys

import tandem as td  # first on purpose: the strategy is registered on `import lightning`

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Module(L.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = nn.Linear(4, 2)

    def configure_model(self) -> None:
        if self.mode == "configure_model":
            td.shutdown()  # a world of its own: not what the strategy joined
            td.init(backend="gloo")

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        if self.mode == "validation" and td.rank() == 1:
            raise RuntimeError("rank 1 broke in validation_step")
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    mode = sys.argv[1]
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    devices = 3 if mode == "devices" else "auto"
    trainer = L.Trainer(strategy="tandem", accelerator="cpu", devices=devices, max_epochs=2,
                        limit_val_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(mode), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
