"""`tandem.job.settings`: every TANDEM_* setting parsed in one place, and the one backend choice."""

from __future__ import annotations

import pytest

from tandem.job import settings
from tandem.job.settings import DEFAULT_TIMEOUT_S, Settings, choose_backend, read


def test_nothing_set_gives_the_defaults():
    told = read({})
    assert told == Settings()
    assert told.timeout_s == DEFAULT_TIMEOUT_S and told.checks and not told.debug


def test_every_setting_is_parsed():
    told = read({
        "TANDEM_BACKEND": " Gloo ", "TANDEM_TIMEOUT": "2.5", "TANDEM_CHECKS": "off",
        "TANDEM_DEBUG": "1", "TANDEM_WATCHDOG": "no", "TANDEM_TIMELINE": "t.json",
        "TANDEM_TIMELINE_EVENTS": "10", "TANDEM_RESTART": "2", "TANDEM_MPI_PROGRESS": "Thread",
        "TANDEM_MPI_ON_FAILURE": "exit", "TANDEM_MPI_CUDA_AWARE": "0",
        "TANDEM_LAUNCH_TOKEN": "abc", "TANDEM_SCALE_STEPS": "5", "TANDEM_SCALE_WARMUP": "1",
        "TANDEM_SCALE_OUT": "out", "TANDEM_SCALE_MODE": "weak",
    })
    assert told == Settings(
        backend="gloo", timeout=2.5, checks=False, debug=True, watchdog=False,
        timeline="t.json", timeline_events=10, restart=2, mpi_progress="thread",
        mpi_on_failure="exit", mpi_cuda_aware=False, launch_token="abc", scale_steps=5,
        scale_warmup=1, scale_out="out", scale_mode="weak",
    )


@pytest.mark.parametrize("env, message", [
    ({"TANDEM_BACKEND": "carrier-pigeon"},
     "TANDEM_BACKEND='carrier-pigeon': unknown backend 'carrier-pigeon': choose one of gloo"),
    ({"TANDEM_TIMEOUT": "soon"}, "TANDEM_TIMEOUT='soon' is not a number"),
    ({"TANDEM_TIMEOUT": "0"}, "TANDEM_TIMEOUT=0: give a positive number of seconds"),
    ({"TANDEM_TIMELINE_EVENTS": "lots"}, "TANDEM_TIMELINE_EVENTS='lots' is not an integer"),
    ({"TANDEM_MPI_PROGRESS": "always"}, "TANDEM_MPI_PROGRESS='always': choose one of auto"),
    ({"TANDEM_SCALE_MODE": "fast"}, "TANDEM_SCALE_MODE='fast': choose one of strong, weak"),
    ({"TANDEM_SCALE_STEPS": "3"}, "TANDEM_SCALE_STEPS is set but TANDEM_SCALE_OUT is not"),
])
def test_a_bad_value_names_the_variable_and_the_fix(env, message):
    with pytest.raises(ValueError, match=message):
        read(env)


def test_settings_are_read_once_and_reread_on_demand(monkeypatch):
    first = settings.reload()
    monkeypatch.setenv("TANDEM_DEBUG", "0" if first.debug else "1")
    assert settings.current() is first  # read once per process
    assert settings.reload().debug is not first.debug
    monkeypatch.undo()
    assert settings.reload() == first


def test_one_backend_order_for_the_launcher_and_the_rank():
    """DESIGN section 1: the one named; else nccl with CUDA; else mpi for an MPI job; else gloo."""
    assert choose_backend("MPI", cuda=True, mpi=False, mpi_job=False) == "mpi"
    assert choose_backend(None, cuda=True, mpi=True, mpi_job=True) == "nccl"  # also under mpiexec
    assert choose_backend(None, cuda=False, mpi=True, mpi_job=True) == "mpi"
    assert choose_backend(None, cuda=False, mpi=True, mpi_job=False) == "gloo"
    assert choose_backend(None, cuda=False, mpi=False, mpi_job=True) == "gloo"
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        choose_backend("nccl", cuda=False, mpi=True, mpi_job=True)
    with pytest.raises(ValueError, match="unknown backend 'tcp': choose one of gloo, nccl, mpi"):
        choose_backend("tcp", cuda=False, mpi=False, mpi_job=False)
