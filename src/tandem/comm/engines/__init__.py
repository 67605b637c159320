"""The engines: what moves the bytes. The backend protocol (`backend`), Gloo and NCCL through
torch.distributed (`torch_backend`, `c10d_engine`), MPI through mpi4py (`mpi_*`).

What is where:

- `backend`: The backend protocol: what an engine (Gloo/NCCL through torch.distributed, or MPI)
  provides.
- `c10d_engine`: Gloo (or NCCL) as an engine of its own: a c10d backend object, driven without a
  process group.
- `mpi_backend`: MPI through mpi4py: the backend for jobs started by `mpiexec` (or `srun
  --mpi=pmi2`).
- `mpi_buffers`: How tensors travel through MPI: datatypes, zero-copy views, and stand-ins for
  what MPI lacks.
- `mpi_exit`: Leaving an MPI job: a rank that failed must not hang in `MPI_Finalize`.
- `mpi_progress`: Completion and progress of non-blocking MPI operations.
- `mpi_setup`: Joining MPI: importing mpi4py, meeting with a deadline, and telling `tandem run`
  we joined.
- `sockets`: The sockets an engine opened, so that they can be shut at once when its world is
  over.
- `torch_backend`: Gloo (CPU) and NCCL (GPU) through torch.distributed.
"""
