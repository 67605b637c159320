"""Every torch.distributed call of tests/torch_backend_checks.py, in a job of
`init_process_group(argv[1])` ("tandem" or "mpi"): `tandem run -np 3 torch_calls.py tandem`."""

import sys
from pathlib import Path

import torch.distributed as dist

import tandem  # noqa: F401  (registers the backends)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_backend_checks import check_every_call  # noqa: E402

dist.init_process_group(sys.argv[1])
print(f"rank {dist.get_rank()}: every call checked on {check_every_call()}")
dist.destroy_process_group()
