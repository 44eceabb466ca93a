"""LineSearch under 2-process CPU DDP (gloo); launched by tests/steps/test_line_search.py as a script.

Near-noiseless budgets (σ = 1e-8, so the SVT is an exact Armijo test) and q = 1, so the run must match a
single-process run; each rank writes its final weights and search statistics to ``OUT``.
"""

from __future__ import annotations

import json

import _worker
import torch
from conftest import TinyModule
from lightning.pytorch import Trainer

from lightning_dp import DPDDPStrategy, DPStrategy, LineSearch

OUT, ARGS = _worker.start()
DEVICES = int(ARGS[0]) if ARGS else 2


class LossModule(TinyModule):
    def dp_per_sample_loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, reduction="none")

    def training_step(self, batch, batch_idx):
        return self.dp_per_sample_loss(batch).mean()


torch.manual_seed(0)
module = LossModule(n=64, batch_size=64)  # q = 1: every batch is the whole data set
step = LineSearch(mode="nn", seed=0, loss_clip=1e3, armijo=0.1, eta0=4.0)
options = dict(noise_multiplier=1e-8, max_grad_norm=100.0, seed=0, step=step)
strategy = DPDDPStrategy(**options) if DEVICES > 1 else DPStrategy(**options)
trainer = Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=DEVICES,
    max_epochs=4,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    default_root_dir=str(OUT),
)
trainer.fit(module)
rank = trainer.global_rank
torch.save(module.state_dict(), OUT / f"weights.{DEVICES}.rank{rank}.pt")
(OUT / f"stats.{DEVICES}.rank{rank}.json").write_text(
    json.dumps({"steps": strategy.engine.steps, **step.metrics()})
)

_worker.finish_distributed()
