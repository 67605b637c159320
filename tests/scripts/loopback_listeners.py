"""Under `tandem run`: rank 0 lists the machine's listening sockets while every rank is alive.

It writes one JSON object to the file named by its argument: `ss -ltunpH` (TCP and UDP, with
the owning processes) and every process's parent, read at the same moment, so the test can
tell the job's sockets (the launcher's descendants) from those of other programs on the machine.
"""

import json
import os
import subprocess
import sys

import torch

import tandem as td

td.init()
td.allreduce(torch.ones(4))  # the transports are wired by now
td.barrier()
if td.rank() == 0:
    listening = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, timeout=30)
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                    parents[name] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    # ss pads its columns with spaces: squeezed, the one line stays short on a busy machine
    squeezed = "\n".join(" ".join(line.split()) for line in listening.stdout.splitlines())
    # to the file the test names: on a machine with many processes the report passes the 64 KB
    # at which `tandem run` splits a rank's line into pieces (launch/local/output.py)
    with open(sys.argv[1], "w") as report:
        json.dump({"ss": squeezed, "rc": listening.returncode, "parents": parents}, report)
    print("LISTENERS written", flush=True)
td.barrier()
