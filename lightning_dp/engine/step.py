"""The private step: per-example gradients → clip → price → noise → step, on the state ``state.py`` holds.

The strategy owns the Lightning wiring; this object owns the privacy-relevant arithmetic,
so the single-device and distributed strategies (and tests) share exactly one implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_dp.accounting import BudgetExceededError, PrivacyEvent, PrivacyLedger
from lightning_dp.accounting.budget import affordable_after
from lightning_dp.core.batches import UnitInfo
from lightning_dp.core.errors import BatchDimensionError, DPConfigurationError
from lightning_dp.engine.batch import PendingChunks
from lightning_dp.engine.consistency import missed_gradients, refuse_sequence_first
from lightning_dp.engine.inputs import GradientSink
from lightning_dp.engine.state import EngineState
from lightning_dp.per_example import GradientCapture, GradMode, PerExampleGradients
from lightning_dp.per_example.gradients import Registered, SumSink
from lightning_dp.slots import (
    NOISE_SLICE,
    Clipping,
    Noise,
    Sampler,
    Step,
    StepContext,
    StepSetup,
)
from lightning_dp.slots.compatibility import check_mechanisms
from lightning_dp.slots.release import ReduceScatter, Releases

_GAUSSIAN_DRAW = Noise.add_noise
"""The default noise draw, as defined (a noise slot that overrides or patches it draws in the release)."""


class PrivateStepEngine(EngineState):
    """Holds the four slots, the ledger and the noise generator, and runs the private step."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        clipping: Clipping,
        noise: Noise,
        step: Step,
        max_grad_norm: float,
        delta: float,
        target_epsilon: float | None,
        accountant: Literal["rdp", "prv", "pld", "pure"],
        loss_reduction: str,
        seed: int | None,
        grad_sample_mode: GradMode = "auto",
        max_physical_batch_size: int | None = None,
    ) -> None:
        self.grad_sample_mode: GradMode = grad_sample_mode
        check_mechanisms(sampler, clipping, noise, accountant, step)
        noise.link_step(step)  # schedules such as NoiseDividing take their weights from the step slot
        # A step that brings its own noise rule or ledger rule declares it here, once: nothing
        # replaces the engine's slots or ledger after construction.
        plan = step.plan(StepSetup(noise, clipping, accountant, target_epsilon, delta, max_grad_norm))
        noise = plan.noise if plan.noise is not None else noise
        noise.link_sampler(sampler)  # correlated noise reads the sampler's bands
        releases = Releases(
            plan.ledger if plan.ledger is not None else PrivacyLedger(delta=delta, accountant=accountant),
            target_epsilon=target_epsilon,
            noise=noise,
            clipping=clipping,
            gradient_name=f"the private gradient step ({sampler.name}, {clipping.name}, {step.name})",
        )
        super().__init__((sampler, clipping, noise, step), releases, max_grad_norm, seed)
        self.delta = delta
        self.target_epsilon = target_epsilon
        self.accountant = accountant
        self.loss_reduction = loss_reduction
        # nothing but the gradient release draws from the noise generator: its noise can be drawn ahead
        self.releases.prefetch_draw = _GAUSSIAN_DRAW if type(step) is Step else None
        self.releases.prefetch_slice = NOISE_SLICE
        sampler.use_releases(self.releases)
        clipping.use_releases(self.releases)  # a clipping's joint statistic (quantile clipping's count)
        self.grads: GradientCapture | None = None
        self._checked_consistency = False
        self._chunks = PendingChunks()
        self.normalisation: Literal["batch", "public"] = "batch"
        """How a ``loss_reduction="mean"`` loss is normalised, as the mixing check reads it: "batch", a mean over
        the batch's rows (each row's gradient is the rows' count times its share, then reduced per unit as
        configured); "public", divided by public constants only (a per-user mean over ``users_per_step``):
        each unit's gradient is the expected batch size times its share, its rows summed. Either way no other
        unit's rows, nor how many there are, enter a unit's gradient (:meth:`use_normalisation`)."""
        self.module: nn.Module | None = None
        """The module the hooks are attached to (steps that probe the loss evaluate it; :meth:`attach`)."""
        self.max_physical_batch_size = max_physical_batch_size
        """Virtual batching: at most this many examples per forward (None: the whole logical batch)."""
        step.bind(self)

    # -- inputs that configure the engine's parts (the rest of its inputs: StepInputs) -------------------
    def begin_batch(self, realised: int | None, *, data: Any = None, units: UnitInfo | None = None) -> None:
        self.refresh_parameters()  # BackboneFinetuning may have unfrozen parameters since the last batch
        super().begin_batch(realised, data=data, units=units)

    def _expect_rows(self, rows: int | None) -> None:
        # The hooks take the batch size from the sampler, not from the first layer's input (a position
        # lookup of batch 1 may come first), so broadcast inputs are expanded to the real batch.
        if self.grads is not None:
            self.grads.expect_batch(rows)

    def use_sinks(
        self,
        gradient_sink: GradientSink | None,
        sum_sink: SumSink | None,
        reduce_scatter: ReduceScatter | None,
    ) -> None:
        """Where released gradients and clipped sums go, and how the noisy sum is split over the ranks
        (``dp_fsdp``: each rank's shards); None: whole tensors."""
        self._gradient_sink, self._sum_sink = gradient_sink, sum_sink
        self.releases.reduce_scatter_fn = reduce_scatter

    def use_registered(self, registered: Registered | None) -> None:
        """Layer types the hooks must treat as registered while they recompute (``dp_fsdp``'s sharded
        layers); call after :meth:`attach`."""
        assert self.grads is not None, "attach() first"
        self.grads.registered = registered

    def keep_param_grads(self, keep: bool) -> None:
        """Keep autograd's own ``p.grad`` through backward (a hook the user wrote reads it there)."""
        assert self.grads is not None, "attach() first"
        self.grads.keep_param_grads = keep

    # -- set-up ---------------------------------------------------------------------------------
    def attach(self, module: nn.Module) -> None:
        """Install the per-example gradient hooks on ``module`` (idempotent)."""
        self.module = module
        if self.grads is None:
            refuse_sequence_first(module)
            self.grads = GradientCapture(
                module, loss_reduction=self.loss_reduction, mode=self.grad_sample_mode
            )
            self.clipping.setup(self.grads.params)
            self.noise.setup(self.grads.params)
            self.releases.anchor = self.grads.params[0]
            self.use_normalisation(self.normalisation)

    def use_normalisation(self, kind: Literal["batch", "public"]) -> None:
        """Form the per-unit gradients under ``kind`` (:attr:`normalisation`) from the next backward on."""
        self.normalisation = kind
        if self.grads is not None:
            public = kind == "public"
            self.grads.public_scale = float(self.sampler.expected_batch_size) if public else None

    def refresh_parameters(self) -> None:
        """Before each step: cover exactly the parameters that are trainable now (``BackboneFinetuning``
        unfreezes a backbone at a later epoch; every one of them is clipped and noised from that step on).

        Slots that keep state per parameter (``Slot.tracks_parameters``) cannot follow a change after the
        first step: the run is refused before the release, naming the parameters."""
        if self.grads is None:
            return
        before = list(self.grads.params)
        if not self.grads.refresh():
            return
        tracking = [slot.name for _, slot in self._slots() if slot.tracks_parameters]
        if tracking and self.steps > 0:
            names = {p: n for n, p in self.module.named_parameters()} if self.module is not None else {}
            added = [names.get(p, "?") for p in self.grads.params if p not in set(before)]
            removed = [names.get(p, "?") for p in before if p not in set(self.grads.params)]
            raise DPConfigurationError(
                f"The trainable parameters changed after {self.steps} steps (now trainable: {added[:8]}; now "
                f"frozen: {removed[:8]}), but {', '.join(tracking)} keeps state per parameter and cannot follow "
                "the change. Unfreeze (or freeze) before fit starts, or train with slots that keep no such "
                "state (the default clipping and the user's optimizer step)."
            )
        self.clipping.setup(self.grads.params)
        self.releases.anchor = self.grads.params[0]

    def clear_gradients(self) -> None:
        """Drop the per-example gradients captured so far (a step about to backpropagate another batch)."""
        assert self.grads is not None, "attach() first"
        self.grads.clear()

    def detach(self) -> None:
        if self.grads is not None:
            self.grads.remove()
            self.grads = None
            self.releases.anchor = None

    @property
    def attached(self) -> bool:
        return self.grads is not None

    @property
    def params(self) -> list[nn.Parameter]:
        assert self.grads is not None, "attach() first"
        return self.grads.params

    @property
    def stepped_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps, one per hooked parameter (the same ones but under ``dp_fsdp``)."""
        sink = self._gradient_sink
        return self.params if sink is None else [sink.stepped(p) for p in self.params]

    # -- pricing --------------------------------------------------------------------------------
    def noise_multiplier(self) -> float | None:
        """σ of the next step: the sampler's own when it schedules noise (None until it knows), else the noise slot's."""
        if self.sampler.schedules_noise:
            return self.sampler.step_noise_multiplier()
        return self.noise.noise_multiplier(self.steps)

    def last_noise_multiplier(self) -> float | None:
        """σ of the latest step (of the first before any step), as the report and the logged metrics show
        it: the sampler's own when it schedules noise (DPIS), else the noise slot's; None while unset."""
        if self.sampler.schedules_noise:
            return self.noise_multiplier()
        return self.noise.noise_multiplier(max(self.steps - 1, 0)) if self.noise.is_set else None

    def next_event(self) -> Any:
        """The ledger event the next step would release (None while a noise-scheduling sampler has no σ yet)."""
        sigma = self.noise_multiplier()
        if sigma is None:
            return None
        own = self.noise.step_event(self.steps, self.sampler, sigma)  # correlated noise prices its own steps
        return own if own is not None else self.step_slot.gradient_event(self.sampler, sigma)

    def _covered(self) -> bool:
        """Whether the next step was paid for by the event recorded at the start of its round (BandMF)."""
        return self.steps % self.noise.steps_per_event != 0

    def affordable_steps(self, drawn: bool = False) -> int | None:
        """How many more steps fit under ``target_epsilon`` (None when there is no target).

        Releases the sampler must make before the next batch is drawn (DPIS's epoch statistics) are
        priced first: when they and one step do not fit, the answer is 0, so training stops before any
        of them. ``drawn=True``: the step's batch is already drawn (its statistics, if any, released).
        """
        event = self.next_event() if self.target_epsilon is not None else None
        if event is None or self.target_epsilon is None:
            return None
        pending = [] if drawn else self.sampler.pending_events()
        per_event = self.noise.steps_per_event  # one event pays for a round of this many steps
        paid = -self.steps % per_event  # steps left in the current round, already paid
        return paid + per_event * int(affordable_after(self.ledger, pending, event, self.target_epsilon))

    @property
    def release_name(self) -> str:
        """How budget errors name this engine's gradient release (the slots that make it)."""
        return self.releases.gradient_name

    def example_norms(self, batches: Any, loss_fn: Callable[[Any], Tensor]) -> Tensor:
        """Per-example gradient norms (fp64, CPU) over ``batches`` at the current weights.

        Norms come from the same hooks as clipping (without materialising where the layer allows);
        nothing is released, priced or stepped, and the parameters' ``.grad`` is left as it was.
        """
        assert self.grads is not None, "attach() first"
        saved = [p.grad for p in self.params]
        out: list[Tensor] = []
        try:
            for batch in batches:
                self.grads.clear()
                with torch.enable_grad():
                    loss_fn(batch).backward()
                grad_samples, _ = self.grads.collect()
                out.append(grad_samples.sq_norms().sqrt().double().cpu())
        finally:
            self.grads.clear()
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    # -- run-time checks -----------------------------------------------------------------------------
    def _count_release(self) -> None:
        """Refuse a second noisy gradient release from one sampled batch (checked before the release)."""
        if self._releases_this_batch is None:
            return
        if self._releases_this_batch >= 1:
            self._drop_step()
            raise DPConfigurationError(
                "A second noisy gradient release from the same sampled batch (two optimizers that each step "
                "on it, a SAM-style inner step, or two backward/step pairs in one training_step). The ledger "
                "prices one subsampled Gaussian per sampled batch; releases of one batch are not independent "
                "steps, so ε would be understated. Use one optimizer over all parameters (parameter groups "
                "give each part its own learning rate), or add the losses and call backward once per batch. A "
                "second step that reads no example of the batch (a DP-GAN generator step through the "
                "discriminator just released) would cost nothing, but lightning-dp cannot show that a backward "
                "reads no private row, so it counts as a release: alternate the two steps over batches instead "
                "(the discriminator on even batch_idx, the generator on odd ones, with as many generated rows as "
                "the batch has examples), so that each sampled batch makes one release, priced as one step."
            )
        self._releases_this_batch += 1

    def _layer_expected(self, chunked: bool) -> int | None:
        """The batch dimension every layer of the chunk just backpropagated must have (None: unknown).

        The strategy sets ``chunk_batch`` for each physical chunk it makes; a caller that chunks the
        batch itself leaves it at the whole batch, and then only the total is checked."""
        if chunked and self.chunk_batch == self.realised_batch:
            return None
        return self.chunk_batch

    def _check_realised_total(self, batch: int) -> None:
        """The per-example gradients of the logical batch must number the examples the sampler drew."""
        if self.realised_batch is None or batch in (0, self.realised_batch):  # 0: no backward ran
            return
        self._drop_step()
        raise BatchDimensionError(
            f"The per-example gradients of this batch are {'more' if batch > self.realised_batch else 'fewer'} "
            "than the examples the sampler drew: the batch is not on dimension 0 of the collated tensors or "
            "of the layers (sequence-first tensors, a reshaped batch). Keep the examples on dimension 0 of "
            "every tensor the collate function returns and use batch_first=True in recurrent and attention "
            "layers."
        )

    # -- the private step ---------------------------------------------------------------------------
    def _context(self, batch: int) -> StepContext:
        assert self.grads is not None, "attach() first"
        return StepContext(
            step=self.steps,
            batch_size=batch,
            expected_batch_size=self.sampler.expected_batch_size,
            max_grad_norm=self.max_grad_norm,
            # the gradient's σ: the step's own, or its share when the clipping releases a joint statistic
            noise_multiplier=self.clipping.gradient_noise_multiplier(
                float(self.noise_multiplier() or 0.0), self.sampler.expected_batch_size
            ),
            generator=self._noise_generator(self.grads.params[0].device),
        )

    def _clipped_sums(self, expected: int | None = None) -> tuple[list[Tensor], StepContext]:
        """Clip the per-example gradients just backpropagated and sum them (releases nothing);
        ``expected``: the examples every layer must see on its batch dimension (None: unchecked).

        When the rows carry privacy units (``units``), the clipping bounds each unit's gradient: the rows
        are grouped first, ``ctx.batch_size`` counts units and ``ctx.extras["rows"]`` the rows."""
        assert self.grads is not None, "attach() first"
        grad_samples, batch = self.grads.collect(expected)
        if batch and not self._checked_consistency:
            self._check_consistency(self.grads.params, grad_samples, batch)
            # Checked once against autograd's gradient; from now on that gradient is never computed
            # (it would be discarded anyway: privatize builds p.grad from per-example terms alone).
            self.grads.skip_param_grads = True
        units = self.units if batch else None
        if units is not None:
            if units.unit_of_row.numel() != batch:
                self._drop_step()
                raise BatchDimensionError(
                    "The batch carries privacy units for another number of rows than it has per-example "
                    "gradients: keep every row of the collated batch on dimension 0."
                )
            if self.normalisation == "public":  # the loss weighs a unit's rows itself: their sum, unscaled
                grad_samples = grad_samples.grouped(units.unit_of_row, "sum")
            else:
                grad_samples = grad_samples.grouped(units.unit_of_row, units.reduction, units.views)
        grad_samples.sink = self._sum_sink  # after the consistency check, which compares full-size sums
        ctx = self._context(grad_samples.batch)
        ctx.extras["rows"] = batch
        weighed = self.sampler.weigh(grad_samples, ctx)
        if weighed is None:
            grad_samples.release_on_sum = self.clipping.sums_once  # free each layer as it is summed
            sums = self.clipping.clip_and_sum(grad_samples, ctx)
        else:  # the sampler bounds each contribution itself (importance sampling)
            grad_samples.release_on_sum = True  # this sum is their last use
            sums = grad_samples.weighted_sum(weighed[0])
            ctx.sensitivity = weighed[1]
        self.grads.clear()
        return sums, ctx

    def accumulate_chunk(self) -> None:
        """Virtual batching: fold one physical chunk's clipped sum into the pending logical step.

        Nothing is released and nothing is priced: noise is added once, by the ``privatize`` that
        ends the logical batch. The non-private ``p.grad`` of the chunk is discarded.
        """
        sums, ctx = self._clipped_sums(self._layer_expected(chunked=True))
        self._chunks.add(sums, ctx.batch_size, ctx.extras["rows"])
        for p in self.params:
            p.grad = None

    def privatize(self) -> StepContext:
        """Replace every ``p.grad`` with the private gradient of the logical batch just backpropagated."""
        assert self.grads is not None, "attach() first"
        if self._pending_ctx is not None:
            raise RuntimeError(
                "Two backward passes before one optimizer step: every private step must be one backward "
                "followed by optimizer.step(). For larger logical batches use max_physical_batch_size, "
                "not gradient accumulation."
            )
        self._count_release()
        event = self.next_event()
        if event is None:
            raise RuntimeError(f"{self.sampler.name} has not set the noise multiplier of this step.")
        covered = self._covered()
        if not covered:
            self._check_affordable(event)
        sums, ctx = self._clipped_sums(self._layer_expected(chunked=not self._chunks.empty))
        earlier, units, rows = self._chunks.take()
        if earlier is not None:
            sums = [a + b for a, b in zip(earlier, sums, strict=True)]
            ctx.batch_size += units
            ctx.extras["rows"] += rows
        self._check_realised_total(ctx.extras["rows"])
        released = self._release(sums, ctx, None if covered else event)
        if self._gradient_sink is not None:
            self._gradient_sink.assign(self.params, released)
        else:
            for p, g in zip(self.params, released, strict=True):
                p.grad = g.to(p.dtype)
        self.steps += 1
        self._pending_ctx = ctx
        return ctx

    def noise_only_step(self) -> StepContext:
        """The private step of a batch that backpropagated nothing (an empty batch, a training_step that
        returned None): pure noise, released and priced like any step, so a skipped step cannot reveal a
        data-dependent decision. Drops whatever was captured or written to ``p.grad`` before."""
        assert self.grads is not None, "attach() first"
        for p in self.params:
            p.grad = None
        self.grads.clear()
        return self.privatize()

    def _release(self, sums: list[Tensor], ctx: StepContext, event: PrivacyEvent | None) -> list[Tensor]:
        """Record ``event`` (None: a step its round's event already paid for), add the noise once over all
        ranks, and finalize: the released gradient."""
        return self.releases.release_gradient(sums, ctx, event, keep_sums=self.step_slot.needs_sums)

    def private_gradient(self, event: PrivacyEvent) -> list[Tensor]:
        """One more noisy gradient of what was just backpropagated, priced as ``event`` (``p.grad`` untouched).

        For step slots that measure a second gradient inside a step (e.g. the line search's CHEB);
        the noise multiplier is the noise slot's current one, and check-before-spend applies.
        """
        if self.noise.correlated:
            raise DPConfigurationError(
                f"{self.step_slot.name} asked for a second noisy gradient in one step, but {self.noise.name}'s "
                "noise is correlated across steps: every release advances it, so the gradient must be a step's "
                "only release. Use the default step (the optimizer) with correlated noise."
            )
        self._check_affordable(event)
        sums, ctx = self._clipped_sums()
        return self._release(sums, ctx, event)

    def _check_affordable(self, event: PrivacyEvent) -> None:
        """Check before spend: refuse a release the target cannot pay for (O(1) per step, even with PRV);
        a refusal drops this step's per-example gradients and any pending chunks."""
        try:
            self.releases.check(event)
        except BudgetExceededError:
            self._drop_step()
            raise

    def _check_consistency(
        self, params: list[nn.Parameter], grad_samples: PerExampleGradients, batch: int
    ) -> None:
        """Once, before the first release: the per-example gradients must add up to autograd's gradient,
        parameter by parameter; a parameter whose gradient they miss in part is refused by name (its missed
        part would be released without clipping, or dropped)."""
        assert self.grads is not None
        self._checked_consistency = True
        totals = grad_samples.weighted_sum(torch.ones(batch, device=params[0].device))
        names = {p: n for n, p in self.module.named_parameters()} if self.module is not None else {}
        gaps = missed_gradients(params, totals, self.grads._scale(batch), names)
        if gaps:
            self._drop_step()
            message = self.grads.checks.missed_use_message([n for n, _ in gaps])
            raise DPConfigurationError(message)

    def _drop_step(self) -> None:
        """A refused release: the per-example gradients captured and any pending chunks are dropped, so
        nothing of this step reaches a later one."""
        assert self.grads is not None
        self.grads.clear()
        self._chunks.drop()

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Let the step slot move the weights with the private gradient of the pending step."""
        ctx = self._pending_ctx
        assert ctx is not None
        self._pending_ctx = None
        self.step_slot.step(optimizer, ctx)
