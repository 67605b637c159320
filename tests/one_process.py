"""One-process references, computed once per test session and shared by the files that use them.

A test that compares a job with one process (`tests/scripts/elastic_train.py` run as
`python elastic_train.py OUT`, `preemptible_train.py DIR OUT`) needs that one process's result.
Run as separate processes, each reference pays a Python start, `import torch` and an interpreter
exit (seconds on a loaded machine) for a few milliseconds of training. Here every reference a
call asks for that is not known yet runs in ONE fresh process, one after the other (the script
as `__main__`, with its own arguments: what `python script ARGS` does), and each result is kept
for the rest of the session (per pytest-xdist worker), so a second file that asks for the same
script and arguments gets it without running anything (test_elastic.py and test_job_ends.py share
elastic_train.py's SGD run; test_preemption_launcher.py and test_preemption_stress.py share
preemptible_train.py's).

    one_process(SCRIPT, ("{out}", "--optimizer", "adam"), ("{out}",))  # [result, result]

In each run's arguments "{out}" is the file the script writes (loaded with torch.load) and
"{dir}" a fresh directory of the run's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # every run of one call, start to end, on a loaded machine

# Runs the script once per argument list (a JSON list of them), each as `python script ARGS` would.
_DRIVER = """
import json, runpy, sys
script = sys.argv[1]
for run in json.loads(sys.argv[2]):
    sys.argv = [script, *run]
    runpy.run_path(script, run_name="__main__")
"""

_results: dict[tuple[str, tuple[str, ...]], Any] = {}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def one_process(script: str | Path, *runs: tuple[str, ...]) -> list[Any]:
    """The result of `python script ARGS` for each argument list of `runs`, in their order."""
    keys = [(str(script), tuple(run)) for run in runs]
    missing = list(dict.fromkeys(key for key in keys if key not in _results))
    if missing:
        with tempfile.TemporaryDirectory(prefix="tandem-one-process-") as tmp:
            outs, argv = [], []
            for number, (_, run) in enumerate(missing):
                here = Path(tmp) / str(number)
                here.mkdir()
                out = here / "out.pt"
                outs.append(out)
                argv.append([arg.format(out=out, dir=here / "dir") for arg in run])
            done = subprocess.run([sys.executable, "-c", _DRIVER, str(script), json.dumps(argv)],
                                  cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
            assert done.returncode == 0, f"the one-process runs of {script} failed:\n{done.stderr}"
            for key, out in zip(missing, outs, strict=True):
                _results[key] = torch.load(out)
    return [_results[key] for key in keys]
