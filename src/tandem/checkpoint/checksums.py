"""Checksums of a distributed checkpoint's bytes: computed by the writer, checked before a load.

A file whose size is right can still hold the wrong bytes (a disk or a copy that changed a
block). So every rank, once its files are written (in the background thread for async saves,
never on the training thread), reads them back and takes a CRC-32 of each item's bytes
(`zlib.crc32`, which releases the GIL: it runs beside training at memory speed). Rank 0 keeps
them in the checkpoint's `.metadata`, as an attribute that torch's own readers ignore:

    metadata.tandem_checksums = {"__0_0.distcp": [(offset, length, crc32, key), ...], ...}

Before anything loads, the ranks share the files out, each checks its share and they agree on
the verdict (`dcp_files.read_metadata`): one damaged byte is an error on every rank that names
the file and the tensor, and nothing has been loaded. Checkpoints written before checksums (or
by torch's `dcp.save`) have none and load as before.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

ATTRIBUTE = "tandem_checksums"
_BLOCK = 8 << 20  # bytes read at a time


def _crc(file: Any, offset: int, length: int) -> int:
    file.seek(offset)
    crc, left = 0, length
    while left:
        block = file.read(min(_BLOCK, left))
        if not block:
            return -1  # shorter than recorded: never equal to a CRC
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def of_results(directory: Path, results: list) -> dict[str, list[tuple[int, int, int, str]]]:
    """The CRC-32 of every item this rank wrote (its DCP `WriteResult`s), by file."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for result in results:
        info = result.storage_data
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, result.index.fqn))
    sums: dict[str, list[tuple[int, int, int, str]]] = {}
    for name, items in by_file.items():
        with open(directory / name, "rb") as file:
            sums[name] = [(offset, length, _crc(file, offset, length), key)
                          for offset, length, key in sorted(items)]
    return sums


def attach(metadata: Any, sums: list[dict]) -> None:
    """Keep every rank's checksums in the metadata rank 0 is about to write."""
    merged: dict[str, list] = {}
    for mine in sums:
        for name, items in mine.items():
            merged.setdefault(name, []).extend(items)
    setattr(metadata, ATTRIBUTE, merged)


def check(path: Path, metadata: Any, rank: int, size: int) -> str | None:
    """This rank's share of the files checked against their checksums; a problem, or None
    (also for a checkpoint saved without checksums)."""
    sums = getattr(metadata, ATTRIBUTE, None)
    if not sums:
        return None
    for name in sorted(sums)[rank::size]:
        with open(path / name, "rb") as file:
            for offset, length, saved, key in sums[name]:
                found = _crc(file, offset, length)
                if found != saved:
                    return (f"{name} is corrupt: the {length} bytes of {key} at offset {offset} do "
                            f"not match the checksum saved with them (crc32 {found & 0xffffffff:08x}, "
                            f"saved {saved:08x}); the file changed after it was written")
    return None
