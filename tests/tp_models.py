"""Models shared by the tensor-parallel tests, benchmark and example: built as for one process."""

import torch
from torch import nn

import tandem as td

PLAN = {"embed": "vocab", "block.attn": "heads", "block.mlp.0": "colwise", "block.mlp.2": "rowwise",
        "head": "colwise"}


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, -1).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Embedding, one block, a vocabulary head: every tensor-parallel layer kind in one model."""

    def __init__(self, vocab: int = 12, dim: int = 12, num_heads: int = 6, hidden: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim, num_heads, hidden)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def lm_loss(model, ids, target, group=None, parallel=True):
    logits = model(ids)
    if parallel:
        return td.vocab_parallel_cross_entropy(logits, target, group=group)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(seed: int, size: int = 4, length: int = 5, vocab: int = 12):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (size, length), generator=generator)
    return ids, torch.randint(vocab, (size, length), generator=generator)
