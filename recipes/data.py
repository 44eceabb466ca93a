"""Lightning data modules for the recipes: scikit-learn digits, MNIST and the DP-AGD tabular sets.

The train dataloaders are plain map-style datasets with a fixed ``batch_size``: a DP strategy reads
``batch_size`` as the expected batch size and swaps the sampler for Poisson sampling.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch
from sklearn.model_selection import StratifiedKFold, train_test_split
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = [
    "DigitsDataModule",
    "MNISTDataModule",
    "TabularDataModule",
    "UserTensorDataset",
    "resolve_mnist_root",
]


def _loader(dataset: Dataset, batch_size: int, shuffle: bool, num_workers: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


class _SplitDataModule(L.LightningDataModule):
    """Train/val/test sets built in ``setup``, served by plain DataLoaders with ``batch_size``."""

    batch_size: int
    num_workers: int
    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        return _loader(self.train_set, self.batch_size, True, self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        assert self.val_set is not None, "call setup() first"
        if len(self.val_set) == 0:  # type: ignore[arg-type]
            return []
        return _loader(self.val_set, self.batch_size, False, self.num_workers)

    def test_dataloader(self) -> DataLoader:
        assert self.test_set is not None, "call setup() first"
        return _loader(self.test_set, self.batch_size, False, self.num_workers)


# --------------------------------------------------------------------------------------------------
# scikit-learn digits
# --------------------------------------------------------------------------------------------------


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's bundled 8×8 digits (1,797 images, no download), stratified train/val/test split.

    Normalisation (``normalization``):

    * ``"public"`` (default): ``x / 16`` maps the public pixel range ``[0, 16]`` to ``[0, 1]``, then
      ``(x - 0.5) / 0.5`` to ``[-1, 1]``. The constants are fixed by the data format, not estimated from
      the data, so no information about the private training set leaks through preprocessing.
    * ``"train_stats"``: scale to ``[0, 1]`` then standardise each pixel with the training-set mean/std.
      Those statistics are computed from the *private* training data and are not covered by the DP
      guarantee of training; only use it for non-private baselines.

    Args:
        batch_size: the train loader's batch size, in examples: the expected Poisson batch under a DP
            strategy (default 64).
        val_fraction: share of the 1,797 images held out for validation (default 0.1).
        test_fraction: share held out for testing (default 0.2).
        seed: seeds the split (default 0).
        num_workers: DataLoader workers (default 0).
        flatten: give each image as a 64-vector instead of ``(1, 8, 8)`` (default False).
        normalization: ``"public"`` (default) or ``"train_stats"``, as above.
        users: ``"shuffled"`` or ``"label_sorted"`` gives the train set synthetic users, consecutive runs of
            ``examples_per_synthetic_user`` train examples (1,257 → 126 users), as a ``user_id`` attribute
            for user-level DP (``configs/digits_users.yaml``); default None (no user ids).
        examples_per_synthetic_user: examples per synthetic user (default 10).
    """

    num_classes = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        flatten: bool = False,
        normalization: str = "public",
        users: str | None = None,
        examples_per_synthetic_user: int = 10,
    ) -> None:
        super().__init__()
        if normalization not in ("public", "train_stats"):
            raise ValueError(f"normalization must be 'public' or 'train_stats', got {normalization!r}")
        if users not in (None, "shuffled", "label_sorted"):
            raise ValueError(f"users must be None, 'shuffled' or 'label_sorted', got {users!r}")
        if not (0 <= val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError("need 0 <= val_fraction, 0 < test_fraction and val_fraction + test_fraction < 1")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.flatten = flatten
        self.normalization = normalization
        self.users = users
        self.examples_per_synthetic_user = examples_per_synthetic_user
        self.input_shape: tuple[int, ...] = (64,) if flatten else (1, 8, 8)
        self.in_features = 64
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self.split_indices: dict[str, np.ndarray] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        X = digits.data.astype(np.float32) / 16.0  # public pixel range [0, 16] -> [0, 1]
        y = digits.target.astype(np.int64)
        idx = np.arange(len(y))
        rest, test_idx = train_test_split(
            idx, test_size=self.test_fraction, stratify=y, random_state=self.seed
        )
        if self.val_fraction > 0:
            val_rel = self.val_fraction / (1.0 - self.test_fraction)
            train_idx, val_idx = train_test_split(
                rest, test_size=val_rel, stratify=y[rest], random_state=self.seed
            )
        else:
            train_idx, val_idx = rest, rest[:0]
        if self.normalization == "public":
            X = (X - 0.5) / 0.5
        else:
            # Data-dependent: statistics of the private training set (not covered by DP).
            mean = X[train_idx].mean(axis=0)
            std = X[train_idx].std(axis=0)
            X = (X - mean) / np.where(std > 1e-6, std, 1.0)
        shape = (-1, 64) if self.flatten else (-1, 1, 8, 8)
        Xt = torch.from_numpy(X).reshape(shape)
        yt = torch.from_numpy(y)
        if self.users is not None:  # synthetic users: consecutive runs of the (re-ordered) train indices
            train_idx = _synthetic_user_order(train_idx, y, self.users)
        self.split_indices = {"train": train_idx, "val": val_idx, "test": test_idx}
        self.train_set = TensorDataset(Xt[train_idx], yt[train_idx])
        if self.users is not None:
            self.train_set = UserTensorDataset(
                self.train_set.tensors, torch.arange(len(train_idx)) // self.examples_per_synthetic_user
            )
        self.val_set = TensorDataset(Xt[val_idx], yt[val_idx])
        self.test_set = TensorDataset(Xt[test_idx], yt[test_idx])


class UserTensorDataset(TensorDataset):
    """A ``TensorDataset`` whose examples carry a user id: ``user_id[i]`` owns example i
    (``DPStrategy(sampler=UserPoisson(user_key="user_id", ...))`` reads the attribute)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], user_id: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.user_id = user_id


def _synthetic_user_order(train_idx: np.ndarray, y: np.ndarray, users: str) -> np.ndarray:
    """The train indices in the order that makes consecutive runs users (``docs/user-level.md``, spec §5.8):
    ``"label_sorted"`` (stable sort by label: mostly one digit per user, non-iid) or ``"shuffled"`` (a
    permutation from ``torch.Generator().manual_seed(0)``: iid users)."""
    if users == "label_sorted":
        return train_idx[np.argsort(y[train_idx], kind="stable")]
    permutation = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(0)).numpy()
    return train_idx[permutation]


# --------------------------------------------------------------------------------------------------
# MNIST
# --------------------------------------------------------------------------------------------------

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # public, customary constants (not estimated from our split)
# Decompressed IDX files and their exact sizes (16/8-byte header + one byte per pixel/label).
_MNIST_SIZES = {
    "train-images-idx3-ubyte": 16 + 60000 * 28 * 28,
    "train-labels-idx1-ubyte": 8 + 60000,
    "t10k-images-idx3-ubyte": 16 + 10000 * 28 * 28,
    "t10k-labels-idx1-ubyte": 8 + 10000,
}
_MNIST_FILES = tuple(_MNIST_SIZES)


def _cache_dir() -> Path:
    env = os.environ.get("LIGHTNING_DP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_dp"


def _mnist_extracted(root: Path, check_sizes: bool = False) -> bool:
    raw = root / "MNIST" / "raw"
    return all(
        (raw / name).is_file() and (not check_sizes or (raw / name).stat().st_size == size)
        for name, size in _MNIST_SIZES.items()
    )


def resolve_mnist_root(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Return a root from which ``torchvision.datasets.MNIST(root, download=False)`` can read.

    torchvision reads only the *decompressed* ``MNIST/raw/*-ubyte`` files. If ``root`` holds only the
    ``*.gz`` archives (e.g. a read-only shared data folder), they are decompressed (and the size of
    each decompressed file checked; the archives may be recompressed, so their own MD5 sums
    need not match torchvision's) into ``<cache_dir>/MNIST/raw`` (default ``~/.cache/lightning_dp``, or
    ``$LIGHTNING_DP_CACHE``) and that cache root is returned; nothing is written into ``root``.
    Otherwise ``root`` is returned unchanged (torchvision's own download then applies).

    Args:
        root: the folder given as MNIST's root.
        cache_dir: where decompressed archives go (default None: ``$LIGHTNING_DP_CACHE`` or
            ``~/.cache/lightning_dp``).
    """
    root_p = Path(root)
    if _mnist_extracted(root_p):
        return str(root_p)
    raw = root_p / "MNIST" / "raw"
    if not all((raw / f"{name}.gz").is_file() for name in _MNIST_FILES):
        return str(root_p)

    cache = Path(cache_dir) if cache_dir is not None else _cache_dir()
    if _mnist_extracted(cache, check_sizes=True):
        return str(cache)

    out = cache / "MNIST" / "raw"
    out.mkdir(parents=True, exist_ok=True)
    for name in _MNIST_FILES:
        src = raw / f"{name}.gz"
        dst = out / name
        if dst.is_file() and dst.stat().st_size == _MNIST_SIZES[name]:
            continue
        # Decompress to a temporary file and rename atomically (safe with concurrent readers).
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        try:
            with gzip.open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            size = os.path.getsize(tmp)
            if size != _MNIST_SIZES[name]:
                raise RuntimeError(f"{src} decompresses to {size} bytes, expected {_MNIST_SIZES[name]}")
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return str(cache)


class _ImageTensorDataset(Dataset):
    """uint8 images ``(N, H, W)`` converted to float ``(1, H, W)`` lazily (keeps memory at 1 byte/pixel)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, mean: float, std: float) -> None:
        self.images = images
        self.targets = targets
        self.mean = mean
        self.std = std

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index].unsqueeze(0).float().div_(255.0)
        return (x - self.mean) / self.std, self.targets[index]


class MNISTDataModule(_SplitDataModule):
    """MNIST via ``torchvision.datasets.MNIST``: 60,000 training images split into train/val
    (``val_size`` held out by a seeded permutation) and the standard 10,000 test images.

    Images are float ``(1, 28, 28)`` in ``[0, 1]``, standardised with the public constants
    (0.1307, 0.3081) when ``normalize=True``. ``root`` may also be a folder holding only the
    ``MNIST/raw/*.gz`` archives (see :func:`resolve_mnist_root`).

    Args:
        root: the folder with torchvision's ``MNIST/`` (default ``"data"``).
        batch_size: the train loader's batch size, in examples (default 256).
        download: let torchvision download MNIST into ``root`` when it is absent (default True).
        val_size: training images held out for validation, in examples (default 5000).
        seed: seeds the train/val split (default 0).
        num_workers: DataLoader workers (default 0).
        normalize: standardise with the public constants (0.1307, 0.3081) (default True).
        train_size: keep only this many of the training images (the first of the seeded permutation, after
            the validation ones), for runs sized to a machine; None (default): all of them.
    """

    num_classes = 10
    input_shape = (1, 28, 28)
    in_features = 784

    def __init__(
        self,
        root: str = "data",
        batch_size: int = 256,
        download: bool = True,
        val_size: int = 5000,
        seed: int = 0,
        num_workers: int = 0,
        normalize: bool = True,
        train_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if train_size is not None and (
            isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1
        ):
            raise ValueError(f"train_size must be a positive integer or None, got {train_size!r}")
        self.train_size = train_size
        self.root = root
        self.batch_size = batch_size
        self.download = download
        self.val_size = val_size
        self.seed = seed
        self.num_workers = num_workers
        self.normalize = normalize
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _resolved_root(self) -> str:
        return resolve_mnist_root(self.root)

    def prepare_data(self) -> None:
        from torchvision.datasets import MNIST

        root = self._resolved_root()
        if self.download and not _mnist_extracted(Path(root)):
            MNIST(root, train=True, download=True)
            MNIST(root, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from torchvision.datasets import MNIST

        root = self._resolved_root()
        try:
            train = MNIST(root, train=True, download=self.download)
            test = MNIST(root, train=False, download=self.download)
        except RuntimeError as err:
            raise RuntimeError(
                f"MNIST not found under {self.root!r} (expected MNIST/raw/*-ubyte or *-ubyte.gz); "
                "pass download=True or point root at a folder holding the files"
            ) from err
        mean, std = (MNIST_MEAN, MNIST_STD) if self.normalize else (0.0, 1.0)
        n = len(train.targets)
        if not 0 <= self.val_size < n:
            raise ValueError(f"val_size must be in [0, {n}), got {self.val_size}")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        val_idx, train_idx = perm[: self.val_size], perm[self.val_size :][: self.train_size]
        self.split_indices = {"train": train_idx, "val": val_idx}
        self.train_set = _ImageTensorDataset(train.data[train_idx], train.targets[train_idx], mean, std)
        self.val_set = _ImageTensorDataset(train.data[val_idx], train.targets[val_idx], mean, std)
        self.test_set = _ImageTensorDataset(test.data, test.targets, mean, std)


# --------------------------------------------------------------------------------------------------
# Tabular (DP-AGD preprocessing of BANK, IPUMS-BR)
# --------------------------------------------------------------------------------------------------


def load_tabular(path: str | os.PathLike, normalize_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Read a whitespace-separated (optionally gzipped) file, label in the last column (0/1).

    Features are min-max scaled to ``[0, 1]`` per column, then (``normalize_rows=True``) every row is
    scaled to unit L2 norm (all-zero rows stay zero), as in the private line-search paper; DP-AGD uses
    min-max scaling only (``normalize_rows=False``). The column ranges are taken from the whole file,
    the papers' convention of treating attribute domains as public.
    """
    data = np.loadtxt(path, dtype=np.float64, ndmin=2)
    X, y = data[:, :-1], data[:, -1]
    labels = np.unique(y)
    if not set(labels.tolist()) <= {0.0, 1.0}:
        raise ValueError(f"{path}: expected 0/1 labels in the last column, got {labels[:10]}")
    lo, hi = X.min(axis=0), X.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    X = (X - lo) / span
    if not normalize_rows:
        return X.astype(np.float32), y.astype(np.int64)
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    X = X / np.where(norms > 0, norms, 1.0)
    return X.astype(np.float32), y.astype(np.int64)


class TabularDataModule(_SplitDataModule):
    """Binary classification on the DP-AGD tabular files (``BANK.dat.gz``, ``IPUMS-BR.dat.gz``).

    ``fold=None``: one stratified train/test split with ``test_fraction`` (seeded). ``fold=k``: the test
    set is fold ``k`` of a seeded ``StratifiedKFold(num_folds)`` and the rest is training data, so the
    ``num_folds`` test sets partition the data (benchmarks report the mean over folds). ``val_fraction > 0``
    carves a validation split out of the training part; otherwise there is no validation loader.
    ``normalize_rows=False`` keeps min-max scaling only (DP-AGD's preprocessing). ``full_batch=True``: the
    train loader's batch is the whole training split (DP-AGD's full-batch gradient descent; ``batch_size``
    then only sets the evaluation batches).

    Args:
        path: the ``.dat.gz`` file.
        batch_size: the train loader's batch size, in examples (default 256).
        test_fraction: share of the rows held out for testing when ``fold`` is None (default 0.2).
        seed: seeds the split (default 0).
        fold: the test fold k, or None (default) for one split.
        num_folds: the number of folds (default 5).
        val_fraction: share of the training part held out for validation (default 0).
        num_workers: DataLoader workers (default 0).
        normalize_rows: after min-max scaling per column, scale each row to unit L2 norm (default True).
        full_batch: the train batch is the whole training split (default False).
    """

    num_classes = 2

    def __init__(
        self,
        path: str,
        batch_size: int = 256,
        test_fraction: float = 0.2,
        seed: int = 0,
        fold: int | None = None,
        num_folds: int = 5,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        normalize_rows: bool = True,
        full_batch: bool = False,
    ) -> None:
        super().__init__()
        if fold is not None and not 0 <= fold < num_folds:
            raise ValueError(f"fold must be in [0, {num_folds}), got {fold}")
        self.save_hyperparameters()
        self.path = path
        self.batch_size = batch_size
        self.test_fraction = test_fraction
        self.seed = seed
        self.fold = fold
        self.num_folds = num_folds
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.normalize_rows = normalize_rows
        self.full_batch = full_batch
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self.split_indices: dict[str, np.ndarray] = {}
        self.in_features: int | None = None
        self.input_shape: tuple[int, ...] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        X, y = load_tabular(self.path, self.normalize_rows)
        idx = np.arange(len(y))
        if self.fold is None:
            train_idx, test_idx = train_test_split(
                idx, test_size=self.test_fraction, stratify=y, random_state=self.seed
            )
        else:
            skf = StratifiedKFold(n_splits=self.num_folds, shuffle=True, random_state=self.seed)
            train_idx, test_idx = list(skf.split(X, y))[self.fold]
        if self.val_fraction > 0:
            train_idx, val_idx = train_test_split(
                train_idx, test_size=self.val_fraction, stratify=y[train_idx], random_state=self.seed
            )
        else:
            val_idx = train_idx[:0]
        self.in_features = X.shape[1]
        self.input_shape = (X.shape[1],)
        self.split_indices = {"train": train_idx, "val": val_idx, "test": test_idx}
        Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
        self.train_set = TensorDataset(Xt[train_idx], yt[train_idx])
        self.val_set = TensorDataset(Xt[val_idx], yt[val_idx])
        self.test_set = TensorDataset(Xt[test_idx], yt[test_idx])

    def train_dataloader(self) -> DataLoader:
        if self.full_batch and self.train_set is not None:
            return _loader(self.train_set, len(self.train_set), True, self.num_workers)
        return super().train_dataloader()
