"""What an estimate holds and how it prints: `MemoryEstimate` and `MemoryComparison`."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 2**20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds (the largest rank, when ranks differ). Sizes are in bytes.

    Made by `estimate_memory`, not by users.

    Args:
        layout: the layout estimated ("ddp", "zero", "fully_shard", "pipeline", "tp").
        world_size: the ranks it splits over.
        optimizer: the optimizer whose state is counted.
        parameters: P, the model's parameter count, unsplit.
        params: the bytes of this rank's parameters.
        grads: the bytes of its gradients.
        optimizer_state: the bytes of its optimizer state.
        buffers: the wrapper's own buffers, kept between steps.
        transient: the most held at once during a step beyond the above.
        offload: "cpu" when params, grads and optimizer state live on the host.
        notes: what the estimate assumed, in words.
    """

    layout: str
    world_size: int
    optimizer: str
    parameters: int  # P: the model's parameter count, unsplit
    params: int
    grads: int
    optimizer_state: int
    buffers: int = 0  # the wrapper's own, kept between steps
    transient: int = 0  # the most held at once during a step beyond the above
    offload: str | None = None  # "cpu": params, grads and optimizer state live on the host
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def states(self) -> int:
        """Parameters, gradients and optimizer state (the ZeRO paper's "model states")."""
        return self.params + self.grads + self.optimizer_state

    @property
    def host(self) -> int:
        """Bytes kept in host memory instead of the device (offload="cpu")."""
        return self.states if self.offload else 0

    @property
    def total(self) -> int:
        """Device bytes kept between steps."""
        return self.states + self.buffers - self.host

    @property
    def peak(self) -> int:
        """Device bytes at the busiest moment of a step (activations not counted)."""
        return self.total + self.transient

    def __str__(self) -> str:
        where = f", offload={self.offload!r}" if self.offload else ""
        lines = [f"{self.layout} over {self.world_size} rank(s), {self.optimizer}, "
                 f"{self.parameters / 1e6:.2f} M parameters{where}: MiB per rank"]
        rows = [("parameters", self.params), ("gradients", self.grads),
                ("optimizer state", self.optimizer_state), ("buffers", self.buffers),
                ("between steps", self.total), ("during a step", self.transient),
                ("peak", self.peak)]
        if self.offload:
            rows.append(("on the host", self.host))
        lines += [f"  {name:<16}{value / MiB:>10.2f}" for name, value in rows]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class MemoryComparison(tuple):
    """Several `MemoryEstimate`s, printed as one table."""

    def __str__(self) -> str:
        if not self:
            return "(no layouts)"
        first = self[0]
        head = (f"{first.parameters / 1e6:.2f} M parameters, {first.optimizer}, "
                f"{first.world_size} rank(s): MiB per rank")
        columns = ("params", "grads", "optimizer", "buffers", "between", "during", "peak", "host")
        lines = [head, f"{'layout':<12}" + "".join(f"{c:>10}" for c in columns)]
        for e in self:
            values = (e.params, e.grads, e.optimizer_state, e.buffers, e.total, e.transient,
                      e.peak, e.host)
            lines.append(f"{e.layout:<12}" + "".join(f"{v / MiB:>10.2f}" for v in values))
        notes = dict.fromkeys(f"{e.layout}: {note}" for e in self for note in e.notes)
        lines += [f"note: {note}" for note in notes]
        return "\n".join(lines)
