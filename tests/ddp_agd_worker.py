"""AdaptiveGD (DP-AGD) under 2-process CPU DDP (gloo); launched by tests/steps/test_dp_agd.py as a script.

Each rank writes ``OUT/agd.rank<r>.json``: its final weights, the ledger and the step's counters.
"""

from __future__ import annotations

import json

import _worker
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import AdaptiveGD, DPDDPStrategy
from recipes.linear import LinearClassifier

OUT, _ = _worker.start()

g = torch.Generator().manual_seed(0)
x = torch.rand(400, 6, generator=g)
y = ((x - 0.5) @ torch.randn(6, generator=g) > 0).long()
module = LinearClassifier(6)
step = AdaptiveGD(splits=10)
strategy = DPDDPStrategy(step=step, target_epsilon=0.5, delta=1e-8, max_grad_norm=3.0, seed=0)
trainer = Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=2,
    max_epochs=-1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(OUT),
)
trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=len(y)))
record = {
    "weights": [float(v) for p in module.parameters() for v in p.detach().reshape(-1)],
    "rho_spent": strategy.ledger.rho_spent,
    "rho_total": step.rho_total,
    "epsilon": strategy.epsilon,
    "history": [[e.kind, n] for e, n in strategy.ledger.history],
    "iterations": step.iterations,
    "rejections": step.rejections,
    "noisy_min_calls": step.noisy_min_calls,
}
(OUT / f"agd.rank{strategy.global_rank}.json").write_text(json.dumps(record))

_worker.finish_distributed()
