"""The Lightning strategies: ``DPStrategy`` (one device) and ``DPDDPStrategy`` (Lightning's DDP).

Both take the same privacy arguments (:class:`PrivacyConfig`) and share the hooks of
:class:`DPStrategyBase`; the modules beside them hold what the hooks call (refusals, loaders,
checkpoints, routing, the norm pass, the optimizer proxy).
"""

from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.config import PrivacyConfig
from lightning_dp.strategies.ddp import DPDDPStrategy
from lightning_dp.strategies.single_device import DPStrategy


def register() -> None:
    """Make ``strategy="dp"`` and ``strategy="dp_ddp"`` work in ``Trainer`` and LightningCLI YAML.

    Runs on ``import lightning_dp``. Lightning 2.6 has no entry-point group for strategies, so a script
    that never imports lightning_dp must name the class instead (``lightning_dp.DPStrategy``).
    """
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in (DPStrategy, DPDDPStrategy):
        if cls.strategy_name not in StrategyRegistry:
            cls.register_strategies(StrategyRegistry)


__all__ = ["DPDDPStrategy", "DPStrategy", "DPStrategyBase", "PrivacyConfig", "register"]
