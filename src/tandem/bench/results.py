"""What every benchmark does with its numbers: write them as JSON where `--out` says."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(result: Any, path: str | os.PathLike) -> Path:
    """Write `result` as indented JSON to `path` (its folder created); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out
