"""Per-example gradients of parameters whose dimension 0 is 1, and of the layers the reviewer found wrong or
crashing (issue: per-example exactness failures): each exact against autograd on every example alone (fp64,
batches of 1, 2 and 8: at 1, dimension 0 of 1 is the batch's), or refused by name before any release.

- a (1,) offset or temperature next to a (B, 1), (B, C) or (B, T, D) tensor, a (1, 1, H) GRU ``h0``, a (1, D)
  bias, a (1, T, D) ``pos_embed`` and a (1, 1, D) ``cls_token``: exact (never a (B, B) broadcast);
- norm layers without bias or weight on the materialise path; ``EmbeddingBag(per_sample_weights=...)``;
- a batch sorted for ``pack_padded_sequence(enforce_sorted=True)`` and unsorted by hand: refused, naming the
  layer and ``enforce_sorted=False`` (which is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule
from lightning.pytorch import seed_everything
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from lightning_dp import DPConfigurationError
from lightning_dp.per_example import GradientCapture, vmap
from tests.per_example.test_capture_cases import assert_exact_clipped_sum, assert_refused_before_release

D, T, H, CLASSES = 4, 3, 5, 3


def _sequence(x: Tensor) -> Tensor:
    """[B, D] → [B, T, D]: each position a different multiple of the example."""
    return x.unsqueeze(1) * torch.arange(1.0, T + 1, dtype=x.dtype).view(1, T, 1)


class Offset(nn.Module):
    """A (1,) offset added to a (B, 1) regression output, (B, C) logits or a (B, T, D) sequence."""

    def __init__(self, target: str) -> None:
        super().__init__()
        width = {"B1": 1, "BC": CLASSES, "BTD": D}[target]
        self.mlp = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, width))
        self.offset = nn.Parameter(torch.tensor([0.3]))
        self.target = target

    def forward(self, x: Tensor) -> Tensor:
        if self.target == "BTD":
            return (self.mlp(_sequence(x)) + self.offset).tanh().sum(1)[:, :CLASSES]
        out = self.mlp(x) + self.offset  # then a class scale: a uniform shift of logits has no gradient
        return out * torch.tensor([1.0, -1.0, 0.5], dtype=x.dtype)


class Temperature(nn.Module):
    """Logits divided by a (1,) temperature, or scaled by exp of a (1,) log-temperature."""

    def __init__(self, log: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, CLASSES)
        self.t = nn.Parameter(torch.tensor([0.2 if log else 1.5]))
        self.log = log

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.t.exp() if self.log else self.lin(x) / self.t


class InitialState(nn.Module):
    """A GRU whose learnable (1, 1, H) initial state is made the batch's as users write it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.gru = nn.GRU(D, H, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(1, 1, H) * 0.3)
        self.head = nn.Linear(H, CLASSES)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        B = len(x)
        h0 = {
            "expand-contiguous": lambda: self.h0.expand(-1, B, -1).contiguous(),
            "expand-sizes": lambda: self.h0.expand(1, B, H).contiguous(),
            "repeat": lambda: self.h0.repeat(1, B, 1),
        }[self.how]()
        _, h = self.gru(_sequence(x), h0)
        return self.head(h[-1])


class Tokens(nn.Module):
    """ViT's prefix: a (1, 1, D) cls token expanded to the batch, a (1, T+3, D) position table sliced to the
    sequence (minGPT's ``pos_emb[:, :t, :]``) and added."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(D, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, T + 3, D))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), self.patch(_sequence(x))], 1)
        return self.head(torch.tanh(h + self.pos_embed[:, : h.shape[1], :]).mean(1))


class RowBias(nn.Module):
    """A (1, D) bias added to (B, D) hidden rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(1, D))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(x) + self.bias))


def _norms() -> nn.Module:
    """RMSNorm (materialise path only) beside norm layers without bias."""
    group, instance = nn.GroupNorm(1, 2), nn.InstanceNorm1d(2, affine=True)
    group.bias, instance.bias = None, None
    return nn.Sequential(
        nn.RMSNorm(D),
        nn.LayerNorm(D, bias=False),
        nn.Unflatten(1, (2, 2)),
        group,
        instance,
        nn.Flatten(),
        nn.Linear(D, CLASSES),
    )


class WeightedBag(nn.Module):
    """EmbeddingBag(sum) over each example's tokens, weighted per token (``per_sample_weights`` only)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(7, D, mode="sum")
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        tokens = (x.abs() * 3).long().clamp(max=6)  # [B, D] token ids
        return self.head(self.bag(tokens, per_sample_weights=x.sigmoid()))


class PackedGRU(nn.Module):
    """A GRU over a PackedSequence of each example's own length; ``by_hand``: the batch is sorted by length
    for ``enforce_sorted=True`` and the order restored before the head, else ``enforce_sorted=False``."""

    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        self.gru = nn.GRU(D, H, batch_first=True)
        self.head = nn.Linear(H, CLASSES)
        self.by_hand = by_hand

    def forward(self, x: Tensor) -> Tensor:
        lengths = 1 + (x[:, 0].abs() * 10).long() % T
        seq = _sequence(x)
        if not self.by_hand:
            packed = pack_padded_sequence(seq, lengths, batch_first=True, enforce_sorted=False)
            return self.head(self.gru(packed)[1][-1])
        lengths, order = lengths.sort(descending=True)
        packed = pack_padded_sequence(seq[order], lengths, batch_first=True)
        return self.head(self.gru(packed)[1][-1][order.argsort()])


class PackedOffset(nn.Module):
    """A (1,) offset added to a sequence packed for a GRU: the container's forward cannot be recomputed
    one example at a time (``vmap`` over the lengths), so it is pulled back per example with autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(D, H, batch_first=True)
        self.head = nn.Linear(H, CLASSES)
        self.offset = nn.Parameter(torch.tensor([0.3]))

    def forward(self, x: Tensor) -> Tensor:
        lengths = 1 + (x[:, 0].abs() * 10).long() % T
        packed = pack_padded_sequence(
            _sequence(x) + self.offset, lengths, batch_first=True, enforce_sorted=False
        )
        return self.head(self.gru(packed)[1][-1])


class Reordered(nn.Module):
    """The hidden rows reordered before the head: ``undone`` restores the order before the head (exact),
    else the head runs on the reordered rows and the output is put back after it (refused)."""

    def __init__(self, undone: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.head = nn.Linear(D, CLASSES)
        self.undone = undone

    def forward(self, x: Tensor) -> Tensor:
        perm = torch.arange(len(x)).flip(0)
        h = torch.tanh(self.inp(x))[perm]
        if self.undone:
            return self.head(h.index_select(0, perm.argsort()))
        return self.head(h)[perm.argsort()]


class HiddenMixup(nn.Module):
    """Manifold mixup: each example's hidden row blended with another example's (``h[perm]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(0.5 * h + 0.5 * h[torch.arange(len(x)).flip(0)])


class SortedAfterALayer(nn.Module):
    """e37 with the sort applied to a layer's output: the GRU runs on sorted rows, the head on restored ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gru = nn.GRU(D, H, batch_first=True)
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        lengths, order = (1 + (x[:, 0].abs() * 10).long() % T).sort(descending=True)
        packed = pack_padded_sequence(self.inp(_sequence(x))[order], lengths, batch_first=True)
        return self.head(self.gru(packed)[1][-1][order.argsort()])


EXACT: dict[str, Callable[[], nn.Module]] = {
    "offset-into-packed-gru": PackedOffset,
    "reordered-and-restored": lambda: Reordered(undone=True),
    "offset-B1": lambda: Offset("B1"),
    "offset-BC": lambda: Offset("BC"),
    "offset-BTD": lambda: Offset("BTD"),
    "temperature": lambda: Temperature(log=False),
    "log-temperature": lambda: Temperature(log=True),
    "gru-h0-expand-contiguous": lambda: InitialState("expand-contiguous"),
    "gru-h0-expand-sizes": lambda: InitialState("expand-sizes"),
    "gru-h0-repeat": lambda: InitialState("repeat"),
    "cls-token-pos-embed": Tokens,
    "row-bias": RowBias,
    "norms-without-bias": _norms,
    "bag-per-sample-weights": WeightedBag,
    "packed-enforce-sorted-false": lambda: PackedGRU(by_hand=False),
}


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def _per_example(model: nn.Module, x: Tensor, y: Tensor) -> tuple[dict[nn.Parameter, Tensor], int]:
    """The capture's per-example gradients [B, *shape] of one batch, and how many layer calls it recomputed."""
    recomputed = 0
    original = vmap.per_example_grads

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal recomputed
        recomputed += 1
        return original(*args, **kwargs)

    grads = GradientCapture(model)
    try:
        vmap.per_example_grads = counting  # type: ignore[assignment]
        _loss(model, x, y).backward()
        samples, n = grads.collect()
        assert n == len(x)
        return dict(zip(samples.params, samples.materialize(), strict=True)), recomputed
    finally:
        vmap.per_example_grads = original  # type: ignore[assignment]
        grads.remove()


@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("name", list(EXACT))
def test_per_example_gradients_equal_autograd_on_each_example_alone(name: str, batch: int) -> None:
    torch.manual_seed(0)
    model = EXACT[name]().double().train()
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    alone = [torch.autograd.grad(_loss(model, x[i : i + 1], y[i : i + 1]), params) for i in range(batch)]
    got, _ = _per_example(model, x, y)
    names = {p: n for n, p in model.named_parameters()}
    assert set(got) == set(params)
    overall = max(float(g.abs().max()) for one in alone for g in one)
    for j, p in enumerate(params):
        expected = torch.stack([one[j] for one in alone])
        assert got[p].shape == (batch, *p.shape), names[p]  # never (B, B, ...)
        scale = float(expected.abs().max()) + 1e-9 * overall
        torch.testing.assert_close(got[p].double(), expected, rtol=0, atol=1e-5 * scale, msg=names[p])


@pytest.mark.parametrize(
    ("name", "recomputes"), [("cls-token-pos-embed", False), ("row-bias", False), ("offset-B1", True)]
)
def test_uses_in_line_with_the_batch_keep_the_expansion_and_only_the_others_are_recomputed(
    name: str, recomputes: bool
) -> None:
    """``x + pos_embed`` and ``cls_token.expand(B, ...)`` are per example as expanded (no recomputation of the
    container); ``(B, 1) + offset`` is not, and is recomputed per example instead."""
    torch.manual_seed(0)
    model = EXACT[name]().double().train()
    x = torch.randn(8, D, dtype=torch.float64)
    _, recomputed = _per_example(model, x, torch.zeros(8, dtype=torch.long))
    assert (recomputed > 0) is recomputes


class _OffsetBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
        self.offset = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x) + self.offset


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: PackedGRU(by_hand=True), ["head"]),
        (SortedAfterALayer, ["gru.ih_l0", "head"]),
        (lambda: Reordered(undone=False), ["head"]),
        (HiddenMixup, ["head"]),
    ],
    ids=["sorted-data", "sorted-hidden", "head-on-reordered-rows", "hidden-mixup"],
)
def test_a_layer_on_reordered_rows_is_refused_by_name_with_the_fix(build: Any, names: list[str]) -> None:
    torch.manual_seed(0)
    model = build().double().train()
    x = torch.randn(8, D, dtype=torch.float64)
    grads = GradientCapture(model)
    try:
        _loss(model, x, torch.zeros(8, dtype=torch.long)).backward()
        with pytest.raises(DPConfigurationError) as refusal:
            grads.collect()
    finally:
        grads.remove()
    assert f"The layers {names} are called on the batch's rows reordered" in str(refusal.value)
    assert "enforce_sorted=False" in str(refusal.value)


class OffsetRegression(TinyModule):
    """The reviewer's model: an MLP with a learnable (1,) output offset beside it, MSE on (B, 1) outputs."""

    def __init__(self) -> None:
        super().__init__(n=32, d=D, batch_size=8)
        self.net = _OffsetBody()
        self.y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y.to(x.dtype))


def test_an_output_offset_of_shape_1_is_exact_through_the_trainer_with_the_default_checks(neighbour):
    """One private step with the default checks (no refusal): the released clipped sum is Σ_i clip(g_i) and
    one example moves it by at most C."""
    seed_everything(0, verbose=False)
    assert_exact_clipped_sum(OffsetRegression(), 0.05, neighbour)


class SortedByHand(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=32, d=D, batch_size=8)
        self.net = PackedGRU(by_hand=True)


def test_a_batch_sorted_for_packing_and_unsorted_by_hand_is_refused_naming_the_layer_and_the_fix():
    assert_refused_before_release(SortedByHand(), "net.head", "enforce_sorted=False")
