"""td.Checkpointer never loads a wrong checkpoint and never loses one silently (issue 42).

- A data file with 4 KB overwritten (size unchanged) fails its checksums: refused on every rank,
  naming the file, the step and the older steps, with the model and optimizer untouched; a
  checkpoint saved without checksums (before them) still loads.
- A directory another running job saves into is refused, naming that job; once it stopped, a
  new job resumes from it (the normal resume); a dead job's owner file is taken over.
- An async save the script never waited for is published at exit (also after td.shutdown()),
  or its loss is said naming the step.
- A full disk is named as such (the path, bytes needed and free), before writing when the
  file system is visibly too small, and when a write fails on it.
"""

import gc
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.checkpoint import dir_owner
from tandem.checkpoint import exit as checkpoint_exit
from tandem.checkpoint.durable import CheckpointError, CorruptCheckpointError
from tandem.testing import run_distributed

BACKENDS = ["gloo", "mpi"]
ROOT = Path(__file__).resolve().parents[1]


def _sharded():
    """A fully sharded model with Adam: every rank writes a data file of ~24 KB."""
    torch.manual_seed(0)
    model = td.fully_shard(nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def _train(model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    optimizer.zero_grad()
    model(torch.randn(4, 64, generator=generator)).square().mean().backward()
    optimizer.step()


def _state(model, optimizer) -> dict:
    tensors = {k: t.clone() for k, t in td.fsdp.full_state_dict(model).items()}
    for i, state in optimizer.state_dict()["state"].items():
        tensors.update({(i, k): torch.as_tensor(v).clone() for k, v in state.items()})
    return tensors


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


# -- 5: checksums ---------------------------------------------------------------------------


def check_corrupt_file(directory: str) -> dict:
    model, optimizer = _sharded()
    checkpointer = td.Checkpointer(directory, keep=3)
    for step in range(3):
        _train(model, optimizer, step)
        checkpointer.save(step, model=model, optimizer=optimizer)
    newest = Path(directory) / "step-00000003"
    if td.rank() == 0:  # 4 KB overwritten in the middle of rank 1's file, its size unchanged
        data = newest / "__1_0.distcp"
        size = data.stat().st_size
        with open(data, "r+b") as file:
            file.seek(size // 2 - 2048)
            file.write(os.urandom(4096))
        assert data.stat().st_size == size
    td.barrier()
    fresh, fresh_optimizer = _sharded()
    _train(fresh, fresh_optimizer, 7)  # state of its own, that a refused load must leave alone
    before = _state(fresh, fresh_optimizer)
    result = {}
    try:
        td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_optimizer)
    except CorruptCheckpointError as error:
        result["error"] = str(error)
    result["untouched"] = _same(before, _state(fresh, fresh_optimizer))
    # A checkpoint saved before checksums existed (its metadata has none) loads as ever.
    if td.rank() == 0:
        shutil.move(str(newest), os.path.join(os.path.dirname(directory), f"damaged-{td.size()}"))
        metadata_file = Path(directory) / "step-00000002" / ".metadata"
        metadata = pickle.loads(metadata_file.read_bytes())
        del metadata.tandem_checksums
        metadata_file.write_bytes(pickle.dumps(metadata))
    td.barrier()
    result["old"] = td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_optimizer)
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(240)
def test_a_corrupt_file_is_refused_naming_it_the_step_and_the_older_steps(tmp_path, backend):
    results = run_distributed(check_corrupt_file, world_size=2, backend=backend,
                              args=(str(tmp_path / "ck"),))
    for rank, result in enumerate(results):
        error = result.get("error", "")
        for fragment in ("step-00000003", "__1_0.distcp is corrupt", "do not match the checksum",
                         "step 3", "step(s) 2, 1", "to resume from step 2", "Nothing was loaded"):
            assert fragment in error, (rank, fragment, error)
        assert result["untouched"], rank
        assert result["old"] == 2, (rank, result["old"])


# -- 6: one running job per directory --------------------------------------------------------

_KEPT: list = []  # a running job's Checkpointer, kept alive between calls in its world


def start_first_job(directory: str) -> int:
    model, optimizer = _sharded()
    _KEPT.append(td.Checkpointer(directory))
    _KEPT[0].save(0, model=model, optimizer=optimizer)
    return os.getpid()


def stop_first_job() -> None:
    _KEPT.clear()
    gc.collect()


def second_job(directory: str) -> dict:
    model, optimizer = _sharded()
    checkpointer = td.Checkpointer(directory)
    errors = {}
    for name, call in (("save", lambda: checkpointer.save(0, model=model, optimizer=optimizer)),
                       ("restore", lambda: checkpointer.restore(model=model, optimizer=optimizer))):
        try:
            call()
        except CheckpointError as error:
            errors[name] = str(error)
    return errors


def resume_second_job(directory: str) -> tuple[int, list[str]]:
    model, optimizer = _sharded()
    checkpointer = td.Checkpointer(directory)
    resumed = checkpointer.restore(model=model, optimizer=optimizer)
    checkpointer.save(resumed, model=model, optimizer=optimizer)
    return resumed, sorted(os.listdir(directory))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(240)
def test_a_directory_another_running_job_saves_into_is_refused(tmp_path, backend):
    directory = str(tmp_path / "ck")
    first = run_distributed(start_first_job, world_size=2, backend=backend, args=(directory,))[0]
    try:
        for rank, errors in enumerate(run_distributed(second_job, world_size=3, backend=backend,
                                                      args=(directory,))):
            for name in ("save", "restore"):
                message = errors.get(name, "")
                assert "belongs to another running job" in message, (rank, name, errors)
                assert f"pid {first} on" in message and "a directory of its own" in message, message
    finally:
        run_distributed(stop_first_job, world_size=2, backend=backend)
    assert not (tmp_path / "ck" / dir_owner.OWNER).exists()  # released when the job stopped
    results = run_distributed(resume_second_job, world_size=3, backend=backend, args=(directory,))
    assert [resumed for resumed, _ in results] == [1, 1, 1], results
    # Rank 0 listed it while its job held it (the others may list after it let go).
    assert results[0][1] == [dir_owner.OWNER, "step-00000001", "step-00000002"], results[0]


def test_a_dead_jobs_directory_is_taken_over(tmp_path):
    """A job killed while it owned the directory left its file: its pid is gone, so the next
    job resumes there (this process, a world of one)."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / dir_owner.OWNER).write_text(
        f'{{"job": "an old job", "host": "{os.uname().nodename}", "pid": {gone.stdout.strip()}, '
        f'"started": "1", "since": "yesterday"}}')
    checkpointer = td.Checkpointer(tmp_path)
    assert checkpointer.save(0, model=nn.Linear(2, 2))
    assert f'"pid": {os.getpid()}' in (tmp_path / dir_owner.OWNER).read_text()
    del checkpointer
    gc.collect()
    assert not (tmp_path / dir_owner.OWNER).exists()


# -- 7: the last async save is published at exit ----------------------------------------------


def check_published_at_exit(directory: str) -> dict:
    model, optimizer = _sharded()
    checkpointer = td.Checkpointer(directory, every=2, async_save=True)
    for step in range(4):
        _train(model, optimizer, step)
        checkpointer.save(step, model=model, optimizer=optimizer)  # step 4's is left in flight
    expected = _state(model, optimizer)
    result = {"at_exit": checkpoint_exit.publish_at_exit()}  # what the exit hook runs
    del checkpointer
    fresh, fresh_optimizer = _sharded()
    result["restored"] = td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_optimizer)
    result["same"] = _same(expected, _state(fresh, fresh_optimizer))
    # A rank that never gets to the exit hook (killed): rank 0 waits to its deadline, then
    # says which step is lost and where a restart resumes.
    checkpointer = td.Checkpointer(directory, every=2, async_save=True)
    checkpointer.save(5, model=model, optimizer=optimizer)
    if td.rank() == 0:
        result["lost"] = checkpoint_exit.publish_at_exit(deadline_s=1.0)
    else:
        checkpoint_exit.done(checkpointer._pending)
    checkpointer._pending = None
    td.barrier()
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(240)
def test_an_async_save_never_waited_for_is_published_at_exit(tmp_path, backend):
    results = run_distributed(check_published_at_exit, world_size=2, backend=backend,
                              args=(str(tmp_path / "ck"),))
    for rank, result in enumerate(results):
        assert result["at_exit"] == [] and result["restored"] == 4 and result["same"], (rank, result)
    lost = results[0]["lost"]
    assert len(lost) == 1, lost
    for fragment in ("checkpoint of step 6", "NOT published", "rank(s) [1] did not finish",
                     "a restart resumes from step 4"):
        assert fragment in lost[0], (fragment, lost[0])


_NEVER_WAITS = textwrap.dedent("""
    import sys
    import torch
    import tandem as td

    td.init()
    torch.manual_seed(0)
    model = td.fully_shard(torch.nn.Linear(64, 64))
    checkpointer = td.Checkpointer(sys.argv[1], every=2, async_save=True)
    for step in range(6):
        with torch.no_grad():
            model._tandem_shard.add_(1.0)
        checkpointer.save(step, model=model)
    td.shutdown()  # and no checkpointer.wait(): step 6's save is still in flight
""")


@pytest.mark.timeout(180)
def test_a_job_that_ends_without_wait_publishes_its_last_checkpoint(tmp_path):
    script = tmp_path / "never_waits.py"
    script.write_text(_NEVER_WAITS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo",
                             str(script), str(tmp_path / "ck")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["step-00000004", "step-00000006"], names  # published; owner file released
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for value in expected.values():
        for _ in range(6):
            value.add_(1.0)  # as the job did, step by step
    assert td.Checkpointer(tmp_path / "ck").restore(model=model) == 6
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


# -- 14: a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KB tmpfs (mounting needs root; skipped otherwise)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def check_full_disk(directory: str) -> dict:
    errors = {}
    torch.manual_seed(0)
    big = nn.Linear(512, 512)  # 1 MB: more than the disk holds, seen before writing
    try:
        td.Checkpointer(os.path.join(directory, "big")).save(0, model=big)
    except CheckpointError as error:
        errors["before"] = str(error)
    # Many small tensors: 4 KB of numbers, but each item's framing makes the files far larger
    # than that, so the check before writing passes and the write itself runs out of space.
    many = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(400)])
    checkpointer = td.Checkpointer(os.path.join(directory, "many"), async_save=True)
    checkpointer.save(0, model=many)
    try:
        checkpointer.wait()
    except CheckpointError as error:
        errors["async"] = str(error)
    try:
        td.save(big.state_dict(), os.path.join(directory, "single.pt"))
    except CheckpointError as error:
        errors["single"] = str(error)
    errors["left"] = sorted(os.listdir(os.path.join(directory, "many")))
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(240)
def test_a_full_disk_is_named_with_the_bytes_needed_and_free(small_disk, backend):
    for rank, errors in enumerate(run_distributed(check_full_disk, world_size=2, backend=backend,
                                                  args=(str(small_disk),))):
        assert "no space left on device: rank(s) [0, 1]" in errors.get("before", ""), (rank, errors)
        assert "which has" in errors["before"] and "Nothing was written" in errors["before"], errors
        assert "no space left on device in" in errors.get("async", ""), (rank, errors)
        assert "bytes free" in errors["async"] and "needs at least" in errors["async"], errors
        assert "no space left on device in" in errors.get("single", ""), (rank, errors)
        assert errors["left"] == [dir_owner.OWNER], errors  # the failed save's files are gone
