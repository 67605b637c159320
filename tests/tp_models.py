"""The model the tensor-parallel tests train: every tensor-parallel layer kind, built as for one process."""

import torch
from torch import nn

import tandem as td
from tandem.bench.models import Block

PLAN = {"embed": "vocab", "block.attn": "heads", "block.mlp.0": "colwise", "block.mlp.2": "rowwise",
        "head": "colwise"}


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
