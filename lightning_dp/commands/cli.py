"""The ``lightning-dp`` command: LightningCLI with the DP strategies registered and a final summary.

``lightning-dp fit --config configs/digits_dpsgd.yaml`` trains, tests (``--test_after_fit``, on by
default) and prints ε next to the test accuracy; ``validate`` and ``test`` work as in LightningCLI.
``lightning-dp audit --config configs/digits_dpsgd.yaml`` audits the run empirically (lightning_dp/commands/audit.py).
``lightning-dp tune --config base.yaml --search search.yaml`` tunes privately (lightning_dp/commands/tuning/).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from lightning_dp.commands.lightning_cli import DPLightningCLI, command_line_args
from lightning_dp.strategies import register

if TYPE_CHECKING:
    from lightning_dp.commands.audit import AuditResult


def audit_main(args: list[str]) -> int:
    """``lightning-dp audit --config run.yaml``: train once with canaries, print claimed vs audited ε.

    Returns 1 (the exit status) when the audited lower bound exceeds the claimed ε.
    """
    from lightning_dp.commands.audit import audit

    parser = argparse.ArgumentParser(
        prog="lightning-dp audit",
        description="Empirical lower bound on ε from one training run (Steinke, Nasr & Jagielski 2023). "
        "Other options (--config, --trainer.*, --model.*, --data.*) are those of `lightning-dp fit`.",
    )
    parser.add_argument("--canary", choices=("gradient", "input"), default="gradient")
    parser.add_argument("--num_canaries", type=int, default=256)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument(
        "--examples_per_canary",
        type=int,
        default=None,
        help="input canaries on a user-level run: examples per canary user (default: examples_per_user)",
    )
    parser.add_argument(
        "--audit_seed", type=int, default=None, help="fixes the canaries (default: os.urandom)"
    )
    known, rest = parser.parse_known_args(args)
    cli = DPLightningCLI(
        args=rest, run=False, save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False
    )
    result = audit(
        cli.trainer,
        cli.model,
        cli.datamodule,
        canary=known.canary,
        num_canaries=known.num_canaries,
        confidence=known.confidence,
        examples_per_canary=known.examples_per_canary,
        seed=known.audit_seed,
    )
    if cli.trainer.is_global_zero:
        verdict = (
            "no evidence against the claim" if result.passed else "FAILED: the run leaks more than claimed"
        )
        print(
            f"lightning-dp audit: claimed ε = {result.claimed_epsilon:.4f} per {result.privacy_unit}, audited "
            f"ε ≥ {result.epsilon_lower_bound:.4f} at {result.confidence:.0%} confidence ({result.num_correct}/"
            f"{result.num_guesses} guesses correct, {canaries_line(result)}): {verdict}"
        )
    return 0 if result.passed else 1


def canaries_line(result: AuditResult) -> str:
    """The canaries in words: "256 gradient canaries"; on a user-level run "256 input canary users of 10
    examples each"."""
    if result.privacy_unit != "user":
        return f"{result.num_canaries} {result.canary} canaries"
    held = f" of {result.examples_per_canary} examples each" if result.examples_per_canary else ""
    return f"{result.num_canaries} {result.canary} canary users{held}"


def tune_main(args: list[str]) -> int:
    """``lightning-dp tune --config base.yaml --search search.yaml``: best of a secret number of DP trials.

    ``--plan_only`` prints the per-candidate ε and the tuned ε of every distribution of K (no training).
    """
    from lightning_dp.commands import tuning

    parser = argparse.ArgumentParser(
        prog="lightning-dp tune",
        description="Private hyperparameter tuning (Papernot & Steinke 2022): a secret random number of DP "
        "trials, only the best released, ε of the whole search reported. Other options (--config, "
        "--trainer.*, --model.*, --data.*) are those of `lightning-dp fit` and form the base of every trial.",
    )
    parser.add_argument("--search", required=True, help="search YAML: repetitions, candidates, score, budget")
    parser.add_argument("--out_dir", default="runs/tune")
    parser.add_argument("--resume", action="store_true", help="finish an interrupted search (same K and θ)")
    parser.add_argument("--plan_only", action="store_true", help="print the planned ε; train nothing")
    parser.add_argument("--seed", type=int, default=None, help="for tests only: makes K public")
    parser.add_argument(
        "--ledger", default=None, help="JSON ledger of earlier releases: the search is added to it"
    )
    known, rest = parser.parse_known_args(args)
    if known.plan_only:
        spec = tuning.load_search(known.search, require_distribution=False)
        print(tuning.plan_summary(tuning.plan(rest, spec)))
        return 0
    result = tuning.tune(
        rest, known.search, out_dir=known.out_dir, resume=known.resume, seed=known.seed, ledger=known.ledger
    )
    chosen = "nothing released" if result.selected is None else f"selected {result.selected['overrides']}"
    print(
        f"lightning-dp tune: ε = {result.epsilon:.4f} for the whole search (δ = {result.delta:g}); {chosen}"
    )
    print(f"lightning-dp tune: report {os.path.abspath(result.report_path)}")
    return 0


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-dp`` console script (``args``: the command line without the program)."""
    register()
    argv = args if args is not None else sys.argv[1:]
    with command_line_args():
        if argv[:1] == ["audit"]:
            status = audit_main(argv[1:])
            if status:
                sys.exit(status)
            return
        if argv[:1] == ["tune"]:
            tune_main(argv[1:])
            return
        DPLightningCLI(
            args=argv,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )


if __name__ == "__main__":
    main()
