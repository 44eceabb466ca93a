"""The speed part of ``bench/gpu_check.py``: plain vs lightning-dp vs Opacus per step on realistic models.

Each model (random weights from a config, no downloads) trains its own copies of the same initial model
on one fixed batch already on the device; the three variants run in interleaved rounds (the order
rotating), timed with ``bench/step_time.py``'s helpers (a device synchronisation at every phase boundary),
and the table reports medians and the peak of allocated memory in one step:

* plain         forward + loss (autocast bf16 for the transformers), backward, ``optimizer.step()``
* lightning-dp  ``PrivateStepEngine`` (Poisson, flat clipping, σ = 1, auto per-example path) attached to the
                model: forward + loss, backward, ``privatize()``, ``apply_step``
* opacus        ``make_private(..., grad_sample_mode="ghost")`` where it runs (its wrapped criterion's
                two backward passes), else its hooks (``GradSampleModule``); the row says which

Every part stops its rounds early to stay inside its time box (``deadline``): the number of rounds is
chosen from the warm-up steps' times, and a variant that would not fit one more round is left out of the
remaining ones. ``dry=True`` builds the same models at tiny sizes for the CPU (``gpu_check.py --dry-run``).
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from step_time import Variant, _reason, check_variant, measure_peak, private_variant, run_step
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from wide_resnet import wide_resnet

SIGMA, MAX_GRAD_NORM, LR, DATASET_SIZE = 1.0, 1.0, 1e-4, 50_000
Batch = tuple[Tensor, ...]


# -- models ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeedModel:
    """One realistic model: how to build it and a batch, and its logits → loss (and Opacus's ghost loss)."""

    key: str
    title: str
    build: Callable[[bool], nn.Module]
    batch: Callable[[bool, int, torch.Generator], Batch]
    logits: Callable[[nn.Module, Batch], Tensor]
    loss: Callable[[Tensor, Batch, Any], Any]
    """(logits, batch, None) → mean loss; (logits, batch, opacus criterion) → Opacus's ghost loss."""
    batch_size: int
    dry_batch_size: int = 2
    bf16: bool = True


def _gpt2(dry: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    small = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 96, "n_positions": 32} if dry else {}
    return GPT2LMHeadModel(GPT2Config(**small))  # GPT-2 small (124M) at its defaults, dropout 0.1


def _bert(dry: bool) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    small = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    return BertForSequenceClassification(BertConfig(num_labels=2, **(small if dry else {})))  # BERT-base


def _vit(dry: bool) -> nn.Module:
    import timm

    if dry:
        return timm.create_model(
            "vit_base_patch16_224",
            pretrained=False,
            num_classes=10,
            img_size=32,
            embed_dim=32,
            depth=1,
            num_heads=2,
        )
    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10)  # ViT-B/16, 86M


def _timm(name: str, dry_kwargs: dict[str, Any], **kwargs: Any) -> Callable[[bool], nn.Module]:
    """A timm model with a 10-class head (one block per stage in the dry run)."""

    def build(dry: bool) -> nn.Module:
        import timm

        return timm.create_model(
            name, pretrained=False, num_classes=10, **kwargs, **(dry_kwargs if dry else {})
        )

    return build


def _group_norm(channels: int, **kwargs: Any) -> nn.Module:
    return nn.GroupNorm(32, channels)


def _mnist_cnn(dry: bool) -> nn.Module:
    from recipes.models import tramer_boneh_cnn

    return tramer_boneh_cnn()


def _lstm(dry: bool) -> nn.Module:
    from realistic_models import LSTMClassifier

    return LSTMClassifier(vocab=100, dim=16) if dry else LSTMClassifier()


def _llama_lora(dry: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if dry:
        shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
        config = LlamaConfig(vocab_size=96, num_key_value_heads=1, **shape)
    else:  # TinyLlama-1.1B's shape: 22 layers, d 2048, GQA with 4 KV heads, vocabulary 32000
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
        )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    return get_peft_model(LlamaForCausalLM(config), lora)


def _tokens(vocab_full: int, vocab_dry: int, length: int, dry_length: int = 16) -> Callable[..., Batch]:
    """Token ids and position ids per example ([B, T]: Opacus's embedding hooks need the batch dimension)."""

    def make(dry: bool, b: int, g: torch.Generator) -> Batch:
        t = dry_length if dry else length
        ids = torch.randint(0, vocab_dry if dry else vocab_full, (b, t), generator=g)
        return ids, torch.arange(t).repeat(b, 1)

    return make


def _bert_batch(dry: bool, b: int, g: torch.Generator) -> Batch:
    """Token ids, token types, position ids per example (Opacus's embedding hooks need the batch
    dimension) and labels; T = 128."""
    t = 16 if dry else 128
    ids = torch.randint(0, 30522, (b, t), generator=g)
    positions = torch.arange(t).repeat(b, 1)
    return ids, torch.zeros_like(ids), positions, torch.randint(0, 2, (b,), generator=g)


def _images(size_full: int, size_dry: int) -> Callable[..., Batch]:
    def make(dry: bool, b: int, g: torch.Generator) -> Batch:
        s = size_dry if dry else size_full
        return torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)

    return make


def _lm_loss(logits: Tensor, batch: Batch, criterion: Any) -> Any:
    """Next-token cross-entropy, mean over the batch's tokens (equal lengths: the mean of per-example means)."""
    ids = batch[0]
    flat, target = logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    if criterion is None:
        return F.cross_entropy(flat, target)
    return criterion(flat, target, shape=(ids.shape[0], ids.shape[1] - 1, logits.shape[-1]))


def _class_loss(logits: Tensor, batch: Batch, criterion: Any) -> Any:
    loss = F.cross_entropy if criterion is None else criterion
    return loss(logits.float(), batch[-1])


MODELS: dict[str, SpeedModel] = {
    m.key: m
    for m in (
        SpeedModel(
            "gpt2",
            "GPT-2 small (124M), causal LM, T=512",
            _gpt2,
            _tokens(50257, 96, 512),
            lambda m, b: m(input_ids=b[0], position_ids=b[1]).logits,
            _lm_loss,
            batch_size=16,
        ),
        SpeedModel(
            "bert",
            "BERT-base (110M) sequence classification, T=128",
            _bert,
            _bert_batch,
            lambda m, b: m(input_ids=b[0], token_type_ids=b[1], position_ids=b[2]).logits,
            _class_loss,
            batch_size=32,
        ),
        SpeedModel(
            "vit",
            "ViT-B/16 (86M) at 224×224, 10 classes",
            _vit,
            _images(224, 32),
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=32,
        ),
        SpeedModel(
            "wrn",
            "WideResNet-16-4 (2.7M) with GroupNorm, CIFAR 32×32, fp32",
            lambda dry: wide_resnet(10 if dry else 16, 1 if dry else 4),
            _images(32, 8),
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=256,
            bf16=False,
        ),
        SpeedModel(
            "resnet18_gn",
            "timm ResNet-18 with GroupNorm at 32×32, 10 classes, fp32",
            _timm("resnet18", {"layers": (1, 1, 1, 1)}, norm_layer=_group_norm),
            _images(32, 16),
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=256,
            bf16=False,
        ),
        SpeedModel(
            "convnext_atto",
            "timm ConvNeXt-atto at 32×32, 10 classes, fp32",
            _timm("convnext_atto", {"depths": (1, 1, 1, 1), "dims": (8, 8, 16, 16), "patch_size": 2}),
            _images(32, 32),  # a stem and three downsamplings: 32 px in the dry run too
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=256,
            bf16=False,
        ),
        SpeedModel(
            "cnn",
            "Tramèr & Boneh MNIST CNN, fp32",
            _mnist_cnn,
            lambda dry, b, g: (
                torch.randn(b, 1, 28, 28, generator=g),
                torch.randint(0, 10, (b,), generator=g),
            ),
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=256,
            bf16=False,
        ),
        SpeedModel(
            "lstm",
            "Embedding(10000, 256) + LSTM(256), T=64, fp32",
            _lstm,
            lambda dry, b, g: (
                torch.randint(1, 100 if dry else 10_000, (b, 8 if dry else 64), generator=g),
                torch.randint(0, 2, (b,), generator=g),
            ),
            lambda m, b: m(b[0]),
            _class_loss,
            batch_size=64,
            bf16=False,
        ),
        SpeedModel(
            "lora",
            "LoRA r=16 (q, v) on a 1.1B Llama (TinyLlama's shape), T=512",
            _llama_lora,
            _tokens(32000, 96, 512),
            lambda m, b: m(input_ids=b[0], position_ids=b[1]).logits,
            _lm_loss,
            batch_size=8,
        ),
    )
}


# -- variants -----------------------------------------------------------------------------------------
def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(_trainable(model), lr=LR)


def _autocast(spec: SpeedModel, device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16)


def _forward_backward(
    spec: SpeedModel, model: nn.Module, batch: Batch, device: torch.device
) -> Callable[[], None]:
    def run() -> None:
        with _autocast(spec, device):
            loss = spec.loss(spec.logits(model, batch), batch, None)
        loss.backward()

    return run


def build_plain(spec: SpeedModel, base: nn.Module, batch: Batch, device: torch.device) -> Variant:
    model = copy.deepcopy(base)
    opt = _sgd(model)
    return Variant(
        "plain",
        [("fwd+bwd", _forward_backward(spec, model, batch, device)), ("update", opt.step)],
        zero=lambda: opt.zero_grad(set_to_none=True),
        params=_trainable(model),
    )


def build_lightning_dp(spec: SpeedModel, base: nn.Module, batch: Batch, device: torch.device) -> Variant:
    return private_variant(
        base,
        lambda model: _forward_backward(spec, model, batch, device),
        len(batch[0]),
        lr=LR,
        dataset_size=DATASET_SIZE,
    )


def _opacus_loader(batch: Batch) -> DataLoader[Any]:
    """Only tells Opacus N and the batch size (the sample rate); the timed steps use the fixed batch."""
    return DataLoader(TensorDataset(torch.zeros(DATASET_SIZE)), batch_size=len(batch[0]))


def build_opacus(spec: SpeedModel, base: nn.Module, batch: Batch, device: torch.device, mode: str) -> Variant:
    from opacus import PrivacyEngine

    model = copy.deepcopy(base)
    kwargs: dict[str, Any] = (
        {"grad_sample_mode": "ghost", "criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
    )
    made = PrivacyEngine().make_private(
        module=model, optimizer=_sgd(model), data_loader=_opacus_loader(batch), noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM, poisson_sampling=False, **kwargs,
    )  # fmt: skip
    gsm, dp_opt = made[0], made[1]
    criterion = made[2] if mode == "ghost" else None

    def fwd_bwd() -> None:
        with _autocast(spec, device):
            loss = spec.loss(spec.logits(gsm, batch), batch, criterion)
        loss.backward()

    return Variant(
        f"opacus {mode}",
        [("fwd+bwd", fwd_bwd), ("step", dp_opt.step)],
        zero=lambda: dp_opt.zero_grad(set_to_none=True),
        params=_trainable(model),
    )


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _built(
    name: str, make: Callable[[], Variant], device: torch.device, errors: list[str] | None = None
) -> Variant | None:
    """Build a variant and check one step; None (the reason appended to ``errors``) if either fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = make()
            check_variant(v, device)
        return v
    except Exception as err:  # a library that fails on this model: report, don't crash
        if errors is not None:
            errors.append(f"{name}: {_reason(err)}")
        _free(device)
        return None


# -- the measurement ------------------------------------------------------------------------------------
def bench(
    spec: SpeedModel,
    device: torch.device,
    dry: bool,
    deadline: float,
    report: Callable[[dict[str, Any]], None],
    rounds: int = 20,
    warmup: int = 2,
) -> dict[str, Any]:
    """Time the three variants of ``spec`` until ``deadline`` (time.monotonic); ``report`` gets partial results."""
    batch_size = spec.dry_batch_size if dry else spec.batch_size
    result: dict[str, Any] = {
        "model": spec.key, "title": spec.title, "batch": batch_size,
        "precision": "bf16-mixed" if spec.bf16 else "fp32", "stage": "building", "rows": [],
    }  # fmt: skip
    report(result)
    torch.manual_seed(0)
    start = time.monotonic()
    with torch.device(device):  # initialise the weights on the device (a 1.1B model in seconds)
        base = spec.build(dry).train()
    batch = tuple(t.to(device) for t in spec.batch(dry, batch_size, torch.Generator().manual_seed(0)))
    result["parameters"] = sum(p.numel() for p in base.parameters())
    result["trainable"] = sum(p.numel() for p in _trainable(base))
    result["weight_bytes"] = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    result["build_s"] = round(time.monotonic() - start, 2)
    variants, errors = _variants(spec, base, batch, device)
    del base  # the variants hold their own copies
    result["stage"] = "warm-up"
    _rows(result, variants, errors)
    report(result)
    step_s: dict[str, float] = {}
    for v in variants:
        for _ in range(warmup):
            if time.monotonic() > deadline:
                v.note = "not timed: the part's box was spent before its warm-up"
                break
            try:
                step_s[v.name] = run_step(v, device, record=False)
            except Exception as err:  # e.g. out of memory at the real batch size
                v.error = _reason(err)
                step_s.pop(v.name, None)
                _free(device)
                break
    live = [v for v in variants if v.name in step_s]
    reserve = 2 * sum(step_s.values()) + 1.0  # the memory steps, and slack
    per_round = sum(step_s.values()) or 1.0
    planned = max(1, min(rounds, math.floor((deadline - time.monotonic() - reserve) / per_round)))
    result.update(stage="rounds", planned_rounds=planned)
    gc.collect()
    gc.disable()
    try:
        for r in range(planned):
            for v in live[r % len(live) :] + live[: r % len(live)] if live else []:
                if time.monotonic() + step_s[v.name] > deadline - reserve:
                    continue  # would overrun the part's time box: fewer rounds for this variant
                try:
                    step_s[v.name] = run_step(v, device, record=True)
                except Exception as err:
                    v.error = _reason(err)
                    _free(device)
            live = [v for v in live if v.error is None]
            if r % 5 == 4:
                _rows(result, variants, errors)
                report(result)
    finally:
        gc.enable()
    for v in variants:
        if v.error is None and time.monotonic() + 2 * step_s.get(v.name, 0) < deadline:
            try:
                v.peak_bytes = measure_peak(v, device)
            except Exception as err:
                v.note = (v.note + "; " if v.note else "") + f"memory: {_reason(err)}"
    result["stage"] = "done"
    _rows(result, variants, errors)
    report(result)
    return result


def _variants(
    spec: SpeedModel, base: nn.Module, batch: Batch, device: torch.device
) -> tuple[list[Variant], dict[str, str]]:
    """plain, lightning-dp and Opacus (ghost, else hooks) on copies of ``base``, each checked by one step;
    the reason of each that could not be built or checked."""
    variants: list[Variant] = []
    errors: dict[str, str] = {}
    for name, make in (
        ("plain", lambda: build_plain(spec, base, batch, device)),
        ("lightning-dp", lambda: build_lightning_dp(spec, base, batch, device)),
    ):
        failed: list[str] = []
        v = _built(name, make, device, failed)
        if v is None:
            errors[name] = failed[0]
        else:
            variants.append(v)
    opacus_errors: list[str] = []
    opacus = _built("ghost", lambda: build_opacus(spec, base, batch, device, "ghost"), device, opacus_errors)
    if opacus is None:
        opacus = _built(
            "hooks", lambda: build_opacus(spec, base, batch, device, "hooks"), device, opacus_errors
        )
    if opacus is None:
        errors["opacus"] = "; ".join(opacus_errors)
    else:
        variants.append(opacus)
        if opacus_errors:
            opacus.note = opacus_errors[0]
    return variants, errors


def _rows(result: dict[str, Any], variants: list[Variant], errors: dict[str, str]) -> None:
    """The result's table rows from the variants so far: medians, IQR, × plain, and the peak memory of a
    step: the most allocated during it over what was live before (gradients are set to None between
    steps, so they are in it) plus the model's own weights and buffers, which every variant holds alike."""
    weights = result.get("weight_bytes", 0)
    plain = next((v for v in variants if v.name == "plain" and v.times), None)
    plain_ms = statistics.median(plain.times) * 1e3 if plain else None
    plain_total = plain.peak_bytes + weights if plain and plain.peak_bytes is not None else None
    rows: list[dict[str, Any]] = []
    for v in variants:
        row: dict[str, Any] = {"variant": v.name, "rounds": len(v.times)}
        if v.error:
            row["error"] = v.error
        if v.times:
            ms = statistics.median(v.times) * 1e3
            qs = statistics.quantiles(v.times, n=4) if len(v.times) > 1 else [v.times[0]] * 3
            row.update(
                median_ms=round(ms, 3),
                iqr_ms=[round(qs[0] * 1e3, 3), round(qs[2] * 1e3, 3)],
                x_plain=round(ms / plain_ms, 3) if plain_ms else None,
                phases_ms={k: round(statistics.median(t) * 1e3, 3) for k, t in v.phase_times.items()},
            )
        if v.peak_bytes is not None:
            total = v.peak_bytes + weights
            row.update(
                step_peak_mb=round(v.peak_bytes / 2**20, 1),
                peak_mb=round(total / 2**20, 1),
                mem_x_plain=round(total / plain_total, 3) if plain_total else None,
            )
        if v.paths:
            row["paths"] = v.paths
        if v.note:
            row["note"] = v.note
        rows.append(row)
    rows += [{"variant": name, "error": reason, "rounds": 0} for name, reason in errors.items()]
    result["rows"] = rows
