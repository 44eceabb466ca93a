import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import BANK_FILE, DATA_ROOT, MNIST_FILES, requires_data
from torch import nn

from recipes import (
    DigitsDataModule,
    ImageClassifier,
    MNISTDataModule,
    TabularDataModule,
    logistic_regression,
    mlp,
    small_cnn_digits,
    tramer_boneh_cnn,
)

torch.set_num_threads(1)

MNIST_RAW = DATA_ROOT / "MNIST" / "raw"
BANK = DATA_ROOT / BANK_FILE


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- digits


def test_digits_split_sizes_disjoint_and_shapes():
    dm = DigitsDataModule(batch_size=32, seed=0)
    dm.setup()
    sizes = {k: len(v) for k, v in dm.split_indices.items()}
    assert sum(sizes.values()) == 1797
    assert sizes["test"] == 360
    assert sizes["val"] == pytest.approx(180, abs=2)
    idx = [set(v.tolist()) for v in dm.split_indices.values()]
    assert not idx[0] & idx[1]
    assert not idx[0] & idx[2]
    assert not idx[1] & idx[2]
    assert len(dm.train_set) == sizes["train"]
    assert dm.num_classes == 10
    assert dm.input_shape == (1, 8, 8)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 8, 8)
    assert x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert dm.train_dataloader().batch_size == 32
    # Public fixed range: x/16 in [0, 1] then (x - 0.5)/0.5 in [-1, 1]; both ends are attained.
    X = dm.train_set.tensors[0]
    assert X.min().item() == -1.0
    assert X.max().item() == 1.0
    # Same seed, same split; other seed, other split.
    dm2 = DigitsDataModule(seed=0)
    dm2.setup()
    assert np.array_equal(dm.split_indices["test"], dm2.split_indices["test"])
    dm3 = DigitsDataModule(seed=1)
    dm3.setup()
    assert not np.array_equal(dm.split_indices["test"], dm3.split_indices["test"])


def test_digits_flatten_and_stratified():
    dm = DigitsDataModule(flatten=True)
    dm.setup()
    assert dm.input_shape == (64,)
    x, _ = next(iter(dm.test_dataloader()))
    assert x.shape[1:] == (64,)
    counts = torch.bincount(dm.test_set.tensors[1], minlength=10)
    assert counts.min() >= 35  # ~36 per class in 360 test examples
    assert counts.max() <= 37


# ---------------------------------------------------------------- MNIST


@requires_data(*MNIST_FILES)
def test_mnist_from_shared_gz(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DP_CACHE", str(tmp_path / "cache"))
    before = sorted(p.name for p in MNIST_RAW.iterdir())
    dm = MNISTDataModule(root=str(DATA_ROOT), batch_size=16, download=False)
    dm.prepare_data()
    dm.setup()
    assert sorted(p.name for p in MNIST_RAW.iterdir()) == before  # nothing written to shared data
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (55000, 5000, 10000)
    assert not set(dm.split_indices["train"].tolist()) & set(dm.split_indices["val"].tolist())
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 28, 28)
    assert x.dtype == torch.float32
    assert y.shape == (16,)
    assert y.min() >= 0
    assert y.max() <= 9
    # Standard normalisation constants: a zero pixel maps to -0.1307/0.3081.
    x0, _ = dm.test_set[0]
    assert x0.min().item() == pytest.approx(-0.1307 / 0.3081, abs=1e-5)
    assert x0.max().item() == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-5)
    # A second module reuses the decompressed cache.
    dm2 = MNISTDataModule(root=str(DATA_ROOT), download=False, normalize=False)
    dm2.setup()
    assert torch.equal(dm2.test_set.images, dm.test_set.images)


def test_mnist_missing_files_without_download(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DP_CACHE", str(tmp_path / "cache"))
    dm = MNISTDataModule(root=str(tmp_path / "empty"), download=False)
    with pytest.raises(RuntimeError, match="MNIST not found"):
        dm.setup()


# ---------------------------------------------------------------- tabular


@requires_data(BANK_FILE)
def test_tabular_bank_normalised_and_folds_partition():
    folds = []
    for k in range(5):
        dm = TabularDataModule(str(BANK), fold=k, num_folds=5)
        dm.setup()
        folds.append(dm.split_indices["test"])
        assert not set(dm.split_indices["train"].tolist()) & set(folds[-1].tolist())
        assert len(dm.split_indices["train"]) + len(folds[-1]) == 45211
    allt = np.concatenate(folds)
    assert len(allt) == 45211
    assert len(np.unique(allt)) == 45211
    X = dm.train_set.tensors[0]
    norms = X.norm(dim=1)
    assert torch.allclose(norms[norms > 0], torch.ones(()), atol=1e-5)
    assert X.min() >= 0
    assert set(dm.train_set.tensors[1].unique().tolist()) <= {0, 1}
    assert dm.num_classes == 2
    assert dm.in_features == X.shape[1] == 32
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (256, 32)
    assert y.dtype == torch.int64


@requires_data(BANK_FILE)
def test_tabular_holdout_split():
    dm = TabularDataModule(str(BANK), test_fraction=0.2, val_fraction=0.1)
    dm.setup()
    n = {k: len(v) for k, v in dm.split_indices.items()}
    assert sum(n.values()) == 45211
    assert n["test"] == pytest.approx(0.2 * 45211, abs=1)


# ---------------------------------------------------------------- models


def test_model_parameter_counts_and_shapes():
    cnn = tramer_boneh_cnn()
    assert n_params(cnn) == 26_010
    assert cnn(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert n_params(tramer_boneh_cnn(activation="tanh")) == 26_010
    assert n_params(mlp(784, [1000], 10)) == 795_010
    assert mlp(784, [1000], 10)(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert n_params(logistic_regression(64, 10)) == 650
    digits_cnn = small_cnn_digits()
    assert digits_cnn(torch.zeros(4, 1, 8, 8)).shape == (4, 10)
    for m in (cnn, mlp(64, [32], 10), digits_cnn, small_cnn_digits(groups=4)):
        assert not any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in m.modules())


def test_classifier_structure():
    for arch in ("mlp", "logreg", "tramer_boneh_cnn", "digits_cnn"):
        model = ImageClassifier(arch=arch, in_features=784 if arch != "digits_cnn" else 64)
        assert list(model._parameters) == []  # all parameters live in the submodule
        assert n_params(model) == n_params(model.net)
    assert n_params(ImageClassifier(arch="tramer_boneh_cnn").net) == 26_010
    assert isinstance(ImageClassifier(optimizer="adam").configure_optimizers(), torch.optim.Adam)
    opt = ImageClassifier(momentum=0.9).configure_optimizers()
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError):
        ImageClassifier(arch="resnet")


@pytest.mark.filterwarnings("ignore:.*self.trainer.*reference is not registered.*")
def test_dp_per_sample_loss_matches_training_loss():
    torch.manual_seed(0)
    dm = DigitsDataModule(batch_size=16)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    model = ImageClassifier(arch="digits_cnn")
    per_ex = model.dp_per_sample_loss(batch)
    assert per_ex.shape == (16,)
    train_loss = model.training_step(batch, 0)
    assert torch.allclose(per_ex.mean(), train_loss, atol=1e-6)
    assert torch.allclose(per_ex[3], F.cross_entropy(model(batch[0][3:4]), batch[1][3:4]))


# ---------------------------------------------------------------- non-private training


def test_nonprivate_digits_fit_reaches_90_percent():
    import lightning as L

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(batch_size=32, seed=0)
    model = ImageClassifier(arch="mlp", hidden=[64], in_features=64, lr=0.1, momentum=0.9)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert "val_acc" in trainer.callback_metrics
    assert "train_loss_epoch" in trainer.callback_metrics
    (res,) = trainer.test(model, datamodule=dm, verbose=False)
    assert res["test_acc"] > 0.9, res
