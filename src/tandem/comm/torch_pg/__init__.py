"""The torch.distributed backends "tandem" and "mpi": tandem's engines as a `ProcessGroup`, for
DDP, FSDP2, DTensor and pipelining.

What is where:

- `join`: `td.init` and torch.distributed on one world, whichever the script starts first.
- `order`: What tandem's process group adds so that torch.distributed never returns garbage:
  collectives completed in order, checks that travel with...
- `p2p`: Point-to-point messages of tandem's process group carry what was sent: a receive into a
  tensor of another size or dtype is an error at the...
- `process_group`: tandem's engines as a torch.distributed process group: what DDP, FSDP2,
  DTensor and pipelining call.
- `register`: The torch.distributed backends "tandem" and "mpi": their creators, and their
  meeting with `td.init`.
- `work`: What torch sees of a tandem operation: a `Work` whose waits go through the watchdog,
  and torch's reduction ops in tandem's words.
"""
