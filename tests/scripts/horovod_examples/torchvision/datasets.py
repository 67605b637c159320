"""`MNIST(root, train=True, download=False, transform=None)`: 192 training and 96 test
images, 1x28x28, drawn from a fixed seed, labels 0-9 (no file is read or downloaded). The
training set counts the images read (`dying.py`)."""

import torch
from torch.utils.data import Dataset

from torchvision.dying import Countdown


class MNIST(Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        generator = torch.Generator().manual_seed(0 if train else 1)
        n = 192 if train else 96
        self.images = torch.rand(n, 1, 28, 28, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)
        self.transform = transform
        self.countdown = Countdown() if train else None

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if self.countdown is not None:
            self.countdown()
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])
