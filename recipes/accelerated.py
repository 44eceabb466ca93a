"""The experiment of Kuru et al. (2020, Sec. 5): L2-regularised logistic regression on synthetic data.

Data (spec §4.1): U with iid Uniform(0, 1) entries (n × d), rows rescaled to L1 norm ≤ 20 (never
triggers for d ≤ 20), w ~ N(0, I), labels z = sign(Uw). Objective F(x) = mean log(1 + exp(−z uᵀx)) +
λ‖x‖² with λ = 0.01, so μ = 2λ and L = λ_max(UᵀU/n + 2λI) (no logistic 1/4: conservative, as the
paper). x_0 = 10·𝟙; F* from non-private NAG. Nothing here is private: the DP strategy wraps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["LogRegProblem", "PaperLogisticRegression", "SyntheticLogRegDataModule", "paper_logreg_problem"]


@dataclass
class LogRegProblem:
    """The data and constants of the paper's logistic regression (float64)."""

    features: torch.Tensor
    labels: torch.Tensor
    lam: float
    mu: float
    smoothness: float
    f_star: float

    @property
    def kappa(self) -> float:
        return self.smoothness / self.mu

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    def objective(self, x: torch.Tensor) -> float:
        """F(x) = mean softplus(−z uᵀx) + λ‖x‖²."""
        x = x.reshape(-1).to(torch.float64)
        margins = -self.labels * (self.features @ x)
        return float(nn.functional.softplus(margins).mean() + self.lam * x.dot(x))

    def gradient(self, x: torch.Tensor) -> torch.Tensor:
        margins = -self.labels * (self.features @ x)
        weights = -self.labels * torch.sigmoid(margins)
        return self.features.T @ weights / len(self.labels) + 2 * self.lam * x


def paper_logreg_problem(
    n: int = 100_000, d: int = 20, seed: int = 1, lam: float = 0.01, reference_steps: int = 1000
) -> LogRegProblem:
    """Generate the data and F* (full-batch NAG with α = 1/L, β = (√κ − 1)/(√κ + 1), from x_0 = 10·𝟙).

    Args:
        n: the number of examples (default 100,000).
        d: the dimension (default 20).
        seed: seeds the data (default 1).
        lam: λ of the regulariser λ‖x‖² (default 0.01).
        reference_steps: the full-batch NAG steps that compute F* (default 1000).
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, d, generator=g, dtype=torch.float64)
    l1 = u.abs().sum(1, keepdim=True)
    u = u * torch.clamp(20.0 / l1, max=1.0)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    z = torch.sign(u @ w)
    z[z == 0] = 1.0
    smoothness = float(torch.linalg.eigvalsh(u.T @ u / n).max()) + 2 * lam
    mu = 2 * lam
    problem = LogRegProblem(u, z, lam, mu, smoothness, f_star=0.0)
    kappa = smoothness / mu
    beta = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    x = x_prev = torch.full((d,), 10.0, dtype=torch.float64)
    for _ in range(reference_steps):
        lookahead = x + beta * (x - x_prev)
        x_prev, x = x, lookahead - problem.gradient(lookahead) / smoothness
    problem.f_star = problem.objective(x)
    return problem


class SyntheticLogRegDataModule(L.LightningDataModule):
    """The paper's synthetic data: train on all n examples; test reports F(x) − F* on the same set.

    Args:
        n: the number of examples (default 100,000).
        d: the dimension (default 20).
        seed: seeds the data (default 1).
        batch_size: the train loader's batch size, in examples (default 1000).
    """

    def __init__(self, n: int = 100_000, d: int = 20, seed: int = 1, batch_size: int = 1000) -> None:
        super().__init__()
        self.n, self.d, self.seed, self.batch_size = n, d, seed, batch_size
        self.problem: LogRegProblem | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.problem is None:
            self.problem = paper_logreg_problem(self.n, self.d, self.seed)

    def _dataset(self) -> TensorDataset:
        assert self.problem is not None, "call setup() first"
        return TensorDataset(self.problem.features.float(), self.problem.labels.float())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(), batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(), batch_size=self.n)


class PaperLogisticRegression(L.LightningModule):
    """x ∈ R^d as a bias-free linear layer from x_0 = 10·𝟙; λ‖x‖² enters as weight decay 2λ (after noise).

    ``lr`` is α = c/L. The optimizer is plain SGD: with a DP step slot (HeavyBall, Nesterov,
    MultiStageNesterov) it only supplies the parameters, α and the weight decay.

    Args:
        d: the dimension of x (default 20).
        lr: α = c/L, the step size (default 0.196).
        lam: λ of the regulariser λ‖x‖² (default 0.01).
    """

    def __init__(self, d: int = 20, lr: float = 0.196, lam: float = 0.01) -> None:
        super().__init__()
        self.net = nn.Linear(d, 1, bias=False)
        nn.init.constant_(self.net.weight, 10.0)
        self.lr, self.lam = lr, lam

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        u, z = batch
        return nn.functional.softplus(-z * self.net(u).squeeze(1)).mean()

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        problem = getattr(datamodule, "problem", None)
        if problem is not None:
            gap = problem.objective(self.net.weight.detach().double().cpu()) - problem.f_star
            self.log("test/objective_gap", gap)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=2 * self.lam)
