"""DPStrategy: trains any LightningModule with differential privacy on one device."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.config import PrivacyConfig, takes_privacy_options


class DPStrategy(DPStrategyBase, SingleDeviceStrategy):
    """Differentially private training (DP-SGD by default) for an unmodified LightningModule.

    Takes every privacy option of :class:`~lightning_dp.strategies.PrivacyConfig` by keyword
    (``target_epsilon``, ``max_grad_norm``, the slots, ``checks=Checks(...)``, …), validated there and
    kept as ``strategy.config``; ``help(DPStrategy)`` and ``lightning-dp fit --help`` list them.

    Args:
        device: force a device; by default it comes from the Trainer's accelerator and devices.
        accelerator: Lightning's, passed on to ``SingleDeviceStrategy``.
        checkpoint_io: Lightning's, passed on to ``SingleDeviceStrategy``.
        precision_plugin: Lightning's, passed on to ``SingleDeviceStrategy``.
    """

    strategy_name = "dp"

    @takes_privacy_options
    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        **options: Any,
    ) -> None:
        config = PrivacyConfig.from_options(options, owner=type(self).__name__)
        SingleDeviceStrategy.__init__(
            self,
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_given = device is not None
        self.parallel_devices: list[torch.device] | None = None  # filled in by the Trainer's connector
        self._init_dp(config)

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            if len(self.parallel_devices) > 1:
                raise DPConfigurationError(
                    f"DPStrategy trains on one device, but the Trainer asked for {len(self.parallel_devices)}. "
                    "Use devices=1, or the distributed strategy (strategy='dp_ddp')."
                )
            return self.parallel_devices[0]
        return self._root_device

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on one device (lightning-dp)", override=True
        )
