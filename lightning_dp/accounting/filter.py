"""The ledger as a privacy filter: adaptively chosen releases, each checked before it is spent.

When the cost of each release depends on earlier noisy outputs (DP-AGD raises its gradient budget
after a rejected direction; a line search decides at run time how many tests to run) and training
stops when the budget is used up, plain composition is not the right theorem. A privacy filter is:
if every release's cost is fixed from public state *before* it runs, and a release runs only when it
still fits, the whole run meets the budget (Feldman & Zrnic 2021, Rényi filter; Rogers et al. 2016).

:class:`PrivacyFilter` is a :class:`PrivacyLedger` (same history, checkpoints, report, ``spend``/
``can_afford``/``affordable_count``) with the filter's rules:

* ``mode="zcdp"``: budget ρ_tot, the largest ρ whose ρ-zCDP implies (ε, δ)-DP by the tight conversion
  of Canonne, Kamath & Steinke 2020 (Prop. 12; ``conversion="bun_steinke"``: (√(L + ε) − √L)²,
  L = ln(1/δ), Bun & Steinke Prop. 1.3, as in the DP-AGD paper); a release of cost ρ_i runs iff
  Σρ + ρ_i ≤ ρ_tot. Every order stops at the same time, so the run is ρ_tot-zCDP and therefore
  (ε, δ)-DP (DP-AGD, Thm 5.1 with a filter). Events must be zCDP
  (:func:`~lightning_dp.accounting.zcdp.zcdp_rho`).
* ``mode="rdp"`` (strict, default for RDP): per-order budgets B(α) = ε − ln(|Λ|/δ)/(α−1); a release
  runs iff SOME order α still has spent(α) + c(α) ≤ B(α). Each order's filtered process is
  (α, B(α))-RDP, so P[loss > ε] ≤ δ/|Λ| for each, and a union bound over the |Λ| orders gives (ε, δ)-DP
  whichever orders survive (line-search spec §3.7).
* ``mode="rdp_paper"``: the same with ln(1/δ) (the line-search paper's rule, no union bound: only
  valid when the stopping order is fixed in advance; use it for parity runs only).

``reserve``: an event that must be affordable *together with* each counted release (DP-AGD reserves one
NoisyMin per gradient measurement, so a gradient whose line search could not run is never bought).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .arguments import MAX_COUNT, check_count, check_event, check_target
from .events import PrivacyEvent
from .ledger import BudgetExceededError, PrivacyLedger
from .rdp import SPARSE_ORDERS, check_delta, event_rdp
from .zcdp import ZCDPConversion, epsilon_from_rho, rho_from_epsilon, zcdp_rho

__all__ = ["FilterMode", "PrivacyFilter"]

FilterMode = Literal["zcdp", "rdp", "rdp_paper"]
_MODES = ("zcdp", "rdp", "rdp_paper")


class PrivacyFilter(PrivacyLedger):
    """A :class:`PrivacyLedger` whose budget checks are a privacy filter (see the module docstring).

    Its default orders are the sparse grid (the strict RDP rule pays ln|Λ|), and every event is priced
    with its exact RDP, so a check and the history it admits use the same costs.

    Args:
        target_epsilon: ε of the guarantee; also the default target of every check.
        delta: δ of the guarantee.
        mode: ``"zcdp"``, ``"rdp"`` (strict union over orders) or ``"rdp_paper"``.
        orders: RDP orders Λ (RDP modes); keep |Λ| small: the strict rule pays ln|Λ|.
        reserve: event that must fit with every release counted by :meth:`affordable_count`.
        conversion: zCDP mode: ρ ↔ (ε, δ) by ``"cks"`` (Canonne, Kamath & Steinke 2020, the default:
            17-100 % more ρ for the same ε than ``"bun_steinke"``, ρ + 2√(ρ ln(1/δ)), the DP-AGD paper's).
        rho: zCDP mode only: the budget ρ_tot itself (then ``target_epsilon`` may be ``None`` and is
            reported as ε(ρ_tot, δ)); otherwise ρ_tot is derived from ``target_epsilon``.
    """

    _bound_short_runs = False

    def __init__(
        self,
        target_epsilon: float | None,
        delta: float,
        mode: FilterMode = "zcdp",
        orders: Sequence[float] = SPARSE_ORDERS,
        reserve: PrivacyEvent | None = None,
        rho: float | None = None,
        conversion: ZCDPConversion = "cks",
    ) -> None:
        super().__init__(delta, "rdp", orders)
        if conversion not in ("cks", "bun_steinke"):
            raise ValueError(f"conversion must be 'cks' or 'bun_steinke', got {conversion!r}")
        self.conversion: ZCDPConversion = conversion
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self._rho_tot: float | None = None
        if rho is not None:
            if mode != "zcdp":
                raise ValueError("a ρ budget needs mode='zcdp'")
            self._rho_tot = float(rho)
            if target_epsilon is None:
                target_epsilon = epsilon_from_rho(self._rho_tot, self.delta, conversion)
        target = check_target(target_epsilon)
        if not 0 < target < math.inf:
            raise ValueError(f"a privacy filter needs a finite target_epsilon > 0, got {target_epsilon!r}")
        self.target_epsilon = target
        self._rho_cache: tuple[tuple[int, int], float] | None = None
        self.mode: FilterMode = mode
        self.reserve = reserve

    # -- budgets -------------------------------------------------------------------------------
    def _log_term(self, delta: float) -> float:
        count = len(self.orders) if self.mode == "rdp" else 1
        return math.log(count / delta)

    def rho_budget(self, target_epsilon: float | None = None) -> float:
        """ρ_tot of the zCDP filter for ``target_epsilon`` (default: the filter's)."""
        target = self.target_epsilon if target_epsilon is None else check_target(target_epsilon)
        if self._rho_tot is not None and target == self.target_epsilon:
            return self._rho_tot
        return rho_from_epsilon(target, self.delta, self.conversion)

    def rdp_budgets(self, target_epsilon: float | None = None) -> np.ndarray:
        """B(α) per order of the RDP filter (≤ 0: that order is unusable)."""
        target = self.target_epsilon if target_epsilon is None else check_target(target_epsilon)
        a = np.asarray(self.orders, dtype=np.float64)
        return target - self._log_term(self.delta) / (a - 1.0)

    # -- costs -----------------------------------------------------------------------------------
    def _check_priceable(self, event: PrivacyEvent) -> None:
        if self.mode == "zcdp" and zcdp_rho(event) is None:
            raise ValueError(
                f"the zCDP privacy filter cannot price {event.kind!r} events ({event!r}): they are not ρ-zCDP "
                "for a known ρ; use PrivacyFilter(mode='rdp')"
            )

    @property
    def rho_spent(self) -> float:
        """Σρ over the history (exactly rounded), zCDP mode only."""
        if self.mode != "zcdp":
            raise AttributeError("rho_spent exists only for mode='zcdp'")
        key = (self._generation, self.steps)
        cached = self._rho_cache
        if cached is None or cached[0] != key:
            cached = (key, math.fsum(count * self._rho(event) for event, count in self._history))
            self._rho_cache = cached
        return cached[1]

    @staticmethod
    def _rho(event: PrivacyEvent) -> float:
        rho = zcdp_rho(event)
        assert rho is not None
        return rho

    def _unit(self, event: PrivacyEvent, with_reserve: bool) -> Any:
        """Cost of one ``event`` (plus the reserve): ρ (zCDP) or the RDP vector."""
        events = [event] + ([self.reserve] if with_reserve and self.reserve is not None else [])
        if self.mode == "zcdp":
            return math.fsum(self._rho(e) for e in events)
        return sum((event_rdp(e, self.orders) for e in events), np.zeros(len(self.orders)))

    def _fits(self, event: PrivacyEvent, count: int, target: float, with_reserve: bool) -> bool:
        if count == 0:
            return True
        if self.mode == "zcdp":
            extra = [count * self._rho(event)]
            if with_reserve and self.reserve is not None:
                extra.append(count * self._rho(self.reserve))
            return math.fsum([self.rho_spent, *extra]) <= self.rho_budget(target)
        cost = count * event_rdp(event, self.orders)
        if with_reserve and self.reserve is not None:
            cost = cost + count * event_rdp(self.reserve, self.orders)
        return bool(np.any(self.rdp + cost <= self.rdp_budgets(target)))

    # -- check-before-spend (the filter) ----------------------------------------------------------
    def can_afford(self, event: PrivacyEvent, target_epsilon: float | None = None, count: int = 1) -> bool:
        """Whether ``count`` × ``event`` still passes the filter (reserve not included)."""
        event = check_event(event)
        count = check_count(count)
        self._check_priceable(event)
        target = self.target_epsilon if target_epsilon is None else check_target(target_epsilon)
        return self._fits(event, count, target, with_reserve=False)

    def spend(self, event: PrivacyEvent, target_epsilon: float | None = None, count: int = 1) -> float:
        """Record ``count`` × ``event`` if it passes the filter and return ε spent; else raise, recording nothing."""
        target = self.target_epsilon if target_epsilon is None else check_target(target_epsilon)
        if not self.can_afford(event, target, count):
            spent = self.epsilon()
            raise BudgetExceededError(
                f"privacy filter ({self.mode}) refuses {count} x {event!r}: it does not fit in the budget of "
                f"ε={target:g} at δ={self.delta:g} (ε spent so far {spent:.6g}); nothing recorded",
                spent=spent,
                target=target,
                would_be=self.epsilon_if(event, count),
                event=event,
                count=count,
            )
        self.record(event, count)
        return self.epsilon()

    def affordable_count(self, event: PrivacyEvent, target_epsilon: float | None = None) -> int:
        """Largest n such that n × (event + reserve) passes the filter (2**62 for a costless event)."""
        event = check_event(event)
        self._check_priceable(event)
        target = self.target_epsilon if target_epsilon is None else check_target(target_epsilon)
        unit = self._unit(event, with_reserve=True)
        if self.mode == "zcdp":
            if unit == 0:
                return MAX_COUNT
            guess = (self.rho_budget(target) - self.rho_spent) / unit
        else:
            room = self.rdp_budgets(target) - self.rdp
            with np.errstate(divide="ignore", invalid="ignore"):
                per_order = np.where(unit > 0, room / unit, np.where(room >= 0, np.inf, -np.inf))
            guess = float(np.max(per_order))
            if math.isinf(guess) and guess > 0:
                return MAX_COUNT
        n = int(min(max(math.floor(guess), 0), MAX_COUNT)) if math.isfinite(guess) else 0
        while n > 0 and not self._fits(event, n, target, with_reserve=True):
            n -= 1
        while n < MAX_COUNT and self._fits(event, n + 1, target, with_reserve=True):
            n += 1
        return n

    # -- readout -----------------------------------------------------------------------------------
    def _filter_epsilon(self, rdp: np.ndarray, rho: float | None, delta: float) -> tuple[float, float | None]:
        if self.mode == "zcdp":
            assert rho is not None
            return epsilon_from_rho(rho, delta, self.conversion), None
        a = np.asarray(self.orders, dtype=np.float64)
        log_term = math.log((len(a) if self.mode == "rdp" else 1) / delta)
        eps = rdp + log_term / (a - 1.0)
        alive = rdp <= self.rdp_budgets()
        pool = np.where(alive, eps, np.inf) if alive.any() else eps
        if not np.isfinite(pool).any():
            return math.inf, None
        i = int(np.argmin(pool))
        return max(0.0, float(pool[i])), float(a[i])

    def epsilon_and_order(self, delta: float | None = None) -> tuple[float, float | None]:
        """ε spent so far under the filter's conversion (an odometer reading; the guarantee is the target).

        zCDP: ρ_spent + 2√(ρ_spent·ln(1/δ)). RDP: min over surviving orders of spent(α) + ln(|Λ|/δ)/(α−1).
        """
        d = self.delta if delta is None else check_delta(delta)
        rho = self.rho_spent if self.mode == "zcdp" else None
        return self._filter_epsilon(self.rdp, rho, d)

    def epsilon_if(self, event: PrivacyEvent, count: int = 1) -> float:
        event = check_event(event)
        count = check_count(count)
        self._check_priceable(event)
        rdp = self._total_rdp_with(event, count)
        rho = math.fsum([self.rho_spent, count * self._rho(event)]) if self.mode == "zcdp" else None
        return self._filter_epsilon(rdp, rho, self.delta)[0]

    def _empty_like(self) -> PrivacyLedger:
        return PrivacyFilter(
            self.target_epsilon,
            self.delta,
            self.mode,
            self.orders,
            self.reserve,
            rho=self._rho_tot,
            conversion=self.conversion,
        )

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["filter"] = {"mode": self.mode, "target_epsilon": self.target_epsilon}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("filter") if isinstance(state, dict) else None
        if saved is None or saved.get("mode") != self.mode:
            raise ValueError(
                f"this privacy filter uses mode={self.mode!r} but the saved ledger state has "
                f"{None if saved is None else saved.get('mode')!r}; resume with the same step and budget rule"
            )
        if float(saved["target_epsilon"]) != self.target_epsilon:
            raise ValueError(
                f"the saved privacy filter had target_epsilon={saved['target_epsilon']}, this one "
                f"{self.target_epsilon}: a filter's budget cannot change during a run"
            )
        self._rho_cache = None
        super().load_state_dict({k: v for k, v in state.items() if k != "filter"})

    def __repr__(self) -> str:
        return (
            f"PrivacyFilter(target_epsilon={self.target_epsilon}, delta={self.delta}, mode={self.mode!r}, "
            f"steps={self.steps})"
        )
