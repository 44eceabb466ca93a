"""The strategy keywords that option objects replaced (issue #52), translated before the config is built.

Each still works, with one ``DeprecationWarning`` that names its new form, and builds the same run: the
five check keywords become ``checks=Checks(...)``; ``privacy_unit="user"`` and its five keywords become
``sampler=UserPoisson(..., seed=seed)``; ``user_key`` with ``max_examples_per_user`` on an example-level run
becomes ``user_bound=UserBound(...)``. The strategies' signatures keep them (default None: not given), so
LightningCLI YAML that uses them still parses. No message shows a keyword's value (a ``user_key`` may be
the ids themselves).
"""

from __future__ import annotations

import inspect
import sys
import typing
import warnings
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any, Literal

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.sampling import UserPoisson
from lightning_dp.strategies.options import Checks, UserBound

PrivacyUnitKind = Literal["example", "user"]
"""What one neighbouring data set adds or removes: one example, or one user with all their examples."""

CHECK_KEYWORDS: dict[str, str] = {
    "check_sensitivity": "sensitivity",
    "check_overhead": "overhead",
    "isolate_examples": "isolate_examples",
    "public_buffers": "public_buffers",
    "data_changes": "data_changes",
}
"""Old strategy keyword -> its :class:`Checks` field."""
USER_KEYWORDS: dict[str, str] = {
    "user_key": "user_key",
    "examples_per_user": "examples_per_user",
    "users_per_step": "users_per_step",
    "unit_selection": "selection",
    "unit_reduction": "reduction",
    "max_examples_per_user": "max_examples_per_user",
}
"""Old strategy keyword -> its :class:`UserPoisson` argument (``privacy_unit`` chose the sampler)."""
KEYWORDS = (*CHECK_KEYWORDS, "privacy_unit", *USER_KEYWORDS)

_USER_ONLY = ("examples_per_user", "users_per_step", "unit_selection", "unit_reduction")
_OLD_DEFAULTS = {"unit_selection": "random", "unit_reduction": "mean"}


def parameters() -> list[inspect.Parameter]:
    """The old keywords as the strategies' signatures show them: keyword-only, default None (not given),
    typed as their new home types them (so YAML that still uses them parses as before)."""
    checks = typing.get_type_hints(Checks)
    users = typing.get_type_hints(UserPoisson.__init__)
    types: dict[str, Any] = {old: checks[new] for old, new in CHECK_KEYWORDS.items()}
    types["privacy_unit"] = PrivacyUnitKind
    types.update({old: users[new] for old, new in USER_KEYWORDS.items()})
    return [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=types[name] | None)
        for name in KEYWORDS
    ]


def help_lines() -> list[tuple[str, str]]:
    """(keyword, its help) for each old keyword, as ``--help`` and ``help()`` show them."""
    moved = {old: f"checks=Checks({new}=...)" for old, new in CHECK_KEYWORDS.items()}
    moved.update({old: f"sampler=UserPoisson({new}=...)" for old, new in USER_KEYWORDS.items()})
    moved["privacy_unit"] = "sampler=UserPoisson(...) (user-level DP)"
    moved["max_examples_per_user"] += " or, example-level, user_bound=UserBound(...)"
    return [(name, f"deprecated: pass {moved[name]} instead.") for name in KEYWORDS]


def translate(options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``options`` with the old keywords given (not None) replaced by their new form, after one warning
    each form; old and new forms of one setting together are refused."""
    options = dict(options)
    given = {name: value for name in KEYWORDS if (value := options.pop(name, None)) is not None}
    checks = {CHECK_KEYWORDS[name]: value for name, value in given.items() if name in CHECK_KEYWORDS}
    if checks:
        old = _names(name for name in given if name in CHECK_KEYWORDS)
        if options.get("checks") not in (None, Checks()):
            raise DPConfigurationError(
                f"{owner}: give the checks' settings either as checks=Checks(...) or as the deprecated keywords "
                f"{old}, not both. Move them into Checks(...)."
            )
        _warn(owner, old, f"checks=Checks({'=..., '.join(checks)}=...)")
        options["checks"] = Checks(**checks)
    users = {name: value for name, value in given.items() if name not in CHECK_KEYWORDS}
    if users:
        options.update(_user_form(users, options, owner))
    return options


def _user_form(users: dict[str, Any], options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The sampler (``privacy_unit="user"``) or the bound (example level) the user keywords stand for."""
    unit = users.pop("privacy_unit", None)
    allowed = {
        "privacy_unit": ("example", "user"),
        "unit_selection": ("random", "cycle"),
        "unit_reduction": ("mean", "sum"),
    }
    for name, values in allowed.items():
        value = unit if name == "privacy_unit" else users.get(name)
        if value is not None and value not in values:
            raise DPConfigurationError(
                f"{owner}: {name} must be {values[0]!r} or {values[1]!r}, got {value!r} (a deprecated keyword: "
                "pass sampler=UserPoisson(...) instead)."
            )
    sampler = options.get("sampler")
    if sampler is not None and sampler.unit == "user" and users:
        raise DPConfigurationError(
            f"{owner}: give the user sampling either as keywords (user_key, examples_per_user, users_per_step, "
            "unit_selection, unit_reduction, max_examples_per_user) or as sampler=UserPoisson(...), not both."
        )
    if unit == "user":
        return _user_sampler(users, options, owner)
    if unit is not None and not users:
        _warn_no_effect(owner, "privacy_unit='example'", "remove it (each example is the default unit)")
    return _example_bound(users, options, owner)


def _user_sampler(users: dict[str, Any], options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``privacy_unit="user"``: the ``UserPoisson`` its keywords build, seeded with the strategy's seed."""
    sampler = options.get("sampler")
    if sampler is not None:
        if sampler.unit != "user":
            raise DPConfigurationError(
                f"{owner}: privacy_unit='user' samples users, but sampler={sampler.name} samples examples: "
                f"{sampler.name} with users is not priced in this version. Pass sampler=UserPoisson(...) (and "
                "no privacy_unit)."
            )
        _warn_no_effect(owner, "privacy_unit='user'", f"remove it (sampler={sampler.name} samples users)")
        return {}
    missing = [name for name in ("user_key", "examples_per_user", "users_per_step") if name not in users]
    if missing:
        raise DPConfigurationError(
            f"{owner}: privacy_unit='user' needs {', '.join(missing)}: user_key says whose each example is, "
            "examples_per_user (k) bounds the rows a sampled user contributes to a step and users_per_step "
            "(B_u) is the expected users per step (q = B_u / U). Each is a public hyperparameter: choose it "
            "from public knowledge, not from the private per-user counts (pay for a search with lightning-dp "
            "tune). Pass them as sampler=UserPoisson(user_key=..., examples_per_user=..., users_per_step=...)."
        )
    arguments = {USER_KEYWORDS[name]: value for name, value in users.items()}
    seed = options.get("seed")
    shown = [f"{name}=..." for name in arguments] + ([] if seed is None else ["seed=<the same seed>"])
    _warn(owner, _names(["privacy_unit", *users]), f"sampler=UserPoisson({', '.join(shown)})")
    return {"sampler": UserPoisson(**arguments, seed=seed)}


def _example_bound(users: dict[str, Any], options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """An example-level run's user keywords: ``user_key`` with ``max_examples_per_user`` is a bound."""
    per_user = [name for name in _USER_ONLY if name in users and users[name] != _OLD_DEFAULTS.get(name)]
    if per_user:
        raise DPConfigurationError(
            f"{owner}: {', '.join(per_user)} only apply with privacy_unit='user'. For user-level DP pass "
            "sampler=UserPoisson(...), or remove them (for a user-level statement about an example-level run, "
            "pass user_bound=UserBound(user_key=..., max_examples_per_user=...))."
        )
    bound = "user_bound=UserBound(user_key=..., max_examples_per_user=...)"
    if "max_examples_per_user" not in users:
        if users:
            _warn_no_effect(owner, _names(users), f"remove it, or pass {bound} to bound each user's examples")
        return {}
    if "user_key" not in users:
        raise DPConfigurationError(
            f"{owner}: max_examples_per_user needs user_key (whose each example is) to keep at most that many "
            f"examples per user: pass {bound}."
        )
    if options.get("user_bound") is not None:
        raise DPConfigurationError(
            f"{owner}: give the bound either as user_bound=UserBound(...) or as the deprecated keywords user_key "
            "and max_examples_per_user, not both."
        )
    _warn(owner, _names(users), bound)
    return {"user_bound": UserBound(users["user_key"], users["max_examples_per_user"])}


def _names(given: Iterable[str]) -> str:
    """The old keywords given, by name only (never their values), in the signature's order."""
    chosen = set(given)
    return ", ".join(name for name in KEYWORDS if name in chosen)


def _warn(owner: str, old: str, new: str) -> None:
    """The old keywords, by name, and the new form that builds the same run."""
    _deprecated(
        f"{owner}: deprecated keywords {old}: pass {new} instead (the same settings build the same run; the "
        "old keywords keep working until a release removes them)."
    )


def _warn_no_effect(owner: str, old: str, advice: str) -> None:
    """An old keyword that changes nothing where it was given."""
    _deprecated(f"{owner}: the keyword {old} is deprecated and has no effect here: {advice}.")


def _deprecated(message: str) -> None:
    """A DeprecationWarning pointed at the first caller outside lightning_dp (the line that built the strategy)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_dp."):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
