"""The privacy report: what was spent, how, and by which mechanisms (JSON plus an ε-vs-step plot)."""

from __future__ import annotations

import json
import math
import os
from typing import IO, Any

from lightning_dp.accounting import PrivacyFilter
from lightning_dp.checks import RunChecks
from lightning_dp.core.privacy_unit import PrivacyUnit
from lightning_dp.core.version import __version__
from lightning_dp.run.checkpointing import atomic_write

REPORT_NAME = "privacy_report.json"
CURVE_NAME = "privacy_curve.png"


def privacy_report(
    strategy: Any, stopped_on_budget: bool = False, test_metrics: dict[str, float] | None = None
) -> dict[str, Any]:
    """Everything a reader needs to check the claim, as plain JSON-able values."""
    engine = strategy.engine
    epsilon, order = engine.ledger.epsilon_and_order()
    sigma = engine.last_noise_multiplier()
    data: dict[str, Any] = {
        "epsilon": float(epsilon),
        "delta": engine.delta,
        "target_epsilon": engine.target_epsilon,
        "accountant": engine.accountant,
        "rdp_order": order,
        "steps": engine.steps,
        "noise_multiplier": sigma,
        "sample_rate": engine.sampler.sample_rate,
        "expected_batch_size": engine.sampler.expected_batch_size,
        "dataset_size": engine.sampler.size_for_releases,
        "max_grad_norm": engine.max_grad_norm,
        "sampler": engine.sampler.name,
        "clipping": engine.clipping.name,
        "noise": engine.noise.name,
        "step": engine.step_slot.name,
        "stopped_on_budget": stopped_on_budget,
        "lightning_dp_version": __version__,
    }
    data.update(_slot_facts(strategy, float(epsilon)))
    data["released_constants"] = released_constants(strategy)
    data["public_constants"] = public_constants_statement(engine.sampler)
    if isinstance(engine.ledger, PrivacyFilter):
        data.update(_filter_fields(engine.ledger, float(epsilon)))
    data.update(unit_fields(strategy, float(data["epsilon"])))
    if data.get("privacy_unit") == "user":
        del data["dataset_size"]  # sampler.num_samples is U there; the number of examples is never reported
    if test_metrics:
        data["test_metrics"] = dict(test_metrics)
        for key in ("test_acc", "test_accuracy"):
            if key in test_metrics:
                data["test_accuracy"] = test_metrics[key]
    return data


def _slot_facts(strategy: Any, epsilon: float) -> dict[str, Any]:
    """What the checks, the ledger and the slots add to the report, each only where it has something."""
    engine = strategy.engine
    data: dict[str, Any] = {}
    checks = getattr(strategy, "checks", None)  # the audit reports a strategy-less run too
    if isinstance(checks, RunChecks):
        data["checks"] = checks.summary()
    data["ledger_events"] = engine.ledger.steps
    conv_tuner = getattr(strategy, "conv_tuner", None)  # the cost model's methods per convolution shape
    if conv_tuner is not None and conv_tuner.choices:
        data["conv_methods"] = conv_tuner.report()
    if engine.prior_events:  # the model's releases before this strategy: counted in ε above
        data["earlier_ledger_events"] = engine.prior_events
    clip_norm = engine.clipping.report()
    if clip_norm is not None:  # a clipping bound adapted from released values: its trajectory's summary
        data["clip_norm"] = clip_norm
    facts = engine.noise.report()
    if facts is not None and engine.noise.correlated:  # BandMF / BLT: the strategy matrix, its accounting
        data["correlated_noise"] = facts
    elif facts is not None:  # secure noise: the grid, the generator, the bound used and the sampler's δ
        data["noise_mechanism"] = facts | secure_delta(engine, epsilon)
    return data


def _filter_fields(ledger: PrivacyFilter, epsilon: float) -> dict[str, Any]:
    """Adaptively chosen releases: the guarantee is the budget fixed in advance (the filter's target); the
    composition of what happened to be released (``epsilon``) is an odometer reading beside it."""
    return {
        "epsilon": float(ledger.target_epsilon),
        "epsilon_kind": "privacy filter: epsilon is the guarantee (the budget fixed in advance)",
        "realised_epsilon": epsilon,
        "realised_epsilon_kind": "odometer: the composition of the releases this run made; not a guarantee by itself",
    }


def secure_delta(engine: Any, epsilon: float) -> dict[str, Any]:
    """The δ the discrete Gaussian sampler's tail adds (``DiscreteGaussian``), and the whole guarantee's δ."""
    from lightning_dp.noise.discrete_gaussian import DiscreteGaussian

    noise = engine.noise
    if not isinstance(noise, DiscreteGaussian):
        return {}
    extra = noise.sampler_delta(engine.ledger.steps, epsilon)
    return {
        "sampler_delta": extra,
        "guarantee": f"(ε, δ + sampler_delta) = ({epsilon:.4g}, {engine.delta + extra:.6g})",
    }


def released_constants(strategy: Any) -> dict[str, dict[str, Any]]:
    """Every constant that entered the releases: its value, where it came from, and whether it was declared
    public. N (U with users) is declared only with ``dataset_size=``; q, the divisor, the epoch length and a
    calibrated σ are computed from it, so they are declared exactly when it is; the rest are arguments."""
    engine = strategy.engine
    sampler = engine.sampler
    declared = sampler.public_size is not None
    users = sampler.unit == "user"
    derived = "declared" if declared else "assumed public"
    size_source = "dataset_size=" if declared else "the training set's real size (assumed public)"
    batch = max(1, round(sampler.expected_batch_size))
    config = getattr(strategy, "config", None)
    sigma_given = config is not None and not config.sigma_calibrated

    def entry(value: Any, source: str, public: bool) -> dict[str, Any]:
        return {"value": value, "source": source, "declared_public": public}

    out = {
        "num_units" if users else "dataset_size": entry(sampler.size_for_releases, size_source, declared),
        "expected_batch_size": entry(
            sampler.expected_batch_size, "users_per_step" if users else "the DataLoader's batch_size", True
        ),
        "sample_rate": entry(
            sampler.sample_rate, f"expected batch / {'U' if users else 'N'} ({derived})", declared
        ),
        "steps_per_epoch": entry(
            sampler.batches_per_epoch(sampler.num_samples, batch), f"⌈N / B⌉ ({derived})", declared
        ),
        "steps": entry(engine.steps, f"max_epochs × steps per epoch, or max_steps ({derived})", declared),
        "noise_multiplier": entry(
            engine.last_noise_multiplier(),
            "noise_multiplier="
            if sigma_given
            else f"calibrated from target_epsilon, δ, q and the steps ({derived})",
            True if sigma_given else declared,
        ),
        "max_grad_norm": entry(engine.max_grad_norm, "max_grad_norm=", True),
        "delta": entry(engine.delta, "delta=", True),
        "target_epsilon": entry(engine.target_epsilon, "target_epsilon=", True),
    }
    if isinstance(sampler.bands, int) and sampler.bands > 1:
        out["bands"] = entry(
            sampler.bands, f"CyclicPoisson bands (b = ⌊N / B⌋ when 'auto'; {derived})", declared
        )
    if users:
        out["examples_per_user"] = entry(
            getattr(sampler, "examples_per_user", None), "examples_per_user=", True
        )
    return out


def public_constants_statement(sampler: Any) -> str:
    """One sentence: whether N was declared public or is assumed public."""
    name = "U (the number of users)" if sampler.unit == "user" else "N (the number of training examples)"
    if sampler.public_size is not None:
        return (
            f"{name} was declared public (dataset_size={sampler.public_size}): q, the divisor q·N and the steps "
            "per epoch read it, not the training set's real size."
        )
    return (
        f"{name} is assumed public: it is the training set's real size and it sets q, the divisor q·N and the "
        "steps per epoch. Pass dataset_size=... to declare a public value instead."
    )


NO_USER_LEVEL_GUARANTEE = (
    "No user-level privacy guarantee is possible without a bound on the number of examples per user."
)
USER_LEVEL_METHOD = "Ganesh 2024 MoG dominating pair; Vadhan 2017 Lemma 2.2 group privacy"


def unit_fields(strategy: Any, epsilon: float) -> dict[str, Any]:
    """What the ε covers (``docs/user-level.md``): the privacy unit, its adjacency and count, q and the expected
    batch in units, the public per-unit bounds, and a TF-Privacy-shaped statement. Never the number of
    examples of a user-level run, per-user counts or rows per step: those are statistics of the private data."""
    unit = getattr(strategy, "privacy_unit", None)
    if not isinstance(unit, PrivacyUnit):
        return {}
    engine = strategy.engine
    sampler = engine.sampler
    user = unit.kind == "user"
    config = getattr(strategy, "config", None)
    fields: dict[str, Any] = {
        "privacy_unit": unit.kind,
        "adjacency": unit.adjacency,
        "unit_key": _key_name(_user_key(sampler, config)),
        "num_units": unit.num_units,
        "sample_rate": sampler.sample_rate,
        "expected_batch_size": sampler.expected_batch_size,
        "examples_per_unit": unit.examples_per_user if user else 1,
        "unit_selection": getattr(sampler, "selection", None) if user else None,
        "unit_reduction": getattr(sampler, "reduction", None) if user else None,
        "augmentation_multiplicity": unit.augmentation_multiplicity,
    }
    accountant = str(engine.accountant).upper()
    sampling = (
        f"Poisson sampling of {unit.kind}s"
        if sampler.name in ("Poisson", "UserPoisson")
        else (f"{sampler.name} sampling")
    )
    statement = (
        f"{unit.kind.capitalize()}-level DP (add/remove one {unit.kind}, all checkpoints), δ={engine.delta:g}: "
        f"ε = {epsilon:.4g} ({accountant}) with {sampling}"
    )
    if user:
        statement += f"; each user contributes at most {unit.examples_per_user} examples per step."
    elif unit.max_examples_per_user is not None:
        user_level = els_statement(strategy, unit.max_examples_per_user)
        fields["user_level"] = user_level
        statement += f". {user_level['statement']}"
    else:
        statement += f". {NO_USER_LEVEL_GUARANTEE}"
    fields["statement"] = statement
    return fields


def _user_key(sampler: Any, config: Any) -> Any:
    """Where the run reads each example's user: the user sampler's key, else the example-level bound's."""
    if sampler.unit == "user":
        return getattr(sampler, "user_key", None)
    return getattr(getattr(config, "user_bound", None), "user_key", None)


def _key_name(key: Any) -> str | None:
    """How the user ids were read, never the ids: the name given, or the kind of object."""
    if key is None or isinstance(key, str):
        return key
    return f"<{getattr(key, '__name__', type(key).__name__)}>"


def els_statement(strategy: Any, k: int) -> dict[str, Any]:
    """The user-level ε of an example-level run whose users own at most k examples each (enforced): the tight
    mixture-of-Gaussians PLD (None without dp-accounting, or for a ledger with events other than
    Poisson-subsampled Gaussians) and the RDP group-privacy bound (∞ where it has no solution). Slow (seconds to a minute): computed
    once per ledger state, at the end of fit, never per step."""
    from lightning_dp.accounting.group import group_rdp_user_epsilon, mog_user_epsilon_of_history

    engine = strategy.engine
    ledger = engine.ledger
    key = (ledger.steps, len(ledger.history), engine.delta, k)
    cached = getattr(strategy, "_els_cache", None)
    if cached is not None and cached[0] == key:
        return dict(cached[1])
    try:  # one mixture-of-Gaussians event per (σ, q) segment of the ledger
        mog = mog_user_epsilon_of_history(ledger.history, k, engine.delta)
    except ValueError:  # an event other than a subsampled Gaussian: the RDP group bound alone
        mog = None
    group = float(group_rdp_user_epsilon(ledger, k, engine.delta))
    best = min(value for value in (mog, group) if value is not None)
    parts = [f"{_number(mog)} (MoG PLD)"] if mog is not None else []
    parts.append(f"{_number(group)} (RDP group privacy)")
    data = {
        "max_examples_per_user": k,
        "epsilon": best,
        "epsilon_pld_mog": mog,
        "epsilon_rdp_group": group,
        "method": USER_LEVEL_METHOD,
        "enforced": True,
        "statement": (
            f"User-level DP (add/remove one user, all checkpoints), δ={engine.delta:g}, each user owning at most "
            f"{k} examples (enforced): ε = {' or '.join(parts)}."
        ),
    }
    strategy._els_cache = (key, data)
    return dict(data)


def _number(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.4g}"


def write_report(data: dict[str, Any], ledger: Any, directory: str) -> str:
    """Write ``privacy_report.json`` and ``privacy_curve.png`` into ``directory``; returns the JSON path.

    Each file is replaced atomically; a failed write (a full disk) raises an ``OSError`` that says the
    file in place, if any, is from an earlier run, and leaves no temporary file behind.
    """
    path = os.path.join(directory, REPORT_NAME)
    atomic_write(path, lambda f: f.write(_json_bytes(data)), "privacy report")
    atomic_write(os.path.join(directory, CURVE_NAME), lambda f: plot_curve(ledger, f, data), "privacy curve")
    return path


def add_audit(report_path: str, audit: dict[str, Any]) -> None:
    """Store an audit summary (lightning_dp/commands/audit.py) as the report's ``"audit"`` field, atomically."""
    with open(report_path) as f:
        data = json.load(f)
    data["audit"] = audit
    atomic_write(report_path, lambda f: f.write(_json_bytes(data)), "privacy report")


def _json_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=2, default=float).encode()


def plot_curve(ledger: Any, path: str | IO[bytes], data: dict[str, Any]) -> None:
    """ε against step, with the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curve = ledger.epsilon_curve()
    per_event = int(data.get("correlated_noise", {}).get("steps_per_event", 1))
    if per_event != 1:  # BandMF: one ledger event per round of b steps; the x-axis stays in steps
        curve = [(min(events * per_event, int(data["steps"])), eps) for events, eps in curve]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    filtered = "realised_epsilon" in data
    if curve:
        steps, eps = zip(*curve, strict=True)
        spent = "realised ε (odometer)" if filtered else "ε spent"
        ax.plot(steps, eps, label=f"{spent} ({data['accountant']})")
    if data.get("target_epsilon") is not None:
        target = "guaranteed ε (filter budget)" if filtered else "target ε"
        ax.axhline(data["target_epsilon"], linestyle="--", color="grey", label=target)
    ax.set_xlabel("step")
    ax.set_ylabel(f"ε at δ={data['delta']:g}")
    ax.set_title(f"{data['sampler']} · {data['clipping']} · σ={data['noise_multiplier'] or 0:.3g}")
    ax.legend(loc="lower right")
    try:
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
