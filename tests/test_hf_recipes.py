"""The Hugging Face fine-tuning recipes (recipes/hf.py, configs/hf_*.yaml) on config-built tiny models, offline."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dp import DPStrategy
from recipes.hf import HFCausalLM, HFSequenceClassifier, HFTextDataModule, synthetic_token_data

ROOT = Path(__file__).resolve().parents[1]
BERT = {
    "model_type": "bert",
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 32,
}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
#: Small enough for a few seconds per config: the configs' models at width 16, one layer.
SHRINK = {
    "hf_seqcls": [
        "--model.init_args.config.hidden_size",
        "16",
        "--model.init_args.config.num_hidden_layers",
        "1",
    ],
    "hf_causal_lm": ["--model.init_args.config.n_embd", "16", "--model.init_args.config.n_layer", "1"],
}
SHRINK["hf_seqcls_lora"] = SHRINK["hf_seqcls"]
SHRINK["hf_causal_lm_lora"] = ["--model.init_args.config.hidden_size", "16"]


def _trainer(steps: int = 2) -> L.Trainer:
    return L.Trainer(
        strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


@pytest.mark.parametrize("name", sorted(SHRINK))
def test_each_config_trains_privately_from_the_cli(name, tmp_path):
    from lightning_dp.commands.cli import main

    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / f"{name}.yaml"),
            *SHRINK[name],
            "--data.init_args.size",
            "128",
            "--data.init_args.batch_size",
            "32",
            "--data.init_args.seq_len",
            "12",
            "--trainer.accelerator",
            "cpu",
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--test_after_fit",
            "false",
        ]
    )
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["steps"] == 2
    assert 0 < report["epsilon"] < 3.0


def test_lora_trains_only_the_adapters():
    torch.manual_seed(0)
    module = HFCausalLM(config=LLAMA, lora=True, lora_r=2)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    _trainer().fit(module, HFTextDataModule(seq_len=12, batch_size=32, size=128, vocab_size=64))
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable
    assert all("lora_" in n for n in trainable)
    assert changed == trainable  # every adapter moved (lora_B starts at 0), nothing else did


def test_a_local_checkpoint_folder_and_tokenizer_load_offline(tmp_path):
    """``from_pretrained`` of a folder written by ``save_pretrained``, text through a local tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertTokenizerFast

    words = ["good", "bad", "film", "plot", "great", "awful", "the", "was"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    checkpoint = tmp_path / "checkpoint"
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(checkpoint)
    fields = {k: v for k, v in BERT.items() if k != "model_type"}
    torch.manual_seed(1)
    saved = AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model("bert", **{**fields, "vocab_size": 13}, num_labels=2)
    )
    saved.save_pretrained(checkpoint)
    rows = [{"text": f"the film was {w}", "label": int(w in ("good", "great"))} for w in words * 8]
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("\n".join(json.dumps(r) for r in rows))

    module = HFSequenceClassifier(model_name_or_path=str(checkpoint), num_labels=2)
    for (name, loaded), original in zip(module.model.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(loaded, original), name
    data = HFTextDataModule(data_file=str(data_file), tokenizer=str(checkpoint), seq_len=8, batch_size=16)
    _trainer(steps=1).fit(module, data)
    assert data.train is not None
    assert data.train[0]["input_ids"].shape == (8,)
    assert module.trainer.strategy.ledger.steps == 1


def test_the_causal_lm_loss_is_each_examples_own_token_mean():
    """Padding never counts, and an example's loss does not depend on the others' lengths."""
    torch.manual_seed(0)
    module = HFCausalLM(config=LLAMA).eval()
    batch = synthetic_token_data(4, 10, 64, 2, seed=3)
    losses = module.dp_per_sample_loss(batch)
    padded = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7))
    torch.testing.assert_close(module.dp_per_sample_loss(padded), losses)
    alone = module.dp_per_sample_loss({k: v[:1] for k, v in batch.items()})
    torch.testing.assert_close(alone, losses[:1], rtol=1e-5, atol=1e-6)


def test_a_model_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of model_name_or_path"):
        HFSequenceClassifier()
    with pytest.raises(ValueError, match="model_type"):
        HFCausalLM(config={"hidden_size": 16})


def test_the_configs_own_dropout_passes_the_sensitivity_check():
    """BERT's 0.1 dropout in every block, checked on every step: dropout draws random numbers, so the
    check replaces an example (same shapes, same masks for the others): no example is mixed."""
    torch.manual_seed(0)
    module = HFSequenceClassifier(config=BERT, dropout=None)
    assert module.model.config.hidden_dropout_prob == 0.1
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, check_sensitivity="every_step")
    trainer = L.Trainer(
        strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, HFTextDataModule(seq_len=12, batch_size=32, size=128, vocab_size=64))
    assert strategy.checks.mixing.checked_steps == [0, 1]
