#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the Python 3.12 manylinux wheels of bench/gpu_wheels.txt, the packages the
# GPU machine's image lacks, and check that pip install --no-deps of them beside the image's packages
# (bench/gpu_image.txt) leaves no requirement missing, and that they stay far under the 64 MiB that travels.
# Run it here, where pip reaches PyPI; bench/README.md has the command that installs them on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
dest=.whl
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" -r bench/gpu_wheels.txt
"$python" - "$dest" <<'PY'
"""Every Requires-Dist (markers evaluated for CPython 3.12 on Linux, no extras) of every wheel must be in the
image or among the wheels, and each package must come once."""
import re, sys, zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an interpreter without packaging: pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

dest = Path(sys.argv[1])
wanted = {canonicalize_name(Requirement(ln).name) for ln in Path("bench/gpu_wheels.txt").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")}
image = {canonicalize_name(ln.strip()) for ln in Path("bench/gpu_image.txt").read_text().splitlines()
         if ln.strip() and not ln.startswith("#")}
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
wheels = {}
for whl in sorted(dest.glob("*.whl")):
    name = canonicalize_name(whl.name.split("-")[0])
    if name in wheels:
        sys.exit(f"two wheels of {name} in {dest}: keep one")
    wheels[name] = whl
if wanted - set(wheels):
    sys.exit(f"not downloaded: {sorted(wanted - set(wheels))}")
missing = []
for name, whl in wheels.items():
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                dep = canonicalize_name(req.name)
                if dep not in image and dep not in wheels:
                    missing.append(f"{name} needs {req}")
if missing:
    sys.exit("missing on the GPU machine, add to bench/gpu_wheels.txt:\n  " + "\n  ".join(missing))
size = sum(w.stat().st_size for w in wheels.values())
if size > 32 * 2**20:
    sys.exit(f"the wheels take {size / 2**20:.1f} MiB: too much of the 64 MiB that travels")
print(f"gpu_wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest}/, every requirement in the image or here")
PY
