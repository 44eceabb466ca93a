"""What the strategy hands the engine: each input set by one method, read back as a property.

The strategy announces each sampled batch (``begin_batch``), each physical chunk of it (``begin_chunk``),
a batch the budget cannot pay for (``halt``), the train data, the model's earlier releases; a check says
whether it settled the loss's normalisation. Nothing else writes these (``tests/engine/test_inputs.py``
scans the package for attribute writes), so what a release reads is what was said of this batch.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from lightning_dp.core.batches import UnitInfo
from lightning_dp.engine.batch import Chunk, SampledBatch
from lightning_dp.per_example.gradients import SumSink
from lightning_dp.slots import StepContext


class GradientSink(Protocol):
    """Where the released gradient goes when the optimizer holds other tensors than the ones the hooks see
    (``dp_fsdp``: each rank's shard of a parameter whose full tensor the forward uses)."""

    def stepped(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter the optimizer steps for the hooked ``param``."""
        ...

    def assign(self, params: list[nn.Parameter], grads: list[Tensor]) -> None:
        """Hand each released gradient to the parameter the optimizer steps."""
        ...


class StepInputs:
    """The engine's inputs (its base class): the sampled batch, the chunk about to be backpropagated, the
    releases made from the batch, the budget's halt, the pending release, the train data, the sinks, the
    model's prior releases and whether the normalisation is settled."""

    def __init__(self) -> None:
        self._batch = SampledBatch()
        self._chunk = Chunk()
        self._releases_this_batch: int | None = None
        self._halted = False
        self._pending_ctx: StepContext | None = None
        self._train_data: tuple[Any, Any] | None = None
        self._gradient_sink: GradientSink | None = None
        self._sum_sink: SumSink | None = None
        self._prior_events = 0
        self._prior_num_samples: int | None = None
        self._normalisation_settled = False

    def begin_batch(self, realised: int | None, *, data: Any = None, units: UnitInfo | None = None) -> None:
        """A new sampled batch of ``realised`` examples (None: not known, unchecked), as user code sees it
        (``data``) with its rows' privacy units (None: each row its own): one release may be made from it, and
        every layer must see ``realised`` on its batch dimension."""
        self._batch = SampledBatch(realised, data, units)
        self._set_chunk(Chunk(realised, units))
        self._releases_this_batch = 0
        self._halted = False

    def begin_chunk(self, rows: int | None, units: UnitInfo | None) -> None:
        """Virtual batching: the next backward is one physical chunk of ``rows`` rows holding whole units,
        ``units`` its own unit map (renumbered from 0): each unit is clipped once, over all its rows."""
        self._set_chunk(Chunk(rows, units))

    def _set_chunk(self, chunk: Chunk) -> None:
        self._chunk = chunk
        self._expect_rows(chunk.rows)

    def _expect_rows(self, rows: int | None) -> None:
        """The engine's hook: the next backward has ``rows`` rows (None: not known)."""

    def halt(self) -> None:
        """The budget cannot pay for this sampled batch: its optimizer steps release nothing and move nothing."""
        self._halted = True

    def share_release(self, ctx: StepContext) -> None:
        """One release stepped by several optimizers (a noise-only step): the next ``apply_step`` uses ``ctx``."""
        self._pending_ctx = ctx

    def use_train_data(self, dataset: Any, collate: Any) -> None:
        """The private train loader's data set and collate function (step slots that draw extra batches)."""
        self._train_data = (dataset, collate)

    def carry_prior(self, events: int, num_samples: int | None) -> None:
        """The model arrived with ``events`` ledger events released by an earlier strategy's fits, on a data
        set of ``num_samples``: they count in ε, and are not this engine's steps."""
        self._prior_events, self._prior_num_samples = events, num_samples

    def settle_normalisation(self, settled: bool) -> None:
        """Whether a check has told the two readings of :attr:`normalisation` apart (one passed, one not)."""
        self._normalisation_settled = settled

    @property
    def sampled_batch(self) -> SampledBatch:
        """The sampled batch of this step, as :meth:`begin_batch` announced it."""
        return self._batch

    @property
    def batch(self) -> Any:
        """The current logical batch as user code sees it (for loss probes)."""
        return self._batch.data

    @property
    def realised_batch(self) -> int | None:
        """Examples the sampler drew for the current sampled batch; None: unchecked."""
        return self._batch.realised

    @property
    def units(self) -> UnitInfo | None:
        """The privacy units of the rows about to be backpropagated (the chunk's under virtual batching);
        None: every row is its own unit."""
        return self._chunk.units

    @property
    def chunk_batch(self) -> int | None:
        """Examples in the physical chunk about to be backpropagated (virtual batching), else the batch."""
        return self._chunk.rows

    @property
    def releases_this_batch(self) -> int | None:
        """Noisy gradient releases made from the current sampled batch (None: not tracked)."""
        return self._releases_this_batch

    @property
    def halted(self) -> bool:
        """True for a sampled batch the budget cannot pay for (:meth:`halt`)."""
        return self._halted

    @property
    def pending_ctx(self) -> StepContext | None:
        """The release made for the next optimizer step (None: none pending)."""
        return self._pending_ctx

    @property
    def train_data(self) -> tuple[Any, Any] | None:
        """(dataset, collate_fn) of the private train loader (:meth:`use_train_data`)."""
        return self._train_data

    @property
    def gradient_sink(self) -> GradientSink | None:
        """None: the released gradient goes to ``p.grad`` of each hooked parameter (:meth:`use_sinks`)."""
        return self._gradient_sink

    @property
    def sum_sink(self) -> SumSink | None:
        """None: each clipped sum is formed whole; ``dp_fsdp``'s reduce-scatters it per FSDP unit as it is
        formed (the per-example gradients' ``weighted_sum`` then returns this rank's shards)."""
        return self._sum_sink

    @property
    def prior_events(self) -> int:
        """Ledger events of releases the model had before this engine trained it (:meth:`carry_prior`)."""
        return self._prior_events

    @property
    def prior_num_samples(self) -> int | None:
        """N of the data set those earlier releases were made on."""
        return self._prior_num_samples

    @property
    def normalisation_settled(self) -> bool:
        """True once a check told the two readings of :attr:`normalisation` apart."""
        return self._normalisation_settled
