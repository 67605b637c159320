"""Reference models for benchmarks and examples: the same shapes everywhere we compare numbers.

- `resnet9(num_classes=10)`: the DAWNBench CIFAR-10 ResNet-9 (David Page's "How to train your
  ResNet"): conv-BN-ReLU blocks 64-128-256-512 with two residual blocks, max pooling, a
  bias-free classifier scaled by 0.125. 6.57 M parameters, inputs (N, 3, 32, 32).
- `mlp(784, 2048, 2048, 10)`: Linear-ReLU layers of the given widths (5.8 M parameters for
  those sizes): communication-heavy, little compute.
"""

from __future__ import annotations

import torch
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
