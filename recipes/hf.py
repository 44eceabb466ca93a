"""Hugging Face fine-tuning recipes: sequence classification and causal-LM, full or LoRA, for DP training.

The modules are ordinary LightningModules; ``strategy=DPStrategy(...)`` (or ``strategy: dp`` in YAML)
makes them private. A model comes from a local folder or hub name (``model_name_or_path``, loaded with
``from_pretrained``) or from a config with random weights (``config={"model_type": "bert", ...}``), the
form the tests and the offline default configs use. Losses are per-example (a token mean per example
for language models, :func:`lightning_dp.per_example_token_loss`), so the privacy analysis holds.
Dropout is set to 0 by default (``dropout=None`` keeps the config's): DP-SGD's noise already
regularises. With dropout on, the sensitivity check at fit start says it checked in eval mode.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import per_example_token_loss

__all__ = ["HFCausalLM", "HFSequenceClassifier", "HFTextDataModule", "load_hf_model", "synthetic_token_data"]

#: Dropout probabilities a config may name; the recipes set them to ``dropout`` (0 by default).
_DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "attention_dropout",
    "dropout",
)


def load_hf_model(
    auto_class: str,
    model_name_or_path: str | None,
    config: dict[str, Any] | None,
    dropout: float | None,
    **model_kwargs: Any,
) -> nn.Module:
    """A ``transformers`` model: ``from_pretrained(model_name_or_path)`` (a local folder works offline) or,
    with ``config`` (``{"model_type": ..., **fields}``), a randomly initialised model of that config."""
    import transformers

    auto = getattr(transformers, auto_class)
    if (model_name_or_path is None) == (config is None):
        raise ValueError("give exactly one of model_name_or_path (a local folder or hub name) and config")
    overrides = dict(model_kwargs)
    if config is not None:
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("config needs a 'model_type' (e.g. 'bert', 'gpt2', 'llama')")
        hf_config = transformers.AutoConfig.for_model(model_type, **fields, **overrides)
        _set_dropout(hf_config, dropout)
        return auto.from_config(hf_config)
    assert model_name_or_path is not None
    hf_config = transformers.AutoConfig.from_pretrained(model_name_or_path, **overrides)
    _set_dropout(hf_config, dropout)
    model: nn.Module = auto.from_pretrained(model_name_or_path, config=hf_config)
    return model.train()  # from_pretrained returns eval mode; Lightning keeps the mode it finds


def _set_dropout(hf_config: Any, dropout: float | None) -> None:
    """Set every dropout probability the config has to ``dropout`` (None: keep the config's)."""
    if dropout is None:
        return
    for key in _DROPOUT_KEYS:
        if isinstance(getattr(hf_config, key, None), float):
            setattr(hf_config, key, dropout)


def _with_lora(
    model: nn.Module, task_type: str, r: int, alpha: float, target_modules: Sequence[str] | None
) -> nn.Module:
    """Wrap ``model`` in peft LoRA adapters; only the adapters (and a new classification head) train.

    ``target_modules=None`` uses peft's defaults for known architectures (BERT: query/value, GPT-2:
    c_attn, Llama: q_proj/v_proj).
    """
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        task_type=task_type,
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(target_modules) if target_modules is not None else None,
    )
    return get_peft_model(model, lora)


class _HFModule(L.LightningModule):
    """The optimiser, logging and LoRA wiring shared by both recipes."""

    def __init__(self, lr: float, optimizer: str, weight_decay: float) -> None:
        super().__init__()
        if optimizer.lower() not in ("sgd", "adamw", "adam"):
            raise ValueError(f"optimizer must be 'sgd', 'adam' or 'adamw', got {optimizer!r}")
        self.lr, self.optimizer_name, self.weight_decay = lr, optimizer.lower(), weight_decay
        self.model: nn.Module

    def dp_per_sample_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Unreduced per-example losses (the contract of the loss-probe mechanisms)."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.dp_per_sample_loss(batch).mean()  # a mean over examples: sensitivity C per example
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.dp_per_sample_loss(batch).mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        cls = torch.optim.AdamW if self.optimizer_name == "adamw" else torch.optim.Adam
        return cls(params, lr=self.lr, weight_decay=self.weight_decay)


class HFSequenceClassifier(_HFModule):
    """Fine-tune a ``transformers`` sequence classifier (BERT, GPT-2, Llama, ...), fully or with LoRA.

    Batches are dicts with ``input_ids``, ``attention_mask`` and ``labels`` ([B] class indices).
    Logs ``train_loss``, ``val_loss`` and ``val_acc``.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        config: dict[str, Any] | None = None,
        num_labels: int = 2,
        lora: bool = False,
        lora_r: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        dropout: float | None = 0.0,
        lr: float = 1e-3,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, optimizer, weight_decay)
        self.save_hyperparameters()
        model = load_hf_model(
            "AutoModelForSequenceClassification", model_name_or_path, config, dropout, num_labels=num_labels
        )
        if getattr(model.config, "pad_token_id", None) is None:  # GPT-2/Llama: find the last real token
            model.config.pad_token_id = getattr(model.config, "eos_token_id", None) or 0
        self.model = _with_lora(model, "SEQ_CLS", lora_r, lora_alpha, lora_target_modules) if lora else model

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def dp_per_sample_loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        self.log("val_loss", F.cross_entropy(logits.float(), batch["labels"]), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), prog_bar=True)


class HFCausalLM(_HFModule):
    """Fine-tune a ``transformers`` causal language model (GPT-2, Llama, ...), fully or with LoRA.

    Batches are dicts with ``input_ids`` and ``attention_mask``; the loss is each example's mean
    next-token cross-entropy over its own non-padding tokens (``per_example_token_loss(shift=True)``),
    then the mean over examples. Logs ``train_loss`` and ``val_loss``.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        config: dict[str, Any] | None = None,
        lora: bool = False,
        lora_r: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        dropout: float | None = 0.0,
        lr: float = 1e-3,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, optimizer, weight_decay)
        self.save_hyperparameters()
        model = load_hf_model("AutoModelForCausalLM", model_name_or_path, config, dropout)
        self.model = (
            _with_lora(model, "CAUSAL_LM", lora_r, lora_alpha, lora_target_modules) if lora else model
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def dp_per_sample_loss(self, batch: dict[str, Tensor]) -> Tensor:
        mask = batch.get("attention_mask")
        logits = self(batch["input_ids"], mask)
        labels = batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, -100)
        return per_example_token_loss(logits, labels, shift=True)


def synthetic_token_data(
    size: int, seq_len: int, vocab_size: int, num_labels: int, seed: int = 0
) -> dict[str, Tensor]:
    """A learnable token task with no download. The vocabulary (less the pad id 0) is cut into
    ``num_labels`` bands; a row of class c counts up by one from a random token of band c, wrapping
    within the band, and ends in a padded tail of random length. A classifier can learn the band, a
    causal LM the continuation."""
    band = (vocab_size - 1) // num_labels
    if band < 2:
        raise ValueError(f"vocab_size {vocab_size} is too small for {num_labels} labels")
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_labels, (size,), generator=g)
    offset = torch.randint(0, band, (size, 1), generator=g)
    ids = 1 + labels[:, None] * band + (offset + torch.arange(seq_len)[None, :]) % band
    lengths = torch.randint(max(2, seq_len // 2), seq_len + 1, (size,), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


class _DictDataset(TensorDataset):
    """A TensorDataset whose items are dicts (the batches the HF recipes take)."""

    def __init__(self, data: dict[str, Tensor]) -> None:
        self.keys = list(data)
        super().__init__(*data.values())

    def __getitem__(self, index: int) -> dict[str, Tensor]:  # type: ignore[override]
        return dict(zip(self.keys, super().__getitem__(index), strict=True))


class HFTextDataModule(L.LightningDataModule):
    """Token batches for the HF recipes, with no download by default.

    ``data_file=None``: :func:`synthetic_token_data`. Otherwise a JSON-lines file with ``"text"`` (and
    ``"label"`` for classification) per line, tokenised by ``tokenizer`` (a local folder or hub name
    for ``AutoTokenizer.from_pretrained``), padded or cut to ``seq_len``. ``val_fraction`` of the rows
    (a fixed split) is held out for validation.
    """

    def __init__(
        self,
        data_file: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 32,
        batch_size: int = 64,
        size: int = 2048,
        vocab_size: int = 128,
        num_labels: int = 2,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if data_file is not None and tokenizer is None:
            raise ValueError("a data_file needs a tokenizer (a local folder or hub name)")
        self.data_file, self.tokenizer = data_file, tokenizer
        self.seq_len, self.batch_size, self.size = seq_len, batch_size, size
        self.vocab_size, self.num_labels = vocab_size, num_labels
        self.val_fraction, self.seed = val_fraction, seed
        self.train: _DictDataset | None = None
        self.val: _DictDataset | None = None

    def _load(self) -> dict[str, Tensor]:
        if self.data_file is None:
            return synthetic_token_data(self.size, self.seq_len, self.vocab_size, self.num_labels, self.seed)
        from transformers import AutoTokenizer

        rows = [json.loads(line) for line in Path(self.data_file).read_text().splitlines() if line.strip()]
        tok = AutoTokenizer.from_pretrained(self.tokenizer)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok(
            [r["text"] for r in rows],
            padding="max_length",
            truncation=True,
            max_length=self.seq_len,
            return_tensors="pt",
        )
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if all("label" in r for r in rows):
            data["labels"] = torch.tensor([int(r["label"]) for r in rows])
        return data

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        data = self._load()
        n = len(data["input_ids"])
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        n_val = round(self.val_fraction * n)
        self.val = _DictDataset({k: v[order[:n_val]] for k, v in data.items()})
        self.train = _DictDataset({k: v[order[n_val:]] for k, v in data.items()})

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        assert self.train is not None
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        assert self.val is not None
        return DataLoader(self.val, batch_size=self.batch_size)
