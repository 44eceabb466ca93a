"""Fault injection: SIGKILL mid-checkpoint-write and mid-step (one DDP rank), then resume.

Invariants after every resume: ε never decreases, the ledger's step count equals the global step
(no step lost or counted twice), and a damaged checkpoint is refused with a clear message while the
previous complete one is found and used. Three subprocess launches in all (about 15 s each here).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _worker import launch, launch_ranks
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPConfigurationError, DPStrategy
from lightning_dp.accounting import PoissonGaussian, PrivacyLedger
from lightning_dp.checkpointing import (
    PARTIAL_SUFFIX,
    atomic_save,
    checkpoint_problem,
    latest_valid_checkpoint,
)

SIGMA, MAX_STEPS, N, BATCH = 1.0, 16, 128, 16  # as in fault_worker.py
# The kill points are random; a failure names the seed, and LDP_FAULT_SEED=<seed> replays it.
SEED = int(os.environ.get("LDP_FAULT_SEED", random.randrange(1 << 30)))


def exact_epsilon(steps: int) -> float:
    """ε of exactly ``steps`` steps of this run's mechanism (what the ledger must report)."""
    ledger = PrivacyLedger(delta=1e-5)
    ledger.record(PoissonGaussian(noise_multiplier=SIGMA, sample_rate=BATCH / N), count=steps)
    return float(ledger.epsilon())


def saved_state(path: str) -> dict:
    checkpoint = torch.load(path, weights_only=True)
    return {"global_step": checkpoint["global_step"], **checkpoint["lightning_dp"]}


class RecordStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.steps, self.global_step = trainer.strategy.engine.steps, trainer.global_step
        self.epsilon = trainer.strategy.epsilon


# -- in-process ------------------------------------------------------------------------------------
def test_interrupted_atomic_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_save({"step": 1}, path)

    def crash(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_dp.checkpointing.torch.save", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the partial file is cleaned up


def test_checkpoint_problem_names_truncation_and_bad_crc(tmp_path):
    good = tmp_path / "good.ckpt"
    atomic_save({"w": torch.arange(1000)}, good)
    data = good.read_bytes()
    (tmp_path / "half.ckpt").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    index = data.index(torch.arange(1000).numpy().tobytes()[8:16])
    flipped[index] ^= 0xFF
    (tmp_path / "crc.ckpt").write_bytes(bytes(flipped))
    assert checkpoint_problem(good) is None
    assert "truncated" in checkpoint_problem(tmp_path / "half.ckpt")
    assert "CRC" in checkpoint_problem(tmp_path / "crc.ckpt")
    assert checkpoint_problem(tmp_path / "missing.ckpt") == "the file does not exist"


# -- SIGKILL mid-checkpoint-write (one process), resume in-process -----------------------------------
@pytest.fixture(scope="module")
def killed_mid_write(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault_write")
    hang_at = random.Random(SEED).randint(2, 4)  # which checkpoint write is interrupted
    proc = launch("fault_worker.py", out, "write", str(hang_at))
    deadline = time.monotonic() + 300
    while not (out / "writing").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(
                f"worker ended before the injected write (seed {SEED}):\n{proc.communicate()[0][-3000:]}"
            )
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return out, hang_at


def test_kill_mid_write_leaves_only_complete_checkpoints(killed_mid_write):
    out, hang_at = killed_mid_write
    names = sorted(os.listdir(out / "ckpt"))
    print(f"seed {SEED}: killed during checkpoint write {hang_at}")
    complete = [n for n in names if n.endswith(".ckpt")]
    assert len(complete) == hang_at - 1, names
    assert all(checkpoint_problem(out / "ckpt" / n) is None for n in complete)
    assert len([n for n in names if n.endswith(PARTIAL_SUFFIX)]) == 1, names  # the write SIGKILL cut short


def test_resume_after_kill_mid_write_neither_loses_nor_double_counts(killed_mid_write, tmp_path):
    out, hang_at = killed_mid_write
    path = latest_valid_checkpoint(out / "ckpt")
    state = saved_state(path)
    assert state["steps"] == state["global_step"] == 3 * (hang_at - 1)
    record = RecordStart()
    strategy = DPStrategy(noise_multiplier=SIGMA, seed=0)
    trainer = make_trainer(strategy, tmp_path, max_steps=MAX_STEPS, max_epochs=-1, callbacks=[record])
    trainer.fit(TinyModule(n=N, batch_size=BATCH), ckpt_path=path)
    assert record.steps == record.global_step == state["global_step"]
    assert record.epsilon == pytest.approx(exact_epsilon(state["steps"]), rel=1e-9)
    assert strategy.engine.steps == trainer.global_step == MAX_STEPS
    assert strategy.epsilon == pytest.approx(exact_epsilon(MAX_STEPS), rel=1e-9)
    assert strategy.epsilon >= record.epsilon


def test_half_written_checkpoint_is_refused_and_the_previous_one_used(killed_mid_write, tmp_path):
    """What a non-atomic writer would leave: the cut-short bytes under a .ckpt name, newest of all."""
    out, hang_at = killed_mid_write
    folder = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", folder)
    partial = next(folder.glob(f"*{PARTIAL_SUFFIX}"))
    damaged = folder / f"step={3 * hang_at}.ckpt"
    partial.rename(damaged)
    os.utime(damaged, (time.time() + 10, time.time() + 10))
    trainer = make_trainer(
        DPStrategy(noise_multiplier=SIGMA, seed=0), tmp_path, max_steps=MAX_STEPS, max_epochs=-1
    )
    with pytest.raises(
        DPConfigurationError, match=r"is damaged: the file is truncated.*latest_valid_checkpoint"
    ):
        trainer.fit(TinyModule(n=N, batch_size=BATCH), ckpt_path=str(damaged))
    previous = latest_valid_checkpoint(folder)
    assert previous is not None
    assert Path(previous).name == f"step={3 * (hang_at - 1)}.ckpt"


def test_checkpoints_written_by_the_strategy_are_complete_at_every_save(tmp_path, monkeypatch):
    """Lightning's ModelCheckpoint goes through the strategy's atomic path (no temp file is left)."""
    written = []

    def counting_save(checkpoint, path):
        written.append(os.path.basename(path))
        atomic_save(checkpoint, path)

    monkeypatch.setattr("lightning_dp.strategies.base.atomic_save", counting_save)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    strategy = DPStrategy(noise_multiplier=SIGMA, seed=0)
    trainer = make_trainer(
        strategy, tmp_path, max_steps=6, max_epochs=-1, enable_checkpointing=True, callbacks=[checkpoint]
    )
    trainer.fit(TinyModule(n=N, batch_size=BATCH))
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == sorted(written)
    assert len(names) == 3
    for name in names:
        state = saved_state(str(tmp_path / "ckpt" / name))
        assert state["steps"] == state["global_step"]


# -- a full disk ---------------------------------------------------------------------------------------------
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:664] . unexpected pos 4224 vs 4118"


def test_full_disk_while_checkpointing_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(DPStrategy(noise_multiplier=SIGMA), tmp_path, max_steps=2)
    trainer.fit(TinyModule(n=N, batch_size=BATCH))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()

    def full(obj, f):
        f.write(b"PK\x03\x04 a first chunk")
        raise RuntimeError(TORCH_FULL_DISK)  # what torch.save raises when the disk fills mid-write

    monkeypatch.setattr("lightning_dp.checkpointing.torch.save", full)
    with pytest.raises(
        OSError, match=r"Writing the checkpoint .*last\.ckpt failed: the disk is full"
    ) as info:
        trainer.save_checkpoint(path)
    assert "the previous checkpoint there, if any, is intact and is NOT from this run" in str(info.value)
    assert path.read_bytes() == before
    assert not [name for name in os.listdir(tmp_path) if name.endswith(PARTIAL_SUFFIX)]


def test_full_disk_while_writing_the_report_says_so_and_leaves_no_temp_file(tmp_path, monkeypatch):
    make_trainer(DPStrategy(noise_multiplier=SIGMA), tmp_path, max_steps=1).fit(
        TinyModule(n=N, batch_size=BATCH)
    )
    report = tmp_path / "privacy_report.json"
    earlier = report.read_text()

    def enospc(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("lightning_dp.checkpointing.os.fsync", enospc)
    with pytest.raises(
        OSError, match=r"Writing the privacy report .*privacy_report\.json failed: the disk is full"
    ):
        make_trainer(DPStrategy(noise_multiplier=SIGMA), tmp_path, max_steps=2).fit(
            TinyModule(n=N, batch_size=BATCH)
        )
    assert report.read_text() == earlier  # untouched, and the error said it is not this run's
    assert sorted(os.listdir(tmp_path)) == ["privacy_curve.png", "privacy_report.json"]


# -- SIGKILL of one DDP rank mid-step, resume under 2-process DDP ------------------------------------------
def launch_ddp(out: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """Both ranks at once (Lightning sees LOCAL_RANK and does not spawn), so their imports overlap."""
    return launch_ranks("fault_worker.py", out, *args)


@pytest.fixture(scope="module")
def ddp_resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault_ddp")
    kill_step = random.Random(SEED + 1).randint(5, 11)
    killed = launch_ddp(out, "ddp_kill", str(kill_step))
    assert killed[1].returncode == -signal.SIGKILL, killed[1].stdout[-3000:]
    assert killed[0].returncode != 0, "rank 0 finished although rank 1 died"
    before = sorted(os.listdir(out / "ckpt"))
    resumed = launch_ddp(out, "ddp_resume")
    for rank in resumed:
        assert rank.returncode == 0, f"seed {SEED}:\n{rank.stdout[-4000:]}"
    records = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in (0, 1)]
    return kill_step, before, records


def test_ddp_rank_death_mid_step_resumes_without_losing_or_double_counting(ddp_resumed):
    kill_step, before, records = ddp_resumed
    print(f"seed {SEED}: rank 1 killed in step {kill_step}")
    last_complete = 2 * (kill_step // 2)  # checkpoints every 2 steps; step kill_step never finished
    assert before[-1] == f"step={last_complete}.ckpt" or f"step={last_complete}.ckpt" in before, before
    for record in records:
        start = record["start"]
        assert start["steps"] == start["global_step"] == last_complete
        assert start["epsilon"] == pytest.approx(exact_epsilon(last_complete), rel=1e-9)
        assert record["steps"] == record["global_step"] == MAX_STEPS
        assert record["epsilon"] == pytest.approx(exact_epsilon(MAX_STEPS), rel=1e-9)
        assert record["epsilon"] >= start["epsilon"]
