"""The leave-one-out sensitivity check: at fit start, no example's gradient may depend on another.

DP-SGD's proof needs each example's clipped gradient to be a function of that example alone: then
adding or removing one example moves the released sum by at most C. A loss or a forward that mixes
examples (a token mean over the whole batch, in-batch mixup, a batch statistic) breaks this without
breaking the engine's consistency warning (the per-example gradients still add up to the gradient).

The check runs the user's own ``training_step`` (train mode, logging detached) on a few real train
examples twice, with and without the last one, from the same random state (so the first dropout draws
the same masks), in a second trial from another random state when ``training_step`` draws random numbers,
and compares every other example's per-example gradient as the engine computes it (with
``loss_reduction``'s scaling by the realised batch size). Any change beyond a dtype-scaled tolerance
is refused before the first noisy release, unless the step draws random numbers and the comparison
passes with the modules in eval mode (later dropout layers draw at offsets that move with the batch
size; dropout never mixes examples). Nothing is released, priced or stepped, and everything the
passes touch (``.grad``, buffers, the global RNG streams, the hooks) is put back.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_dp.errors import DPConfigurationError

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine
    from lightning_dp.per_example import PerExampleGradients


class SensitivityHost(Protocol):
    """What the check reads from the strategy (both DP strategies have it)."""

    check_sensitivity: bool
    max_physical_batch_size: int | None

    @property
    def engine(self) -> PrivateStepEngine: ...
    @property
    def lightning_module(self) -> LightningModule | None: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def precision_plugin(self) -> Any: ...
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any: ...


CHECK_EXAMPLES = 4
"""Examples in the check's larger batch (the smaller one leaves the last out): two trials of two passes
over 4 and 3 examples cost less than one training step at the batch sizes DP training uses."""

MATERIALIZE_LIMIT = 2**25
"""Up to this many per-example gradient entries (batch × parameters, 128 MiB in fp32 per pass) the check
forms every row at once; above it, one row at a time (a one-hot weighted sum), so memory stays ~2× the
parameters."""

TRIAL_SEEDS = (0, 1)
"""Each trial seeds the global RNGs afresh (inside the fork) for its two passes: mixing driven by a random
draw (mixup's permutation) that happens to leave the kept examples' partners alone in one trial shows
in the other. The second trial runs only when ``training_step`` drew random numbers in the first."""

RELATIVE_FLOOR = 1e-3
"""The smallest relative change refused: a full forward and backward in fp32 over batches of 4 and 3
rows rounds differently (GEMM blocking) by ~1e-6; the patterns the check exists for move 10% and more."""


@dataclass(frozen=True)
class SensitivityResult:
    """What the check measured: the largest relative change of any kept example's gradient."""

    examples: int
    worst_change: float
    worst_example: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.worst_change <= self.tolerance


def training_step_loss(module: LightningModule, batch: Any) -> Tensor | None:
    """The loss ``module.training_step(batch, 0)`` returns, with ``self.log``/``log_dict`` detached.

    For passes that are not training steps (the sensitivity check, DPIS's norm pass): they must leave
    no trace in the metrics. None when ``training_step`` returns no loss.
    """
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.__dict__["log"] = module.__dict__["log_dict"] = _no_log
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = module.training_step(batch, 0)
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                module.__dict__[name] = saved[name]
            else:
                del module.__dict__[name]
    loss = out["loss"] if isinstance(out, Mapping) else out
    return loss if isinstance(loss, Tensor) else None


def _no_log(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


def relative_tolerance(precision: str, device: torch.device) -> float:
    """The largest relative change a correct model shows between the two passes, from the compute dtype.

    16 units in the last place of the dtype the forward runs in (bf16/fp16 under mixed precision, TF32
    for fp32 matmuls and convolutions on CUDA), never below ``RELATIVE_FLOOR``.
    """
    if "bf16" in precision:
        eps = torch.finfo(torch.bfloat16).eps
    elif "16" in precision:
        eps = torch.finfo(torch.float16).eps
    elif device.type == "cuda":
        eps = 2.0**-10  # TF32 keeps a 10-bit mantissa (cuDNN convolutions use it by default)
    else:
        eps = torch.finfo(torch.float32).eps
    return max(RELATIVE_FLOOR, 16 * eps)


def skip_reason(strategy: SensitivityHost) -> str | None:
    """Why the check cannot or need not run for this fit (None: it runs)."""
    module = strategy.lightning_module
    if not strategy.check_sensitivity:
        return "turned off (check_sensitivity=False)"
    if module is None or strategy.engine.grads is None or strategy.engine.train_data is None:
        return "no train data or no per-example hooks"
    if not module.automatic_optimization:
        return (
            "manual optimization (training_step steps the optimizer itself, so it cannot be run without "
            "releasing); check the model with the neighbour test instead"
        )
    if strategy.max_physical_batch_size == 1:
        return "max_physical_batch_size=1 (every example has its own forward, so none can mix)"
    if len(strategy.engine.train_data[0]) < 2:
        return "fewer than two train examples"
    return None


def check_sensitivity(strategy: SensitivityHost) -> SensitivityResult | None:
    """Run the check for ``strategy``'s fit, refuse the run if it fails, or say why it is skipped."""
    reason = skip_reason(strategy)
    if reason is not None:
        rank_zero_info(f"lightning-dp: sensitivity check skipped: {reason}.")
        return None
    module = strategy.lightning_module
    assert module is not None
    assert strategy.engine.train_data is not None
    dataset, collate = strategy.engine.train_data
    count = min(CHECK_EXAMPLES, len(dataset), strategy.max_physical_batch_size or CHECK_EXAMPLES)
    device = strategy.root_device
    tolerance = relative_tolerance(str(strategy.precision_plugin.precision), device)
    with fork_rng(device) as rng:
        indices = spread_indices(len(dataset), count)
        samples = [dataset[i] for i in indices]
        batches = [strategy.batch_to_device(collate(samples[:n]), device) for n in (count, count - 1)]
        spare = next((i for i in range(len(dataset)) if i not in indices), None)

        def trials(train: bool) -> tuple[SensitivityResult | None, bool]:
            """The worst trial over TRIAL_SEEDS (train or eval mode), and whether the step drew random numbers."""
            worst: SensitivityResult | None = None
            for seed in TRIAL_SEEDS:
                drew = [False]

                def loss_fn(batch: Any, seed: int = seed, drew: list[bool] = drew) -> Tensor | None:
                    rng.reseed(seed)  # both passes draw the same first masks (the kept examples come first)
                    start = rng.state()
                    with strategy.precision_plugin.train_step_context():
                        loss = training_step_loss(module, batch)
                    drew[0] = drew[0] or not rng.same(start, rng.state())
                    return loss

                trial = leave_one_out(
                    strategy.engine, module, batches[0], batches[1], count, loss_fn, tolerance, train=train
                )
                if trial is not None and (worst is None or trial.worst_change > worst.worst_change):
                    worst = trial
                if (worst is not None and not worst.passed) or not drew[0]:
                    return worst, drew[0]  # refused, or nothing random: another trial would compute the same
            return worst, True

        result, drew_any = trials(train=True)
        note = ""
        if result is not None and not result.passed and drew_any:
            # Dropout after the first random layer draws masks at an offset that depends on the batch's
            # size, so the two passes differ even for a correct model. Dropout never mixes examples:
            # check again with the modules in eval mode (training_step's own draws, mixup's, still run).
            # A layer that mixes examples only in train mode is still caught by a train-mode pass that
            # swaps the last example for another: same shapes, so every random draw is the same.
            in_eval, _ = trials(train=False)
            swapped = None
            if in_eval is not None and in_eval.passed and spare is not None:
                batches[1] = strategy.batch_to_device(collate([*samples[:-1], dataset[spare]]), device)
                swapped = leave_one_out(
                    strategy.engine,
                    module,
                    batches[0],
                    batches[1],
                    count,
                    lambda batch: _seeded_loss(strategy, module, rng, batch),
                    tolerance,
                    replaced=True,
                )
            if in_eval is not None and in_eval.passed and (swapped is None or swapped.passed):
                result = in_eval
                note = (
                    " in eval mode, and in train mode with the last example swapped for another "
                    "(training_step draws random numbers, e.g. dropout, whose masks move with the batch size)"
                )
            elif swapped is not None and not swapped.passed:
                result = swapped
    if result is None:
        rank_zero_info("lightning-dp: sensitivity check skipped: training_step returned no loss.")
        return None
    if not result.passed:
        raise DPConfigurationError(refusal_message(result))
    rank_zero_info(
        f"lightning-dp: sensitivity check passed{note}: {count} examples, largest change of a kept example's "
        f"gradient {result.worst_change:.2g} (tolerance {tolerance:.2g})."
    )
    return result


def _seeded_loss(
    strategy: SensitivityHost, module: LightningModule, rng: GlobalRNG, batch: Any
) -> Tensor | None:
    """``training_step``'s loss from the first trial seed: two calls on same-shaped batches draw the same."""
    rng.reseed(TRIAL_SEEDS[0])
    with strategy.precision_plugin.train_step_context():
        return training_step_loss(module, batch)


def spread_indices(num_samples: int, count: int) -> list[int]:
    """``count`` dataset indices spread evenly over the data set (no random draw: no RNG consumed)."""
    if count == 1:
        return [0]
    return sorted({round(k * (num_samples - 1) / (count - 1)) for k in range(count)})


class GlobalRNG:
    """The global random streams user code may draw from: torch (CPU, and CUDA on a CUDA device),
    Python's ``random`` and NumPy's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()

    def state(self) -> tuple[Any, ...]:
        cuda = torch.cuda.get_rng_state_all() if self.cuda else []
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()

    def restore(self, state: tuple[Any, ...]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state_all(state[1])
        random.setstate(state[2])
        np.random.set_state(state[3])

    def reseed(self, seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)
        if self.cuda:
            torch.cuda.manual_seed_all(seed)
        random.seed(seed)
        np.random.seed(seed)

    @staticmethod
    def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        """Whether nothing was drawn between the two states."""
        return (
            torch.equal(a[0], b[0])
            and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
            and a[2] == b[2]
            and all(np.array_equal(x, y) for x, y in zip(a[3], b[3], strict=True))
        )


@contextlib.contextmanager
def fork_rng(device: torch.device) -> Iterator[GlobalRNG]:
    """Put the global random states back on exit, so the check neither consumes nor perturbs them."""
    rng = GlobalRNG(device)
    saved = rng.state()
    try:
        yield rng
    finally:
        rng.restore(saved)


@contextlib.contextmanager
def no_trace(module: nn.Module, params: list[nn.Parameter], train: bool = True) -> Iterator[None]:
    """Run the block in train mode (or in eval mode bar the layers holding trainable weights, which keep
    recording per-example gradients); restore every ``.grad``, buffer and mode of ``module`` after."""
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    for p in params:
        p.grad = None
    module.train()
    if not train:  # "eval" for everything but the layers holding trainable weights, whose hooks must record
        for m in module.modules():
            m.training = any(p.requires_grad for p in m.parameters(recurse=False))
    try:
        yield
    finally:
        for m, mode in modes:  # each module's own mode (from_pretrained models may come in eval mode)
            m.training = mode
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def leave_one_out(
    engine: PrivateStepEngine,
    module: nn.Module,
    full: Any,
    without_last: Any,
    count: int,
    loss_fn: Callable[[Any], Tensor | None],
    tolerance: float,
    train: bool = True,
    replaced: bool = False,
) -> SensitivityResult | None:
    """Compare each of the first ``count - 1`` examples' per-example gradients in ``full`` (``count``
    examples) and in ``without_last`` (or, ``replaced``, the same batch with its last example swapped
    for another), the modules in train (or eval) mode. None when ``loss_fn`` gives no loss."""
    grads = engine.grads
    assert grads is not None, "attach() first"
    with no_trace(module, engine.params, train=train):
        passes = []
        try:
            for batch, size in ((full, count), (without_last, count if replaced else count - 1)):
                grads.clear()
                grads.expect_batch(size)
                with torch.enable_grad():
                    loss = loss_fn(batch)
                    if loss is None or not loss.requires_grad:
                        return None
                    loss.backward()
                samples, rows = grads.collect(expected=size)  # names a layer off dimension 0
                if rows != size:
                    raise DPConfigurationError(
                        f"The sensitivity check's batch of {size} examples gave per-example gradients with "
                        f"{rows} rows: a layer does not see the batch on dimension 0 (sequence-first input, "
                        "or a batch folded into another dimension). Put the batch first (batch_first=True)."
                    )
                passes.append(samples)
                for p in engine.params:
                    p.grad = None
        finally:
            grads.clear()
        return _compare(passes[0], passes[1], count - 1, tolerance)


def _compare(
    full: PerExampleGradients, kept: PerExampleGradients, rows: int, tolerance: float
) -> SensitivityResult:
    """The largest relative change ‖g_i − g_i'‖ / max(‖g_i‖, ‖g_i'‖) over the kept rows."""
    diff_sq, full_sq, kept_sq = (torch.zeros(rows, dtype=torch.float64) for _ in range(3))
    for part, a, b in _row_blocks(full, kept, rows):
        for x, y in zip(a, b, strict=True):
            x, y = x.double().flatten(1), y.double().flatten(1)
            diff_sq[part] += (x - y).pow(2).sum(1).cpu()
            full_sq[part] += x.pow(2).sum(1).cpu()
            kept_sq[part] += y.pow(2).sum(1).cpu()
    worst, worst_row = 0.0, 0
    for i in range(rows):
        norm_full, norm_kept = math.sqrt(full_sq[i]), math.sqrt(kept_sq[i])
        if not (math.isfinite(norm_full) and math.isfinite(norm_kept)):
            change = 0.0 if math.isfinite(norm_full) == math.isfinite(norm_kept) else math.inf
        else:
            scale = max(norm_full, norm_kept)
            change = math.sqrt(diff_sq[i]) / scale if scale > 0 else 0.0
        if change > worst:
            worst, worst_row = change, i
    return SensitivityResult(rows + 1, worst, worst_row, tolerance)


def _row_blocks(
    full: PerExampleGradients, kept: PerExampleGradients, rows: int
) -> Iterator[tuple[slice, list[Tensor], list[Tensor]]]:
    """(the rows, their gradients in each pass as [r, *shape] per parameter): all rows at once for a
    small model (few large operations), else one row at a time (a one-hot weighted sum)."""
    if full.batch * sum(p.numel() for p in full.params) <= MATERIALIZE_LIMIT:
        yield slice(0, rows), [g[:rows] for g in full.materialize()], [g[:rows] for g in kept.materialize()]
        return
    for i in range(rows):
        yield slice(i, i + 1), [g[None] for g in _row(full, i)], [g[None] for g in _row(kept, i)]


def _row(samples: PerExampleGradients, row: int) -> list[Tensor]:
    """Example ``row``'s gradient, one tensor per parameter (a one-hot weighted sum: nothing materialised)."""
    weights = torch.zeros(samples.batch, device=samples.params[0].device)
    weights[row] = 1.0
    return samples.weighted_sum(weights)


def refusal_message(result: SensitivityResult) -> str:
    """The refusal: what changed, why it breaks the guarantee, the likely causes and their fixes."""
    return (
        f"Sensitivity check failed: example {result.worst_example}'s per-example gradient changed by "
        f"{result.worst_change:.1%} when another example was left out of the batch (tolerance "
        f"{result.tolerance:.2g}). DP-SGD needs each example's gradient to depend on that example alone; "
        "here the loss or the forward mixes examples, so one example can move the released sum by more "
        "than max_grad_norm and the reported ε does not hold. Likely causes and fixes: a token-level mean "
        "over the whole batch (cross_entropy over flattened tokens with ignore_index, or a Hugging Face "
        "model's labels= loss): return lightning_dp.per_example_token_loss(logits, labels).mean(); an "
        "operation that mixes examples (mixup or cutmix across the batch, attention or pooling over the "
        "batch dimension): mix within one example only; a batch statistic (standardising by the batch "
        "mean or std): normalise each example on its own (LayerNorm, GroupNorm); a loss summed over the "
        "batch while loss_reduction='mean': return the mean. See docs/writing-a-loss.md. Only if the model "
        "is verified otherwise (the neighbour test), DPStrategy(check_sensitivity=False) turns the check off."
    )
