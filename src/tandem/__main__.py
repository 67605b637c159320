"""`python -m tandem` is the `tandem` command."""

import sys

from tandem.cli.command import main

sys.exit(main())
