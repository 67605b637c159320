"""An Accelerate script and a Hugging Face Trainer script, to run under torchrun and tandem run.

    torchrun --nproc-per-node 2 hf_train.py OUT
    tandem run -np 2 --backend gloo hf_train.py OUT          # nothing changed
    tandem run -np 2 hf_train.py OUT --td-init               # MPI: td.init() first

First an `Accelerator(cpu=True)` loop, then `transformers.Trainer` on a tiny GPT-2 built from a
config (no download), in the same processes (Python start-up is most of the cost here).

Both read torchrun's variables, which `tandem run` sets too, and make their own Gloo group;
with --td-init the script calls td.init() first, Accelerate finds torch.distributed initialised
and trains on tandem's group (the MPI engine under `tandem run`). Rank 0 saves the parameters.
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

STEPS = 4


def accelerate_run(out: str) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # per process, Accelerate's rule
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (xb, yb) in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
    losses = accelerator.gather(torch.tensor([float(accelerator.process_index)]))
    assert losses.tolist() == [float(i) for i in range(accelerator.num_processes)], losses
    print(f"accelerate: process {accelerator.process_index} of {accelerator.num_processes}, "
          f"{accelerator.distributed_type} over {torch.distributed.get_backend()}", flush=True)
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


class Tokens(Dataset):
    def __init__(self, n: int = 32, length: int = 8) -> None:
        self.ids = torch.randint(0, 50, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_run(out: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=os.path.dirname(out), use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=4, learning_rate=1e-2, seed=0,
                             report_to=[], save_strategy="no", logging_steps=1,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    print(f"trainer: process {args.process_index} of {args.world_size}, {args.parallel_mode} "
          f"over {torch.distributed.get_backend()}", flush=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--td-init", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.td_init:
        import tandem as td

        td.init()  # before Accelerate/Trainer: they find torch.distributed initialised
        print(f"tandem: rank {td.rank()} of {td.size()} on {td.init().backend}", flush=True)
    params = {"accelerate": accelerate_run(args.out), "trainer": trainer_run(args.out)}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(params, args.out)


if __name__ == "__main__":
    main()
