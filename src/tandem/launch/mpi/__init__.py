"""Ranks started by `mpiexec`: the MPI front end of `tandem run` and each rank's supervisor.

What is where:

- `fault_tolerance`: Whether the MPI here can shrink a world (ULFM), and the refusal of an
  elastic job on MPI where it cannot, naming it.
- `launch_port`: The MPI agent's launch port: where each rank's supervisor connects its three
  sockets.
- `mpiexec`: The MPI front end of `tandem run` (the CPU default, or `--backend mpi`): ranks
  started by `mpiexec`.
- `rank`: One rank's supervisor under `tandem run --backend mpi` (internal; mpiexec runs it).
- `shrinking`: An elastic job on MPI: `tandem run --backend mpi -np N --min-np A`, whose world
  shrinks.
- `shm`: MPI's shared-memory segments in /dev/shm: removed when a job ends, reported when stale.
"""
