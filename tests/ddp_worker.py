"""Runs DP scenarios under 2-process CPU DDP (gloo); launched by tests/test_ddp.py as a script.

Lightning's DDP launcher re-runs this script for rank 1, so every rank executes the same scenarios
in the same order. Each rank writes its results to ``OUT/<scenario>.rank<r>.json`` (and weights).
"""

from __future__ import annotations

import math

import _worker
import torch
from conftest import GradientRecorder, TinyModule, ZeroSignal
from lightning.pytorch import Trainer

from lightning_dp import DPDDPStrategy

OUT, _ = _worker.start()


def trainer(strategy: DPDDPStrategy, **kwargs) -> Trainer:
    return _worker.ddp_trainer(OUT, strategy, **kwargs)


def dump(name: str, strategy: DPDDPStrategy, **extra) -> None:
    _worker.dump(OUT, name, strategy, sample_rate=strategy.engine.sampler.sample_rate, **extra)


# 1. σ = 0, C = ∞, q = 1: two processes must give exactly single-process full-batch training.
torch.manual_seed(0)
module = TinyModule(n=64, batch_size=64)  # logical batch = the whole data set, q = 1
t = trainer(DPDDPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0), max_epochs=5)
t.fit(module)
if t.global_rank == 0:
    torch.save(module.state_dict(), OUT / "exact.pt")
dump("exact", t.strategy, batches=module.seen_batch_sizes)


# 2. Zero-signal loss: the private gradient is noise of std σC/B_global, added once in total.
recorder = GradientRecorder()
t = trainer(DPDDPStrategy(noise_multiplier=2.0, max_grad_norm=3.0), max_steps=3, callbacks=[recorder])
t.fit(ZeroSignal(n=400, d=50, hidden=100, classes=50, batch_size=40))
noise = torch.cat(recorder.grads)
dump("noise", t.strategy, std=float(noise.std()), numel=noise.numel(), checksum=float(noise.sum()))

# 3. Tiny q: most local batches are empty; every rank must take every step, with the same ε. The step logs
# with sync_dist=True (Lightning reduces at log time): a rank without data makes a placeholder call whose
# all-reduce meets the others' and counts for nothing (issue #48); a short timeout fails a hang fast.
from datetime import timedelta  # noqa: E402

from sync_logs import LoggedValues, SyncLogs  # noqa: E402

HANG = timedelta(seconds=60)


class LogsSynced(SyncLogs, TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log_synced(loss, len(batch[0]))
        return loss


module, logged = LogsSynced(n=200, batch_size=1), LoggedValues()  # per device: q = 2/200 over both ranks
strategy = DPDDPStrategy(noise_multiplier=1.0, per_device_batch_size=True, seed=3, timeout=HANG)
t = trainer(strategy, max_epochs=1, callbacks=[logged])
t.fit(module)
dump(
    "tiny_q",
    t.strategy,
    seen=len(module.seen_batch_sizes),
    weights=float(sum(p.sum() for p in module.parameters())),
    placeholders=t.strategy.placeholders.placeholders,
    **logged.record(module),
)

# 4. Virtual batching under DDP: σ = 0, C = 0.1, q = 1, chunks of 5 must equal unsplit single-process.
torch.manual_seed(0)
module = TinyModule(n=64, batch_size=64)
strategy = DPDDPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0, max_physical_batch_size=5)
t = trainer(strategy, max_epochs=3)
t.fit(module)
if t.global_rank == 0:
    torch.save(module.state_dict(), OUT / "virtual.pt")
dump("virtual", t.strategy, max_chunk=max(module.seen_batch_sizes))

# 5. bf16-mixed under DDP: every per-example contribution stays ≤ C.
from conftest import RecordingClipping  # noqa: E402

clipping = RecordingClipping()
module = TinyModule(n=128, batch_size=32)
module.x = module.x * 100
t = trainer(
    DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=0.05, clipping=clipping),
    max_epochs=1,
    precision="bf16-mixed",
)
t.fit(module)
dump(
    "bf16",
    t.strategy,
    max_contribution=clipping.max_contribution,
    dtypes=sorted(map(str, clipping.grad_dtypes)),
)

# 6. Checkpoint and resume under DDP: every rank continues its own streams; ε continues exactly.
import copy  # noqa: E402

torch.manual_seed(0)
first = TinyModule(n=128, batch_size=32)
straight = copy.deepcopy(first)
t = trainer(DPDDPStrategy(noise_multiplier=1.0, seed=7), max_epochs=1)
t.fit(first)
t.save_checkpoint(OUT / "ddp.ckpt")
resumed_module = TinyModule(n=128, batch_size=32)
resumed = trainer(DPDDPStrategy(noise_multiplier=1.0, seed=7), max_epochs=2)
resumed.fit(resumed_module, ckpt_path=OUT / "ddp.ckpt")
trainer(DPDDPStrategy(noise_multiplier=1.0, seed=7), max_epochs=2).fit(straight)
same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed_module.parameters()))
dump("resume", resumed.strategy, same_as_straight=same)

# 7. AdaCliP under DDP: σ = 0, q = 1; the inverse transform and the (m, s) update run after the all-reduce,
# so both ranks hold the same statistics and training equals the single-process run.
from lightning_dp import AdaCliP  # noqa: E402

torch.manual_seed(0)
module = TinyModule(n=64, batch_size=64)
adaclip = AdaCliP(h2=1.0)
t = trainer(DPDDPStrategy(noise_multiplier=0.0, clipping=adaclip, seed=0), max_epochs=3)
t.fit(module)
if t.global_rank == 0:
    torch.save({"model": module.state_dict(), "m": adaclip.m, "s": adaclip.s}, OUT / "adaclip.pt")
dump("adaclip", t.strategy, s_sum=float(sum(s.double().sum() for s in adaclip.s)))

# 8. DPIS under DDP: each rank samples and accepts its share; N~ and K~ are one release (all-reduced).
from dataclasses import asdict  # noqa: E402

from lightning_dp import DPIS  # noqa: E402

torch.manual_seed(0)
t = trainer(
    DPDDPStrategy(
        target_epsilon=1.0, max_grad_norm=0.5, sampler=DPIS(k=3, seed=3, sigma_N=50, sigma_K=50), seed=0
    ),
    max_epochs=2,
)
t.fit(TinyModule(n=256, batch_size=16))
dump(
    "dpis",
    t.strategy,
    epochs=[asdict(e) for e in t.strategy.engine.sampler.epochs],
    history=[[e.to_dict(), c] for e, c in t.strategy.engine.ledger.history],
    share=len(t.strategy.engine.sampler.share),
)


# 9. Ranks whose data sets differ in size: each would bind its own N (and q); refused on every rank.
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dp import DPConfigurationError  # noqa: E402


class UnequalShards(TinyModule):
    def train_dataloader(self):
        n = 64 if self.trainer.global_rank == 0 else 32
        return DataLoader(TensorDataset(self.x[:n], self.y[:n]), batch_size=8)


t = trainer(DPDDPStrategy(target_epsilon=2.0), max_epochs=1)
try:
    t.fit(UnequalShards(n=64))
    refusal = ""
except DPConfigurationError as err:
    refusal = str(err)
dump("unequal", t.strategy, refusal=refusal)


# 10. Mixing on one rank only: the check refuses there, and every rank stops before the release (none may
# wait in the all-reduce of a step the other rank refused).
class MixesOnRankOne(TinyModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_rank == 1:
            x = x - x.mean(0)  # a batch statistic
        return torch.nn.functional.cross_entropy(self(x), y)


t = trainer(DPDDPStrategy(noise_multiplier=1.0, seed=0), max_epochs=1)
try:
    t.fit(MixesOnRankOne(n=64, batch_size=32))
    refusal = ""
except DPConfigurationError as err:
    refusal = str(err)
dump("mixing_one_rank", t.strategy, refusal=refusal)


# 11. Secrets (issue #35): unseeded DP-SGD and DPIS runs write checkpoints (ModelCheckpoint and save_checkpoint),
# a CSV log and the report under OUT/secrets; every os.urandom draw of each rank is dumped for tests/test_secrets.py's
# scan (tests/test_ddp.py runs it).
import os  # noqa: E402

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from secret_scan import UrandomDraws  # noqa: E402

draws = UrandomDraws()
os.urandom = draws
for name, slots in (("dpsgd", {}), ("dpis", {"sampler": DPIS(k=2)})):
    root = OUT / "secrets" / name
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    t = trainer(
        DPDDPStrategy(target_epsilon=3.0, **slots), max_steps=4, max_epochs=5, logger=CSVLogger(root),
        enable_checkpointing=True, callbacks=[checkpoints],
    )  # fmt: skip
    t.fit(TinyModule(n=211, batch_size=40))
    t.save_checkpoint(root / "saved.ckpt")
os.urandom = draws.real
dump("secrets", t.strategy, draws=[d.hex() for d in draws.draws])

# 12. User-level DP (issue #38, spec §5.7 test 7): users sharded by rank. Each rank's draws (empty ones too), the
# rows its training_step saw, U, q, σ and ε; rank 0 saves the weights of the σ = 0 runs (one process repeats them).
from user_runs import RUNS, UserRows, batch_size, record_draws  # noqa: E402

for name, (args, fit) in RUNS.items():
    torch.manual_seed(0)
    module = UserRows(batch_size(name))
    strategy = DPDDPStrategy(**args)
    drawn = record_draws(strategy.engine.sampler)
    t = trainer(strategy, **fit)
    t.fit(module)
    if t.global_rank == 0:
        torch.save(module.state_dict(), OUT / f"users_{name}.pt")
    dump(
        f"users_{name}", t.strategy, draws=drawn, rows=module.rows, num_units=t.strategy.engine.sampler.num_samples,
        sigma=t.strategy.engine.noise_multiplier(),
    )  # fmt: skip

# 13. Secure noise (issue #50): at σ = 0 the int64 sums of the two ranks add up to the single-process
# integers exactly; at σ = 2 each rank adds a discrete Gaussian share of σΔ/√2, the sum's std is σΔ.
from lightning_dp.slots.release import ReleaseHook  # noqa: E402


class Released(ReleaseHook):
    """Keeps every released (all-reduced) integer sum, before finalize."""

    def __init__(self) -> None:
        self.noisy: list[torch.Tensor] = []

    def after_release(self, noisy: list[torch.Tensor], ctx) -> list[torch.Tensor]:
        self.noisy.append(torch.cat([s.reshape(-1) for s in noisy]).clone())
        return noisy


for name, sigma in (("secure_exact", 0.0), ("secure_noise", 2.0)):
    torch.manual_seed(0)
    strategy = DPDDPStrategy(noise_multiplier=sigma, max_grad_norm=0.1, seed=0, secure=True)
    released = Released()
    strategy.engine.release_hooks.append(released)
    t = trainer(strategy, max_steps=1 if sigma == 0 else 3)
    t.fit(TinyModule(n=64, batch_size=64))
    event = strategy.engine.ledger.history[0][0]
    dump(
        name, t.strategy, integers=[x.tolist() for x in released.noisy], dtype=str(released.noisy[0].dtype),
        ranks=event.ranks, share_scale=event.share_scale, sensitivity=strategy.engine.noise.grid.sensitivity,
    )  # fmt: skip

# 14. QuantileClipping (issue #49): each rank counts its own examples' unclipped indicators and adds its share
# σ_b/√W of the count's noise; the all-reduced count moves C alike on every rank. σ = 0: the single-process run.
from lightning_dp import QuantileClipping  # noqa: E402

for name, sigma in (("quantile_exact", 0.0), ("quantile_noisy", 1.0)):
    torch.manual_seed(0)
    module = TinyModule(n=64, batch_size=64)
    quantile = QuantileClipping(initial_norm=0.5, seed=1)
    t = trainer(DPDDPStrategy(noise_multiplier=sigma, clipping=quantile, seed=0), max_epochs=3)
    t.fit(module)
    if t.global_rank == 0:
        torch.save(module.state_dict(), OUT / f"{name}.pt")
    dump(name, t.strategy, norm=quantile.norm, norm_range=list(quantile.norm_range))


# 15. User code's collectives (issue #48). Virtual batching with unequal chunks (chunks of 2 from about 5
# examples a rank): a rank with fewer first makes placeholder calls; the synced logs are the ranks' with data.
class ChunkLogsSynced(LogsSynced):
    epoch_batch_size = True


module, logged = ChunkLogsSynced(n=80, batch_size=10), LoggedValues()
strategy = DPDDPStrategy(noise_multiplier=1.0, max_physical_batch_size=2, seed=5, timeout=HANG)
t = trainer(strategy, max_epochs=1, callbacks=[logged])
t.fit(module)
dump("sync_chunks", t.strategy, placeholders=t.strategy.placeholders.placeholders, **logged.record(module))


# 16. Manual optimization, tiny q: an empty rank's placeholder call runs the user's step (its log's all-reduce,
# its release of noise alone, its optimizer and scheduler steps), so both ranks stay in step.
class ManualLogsSynced(SyncLogs, TinyModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log_synced(loss, len(x))
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)]


module, logged = ManualLogsSynced(n=200, batch_size=2), LoggedValues()
t = trainer(DPDDPStrategy(noise_multiplier=1.0, seed=3, timeout=HANG), max_epochs=1, callbacks=[logged])
t.fit(module)
dump(
    "sync_manual", t.strategy, placeholders=t.strategy.placeholders.placeholders, global_step=t.global_step,
    lr=t.optimizers[0].param_groups[0]["lr"], weights=[p.detach().flatten().tolist() for p in module.parameters()],
    **logged.record(module),
)  # fmt: skip

# 17. The ordinary step at B = 8 and B = 1024 logs synced values and trains; a collective that cannot be matched
# (self.all_gather hands one rank's examples to the other's step; a product cannot leave placeholders out) is
# refused on both ranks before any release.
for size in (8, 1024):
    module, logged = LogsSynced(n=2048, batch_size=size), LoggedValues()
    t = trainer(DPDDPStrategy(noise_multiplier=1.0, seed=1, timeout=HANG), max_steps=2, callbacks=[logged])
    t.fit(module)
    dump(f"sync_b{size}", t.strategy, **logged.record(module))


class Gathers(TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0 * self.all_gather(loss).sum()


class ReducesProduct(TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.trainer.strategy.reduce(loss.detach(), reduce_op="product")
        return loss


for name, kind in (("gathers", Gathers), ("product", ReducesProduct)):
    t = trainer(DPDDPStrategy(noise_multiplier=1.0, timeout=HANG), max_steps=3)
    try:
        t.fit(kind(n=64, batch_size=32))
        refusal = ""
    except DPConfigurationError as err:
        refusal = str(err)
    dump(f"refuse_{name}", t.strategy, refusal=refusal)

_worker.finish_distributed()
