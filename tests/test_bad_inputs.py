"""Bad input gets a clear error before any work starts, naming the value and the fix."""

import pytest
import torch

import tandem as td
from tandem.cli.command import build_parser, main
from tandem.launch import LaunchError, config_from_args
from tandem.launch.launcher import launch


def _config(*argv: str):
    return config_from_args(build_parser().parse_args(["run", *argv]), {})


@pytest.mark.parametrize("path, says", [
    ("/no/such/folder/trace.json", "the folder /no/such/folder does not exist"),
    ("{tmp}", "is a directory; give a file name"),
])
def test_a_timeline_path_that_cannot_be_written_is_refused_before_the_job(tmp_path, path, says):
    with pytest.raises(LaunchError, match=says):
        _config("-np", "2", "--timeline", path.format(tmp=tmp_path), "train.py")
    assert _config("-np", "2", "--timeline", str(tmp_path / "t.json"), "t.py").timeline


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_master_on_a_one_node_job_is_refused_not_ignored(backend):
    config = _config("-np", "2", "--backend", backend, "--master", "127.0.0.1:29500", "t.py")
    with pytest.raises(LaunchError, match=r"--master 127.0.0.1:29500 is for jobs of several "
                                          r"nodes .* Drop --master"):
        launch(config)


def test_an_unknown_run_flag_prints_runs_usage(capsys):
    assert main(["run", "-np", "2", "--bogus", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tandem run ") and "unrecognized arguments: --bogus" in err


def test_an_empty_bench_range_is_refused(capsys):
    assert main(["bench", "allreduce", "--min-size", "1M", "--max-size", "4K"]) == 2
    assert "--min-size 1048576 is larger than --max-size 4096 (bytes): swap them" in \
        capsys.readouterr().err


def test_restoring_into_another_shape_names_the_checkpoint(tmp_path):
    checkpointer = td.Checkpointer(tmp_path, every=1)
    checkpointer.save(1, model=torch.nn.Linear(2, 3))
    with pytest.raises(RuntimeError, match=r"checkpoint .*step-\d+'(.|\n)*its 'model' does not match "
                                           r"(.|\n)*weight: model \[3, 4\], saved \[3, 2\]"):
        checkpointer.restore(model=torch.nn.Linear(4, 3))


def test_a_collective_after_shutdown_says_so_and_all_finite_checks_its_input():
    td.init(backend="gloo")
    try:
        assert td.all_finite(torch.tensor(1.0), torch.ones(3))
        assert not td.all_finite(torch.tensor([1.0, float("inf")]))
        with pytest.raises(TypeError, match="all_finite takes torch tensors, got float"):
            td.all_finite(1.0)
        with pytest.raises(ValueError, match="at least one tensor"):
            td.all_finite()
    finally:
        td.shutdown()
    with pytest.raises(RuntimeError, match=r"tandem was shut down \(td.shutdown\(\) was called\)"):
        td.allreduce(torch.ones(2))
