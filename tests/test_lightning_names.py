"""`self.log(name, value, sync_dist=True)` on strategy="tandem" reduces one name on every rank.

Rank 0 logging `val_loss` and rank 1 `val_acc` at the same point made rank 0's
`callback_metrics["val_loss"]` the mean of a loss and an accuracy, rc 0: the strategy's
`reduce` gets the tensor alone. Now every rank raises `td.MetricMismatchError` naming each
rank's metric and the fix, before anything is averaged; the same names still average as
before. A real Trainer (`validate`) in the harness's shared worlds, Gloo and MPI.
"""

from __future__ import annotations

import importlib.util

import pytest

from tandem.testing import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs lightning: pip install 'tandem[lightning]'")
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def _validate(names: tuple[str, str]) -> dict:
    """Trainer.validate of a module whose rank r logs names[r] = r + 1, with sync_dist."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import tandem as td
    from tandem.lightning import TandemStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def validation_step(self, batch, _):
            self.log(names[td.rank()], torch.tensor(td.rank() + 1.0), sync_dist=True)

    trainer = L.Trainer(strategy=TandemStrategy(), accelerator="cpu", logger=False,
                        limit_val_batches=2, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2)
    try:
        trainer.validate(Module(), data, verbose=False)
    except td.metrics.MetricMismatchError as error:
        return {"error": str(error)}
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


def check_logged_names_are_agreed() -> dict:
    import tandem as td

    found = {"same": _validate(("val_loss", "val_loss")),
             "mixed": _validate(("val_loss", "val_acc"))}
    found["sum"] = td.allreduce(__import__("torch").ones(1), op="sum").item()  # still usable
    return found


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_log_different_names_with_sync_dist_are_named(backend):
    for found in run_distributed(check_logged_names_are_agreed, world_size=2, backend=backend,
                                 timeout=150):
        assert found["same"] == {"metrics": {"val_loss": 1.5}}  # the mean of 1 and 2
        error = found["mixed"]["error"].splitlines()
        assert error[0] == ("ranks reduce different logged values in one self.log(..., "
                            "sync_dist=True) reduction (nothing was averaged):"), error
        assert error[1].startswith("  rank 0: self.log('val_loss') in validation_step: "
                                   "allreduce(shape=(), dtype=float32"), error
        assert error[2].startswith("  rank 1: self.log('val_acc') in validation_step: "), error
        assert error[3].startswith("Log the same names with sync_dist=True"), error
        assert found["sum"] == 2.0
