"""A small language model with its layers split across ranks (tensor parallelism).

    tandem run -np 2 examples/tensor_parallel.py              # tp = 2
    tandem run -np 4 examples/tensor_parallel.py --dp 2       # dp = 2 replicas of tp = 2

The model is written for one process (embedding, one transformer block with
`nn.MultiheadAttention`, a vocabulary head). `td.parallelize` splits it by layer name: the
embedding and the head by vocabulary, attention by heads, the MLP column- then row-wise. The
loss is computed on the split logits (`td.tensor.vocab_parallel_cross_entropy`), never gathered. The
task: predict the next token of sequences that count up modulo the vocabulary.
"""

import argparse

import torch
from torch import nn

import tandem as td


class Block(nn.Module):
    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(embed), nn.LayerNorm(embed)
        self.attn = nn.MultiheadAttention(embed, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(embed, 4 * embed), nn.GELU(), nn.Linear(4 * embed, embed))

    def forward(self, x):
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, embed: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.position = nn.Parameter(torch.zeros(seq, embed))
        self.block = Block(embed, heads)
        self.head = nn.Linear(embed, vocab)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids) + self.position[: ids.shape[1]]))


PLAN = {"embed": "embedding", "block.attn": "attention", "block.mlp.0": "colwise",
        "block.mlp.2": "rowwise", "head": "colwise"}


def batch(step: int, size: int, seq: int, vocab: int, first: int = 0):
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, vocab, (size, 1), generator=generator)[first:]
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (tp = ranks / dp)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    args = parser.parse_args()

    td.init()
    mesh = td.mesh(dp=args.dp, tp=td.size() // args.dp)
    torch.manual_seed(0)  # every rank builds the same one-process model, then keeps its shards
    model = td.parallelize(TinyLM(args.vocab, args.embed, args.heads, args.seq), PLAN,
                           group=mesh.tp_group)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    if args.dp > 1:  # gradients averaged over the replicas only, not over the tp group
        optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            group=mesh.dp_group)
    per_replica = args.batch // args.dp
    for step in range(args.steps):
        ids, target = batch(step, args.batch, args.seq, args.vocab)
        ids = ids[mesh.dp_rank * per_replica:(mesh.dp_rank + 1) * per_replica]
        target = target[mesh.dp_rank * per_replica:(mesh.dp_rank + 1) * per_replica]
        loss = td.tensor.vocab_parallel_cross_entropy(model(ids), target, group=mesh.tp_group)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if td.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}")
    if td.rank() == 0:
        local = sum(p.numel() for p in model.parameters())
        print(f"tp={mesh.tp} dp={mesh.dp}: this rank holds {local} parameters")
    td.shutdown()


if __name__ == "__main__":
    main()
