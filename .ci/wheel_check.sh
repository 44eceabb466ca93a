#!/usr/bin/env bash
# The README's "install into your own project": build the wheel, install it into a fresh virtualenv, and
# from a folder outside the clone train the digits config once with the installed `lightning-dp` command,
# then run a user's own LightningCLI script that never imports lightning_dp. PYTHON: an interpreter with
# pip (the Makefile passes the clone's .venv).
#
# The fresh virtualenv takes its third-party packages as hard links of the clone's venv (the same
# resolution of the same pyproject requirements under constraints.txt, which `make install` just did), the
# clone's own editable install removed; the wheel then goes in with --no-deps and `pip check` verifies that
# every requirement the *wheel's* metadata declares is met. This tests what the wheel adds (its files,
# entry points and metadata) in ~10 s instead of re-unpacking 6 GB of torch and CUDA wheels (~2 min).
# Where hard links are impossible (another file system), the dependencies are installed from scratch.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$root"
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
"$python" -m venv --without-pip "$work/venv"
venv_python="$work/venv/bin/python"
source_site="$(purelib "$python")"
target_site="$(purelib "$venv_python")"
if cp -al "$source_site/." "$target_site/" 2>/dev/null; then
    rm -rf "$target_site"/__editable__*lightning_dp* "$target_site"/lightning_dp-*.dist-info
    "$venv_python" -m pip install -q --no-deps "$work"/dist/*.whl
    "$venv_python" -m pip check
    echo "wheel-check: dependencies hard-linked from the clone's venv; the wheel installed with --no-deps"
else
    rm -rf "$work/venv"
    "$python" -m venv "$work/venv"
    "$venv_python" -m pip install -q -c "$root/constraints.txt" "$work"/dist/*.whl
    echo "wheel-check: dependencies installed from scratch (no hard links across file systems)"
fi
cd "$work"  # only the installed package (lightning_dp and recipes) is importable from here
"$venv_python" -c "import lightning_dp, sys; assert lightning_dp.__file__.startswith('$work/venv/'), lightning_dp.__file__"
quiet=(--trainer.enable_progress_bar false --trainer.enable_model_summary false)
"$work/venv/bin/lightning-dp" fit --config "$root/configs/digits_dpsgd.yaml" --trainer.max_epochs 1 "${quiet[@]}"
test -s runs/digits_dpsgd/version_0/privacy_report.json
"$venv_python" "$root/.ci/user_cli.py" --trainer.strategy lightning_dp.DPStrategy \
    --trainer.strategy.noise_multiplier 1.0 --trainer.max_steps 2 --trainer.logger false \
    --trainer.enable_checkpointing false "${quiet[@]}"
echo "wheel-check: OK"
