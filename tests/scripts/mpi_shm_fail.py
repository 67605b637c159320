"""Under `tandem run --backend mpi`: print the /dev/shm segments this rank maps, then fail."""

import tandem as td

td.init()
td.barrier()  # MPI's shared memory is set up by now
with open("/proc/self/maps") as maps:
    names = sorted({line.split("/dev/shm/")[1].strip() for line in maps if "/dev/shm/" in line})
print(f"rank {td.rank()} maps {' '.join(names) or '-'}", flush=True)
td.barrier()
if td.rank() == 1:
    raise RuntimeError("rank 1 fails after td.init()")
td.barrier()  # never completes: the launcher stops this rank
