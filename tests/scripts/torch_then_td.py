"""torch.distributed first, tandem second: `init_process_group(argv[1])`, then `td.init()`
joins that very group; argv[2] ("mismatch") asks td.init for another backend instead."""

import sys

import torch
import torch.distributed as dist

import tandem as td

dist.init_process_group(sys.argv[1])
if sys.argv[2:] == ["mismatch"]:
    try:
        td.init(backend="gloo")
    except ValueError as error:
        print(f"refused: {error}")
        sys.exit(0)
    raise SystemExit("td.init(backend='gloo') on a group of another backend was accepted")
world = td.init()
assert (world.rank, world.size) == (dist.get_rank(), dist.get_world_size())
total = td.allreduce(torch.tensor([world.rank + 1.0]), op="sum")
other = torch.tensor([1.0])
dist.all_reduce(other)  # the same engine, the same stream of operations
print(f"td={total.item():g} torch={other.item():g} engine={world.backend} "
      f"group={dist.get_backend()}")
td.shutdown()  # leaves torch's group, which the script made, to the script
dist.barrier()
dist.destroy_process_group()
