"""Reference models for benchmarks and examples: the same shapes everywhere we compare numbers.

- `resnet9(num_classes=10)`: the DAWNBench CIFAR-10 ResNet-9 (David Page's "How to train your
  ResNet"): conv-BN-ReLU blocks 64-128-256-512 with two residual blocks, max pooling, a
  bias-free classifier scaled by 0.125. 6.57 M parameters, inputs (N, 3, 32, 32).
- `mlp(784, 2048, 2048, 10)`: Linear-ReLU layers of the given widths (5.8 M parameters for
  those sizes): communication-heavy, little compute.
- `gpt(vocab, dim, heads, layers, seq)`: a GPT-2-style decoder (token and position embeddings,
  pre-norm causal self-attention and 4x MLP blocks, a final LayerNorm and an untied head).
  Inputs are token ids (N, seq); it returns logits flattened to (N * seq, vocab), so
  `cross_entropy(model(x), y.flatten())` is its loss. The defaults (vocab 32768, dim 1024, 16
  heads, 4 layers, seq 512) hold 118 M parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn(channels, channels), _conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def resnet9(num_classes: int = 10) -> nn.Sequential:
    """The DAWNBench ResNet-9 for 32x32 RGB images."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return nn.Sequential(
        _conv_bn(3, 64),
        _conv_bn(64, 128), nn.MaxPool2d(2), _Residual(128),
        _conv_bn(128, 256), nn.MaxPool2d(2),
        _conv_bn(256, 512), nn.MaxPool2d(2), _Residual(512),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(512, num_classes, bias=False),
        _Scale(0.125),
    )


def mlp(*sizes: int) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them: `mlp(784, 2048, 2048, 10)`."""
    if len(sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"mlp needs two or more positive integer widths, got {sizes}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(n, t, d))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(_Block(dim, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.tokens(ids) + self.positions(positions))
        return self.head(self.norm(x)).flatten(0, 1)


def gpt(vocab: int = 32768, dim: int = 1024, heads: int = 16, layers: int = 4, seq: int = 512) -> nn.Module:
    """A GPT-2-style decoder whose logits come out as (batch * seq, vocab)."""
    if min(vocab, dim, heads, layers, seq) < 1 or dim % heads:
        raise ValueError(f"gpt needs positive sizes and dim divisible by heads, got vocab={vocab} "
                         f"dim={dim} heads={heads} layers={layers} seq={seq}")
    return _GPT(vocab, dim, heads, layers, seq)
