"""Correlated noise under 2-process CPU DDP (gloo); launched by tests/test_correlated_noise_runs.py.

Lightning's DDP launcher re-runs this script for rank 1. Each rank writes ``OUT/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import json

import _worker
import torch
from conftest import TinyModule
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import BandMF, CyclicPoisson, DPDDPStrategy, checking

OUT, _ = _worker.start()


def trainer(strategy: DPDDPStrategy, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(OUT),
    )  # fmt: skip
    options.update(kwargs)
    return Trainer(strategy=strategy, **options)


def dump(name: str, strategy: DPDDPStrategy, **extra) -> None:
    record = {
        "rank": strategy.global_rank,
        "steps": strategy.engine.steps,
        "epsilon": strategy.epsilon,
        "history": [[e.to_dict(), c] for e, c in strategy.ledger.history],
        "sigma": strategy.engine.noise.sigma,
        **extra,
    }
    (OUT / f"{name}.rank{strategy.global_rank}.json").write_text(json.dumps(record))


# 1. BandMF, b = 4, calibrated: the examples each rank used at each step, the partition, the ledger.
class Indexed(TinyModule):
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


torch.manual_seed(0)
module = Indexed(n=256, batch_size=16)
t = trainer(
    DPDDPStrategy(target_epsilon=2.0, sampler=CyclicPoisson(4, seed=1), noise=BandMF(), seed=0), max_epochs=3
)
t.fit(module)
dump("bandmf", t.strategy, indices=module.steps, groups=t.strategy.engine.sampler.groups().tolist())


# 2. Zero signal, σ given: the released gradient is the summed correlated noise of both ranks' shares.
class ZeroSignal(TinyModule):
    def training_step(self, batch, batch_idx):
        return (self(batch[0]) * 0.0).mean()


grads: list[torch.Tensor] = []


class Capture(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]).double())


coefficients = [1.0, 0.5, 0.375, 0.3125]
t = trainer(
    DPDDPStrategy(
        max_grad_norm=3.0, sampler=CyclicPoisson(4), noise=BandMF(noise_multiplier=2.0, coefficients=coefficients)
    ),
    max_steps=8, callbacks=[Capture()],
)  # fmt: skip
t.fit(ZeroSignal(n=400, d=50, hidden=200, classes=50, batch_size=40))
released = torch.stack(grads)  # [steps, d]: every rank holds the same all-reduced gradient
dump(
    "noise",
    t.strategy,
    covariance=(released @ released.T / released.shape[1]).tolist(),
    numel=released.shape[1],
    checksum=float(released.sum()),
)

_worker.finish_distributed()
