"""Can this MPI shrink a world? 3 ranks; rank 2 leaves (os._exit) after a barrier; the others
meet the loss in an allreduce, then Revoke, Shrink, Agree and allreduce on the shrunk
communicator (mpi4py >= 4: ULFM's MPIX_Comm_revoke/shrink/agree). Each survivor prints what
happened; a survivor that prints nothing after "up" never heard of the loss (the run then ends
only by its timeout).

    # Open MPI 5 (`ompi_info | grep "FT MPI"` says yes); over TCP the loss is seen at once,
    # over shared memory alone only with the detector (~10 s):
    timeout 60 mpiexec --with-ft ulfm --oversubscribe -n 3 \
        --mca btl self,tcp --mca btl_tcp_if_include lo python -u scripts/ulfm-probe.py
    timeout 60 mpiexec --with-ft ulfm --oversubscribe -n 3 \
        --mca btl ^tcp --mca mpi_ft_detector true python -u scripts/ulfm-probe.py
    # MPICH (Hydra; MPIR_CVAR_ENABLE_FT=1 aborts MPI_Init in the mpich 5.0.2 wheel):
    timeout 60 mpiexec -n 3 -disable-auto-cleanup python -u scripts/ulfm-probe.py

What the project's MPIs did is in src/tandem/launch/mpi/fault_tolerance.py; scripts/ulfm-shrink.py
goes on from here with tandem itself: its MPI engine on the shrunk communicator and
td.elastic.State restoring the last commit.
"""

import os
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank = comm.Get_rank()
print(f"[{rank}] up, {comm.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0]}",
      flush=True)
comm.Barrier()
if rank == 2:
    os._exit(3)
start = time.monotonic()
try:
    print(f"[{rank}] allreduce gave {comm.allreduce(1)}: the loss was not seen", flush=True)
except MPI.Exception as error:
    print(f"[{rank}] allreduce failed after {time.monotonic() - start:.1f} s: "
          f"{error.Get_error_string()}", flush=True)
try:
    comm.Revoke()
    shrunk = comm.Shrink()
    print(f"[{rank}] shrunk: rank {shrunk.Get_rank()} of {shrunk.Get_size()}, "
          f"agree {shrunk.Agree(1)}, allreduce {shrunk.allreduce(rank)}", flush=True)
except (MPI.Exception, NotImplementedError) as error:
    print(f"[{rank}] revoke/shrink/agree failed: {error}", flush=True)
    sys.exit(5)
