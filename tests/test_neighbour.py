"""The neighbour test on every model and mechanism the suite trains: one example moves the clipped
sum by at most its sensitivity (C for flat clipping); models that mix examples move it further.

DPIS is not in the list: its batch and its weights depend on the N~ and K~ released at the epoch start,
so one step on D and one on D minus an example are not a coupled pair. The sensitivity check does run
under DPIS (tests/checks/test_mixing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyModule
from neighbour import BatchStandardised, Mixup, TinyLM, tiny_data, token_data
from per_example.test_capture import ConvModel, SequenceModel
from torch.utils.data import TensorDataset

from lightning_dp import (
    AdaCliP,
    AdaptiveGD,
    AutoClipping,
    DPStrategy,
    FixedSize,
    HeavyBall,
    L1Clipping,
    LineSearch,
    MultiStageNesterov,
    QuantileClipping,
)
from lightning_dp.noise import NoiseDividing
from recipes.accelerated import PaperLogisticRegression
from recipes.classifier import ImageClassifier
from recipes.linear import LinearClassifier

C = 1e-3  # tiny: every contribution is clipped, so each one is exactly C (the worst case)


def _images(shape: tuple[int, ...], n: int = 6, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))


def _signs(d: int, n: int = 6) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    )


def _tiny(module: TinyModule) -> tuple[TinyModule, TensorDataset]:
    return module, tiny_data(module, 6)


def _dp(slots: Callable[[], dict[str, Any]] = dict, **kwargs: Any) -> Callable[[], DPStrategy]:
    """σ = 0, C = ``C``, fixed seed; ``slots()`` builds fresh slot objects for each of the two runs."""
    kwargs.setdefault("noise_multiplier", 0.0)
    return lambda: DPStrategy(max_grad_norm=C, seed=0, **slots(), **kwargs)


MODELS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "tiny_mlp": lambda: _tiny(TinyModule()),
    "sequence_embedding_layernorm": lambda: _tiny(SequenceModel()),
    "conv_groupnorm": lambda: _tiny(ConvModel()),
    "token_lm_per_example": lambda: (TinyLM(token_mean=False), token_data()),
    "recipe_mlp": lambda: (ImageClassifier("mlp", in_features=64, hidden=[16]), _images((64,))),
    "recipe_logreg": lambda: (ImageClassifier("logreg", in_features=64), _images((64,))),
    "recipe_tramer_boneh_cnn": lambda: (ImageClassifier("tramer_boneh_cnn"), _images((1, 28, 28))),
    "recipe_digits_cnn": lambda: (ImageClassifier("digits_cnn"), _images((1, 8, 8))),
    "recipe_scatternet_cnn": lambda: (ImageClassifier("scatternet_cnn", in_features=81), _images((81, 7, 7))),
    "recipe_linear_hinge": lambda: (LinearClassifier(in_features=8, loss="hinge"), _signs(8)),
    "recipe_paper_logreg": lambda: (PaperLogisticRegression(d=8), _signs(8)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_moves_the_sum_by_at_most_c(name, neighbour):
    module, data = MODELS[name]()
    move = neighbour.neighbour_move(module, data, _dp())
    neighbour.assert_neighbour_bound(move, bound=C)


MECHANISMS: dict[str, tuple[Callable[[], DPStrategy], str, float | None]] = {
    # name: (strategy, norm of the bound, bound: None = the sensitivity the noise is calibrated for)
    "materialize": (_dp(grad_sample_mode="materialize"), "l2", C),
    "virtual_batching": (_dp(max_physical_batch_size=2), "l2", C),
    "loss_reduction_sum": (_dp(loss_reduction="sum"), "l2", C),
    "adaclip": (_dp(lambda: {"clipping": AdaCliP(h2=1e-2)}), "l2", None),
    "heavy_ball": (_dp(lambda: {"step": HeavyBall(beta=0.5)}), "l2", C),
    # σ > 0 where the mechanism needs it: the hook reads the sum before the noise is added
    "line_search": (_dp(lambda: {"step": LineSearch(seed=0)}, noise_multiplier=1.0), "l2", C),
    "dp_agd": (_dp(lambda: {"step": AdaptiveGD()}, noise_multiplier=None, target_epsilon=1.0), "l2", C),
    "fixed_size_l1_laplace": (
        _dp(
            lambda: {
                "sampler": FixedSize(seed=0),
                "clipping": L1Clipping(),
                "noise": NoiseDividing(privacy="paper"),
                "step": MultiStageNesterov(lr=0.1, mu=0.1, L=1.0, n1=3),
            },
            accountant="pure",
            target_epsilon=1.0,
            noise_multiplier=None,
        ),
        "l1",
        C,
    ),
}


ADAPTIVE: dict[str, Callable[[], DPStrategy]] = {
    # step 0's C_t is C_0 (QuantileClipping sets C itself); AutoClipping normalises to just below C
    "quantile": lambda: DPStrategy(noise_multiplier=0.0, seed=0, clipping=QuantileClipping(initial_norm=C)),
    "auto": _dp(lambda: {"clipping": AutoClipping()}),
}
FAST_PATH_FAMILIES = ("tiny_mlp", "conv_groupnorm", "sequence_embedding_layernorm", "token_lm_per_example")
"""Linear; Conv + GroupNorm; Embedding + LayerNorm + Linear over sequences; Embedding + Linear over tokens (every
zoo model's contributions: tests/clipping/test_adaptive.py)."""


@pytest.mark.parametrize("clipping", sorted(ADAPTIVE))
@pytest.mark.parametrize("name", FAST_PATH_FAMILIES)
def test_adaptive_clippings_move_the_sum_by_at_most_c_t_on_every_fast_path_family(name, clipping, neighbour):
    module, data = MODELS[name]()
    move = neighbour.neighbour_move(module, data, ADAPTIVE[clipping])
    assert move.sensitivity == C  # the released step's C_t (QuantileClipping: C_0)
    neighbour.assert_neighbour_bound(move, bound=C)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_every_mechanism_moves_the_sum_by_at_most_its_sensitivity(name, neighbour):
    make_strategy, norm, bound = MECHANISMS[name]
    module, data = _tiny(_SumLoss() if name == "loss_reduction_sum" else TinyModule())
    if name in ("dp_agd", "line_search"):  # evaluate the loss at candidate weights through dp_per_sample_loss
        module, data = MODELS["recipe_mlp"]()
    move = neighbour.neighbour_move(module, data, make_strategy)
    neighbour.assert_neighbour_bound(move, norm=norm, bound=bound)


class _SumLoss(TinyModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, reduction="sum")


@pytest.mark.parametrize(("model", "n"), [(Mixup, 8), (BatchStandardised, 4)])
def test_examples_mixed_in_the_forward_move_the_sum_beyond_c_without_the_check(model, n, neighbour):
    module = model()
    move = neighbour.neighbour_move(module, tiny_data(module, n), _dp(check_sensitivity=False))
    assert move.l2 > C * (1 + 10 * neighbour.MOVE_RTOL)


def test_a_token_mean_loss_moves_the_sum_beyond_c_without_the_check(neighbour):
    """Unclipped gradients (C = 1): the long last example shrinks every other example's weight."""
    move = neighbour.neighbour_move(
        TinyLM(token_mean=True),
        token_data(),
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, seed=0, check_sensitivity=False),
    )
    assert move.l2 > 1.0 * (1 + 10 * neighbour.MOVE_RTOL)
    fixed = neighbour.neighbour_move(
        TinyLM(token_mean=False),
        token_data(),
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, seed=0),
    )
    neighbour.assert_neighbour_bound(fixed, bound=1.0)
