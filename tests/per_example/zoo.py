"""A zoo of models users bring, in tiny configurations with random weights (no downloads).

Each :class:`ZooModel` builds a module whose forward takes one batch (a tuple of batch-first tensors,
the last being the target) and returns the batch-mean loss, so any test can compare per-example
gradients with autograd on each example alone, or run a private step through the Trainer
(:func:`zoo_lightning_module`). ``ZOO`` is the parametrized list other tests import (for example the
neighbour test: one private step with and without an example).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

B, T, V, D, CLASSES = 3, 6, 23, 16, 3
"""Batch, sequence length (≠ B, so a sequence-first mix-up cannot pass), vocabulary, width, classes."""


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], nn.Module]
    """The model (its forward: batch tensors → batch-mean loss), float32, random weights."""
    batch: Callable[[torch.Generator], tuple[Tensor, ...]]
    """B examples, every tensor batch first."""
    on_batchnorm: str = "raise"

    def __repr__(self) -> str:
        return self.name


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


def _tokens(g: torch.Generator) -> tuple[Tensor, ...]:
    """Token ids 1..V-1 (0 is padding) and a class per example."""
    return torch.randint(1, V, (B, T), generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def _tokens_with_lengths(g: torch.Generator) -> tuple[Tensor, ...]:
    """Token ids zero-padded after each example's length (lengths 2..T, the longest not first)."""
    ids, y = _tokens(g)
    lengths = torch.tensor([3, T, 2, 5])[:B]
    ids = ids * (torch.arange(T) < lengths.unsqueeze(1))
    return ids, lengths, y


def _features(g: torch.Generator) -> tuple[Tensor, ...]:
    return torch.randn(B, T, D, generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def _images(g: torch.Generator, size: int = 16) -> tuple[Tensor, ...]:
    return torch.randn(B, 3, size, size, generator=g), torch.randint(0, CLASSES, (B,), generator=g)


# --------------------------------------------------------------------------------------------------
# Wrappers: batch → mean loss
# --------------------------------------------------------------------------------------------------


class Classifier(nn.Module):
    """``body`` maps the inputs to logits [B, CLASSES]; the loss is cross-entropy, batch mean."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *batch: Tensor) -> Tensor:
        return F.cross_entropy(self.body(*batch[:-1]), batch[-1])


class HFClassifier(nn.Module):
    """A Hugging Face sequence classifier: (input_ids, y) → its own mean loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, y: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=y).loss


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM: (input_ids, unused target) → next-token loss, mean over equal-length rows."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, y: Tensor) -> Tensor:
        del y
        return self.model(input_ids=ids, labels=ids).loss


class Recurrent(nn.Module):
    """Embedding → RNN → Linear on the final hidden state; sequence-first RNNs get transposed inputs,
    ``packed`` feeds a PackedSequence built from the lengths."""

    def __init__(self, kind: str, batch_first: bool, packed: bool = False, **options: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=0)
        if kind == "DPLSTM":
            from opacus.layers import DPLSTM

            self.rnn: nn.Module = DPLSTM(D, D, batch_first=batch_first, **options)
        else:
            self.rnn = getattr(nn, kind)(D, D, batch_first=batch_first, **options)
        directions = 2 if options.get("bidirectional") else 1
        self.head = nn.Linear(D * directions, CLASSES)
        self.batch_first, self.packed, self.lstm = batch_first, packed, kind in ("LSTM", "DPLSTM")

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        x = self.embed(ids)
        if not self.batch_first:
            x = x.transpose(0, 1)
        if self.packed:
            # pack_padded_sequence takes its lengths on the CPU (a CUDA run moves the whole batch)
            x = pack_padded_sequence(x, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        _, state = self.rnn(x)
        h = state[0] if self.lstm else state  # [layers·directions, B, D]
        directions = 2 if self.rnn.bidirectional else 1
        return self.head(h[-directions:].transpose(0, 1).reshape(ids.shape[0], -1))


class Attention(nn.Module):
    """Embedding → nn.MultiheadAttention (self or cross) with a key padding mask → mean-pool → Linear."""

    def __init__(self, batch_first: bool, cross: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        self.other = nn.Linear(D, D) if cross else None
        self.head = nn.Linear(D, CLASSES)
        self.batch_first = batch_first

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        x = self.embed(ids)
        pad = torch.arange(ids.shape[1], device=ids.device) >= lengths.unsqueeze(1)
        kv = x if self.other is None else self.other(x)
        q, kv = (x, kv) if self.batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
        out, _ = self.attn(q, kv, kv, key_padding_mask=pad)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


class Encoder(nn.Module):
    """Embedding + learned positions → 2-layer nn.TransformerEncoder with padding mask → Linear."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, CLASSES)
        self.batch_first = batch_first

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(positions)
        pad = positions >= lengths.unsqueeze(1)
        x = x if self.batch_first else x.transpose(0, 1)
        x = self.encoder(x, src_key_padding_mask=pad)
        x = x if self.batch_first else x.transpose(0, 1)
        return self.head(x[:, 0])


class NanoGPT(nn.Module):
    """nanoGPT's shape: wte + wpe(arange(T)), pre-norm causal blocks, lm_head tied to wte."""

    def __init__(self, layers: int = 1, heads: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(_GPTBlock(heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor, y: Tensor) -> Tensor:
        del y
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))


class _GPTBlock(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        Bx, Tx, _ = x.shape
        q, k, v = (
            t.reshape(Bx, Tx, self.heads, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).chunk(3, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bx, Tx, D)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class ScaleShift(nn.Module):
    """A custom layer with no fast kernel: a per-channel affine map, times a constant mask held as a
    buffer when ``buffer`` (never updated: not batch statistics)."""

    def __init__(self, channels: int, buffer: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))
        self.shift = nn.Parameter(torch.zeros(channels))
        mask = torch.linspace(0.5, 1.5, channels)
        if buffer:
            self.register_buffer("mask", mask)
        else:
            self.mask = nn.Parameter(mask, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        c = (1, -1, 1, 1)
        return x * (self.scale * self.mask).view(c) + self.shift.view(c)


class ChannelsLastCNN(nn.Module):
    """Conv → ScaleShift → ReLU → Conv → pool → Linear, on channels_last inputs."""

    def __init__(self, buffer: bool = False) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, stride=2)
        self.scale = ScaleShift(8, buffer)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        x = self.conv2(torch.relu(self.scale(self.conv1(x))))
        return self.head(x.mean((2, 3)))


# --------------------------------------------------------------------------------------------------
# Hugging Face, timm, torchvision (imported once, on first use)
# --------------------------------------------------------------------------------------------------


def _bert(lora: bool = False) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=T + 2,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    return HFClassifier(_lora(model, ["query", "value"]) if lora else model)


def _gpt2_classifier() -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(
        vocab_size=V,
        n_embd=D,
        n_layer=1,
        n_head=2,
        n_positions=T + 2,
        num_labels=CLASSES,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return HFClassifier(GPT2ForSequenceClassification(config))


def _gpt2_lm() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=V,
        n_embd=D,
        n_layer=1,
        n_head=2,
        n_positions=T + 2,
        bos_token_id=1,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return HFCausalLM(GPT2LMHeadModel(config))


def _llama(lora: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=T + 2,
    )
    model = LlamaForCausalLM(config)
    return HFCausalLM(_lora(model, ["q_proj", "v_proj"]) if lora else model)


def _lora(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets))


def _vit() -> nn.Module:
    import timm

    body = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=8,
        embed_dim=D,
        depth=1,
        num_heads=2,
        num_classes=CLASSES,
    )
    return Classifier(body)


def _convnext() -> nn.Module:
    from timm.models.convnext import ConvNeXt

    return Classifier(ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=CLASSES, patch_size=2))


def _timm_resnet_groupnorm() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    def group_norm(channels: int, **kwargs: Any) -> nn.Module:
        return nn.GroupNorm(4, channels)

    return Classifier(
        ResNet(
            BasicBlock,
            (1, 1, 1, 1),
            channels=(8, 8, 16, 16),
            stem_width=8,
            num_classes=CLASSES,
            norm_layer=group_norm,
        )
    )


def _torchvision_resnet18() -> nn.Module:
    from torchvision.models import resnet18

    return Classifier(resnet18(num_classes=CLASSES))


def _classify(body: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: Classifier(body(*args, **kwargs))


ZOO: list[ZooModel] = [
    ZooModel("hf_bert", _bert, _tokens),
    ZooModel("hf_bert_lora", functools.partial(_bert, lora=True), _tokens),
    ZooModel("hf_gpt2_classifier", _gpt2_classifier, _tokens),
    ZooModel("hf_gpt2_lm_tied", _gpt2_lm, _tokens),
    ZooModel("hf_llama", _llama, _tokens),
    ZooModel("hf_llama_lora", functools.partial(_llama, lora=True), _tokens),
    ZooModel("timm_vit", _vit, _images),
    ZooModel("timm_convnext", _convnext, functools.partial(_images, size=32)),
    ZooModel("timm_resnet_groupnorm", _timm_resnet_groupnorm, _images),
    ZooModel("torchvision_resnet18", _torchvision_resnet18, _images, "replace"),
    ZooModel("lstm", _classify(Recurrent, "LSTM", True), _tokens_with_lengths),
    ZooModel(
        "lstm_seq_first_2_layers", _classify(Recurrent, "LSTM", False, num_layers=2), _tokens_with_lengths
    ),
    ZooModel(
        "lstm_packed_bidirectional",
        _classify(Recurrent, "LSTM", True, True, bidirectional=True),
        _tokens_with_lengths,
    ),
    ZooModel("gru_seq_first_packed", _classify(Recurrent, "GRU", False, True), _tokens_with_lengths),
    ZooModel("gru", _classify(Recurrent, "GRU", True, bidirectional=True), _tokens_with_lengths),
    ZooModel("rnn_seq_first", _classify(Recurrent, "RNN", False), _tokens_with_lengths),
    ZooModel(
        "rnn_packed_relu", _classify(Recurrent, "RNN", True, True, nonlinearity="relu"), _tokens_with_lengths
    ),
    ZooModel("opacus_dplstm", _classify(Recurrent, "DPLSTM", True), _tokens_with_lengths),
    ZooModel("mha", _classify(Attention, True), _tokens_with_lengths),
    ZooModel("mha_seq_first_cross", _classify(Attention, False, cross=True), _tokens_with_lengths),
    ZooModel("transformer_encoder", _classify(Encoder, True), _tokens_with_lengths),
    ZooModel("transformer_encoder_seq_first", _classify(Encoder, False), _tokens_with_lengths),
    ZooModel("nanogpt_tied", NanoGPT, _tokens),
    ZooModel("channels_last_cnn_custom_layer", _classify(ChannelsLastCNN), _images),
    ZooModel("custom_layer_constant_buffer", _classify(ChannelsLastCNN, buffer=True), _images),
]


def zoo_model(name: str) -> ZooModel:
    return next(m for m in ZOO if m.name == name)


class ZooLightningModule(LightningModule):
    """A zoo model trained on ``n`` random examples (SGD), for steps through the Trainer."""

    def __init__(self, entry: ZooModel, n: int = 2 * B, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = entry.build()
        g = torch.Generator().manual_seed(seed)
        parts = [entry.batch(g) for _ in range(max(1, n // B))]
        self.data = tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*self.data), batch_size=B)


def zoo_lightning_module(entry: ZooModel, **kwargs: Any) -> ZooLightningModule:
    return ZooLightningModule(entry, **kwargs)


# --------------------------------------------------------------------------------------------------
# The table of per-example paths in docs/models.md
# --------------------------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
TABLE_START, TABLE_END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"


def path_summary(entry: ZooModel) -> dict[str, Counter[str]]:
    """Which path each trainable layer of the model takes: path → Counter of layer type names."""
    from lightning_dp.per_example import GradientCapture
    from lightning_dp.per_example.materialized import direct_params
    from lightning_dp.run.prepare import replace_batchnorm

    torch.manual_seed(0)
    model = entry.build()
    if entry.on_batchnorm == "replace":
        replace_batchnorm(model)
    grads = GradientCapture(model)
    try:
        summary: dict[str, Counter[str]] = {}
        for _, layer in grads.layers:
            if not direct_params(layer):  # frozen (LoRA's base layers): hooked, but nothing to clip
                continue
            summary.setdefault(grads.path_of(layer), Counter())[type(layer).__name__] += 1
        summary.setdefault(f"{grads.mode} mode", Counter())
        return summary
    finally:
        grads.remove()


def paths_table() -> str:
    """The Markdown table of docs/models.md, computed from the zoo."""
    order = ["fast", "formula", "functorch", "direct"]
    lines = [
        "| model | mode | " + " | ".join(order) + " |",
        "|---|---|" + "---|" * len(order),
    ]
    for entry in ZOO:
        summary = path_summary(entry)
        mode = next(k for k in summary if k.endswith(" mode")).removesuffix(" mode")
        cells = [
            ", ".join(f"{name}×{n}" for name, n in sorted(summary.get(path, Counter()).items())) or "–"
            for path in order
        ]
        lines.append(f"| {entry.name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_table() -> None:
    """Rewrite the table between the markers of docs/models.md (``python -m tests.per_example.zoo``)."""
    text = DOC.read_text()
    head, rest = text.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    DOC.write_text(f"{head}{TABLE_START}\n{paths_table()}\n{TABLE_END}{tail}")


if __name__ == "__main__":
    write_table()
