"""How many GPUs the ranks of `tandem run` will see, asked without importing torch.

`tandem run` without `-np` starts one rank per visible GPU, and `--nproc-per-node gpu|auto`
(torchrun's spelling) counts them the same way. The machine's NVIDIA GPUs are read from the
driver (`/proc/driver/nvidia/gpus/*/information`, else `nvidia-smi -L`); `CUDA_VISIBLE_DEVICES`
is then parsed as CUDA parses it (`visible_count`, the rules of torch's
`torch.cuda._parse_visible_devices`): indices or UUID prefixes, read up to the first one that
names no device; a repeated one hides every device.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from collections.abc import Mapping, Sequence

DRIVER = "/proc/driver/nvidia/gpus"
NVIDIA_SMI_TIMEOUT_S = 10.0


def machine_gpus() -> list[str]:
    """The UUIDs of this machine's NVIDIA GPUs (`GPU-...`), or [] when there are none."""
    uuids = []
    for information in sorted(glob.glob(os.path.join(DRIVER, "*", "information"))):
        try:
            with open(information) as file:
                found = re.search(r"^GPU UUID:\s*(\S+)", file.read(), re.MULTILINE)
        except OSError:
            found = None
        uuids.append(found.group(1) if found else f"GPU-unknown-{len(uuids)}")
    if uuids or not glob.glob("/dev/nvidia[0-9]*"):
        return uuids
    try:  # a container may have the devices without the driver's /proc entries
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=NVIDIA_SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU \d+:.*\(UUID: (GPU-[^)\s]+)\)", listing, re.MULTILINE)


def _leading_integer(text: str) -> int:
    """CUDA reads each entry like strtoul: `1gpu` is 1; an entry without digits is -1."""
    found = re.match(r"[+-]?\d+", text.strip())
    return int(found.group()) if found else -1


def visible_count(variable: str | None, uuids: Sequence[str]) -> int:
    """How many of the GPUs `uuids` a process sees under CUDA_VISIBLE_DEVICES=`variable`
    (None: unset, so all of them)."""
    if variable is None:
        return len(uuids)
    entries = variable.split(",")
    if variable.startswith("MIG-"):  # MIG instances are not in the driver's list: count them
        seen = []
        for entry in entries:
            if not entry.startswith("MIG-"):
                break
            if entry in seen:
                return 0
            seen.append(entry)
        return len(seen) if uuids else 0
    chosen: list[int] = []
    for entry in entries:
        if variable.startswith("GPU-"):
            matches = [i for i, uuid in enumerate(uuids) if entry and uuid.startswith(entry)]
            index = matches[0] if len(matches) == 1 else -1
        else:
            index = _leading_integer(entry)
        if index < 0 or index >= len(uuids):
            break  # the first entry that names no device ends the list
        if index in chosen:
            return 0  # a repeated device: CUDA shows none
        chosen.append(index)
    return len(chosen)


def visible_gpus(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs a rank started from this environment will see."""
    environ = os.environ if environ is None else environ
    return visible_count(environ.get("CUDA_VISIBLE_DEVICES"), machine_gpus())


def ranks_without_np(physical: int, visible: int, variable: str | None, cores: int) -> int:
    """`tandem run` without -np: one rank per visible GPU; without one, a ValueError that says
    what to give. `physical`: the machine's GPUs, `visible`: those CUDA_VISIBLE_DEVICES leaves."""
    if visible > 0:
        return visible
    if physical > 0:
        why = (f"CUDA_VISIBLE_DEVICES={variable!r} hides this machine's {physical} GPU(s) "
               "(set it to the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1)")
    else:
        why = "this machine has no visible GPU"
    raise ValueError(f"how many processes? give -np N (or set TANDEM_NP): without it tandem run "
                   f"starts one rank per visible GPU, and {why}; on CPUs, -np {min(cores, 4)} "
                   f"starts {min(cores, 4)} ranks (this machine has {cores} core(s))")


def started_note(ranks: int, variable: str | None) -> str:
    """The line `tandem run` prints when it chose -np from the GPUs."""
    shown = f" (CUDA_VISIBLE_DEVICES={variable})" if variable is not None else ""
    return (f"tandem run: no -np given: starting {ranks} rank(s), one per visible GPU{shown}; "
            "give -np N for another number")
