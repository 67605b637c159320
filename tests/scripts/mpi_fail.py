"""Under `tandem run --backend mpi`: rank 1 fails while rank 0 waits for it in a barrier."""

import time

import tandem as td

td.init()
if td.rank() == 1:
    print(f"rank 1 gives up at {time.time():.3f}", flush=True)
    raise RuntimeError("rank 1 cannot go on")
print("rank 0 waits in a barrier", flush=True)
td.barrier()  # never completes: only the launcher stopping the job ends this rank
