"""A horovod.torch script (but for the import): reads horovodrun's variables, then one allreduce."""

import os

import torch

import tandem.horovod as hvd

hvd.init()
told = [int(os.environ[f"HOROVOD_{name}"]) for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
assert told == [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()], told
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
print(f"horovod rank {hvd.rank()} of {hvd.size()}: sum {total.item():g}")
hvd.shutdown()
