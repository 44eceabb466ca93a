"""Runs DP scenarios under 2-process CPU FSDP2 (``dp_fsdp``, gloo); launched by tests/test_fsdp.py as a script.

Lightning's launcher re-runs this script for rank 1, so both ranks run the same scenarios in the same
order. Each rank writes ``OUT/<scenario>.rank<r>.json`` (and rank 0 the full weights, gathered). The last
scenario kills rank 1 mid-step: rank 0 must fail cleanly, not hang.
"""

from __future__ import annotations

import math
import os
import signal
from datetime import timedelta

import _worker
import torch
import torch.distributed as dist
from conftest import GradientRecorder, RecordingClipping, ZeroSignal
from fsdp_models import GPTModule, ShardedDeep, ShardedTiny, full_weights
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_dp import DPConfigurationError, DPFSDPStrategy
from lightning_dp.slots.release import ReleaseHook

OUT, _ = _worker.start()
TIMEOUT = timedelta(seconds=60)  # the process group's: a dead peer fails a collective within it


def strategy(**kwargs) -> DPFSDPStrategy:
    return DPFSDPStrategy(timeout=TIMEOUT, **kwargs)


def fit(module, strat: DPFSDPStrategy, **kwargs):
    trainer = _worker.ddp_trainer(OUT, strat, **kwargs)
    trainer.fit(module)
    return trainer


def dump(name: str, strat: DPFSDPStrategy, **extra) -> None:
    _worker.dump(OUT, name, strat, sample_rate=strat.engine.sampler.sample_rate, **extra)


def save_weights(name: str, module, trainer) -> None:
    weights = full_weights(module)
    if trainer.global_rank == 0:
        torch.save(weights, OUT / f"{name}.pt")


def local_numel(module, optimizer) -> dict:
    """What this rank holds between steps: its shards of the parameters, gradients and optimizer state."""
    params = [p for p in module.parameters()]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    return {
        "params": sum(p.to_local().numel() for p in params),
        "full_params": sum(p.numel() for p in params),
        "state": sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in state),
    }


# 1. σ = 0, C = ∞, q = 1, fp64: five steps on two ranks equal single-process training.
torch.manual_seed(0)
module = ShardedTiny(n=64, batch_size=64, dtype=torch.float64)
t = fit(module, strategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0), max_epochs=5)
save_weights("exact", module, t)
dump("exact", t.strategy, batches=module.seen_batch_sizes)

# 2. A binding C with Adam (optimizer state sharded), σ = 0, q = 1, fp64.
torch.manual_seed(0)
module = ShardedTiny(n=64, batch_size=64, dtype=torch.float64, optimizer="adam", lr=0.01)
t = fit(module, strategy(noise_multiplier=0.0, max_grad_norm=0.05, seed=0), max_epochs=3)
save_weights("clipped", module, t)
dump("clipped", t.strategy, held=local_numel(module, t.strategy.optimizers[0]))


# 3. Zero-signal loss: each rank's shard of the private gradient is noise of std σC/B, from its own stream.
class ShardRecorder(GradientRecorder):
    """The gradient each optimizer step receives: this rank's shards, flattened."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.to_local().flatten() for p in pl_module.parameters()]))


recorder = ShardRecorder()


class ShardedZero(ShardedTiny, ZeroSignal):
    pass


t = fit(
    ShardedZero(n=400, d=50, hidden=100, classes=50, batch_size=40),
    strategy(noise_multiplier=2.0, max_grad_norm=3.0),
    max_steps=3,
    callbacks=[recorder],
)
noise = torch.cat(recorder.grads)
dump("noise", t.strategy, std=float(noise.std()), numel=noise.numel(), head=noise[:8].tolist())


# 4. The neighbour test through Trainer.fit: one step, σ = 0, C = 0.01, q = 1, with and without one example.
class Released(ReleaseHook):
    """The released (noise-free) sum, each rank's shard, gathered into full tensors."""

    def after_release(self, noisy, ctx):
        self.sums = [s.double().clone() for s in noisy]
        return noisy


def released_sum(n: int) -> list[float]:
    torch.manual_seed(0)
    module = ShardedTiny(n=16, batch_size=n)
    module.x, module.y = module.x[:n], module.y[:n]
    strat = strategy(noise_multiplier=0.0, max_grad_norm=0.01, seed=0)
    hook = Released()
    strat.engine.release_hooks.append(hook)
    fit(module, strat, max_steps=1)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, [s.flatten().tolist() for s in hook.sums])
    return [v for rank in parts for s in rank for v in s]


full, kept = released_sum(16), released_sum(15)
move = math.sqrt(sum((a - b) ** 2 for a, b in zip(full, kept, strict=True)))
dump("neighbour", t.strategy, move=move, numel=len(full))

# 5. ε, q, σ and the report of a noisy run equal one process's (the test runs the single-process one).
module = ShardedTiny(n=128, batch_size=32)
t = fit(module, strategy(noise_multiplier=1.0, seed=3), max_epochs=2, default_root_dir=str(OUT / "epsilon"))
dump("epsilon", t.strategy, sigma=t.strategy.engine.noise.noise_multiplier(0))

# 6. Tiny q: most local batches are empty; both ranks take every step (no collective in their passes).
module = ShardedTiny(n=200, batch_size=2)
t = fit(module, strategy(noise_multiplier=1.0), max_steps=40)
dump(
    "tiny_q",
    t.strategy,
    seen=len(module.seen_batch_sizes),
    weights=float(full_weights(module)["net.0.weight"].sum()),
)

# 7. Virtual batching: chunks of 5 (a different number per rank), σ = 0, binding C, equals one process unsplit.
torch.manual_seed(0)
module = ShardedTiny(n=64, batch_size=64)
t = fit(
    module, strategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0, max_physical_batch_size=5), max_epochs=3
)
save_weights("virtual", module, t)
dump("virtual", t.strategy, max_chunk=max(module.seen_batch_sizes))

# 7b. Activation checkpointing: σ = 0, binding C, q = 1 equals one process without it.
torch.manual_seed(0)
module = ShardedTiny(n=64, batch_size=64, checkpointed=True)
t = fit(module, strategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=2)
save_weights("checkpointed", module, t)
dump("checkpointed", t.strategy)

# 7c. User-level DP: 16 users of 4 examples, k = 2 rows per sampled user, 8 users per step.
module = ShardedTiny(n=64, batch_size=16)
users = torch.arange(64) // 4
t = fit(
    module,
    strategy(
        noise_multiplier=1.0, privacy_unit="user", user_key=users, examples_per_user=2, users_per_step=8
    ),
    max_epochs=2,
)
dump("users", t.strategy, unit=t.strategy.privacy_unit.kind, units=t.strategy.privacy_unit.num_units)

# 8. Mixed precision (bf16 parameters, fp32 reduction) and a frozen first layer: every contribution ≤ C.
clipping = RecordingClipping()
module = ShardedTiny(n=128, batch_size=32, mixed_precision=True, frozen_first=True)
module.x = module.x * 100
t = fit(module, strategy(noise_multiplier=1.0, max_grad_norm=0.05, clipping=clipping), max_epochs=1)
dump(
    "bf16",
    t.strategy,
    max_contribution=clipping.max_contribution,
    dtypes=sorted(str(d) for d in clipping.grad_dtypes),
    trained=sorted(n for n, p in module.named_parameters() if p.requires_grad),
)

# 9. A GPT-2 from a transformers config (tied embeddings), fp64, sharded per block: σ = 0 and C = 1e-3 (every
# example clipped, so the step is a sum of each example's gradient direction) equals one process.
torch.manual_seed(0)
gpt = GPTModule()
t = fit(gpt, strategy(noise_multiplier=0.0, max_grad_norm=1e-3, seed=0), max_epochs=2)
save_weights("gpt", gpt, t)
dump("gpt", t.strategy, paths=t.strategy.clipping_paths)

# 10. Sharded checkpoints: 4 steps saved, resumed to 8, equal to 8 straight steps (seeded: exact).
torch.manual_seed(0)
straight = ShardedTiny(n=128, batch_size=32, optimizer="adam", lr=0.01)
t = fit(straight, strategy(noise_multiplier=1.0, seed=7), max_steps=8)
straight_weights = full_weights(straight)
torch.manual_seed(0)
first = ShardedTiny(n=128, batch_size=32, optimizer="adam", lr=0.01)
ckpt = ModelCheckpoint(dirpath=str(OUT / "ckpt"), every_n_train_steps=4, save_top_k=-1)
t = fit(
    first, strategy(noise_multiplier=1.0, seed=7), max_steps=4, enable_checkpointing=True, callbacks=[ckpt]
)
torch.manual_seed(1)  # different initial weights: the checkpoint must restore them
resumed = ShardedTiny(n=128, batch_size=32, optimizer="adam", lr=0.01)
trainer = _worker.ddp_trainer(OUT, strategy(noise_multiplier=1.0, seed=7), max_steps=8)
trainer.fit(resumed, ckpt_path=str(OUT / "ckpt" / "epoch=0-step=4.ckpt"))
resumed_weights = full_weights(resumed)
same = all(torch.equal(resumed_weights[k], v) for k, v in straight_weights.items())
dump(
    "resume",
    trainer.strategy,
    same_as_straight=same,
    files=sorted(os.listdir(OUT / "ckpt" / "epoch=0-step=4.ckpt")),
)


# 10b. Peak memory during the step: a model of 8 FSDP units holds only the units its forward or backward is
# in, and forms its clipped sum one unit at a time (each reduce-scattered at once).
class UnshardedPeak(Callback):
    """The most full-size parameter values alive at once during the training steps (read before every layer's
    forward and at every layer's output gradient in backward: FSDP2's unsharded storage), and the most
    full-size clipped-sum values held at once (one unit's, handed to its reduce-scatter)."""

    def __init__(self) -> None:
        self.active, self.params, self.sums = False, 0, 0

    def on_train_start(self, trainer, pl_module):
        shards = trainer.strategy.shards
        alive = lambda: sum(  # noqa: E731
            fp._unsharded_param.untyped_storage().nbytes() // fp._unsharded_param.element_size()
            for fp in shards.fsdp_params
            if hasattr(fp, "_unsharded_param")
        )

        def read(*_):
            if self.active:
                self.params = max(self.params, alive())

        def output(module, args, out):
            read()
            if out.requires_grad:
                out.register_hook(lambda grad: read())

        for layer in pl_module.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_pre_hook(read)
                layer.register_forward_hook(output)
        take = shards.take

        def counted(params, sums):
            self.sums = max(self.sums, sum(s.numel() for s in sums))
            return take(params, sums)

        shards.take = counted

    def on_train_batch_start(self, *args):
        self.active = True

    def on_train_batch_end(self, *args):
        self.active = False


peak = UnshardedPeak()
deep = ShardedDeep(n=32, batch_size=16, hidden=64, depth=6)
t = fit(deep, strategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=3, callbacks=[peak])
units = [sum(p.numel() for p in m.parameters()) for m in deep.net if isinstance(m, nn.Linear)]
full = sum(p.numel() for p in deep.parameters())
dump("peak", t.strategy, params=peak.params, sums=peak.sums, full=full, unit=max(units), units=len(units))

# 10c. A rank with an empty batch every step (N = 1, q = 1: rank 1 owns no example), ranks with different
# numbers of physical chunks (N = 3, chunks of 1: two on rank 0, one on rank 1), and a mixing check that runs
# its dry passes on rank 0 only (N = 3, every step checked: rank 1's one example cannot mix): σ = 0, C = ∞,
# fp64, equal to one process; the short rank makes zero-contributing placeholder passes instead of hanging.
# The step logs with sync_dist=True (issue #48): the placeholder passes make the same all-reduce, and what
# both ranks log is the mean over the ranks with data.
from sync_logs import LoggedValues, SyncLogs  # noqa: E402


class LogsSynced(SyncLogs, ShardedTiny):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log_synced(loss, len(batch[0]))
        return loss


for name, n, chunk, check in (
    ("empty", 1, None, True),
    ("chunks", 3, 1, True),
    ("checked", 3, None, "every_step"),
):
    torch.manual_seed(0)
    module, logged = LogsSynced(n=n, batch_size=n, dtype=torch.float64), LoggedValues()
    module.epoch_batch_size = chunk is not None  # each chunk weighed by its own rows
    strat = strategy(
        noise_multiplier=0.0,
        max_grad_norm=math.inf,
        seed=0,
        max_physical_batch_size=chunk,
        check_sensitivity=check,
    )
    t = fit(module, strat, max_epochs=3, callbacks=[logged])
    save_weights(name, module, t)
    dump(
        name, strat, passes=strat.lockstep.passes, placeholders=strat.lockstep.placeholders,
        **logged.record(module),
    )  # fmt: skip


# 10d. training_step returns no loss on rank 1 at its second batch, after the model's forward: that pass
# ends with a backward of zeros, rank 1 adds nothing to that step, and both ranks go on in step.
class NoLossOnRankOne(ShardedTiny):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if self.global_rank == 1 and batch_idx == 1 else loss


torch.manual_seed(0)
module = NoLossOnRankOne(n=64, batch_size=64, dtype=torch.float64)
strat = strategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0)
t = fit(module, strat, max_epochs=3)
save_weights("noloss", module, t)
dump("noloss", strat, passes=strat.lockstep.passes)


# 11. A loss that mixes examples on rank 1 only: both ranks refuse before the release.
class MixesOnRankOne(ShardedTiny):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.global_rank == 1:
            logits = logits - logits.mean(0, keepdim=True)  # batch statistics: mixes examples
        return nn.functional.cross_entropy(logits, y)


trainer = _worker.ddp_trainer(OUT, strategy(noise_multiplier=1.0), max_epochs=1)
try:
    trainer.fit(MixesOnRankOne(n=64, batch_size=16))
    refusal = ""
except DPConfigurationError as err:
    refusal = str(err)
dump("mixing", trainer.strategy, refusal=refusal)


# 12. Rank 1 dies (SIGKILL) in the middle of step 2: rank 0's next collective fails; it must not hang.
class DiesOnRankOne(ShardedTiny):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


trainer = _worker.ddp_trainer(OUT, strategy(noise_multiplier=1.0), max_epochs=1)
try:
    trainer.fit(DiesOnRankOne(n=128, batch_size=16))
    failure = ""
except Exception as err:
    failure = f"{type(err).__name__}: {err}"[:500]
dump("dies", trainer.strategy, failure=failure)
os._exit(0)  # the process group cannot be destroyed cleanly without its peer
