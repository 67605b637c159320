"""All-reduce time and bus bandwidth, raw Gloo / mpi4py against tandem, 4 KB ... 256 MB.

    python benchmarks/allreduce.py [-np 2] [--max-size 16MB] [--budget 2] [--out FILE]

The measurement lives in `tandem.bench.allreduce` (also behind `tandem bench allreduce`).
"""

import sys

from tandem.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
