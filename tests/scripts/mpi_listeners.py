"""Under `tandem run --backend mpi`: print this rank's listening TCP sockets outside loopback.

mpiexec's own sockets are listed apart: Hydra's control port (on every interface, inherited
by the ranks) when tandem runs Hydra because no mpiexec.gforker sits beside it (docs/mpi.md).
"""

import os
import subprocess

import tandem as td

td.init()
td.allreduce(td.rank() * __import__("torch").ones(4))  # the transports are wired by now
td.barrier()
lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
mine = [line for line in lines if f"pid={os.getpid()}," in line]
external = [line for line in mine
            if not line.split()[3].startswith(("127.", "[::1]", "[::ffff:127."))]
hydra = [line.split()[3] for line in external if '"mpiexec"' in line]
own = [line.split()[3] for line in external if '"mpiexec"' not in line]
print(f"rank {td.rank()} listens on {len(mine)} socket(s); outside loopback: "
      f"{' '.join(own) or 'none'}; mpiexec's: {' '.join(hydra) or 'none'}", flush=True)
td.barrier()
