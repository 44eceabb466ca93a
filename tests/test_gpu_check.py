"""bench/gpu_check.py cannot rot between GPU visits: its dry run (the same code on the CPU at tiny sizes) runs
here, its time boxes cut a part and let the others run, and it imports nothing the GPU machine lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _names(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {
        canonicalize_name(ln.split("==")[0].strip()) for ln in lines if ln.strip() and not ln.startswith("#")
    }


def _run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert (out / "results.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    return _run(tmp_path_factory.mktemp("dry"))


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_passes(dry_run: tuple[int, dict[str, Any], str]) -> None:
    code, record, md = dry_run
    parts = record["parts"]
    assert code == 0, json.dumps({k: (v["status"], v.get("detail")) for k, v in parts.items()})
    names = [name for name in parts]
    assert [n for n in names if n.startswith("correctness")] == [
        "correctness-gradients",
        "correctness-trainer",
        "correctness-mechanisms",
    ]
    for name, part in parts.items():
        if name.startswith("correctness"):
            assert part["status"] == "passed"
            outcomes = [t["outcome"] for t in part["result"]["tests"]]
            assert outcomes, name
            assert set(outcomes) <= {"passed", "xfailed"}, outcomes
        elif part["result"].get("model") == "fsdp":  # speed-fsdp: on the CPU, dp_fsdp alone on one process
            assert part["status"] == "done", part
            rows = {row["variant"]: row for row in part["result"]["rows"]}
            assert rows["dp-fsdp W=1"]["rounds"] >= 1, rows
            assert rows["dp-fsdp W=1"]["median_ms"] > 0, rows
        else:
            assert part["status"] == "done", part
            rows = {row["variant"]: row for row in part["result"]["rows"]}
            for variant in ("plain", "lightning-dp"):
                assert rows[variant]["rounds"] >= 1, rows
                assert rows[variant]["median_ms"] > 0, rows
            assert any(v.startswith("opacus") for v in rows), rows  # timed, or n/a with Opacus's reason
    assert "| part | box s | took s | status | what |" in md
    assert "## Speed and memory" in md
    assert "## Correctness" in md


@pytest.mark.slow
def test_the_dry_run_imports_only_what_the_gpu_machine_has(dry_run: tuple[int, dict[str, Any], str]) -> None:
    """The image's packages (bench/gpu_image.txt) and the wheels bench/gpu_wheels.sh brings: nothing else."""
    _, record, _ = dry_run
    imported = {canonicalize_name(d) for d in record["check"]["imported_distributions"]}
    assert {"torch", "lightning", "opacus", "transformers"} <= imported  # the record is not empty
    allowed = _with_requirements(
        _names(ROOT / "bench" / "gpu_image.txt") | _names(ROOT / "bench" / "gpu_wheels.txt")
    )
    assert imported - OPTIONAL_IMPORTS <= allowed, sorted(imported - allowed)


OPTIONAL_IMPORTS = {"platformdirs"}
"""Imported only when installed, inside a ``try`` (scipy.datasets): here the docs tools bring it; the GPU image
runs without it."""


def _with_requirements(names: set[str]) -> set[str]:
    """``names`` and what their versions installed here require (huggingface-hub 2.x imports httpx2, which the
    image's 1.x does not need: an image package brings its own dependencies)."""
    out, todo = set(names), list(names)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name not in out:
                out.add(name)
                todo.append(name)
    return out


@pytest.mark.slow
def test_a_part_past_its_box_is_cut_and_the_others_still_run(tmp_path: Path) -> None:
    """A correctness part and a speed part, each with a box too short for it: both are cut (killed), a
    new child runs the next part, and the exit status says the correctness was not established (2)."""
    code, record, md = _run(
        tmp_path,
        "--parts", "correctness-mechanisms,speed-vit,speed-wrn",
        "--box", "correctness-mechanisms=0.01", "--box", "speed-vit=0.01", "--grace", "0",
    )  # fmt: skip
    parts = record["parts"]
    assert parts["correctness-mechanisms"]["status"] == "cut"
    assert parts["speed-vit"]["status"] == "cut"
    assert parts["speed-wrn"]["status"] == "done"
    assert code == 2
    assert "**cut**" in md


@pytest.mark.slow
def test_a_correctness_part_stops_its_own_tests_at_its_box(tmp_path: Path) -> None:
    """Within the kill's grace, the part skips the tests that would start past its box ("not run"), ends
    itself, and the same child goes on to the next part."""
    code, record, _ = _run(
        tmp_path, "--parts", "correctness-trainer,correctness-mechanisms", "--box", "correctness-trainer=0.01"
    )
    trainer, mechanisms = record["parts"]["correctness-trainer"], record["parts"]["correctness-mechanisms"]
    outcomes = [t["outcome"] for t in trainer["result"]["tests"]]
    assert trainer["status"] == "cut"
    assert "detail" not in trainer  # it ended itself, nothing was killed
    assert outcomes[0] == "passed"  # a test that started inside the box runs to its end
    assert set(outcomes[1:]) == {"not run"}
    assert mechanisms["status"] == "passed"
    assert (tmp_path / "out" / "children.log").read_text().count("child for") == 1
    assert code == 2
