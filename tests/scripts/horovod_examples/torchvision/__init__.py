"""A stand-in for torchvision (not installed here) that Horovod's elastic examples import:
`models.<name>()` is a small convolutional net with BatchNorm, `datasets.MNIST` a synthetic
MNIST of the same shapes (no download), `transforms` the three the examples compose.

It is also the test's way to kill a rank without editing the examples: with
`HVD_EXAMPLE_DIE=W:N` set, worker W (TANDEM_ELASTIC_WORKER) exits with code 9 at its model's
N-th forward or its N-th training image read (`dying.py`)."""

from torchvision import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
