"""Every snippet of docs/recipes.md runs as a user would run it, and prints what it promises.

Each ```python block of the guide is a complete script whose first line says how to start it:
`# run: tandem run -np 2` (through the launcher, `python -m tandem run -np 2 script.py`, MPI
by default on this machine) or `# run: python` (the mp.Process template, which starts its own
ranks). The script is written to a temporary directory and run from there, with no TANDEM_*
or torch.distributed variables of ours in its environment. Each must exit 0 and print the
lines listed for its section in EXPECTED.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from jobs_ahead import Ahead, Command

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "recipes.md"
JOB_TIMEOUT_S = 120  # a 2-rank job here takes 5-15 s; two shared cores can stall it for long

# What each section's snippet must print (regular expressions, searched line by line).
EXPECTED = {
    "From PyTorch DDP": [r"^\[0\] epoch 2: accuracy (0\.[6-9]\d\d|1\.000) \(evaluated on rank 0 only\)$"],
    'torch.distributed as it is: backend "tandem"': [
        r"^\[1\] rank 1: dist\.all_reduce\(t\) -> \[3\.0, 3\.0, 3\.0\]$",
        r"^\[0\] rank 0: replicas equal after DDP on tandem: True$",
    ],
    "From raw torch.distributed": [
        r"^\[0\] rank 0: td\.allreduce\(t, inplace=False\) = \[1\.5, 1\.5, 1\.5\], t = \[1\.0, 1\.0, 1\.0\]$",
        r"^\[1\] rank 1: after td\.allreduce\(t, op='sum'\): t = \[3\.0, 3\.0, 3\.0\]$",
        r"^\[1\] rank 1: broadcast from rank 0: \[3\.0, 3\.0, 3\.0\]$",
        r"^\[1\] rank 1: gradients equal on all ranks: True$",
    ],
    "From Horovod": [r"^\[0\] step 19: loss 0\.\d{4}, gradient norm before clipping \d+\.\d{3}$"],
    "From Lightning's precision flags": [
        r"^\[0\] precision=32-true: final loss \d\.\d{3}, skipped steps per rank \[0, 0\]$",
        r"^\[0\] precision=bf16-mixed: final loss \d\.\d{3}, skipped steps per rank \[0, 0\]$",
        # 2**20 overflows fp16: the first steps are skipped, the same number on both ranks.
        r"^\[0\] precision=16-mixed: final loss \d\.\d{3}, skipped steps per rank \[([1-9]), \1\]$",
    ],
    "Accumulation, clipping and LR schedulers": [
        r"^\[0\] epoch 1: loss \d+\.\d{4}, lr \d\.\d\de-\d\d, last gradient norm \d+\.\d{3}$",
    ],
    "BatchNorm": [
        r"^\[0\] plain BatchNorm: ReplicaBufferWarning:\s+1\.running_mean \(16,\): differs from rank 0 "
        r"on rank 1 by up to",
        r"^\[0\] after td\.broadcast_buffers: buffers identical too$",
        r"^\[0\] SyncBatchNorm: running mean starts \[",
    ],
    "From the Needle `ddp` module": [
        r"^\[0\] epoch 2: 2 ranks x 30 per step, train accuracy (0\.[6-9]\d\d|1\.000)$",
    ],
    # Two processes print to one pipe: with PYTHONUNBUFFERED set, print's text and its newline
    # are separate writes, so one rank's line may continue another's.
    "The mp.Process template": [
        r"rank 0 of 2: sum of ranks 1, replicas identical",
        r"rank 1 of 2: sum of ranks 1, replicas identical",
    ],
}


def snippets() -> list:
    """(section heading, launch words, script) for every ```python block of the guide."""
    text = GUIDE.read_text()
    found = []
    for block in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        headings = re.findall(r"^### (.+)$", text[: block.start()], re.MULTILINE)
        section = headings[-1] if headings else "(no section)"
        code = block.group(1)
        first = code.splitlines()[0]
        run = re.fullmatch(r"# run: (.+)", first)
        words = shlex.split(run.group(1)) if run else [f"(first line is {first!r}, not '# run: ...')"]
        found.append(pytest.param(section, words, code, id=re.sub(r"\W+", "-", section).strip("-").lower()))
    return found


SNIPPETS = snippets()


def _environment() -> dict[str, str]:
    hidden = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k not in hidden}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def test_every_snippet_has_a_section_and_an_expectation():
    sections = [param.values[0] for param in SNIPPETS]
    assert len(sections) == len(set(sections)), f"one snippet per section: {sections}"
    assert set(sections) == set(EXPECTED), (
        f"snippets without expectations: {set(sections) - set(EXPECTED)}; "
        f"expectations without snippets: {set(EXPECTED) - set(sections)}")


# Each snippet is a job of its own, as a user runs it; the jobs run side by side, ahead of
# their tests (tests/jobs_ahead.py).
ahead = Ahead()
jobs = ahead.fixture()


def _command(words: list[str], script: Path) -> list[str] | None:
    if words[:2] == ["tandem", "run"]:
        return [sys.executable, "-m", "tandem", "run", *words[2:], str(script)]
    if words == ["python"]:
        return [sys.executable, str(script)]
    return None


@ahead.plan("test_snippet_runs")
def _(tmp, words, code):
    script = tmp / "script.py"
    script.write_text(code)
    command = _command(words, script)
    return [] if command is None else [Command(command, _environment(), tmp, JOB_TIMEOUT_S)]


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("section, words, code", SNIPPETS)
def test_snippet_runs(section, words, code, jobs, request):
    if _command(words, Path("script.py")) is None:
        pytest.fail(f"{section}: cannot run {words!r}; say '# run: tandem run -np N' or '# run: python'")
    [result], _ = jobs.take(request.node)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{section}: exit code {result.returncode}\n{output}"
    lines = output.splitlines()
    for pattern in EXPECTED[section]:
        assert any(re.search(pattern, line) for line in lines), f"{section}: no line {pattern!r}:\n{output}"
