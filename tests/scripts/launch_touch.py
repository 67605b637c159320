"""Writes this rank's number to the file named by `sys.argv[1]`: proof that the job started."""

import os
import sys
from pathlib import Path

Path(sys.argv[1]).write_text(os.environ["TANDEM_RANK"])
