"""The Lightning strategies: ``DPStrategy`` (one device), ``DPDDPStrategy`` (Lightning's DDP) and
``DPFSDPStrategy`` (FSDP2-sharded parameters on Lightning's ModelParallelStrategy).

All take the same privacy options (:class:`PrivacyConfig`, with the option objects :class:`Checks` and
:class:`UserBound`) and share the hooks of
:class:`DPStrategyBase`; the modules beside them hold what the hooks call (refusals, loaders,
checkpoints, routing, the norm pass, the optimizer proxy).
"""

from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.config import PrivacyConfig
from lightning_dp.strategies.ddp import DPDDPStrategy
from lightning_dp.strategies.fsdp import DPFSDPStrategy
from lightning_dp.strategies.options import Checks, UserBound
from lightning_dp.strategies.single_device import DPStrategy


def register() -> None:
    """Make ``strategy="dp"``, ``"dp_ddp"`` and ``"dp_fsdp"`` work in ``Trainer`` and LightningCLI YAML.

    Runs on ``import lightning_dp``. Lightning 2.6 has no entry-point group for strategies, so a script
    that never imports lightning_dp must name the class instead (``lightning_dp.DPStrategy``).
    """
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in (DPStrategy, DPDDPStrategy, DPFSDPStrategy):
        if cls.strategy_name not in StrategyRegistry:
            cls.register_strategies(StrategyRegistry)


__all__ = [
    "Checks",
    "DPDDPStrategy",
    "DPFSDPStrategy",
    "DPStrategy",
    "DPStrategyBase",
    "PrivacyConfig",
    "UserBound",
    "register",
]
