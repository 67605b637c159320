"""Compose, ToTensor (a tensor passes through) and Normalize, over 1xHxW tensors."""


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, x):
        return x


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x):
        return (x - self.mean) / self.std
