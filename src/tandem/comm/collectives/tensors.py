"""Many tensors at once: each tensor once (shared weights), packed into a few flat messages.

`coalesced` runs one in-place collective over many tensors as a few flat buffers per dtype and
device (Horovod's tensor fusion); `each_once` drops the second name of a shared tensor, and
`module_tensors` gives a module's parameters and buffers, each once. Used by the broadcasts of
`tandem.parallel`, by LocalSGD and by the replica check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# Large enough that per-message overhead vanishes, small enough that packing a big model does
# not double its memory.
MESSAGE_BYTES = 64 << 20
# A tensor this big is bandwidth-bound: it travels on its own, in its own memory, rather than
# paying two copies to be packed with others.
OWN_MESSAGE_BYTES = 1 << 20


def coalesced(
    tensors: Iterable[torch.Tensor],
    communicate: Callable[[torch.Tensor], None],
    *,
    copy_back: bool = True,
    message_bytes: int = MESSAGE_BYTES,
) -> None:
    """Pack `tensors` into flat buffers per (dtype, device), call `communicate(buffer)` on each
    (it works in place), and copy the results back into the tensors unless `copy_back=False`.
    Contiguous tensors of `OWN_MESSAGE_BYTES` or more are passed on their own, uncopied.

    Every rank must pass tensors of the same dtypes and sizes in the same order: the buffers
    (and so the messages) are then identical in number and shape on every rank.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_contiguous() and tensor.numel() * tensor.element_size() >= OWN_MESSAGE_BYTES:
            communicate(tensor.detach().view(-1))
            continue
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for (dtype, device), members in by_kind.items():
        limit = max(1, message_bytes // max(1, torch.empty(0, dtype=dtype).element_size()))
        chunk: list[torch.Tensor] = []
        count = 0
        for tensor in [*members, None]:
            if tensor is not None and (not chunk or count + tensor.numel() <= limit):
                chunk.append(tensor)
                count += tensor.numel()
                continue
            if chunk:
                _communicate_chunk(chunk, dtype, device, communicate, copy_back)
            chunk, count = ([tensor], tensor.numel()) if tensor is not None else ([], 0)


def _communicate_chunk(chunk, dtype, device, communicate, copy_back) -> None:
    if sum(t.numel() for t in chunk) == 0:
        return
    if len(chunk) == 1 and chunk[0].is_contiguous():
        communicate(chunk[0].detach().view(-1))  # works in the tensor's own memory
        return
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    communicate(flat)
    if not copy_back:
        return
    offset = 0
    with torch.no_grad():
        for tensor in chunk:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view(tensor.shape))
            offset += n


def each_once(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with each tensor once, under its first name (shared weights)."""
    seen: set[int] = set()
    unique = []
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append((name, tensor))
    return unique


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers, each once (shared weights under their first name)."""
    return each_once([*module.named_parameters(), *module.named_buffers()])
