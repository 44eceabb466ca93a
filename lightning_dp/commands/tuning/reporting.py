"""What a private search publishes: the public checkpoint, the ε report, the plan summary and plot."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.rdp import epsilon_from_rdp
from lightning_dp.accounting.repeat_select import (
    Repetitions,
    max_history_rdp,
)
from lightning_dp.commands.tuning.planning import TuningPlan, instantiate_cli, naive_epsilon, tuned_epsilon
from lightning_dp.core.version import __version__

_PUBLIC_DP_STATE = ("version", "steps", "ledger", "max_grad_norm")


def public_checkpoint(source: Path, destination: Path) -> None:
    """Copy the winner's checkpoint without its generator states (I13); the weights and hparams are kept."""
    import torch

    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    state = checkpoint.get("lightning_dp")
    if isinstance(state, dict):
        checkpoint["lightning_dp"] = {k: v for k, v in state.items() if k in _PUBLIC_DP_STATE}
    tmp = destination.with_suffix(".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, destination)


def tuning_report(
    tuning_plan: TuningPlan, selected: dict[str, Any] | None, *, seed_given: bool
) -> dict[str, Any]:
    """The public report: ε of the search and how it was computed. No K, no other trial, no trial index (I2)."""
    ledger = tuning_plan.ledger()
    epsilon, order = ledger.epsilon_and_order()
    orders = ledger.orders
    curve = max_history_rdp(tuning_plan.histories(), orders)
    reps = tuning_plan.spec.repetitions
    return {
        "epsilon": epsilon,
        "delta": tuning_plan.delta,
        "rdp_order": order,
        "theorem": reps.theorem,
        "repetitions": reps.to_dict(),
        "epsilon_single_trial": epsilon_from_rdp(curve, orders, tuning_plan.delta)[0],
        "epsilon_naive_at_mean": naive_epsilon(curve, orders, math.ceil(reps.mean), tuning_plan.delta),
        "target_epsilon": tuning_plan.spec.target_epsilon,
        "search_space": tuning_plan.spec.space.to_dict(),
        "per_candidate": tuning_plan.per_candidate(),
        "selected": selected,
        "score_source": tuning_plan.spec.score.source,
        "score_noise_multiplier": tuning_plan.spec.score.noise_multiplier
        if tuning_plan.spec.score.private
        else None,
        "seed_given": seed_given,
        "lightning_dp_version": __version__,
    }


def epsilon_by_mean(tuning_plan: TuningPlan, means: Sequence[float]) -> dict[str, list[float]]:
    """Tuned ε of the planned trial curve for every family at each mean (data-independent: the plot, --plan_only)."""
    orders = PrivacyLedger(tuning_plan.delta).orders
    curve = max_history_rdp(tuning_plan.histories(), orders)
    eta = tuning_plan.spec.repetitions.eta
    out: dict[str, list[float]] = {}
    for family in ("poisson", "logarithmic", "geometric", "tnb"):
        if family == "tnb" and tuning_plan.spec.repetitions.family != "tnb":
            continue
        row = []
        for mean in means:
            if (family == "poisson" and mean < 1) or (family != "poisson" and mean <= 1):
                row.append(math.nan)
                continue
            row.append(tuned_epsilon(curve, orders, Repetitions(family, mean, eta), tuning_plan.delta))
        out[family] = row
    out["naive"] = [
        naive_epsilon(curve, orders, int(m), tuning_plan.delta) if float(m).is_integer() else math.nan
        for m in means
    ]
    return out


def plan_summary(tuning_plan: TuningPlan) -> str:
    """Text table for ``--plan_only``: ε of one trial per combination, and the search's ε for each law of K."""
    reps = tuning_plan.spec.repetitions
    lines = [f"privacy-relevant keys: {tuning_plan.relevant_keys or 'none'}"]
    for row in tuning_plan.per_candidate():
        lines.append(
            f"  {row['overrides'] or '(every setting)'}: σ = {row['noise_multiplier']:.6g}, q = {row['sample_rate']:.6g}, "
            f"{row['steps']} steps, ε of one trial = {row['epsilon']:.4f}"
        )
    table = epsilon_by_mean(tuning_plan, [reps.mean])
    lines.append(f"ε of the released best at mean {reps.mean:g} trials (δ = {tuning_plan.delta:g}):")
    for family, (value,) in table.items():
        name = f"naive composition of {reps.mean:g}" if family == "naive" else family
        lines.append(f"  {name}: {value:.4f}" + ("  <- configured" if family == reps.family else ""))
    return "\n".join(lines)


def plot_tuning_epsilon(tuning_plan: TuningPlan, path: Path) -> None:
    """ε against the mean number of trials (chosen family solid, others dashed, naive composition, single
    trial, target, configured mean). No point per executed trial: that would reveal K (I2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = tuning_plan.spec.repetitions
    means = [float(m) for m in np.unique(np.round(np.geomspace(1.0, 100.0, 25)))] + [1.5, 2.5]
    means = sorted({*means, reps.mean})
    table = epsilon_by_mean(tuning_plan, means)
    orders = PrivacyLedger(tuning_plan.delta).orders
    single = epsilon_from_rdp(max_history_rdp(tuning_plan.histories(), orders), orders, tuning_plan.delta)[0]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for family, row in table.items():
        if family == "naive":
            ks = [m for m, v in zip(means, row, strict=True) if math.isfinite(v)]
            ax.plot(ks, [v for v in row if math.isfinite(v)], "k.", label="naive composition of k trials")
            continue
        style = "-" if family == reps.family else "--"
        ax.plot(means, row, style, label=f"best of K, K ~ {family}")
    ax.axhline(single, color="grey", lw=0.8, label="one trial")
    if tuning_plan.spec.target_epsilon is not None:
        ax.axhline(tuning_plan.spec.target_epsilon, color="red", lw=0.8, label="target")
    ax.axvline(reps.mean, color="grey", ls=":", label="configured mean")
    ax.set_xscale("log")
    ax.set_xlabel("mean number of trials")
    ax.set_ylabel(f"ε at δ = {tuning_plan.delta:g}")
    ax.set_title("ε of the released best trial")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_release_to_loggers(base_args: Sequence[str], report: Mapping[str, Any]) -> None:
    """Send the search's ε and the selected setting to every logger of the base config (one run, no trial)."""
    cli = instantiate_cli(base_args)
    selected = report["selected"] or {}
    metrics = {"tune/epsilon": float(report["epsilon"]), "tune/delta": float(report["delta"])}
    if selected.get("score") is not None:
        metrics["tune/score"] = float(selected["score"])
    for logger in cli.trainer.loggers:
        with contextlib.suppress(NotImplementedError):
            logger.log_hyperparams({"tune/" + k: v for k, v in (selected.get("overrides") or {}).items()})
        logger.log_metrics(metrics, step=0)
        logger.save()
        logger.finalize("success")
