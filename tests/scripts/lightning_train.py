"""Train a small model with Lightning's Trainer, then with Fabric; save both models' parameters.

    python lightning_train.py reference OUT [--precision P]   # one process, Lightning alone, full batch
    tandem run -np 2 lightning_train.py tandem OUT [...]      # strategy="tandem", batch split over ranks
    run("tandem", OUT)                                        # the same, on a world already running

The global batch is BATCH whatever the world: each rank gets BATCH // world samples of it, in
DistributedSampler's order (rank r: samples r, r + world, ... of its permutation; Lightning
shuffles training data whenever it adds the sampler), so every step sees the same samples as
the one-process run, which reads that permutation whole. The Trainer run uses gradient
clipping, gradient accumulation, `self.log(..., sync_dist=True)`, a validation loop,
TensorBoard and checkpoints (ModelCheckpoint saves and removes one at each of 4 validations,
then one through trainer.save_checkpoint); the Fabric run `no_backward_sync`,
`clip_gradients`, `all_reduce` and `fabric.save`/`fabric.load`.
Then the Trainer again with precision="bf16-mixed", and (tandem only) the first run on
strategy="tandem_fsdp", and the Fabric run on it.
`lightning` is imported before tandem here: tandem registers its strategy at once.
"""

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tandem as td
from tandem.job.environments import detect

BATCH = 16
STEPS = 4  # optimizer steps; with accumulate_grad_batches=2, 8 batches = 128 samples


def data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def train_trainer(strategy: str, world: int, precision: str, out_dir: str,
                  checkpoint: bool = True) -> dict:
    if strategy != "auto":  # Lightning gives each rank a DistributedSampler(shuffle=True, seed=0)
        loader = DataLoader(data(), batch_size=BATCH // world)
    else:  # ... whose first epoch, dealt out to the ranks, is this order
        order = torch.randperm(len(data()), generator=torch.Generator().manual_seed(0)).tolist()
        loader = DataLoader(data(), batch_size=BATCH, sampler=order)
    val = DataLoader(data(32), batch_size=8)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS, precision=precision,
                        gradient_clip_val=0.5, accumulate_grad_batches=2, limit_val_batches=2,
                        val_check_interval=2, logger=TensorBoardLogger(out_dir, name="tb"),
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out_dir)
    module = Module()
    trainer.fit(module, loader, val)
    if strategy == "tandem_fsdp":  # each rank held (about) half of the 178 parameters
        print(f"rank {td.rank()}: fsdp holds {sum(p.numel() for p in module.parameters())} of "
              f"{sum(p.numel() for p in net().parameters())} parameters", flush=True)
        resume_fsdp(trainer, module, loader, val, out_dir)
    if strategy != "auto" and checkpoint:
        path = os.path.join(out_dir, f"{strategy}-last.ckpt")
        trainer.save_checkpoint(path)
        loaded = trainer.strategy.load_checkpoint(path)
        assert loaded["global_step"] == STEPS, loaded["global_step"]
        print(f"rank {td.rank()}: checkpoint step {loaded['global_step']}, "
              f"val_loss {float(trainer.callback_metrics['val_loss']):.6f}", flush=True)
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def resume_fsdp(trainer, module, loader, val, out_dir: str) -> None:
    """Save the sharded run, restore it into a fresh Trainer and model: the same weights and
    optimizer state (the restored fit stops at once: max_steps is reached)."""
    path = os.path.join(out_dir, "fsdp.ckpt")
    trainer.save_checkpoint(path)
    opt = trainer.optimizers[0]
    again = Module()
    resumed = L.Trainer(strategy="tandem_fsdp", accelerator="cpu", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    resumed.fit(again, loader, val, ckpt_path=path)
    assert resumed.global_step == STEPS, resumed.global_step
    for a, b in zip(again.parameters(), module.parameters(), strict=True):  # this rank's shards
        assert torch.equal(a, b)
    for a, b in zip(resumed.optimizers[0].param_groups[0]["params"], opt.param_groups[0]["params"],
                    strict=True):
        assert torch.equal(resumed.optimizers[0].state[a]["momentum_buffer"],
                           opt.state[b]["momentum_buffer"])
    print(f"rank {td.rank()}: fsdp resumed from its shards", flush=True)


def train_fabric(strategy: str, world: int, precision: str, out_dir: str) -> dict:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", precision=precision)
    fabric.launch()
    if strategy == "tandem_fsdp":  # the optimizer must be made over the shards
        model = fabric.setup_module(net())
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5,
                                                            momentum=0.9))
    else:
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=BATCH // world, shuffle=False))
    batches = iter(loader)
    for _ in range(STEPS):
        for micro in range(2):  # two micro-batches per step, the first without a reduction
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(nn.functional.cross_entropy(model(x), y) / 2)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    loss = fabric.all_reduce(torch.tensor(float(td.rank() if strategy != "auto" else 0)))
    assert float(loss) == (world - 1) / 2, float(loss)
    if strategy != "auto":  # fabric.save through tandem (rank 0 writes, or each rank its shards)
        path = os.path.join(out_dir, strategy, "state.ckpt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "steps": STEPS})
        if strategy == "tandem_fsdp":  # load into the same layout: this rank's shards again
            copy = fabric.setup_module(net())
            copy_opt = fabric.setup_optimizers(torch.optim.SGD(copy.parameters(), lr=0.5,
                                                               momentum=0.9))
            left = fabric.load(path, {"model": copy, "optimizer": copy_opt, "steps": 0})
            assert left == {}, left
        else:
            copy = net()
            left = fabric.load(path, {"model": copy})
            assert left["steps"] == STEPS and "optimizer" in left, sorted(left)
        assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.parameters(),
                                                      strict=True))
        print(f"rank {td.rank()}: {strategy} fabric checkpoint loaded", flush=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(mode: str, out: str, precision: str = "32-true") -> None:
    """Every run of `mode`; rank 0 (or the one process) saves their parameters to `out`."""
    strategy = "auto" if mode == "reference" else "tandem"
    # the launcher's world (tandem run, mpiexec...), read as td.init() will; the strategy joins
    world = detect().size if mode == "tandem" else 1
    out_dir = os.path.dirname(os.path.abspath(out))
    result = {"trainer": train_trainer(strategy, world, precision, out_dir)}
    result["fabric"] = train_fabric(strategy, world, precision, out_dir)
    # bf16 autocast, same data: equal within bf16's rounding, not to float32's
    result["trainer_bf16"] = train_trainer(strategy, world, "bf16-mixed", out_dir, checkpoint=False)
    if mode == "tandem":  # fully sharded: the same numbers as the first runs'
        result["trainer_fsdp"] = train_trainer("tandem_fsdp", world, precision, out_dir)
        result["fabric_fsdp"] = train_fabric("tandem_fsdp", world, precision, out_dir)
    if mode == "tandem":
        assert td.size() == world, (td.size(), world)
        print(f"rank {td.rank()} of {td.size()} on {td.init().backend} done", flush=True)
    if mode == "reference" or td.rank() == 0:
        torch.save(result, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "tandem"])
    parser.add_argument("out")
    parser.add_argument("--precision", default="32-true")  # of the first two runs
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(args.mode, args.out, args.precision)
    sys.exit(0)


if __name__ == "__main__":
    main()
