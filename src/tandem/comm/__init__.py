"""The wire: everything between ranks, one sub-folder per family. Nothing here imports
`tandem.runtime`, `diagnostics` or `parallel` (td.init hands comm its state: `context`).

What is where:

- `agreement/`: Where a collective is checked: ranks agree once, cheaply, on what they are about
  to do, and a mismatch names every rank's version.
- `collectives/`: The collectives: the user-facing ones (`td.allreduce`, `td.broadcast`, ... in
  `user`), checked, and the hot paths' unchecked twins (`direct`).
- `context`: What the engine was given at `td.init`: the backend, the timeout, the checks, this
  process's place.
- `engines/`: The engines: what moves the bytes. The backend protocol (`backend`), Gloo and NCCL
  through torch.distributed (`torch_backend`, `c10d_engine`), MPI...
- `groups`: Sub-groups of ranks, and the named 3-D layout (`mesh`) hybrid jobs use.
- `members`: Who is in a group (None: the world): its size, this process's index in it, its
  ranks.
- `torch_pg/`: The torch.distributed backends "tandem" and "mpi": tandem's engines as a
  `ProcessGroup`, for DDP, FSDP2, DTensor and pipelining.
- `watchdog/`: The watchdog: every operation passes through it, no wait lasts for ever, and a
  desync or a lost peer is named, not hung.
"""
