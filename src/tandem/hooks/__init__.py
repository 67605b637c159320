"""What `import tandem` arranges with torch and Lightning, without importing either: tandem's
torch.distributed backends and Lightning strategies, registered once those packages are
imported.

What is where:

- `after_import`: Run a function right after a package is first imported, without importing it
  ourselves.
- `lightning_strategy`: `Trainer(strategy="tandem")` after `import tandem`, without `import
  tandem` importing Lightning.
- `torch_backends`: tandem's torch.distributed backends, registered once torch is there, without
  importing it.
"""
