"""Run Horovod's own `test_torch.py` against `tandem.horovod`, one 2-rank job per test.

    python scripts/horovod_suite.py /path/to/horovod/test/parallel/test_torch.py \
        [--np 2] [--jobs 2] [--timeout 120] [--backend gloo] [-k SUBSTRING] [--json out.json]

A temporary shim package maps `horovod.torch` onto `tandem.horovod` (and gives the few
`horovod.*` helpers the suite's `common.py` imports), then every `TorchTests.test_*` runs as
`tandem run -np 2 -m pytest FILE::TorchTests::test_x` under a per-test timeout, at most
`--jobs` at a time. Prints one line per test (pass / fail / skip / timeout and the first
error) and a summary, and writes the same as JSON.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHIM = {
    "horovod/__init__.py": "",
    "horovod/torch/__init__.py": "from tandem.horovod import *  # noqa: F403\n",
    "horovod/common/__init__.py": "",
    "horovod/common/exceptions.py": "from tandem.horovod import HorovodInternalError  # noqa: F401\n",
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": (
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"
    ),
}
# The suite's common.py imports the `mock` backport; the standard library has the same.
SHIM_MOCK = "from unittest.mock import *  # noqa: F403\n"


def suite_tests(path: Path) -> list[str]:
    """The names of `TorchTests.test_*`, in file order."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TorchTests":
            return [item.name for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test_")]
    raise SystemExit(f"{path}: no class TorchTests found; give Horovod's test/parallel/test_torch.py")


def write_shim(root: Path, suite: Path) -> Path:
    for name, text in SHIM.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    (root / "mock.py").write_text(SHIM_MOCK)
    if importlib.util.find_spec("cloudpickle") is None:  # common.py imports it; pickle will do
        (root / "cloudpickle.py").write_text("from pickle import dumps, loads  # noqa: F401\n")
    common = suite.parent / "common.py"
    if not common.exists():
        raise SystemExit(f"{common} is missing: the suite imports it from beside test_torch.py")
    return root


def first_error(output: str) -> str:
    """The first line that says what went wrong, from pytest's or the launcher's output."""
    for pattern in (r"^(?:\[\d+\]\s*)?E\s{3}(.+)$", r"^(?:\[\d+\]\s*)?(\w*Error: .+)$",
                    r"^(?:\[\d+\]\s*)?(FAILED .+)$", r"(tandem run: .+)$"):
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            return match.group(1).strip()[:200]
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def run_one(test: str, suite: Path, shim: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shim), str(suite.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "tandem", "run", "-np", str(args.np)]
    if args.backend:
        command += ["--backend", args.backend]
    command += ["-m", "pytest", f"{suite}::TorchTests::{test}", "-q", "-rs",
                "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout, cwd=suite.parent)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode(errors="replace") if isinstance(
            expired.stdout, bytes) else (expired.stdout or "")
        return {"test": test, "result": "timeout", "seconds": round(time.monotonic() - start, 1),
                "error": f"no result within {args.timeout}s; " + first_error(output)}
    seconds = round(time.monotonic() - start, 1)
    if code == 0:
        skipped = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.+)$", output, re.MULTILINE)
        if skipped or re.search(r"\b\d+ skipped\b", output) and not re.search(r"\b\d+ passed",
                                                                                 output):
            reason = skipped.group(1).strip()[:200] if skipped else "skipped"
            return {"test": test, "result": "skip", "seconds": seconds, "error": reason}
        return {"test": test, "result": "pass", "seconds": seconds, "error": ""}
    return {"test": test, "result": "fail", "seconds": seconds, "error": first_error(output),
            "output": output[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", type=Path, help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test")
    parser.add_argument("--backend", default="gloo", help="tandem backend (default gloo)")
    parser.add_argument("-k", dest="only", action="append", default=[],
                        help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--json", type=Path, default=Path("horovod_suite.json"))
    args = parser.parse_args(argv)
    suite = args.suite.resolve()
    if not suite.is_file():
        raise SystemExit(f"{suite}: no such file; give the path of Horovod's test_torch.py")
    tests = suite_tests(suite)
    if args.only:
        tests = [t for t in tests if any(part in t for part in args.only)]
    with tempfile.TemporaryDirectory(prefix="horovod-shim-") as tmp:
        shim = write_shim(Path(tmp), suite)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_one, test, suite, shim, args) for test in tests]
            results = []
            for future in futures:
                result = future.result()
                results.append(result)
                print(f"{result['result']:<8}{result['seconds']:>7.1f}s  {result['test']:<55}"
                      f"{result['error'][:110]}", flush=True)
    counts = {kind: sum(r["result"] == kind for r in results)
              for kind in ("pass", "fail", "skip", "timeout")}
    print("\n" + "  ".join(f"{kind}: {n}" for kind, n in counts.items())
          + f"  (of {len(results)})")
    args.json.write_text(json.dumps({"suite": str(suite), "np": args.np, "backend": args.backend,
                                     "counts": counts, "tests": results}, indent=1))
    print(f"wrote {args.json}")
    return 0 if counts["fail"] == counts["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
