"""Host lists as `horovodrun` spells them: `-H node1:4,node2:4` and `--hostfile`.

Pure parsing, no network: a `Host` is a name and a number of slots (processes it may run).
`is_local` says whether a name is this machine, so `-H localhost:4` runs like a plain `-np 4`:
a loopback name or address, this machine's hostname, or an address one of its interfaces holds
(asked by binding a socket to it, which sends nothing; names are never looked up here, so a
typo costs no DNS query). A host listed twice is an error (`check_unique`).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


@dataclass(frozen=True)
class Host:
    """One machine of the job and how many ranks it may run."""

    name: str
    slots: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a host name is empty: write hosts as name:slots, e.g. node1:4")
        if self.slots < 1:
            raise ValueError(
                f"host {self.name!r} has {self.slots} slots: give it at least 1 "
                f"(e.g. {self.name}:4)"
            )

    @property
    def is_local(self) -> bool:
        """True when the name is this machine (localhost, a loopback address, our hostname)."""
        if self.name in LOCAL_NAMES:
            return True
        hostname = socket.gethostname()
        return self.name in (hostname, hostname.split(".")[0]) or holds_address(self.name)


@functools.cache
def holds_address(text: str) -> bool:
    """True when `text` is an IP address of this machine (loopback, or held by an interface)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False  # a name: not resolved here
    if address.is_loopback:
        return True
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((text, 0))  # EADDRNOTAVAIL unless an interface here holds it
        except OSError:
            return False
    return True


def check_unique(hosts: tuple[Host, ...], where: str) -> tuple[Host, ...]:
    """`hosts`, or a ValueError naming a host given twice (its ranks would collide on
    local ranks, GPUs and ports as two agents of one machine)."""
    seen: dict[str, Host] = {}
    for host in hosts:
        key = host.name.lower()
        if key in seen:
            first = seen[key]
            raise ValueError(
                f"{where}: host {host.name!r} is listed twice ({first.name}:{first.slots} and "
                f"{host.name}:{host.slots}): list it once with all its slots "
                f"({host.name}:{first.slots + host.slots})"
            )
        seen[key] = host
    return hosts


def _host(text: str, where: str) -> Host:
    name, sep, slots = text.strip().rpartition(":")
    if not sep:  # no ":" at all: one slot
        name, slots = slots, "1"
    try:
        count = int(slots)
    except ValueError:
        raise ValueError(
            f"{where}: cannot read {text!r} as host:slots (slots must be an integer, "
            f"e.g. node1:4)"
        ) from None
    return Host(name.strip(), count)


def parse_hosts(spec: str) -> tuple[Host, ...]:
    """`"node1:4,node2:4"` -> two hosts; a host without `:slots` has one slot."""
    parts = [part for part in spec.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"-H {spec!r} names no host: write it as node1:4,node2:4")
    return check_unique(tuple(_host(part, "-H") for part in parts), f"-H {spec}")


def read_hostfile(path: str | Path) -> tuple[Host, ...]:
    """Read a hostfile: one host per line, `node1 slots=4` or `node1:4`; `#` starts a comment."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read the hostfile {str(path)!r}: {error.strerror}") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        if len(fields) == 2 and fields[1].startswith("slots="):
            hosts.append(_host(f"{fields[0]}:{fields[1][len('slots='):]}", where))
        elif len(fields) == 1:
            hosts.append(_host(fields[0], where))
        else:
            raise ValueError(
                f"{where}: cannot read {raw.strip()!r}: write `node1 slots=4` or `node1:4`"
            )
    if not hosts:
        raise ValueError(f"the hostfile {str(path)!r} names no host")
    return check_unique(tuple(hosts), f"the hostfile {str(path)!r}")


def total_slots(hosts: tuple[Host, ...]) -> int:
    return sum(host.slots for host in hosts)
