"""Shared fixtures: tiny models and data so each Lightning run takes well under a second."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import logging
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import FlatClipping, checking
from lightning_dp.clipping import per_sample_norms
from lightning_dp.per_example import PerExampleGradients

torch.set_num_threads(1)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LightningModule.*has parameters that were not used.*")


# -- real data sets: not in the clone ------------------------------------------------------------------
DATA_ROOT = Path(
    os.environ.get("LIGHTNING_DP_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
"""Where the real data sets are: ``$LIGHTNING_DP_DATA``, else ``../shared/data`` beside the clone (CI's layout)."""
MNIST_FILES = tuple(
    f"MNIST/raw/{split}-{kind}-idx{dims}-ubyte.gz"
    for split in ("train", "t10k")
    for kind, dims in (("images", 3), ("labels", 1))
)
"""MNIST's four archives in torchvision's layout (``MNISTDataModule(root=DATA_ROOT, download=False)``)."""
BANK_FILE = "tabular/BANK.dat.gz"


def requires_data(*files: str) -> pytest.MarkDecorator:
    """Skip, naming what is missing and where it was looked for, unless every path exists under DATA_ROOT.

    The clone carries no data sets: a fresh clone skips these tests with the reason; CI, which has
    ``../shared/data`` (or ``LIGHTNING_DP_DATA``), runs them.
    """
    missing = [f for f in files if not (DATA_ROOT / f).exists()]
    shown = ", ".join(missing[:2]) + (f" and {len(missing) - 2} more" if len(missing) > 2 else "")
    return pytest.mark.skipif(
        bool(missing),
        reason=f"data not in the clone: {shown} not found under {DATA_ROOT} "
        "(set LIGHTNING_DP_DATA to the folder that holds it)",
    )


class TinyModule(LightningModule):
    """A 2-layer MLP classifier; ``self.net`` holds every parameter, the loss is a batch mean."""

    def __init__(
        self,
        n: int = 256,
        d: int = 10,
        classes: int = 3,
        batch_size: int = 32,
        lr: float = 0.1,
        hidden: int = 16,
        data_seed: int = 0,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        g = torch.Generator().manual_seed(data_seed)
        self.x = torch.randn(n, d, generator=g)
        w = torch.randn(d, classes, generator=g)
        self.y = (self.x @ w).argmax(1)
        self.batch_size, self.lr, self.optimizer_name = batch_size, lr, optimizer
        self.seen_batch_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not checking():  # lightning-dp's own dry passes (checks, the structure probe) are not steps
            self.seen_batch_sizes.append(len(x))
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=256)


class IndexedModule(TinyModule):
    """TinyModule whose batches carry the examples' indices, recorded per step (``steps``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps: list[list[int]] = []

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(self.x, self.y, torch.arange(len(self.x))), batch_size=self.batch_size
        )

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if not checking():  # the run-time checks' own passes are not steps
            self.steps.append(index.tolist())
        return torch.nn.functional.cross_entropy(self(x), y)


class ZeroSignal(TinyModule):
    """A TinyModule whose loss carries no gradient (0 × output): every release is pure noise."""

    def training_step(self, batch, batch_idx):
        return (self(batch[0]) * 0.0).mean()


class GradientRecorder(Callback):
    """Records the gradient each optimizer step receives, all parameters flattened into one vector."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]))


class RecordingClipping(FlatClipping):
    """Flat clipping that also measures every example's clipped contribution (for the bound tests)."""

    def __init__(self) -> None:
        self.max_contribution = 0.0
        self.max_raw_norm = 0.0
        self.grad_dtypes: set[torch.dtype] = set()

    def clip_and_sum(self, grad_samples, ctx):
        self.grad_dtypes |= {g.dtype for g in grad_samples}
        out = super().clip_and_sum(grad_samples, ctx)
        for i in range(grad_samples[0].shape[0]):
            single = [g[i : i + 1] for g in grad_samples]
            contribution = super().clip_and_sum(PerExampleGradients.from_tensors(single), ctx)
            self.max_contribution = max(
                self.max_contribution,
                float(per_sample_norms(PerExampleGradients.from_tensors([c[None] for c in contribution]))[0]),
            )
        if grad_samples[0].shape[0]:
            self.max_raw_norm = max(self.max_raw_norm, float(per_sample_norms(grad_samples).max()))
        return out


def make_trainer(strategy, tmp_path=None, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path) if tmp_path is not None else None,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


@pytest.fixture
def tiny() -> TinyModule:
    return TinyModule()


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own folder, so reports and logs never land in the repository."""
    monkeypatch.chdir(tmp_path)


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A one-process fit of a distributed strategy (dp_ddp or dp_fsdp with devices=1) leaves Lightning's
    process group, its store bound to MASTER_PORT, and MASTER_PORT in os.environ: a later subprocess that
    inherits the port then fails with EADDRINUSE. Each test ends with neither."""
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def neighbour():
    """The neighbour test (tests/neighbour.py): one private step on D and on D minus one example."""
    import neighbour as helper

    return helper
