"""Training runs that get SIGKILLed on purpose; launched by tests/test_fault_injection.py as a script.

``fault_worker.py OUT write K``: one process, a checkpoint every 3 steps; the K-th checkpoint write
stops half-way (``OUT/writing`` appears) so the test can SIGKILL the process mid-write.
``fault_worker.py OUT ddp_kill K``: 2-process DDP, a checkpoint every 2 steps; rank 1 SIGKILLs itself
in the middle of step K (after its forward pass, before the gradients are all-reduced).
``fault_worker.py OUT ddp_resume``: 2-process DDP resuming from the newest complete checkpoint;
each rank writes ``OUT/resume.rank<r>.json`` with the ledger and the global step at load and at the end.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
import types

import _worker
import torch
from conftest import TinyModule
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dp.run.checkpointing
from lightning_dp import DPDDPStrategy, DPStrategy

OUT, ARGS = _worker.start()
MODE = ARGS[0]
SIGMA, MAX_STEPS = 1.0, 16


class KillMidStep(TinyModule):
    """Rank 1 dies by SIGKILL inside training step ``kill_step`` (0-based global step)."""

    kill_step = -1

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.trainer.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss


class Record(Callback):
    """Ledger and loop counters at train start (right after the checkpoint is restored) and at the end."""

    def on_train_start(self, trainer, pl_module):
        self.start = dict(
            steps=trainer.strategy.engine.steps,
            global_step=trainer.global_step,
            epsilon=trainer.strategy.epsilon,
        )

    def on_train_end(self, trainer, pl_module):
        record = dict(
            start=self.start,
            steps=trainer.strategy.engine.steps,
            global_step=trainer.global_step,
            epsilon=trainer.strategy.epsilon,
            rank=trainer.global_rank,
        )
        (OUT / f"resume.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def hang_in_write(at: int) -> None:
    """The ``at``-th checkpoint write stops after half its bytes and waits to be killed."""
    real_save, count = torch.save, [0]

    def save(obj, f):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        count[0] += 1
        if count[0] == at:
            f.write(data[: len(data) // 2])
            f.flush()
            (OUT / "writing").write_text(str(os.getpid()))
            time.sleep(300)
        f.write(data)

    lightning_dp.run.checkpointing.torch = types.SimpleNamespace(save=save)  # type: ignore[attr-defined]


def trainer(strategy, every: int, devices: int, **kwargs) -> Trainer:
    checkpoint = ModelCheckpoint(
        dirpath=OUT / "ckpt", every_n_train_steps=every, save_top_k=-1, filename="{step}"
    )
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[checkpoint, *kwargs.pop("callbacks", [])],
        default_root_dir=str(OUT),
        **kwargs,
    )


if MODE == "write":
    hang_in_write(int(ARGS[1]))
    trainer(DPStrategy(noise_multiplier=SIGMA, seed=0), every=3, devices=1).fit(
        TinyModule(n=128, batch_size=16)
    )
elif MODE == "ddp_kill":
    module = KillMidStep(n=128, batch_size=16)
    module.kill_step = int(ARGS[1])
    trainer(DPDDPStrategy(noise_multiplier=SIGMA, seed=0), every=2, devices=2).fit(module)
elif MODE == "ddp_resume":
    from lightning_dp.run.checkpointing import latest_valid_checkpoint

    path = latest_valid_checkpoint(OUT / "ckpt")
    t = trainer(DPDDPStrategy(noise_multiplier=SIGMA, seed=0), every=2, devices=2, callbacks=[Record()])
    t.fit(TinyModule(n=128, batch_size=16), ckpt_path=path)
    _worker.finish_distributed()
