"""Under `tandem run --backend mpi`: rank 1 calls sys.exit(3) while rank 0 waits in a barrier."""

import sys
import time

import tandem as td

td.init()
if td.rank() == 1:
    print(f"rank 1 exits at {time.time():.3f}", flush=True)
    sys.exit(3)
print("rank 0 waits in a barrier", flush=True)
td.barrier()  # never completes: only the launcher stopping the job ends this rank
