"""Kept for users' imports: re-exports :mod:`lightning_dp.commands.audit`, this module's new home."""

from lightning_dp.commands.audit import (
    AUDIT_PLOT_NAME,
    JITTER,
    AuditResult,
    CanaryKind,
    GradientCanaries,
    Placement,
    audit,
    canary_scores,
    default_guesses,
    epsilon_lower_bound,
    evaluate_guesses,
    logit_margins,
    make_input_canaries,
    p_value,
    plot_audit,
)

__all__ = [
    "AUDIT_PLOT_NAME",
    "JITTER",
    "AuditResult",
    "CanaryKind",
    "GradientCanaries",
    "Placement",
    "audit",
    "canary_scores",
    "default_guesses",
    "epsilon_lower_bound",
    "evaluate_guesses",
    "logit_margins",
    "make_input_canaries",
    "p_value",
    "plot_audit",
]
