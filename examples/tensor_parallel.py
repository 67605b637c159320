"""Tensor parallelism: a small transformer language model with its layers split over 2 ranks.

    tandem run -np 2 examples/tensor_parallel.py [--dp 1] [--steps 60] [--checkpoint lm.pt]

The model is written as for one process. `td.parallelize` then splits, by layer name, the
embedding's vocabulary, the attention heads, the MLP (column- then row-parallel: one all-reduce
forward, one backward) and the output head over the tp group; the loss is computed from the
vocabulary slices without gathering the logits. With `--dp 2` on 4 ranks, `td.mesh(dp=2, tp=2)`
adds data parallelism: each replica trains on half the batch and gradients average over dp only.
The task: predict the token after each one in sequences that count up modulo the vocabulary.
"""

import argparse

import torch
from torch import nn

import tandem as td


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.causal = num_heads, True
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, -1).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                                       is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class LM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 64, num_heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln1(x))
        return self.head(x + self.mlp(self.ln2(x)))


PLAN = {"embed": "vocab", "attn": "heads", "mlp.0": "colwise", "mlp.2": "rowwise", "head": "colwise"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    td.init()
    mesh = td.mesh(dp=args.dp, tp=td.size() // args.dp)
    torch.manual_seed(0)  # the same full model on every rank; parallelize keeps each rank's slice
    model = td.parallelize(LM(), PLAN, group=mesh.tp_group)
    full = sum(p.numel() for p in LM().parameters())
    mine = sum(p.numel() for p in model.parameters())
    print(f"rank {td.rank()}: dp {mesh.dp_rank}, tp {mesh.tp_rank}: {mine} of {full} parameters")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    if mesh.dp > 1:
        optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            group=mesh.dp_group)
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        start = torch.randint(32, (16, 1), generator=generator)
        tokens = (start + torch.arange(17)) % 32
        rows = slice(mesh.dp_rank * 16 // mesh.dp, (mesh.dp_rank + 1) * 16 // mesh.dp)
        optimizer.zero_grad()
        logits = model(tokens[rows, :-1])
        loss = td.vocab_parallel_cross_entropy(logits, tokens[rows, 1:], group=mesh.tp_group)
        loss.backward()
        optimizer.step()
        if td.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")
    state = td.full_state_dict(model)  # the one-process state dict: loads at any tp
    if args.checkpoint:
        td.save(state, args.checkpoint)


if __name__ == "__main__":
    main()
