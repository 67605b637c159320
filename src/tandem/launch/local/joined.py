"""Whether any rank joined the job, so that `tandem run` can say when none did.

A script that never joins (a single-process example, a library that does not recognise the
launcher) runs N independent copies under `tandem run -np N`, each training alone, and exits 0;
nothing else would say so. Every way of joining ends with the rank connecting to the job's
store, which this agent hosts and which counts the clients that proved its key
(`StoreServer.clients`, a count that only grows):

- tandem's way (`td.init()`): the rank uses that store;
- torch's way (`dist.init_process_group` on any backend, with the torchrun variables
  `tandem run` exports or a MASTER_PORT of the script's own): once the group exists, the rank
  says so to the store (`rendezvous.torch_rendezvous.report_joined`). tandem's `sitecustomize`
  (`launch/rank_site`) imports tandem into every rank, so this holds for a script that never
  imports tandem too.

So the verdict is read from what the ranks did, once they are all gone: nothing is polled, and
no port is watched (a listener on MASTER_PORT could come and go between two looks, and a script
that picks its own port has none to watch).

`JoinWatch.verdict()` is the line printed at the end of a job that exited 0 without anyone
joining: a warning, or with `--require-join` an error (exit code 1). When the script imports a
framework that falls back to one process by itself (Accelerate without `cpu=True` on a machine
without GPUs, Lightning without a strategy), the line names it and the line to add
(`framework_hints`): the launcher reads the script's own imports once, at the end of such a
job (the ranks never reached the store, so they cannot report what they imported).
"""

from __future__ import annotations

import re
from typing import Any

from tandem.launch.local.processes import tcp_sockets
from tandem.launch.programs import is_python, python_target
from tandem.rendezvous import StoreServer

#: (the import a script makes, what it needs to join the job under `tandem run`).
FRAMEWORKS = (
    (re.compile(r"^[ \t]*(?:from|import)[ \t]+accelerate\b", re.M),
     "it imports Accelerate, which runs one process per copy (DistributedType.NO) when it "
     "finds no GPU unless told to join on CPU: `Accelerator(cpu=True)` (the HF Trainer: "
     "`TrainingArguments(..., use_cpu=True)`), or `td.init()` before `Accelerator()` to "
     "train on tandem's engine"),
    (re.compile(r"^[ \t]*(?:from|import)[ \t]+(?:lightning|pytorch_lightning|lightning_fabric)\b",
                re.M),
     "it imports Lightning, whose Fabric and Trainer without a strategy run alone on CPU: "
     "`Fabric(..., strategy=\"tandem\")` or `Trainer(..., strategy=\"tandem\")`"),
)
#: What a rank's report of a framework's fallback names (`comm/torch_pg/copies.py`).
FRAMEWORK_LINES = (
    ("accelerate", "on a machine without GPUs Accelerate joins only when told "
                   "`Accelerator(cpu=True)` (the HF Trainer: `TrainingArguments(..., "
                   "use_cpu=True)`)"),
)
COPIES_KEY = "tandem/copies/"  # comm/torch_pg/copies.py's KEY (the launcher imports no comm)
_READ_BYTES = 1 << 20  # a script's first MiB: its imports are at its top


def script_of(config: Any) -> str | None:
    """The Python script a job's ranks run (None: a module, or a program that is not Python)."""
    if getattr(config, "module", False):
        return None
    if getattr(config, "executable", False):
        if not is_python(config.program):
            return None
        target = python_target(config.args)
        return target[1] if target is not None and target[0] == "script" else None
    return config.program


def framework_hints(script: str | None) -> list[str]:
    """What the script's imports say it needs to join (`FRAMEWORKS`); [] when nothing."""
    if not script:
        return []
    try:
        with open(script, encoding="utf-8", errors="replace") as file:
            source = file.read(_READ_BYTES)
    except OSError:
        return []
    return [hint for pattern, hint in FRAMEWORKS if pattern.search(source)]


def listening(port: int) -> bool:
    """Whether a socket of this network namespace listens on TCP `port` (IPv4 or IPv6)."""
    return bool(tcp_sockets(port, state="0A", end=1))


class JoinWatch:
    """Whether a rank of the attempt about to start joined: a client of `store` from now on
    (see the module's docstring). Made before the attempt's ranks start."""

    def __init__(self, store: StoreServer) -> None:
        self.store = store
        # Earlier clients (the other nodes' agents, ranks of earlier attempts) do not count.
        self._clients_before = store.clients

    def joined(self) -> bool:
        return self.store.clients > self._clients_before

    def copies(self, np: int) -> dict[int, str]:
        """Rank -> the framework that ran it as a copy of its own though it joined (Accelerate's
        DistributedType.NO: `comm/torch_pg/copies.py` sets the key at the rank's exit)."""
        found = {rank: self.store.get(f"{COPIES_KEY}{rank}") for rank in range(np)}
        return {rank: value.decode() for rank, value in found.items() if value is not None}

    def verdict(self, np: int, program: str, required: bool,
                script: str | None = None) -> str | None:
        """None when the ranks joined and computed together (or there is one rank); else the
        line to print, with what `script`'s imports need to join (`framework_hints`)."""
        if np < 2:
            return None
        copies = self.copies(np) if self.joined() else {}
        if copies:
            return self._copies_line(np, program, required, copies)
        if self.joined():
            return None
        hints = "".join(f" In {script}: {hint}." for hint in framework_hints(script))
        head = "error" if required else "warning"
        tail = ("" if required else " (--require-join or TANDEM_REQUIRE_JOIN=1 makes this an "
                "error)")
        return (f"tandem run: {head}: {np} independent copies of {program} ran: no rank joined "
                "the job (neither td.init() nor torch.distributed's init_process_group was "
                "called), so each one computed alone. Call td.init(), or "
                "dist.init_process_group(), in the script; a script for one process is run with "
                f"-np 1{tail}.{hints}")

    @staticmethod
    def _copies_line(np: int, program: str, required: bool, copies: dict[int, str]) -> str:
        head = "error" if required else "warning"
        ranks = ", ".join(str(rank) for rank in sorted(copies))
        hint = dict(FRAMEWORK_LINES).get(next(iter(copies.values())), "")
        return (f"tandem run: {head}: {program}: rank(s) {ranks} of {np} joined torch.distributed, "
                f"but {', '.join(sorted(set(copies.values())))} ran each as a copy of its own "
                f"(DistributedType.NO), so each one computed alone: {hint}" +
                ("" if required else " (--require-join or TANDEM_REQUIRE_JOIN=1 makes this an "
                 "error)") + ".")
