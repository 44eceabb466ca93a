"""The privacy ledger: a run-length history of privacy events, ε readout, and check-before-spend.

Over 500 lines, one class: the readout, check-before-spend, ``affordable_count``'s search, the curve and the
saved state all read one run-length history and its caches, which only the ledger may update.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .arguments import MAX_COUNT, check_count, check_event, check_target
from .events import PrivacyEvent
from .pld import pld_epsilon, require_dp_accounting
from .prv import PRVNumericalError, prv_epsilon
from .rdp import (
    DEFAULT_ORDERS,
    check_delta,
    check_orders,
    epsilon_from_rdp,
    event_rdp,
    event_rdp_bound,
    segment_rdp,
)

__all__ = ["Accountant", "BudgetExceededError", "PrivacyLedger"]

Accountant = Literal["rdp", "prv", "pld", "pure"]
#: ``"pure"``: basic composition of pure ε-DP events (ε adds up, holds for every δ); it prices only events
#: whose ``pure_epsilon()`` is not None, and the RDP/PRV accountants refuse those (different neighbours).
_ACCOUNTANTS = ("rdp", "prv", "pld", "pure")
#: Accountants that price a whole history of (subsampled) Gaussians at once (~0.1-1 s an evaluation).
_DISTRIBUTION_ACCOUNTANTS = ("prv", "pld")
_STATE_VERSION = 1


class BudgetExceededError(RuntimeError):
    """Raised by :meth:`PrivacyLedger.spend` when spending would push ε above the target."""

    def __init__(
        self,
        message: str,
        *,
        spent: float,
        target: float,
        would_be: float,
        event: PrivacyEvent,
        count: int,
        mechanism: str | None = None,
    ) -> None:
        """Keep the numbers so callers (e.g. a training loop) can log or react without parsing text."""
        super().__init__(message)
        self.spent = spent
        self.target = target
        self.would_be = would_be
        self.event = event
        self.count = count
        self.mechanism = mechanism
        """The mechanism whose release was refused (e.g. "DPIS K~ statistic"), when the caller named it."""


class PrivacyLedger:
    """Records privacy events and answers "how much ε is spent / would be spent" cheaply.

    With ``accountant="rdp"`` the ledger keeps the composed RDP vector up to date, so reading ε is a
    few vector ops (microseconds) and is cached until the history changes. With ``"prv"`` each new
    history costs one PRV evaluation (tighter ε, ~0.1-1 s), also cached; ``"pld"`` is the same with
    Google's ``dp-accounting`` privacy-loss-distribution accountant (``pip install dp-accounting``).
    """

    def __init__(
        self, delta: float, accountant: Accountant = "rdp", orders: Sequence[float] = DEFAULT_ORDERS
    ) -> None:
        """Create an empty ledger that reports ε at ``delta`` using ``accountant``."""
        self._delta = check_delta(delta)
        if accountant not in _ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {_ACCOUNTANTS}, got {accountant!r}")
        if accountant == "pld":
            require_dp_accounting()
        self._accountant: Accountant = accountant
        self._orders = check_orders(orders)
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        """Empty the history and every cache."""
        self._history: list[tuple[PrivacyEvent, int]] = []
        self._steps = 0
        # Sum of count·rdp over all segments but the last; the total is a deterministic function of
        # the history (closed + last_count·rdp_last), so reloading a state_dict reproduces ε bit-for-bit.
        self._closed_rdp = np.zeros(len(self._orders))
        self._last_rdp: np.ndarray | None = None  # _segment_rdp of the last run, as it stands
        self._generation = 0  # bumped whenever a segment is added or the history is replaced
        self._eps_cache: dict[float, tuple[float, float | None]] = {}
        self._afford_cache: dict[tuple[PrivacyEvent, float], tuple[int, int, bool, int]] = {}

    @property
    def delta(self) -> float:
        """The δ at which ε is reported by default."""
        return self._delta

    @property
    def accountant(self) -> Accountant:
        """``"rdp"``, ``"prv"``, ``"pld"`` or ``"pure"``."""
        return self._accountant

    @property
    def orders(self) -> tuple[float, ...]:
        """RDP orders used by this ledger."""
        return self._orders

    @property
    def steps(self) -> int:
        """Total number of events recorded (sum of counts, not number of segments)."""
        return self._steps

    @property
    def history(self) -> list[tuple[PrivacyEvent, int]]:
        """A copy of the run-length merged history ``[(event, count), ...]``."""
        return list(self._history)

    @property
    def rdp(self) -> np.ndarray:
        """Composed RDP of the whole history at each of :attr:`orders` (a copy; for any accountant)."""
        return np.array(self._total_rdp_with())

    def __len__(self) -> int:
        """Number of events recorded (same as :attr:`steps`; unlike Opacus, not the number of segments)."""
        return self._steps

    def __repr__(self) -> str:
        """Short description with the current history size."""
        return (
            f"PrivacyLedger(delta={self._delta}, accountant={self._accountant!r}, steps={self._steps}, "
            f"segments={len(self._history)})"
        )

    # ----------------------------------------------------------------- record
    def _check_priceable(self, event: PrivacyEvent) -> None:
        """Refuse events the configured accountant cannot price, before they enter the history."""
        if self._accountant in _DISTRIBUTION_ACCOUNTANTS and event.poisson_gaussian_params() is None:
            raise ValueError(
                f"the {self._accountant.upper()} accountant cannot price {event.kind!r} events ({event!r}); "
                "use accountant='rdp'"
            )
        if self._accountant == "pure" and event.pure_epsilon() is None:
            raise ValueError(
                f"the pure accountant (basic composition of pure ε-DP) cannot price {event.kind!r} events "
                f"({event!r}); use accountant='rdp'"
            )

    #: Price short runs of subsampled Gaussians with the cached grid bound (see ``rdp.segment_rdp``);
    #: a privacy filter turns this off, so its checks and its history use the same exact costs.
    _bound_short_runs = True

    def _event_rdp(self, event: PrivacyEvent) -> np.ndarray:
        """An upper bound on the event's RDP (exact where cheap; validates it), zeros under "pure"."""
        if self._accountant == "pure":
            return np.zeros(len(self._orders))
        if self._bound_short_runs:
            return event_rdp_bound(event, self._orders)
        return event_rdp(event, self._orders)

    def _segment_rdp(self, event: PrivacyEvent, count: int) -> np.ndarray:
        """RDP of a run of ``count`` equal events as the ledger composes it (a function of the run only)."""
        if self._accountant == "pure":
            return np.zeros(len(self._orders))
        if self._bound_short_runs:
            return segment_rdp(event, count, self._orders)
        return count * event_rdp(event, self._orders)

    def record(self, event: PrivacyEvent, count: int = 1) -> None:
        """Append ``count`` occurrences of ``event`` (merged into the last segment when equal)."""
        event = check_event(event)
        count = check_count(count)
        self._check_priceable(event)
        self._record_checked(event, count)

    def _record_checked(self, event: PrivacyEvent, count: int) -> None:
        """:meth:`record` after its argument checks (``spend`` has already made them)."""
        if count == 0:
            return
        self._event_rdp(event)  # validates (and caches) the event's RDP before it enters the history
        if self._history and self._history[-1][0] == event:
            self._history[-1] = (event, self._history[-1][1] + count)
        else:
            if self._history:
                self._closed_rdp = self._closed_rdp + self._last_segment_rdp()
            self._history.append((event, count))
            self._generation += 1
        self._last_rdp = None
        self._steps += count
        self._eps_cache.clear()

    # ---------------------------------------------------------------- readout
    def _last_segment_rdp(self) -> np.ndarray:
        """RDP of the last run of the history (cached until the history changes)."""
        if self._last_rdp is None:
            last_event, last_count = self._history[-1]
            self._last_rdp = self._segment_rdp(last_event, last_count)
        return self._last_rdp

    def _total_rdp_with(self, event: PrivacyEvent | None = None, count: int = 0) -> np.ndarray:
        """Composed RDP of the history plus ``count`` × ``event``, computed exactly as after recording."""
        if event is not None and count > 0:
            if self._history and self._history[-1][0] == event:
                last_event, last_count = self._history[-1]
                return self._closed_rdp + self._segment_rdp(last_event, last_count + count)
            closed = self._closed_rdp
            if self._history:
                closed = closed + self._last_segment_rdp()
            return closed + self._segment_rdp(event, count)
        if not self._history:
            return self._closed_rdp
        return self._closed_rdp + self._last_segment_rdp()

    def _history_with(self, event: PrivacyEvent | None, count: int) -> list[tuple[PrivacyEvent, int]]:
        """The history as it would be after recording ``count`` × ``event``."""
        history = list(self._history)
        if event is None or count == 0:
            return history
        if history and history[-1][0] == event:
            history[-1] = (event, history[-1][1] + count)
        else:
            history.append((event, count))
        return history

    def _epsilon_with(
        self, event: PrivacyEvent | None, count: int, delta: float
    ) -> tuple[float, float | None]:
        """(ε, best RDP order or None) after adding ``count`` × ``event`` to the history."""
        if self._accountant == "prv":
            return prv_epsilon(self._history_with(event, count), delta), None
        if self._accountant == "pld":
            return pld_epsilon(self._history_with(event, count), delta), None
        if self._accountant == "pure":
            costs = [n * float(e.pure_epsilon() or 0.0) for e, n in self._history_with(event, count)]
            return math.fsum(costs), None
        total = self._total_rdp_with(event, count)
        if not total.any():  # zero RDP at every order: the mechanism is perfectly private
            return 0.0, None
        eps, order = epsilon_from_rdp(total, self._orders, delta)
        return eps, (None if math.isnan(order) else order)

    def epsilon_and_order(self, delta: float | None = None) -> tuple[float, float | None]:
        """ε spent so far at ``delta`` (default: the ledger's) and the optimal RDP order (None unless RDP)."""
        d = self._delta if delta is None else check_delta(delta)
        cached = self._eps_cache.get(d)
        if cached is None:
            cached = self._epsilon_with(None, 0, d)
            self._eps_cache[d] = cached
        return cached

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the ledger's δ); cached until the history changes."""
        return self.epsilon_and_order(delta)[0]

    # --------------------------------------------------------- check-before-spend
    def epsilon_if(self, event: PrivacyEvent, count: int = 1) -> float:
        """ε that would be reported after recording ``count`` × ``event`` (nothing is recorded)."""
        event = check_event(event)
        count = check_count(count)
        self._check_priceable(event)
        if count == 0:
            return self.epsilon()
        return self._epsilon_with(event, count, self._delta)[0]

    def can_afford(self, event: PrivacyEvent, target_epsilon: float, count: int = 1) -> bool:
        """Whether recording ``count`` × ``event`` keeps ε ≤ ``target_epsilon``."""
        target = check_target(target_epsilon)
        return self.epsilon_if(event, count) <= target

    def spend(self, event: PrivacyEvent, target_epsilon: float, count: int = 1) -> float:
        """Record ``count`` × ``event`` if ε stays ≤ target and return the new ε; else raise, recording nothing.

        Costs one ε evaluation: the priced value becomes the cached ε of the new history.
        """
        target = check_target(target_epsilon)
        event = check_event(event)
        count = check_count(count)
        self._check_priceable(event)
        would_be, order = self._epsilon_with(event, count, self._delta)
        if not would_be <= target:
            spent = self.epsilon()
            raise BudgetExceededError(
                f"privacy budget exceeded: spent ε={spent:.6g} at δ={self._delta:g}; recording {count} x "
                f"{event!r} would raise it to ε={would_be:.6g} > target ε={target:g}; refused, nothing recorded",
                spent=spent,
                target=target,
                would_be=would_be,
                event=event,
                count=count,
            )
        self._record_checked(event, count)
        self._eps_cache[self._delta] = (would_be, order)  # same function of the same history
        return would_be

    def affordable_count(self, event: PrivacyEvent, target_epsilon: float) -> int:
        """How many more ``event`` s fit under ``target_epsilon``: n with ε(n) ≤ target < ε(n + 1).

        Found by exponential search + bisection on :meth:`epsilon_if`, so it is exact for whatever
        accountant the ledger uses (0 if the ledger is already over target). Cached per (history,
        event, target): when the only change since the last call is that k more of this same event were
        recorded, the history is exactly one the search already priced, so the answer is the cached one
        minus k. Calling it every step is therefore O(1) even with PRV. A costless event (zero RDP,
        e.g. q = 0) returns 2**62.
        """
        event = check_event(event)
        target = check_target(target_epsilon)
        self._check_priceable(event)
        key = (event, target)
        hit = self._afford_cache.get(key)
        if hit is not None:
            generation, steps_then, trailing_was_event, answer = hit
            if generation == self._generation and steps_then == self._steps:
                return answer
            if answer < MAX_COUNT and self._history and self._history[-1][0] == event:
                last_count = self._history[-1][1]
                same_segment = trailing_was_event and generation == self._generation
                new_segment = (
                    not trailing_was_event
                    and generation + 1 == self._generation
                    and self._steps - last_count == steps_then
                )
                if same_segment or new_segment:
                    return max(0, answer - (self._steps - steps_then))
        answer = self._affordable_count(event, target)
        trailing = bool(self._history) and self._history[-1][0] == event
        if len(self._afford_cache) >= 256:  # bound memory if callers sweep many events/targets
            self._afford_cache.clear()
        self._afford_cache[key] = (self._generation, self._steps, trailing, answer)
        return answer

    def _affordable_count(self, event: PrivacyEvent, target: float) -> int:
        """Uncached search for the largest n with ε_if(event, n) ≤ target."""

        def fits(n: int) -> bool:
            if n == 0:
                return True
            try:
                return self._epsilon_with(event, n, self._delta)[0] <= target
            except PRVNumericalError:  # cannot be certified (PRV or PLD), so it does not fit
                return False

        if self.epsilon() > target:
            return 0
        if self._accountant == "pure":
            cost = float(event.pure_epsilon() or 0.0)
            if cost == 0.0:
                return MAX_COUNT
            # Costs add: start at the quotient and correct the floating-point rounding exactly.
            guess = min(MAX_COUNT, int((target - self.epsilon()) / cost)) if math.isfinite(cost) else 0
            while guess > 0 and not fits(guess):
                guess -= 1
            while guess < MAX_COUNT and fits(guess + 1):
                guess += 1
            return guess
        if not self._event_rdp(event).any():
            return MAX_COUNT
        if self._accountant in _DISTRIBUTION_ACCOUNTANTS:
            # Start near the (cheap) RDP answer: PRV/PLD evaluations cost ~0.1-1 s each.
            guess = max(1, self._rdp_affordable(event, target))
        else:
            guess = 1
        if fits(guess):
            lo, step = guess, max(1, guess // 4)
            hi = lo + step
            while fits(hi):
                lo, step = hi, step * 2
                if hi >= MAX_COUNT:
                    return MAX_COUNT
                hi = min(MAX_COUNT, hi + step)
        else:
            hi, lo = guess, guess // 2
            while not fits(lo):
                hi, lo = lo, lo // 2
        while hi - lo > 1:  # invariant: fits(lo) and not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _rdp_affordable(self, event: PrivacyEvent, target: float) -> int:
        """RDP answer for the same question (used to seed the PRV search)."""
        shadow = PrivacyLedger(self._delta, "rdp", self._orders)
        for e, n in self._history:
            shadow.record(e, n)
        return min(shadow.affordable_count(event, target), sys.maxsize)

    # ------------------------------------------------------------------ curve
    def epsilon_curve(self, num_points: int | None = None) -> list[tuple[int, float]]:
        """``[(step, ε after that many steps), ...]`` at up to ``num_points`` evenly spaced steps, for plots.

        Always includes step 0 (ε = 0) and the last step. Default: 200 points with RDP (microseconds
        each), 25 with PRV, where each point is a full PRV evaluation (~0.1-1 s).
        """
        if num_points is None:
            num_points = 25 if self._accountant in _DISTRIBUTION_ACCOUNTANTS else 200
        if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 2:
            raise ValueError(f"num_points must be an integer >= 2, got {num_points!r}")
        if self._steps == 0:
            return [(0, 0.0)]
        points = sorted({round(x) for x in np.linspace(0, self._steps, num_points)})
        prefix = self._empty_like()
        events = [event for event, _ in self._history]
        left = [count for _, count in self._history]
        index = 0
        curve: list[tuple[int, float]] = []
        for target_step in points:
            while prefix.steps < target_step:
                take = min(left[index], target_step - prefix.steps)
                prefix.record(events[index], take)
                left[index] -= take
                if left[index] == 0:
                    index += 1
            curve.append((int(target_step), prefix.epsilon()))
        return curve

    def _empty_like(self) -> PrivacyLedger:
        """An empty ledger priced like this one (subclasses such as privacy filters keep their rules)."""
        return PrivacyLedger(self._delta, self._accountant, self._orders)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain-python state (dicts, lists, floats, ints, strings): safe for ``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "accountant": self._accountant,
            "delta": self._delta,
            "orders": list(self._orders),
            "history": [{"event": event.to_dict(), "count": count} for event, count in self._history],
        }

    def continues(self, history: Sequence[tuple[PrivacyEvent, int]]) -> bool:
        """Whether ``history`` (run-length ``[(event, count), ...]``) starts with this ledger's whole history."""
        theirs = iter([(event, count) for event, count in history if count > 0])
        have: tuple[PrivacyEvent, int] | None = None
        for event, count in self._history:
            while count > 0:
                if have is None or have[1] == 0:
                    have = next(theirs, None)
                    if have is None or have[0] != event:
                        return False
                taken = min(count, have[1])
                count -= taken
                have = (have[0], have[1] - taken)
        return True

    def check_continued_by(self, state: dict[str, Any]) -> None:
        """Refuse (``ValueError``) a saved state that would lower this ledger: within a process a ledger only
        grows, so a state it can load must hold every event it holds now, in the same order, and maybe more."""
        self._refuse_lowering(self._parse_state(state))

    def _refuse_lowering(self, entries: list[tuple[PrivacyEvent, int]]) -> None:
        if self.continues(entries):
            return
        then = PrivacyLedger(self._delta, self._accountant, self._orders)
        for event, count in entries:
            then.record(event, count)
        raise ValueError(
            f"the saved ledger (ε={then.epsilon():.4g}, {then.steps} events) does not continue this one "
            f"(ε={self.epsilon():.4g}, {self._steps} events): loading it would erase releases already recorded, "
            "and a ledger only grows. Load it into a new PrivacyLedger"
        )

    def _parse_state(self, state: dict[str, Any]) -> list[tuple[PrivacyEvent, int]]:
        """The history of a ``state_dict``, checked against this ledger's accountant and δ (``ValueError``)."""
        if not isinstance(state, dict):
            raise ValueError(
                f"state must be a dict from PrivacyLedger.state_dict(), got {type(state).__name__}"
            )
        missing = {"version", "accountant", "delta", "history"} - set(state)
        if missing:
            raise ValueError(f"ledger state is missing keys {sorted(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"unsupported ledger state version {state['version']!r} (expected {_STATE_VERSION})"
            )
        if state["accountant"] != self._accountant:
            raise ValueError(
                f"ledger state was saved with accountant={state['accountant']!r} but this ledger uses "
                f"accountant={self._accountant!r}; create the ledger with the same accountant"
            )
        if float(state["delta"]) != self._delta:
            raise ValueError(
                f"ledger state was saved with delta={state['delta']!r} but this ledger uses "
                f"delta={self._delta!r}; ε is only comparable at the same δ"
            )
        entries: list[tuple[PrivacyEvent, int]] = []
        for item in state["history"]:
            if not isinstance(item, dict) or set(item) != {"event", "count"}:
                raise ValueError(
                    f"bad ledger history entry {item!r}; expected {{'event': ..., 'count': ...}}"
                )
            entries.append((PrivacyEvent.from_dict(item["event"]), check_count(item["count"])))
        for event, _ in entries:  # validate everything before touching the current history
            self._check_priceable(event)
            self._event_rdp(event)
        return entries

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the history with a saved one that continues it; refuses a state saved with another
        accountant or δ, and one that would lower the ledger (it must hold every event recorded so far).

        The history is the ground truth: ε is recomputed with this ledger's orders.
        """
        entries = self._parse_state(state)
        self._refuse_lowering(entries)
        self._reset()
        for event, count in entries:
            self.record(event, count)

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        """Loggable snapshot: epsilon, delta, accountant, steps (and best_order for RDP)."""
        eps, order = self.epsilon_and_order()
        out: dict[str, Any] = {
            "epsilon": eps,
            "delta": self._delta,
            "accountant": self._accountant,
            "steps": self._steps,
        }
        if self._accountant == "rdp":
            out["best_order"] = order
        return out
