"""Fault injection: SIGKILL mid-checkpoint-write and mid-step (one DDP rank), interrupts at random moments
(in-process, as SIGINT lands), then resume.

Invariants after every resume: ε never decreases, the ledger's step count equals the global step
(no step lost or counted twice), and a damaged checkpoint is refused with a clear message while the
previous complete one is found and used. Three subprocess launches in all (about 15 s each here). An
interrupted run's own checkpoint resumes: an ``OnExceptionCheckpoint`` written at any line of a step (or of
a resume's set-up) keeps every release in ε and is accepted (issue #47).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _worker import launch, launch_ranks
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_dp import BandMF, CyclicPoisson, DPConfigurationError, DPStrategy
from lightning_dp.accounting import PoissonGaussian, PrivacyLedger
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.run.checkpointing import (
    PARTIAL_SUFFIX,
    atomic_save,
    checkpoint_problem,
    latest_valid_checkpoint,
)
from lightning_dp.slots.release import Releases
from lightning_dp.strategies import checkpoints

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

    monkeypatch.setattr("lightning_dp.run.checkpointing.torch.save", crash)
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

    monkeypatch.setattr("lightning_dp.run.checkpointing.torch.save", full)
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

    monkeypatch.setattr("lightning_dp.run.checkpointing.os.fsync", enospc)
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


# -- interrupts at random moments, in-process: every checkpoint the strategy wrote resumes ------------------
class Interrupt(Callback):
    """Raises ``KeyboardInterrupt`` between two Python lines, as a SIGINT does between two bytecodes.

    ``plan="step"``: the lines of training step ``step`` are counted, and a uniformly random one of the next
    step's (or of a later one, if it is shorter) interrupts. ``"call"``: the first line of the function whose
    code is ``at``, in step ``step``. ``"first"``: the ``at``-th line from
    ``on_train_start`` (the fit's first batch: its dry passes). ``"setup"``: the ``at``-th line counted from
    ``on_fit_start`` (a fresh fit) or from the strategy's ``load_checkpoint`` (a resume: the restore,
    Lightning's loops, the data, the checks' set-up). It also measures the set-up's lines (to
    ``on_train_start``) and the first batch's. Its counters live in a ``SimpleNamespace``, which the run-time
    checks' dry passes do not restore (they put back a callback's own attributes)."""

    LOAD = DPStrategy.load_checkpoint.__code__
    STDLIB = sysconfig.get_paths()["stdlib"]

    def __init__(self, rng: random.Random, plan: str | None, at: Any, step: int | None, fresh: bool) -> None:
        self.rng, self.plan, self.step, self.fresh = rng, plan, step, fresh
        self.state = types.SimpleNamespace(lines=0, left=None, at=at, mark=0, fired=False, saved=False)
        self.state.setup_lines = self.state.first_lines = self.state.first_step = None

    def _line(self, frame, event, arg):
        state = self.state
        if event == "line":
            state.lines += 1
            if state.left is not None:
                state.left -= 1
                # not inside the standard library (a lock half taken in threading is Python's own hazard)
                if state.left < 0 and not frame.f_code.co_filename.startswith(self.STDLIB):
                    sys.settrace(None)
                    state.left, state.fired = None, True
                    raise KeyboardInterrupt
        return self._line

    def _call(self, frame, event, arg):
        if frame.f_code is self.LOAD:  # a resume's set-up is counted from here
            self.state.mark = self.state.lines
            if self.plan == "setup":
                self.state.left = self.state.at
        elif self.plan == "call" and frame.f_code is self.state.at and self.state.mark is None:
            self.state.left = 0  # the first line of that call, in the step armed below
        return self._line

    def on_fit_start(self, trainer, pl_module):
        sys.settrace(self._call)
        frame = sys._getframe(1)
        while frame is not None:  # the frames already running (Lightning's loops) count their lines too
            frame.f_trace = self._line
            frame = frame.f_back
        if self.fresh and self.plan == "setup":
            self.state.left = self.state.at

    def on_train_start(self, trainer, pl_module):
        state = self.state
        state.setup_lines, state.mark, state.first_step = (
            state.lines - state.mark,
            state.lines,
            trainer.global_step,
        )
        if self.plan == "first":
            state.left = state.at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        state = self.state
        if trainer.global_step == state.first_step + 1 and state.first_lines is None:
            state.first_lines = state.lines - state.mark
        if self.plan == "call" and trainer.global_step == self.step:
            state.mark = None  # armed
        if self.plan == "step" and trainer.global_step == self.step:
            state.mark = state.lines
        elif self.plan == "step" and trainer.global_step == self.step + 1 and state.left is None:
            state.left = self.rng.randrange(max(state.lines - state.mark, 1))  # this step's, or a later one's

    def teardown(self, trainer, pl_module, stage):
        sys.settrace(None)


def _counting_releases(monkeypatch) -> types.SimpleNamespace:
    """Counts the gradient releases that began (their event is recorded before): the exact ε's steps."""
    count, real = types.SimpleNamespace(value=0), Releases.noisy

    def noisy(releases, *args, **kwargs):
        count.value += 1
        return real(releases, *args, **kwargs)

    monkeypatch.setattr(Releases, "noisy", noisy)
    return count


def _resume_check(path: Path, make_strategy) -> None:
    """What resuming from ``path`` checks, without a Trainer: the restore, then the events once bound."""
    strategy, counts = make_strategy(), checkpoints.StepCounts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoints.restore_dp_state(strategy.engine, torch.load(path, weights_only=True), path, 1, 0, counts)
    strategy.engine.sampler.bind(N, BATCH)
    checkpoints.check_resumed_data(strategy.engine, counts, public_changes=False)


INTERRUPTED_RUNS = {
    "DP-SGD": lambda: DPStrategy(noise_multiplier=SIGMA),
    "BandMF": lambda: DPStrategy(sampler=CyclicPoisson(2), noise=BandMF(noise_multiplier=SIGMA)),
}
CHAINS = [("DP-SGD", SEED + i) for i in range(4)] + [("BandMF", SEED + 4)]
INTERRUPTED_STEPS = 16
PLANS = {
    "DP-SGD": ("step", "first", "setup", "step", None),
    "BandMF": ("setup", "step", "setup", "first", None),
}
"""Each chain: a fit interrupted in a step (or its set-up), three resumes interrupted in a step, in their
first batch (its dry passes) or in their set-up, then a resume run to the end."""


class SavedOnException(OnExceptionCheckpoint):
    """``OnExceptionCheckpoint`` that notes (in the interrupt's state) that its checkpoint was written."""

    def __init__(self, dirpath: Path, state: types.SimpleNamespace) -> None:
        super().__init__(dirpath)
        self.state = state

    def on_exception(self, trainer, *args, **kwargs):
        super().on_exception(trainer, *args, **kwargs)
        self.state.saved = True


class Started(Callback):
    def on_train_start(self, trainer, pl_module):
        self.epsilon, self.events = trainer.strategy.epsilon, trainer.strategy.ledger.steps


def _segment(
    name: str, root: Path, plan: str | None, rng: random.Random, lines: dict, releases, call: Any = None
) -> dict:
    """One fit of a chain, interrupted as ``plan`` says (``lines``: the set-ups' and first batches' lines as
    first measured; ``call``: (code, step) for ``plan="call"``); what it did and what it wrote."""
    resume = root / "on_exception.ckpt" if (root / "on_exception.ckpt").exists() else None
    start = int(torch.load(resume, weights_only=True)["global_step"]) if resume else 0
    if (plan == "step" and start + 1 > INTERRUPTED_STEPS - 2) or (
        plan == "first" and start >= INTERRUPTED_STEPS
    ):
        plan = None  # no step left to count and then interrupt
    kind = {"setup": "resume" if resume else "fresh", "first": "first"}.get(plan or "")
    at = rng.randrange(lines[kind]) if kind in lines else None
    plan = None if kind and at is None else plan  # nothing measured yet: run on
    step = rng.randint(start + 1, min(start + 4, INTERRUPTED_STEPS - 2)) if plan == "step" else None
    if plan == "call":
        at, step = call
    interrupt = Interrupt(rng, plan, at, step, fresh=resume is None)
    started, strategy = Started(), INTERRUPTED_RUNS[name]()
    trainer = make_trainer(
        strategy, root, max_steps=INTERRUPTED_STEPS, max_epochs=-1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1),
                   SavedOnException(root, interrupt.state), interrupt, started],
    )  # fmt: skip
    before = releases.value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TinyModule(n=N, batch_size=BATCH), ckpt_path=resume)
        except SystemExit:  # Lightning's answer to a KeyboardInterrupt, after on_exception has saved
            pass
        except Exception:  # Lightning's own teardown may fail after an interrupt in its data set-up
            if not (interrupt.state.fired and interrupt.state.saved):
                raise
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT once hit
    interrupted = interrupt.state.fired and interrupt.state.saved  # (a finalizer may swallow an interrupt)
    if interrupted:  # kept for the check of every checkpoint written
        (root / "ckpt").mkdir(exist_ok=True)
        shutil.copy(
            root / "on_exception.ckpt", root / "ckpt" / f"on_exception_{len(os.listdir(root / 'ckpt'))}.ckpt"
        )
    measured = {
        "resume" if resume else "fresh": interrupt.state.setup_lines,
        "first": interrupt.state.first_lines,
    }
    lines.update({k: v for k, v in measured.items() if v and k not in lines})
    return dict(
        plan=plan, interrupted=interrupted, released_before=before, released=releases.value,
        started=hasattr(started, "epsilon"), start_epsilon=getattr(started, "epsilon", None),
        start_events=getattr(started, "events", None),
        in_flight=any("written in the middle of a training step" in str(w.message) for w in caught),
        steps=strategy.engine.steps, global_step=trainer.global_step, epsilon=strategy.epsilon,
        events=strategy.ledger.steps, counts=strategy.step_counts.state_dict(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def interrupted_chains(tmp_path_factory):
    chains, lines = [], {}  # lines of a fresh fit's and of a resume's set-up, and of a first batch
    with pytest.MonkeyPatch.context() as patch:
        releases = _counting_releases(patch)
        for name, seed in CHAINS:
            releases.value, rng = 0, random.Random(seed)
            root = tmp_path_factory.mktemp(f"interrupted_{name}")
            segments: list[dict] = []
            for plan in PLANS[name]:
                segments.append(_segment(name, root, plan, rng, lines, releases))
                if not segments[-1]["interrupted"]:
                    break
            chains.append((name, seed, root, segments))
    return chains


def test_an_interrupted_runs_own_checkpoints_resume_and_keep_every_release(interrupted_chains):
    """Issue #47: an ``OnExceptionCheckpoint`` written at a random line of a step or of a resume's set-up (an
    event recorded for a step that did not finish, the step's release not yet counted by the loop, a slot
    a step ahead) resumes, says so when it was written inside a step, and ε never falls below the exact ε of
    the releases made; at the end the counts agree again."""
    for name, seed, root, segments in interrupted_chains:
        where = f"{name}, seed {seed} (LDP_FAULT_SEED={seed - CHAINS.index((name, seed))}): {segments}"
        assert [s["interrupted"] for s in segments] == [True] * (len(segments) - 1) + [False], where
        final = segments[-1]
        assert final["global_step"] == INTERRUPTED_STEPS, where
        counts = final["counts"]
        assert final["steps"] - counts["steps_outside_loop"] + counts["silent_steps"] == INTERRUPTED_STEPS, (
            where
        )
        in_flight = [s["in_flight"] for s in segments]  # a resume interrupted in its set-up may repeat one
        carried = sum(f for f, s in zip(in_flight, segments, strict=True) if s["started"])
        assert carried <= counts["interrupted_steps"], where
        assert counts["interrupted_steps"] <= sum(in_flight), where
        for earlier, later in itertools.pairwise(segments):
            if later["started"]:  # ε where the resumed fit starts: every release made so far, and at most
                assert later["start_events"] >= earlier["events"], where  # one event more per interrupt
                if name == "DP-SGD":
                    assert later["start_epsilon"] >= exact_epsilon(later["released_before"]) * (1 - 1e-12), (
                        where
                    )
                    assert later["start_events"] <= later["released_before"] + len(segments), where
        if name == "DP-SGD":
            assert final["epsilon"] >= exact_epsilon(final["released"]) * (1 - 1e-12), where
            assert final["events"] <= final["released"] + len(segments) - 1, where
        else:  # BandMF: one event per round of 2 steps, rounds paid again when a resume repeats their start
            assert final["events"] >= -(-final["steps"] // 2), where
        for path in sorted((root / "ckpt").glob("*.ckpt")):  # every checkpoint the chain wrote
            _resume_check(path, INTERRUPTED_RUNS[name])


def test_the_interrupts_landed_inside_steps_first_batches_and_set_ups(interrupted_chains):
    """The chains above exercised what they claim: checkpoints written inside a step (the resume says so),
    interrupts in a fit's first batch, and in a fresh fit's and a resume's set-up (then the checkpoint is
    the one being restored)."""
    segments = [s for _, _, _, chain in interrupted_chains for s in chain]
    assert sum(s["in_flight"] for s in segments) >= 2
    interrupted = {s["plan"] for s in segments if s["interrupted"]}
    assert {"step", "first", "setup"} <= interrupted, interrupted
    assert any(s["plan"] == "setup" and s["interrupted"] and not s["started"] for s in segments)


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("DP-SGD", Releases.noisy),  # the event recorded, the noise not yet added: one event more than steps
        ("DP-SGD", PrivateStepEngine.apply_step),  # released, the update not applied: a step the loop missed
        ("BandMF", Releases.noisy),  # CyclicPoisson counted the step before the release: drawn again for it
    ],
    ids=["event-recorded", "released-not-applied", "cyclic-step-counted"],
)
def test_a_checkpoint_written_inside_the_release_resumes_and_counts_the_release_once(name, where, tmp_path):
    """The race of issue #47, made certain: ``OnExceptionCheckpoint`` written at the first line of a call
    inside step 3's release. The resume warns, keeps the recorded event, and the counts agree at the end."""
    with pytest.MonkeyPatch.context() as patch:
        releases = _counting_releases(patch)
        first = _segment(name, tmp_path, "call", random.Random(0), {}, releases, call=(where.__code__, 3))
        last = _segment(name, tmp_path, None, random.Random(0), {}, releases)
    assert first["interrupted"], first
    assert first["global_step"] == 3, first
    assert last["in_flight"], last
    counts = last["counts"]
    assert last["global_step"] == INTERRUPTED_STEPS
    assert last["steps"] - counts["steps_outside_loop"] + counts["silent_steps"] == INTERRUPTED_STEPS
    assert counts["interrupted_steps"] == 1
    if name == "DP-SGD":
        assert last["events"] == last["released"]  # every release began with its event, and nothing else
        assert last["epsilon"] >= exact_epsilon(last["released"]) * (1 - 1e-12)
        assert last["released"] == INTERRUPTED_STEPS + 1  # the interrupted release began; its step ran again
    for path in sorted((tmp_path / "ckpt").glob("*.ckpt")):  # the on-exception one (a copy) and the others
        _resume_check(path, INTERRUPTED_RUNS[name])
