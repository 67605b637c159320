"""Imported first by `launch_importing.py`: the rank says on stderr that it is importing, then
stays inside this import until the launcher stops it (60 s at most), as a rank is caught inside
`import torch` by a Ctrl-C during start-up. Nothing on stdout: that would mark it started."""

import sys
import threading

print("importing", file=sys.stderr, flush=True)
threading.Event().wait(60)
