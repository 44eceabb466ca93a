"""The models of issue #31 at the widths users train (random weights, no downloads), for
``bench/model_zoo.py --realistic``.

Each entry builds a module whose forward takes one batch (a tuple of batch-first tensors) and returns
the batch-mean loss, like the test zoo's (``tests/per_example/zoo.py``), and draws its full batch:

| key | model | batch |
| --- | --- | --- |
| ``bert`` | Hugging Face BERT classifier, d 256, 4 layers, 4 heads, FFN 1024, vocab 30522, 2 classes | 16 × 128 tokens |
| ``gpt2_lm`` | Hugging Face GPT-2 LM head (tied to ``wte``), d 256, 4 layers, 4 heads, vocab 50257, ``per_example_token_loss`` | 16 × 128 tokens |
| ``vit_s8`` | timm ``vit_small_patch8_224`` at 64 px (d 384, 12 layers, 6 heads, 65 tokens), 10 classes | 32 × 3 × 64 × 64 |
| ``resnet18_gn`` | timm ResNet-18 with ``GroupNorm(32, ·)`` for every BatchNorm, 10 classes | 32 × 3 × 64 × 64 |
| ``convnext_atto`` | timm ``convnext_atto`` (layer scale, LayerNorm2d, depthwise 7×7), 10 classes | 32 × 3 × 64 × 64 |
| ``resnet18_gn_32`` | the same ResNet-18 at CIFAR size (issue #51) | 256 × 3 × 32 × 32 |
| ``convnext_atto_32`` | the same ConvNeXt-atto at CIFAR size (issue #51) | 256 × 3 × 32 × 32 |
| ``wrn16_4`` | WideResNet-16-4 with ``GroupNorm(16, ·)`` (De et al. 2022; ``bench/wide_resnet.py``), 10 classes | 256 × 3 × 32 × 32 |
| ``lstm`` | ``Embedding(10000, 256)`` → ``nn.LSTM(256, 256, batch_first=True)`` → Linear on the last state, 2 classes | 64 × 64 tokens |
| ``mlp`` | ``bench/step_time.py``'s MLP 784-1000-10 | 256 × 784 |
| ``cnn`` | ``bench/step_time.py``'s Tramèr & Boneh MNIST CNN | 256 × 1 × 28 × 28 |

Dropout stays at each library's default (BERT and GPT-2: 0.1), as users train them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.wide_resnet import wide_resnet
from lightning_dp.core.losses import per_example_token_loss
from recipes.models import mlp, tramer_boneh_cnn

Batch = tuple[Tensor, ...]


@dataclass(frozen=True)
class RealisticModel:
    name: str
    title: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    on_batchnorm: str = "raise"


class Classify(nn.Module):
    """``body`` maps the inputs to logits; the loss is the batch-mean cross-entropy."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *batch: Tensor) -> Tensor:
        return F.cross_entropy(self.body(*batch[:-1]), batch[-1])


class HFClassify(nn.Module):
    """A Hugging Face sequence classifier: (input_ids, y) → its own mean loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, y: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=y).loss


class HFTokenLM(nn.Module):
    """A causal LM trained with ``per_example_token_loss`` (next-token loss, mean per example, then batch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        logits = self.model(input_ids=ids).logits
        return per_example_token_loss(logits, ids, shift=True).mean()


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 10_000, dim: int = 256, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: Tensor) -> Tensor:
        _, (h, _) = self.rnn(self.embed(ids))
        return self.head(h[-1])


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, num_labels=2
    )
    return HFClassify(BertForSequenceClassification(config))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return HFTokenLM(GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4)))


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return Classify(timm.create_model(name, pretrained=False, num_classes=10, **kwargs))

    return build


def _group_norm(channels: int, **kwargs: Any) -> nn.Module:
    return nn.GroupNorm(32, channels)


def _tokens(vocab: int, batch: int, length: int, classes: int | None) -> Callable[[torch.Generator], Batch]:
    def draw(g: torch.Generator) -> Batch:
        ids = torch.randint(1, vocab, (batch, length), generator=g)
        return (ids,) if classes is None else (ids, torch.randint(0, classes, (batch,), generator=g))

    return draw


def _images(shape: tuple[int, ...], batch: int) -> Callable[[torch.Generator], Batch]:
    def draw(g: torch.Generator) -> Batch:
        return torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)

    return draw


REALISTIC: list[RealisticModel] = [
    RealisticModel(
        "bert", "BERT classifier, d=256, 4 layers, T=128, B=16", _bert, _tokens(30522, 16, 128, 2)
    ),
    RealisticModel(
        "gpt2_lm",
        "GPT-2 LM, d=256, 4 layers, T=128, B=16 (per_example_token_loss)",
        _gpt2,
        _tokens(50257, 16, 128, None),
    ),
    RealisticModel(
        "vit_s8",
        "timm ViT-S/8 at 64 px, B=32",
        _timm("vit_small_patch8_224", img_size=64),
        _images((3, 64, 64), 32),
    ),
    RealisticModel(
        "resnet18_gn",
        "timm ResNet-18 with GroupNorm, 64 px, B=32",
        _timm("resnet18", norm_layer=_group_norm),
        _images((3, 64, 64), 32),
    ),
    RealisticModel(
        "convnext_atto", "timm ConvNeXt-atto, 64 px, B=32", _timm("convnext_atto"), _images((3, 64, 64), 32)
    ),
    RealisticModel(
        "resnet18_gn_32",
        "timm ResNet-18 with GroupNorm, 32 px, B=256",
        _timm("resnet18", norm_layer=_group_norm),
        _images((3, 32, 32), 256),
    ),
    RealisticModel(
        "convnext_atto_32",
        "timm ConvNeXt-atto, 32 px, B=256",
        _timm("convnext_atto"),
        _images((3, 32, 32), 256),
    ),
    RealisticModel(
        "wrn16_4",
        "WideResNet-16-4 with GroupNorm, 32 px, B=256",
        lambda: Classify(wide_resnet(16, 4)),
        _images((3, 32, 32), 256),
    ),
    RealisticModel(
        "lstm",
        "Embedding + LSTM(256), T=64, B=64",
        lambda: Classify(LSTMClassifier()),
        _tokens(10_000, 64, 64, 2),
    ),
    RealisticModel(
        "mlp", "bench MLP 784-1000-10, B=256", lambda: Classify(mlp(784, [1000], 10)), _images((784,), 256)
    ),
    RealisticModel(
        "cnn", "bench MNIST CNN, B=256", lambda: Classify(tramer_boneh_cnn()), _images((1, 28, 28), 256)
    ),
]
