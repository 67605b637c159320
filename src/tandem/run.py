"""`python -m tandem.run ARGS` is `tandem run ARGS`, as `python -m torch.distributed.run` is
torchrun: a command written for torchrun runs with its launcher's name replaced."""

import sys

from tandem.cli.command import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
