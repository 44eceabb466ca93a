"""Privacy accounting for lightning-dp: events, a ledger with check-before-spend, and noise calibration.

Typical use::

    from lightning_dp.accounting import PoissonGaussian, PrivacyLedger, calibrate_noise, compute_epsilon

    sigma = calibrate_noise(target_epsilon=8, delta=1e-5, sample_rate=0.04, steps=2250)
    ledger = PrivacyLedger(delta=1e-5)   # RDP by default; "prv" / "pld" are tighter but slower
    ledger.spend(PoissonGaussian(sigma, 0.04), target_epsilon=8)   # raises BudgetExceededError if over
"""

from .budget import charge
from .calibrate import calibrate_noise, compute_epsilon
from .events import Gaussian, PoissonGaussian, PrivacyEvent
from .filter import PrivacyFilter
from .laplace_mechanism import LaplaceMechanism
from .ledger import BudgetExceededError, PrivacyLedger
from .noisy_min import NoisyMin
from .pld import PLDNumericalError
from .prv import PRVNumericalError
from .pure_dp import PureDP
from .rdp import DEFAULT_ORDERS, epsilon_from_rdp
from .repeat_select import RepeatAndSelect, Repetitions, delta_from_rdp, repeat_and_select_rdp
from .subsampled_laplace import SubsampledLaplace
from .svt import GaussianSVT, LaplaceSVT
from .zcdp import ZCDP, epsilon_from_rho, rho_from_epsilon, zcdp_rho

__all__ = [
    "DEFAULT_ORDERS",
    "ZCDP",
    "BudgetExceededError",
    "Gaussian",
    "GaussianSVT",
    "LaplaceMechanism",
    "LaplaceSVT",
    "NoisyMin",
    "PLDNumericalError",
    "PRVNumericalError",
    "PoissonGaussian",
    "PrivacyEvent",
    "PrivacyFilter",
    "PrivacyLedger",
    "PureDP",
    "RepeatAndSelect",
    "Repetitions",
    "SubsampledLaplace",
    "calibrate_noise",
    "charge",
    "compute_epsilon",
    "delta_from_rdp",
    "epsilon_from_rdp",
    "epsilon_from_rho",
    "repeat_and_select_rdp",
    "rho_from_epsilon",
    "zcdp_rho",
]
