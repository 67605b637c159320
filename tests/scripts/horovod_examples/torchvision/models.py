"""Any `models.<name>()`: a small conv net with BatchNorm (its running statistics follow each
rank's own batches, as ResNet's do), 1000 classes, 3-channel images of any size."""

import torch
from torch import nn

from torchvision.dying import Countdown

_maybe_die = Countdown()


class SmallNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 1000) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 8, 3, stride=4, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _maybe_die()
        return self.fc(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    return SmallNet
