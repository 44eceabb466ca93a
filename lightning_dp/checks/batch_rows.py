"""Every layer call's rows are the batch's examples, each once, in order, and no call mixes them.

Per-example clipping takes row i of a layer call as example i. A call whose dimension 0 is not the batch
(time steps, parts of the batch, one row broadcast), whose rows were reordered or moved to dimension 1, a
batch split over several backward passes, or a BatchNorm that normalises with the batch's statistics
breaks that, and is refused before the release. Messages name layers, never a size of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_dp.core.errors import BatchDimensionError


def check_batch_dimension(
    calls: Sequence[tuple[nn.Module, int]], expected: int, layers: Sequence[tuple[str, nn.Module]]
) -> None:
    """Refuse when a layer call's dimension 0 is not ``expected`` examples (see docs/guarantees.md)."""
    bad = next(((m, size) for m, size in calls if size != expected), None)
    if bad is None:
        return
    module, size = bad
    name = next((n for n, m in layers if m is module), "") or "<root>"
    sizes = [n for m, n in calls if m is module]
    if len(sizes) > 1 and sum(sizes) == expected:
        raise BatchDimensionError(  # the calls' sizes are the batch's: the message names none of them
            f"Layer {name!r} ({type(module).__name__}) was called on parts of the batch (several calls whose "
            "rows together are the batch's examples) instead of once on the whole batch: per-example "
            "clipping takes the rows of one call as the batch's examples, and parts of a batch cannot be "
            "matched to the examples they hold. Likely cause: manual gradient accumulation (manual_backward "
            "once per part of a batch, then one optimizer step): call manual_backward once on the whole "
            "batch's loss, or let DPStrategy(max_physical_batch_size=...) split the batch under automatic "
            "optimization; or a forward that calls the layer on rows whose examples cannot be traced (taken "
            "through a reshape, h[i].view(1, -1)): take them as slices, h[i:i+1] (traced, exact), or call "
            "the layer once on the whole batch (fc(h))."
        )
    raise BatchDimensionError(
        f"Layer {name!r} ({type(module).__name__}) has {'fewer' if size < expected else 'more'} rows on its "
        f"batch dimension (dim 0) than this batch has examples. Likely cause: {_likely_cause(size, expected)}"
    )


def _likely_cause(size: int, expected: int) -> str:
    """Why a layer's dimension 0 is not the batch, by whether it is one row, fewer rows or more."""
    if size == 1:
        return (
            "an input of batch 1 broadcast over the batch (e.g. position embeddings looked up with batch 1): "
            "one gradient would stand for every example, which clipping cannot bound. Look it up per example "
            "(expand the input to the batch size before the layer). A layer called on one row of the batch "
            "(fc(h[i:i+1])) or on the batch as one set (h.unsqueeze(0)) must be called on the whole batch "
            "with the examples on dimension 0."
        )
    if size < expected:
        return (
            "a forward over a subset of the batch's rows (the model run on x[mask], e.g. the labelled "
            "examples only: a copy whose rows cannot be traced to the examples): run the model on the whole "
            "batch and zero the loss of the rows not used (per-example losses multiplied by the mask, "
            "summed, divided by the batch size), or select rows of a hidden state (head(body(x)[mask]), "
            "traced and exact). Or "
            "sequence-first (time-major) tensors or a reshaped batch: keep the batch on dimension 0 and build "
            "recurrent and attention layers with batch_first=True."
        )
    return (
        "sequence-first (time-major) tensors or a reshaped batch: per-example clipping takes dimension 0 "
        "as the examples, so it would clip each time step or row instead. Build nn.LSTM, nn.GRU, nn.RNN, "
        "nn.MultiheadAttention and nn.Transformer* with batch_first=True, keep the batch on dimension 0 "
        "(no transpose or view(B * T, ...) before a trainable layer)."
    )


DISAGREEING_MESSAGE = (
    "Per-example gradients disagree on the batch size: every layer must see the batch on dimension 0."
)
"""The refusal for materialised per-example gradients of different numbers of rows."""


def reordered_message(names: list[str]) -> str:
    """The refusal for layers called on the batch's rows reordered (``per_example.rows.reordered_rows``)."""
    return (
        f"The layers {names} are called on the batch's rows reordered by an index (h[perm], index_select) "
        "that no earlier reordering undoes, so their rows are not the examples of the layers before them in "
        "order (nor of the layers after them): each example's per-example gradient would mix the rows of "
        "different examples. "
        "Likely cause: the batch sorted by length for pack_padded_sequence(..., enforce_sorted=True) and the "
        "order restored by hand (h[-1][inverse]). Pass the unsorted batch with "
        "pack_padded_sequence(..., enforce_sorted=False), which sorts and restores the order inside the "
        "packed sequence (exact); any other reordering of rows must be undone before the next layer is called "
        "(h[perm][inverse]), or mixes examples."
    )


def time_major_message(names: list[str]) -> str:
    """The refusal for layers called on a tensor whose batch was moved to dimension 1."""
    return (
        f"The layers {names} are called on a time-major tensor: its batch is on dimension 1 (a "
        "transpose(0, 1), .t() or permute of the batch, the [time, batch, ...] layout batch_first=False "
        "layers use), so their dimension 0 holds time steps, which per-example clipping would take for "
        "examples. This step releases nothing. Keep the batch on dimension 0 up to every trainable layer: "
        "feed [batch, time, ...] tensors, build nn.LSTM/GRU/RNN/MultiheadAttention/Transformer* with "
        "batch_first=True (a batch_first=False one is also handled exactly, fed the time-major tensor "
        "directly), and transpose back before a Linear or Embedding."
    )


def partial_backwards_message() -> str:
    """The refusal for several backward passes over parts of one batch before its release."""
    return (
        "Several backward passes over parts of one sampled batch (manual gradient accumulation: "
        "manual_backward once per part, then one optimizer step) before its release: each part's loss is a "
        "mean over the part, so each example's gradient depends on how the batch was split, and the private "
        "step is one release per sampled batch. Call manual_backward once on the whole batch's loss; if the "
        "batch does not fit in memory, use DPStrategy(max_physical_batch_size=...) with automatic "
        "optimization, which splits it and adds the noise once."
    )


def batch_statistics_message(names: list[str]) -> str:
    """The refusal for BatchNorm layers called with the batch's statistics during a private step."""
    return (
        f"The BatchNorm layers {names} normalised this step's batch with its own statistics (train mode, or "
        "track_running_stats=False): each example's output depends on the other examples of the batch, and "
        "the running statistics it updates are saved with the model without noise. This step releases "
        "nothing. Freeze them in eval mode, so that they normalise with their running statistics (an "
        "affine map of each example alone): layer.eval() in on_train_epoch_start (Lightning sets every "
        "module to train mode before each epoch), a BaseFinetuning callback whose finetune_function calls "
        "layer.eval() (freeze(..., train_bn=False) alone stops their weights but leaves them in train mode), "
        "or a train() override that keeps them in eval; their affine weights may keep training. Or replace "
        "them with GroupNorm, or pass DPStrategy(on_batchnorm='replace')."
    )
