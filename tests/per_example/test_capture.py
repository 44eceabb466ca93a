"""Fast clipping inside the strategy: same training as materialised per-example gradients, never materialised."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import TinyModule, make_trainer
from opacus.grad_sample import GradSampleHooks
from tolerances import assert_close_scaled
from torch import nn

from lightning_dp import DPStrategy, FlatClipping
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.per_example import GradientCapture


class SequenceModel(TinyModule):
    """Embedding → LayerNorm → Linear over tokens → mean-pool → Linear: sequence inputs and tied rows."""

    def __init__(self):
        super().__init__(n=96, batch_size=32)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 20, (96, 12), generator=g)
        self.y = (self.x[:, 0] % 3).long()
        self.net = nn.ModuleDict(
            {
                "emb": nn.Embedding(20, 8, padding_idx=0),
                "norm": nn.LayerNorm(8),
                "mix": nn.Linear(8, 8),
                "out": nn.Linear(8, 3),
            }
        )

    def forward(self, x):
        h = torch.tanh(self.net["mix"](self.net["norm"](self.net["emb"](x))))
        return self.net["out"](h.mean(1))


class ConvModel(TinyModule):
    def __init__(self):
        super().__init__(n=64, batch_size=16)
        self.x = torch.randn(64, 1, 12, 12, generator=torch.Generator().manual_seed(2))
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=2, padding=1),
            nn.GroupNorm(2, 4),
            nn.Tanh(),
            nn.Conv2d(4, 6, 3, dilation=2),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(6 * 2 * 2, 3),
        )


class Scale(nn.Module):
    """A layer with no fast formula (and no Opacus formula): per-coordinate learned scale."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


class MixedModel(TinyModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), Scale(16), nn.Tanh(), nn.Linear(16, 3))


class ReusedLayer(TinyModule):
    """The same Linear applied twice: its per-example norm has cross terms, so it must be materialised."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))

    def forward(self, x):
        h = torch.tanh(self.net[0](x))
        return self.net[1](torch.tanh(self.net[0](h)))


MODELS = {
    "mlp": TinyModule,
    "sequence": SequenceModel,
    "conv": ConvModel,
    "mixed": MixedModel,
    "reused": ReusedLayer,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_trains_exactly_like_materialised_gradients(name):
    torch.manual_seed(0)
    fast_model = MODELS[name]()
    slow_model = copy.deepcopy(fast_model)
    for model, mode in ((fast_model, "fast"), (slow_model, "materialize")):
        strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3, grad_sample_mode=mode)
        make_trainer(strategy, max_epochs=2).fit(model)
    for a, b in zip(fast_model.parameters(), slow_model.parameters(), strict=True):
        assert_close_scaled(a, b, rtol=1e-4)  # two epochs: relative to the layer's weights' scale


def test_auto_mode_is_fast_only_when_every_layer_supports_it():
    assert GradientCapture(TinyModule().net, mode="auto").mode == "fast"
    assert GradientCapture(ConvModel().net, mode="auto").mode == "fast"
    assert GradientCapture(MixedModel().net, mode="auto").mode == "materialize"
    mixed = GradientCapture(MixedModel().net, mode="fast")
    assert [mixed.path_of(m) for _, m in mixed.layers] == ["fast", "functorch", "fast"]


def test_fast_path_never_materialises_linear_gradients(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("per-example Linear gradients were materialised")

    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, nn.Linear, refuse)
    module = TinyModule()
    # The fit-start sensitivity check compares 4 examples' materialised gradients; the steps never do.
    make_trainer(DPStrategy(noise_multiplier=1.0, check_sensitivity=False), max_steps=3).fit(module)
    with pytest.raises(AssertionError, match="materialised"):
        make_trainer(
            DPStrategy(noise_multiplier=1.0, grad_sample_mode="materialize", check_sensitivity=False),
            max_steps=1,
        ).fit(TinyModule())


def test_fit_start_reports_the_path_of_every_layer():
    strategy = DPStrategy(noise_multiplier=1.0, grad_sample_mode="fast")
    make_trainer(strategy, max_steps=1).fit(MixedModel())
    line = strategy.clipping_paths
    assert "fast net.0:Linear, net.3:Linear" in line
    assert "functorch net.1:Scale" in line


def test_invalid_grad_sample_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be"):
        GradientCapture(TinyModule().net, mode="ghost")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["fast", "materialize"])
def test_both_paths_respect_embedding_padding_idx(mode):
    """The padding row gets no gradient (Opacus's own embedding formula would give it one)."""
    model = SequenceModel()
    model.net["emb"] = nn.Embedding(20, 8, padding_idx=0)
    model.x[:, -4:] = 0
    before = model.net["emb"].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*do not add up.*")
        make_trainer(
            DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, grad_sample_mode="fast"), max_steps=2
        ).fit(model)
    after = model.net["emb"].weight.detach()
    assert not torch.equal(before[1:], after[1:])
    assert torch.equal(after[0], before[0])


class InPlaceAfterFirstLayer(TinyModule):
    """A first layer followed by an in-place ReLU (torchvision's ResNet stem), then a frozen-weight path."""

    def __init__(self):
        super().__init__(n=64, batch_size=16)
        self.x = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(4))
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 3),
        )


@pytest.mark.parametrize("name", ["mlp", "sequence", "conv", "inplace"])
def test_book_keeping_skips_weight_gradients_and_changes_nothing(name, monkeypatch):
    """After the first step's consistency check, autograd computes no weight gradient (the private
    one is built from layer inputs and output gradients); the weights trained are the same."""
    factory = {**MODELS, "inplace": InPlaceAfterFirstLayer}[name]
    torch.manual_seed(0)
    skipping = factory()
    reference = copy.deepcopy(skipping)
    no_autograd_grad: list[bool] = []
    original = PrivateStepEngine.privatize

    def spy(self):
        no_autograd_grad.append(all(p.grad is None for p in self.params))
        return original(self)

    monkeypatch.setattr(PrivateStepEngine, "privatize", spy)
    make_trainer(DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3), max_epochs=2).fit(skipping)
    assert no_autograd_grad[0] is False, "the first step computes autograd's gradient for the check"
    assert len(no_autograd_grad) > 2
    assert all(no_autograd_grad[1:])
    monkeypatch.setattr(
        GradientCapture, "skip_param_grads", property(lambda s: False, lambda s, v: None), raising=False
    )
    make_trainer(DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3), max_epochs=2).fit(reference)
    for a, b in zip(skipping.parameters(), reference.parameters(), strict=True):
        assert a.requires_grad
        assert_close_scaled(a, b, rtol=1e-4)  # two epochs: relative to the layer's weights' scale


@pytest.mark.parametrize("name", ["sequence", "conv", "mixed", "reused"])
@pytest.mark.parametrize("kept", [0, 1, 5])
@pytest.mark.parametrize("norms_first", [True, False])
def test_sparse_weights_sum_only_their_rows_and_match_the_dense_sum(name, kept, norms_first, monkeypatch):
    """With few nonzero weights (DPIS's rejected candidates), the weighted sum reduces over those rows
    only; it equals the sum over the materialised per-example gradients, whatever the other rows hold."""
    from lightning_dp.per_example import gradients, kernels

    rows_seen: list[int] = []
    kernel, from_cache = kernels.weighted_grad, gradients.materialized_weighted_grad

    def spy(layer, activations, backprops, weights, cache=None):
        rows_seen.append(backprops.shape[0])
        assert cache is None or all(g.shape[0] == backprops.shape[0] for g in cache.values())
        return kernel(layer, activations, backprops, weights, cache)

    def spy_cached(samples, weights):  # released records (and non-fast layers) sum their cache
        rows_seen.extend(g.shape[0] for g in samples.values() if name in ("sequence", "conv"))
        return from_cache(samples, weights)

    monkeypatch.setattr(kernels, "weighted_grad", spy)
    monkeypatch.setattr(gradients, "materialized_weighted_grad", spy_cached)
    torch.manual_seed(0)
    model = MODELS[name]()
    grads = GradientCapture(model.net, loss_reduction="mean", mode="auto")
    x, y = model.x[:16], model.y[:16]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    per_example, batch = grads.collect()
    if norms_first:  # as in a step: the norms may cache per-example gradients for some layers
        per_example.sq_norms()
    weights = torch.zeros(batch)
    weights[torch.randperm(batch, generator=torch.Generator().manual_seed(1))[:kept]] = torch.rand(kept) + 0.5
    sparse = per_example.weighted_sum(weights)
    if name in ("sequence", "conv"):  # every layer has a fast kernel (the others materialise)
        assert rows_seen
    assert set(rows_seen) <= {kept}, "every fast layer reduces over the weighted rows only"
    full = per_example.materialize()
    for total, samples in zip(sparse, full, strict=True):
        expected = torch.einsum("i,i...->...", weights.double(), samples.double())
        assert_close_scaled(total.double(), expected, terms=batch)
    grads.remove()


class SequenceStack(nn.Module):
    """Sequence Linears and a LayerNorm (per-example gradients materialised, records released), then
    a Linear on pooled vectors (norm from input and output gradient, record kept for the sum)."""

    def __init__(self):
        super().__init__()
        self.first, self.norm, self.mix, self.out = (
            nn.Linear(6, 8),
            nn.LayerNorm(8),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )

    def forward(self, x):
        h = torch.tanh(self.mix(self.norm(self.first(x))))
        return self.out(h.mean(1))


def test_materialised_layers_release_their_inputs_during_the_backward():
    """A layer whose kernels materialise every per-example gradient keeps only those (no larger than
    its inputs and output gradient): its record drops the rest in the backward hook, so the memory is
    freed as in a plain backward; a layer that still needs its inputs for the sum keeps them."""
    torch.manual_seed(0)
    model = SequenceStack()
    grads = GradientCapture(model, mode="fast")
    grads.skip_param_grads = True
    storages = {}

    def keep_storage(module, inputs, output):
        storages[module] = inputs[0].untyped_storage()

    for layer in (model.norm, model.out):
        layer.register_forward_hook(keep_storage)
    x, y = torch.randn(16, 4, 6), torch.randint(0, 3, (16,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # the loss (and with it the autograd graph and its hooks) stays alive
    released = {r.module: r.released for r in grads.records}
    assert released == {model.first: True, model.norm: True, model.mix: True, model.out: False}
    assert all(r.norms is not None for r in grads.records), "norms are computed in the hook"
    use_count = torch._C._storage_Use_Count
    assert use_count(storages[model.norm]._cdata) == 1, "nothing but this test holds the released input"
    assert use_count(storages[model.out]._cdata) == 2, "the kept record still holds its input"
    fast, batch = grads.collect()
    reference = GradientCapture(model, mode="materialize")
    grads.remove()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected, _ = reference.collect()
    weights = torch.rand(batch)
    for got, want in zip(fast.weighted_sum(weights), expected.weighted_sum(weights), strict=True):
        assert_close_scaled(got, want, terms=batch)
    # the fast norms are certified (never below, at most their rounding bound above): relative only
    torch.testing.assert_close(fast.sq_norms(), expected.sq_norms(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["sequence", "conv"])
def test_two_backward_passes_before_collect_add_up_per_example(name):
    """A second backward before the step reaches each layer twice: the first pass's records were
    already reduced (and released) in its hooks, the second pass's see a shared layer. Together they
    still give each example the sum of its two gradients."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = model.x[:8], model.y[:8]
    grads = GradientCapture(model.net, mode="fast")
    grads.skip_param_grads = True
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert any(r.released for r in grads.records), "the first pass must release some records"
    assert_twice_one_pass(grads, model, x, y)


def assert_twice_one_pass(grads, model, x, y):
    """What ``grads`` collected is, per example, twice one materialised pass of ``model`` on (x, y)."""
    twice, _ = grads.collect()
    grads.remove()
    reference = GradientCapture(model.net, mode="materialize")
    torch.nn.functional.cross_entropy(model(x), y).backward()
    once, _ = reference.collect()
    reference.remove()
    for got, want in zip(twice.materialize(), once.materialize(), strict=True):
        assert_close_scaled(got, 2 * want, terms=x[0].numel())  # summed over its positions


def test_the_steps_sum_frees_each_layer_and_a_second_sum_is_refused():
    """With ``release_on_sum`` (set by the engine for the step's clipped sum) each layer's inputs,
    output gradient and cached per-example gradients are freed once its sum is taken; the norms stay,
    and anything that would need the freed terms raises instead of summing nothing."""
    torch.manual_seed(0)
    model = SequenceStack()
    grads = GradientCapture(model, mode="fast")
    grads.skip_param_grads = True
    x, y = torch.randn(6, 4, 6), torch.randint(0, 3, (6,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    per_example, batch = grads.collect()
    norms = per_example.sq_norms()
    per_example.release_on_sum = True
    per_example.weighted_sum(torch.ones(batch))
    assert all(r.spent and r.backprops is None and not r.cache and not r.activations for r in grads.records)
    torch.testing.assert_close(per_example.sq_norms(), norms, rtol=0, atol=0)  # kept, not recomputed
    for use in (lambda: per_example.weighted_sum(torch.ones(batch)), per_example.materialize):
        with pytest.raises(RuntimeError, match="freed after the step's clipped sum"):
            use()


def test_the_engine_frees_per_example_terms_in_its_last_sum_only(monkeypatch):
    """The first step's consistency check sums once before the clipped sum: only the clipped sum frees."""
    from lightning_dp.per_example import PerExampleGradients

    flags: list[bool] = []
    original = PerExampleGradients.weighted_sum

    def spy(self, weights):
        flags.append(self.release_on_sum)
        return original(self, weights)

    monkeypatch.setattr(PerExampleGradients, "weighted_sum", spy)
    off = {"check_sensitivity": False}  # spies on every weighted sum: the sensitivity check takes its own
    make_trainer(DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3, **off), max_steps=3).fit(
        TinyModule()
    )
    assert flags == [False, True, True, True]

    class Peeking(FlatClipping):  # reads the per-example gradients again after its sum
        def clip_and_sum(self, grad_samples, ctx):
            total = super().clip_and_sum(grad_samples, ctx)
            ctx.extras["first"] = grad_samples[0][:1].clone()
            return total

    assert FlatClipping().sums_once
    assert not Peeking().sums_once
    flags.clear()
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3, clipping=Peeking(), **off)
    make_trainer(strategy, max_steps=3).fit(TinyModule())
    assert flags == [False, False, False, False]


def test_in_a_lightning_fit_the_backward_hooks_take_the_norms_and_release(monkeypatch):
    """Lightning calls ``zero_grad`` between ``training_step`` and the backward; the forward's call
    counts must survive it, or no layer would take its norms in the hook and release its record."""
    seen: list[tuple[bool, bool]] = []
    original = GradientCapture._accumulate

    def spy(self, module, activations, grad, count):
        original(self, module, activations, grad, count)
        if self.path_of(module) == "fast":
            seen.append((self.records[-1].norms is not None, self.records[-1].released))

    monkeypatch.setattr(GradientCapture, "_accumulate", spy)
    torch.manual_seed(0)
    # spies on every backward hook: the sensitivity check's passes would add to it
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=0.1, seed=3, check_sensitivity=False)
    make_trainer(strategy, max_steps=3).fit(SequenceModel())
    assert len(seen) == 3 * 4, "four fast layers, three steps"
    assert all(eager for eager, _ in seen), "every norm is taken in the backward hook"
    assert sum(released for _, released in seen) == 3 * 2, "LayerNorm and the sequence Linear release"


def test_a_second_backward_through_the_same_forward():
    """retain_graph: a layer whose record kept its inputs is reached twice and materialised (each
    example gets the sum of both gradients); one whose inputs the first backward already released
    cannot be, and says so instead of failing inside a kernel."""
    torch.manual_seed(0)
    mlp = TinyModule()  # Linears on single vectors: their records keep their inputs
    x, y = mlp.x[:8], mlp.y[:8]
    grads = GradientCapture(mlp.net, mode="fast")
    grads.skip_param_grads = True
    loss = torch.nn.functional.cross_entropy(mlp(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_twice_one_pass(grads, mlp, x, y)

    stack = SequenceStack()
    grads = GradientCapture(stack, mode="fast")
    grads.skip_param_grads = True
    loss = torch.nn.functional.cross_entropy(stack(torch.randn(4, 3, 6)), torch.randint(0, 3, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        loss.backward()


def test_each_capture_times_its_convolutions_once_and_keeps_the_choice_to_itself():
    """The autotuner's cache belongs to the capture: one choice per conv layer shape over several batches
    of different sizes, and a second capture starts empty (no module-global state between runs)."""
    model = ConvModel()
    grads = GradientCapture(model.net, mode="fast")
    for batch in (5, 3):
        torch.nn.functional.cross_entropy(model(model.x[:batch]), model.y[:batch]).backward()
        grads.collect()[0].sq_norms()
        grads.clear()
    assert len(grads.conv_tuner.choices) == 2  # the two Conv2d layers, timed on the first batch only
    other = GradientCapture(copy.deepcopy(model.net), mode="fast")
    assert other.conv_tuner.choices == {}
    grads.remove()
    other.remove()


class _ScaledDropout(nn.Module):
    """A custom layer (no formula: recomputed per example) that draws random numbers in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.shift = nn.Parameter(torch.zeros(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training) * self.scale + self.shift * torch.rand_like(x)


def test_a_recomputed_layer_that_draws_random_numbers_is_replayed_exactly():
    """Its per-example gradients are each example's own, with the masks and draws of the real forward
    (the layer is run again from the random state its forward started from, then pulled back per example)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6).double(), _ScaledDropout(), nn.Tanh(), nn.Linear(6, 2).double())
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    capture = GradientCapture(net, loss_reduction="sum")
    torch.manual_seed(7)
    nn.functional.cross_entropy(net(x), y, reduction="sum").backward()
    samples, _ = capture.collect()
    got = dict(zip(capture.params, samples.materialize(), strict=True))
    capture.remove()
    for p in net.parameters():
        p.grad = None
    torch.manual_seed(7)  # the same masks: one forward, then each example's own loss pulled back
    losses = nn.functional.cross_entropy(net(x), y, reduction="none")
    for i in range(5):
        expected = torch.autograd.grad(losses[i], list(net.parameters()), retain_graph=True)
        for p, g in zip(net.parameters(), expected, strict=True):
            torch.testing.assert_close(got[p][i], g, rtol=1e-10, atol=1e-12)
