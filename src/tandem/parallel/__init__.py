"""Data parallelism: gradient reduction, parameter broadcast, ZeRO and LocalSGD."""
