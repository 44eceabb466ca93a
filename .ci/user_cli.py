"""A user's own LightningCLI script that never imports lightning_dp (issue #22): the strategy is named
by class path (``--trainer.strategy lightning_dp.DPStrategy``), which jsonargparse imports itself."""

import sys

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModel(LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MyDataModule(LightningDataModule):
    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


if __name__ == "__main__":
    assert "lightning_dp" not in sys.modules
    cli = LightningCLI(MyModel, MyDataModule, run=False)
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "DPStrategy", type(strategy)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert strategy.engine.steps >= 1
    assert strategy.epsilon > 0
    print(
        f"user_cli: DPStrategy from the class path, {strategy.engine.steps} steps, ε = {strategy.epsilon:.3f}"
    )
