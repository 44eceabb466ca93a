#!/usr/bin/env bash
# The README's "install into your own project": build the wheel, install it with the pinned torch pair
# into a fresh virtualenv, and from a folder outside the clone train the digits config once with the
# installed `lightning-dp` command, then run a user's own LightningCLI script that never imports
# lightning_dp. PYTHON: an interpreter with pip (the Makefile passes the clone's .venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$root"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -c "$root/constraints.txt" "$work"/dist/*.whl
cd "$work"  # only the installed package (lightning_dp and recipes) is importable from here
quiet=(--trainer.enable_progress_bar false --trainer.enable_model_summary false)
"$work/venv/bin/lightning-dp" fit --config "$root/configs/digits_dpsgd.yaml" --trainer.max_epochs 1 "${quiet[@]}"
test -s runs/digits_dpsgd/version_0/privacy_report.json
"$work/venv/bin/python" "$root/.ci/user_cli.py" --trainer.strategy lightning_dp.DPStrategy \
    --trainer.strategy.noise_multiplier 1.0 --trainer.max_steps 2 --trainer.logger false \
    --trainer.enable_checkpointing false "${quiet[@]}"
echo "wheel-check: OK"
