"""Issues #35 and #47: nothing an unseeded run writes or pickles lets anyone regenerate its noise or its
batches, read the noise it added, or read a private statistic; a seeded run says so and still resumes bit
for bit.

Every mechanism's slots run once through the Trainer with a ModelCheckpoint, ``trainer.save_checkpoint``, a
CSV logger, saved hyperparameters and the privacy report, and every object the library built is pickled
before, during and after the fit; ``tests/secret_scan.py`` then opens every file under the run's folder and
every pickle, plus the log lines, warnings and a refusal's message. The DDP run is in tests/test_ddp.py (it
reuses that file's two-process launch).
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from secret_scan import (
    CPU_STATE_BYTES,
    NoiseRecord,
    Secrets,
    UrandomDraws,
    scan_files,
    scan_pickle,
    search_text,
    walk,
    walk_objects,
)

from lightning_dp import (
    BLT,
    DPIS,
    AdaCliP,
    AdaptiveGD,
    AutoClipping,
    BandMF,
    ConstantNoise,
    CyclicPoisson,
    DPConfigurationError,
    DPStrategy,
    FlatClipping,
    HeavyBall,
    LineSearch,
    Nesterov,
    NoiseDividing,
    PrivacyCallback,
    QuantileClipping,
    checking,
)
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.noise.correlated import CorrelatedNoise
from lightning_dp.slots.release import Releases

N, BATCH = 211, 40  # N prime and unlike any layer size: a dimension of length N is one value per example

MECHANISMS: dict[str, Callable[[], dict[str, Any]]] = {
    "DP-SGD": lambda: {},
    "DPIS": lambda: {"sampler": DPIS(k=2)},
    "AdaCliP": lambda: {"clipping": AdaCliP(h2=1e-2)},
    "LineSearch": lambda: {"step": LineSearch()},
    "AdaptiveGD": lambda: {"step": AdaptiveGD()},
    "HeavyBall": lambda: {"step": HeavyBall(beta=0.9)},
    "Nesterov+NoiseDividing": lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing()},
    "CyclicPoisson+BandMF": lambda: {"sampler": CyclicPoisson(2), "noise": BandMF()},
    "CyclicPoisson+BLT": lambda: {"sampler": CyclicPoisson("auto"), "noise": BLT()},
    "UserPoisson": lambda: {
        "privacy_unit": "user",
        "user_key": _user_of,
        "examples_per_user": 2,
        "users_per_step": 10,
    },
    "augmentation multiplicity": lambda: {"augmentation_multiplicity": 2, "max_physical_batch_size": 64},
    "QuantileClipping": lambda: {"clipping": QuantileClipping()},
    "AutoClipping": lambda: {"clipping": AutoClipping()},
}


def _user_of(index: int) -> int:
    """Three consecutive examples per user (a function of the index: any N has users)."""
    return index // 3


class Logged(TinyModule):
    """TinyModule that saves its hyperparameters (hparams.yaml) and logs its loss (metrics.csv)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def dp_per_sample_loss(self, batch: Any) -> torch.Tensor:
        """The per-example losses the line search and DP-AGD evaluate at candidate weights."""
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, reduction="none")


def _fit(
    strategy: DPStrategy, root, *, max_steps: int, ckpt_path=None, module=None, callbacks=()
) -> tuple[Any, Logged]:
    module = module if module is not None else Logged(n=N, batch_size=BATCH)
    trainer = make_trainer(
        strategy,
        root,
        max_steps=max_steps,
        max_epochs=5,
        logger=CSVLogger(root),
        enable_checkpointing=True,
        callbacks=[
            ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1),
            PrivacyCallback(),
            *callbacks,
        ],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_an_unseeded_runs_files_pickles_logs_and_messages_hold_no_seed_no_generator_state_no_noise(
    mechanism, tmp_path, monkeypatch, caplog
):
    """Also no private statistic in the files. The pickles (issue #47): the slots, the engine, the strategy
    and the loader, as a spawn launcher, a ``torch.save`` or a cache writes them, before the fit, after its
    second step, inside the third (released, not yet applied) and after the fit, hold neither the correlated
    noise's history, nor the noise drawn ahead for the next release, nor a step's clipped sums, nor a
    generator's state; files and pickles are walked for the noise every release
    of the run added (``NoiseRecord``), not only for seeds and generator states."""
    draws = UrandomDraws()
    monkeypatch.setattr(os, "urandom", draws)  # every seed an unseeded stream draws passes through here
    noise = NoiseRecord()
    noise.install(monkeypatch)
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy, mid_run = DPStrategy(target_epsilon=3.0, **MECHANISMS[mechanism]()), PickleAt(step=2)
        pickles = {"strategy (before fit)": pickle.dumps(strategy), **mid_run.pickles}
        trainer, module = _fit(strategy, root, max_steps=4, callbacks=[mid_run])
        pickles.update({**mid_run.pickles, **_pickles(trainer, "after fit")})
        trainer.save_checkpoint(root / "saved.ckpt")
        # resuming works without the states (fresh streams; DPIS recomputes its envelopes) and writes more files
        step2 = next((root / "checkpoints").glob("*step=2.ckpt"))
        resumed, _ = _fit(
            DPStrategy(target_epsilon=3.0, **MECHANISMS[mechanism]()), root, max_steps=4, ckpt_path=step2
        )
        assert resumed.strategy.engine.steps == 4
        refusal = ""
        try:  # a refusal's message is scanned too
            _fit(DPStrategy(target_epsilon=3.0, **MECHANISMS[mechanism]()), root, max_steps=5,
                 ckpt_path=root / "saved.ckpt", module=Logged(n=N - 11, batch_size=BATCH))  # fmt: skip
        except DPConfigurationError as err:
            refusal = str(err)
    units = 71 if mechanism == "UserPoisson" else N  # the ledger's unit: 211 examples or 71 users
    assert (f"U={units} users" if mechanism == "UserPoisson" else f"N={units}") in refusal
    assert not [w for w in caught if "this run is seeded" in str(w.message)]
    assert draws.draws, "the run drew no os.urandom seed: the scan would prove nothing"

    public = {N, BATCH, 2, 4, units}
    secrets = Secrets(draws, N, realised_sizes=module.seen_batch_sizes, public_ints=public, noise=noise)
    found, files = scan_files(root, secrets)
    if units != N:  # a per-user array (which users a step drew) is as private as a per-example one
        per_user = Secrets(
            draws, units, realised_sizes=module.seen_batch_sizes, public_ints={N, BATCH, 2, 4, units}
        )
        found += scan_files(root, per_user)[0]
    names = {p.name for p in files}
    assert {"saved.ckpt", "privacy_report.json", "privacy_curve.png", "hparams.yaml"} <= names
    assert len([p for p in files if p.suffix == ".ckpt"]) >= 3
    said = "\n".join([*(r.getMessage() for r in caplog.records), *(str(w.message) for w in caught), refusal])
    found += [f"log/warning/message: {what}" for what in search_text(said, secrets)]
    assert len(pickles) >= (10 if isinstance(strategy.engine.sampler, DPIS) else 22), sorted(pickles)
    assert noise.count >= 6  # the releases of steps 3 and 4 came after the mid-run pickles
    found += [line for name, data in pickles.items() for line in scan_pickle(data, secrets, name)]
    assert not found, "\n".join(found)
    copy = pickle.loads(pickles["noise (after step 2)"])
    assert type(copy) is type(strategy.engine.noise)  # it loads again
    if isinstance(copy, CorrelatedNoise):  # a copy restarts the recursion, as a resume does
        assert (copy.buffers, copy.local_step, copy.resets) == (None, 0, [2])


def test_the_scan_finds_what_it_looks_for():
    """The scanner itself: a generator state, a seed's bytes and value, a per-example vector, the realised sizes."""
    draws = UrandomDraws()
    seed_bytes = draws(8)
    secrets = Secrets(draws, N, realised_sizes=[37, 41, 39], public_ints={N})
    leaky = {
        "state": torch.Generator().get_state(),
        "seed": int.from_bytes(seed_bytes, "little") & ((1 << 63) - 1),
        "raw": torch.frombuffer(bytearray(b"xx" + seed_bytes), dtype=torch.uint8),
        "norms": torch.rand(N, dtype=torch.float64),
        "sizes": [37, 41, 39],
        "sampled": 117,
    }
    found: list[str] = []
    walk(leaky, secrets, "ckpt", found, private_counts=True)
    for key in leaky:
        assert any(f"ckpt.{key}" in line for line in found), (key, found)
    assert search_text(f"seed={leaky['seed']}", secrets)


def test_a_seeded_run_warns_keeps_its_states_and_resumes_bit_for_bit(tmp_path):
    def run(max_steps: int, ckpt_path=None) -> tuple[Any, TinyModule]:
        module = TinyModule(n=N, batch_size=BATCH)
        torch.manual_seed(0)
        module.net.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        trainer = make_trainer(
            DPStrategy(noise_multiplier=1.0, seed=5), tmp_path, max_steps=max_steps, max_epochs=5
        )
        with pytest.warns(UserWarning, match="this run is seeded") as caught:
            trainer.fit(module, ckpt_path=ckpt_path)
        assert len([w for w in caught if "this run is seeded" in str(w.message)]) == 1
        return trainer, module

    first, _ = run(2)
    first.save_checkpoint(tmp_path / "seeded.ckpt")
    saved = torch.load(tmp_path / "seeded.ckpt", weights_only=True)["lightning_dp"]
    assert saved["noise_generator"].numel() == CPU_STATE_BYTES  # kept: the seed makes the run repeatable
    assert saved["slots"]["sampler"]["state"]["generator"].numel() == CPU_STATE_BYTES
    _, resumed = run(4, ckpt_path=tmp_path / "seeded.ckpt")
    _, straight = run(4)
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)


def test_unseeded_dpis_saves_no_envelope_and_its_resume_recomputes_them_releasing_nothing():
    """DPIS's ghat/gstar are un-noised per-example norms: out of an unseeded state; one norm pass rebuilds them."""
    from tests.sampling.test_dpis import _harness, _run_steps

    grads = torch.randn(100, 3, generator=torch.Generator().manual_seed(3))
    sampler, ledger = _harness(grads, b=5, k=3, seed=None)
    steps = _run_steps(sampler, grads, 8)
    for _ in range(3):
        next(steps)
    state = sampler.state_dict()
    assert not {"ghat", "gstar"} & set(state)
    assert state["generators"] == {}
    released = len(ledger)
    fresh, fresh_ledger = _harness(grads, b=5, k=3, seed=None)
    fresh.load_state_dict(state)
    fresh.bind(100, 5)
    fresh.attach_runtime(sampler.runtime)
    batches = iter(fresh.batch_sampler(8))
    next(batches)  # the resumed epoch's first draw: the envelopes are rebuilt from the norms at these weights
    clip = fresh.current.clip
    norms = grads.norm(dim=1).double()
    torch.testing.assert_close(fresh.ghat, 3 * norms.clamp(max=clip).clamp(min=fresh.g_L * clip))
    assert len(list(batches)) == 4  # the epoch continues after the 3 steps taken (8 in all)
    assert len(fresh_ledger) == 0  # nothing released for it
    assert len(ledger) == released


def test_a_lightning_cli_runs_config_yaml_checkpoints_and_logs_hold_no_seed(
    tmp_path, monkeypatch, caplog, capsys
):
    """`lightning-dp fit`: the saved config.yaml, hparams.yaml, checkpoints and report of an unseeded run."""
    import json

    from lightning_dp.commands.cli import main

    draws = UrandomDraws()
    monkeypatch.setattr(os, "urandom", draws)
    caplog.set_level(logging.INFO)
    config = tmp_path / "run.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  max_steps: 3
  default_root_dir: {tmp_path / "cli"}
  enable_progress_bar: false
  strategy:
    class_path: lightning_dp.DPStrategy
    init_args:
      target_epsilon: 3.0
model:
  class_path: recipes.ImageClassifier
  init_args:
    arch: logreg
    in_features: 64
data:
  class_path: recipes.DigitsDataModule
  init_args:
    batch_size: 128
    flatten: true
"""
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["fit", "--config", str(config)])
    assert draws.draws, "the run drew no os.urandom seed: the scan would prove nothing"
    reports = list((tmp_path / "cli").rglob("privacy_report.json"))
    assert len(reports) == 1
    n = json.loads(reports[0].read_text())["dataset_size"]
    found, files = scan_files(tmp_path / "cli", Secrets(draws, n, public_ints={n, 128, 3}))
    assert {"config.yaml", "hparams.yaml"} <= {p.name for p in files}
    assert any(p.suffix == ".ckpt" for p in files)
    said = "\n".join([*(r.getMessage() for r in caplog.records), capsys.readouterr().out])
    found += [f"log/stdout: {what}" for what in search_text(said, Secrets(draws, n))]
    assert not found, "\n".join(found)


def test_an_unseeded_audit_writes_no_canary_draw(tmp_path, monkeypatch):
    """lightning_dp.audit: which canaries were included (its os.urandom streams) stays in the process."""
    from lightning_dp import audit

    draws = UrandomDraws()
    monkeypatch.setattr(os, "urandom", draws)
    root = tmp_path / "audit"
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0), root, max_steps=4, max_epochs=5, logger=CSVLogger(root),
        enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=root / "checkpoints"), PrivacyCallback()],
    )  # fmt: skip
    result = audit(trainer, Logged(n=N, batch_size=BATCH), num_canaries=64)
    trainer.save_checkpoint(root / "saved.ckpt")
    assert len(draws.draws) >= 4  # the canaries' streams, the sampler's and the noise's
    found, files = scan_files(root, Secrets(draws, N, public_ints={N, BATCH, 4, 64}))
    assert {"privacy_audit.png", "privacy_report.json", "saved.ckpt"} <= {p.name for p in files}
    found += [f"audit result: {what}" for what in search_text(repr(result.summary()), Secrets(draws, N))]
    assert not found, "\n".join(found)


class PickleAt(Callback):
    """Pickles what the library built once the given step has ended, and inside the next one once it has
    released (a user's ``torch.save`` in a callback)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.pickles: dict[str, bytes] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not checking():  # not in the run-time checks' dry passes
            self.pickles.update(_pickles(trainer, f"after step {self.step}"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step and not checking():  # inside the next step: released, not applied
            self.pickles.update(_pickles(trainer, f"inside step {self.step + 1}"))


def _pickles(trainer: Any, when: str) -> dict[str, bytes]:
    """Every object the library builds that a user, a launcher or a cache may pickle: the slots, the engine,
    the strategy and the private train loader. DPIS's sampler holds its norm pass's closures and does not
    pickle (nor does anything that holds it): then nothing is written."""
    engine = trainer.strategy.engine
    objects = {
        "sampler": engine.sampler, "noise": engine.noise, "clipping": engine.clipping, "step": engine.step_slot,
        "engine": engine, "strategy": trainer.strategy, "train_dataloader": trainer.train_dataloader,
    }  # fmt: skip
    out = {}
    for name, value in objects.items():
        try:
            out[f"{name} ({when})"] = pickle.dumps(value)
        except AttributeError:
            assert isinstance(engine.sampler, DPIS), name  # the only one that holds a local function
    return out


def test_the_scan_finds_noise_and_tells_it_from_released_values(monkeypatch):
    """The noise check itself: noise and a clipped sum are found, functions of the released values are not."""
    noise = NoiseRecord()
    noise.install(monkeypatch)
    g = torch.Generator().manual_seed(0)
    clipped = [torch.randn(200, 3, generator=g) for _ in range(4)]
    releases = Releases(PrivacyLedger(1e-5), target_epsilon=None, noise=ConstantNoise(1.0),
                        clipping=FlatClipping(), gradient_name="test")  # fmt: skip
    released = [releases.noisy([c.clone()], 2.0, g)[0] for c in clipped]
    added = [r - c for r, c in zip(released, clipped, strict=True)]
    secrets = Secrets(UrandomDraws(), N, noise=noise)
    momentum = sum(0.9**i * r for i, r in enumerate(released))
    leaky = {"buffer": torch.stack(added[:2]), "clipped": clipped[3], "noise": 0.5 * added[1] - added[2]}
    kept = {"momentum": momentum, "grad": released[3] / 40, "weights": torch.randn(200, 3, generator=g)}
    found = walk_objects(leaky, secrets, "leaky")
    assert all(any(f"leaky{key}" in line for line in found) for key in leaky), found
    assert walk_objects(kept, secrets, "kept") == []
