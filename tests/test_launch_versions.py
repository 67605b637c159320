"""A node whose tandem is another version is refused at admission, with both versions named.

The second "node" is a real agent process on this machine whose tandem reports another version:
a `sitecustomize` on its PYTHONPATH (and on no other process's) sets `tandem.__version__` before
the agent runs, which is what a second tandem install looks like on the control plane.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tandem
from tandem.launch.agents.admission import PROTOCOL, refusal, versions

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "fault_train.py")
OTHER = "0.0.9+other"


def _env(*front: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*front, str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def test_an_agent_of_another_version_or_protocol_is_refused_naming_both():
    hello = {"node_rank": 1, "nnodes": 2, "nproc": 1, "elastic": False, **versions()}
    assert refusal(hello, 2, {0}, elastic=False) is None
    other = refusal({**hello, "version": OTHER}, 2, {0}, elastic=False)
    assert f"node 1 runs tandem {OTHER} (agent protocol {PROTOCOL})" in other
    assert f"node 0 runs tandem {tandem.__version__}" in other
    assert "install the same tandem on every node" in other
    newer = refusal({**hello, "protocol": PROTOCOL + 1}, 2, {0}, elastic=False)
    assert f"agent protocol {PROTOCOL + 1}" in newer
    older = {k: v for k, v in hello.items() if k not in ("version", "protocol")}
    assert "older than the version check" in refusal(older, 2, {0}, elastic=True)


@pytest.mark.timeout(150)
def test_a_node_with_another_tandem_is_refused_at_admission(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        f"import tandem\ntandem.__version__ = {OTHER!r}\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def agent(node: int, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(node),
             "--master", f"127.0.0.1:{port}", "--secret", "s3cret", "-np", "1", TRAIN, "ok"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    agents = [agent(0, _env(TANDEM_TIMEOUT="4")),
              agent(1, _env(str(tmp_path), TANDEM_TIMEOUT="4"))]
    results = []
    try:
        for each in agents:
            results.append(each.communicate(timeout=120))
    finally:
        for each in agents:
            if each.poll() is None:
                each.kill()
                each.wait(10)
    (_, err0), (_, err1) = results
    said = (f"node 1 runs tandem {OTHER} (agent protocol {PROTOCOL}), node 0 runs tandem "
            f"{tandem.__version__} (agent protocol {PROTOCOL}): install the same tandem")
    assert agents[1].returncode == 2, err1
    assert said in err1, err1
    assert "refused the agent from 127.0.0.1" in err0 and said in err0, err0
    assert agents[0].returncode == 1  # its node 1 never joined
    assert "[0]" not in err0  # no rank was started
