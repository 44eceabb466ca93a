"""Tramèr & Boneh's handcrafted ScatterNet features (2-D scattering, J = 2, L = 8) and their CNN head.

Our own small implementation of Mallat's scattering transform with Morlet wavelets, following the
filter construction and the order-0/1/2 cascade of kymatio's ``Scattering2D`` (whose torch frontend
does not import against current SciPy): reflect padding, products in the Fourier domain,
subsampling by periodisation, modulus, low-pass by a Gaussian at scale 2^J. A 1×28×28 image gives
81×7×7 features, a 3×32×32 image 243×8×8. The transform has no parameters and sees no labels, so
features are computed once per data set and cached under ``$LIGHTNING_DP_CACHE`` (default
``~/.cache/lightning_dp``); normalisation is a parameter-free GroupNorm in the model, so it costs no
privacy (Tramèr & Boneh's private BatchNorm statistics would have to be charged, spec §7 A13).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from recipes.data import _cache_dir, _SplitDataModule, resolve_mnist_root
from recipes.models import activation_layer

__all__ = ["ScatterNetDataModule", "Scattering2D", "scatternet_cnn"]


def _gabor(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """Periodised 2-D Gabor filter on a ``size``×``size`` grid (spatial domain, complex)."""
    rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    curv = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2 * sigma * sigma)
    out = np.zeros((size, size), np.complex128)
    for ex in range(-2, 3):
        for ey in range(-2, 3):
            xx, yy = np.mgrid[ex * size : size + ex * size, ey * size : size + ey * size]
            arg = -(curv[0, 0] * xx * xx + (curv[0, 1] + curv[1, 0]) * xx * yy + curv[1, 1] * yy * yy)
            out += np.exp(arg + 1j * (xx * xi * math.cos(theta) + yy * xi * math.sin(theta)))
    return out / (2 * math.pi * sigma * sigma / slant)


def _morlet(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """Gabor minus a Gaussian so the filter has zero mean (a Morlet wavelet)."""
    wave = _gabor(size, sigma, theta, xi, slant)
    envelope = _gabor(size, sigma, theta, 0.0, slant)
    return wave - wave.sum() / envelope.sum() * envelope


def _periodize(filt: np.ndarray, res: int) -> np.ndarray:
    """A Fourier-domain filter at resolution 2^-res: fold the spectrum (aliasing as subsampling does)."""
    k = 2**res
    size = filt.shape[0]
    start, length = int(size * 2 ** (-res - 1)), int(size * (1 - 2 ** (-res)))
    kept = filt.copy()  # only the low band |f| < size/2^(res+1) survives, as in kymatio
    kept[start : start + length, :] = 0
    kept[:, start : start + length] = 0
    return kept.reshape(k, size // k, k, size // k).sum(axis=(0, 2))


class Scattering2D(nn.Module):
    """Second-order 2-D scattering transform: ``(B, C, H, W)`` → ``(B, C·(1 + J L + L² J(J−1)/2), H/2^J, W/2^J)``.

    Args:
        shape: (H, W) of the input images, in pixels (square only).
        J: the number of scales; the output is 2^J times smaller on each side (default 2).
        L: the number of orientations (default 8).
    """

    def __init__(self, shape: tuple[int, int], J: int = 2, L: int = 8) -> None:
        super().__init__()
        if shape[0] != shape[1]:
            raise ValueError("Scattering2D here supports square images only.")
        self.J, self.L, self.size = J, L, shape[0]
        step = 2**J
        self.padded = ((self.size + step) // step + 1) * step
        self.pad = (self.padded - self.size) // 2
        psi: list[tuple[int, list[Tensor]]] = []
        for j in range(J):
            for theta in range(L):
                angle = (int(L - L / 2 - 1) - theta) * math.pi / L
                spatial = _morlet(self.padded, 0.8 * 2**j, angle, 3.0 / 4.0 * math.pi / 2**j, 4.0 / L)
                fourier = np.real(np.fft.fft2(spatial))
                psi.append(
                    (j, [torch.tensor(_periodize(fourier, res), dtype=torch.float32) for res in range(j + 1)])
                )
        phi_fourier = np.real(np.fft.fft2(_gabor(self.padded, 0.8 * 2 ** (J - 1), 0.0, 0.0, 1.0)))
        self.psi_scales = [j for j, _ in psi]
        for n, (_, filters) in enumerate(psi):
            for res, f in enumerate(filters):
                self.register_buffer(f"psi_{n}_{res}", f, persistent=False)
        for res in range(J + 1):
            self.register_buffer(
                f"phi_{res}",
                torch.tensor(_periodize(phi_fourier, res), dtype=torch.float32),
                persistent=False,
            )

    def _psi(self, n: int, res: int) -> Tensor:
        return getattr(self, f"psi_{n}_{res}")

    def _phi(self, res: int) -> Tensor:
        return getattr(self, f"phi_{res}")

    @staticmethod
    def _subsample(x: Tensor, k: int) -> Tensor:
        """Subsample by ``k`` in space = average of the ``k``×``k`` periodised blocks of the spectrum."""
        if k == 1:
            return x
        m, n = x.shape[-2] // k, x.shape[-1] // k
        out = sum(x[..., i * m : (i + 1) * m, j * n : (j + 1) * n] for i in range(k) for j in range(k))
        return out / (k * k)  # type: ignore[operator]

    def _low_pass(self, x_hat: Tensor, res: int) -> Tensor:
        out = self._subsample(x_hat * self._phi(res), 2 ** (self.J - res))
        return torch.fft.ifft2(out).real[..., 1:-1, 1:-1]

    def _psi_group(self, j: int, res: int) -> Tensor:
        """The L wavelets of scale ``j`` at resolution ``res``, stacked: ``(L, M, M)``."""
        return torch.stack([self._psi(n, res) for n, jn in enumerate(self.psi_scales) if jn == j])

    def forward(self, x: Tensor) -> Tensor:
        batch, channels = x.shape[:2]
        x = x.reshape(batch * channels, self.size, self.size).float()
        x = nn.functional.pad(x[:, None], (self.pad, self.pad, self.pad, self.pad), mode="reflect")[:, 0]
        x_hat = torch.fft.fft2(x)
        out = [self._low_pass(x_hat, 0)[:, None]]
        for j1 in range(self.J):  # all L orientations of a scale at once
            u1 = self._subsample(x_hat[:, None] * self._psi_group(j1, 0), 2**j1)
            u1_hat = torch.fft.fft2(torch.fft.ifft2(u1).abs())  # (B, L, M/2^j1, M/2^j1)
            out.append(self._low_pass(u1_hat, j1))
            for j2 in range(j1 + 1, self.J):
                u2 = self._subsample(u1_hat[:, :, None] * self._psi_group(j2, j1), 2 ** (j2 - j1))
                u2_hat = torch.fft.fft2(torch.fft.ifft2(u2).abs())  # (B, L, L, ...)
                out.append(self._low_pass(u2_hat, j2).flatten(1, 2))
        features = torch.cat(out, dim=1)
        return features.reshape(batch, channels * features.shape[1], *features.shape[-2:])


def scatternet_cnn(in_channels: int = 81, num_classes: int = 10, activation: str = "tanh") -> nn.Sequential:
    """Tramèr & Boneh's CNN on ScatterNet features: GroupNorm(27, affine=False) then, for 81×7×7
    (MNIST/FMNIST), Conv(81→16, 3, s2, p1) → Conv(16→32, 3, p1) → Linear(512→32) → Linear(32→C)
    (33,066 parameters); for 243×8×8 (CIFAR-10) Conv(243→64, 3, p1) → MaxPool 2 → Conv(64→64, 3, p1)
    → Linear(1024→C) (187,210 parameters).

    Args:
        in_channels: 81 (MNIST, Fashion-MNIST: 81×7×7 features; default) or 243 (CIFAR-10: 243×8×8).
        num_classes: the number of classes (default 10).
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default tanh).
    """
    norm = nn.GroupNorm(27, in_channels, affine=False)
    if in_channels == 81:
        return nn.Sequential(
            norm,
            nn.Conv2d(81, 16, 3, stride=2, padding=1),
            activation_layer(activation),
            nn.Conv2d(16, 32, 3, stride=1, padding=1),
            activation_layer(activation),
            nn.Flatten(),
            nn.Linear(512, 32),
            activation_layer(activation),
            nn.Linear(32, num_classes),
        )
    return nn.Sequential(
        norm,
        nn.Conv2d(in_channels, 64, 3, padding=1),
        activation_layer(activation),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        activation_layer(activation),
        nn.Flatten(),
        nn.Linear(1024, num_classes),
    )


_DATASETS = ("mnist", "fmnist", "cifar10")


def _raw_split(name: str, root: str, train: bool, download: bool) -> tuple[Tensor, Tensor]:
    """Images as float (N, C, H, W) in [0, 1] and integer labels, via torchvision."""
    from torchvision import datasets

    if name == "mnist":
        ds = datasets.MNIST(resolve_mnist_root(root), train=train, download=download)
    elif name == "fmnist":
        ds = datasets.FashionMNIST(root, train=train, download=download)
    else:
        ds = datasets.CIFAR10(root, train=train, download=download)
        images = torch.tensor(ds.data).permute(0, 3, 1, 2).float() / 255.0
        return images, torch.tensor(ds.targets)
    return ds.data[:, None].float() / 255.0, ds.targets.clone()


def scattering_features(
    name: str, root: str = "data", train: bool = True, download: bool = True, chunk: int = 2000
) -> TensorDataset:
    """ScatterNet features (float16 on disk, float32 in memory) and labels of one split, cached."""
    if name not in _DATASETS:
        raise ValueError(f"dataset must be one of {_DATASETS}, got {name!r}")
    path = _cache_dir() / "scatternet" / f"{name}_{'train' if train else 'test'}_J2_L8.pt"
    if path.is_file():
        features, labels = torch.load(path, weights_only=True)
    else:
        images, labels = _raw_split(name, root, train, download)
        transform = Scattering2D(tuple(images.shape[-2:]))  # type: ignore[arg-type]
        with torch.no_grad():
            features = torch.cat(
                [transform(images[i : i + chunk]).half() for i in range(0, len(images), chunk)]
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save((features, labels), tmp)
        os.replace(tmp, path)
    return TensorDataset(features.float(), labels)


class ScatterNetDataModule(_SplitDataModule):
    """MNIST / Fashion-MNIST / CIFAR-10 as cached ScatterNet features (81×7×7 or 243×8×8).

    ``val_size`` examples of the training set are held out by a seeded permutation (0: train on
    all of it, as the DPIS paper does, and report test accuracy).

    Args:
        dataset: ``"mnist"`` (default), ``"fmnist"`` or ``"cifar10"``.
        root: torchvision's data folder (default ``"data"``); the features are cached under
            ``$LIGHTNING_DP_CACHE``.
        download: let torchvision download the images when absent (default True).
        batch_size: the train loader's batch size, in examples (default 512).
        val_size: training examples held out for validation (default 0).
        seed: seeds the train/val split (default 0).
        num_workers: DataLoader workers (default 0).
    """

    num_classes = 10

    def __init__(
        self,
        dataset: str = "mnist",
        root: str = "data",
        download: bool = True,
        batch_size: int = 512,
        val_size: int = 0,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in _DATASETS:
            raise ValueError(f"dataset must be one of {_DATASETS}, got {dataset!r}")
        self.save_hyperparameters()
        self.dataset, self.root, self.download = dataset, str(Path(root)), download
        self.batch_size, self.val_size, self.seed, self.num_workers = batch_size, val_size, seed, num_workers
        self.train_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        full = scattering_features(self.dataset, self.root, True, self.download)
        features, labels = full.tensors
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        val, train = perm[: self.val_size], perm[self.val_size :]
        self.train_set = TensorDataset(features[train], labels[train])
        self.val_set = TensorDataset(features[val], labels[val])
        self.test_set = scattering_features(self.dataset, self.root, False, self.download)
