"""Correlated noise under 2-process CPU DDP (gloo); launched by tests/noise/test_correlated_runs.py.

Lightning's DDP launcher re-runs this script for rank 1. Each rank writes ``OUT/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import _worker
import torch
from conftest import GradientRecorder, IndexedModule, ZeroSignal
from lightning.pytorch import Trainer

from lightning_dp import BandMF, CyclicPoisson, DPDDPStrategy

OUT, _ = _worker.start()


def trainer(strategy: DPDDPStrategy, **kwargs) -> Trainer:
    return _worker.ddp_trainer(OUT, strategy, **kwargs)


def dump(name: str, strategy: DPDDPStrategy, **extra) -> None:
    history = [[e.to_dict(), c] for e, c in strategy.ledger.history]
    _worker.dump(OUT, name, strategy, history=history, sigma=strategy.engine.noise.sigma, **extra)


# 1. BandMF, b = 4, calibrated: the examples each rank used at each step, the partition, the ledger.
torch.manual_seed(0)
module = IndexedModule(n=256, batch_size=16)
t = trainer(
    DPDDPStrategy(target_epsilon=2.0, sampler=CyclicPoisson(4, seed=1), noise=BandMF(), seed=0), max_epochs=3
)
t.fit(module)
dump("bandmf", t.strategy, indices=module.steps, groups=t.strategy.engine.sampler.groups().tolist())


# 2. Zero signal, σ given: the released gradient is the summed correlated noise of both ranks' shares.
recorder = GradientRecorder()

coefficients = [1.0, 0.5, 0.375, 0.3125]
t = trainer(
    DPDDPStrategy(
        max_grad_norm=3.0, sampler=CyclicPoisson(4), noise=BandMF(noise_multiplier=2.0, coefficients=coefficients)
    ),
    max_steps=8, callbacks=[recorder],
)  # fmt: skip
t.fit(ZeroSignal(n=400, d=50, hidden=200, classes=50, batch_size=40))
released = torch.stack(recorder.grads).double()  # [steps, d]: every rank holds the same all-reduced gradient
dump(
    "noise",
    t.strategy,
    covariance=(released @ released.T / released.shape[1]).tolist(),
    numel=released.shape[1],
    checksum=float(released.sum()),
)

_worker.finish_distributed()
