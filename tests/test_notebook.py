"""td.spawn where notebooks live: functions without a file, bad input, and a real Jupyter kernel.

`python -c` has a `__main__` without a file, as a notebook cell does: one such process checks
a spawned function defined there, a lambda that closes over something unpicklable, and a
child that dies before reporting. Then examples/notebook.ipynb runs on a real ipykernel.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FROM_MAIN = textwrap.dedent("""
    import threading
    import tandem as td

    def run(scale):
        import torch
        return td.allreduce(torch.ones(1) * scale, op="sum").item()

    print("results", td.spawn(run, 2, args=(3.0,)))

    def closes_over_a_lock():
        lock = threading.Lock()
        return lambda: lock.locked()
    try:
        td.spawn(closes_over_a_lock(), 2)
    except TypeError as error:
        print("pickling error:", error)

    def crash():
        import os, sys
        sys.stderr.write(f"rank {td.rank()} cannot go on: disk full\\n")
        sys.stderr.flush()
        os._exit(3)
    try:
        td.spawn(crash, 2)
    except td.SpawnError as error:
        print("spawn error:", error, "|end")
""")


def test_spawn_of_functions_defined_in_main_without_a_file():
    done = subprocess.run([sys.executable, "-c", FROM_MAIN], capture_output=True, text=True,
                          timeout=170, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "results [6.0, 6.0]" in out, out
    assert "pickling error: td.spawn cannot send the variable 'lock' that fn closes over" in out, out
    assert "_thread.lock" in out, out
    error = out[out.index("spawn error:"):out.index("|end")]
    assert "died before reporting (exit code 3)" in error, error
    rank = int(error.split("rank ")[1].split(" ")[0])
    assert f"rank {rank} cannot go on: disk full" in error.split("its last output:")[1], error


def test_notebook_example_runs_on_a_real_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="the test extra: pip install 'tandem[test]'")
    nbclient = pytest.importorskip("nbclient", reason="the test extra: pip install 'tandem[test]'")
    pytest.importorskip("ipykernel", reason="the test extra: pip install 'tandem[test]'")
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    env_path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"], old = env_path, os.environ.get("PYTHONPATH")
    try:  # the kernel inherits our environment: it must import this checkout's tandem
        nbclient.NotebookClient(notebook, timeout=150, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    text = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.outputs)
    assert "[0] epoch 2: loss" in text and "[1] epoch" not in text, text
    assert "on both ranks" in text, text
    assert (tmp_path / "runs" / "notebook" / "metrics.csv").read_text().count("\n") == 3
