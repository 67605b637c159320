"""The data position is part of an elastic job's state (issue 44, part B, item 2).

A `td.partition_dataset` loader kept in `td.elastic.State` is committed with the model; when a
rank dies mid-epoch (3 -> 2), the survivors roll back to the last commit and read the rest of
the epoch split two ways (the sampler's own `load_state_dict`, as a checkpoint restore on
another number of ranks does): each sample once per epoch, the global batches of one process
in its order, and the parameters of one uninterrupted process. One `tandem run` job (Gloo:
MPI's world cannot change).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "elastic_loader.py")
JOB_S = 120
N, STEPS_PER_EPOCH, EPOCHS = 60, 5, 2


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def test_a_loader_in_the_elastic_state_resumes_at_the_exact_sample_when_the_job_shrinks(
        tmp_path):
    reference, out = tmp_path / "one.pt", tmp_path / "out.pt"
    subprocess.run([sys.executable, SCRIPT, str(reference)], cwd=ROOT, env=_env(), check=True,
                   timeout=JOB_S, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "3", "--min-np", "2",
                           "--max-np", "3", SCRIPT, str(out), "--die", "2:3"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=JOB_S)
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2" in done.stderr and "resumed from commit 3" in done.stderr, done.stderr
    result, one = torch.load(out), torch.load(reference)
    assert result["sizes"] == [3] * 3 + [2] * 7  # died mid-epoch 0, in its 4th step
    for epoch in range(EPOCHS):
        batches = result["seen"][epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH]
        assert sorted(i for batch in batches for i in batch) == list(range(N)), \
            f"epoch {epoch}: each sample once"
    assert result["seen"] == one["seen"]  # one process's global batches, in its order
    for name, expected in one["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-6)


def test_a_sampler_resized_mid_epoch_reads_the_rest_as_a_restore_on_that_many_ranks():
    """Without processes: 3 samplers read 2 steps, then become 2 (the abandoned pass's position
    is kept); they read what 2 samplers restored from the same state read."""
    from tandem.data import ShardSampler, epoch_order

    three = [ShardSampler(N, r, 3, batch_size=12, seed=3, pad=False) for r in range(3)]
    for sampler in three:
        iter(sampler)
        sampler.batch_taken()
        sampler.batch_taken()
    state = three[0].state_dict()
    restored = [ShardSampler(N, r, 2, batch_size=12, seed=3, pad=False) for r in range(2)]
    for sampler in restored:
        sampler.load_state_dict(state)
    resized = three[:2]
    for rank, sampler in enumerate(resized):
        sampler.resize(rank, 2)
    assert [list(s) for s in resized] == [list(s) for s in restored]
    assert resized[0].state_dict() == restored[0].state_dict()
    rest = [i for s in resized for i in s.indices(0, 24)]
    assert sorted(rest) == sorted(epoch_order(N, 0, seed=3)[24:].tolist())  # the epoch's rest
