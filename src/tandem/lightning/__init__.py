"""Lightning on tandem: `Trainer(strategy="tandem")` and `Fabric(strategy="tandem")`.

    pip install 'tandem[lightning]'

`import tandem` is enough: when `lightning` is imported (before or after tandem) the strategy
"tandem" is added to the Trainer's and Fabric's registries (`tandem/hooks/lightning_strategy.py`); this
package does it at once when imported itself. Then start the script like any tandem job:

    tandem run -np 4 train.py          # or mpiexec / srun / torchrun

- `environment`: `TandemEnvironment`, the job as tandem's launchers describe it.
- `trainer`: `TandemStrategy`, for `lightning.pytorch.Trainer`.
- `fabric`: `TandemFabricStrategy`, for `lightning.fabric.Fabric`.
- `sharded`: `TandemFSDPStrategy` ("tandem_fsdp"), the Trainer's model under `td.fully_shard`.
- `fabric_sharded`: `TandemFabricFSDPStrategy`, the same for Fabric.
- `common`: what both share (collectives through tandem, the `devices` check).
"""

from __future__ import annotations

try:
    import lightning  # noqa: F401
except ImportError as error:  # only a missing `lightning` itself; anything else is a real bug
    if error.name != "lightning":
        raise
    raise ImportError(
        "tandem.lightning (Trainer/Fabric strategy='tandem') needs Lightning, which is not "
        "installed: pip install 'tandem[lightning]'") from error

from tandem.lightning.environment import TandemEnvironment
from tandem.lightning.fabric import TandemFabricStrategy
from tandem.lightning.fabric_sharded import TandemFabricFSDPStrategy
from tandem.lightning.sharded import TandemFSDPStrategy
from tandem.lightning.trainer import TandemStrategy


def register() -> None:
    """Add "tandem" to the Trainer's and Fabric's strategy registries (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC
    from lightning.pytorch.strategies import StrategyRegistry as TRAINER

    TandemStrategy.register_strategies(TRAINER)
    TandemFSDPStrategy.register_strategies(TRAINER)
    TandemFabricStrategy.register_strategies(FABRIC)
    TandemFabricFSDPStrategy.register_strategies(FABRIC)


register()

__all__ = ["TandemEnvironment", "TandemFSDPStrategy", "TandemFabricFSDPStrategy",
           "TandemFabricStrategy", "TandemStrategy", "register"]
