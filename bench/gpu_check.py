"""The prepared GPU check (issue #30): one command that turns a short GPU visit into figures and bug reports.

    python3 bench/gpu_check.py --out DIR            # on the GPU machine (see bench/README.md: wheels, command)
    python bench/gpu_check.py --dry-run --out DIR   # the same code on the CPU at tiny sizes (CI runs it)

It runs the PARTS below in order, each under its own time box, and writes ``DIR/results.json`` and
``DIR/results.md`` after every part (and every few seconds while one runs), so a killed run still leaves
what it measured. Exit status: 0 when every correctness test that ran passed and all ran; 1 when a
correctness test failed or errored or a correctness part crashed; 2 when none failed but a correctness
part was cut by its time box or not run. Speed and environment problems are reported, never fatal.

How the time boxes hold. The parts run in child processes of this one (``--child``); a child reports the
start and end of each part through a progress file. This process watches the clock: a part that runs past
its box is cut (its child is killed with its process group), reported with whatever it wrote, and a new
child carries on with the remaining parts. A CUDA error that poisons a child's context therefore costs one
part, never the rest. Inside its box a part also stops by itself: the correctness parts skip the tests
that would start after it (``pytest`` with :class:`CheckPlugin`), the speed parts choose their number of
rounds from the warm-up steps (``bench/gpu_speed.py``). The check as a whole stops at ``--total`` seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
for path in (str(ROOT), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)


@dataclass(frozen=True)
class Part:
    name: str
    kind: str  # "tests" (pytest on tests/test_cuda.py, the tests marked cuda(<test_part>)) or "speed"
    box_s: float  # the time box on the GPU, from the part's start in its child process
    what: str
    test_part: str = ""
    model: str = ""
    dry_box_s: float = 60.0  # the time box in the dry run on the CPU (its parts take 1-15 s)


PARTS: list[Part] = [
    Part("correctness-gradients", "tests", 55, "per-example gradients vs autograd (zoo × fp32/TF32/bf16), "
         "certified norms on crafted cancelling batches", test_part="gradients"),
    Part("correctness-trainer", "tests", 155, "σ=0, C=∞ equals plain training and the neighbour test "
         "(zoo × fp32/TF32/bf16-mixed) through the Trainer", test_part="trainer"),
    Part("correctness-mechanisms", "tests", 40, "noise std σC/B, dropout and the sensitivity check, "
         "mixing models refused, every slot's step, checkpoint resume", test_part="mechanisms"),
    Part("speed-gpt2", "speed", 35, "GPT-2 small, T=512, bf16-mixed", model="gpt2"),
    Part("speed-bert", "speed", 30, "BERT-base seq. classification, T=128, bf16-mixed", model="bert"),
    Part("speed-vit", "speed", 30, "ViT-B/16 at 224, bf16-mixed", model="vit"),
    Part("speed-wrn", "speed", 35, "WideResNet-16-4 (GroupNorm) on 32×32, B=256, fp32", model="wrn"),
    Part("speed-resnet18", "speed", 20, "timm ResNet-18 (GroupNorm) on 32×32, B=256, fp32", model="resnet18_gn"),
    Part("speed-convnext", "speed", 20, "timm ConvNeXt-atto on 32×32, B=256, fp32", model="convnext_atto"),
    Part("speed-cnn", "speed", 12, "MNIST CNN, B=256, fp32", model="cnn"),
    Part("speed-lstm", "speed", 15, "Embedding + LSTM(256), T=64, B=64, fp32", model="lstm"),
    Part("speed-lora", "speed", 30, "LoRA on a 1.1B Llama, T=512, bf16-mixed", model="lora"),
    Part("speed-fsdp", "speed", 35, "dp_fsdp vs dp_ddp vs plain FSDP2 (GPT-2-shaped, Adam) on 1 GPU, and on 2 "
         "where lent: step time and memory per rank (bench/fsdp_memory.py)", model="fsdp"),
]  # fmt: skip
"""The parts in the order they run, with their time boxes: 512 s of boxes, inside the 530 s that ``--total``
allows by default (the children's start-up, imports and CUDA context, included), which with the kill's 10 s
of grace keeps the check within 9 minutes."""

TOTAL_S = 530.0
DRY_TOTAL_S = 300.0
"""The dry run takes about 45 s; its boxes are only a net under a loaded CI machine."""
START_BOX_S = 120.0
"""Most a child may spend outside a part: starting up (imports, CUDA initialisation), between parts, exiting."""
POLL_S = 0.2
WRITE_EVERY_S = 5.0
PACKAGES = ("torch", "lightning", "pytorch-lightning", "torchmetrics", "opacus", "transformers", "timm",
            "peft", "numpy", "scipy", "jsonargparse", "dp-accounting", "prv-accountant", "pytest")  # fmt: skip
TESTS = "tests/test_cuda.py"


# ======================================================================================================
# The parent: runs the children, watches the boxes, writes the report
# ======================================================================================================
def parent_env(args: argparse.Namespace) -> dict[str, Any]:
    """What the parent knows without importing torch: versions, the driver's view of the GPU, the commit."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "lightning_dp": re.search(
            r"__version__ = \"(.+?)\"", (ROOT / "lightning_dp" / "core" / "version.py").read_text()
        )[1],
        "cpu_count": os.cpu_count(),
    }
    if shutil.which("nvidia-smi"):
        query = "name,memory.total,driver_version,clocks.max.sm"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        env["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        env["commit"] = out.stdout.strip()
    env["commit"] = env.get("commit") or os.environ.get("LIGHTNING_DP_COMMIT", "unknown")
    return env


class Check:
    """The run's state: every part's status and results, written to results.json and results.md."""

    def __init__(self, args: argparse.Namespace, parts: list[Part]) -> None:
        self.args, self.parts = args, parts
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.started = time.monotonic()
        self.deadline = self.started + args.total
        self.record: dict[str, Any] = {
            "check": {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "dry_run": args.dry_run,
                "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "total_box_s": args.total,
            },
            "env": parent_env(args),
            "parts": {p.name: {"box_s": self.box(p), "what": p.what, "status": "pending"} for p in parts},
        }
        self.last_write = 0.0

    def box(self, part: Part) -> float:
        return self.args.box.get(part.name, part.dry_box_s if self.args.dry_run else part.box_s)

    # -- one group of parts, in as many children as it takes --------------------------------------------
    def run_group(self, parts: list[Part]) -> None:
        pending = list(parts)
        while pending:
            left = self.deadline - time.monotonic()
            if left < 5:
                for p in pending:
                    self.set(
                        p,
                        status="not run",
                        detail=f"the check's total time box ({self.args.total:.0f} s) was spent",
                    )
                return
            pending = self._child(pending)

    def _child(self, parts: list[Part]) -> list[Part]:
        """Run ``parts`` in one child; return those still to run after it exits or is killed."""
        progress = self.work / f"progress-{time.monotonic_ns()}.jsonl"
        boxes = {p.name: min(self.box(p), max(1.0, self.deadline - time.monotonic())) for p in parts}
        command = [
            sys.executable, str(Path(__file__).resolve()), "--child", ",".join(p.name for p in parts),
            "--work", str(self.work), "--progress", str(progress), "--out", str(self.out),
            "--box-json", json.dumps(boxes), "--until", repr(self.deadline),
            *(["--dry-run"] if self.args.dry_run else []),
        ]  # fmt: skip
        environ = dict(os.environ, PYTHONUNBUFFERED="1")
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])
        with (self.out / "children.log").open("a") as log:
            log.write(f"\n===== {dt.datetime.now():%H:%M:%S} child for {', '.join(p.name for p in parts)}\n")
            log.flush()
            child = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        idle_since, started, done = time.monotonic(), 0.0, []
        current: Part | None = None
        seen = 0
        while True:
            code = child.poll()  # before reading: the events a child wrote before it exited are all read
            events, seen = _read_events(progress, seen)
            for event in events:
                idle_since = time.monotonic()
                part = next(p for p in parts if p.name == event["part"])
                if event["event"] == "start":
                    current, started = part, time.monotonic()
                    self.set(part, status="running")
                else:
                    done.append(part.name)
                    current = None
                    self.merge(part, "done", time.monotonic() - started)
            now = time.monotonic()
            if code is not None:  # the part it was in, or else the next it owed, crashed: progress is certain
                victim = current or next((p for p in parts if p.name not in done), None)
                if victim is not None:
                    where = "during it" if current is not None else "before starting it"
                    elapsed = now - started if current is not None else 0.0
                    self.merge(
                        victim,
                        "crashed",
                        elapsed,
                        f"the child exited with status {code} {where} (children.log)",
                    )
                    done.append(victim.name)
                break
            if current is not None and now > self.deadline + self.args.grace:
                _kill(child)
                self.merge(
                    current, "cut", now - started, f"the check's total box ({self.args.total:.0f} s) ran out"
                )
                done.append(current.name)
                break
            if current is not None and now - started > boxes[current.name] + self.args.grace:
                _kill(child)
                self.merge(
                    current, "cut", now - started, f"ran past its {boxes[current.name]:.0f} s box: killed"
                )
                done.append(current.name)
                break
            if (
                current is None and now - idle_since > START_BOX_S
            ):  # stuck starting up, between parts, exiting
                _kill(child)
                waiting = next((p for p in parts if p.name not in done), None)
                if waiting is not None:
                    self.merge(waiting, "cut", 0.0, f"its child did not start it within {START_BOX_S:.0f} s")
                    done.append(waiting.name)
                break
            if current is not None and now - self.last_write > WRITE_EVERY_S:
                self.merge(current, "running", now - started)
            time.sleep(POLL_S)
        return [p for p in parts if p.name not in done]

    # -- results ----------------------------------------------------------------------------------------
    def set(self, part: Part, **fields: Any) -> None:
        self.record["parts"][part.name].update(fields)
        self.write()

    def merge(self, part: Part, status: str, elapsed: float, detail: str = "") -> None:
        """Fold the child's result file of ``part`` into the record (its own verdict for a finished part)."""
        entry = self.record["parts"][part.name]
        path = self.work / f"{part.name}.json"
        if path.exists():
            try:
                result = json.loads(path.read_text())
            except json.JSONDecodeError:  # caught mid-write: keep the previous one
                result = entry.get("result")
            entry["result"] = result
        if status == "done":
            status = _verdict(part, entry.get("result"))
        entry.update(status=status, elapsed_s=round(elapsed, 1))
        if detail:
            entry["detail"] = detail
        self.write(force=status != "running")

    def write(self, force: bool = True) -> None:
        if not force and time.monotonic() - self.last_write < WRITE_EVERY_S:
            return
        self.last_write = time.monotonic()
        self.record["check"]["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.record["check"]["exit_status"] = self.exit_status()
        _atomic_write(self.out / "results.json", json.dumps(self.record, indent=1, default=str))
        _atomic_write(self.out / "results.md", markdown(self.record))

    def exit_status(self) -> int:
        tests = [e for name, e in self.record["parts"].items() if name.startswith("correctness")]
        if any(e["status"] in ("failed", "crashed") for e in tests):
            return 1
        if any(e["status"] not in ("passed",) for e in tests):
            return 2
        return 0


def _verdict(part: Part, result: dict[str, Any] | None) -> str:
    if part.kind == "speed":  # done: every variant that could be built was timed
        rows = (result or {}).get("rows", [])
        if result is not None and result.get("stage") == "not run":
            return "not run"
        timed = result is not None and result.get("stage") == "done"
        return "done" if timed and all(r["rounds"] or r.get("error") for r in rows) else "incomplete"
    if not result or not result.get("tests"):
        return "failed"  # a correctness part that ran no test proves nothing
    outcomes = {t["outcome"] for t in result["tests"]}
    if outcomes & {"failed", "error"}:
        return "failed"
    if "not run" in outcomes:
        return "cut"
    if outcomes - {"passed", "xfailed", "xpassed"}:
        return "incomplete"  # a skipped test (no CUDA?) checked nothing
    return "passed"


def _read_events(path: Path, seen: int) -> tuple[list[dict[str, Any]], int]:
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    complete = [ln for ln in lines[seen:] if ln.endswith("}")]
    return [json.loads(ln) for ln in complete], seen + len(complete)


def _kill(child: subprocess.Popen[Any]) -> None:
    """End the child and everything it started (its own process group); SIGKILL after 5 s."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    except ProcessLookupError:
        pass


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# -- the Markdown report ---------------------------------------------------------------------------------
def markdown(record: dict[str, Any]) -> str:
    check, env = record["check"], record["env"]
    device = next(
        (p["result"]["device"] for p in record["parts"].values() if (p.get("result") or {}).get("device")), {}
    )
    lines = [
        f"# GPU check {'(dry run on the CPU) ' if check['dry_run'] else ''}— {check['started_utc']}",
        "",
        f"`{check['command']}`: {check.get('elapsed_s', 0):.0f} s of {check['total_box_s']:.0f}, "
        f"exit status {check.get('exit_status')}",
        "",
        f"- device: {device.get('name', 'cpu')}, {device.get('memory_gib', '?')} GiB, capability "
        f"{device.get('capability', '-')}, CUDA {device.get('cuda', '-')}, cuDNN {device.get('cudnn', '-')}, "
        f"driver {env.get('nvidia_smi', '-')}",
        f"- torch {device.get('torch', env['versions'].get('torch'))}; "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if k != "torch")
        + f"; lightning-dp {env['lightning_dp']} at {env['commit'][:12]}; Python {env['python']}",
        f"- defaults: TF32 matmul {device.get('tf32_matmul', '-')}, cuDNN TF32 {device.get('tf32_cudnn', '-')}, "
        f"float32 matmul precision {device.get('matmul_precision', '-')}",
        "",
        "| part | box s | took s | status | what |",
        "|---|---|---|---|---|",
    ]
    for name, p in record["parts"].items():
        detail = f" ({p['detail']})" if p.get("detail") else ""
        lines.append(
            f"| {name} | {p['box_s']:.0f} | {p.get('elapsed_s', '-')} | **{p['status']}**{detail} | {p['what']} |"
        )
    tests = [(n, t) for n, p in record["parts"].items() for t in (p.get("result") or {}).get("tests", [])]
    if tests:
        counts: dict[str, int] = {}
        for _, t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        lines += ["", "## Correctness", "", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
        bad = [(n, t) for n, t in tests if t["outcome"] not in ("passed", "skipped")]
        if bad:
            lines += ["| part | test | outcome | s | message |", "|---|---|---|---|---|"]
            for n, t in bad:
                message = (t.get("message") or "").replace("|", "\\|").replace("\n", " ")[:300]
                lines.append(
                    f"| {n} | `{t['id']}` | {t['outcome']} | {t.get('duration_s', '')} | {message} |"
                )
    speed = [p["result"] for p in record["parts"].values() if (p.get("result") or {}).get("rows") is not None]
    if speed:
        lines += [
            "",
            "## Speed and memory (median step, interleaved rounds; peak MB: the most allocated during one step "
            "over what was live before it, plus the model's weights)",
            "",
            "| model | batch | precision | variant | rounds | median ms | IQR ms | × plain | peak MB | mem × plain | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in speed:
            for row in r["rows"]:
                iqr = "–".join(f"{v:.1f}" for v in row["iqr_ms"]) if "iqr_ms" in row else ""
                note = "; ".join(filter(None, [row.get("error"), row.get("note"), row.get("paths")]))
                lines.append(
                    f"| {r.get('model')} | {r.get('batch', '')} | {r.get('precision', '')} | {row['variant']} | {row['rounds']} | "
                    f"{_fmt(row.get('median_ms'))} | {iqr} | {_fmt(row.get('x_plain'), 2)} | "
                    f"{_fmt(row.get('peak_mb'), 1)} | {_fmt(row.get('mem_x_plain'), 2)} | {note.replace('|', '/')[:200]} |"
                )
    return "\n".join(lines) + "\n"


def _fmt(value: Any, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


# ======================================================================================================
# The child: runs its parts in order, reporting each start and end
# ======================================================================================================
class Child:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work)
        self.progress = Path(args.progress)
        self.boxes: dict[str, float] = json.loads(args.box_json)
        self.until = args.until if args.until is not None else math.inf  # the check's end (CLOCK_MONOTONIC)

    def deadline(self, part: str) -> float:
        """When ``part``, starting now, must end: its box, or the whole check's end if that comes first."""
        return min(time.monotonic() + self.boxes[part], self.until)

    def event(self, part: str, event: str, **fields: Any) -> None:
        with self.progress.open("a") as f:
            f.write(json.dumps({"part": part, "event": event, **fields}) + "\n")

    def save(self, part: str, result: dict[str, Any]) -> None:
        _atomic_write(self.work / f"{part}.json", json.dumps(result, indent=1, default=str))

    def run(self, names: list[str]) -> int:
        try:
            return self._run(names)
        finally:
            _atomic_write(self.work / f"imports-{os.getpid()}.json", json.dumps(imported_distributions()))

    def _run(self, names: list[str]) -> int:
        import torch

        device = torch.device("cpu" if self.args.dry_run or not torch.cuda.is_available() else "cuda")
        info = device_info(device)
        tests = [p for p in PARTS if p.name in names and p.kind == "tests"]
        if tests:  # one pytest session for all of them, in order: the plugin reports each part
            return run_tests(self, tests, info)
        for name in names:
            part = next(p for p in PARTS if p.name == name)
            self.event(name, "start")
            if time.monotonic() > self.until:
                self.save(name, {"model": part.model, "stage": "not run", "device": info, "rows": []})
            elif device.type == "cpu" and not self.args.dry_run:  # full sizes on a CPU: nothing worth timing
                self.save(name, {"model": part.model, "stage": "not run", "device": info, "rows": [
                    {"variant": "all", "rounds": 0, "error": "no CUDA device (use --dry-run on a CPU)"}]})  # fmt: skip
            else:
                run_speed(self, part, device, self.deadline(name), info)
            self.event(name, "end")
        return 0


def imported_distributions() -> dict[str, list[str]]:
    """The distributions whose modules this process imported (the standard library and the repository's
    own modules aside): what the GPU machine must have, in its image or as wheels."""
    owners = metadata.packages_distributions()
    local = {
        p.stem if p.is_file() else p.name
        for p in [*ROOT.iterdir(), *BENCH.iterdir(), *(ROOT / "tests").iterdir()]
    }
    found: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if not top or top.startswith("_") or top in sys.stdlib_module_names or top in local:
            continue
        if getattr(module, "__file__", None) is None and top not in owners:  # built-in (cython_runtime)
            continue
        for dist in owners.get(top, ["?" + top]):
            found.setdefault(dist, set()).add(top)
    return {dist: sorted(mods) for dist, mods in sorted(found.items())}


def device_info(device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
        )
    return info


def run_sharded(child: Child, part: Part, device: Any, deadline: float, info: dict[str, Any]) -> None:
    """``dp_fsdp`` against ``dp_ddp`` and plain FSDP2: each configuration on 1 device in this child, then on 2
    devices in their own processes where 2 GPUs are lent; the dry run fits ``dp_fsdp`` alone at a tiny size."""
    import fsdp_memory
    import torch

    cuda = device.type == "cuda"
    args = fsdp_memory.parser().parse_args(
        ["--accelerator", "cuda" if cuda else "cpu", "--steps", "2" if child.args.dry_run else "8"]
        + ([] if cuda else ["--size", json.dumps({"vocab": 64, "width": 32, "layers": 2, "length": 16}), "--batch", "4"])
    )  # fmt: skip
    configs = fsdp_memory.CONFIGS if cuda else ("dp-fsdp",)
    results = []
    for config in configs:
        if time.monotonic() < deadline:
            results.append(fsdp_memory.in_process(args, config))
    if cuda and torch.cuda.device_count() >= 2:
        args.world_sizes = [2]
        results += fsdp_memory.sharded(args, deadline, configs)
    rows = []
    for r in results:
        plain = next(
            (p for p in results if p["config"] == "plain-fsdp" and p["devices"] == r["devices"]), None
        )
        worst = {
            key: max(rank.get(key, 0) for rank in r["ranks"])
            for key in ("step_s", "held", "gathered", "sums", "peak")
        }
        base = {key: max(rank[key] for rank in plain["ranks"]) for key in ("step_s", "peak")} if plain else {}
        memory = worst["peak"] if cuda else worst["held"]
        rows.append({
            "variant": f"{r['config']} W={r['devices']}", "rounds": args.steps,
            "median_ms": worst["step_s"] * 1e3, "peak_mb": memory / 2**20,
            "x_plain": worst["step_s"] / base["step_s"] if base else None,
            "mem_x_plain": worst["peak"] / base["peak"] if base and base["peak"] else None,
            "note": f"per rank: {worst['held'] / 2**20:.1f} MB params+grads+optimizer state between steps, "
                    f"{worst['gathered'] / 2**20:.1f} MB full-size parameters alive at once in a step, "
                    f"{worst['sums'] / 2**20:.1f} MB full-size clipped sum held at once",
        })  # fmt: skip
    child.save(part.name, {"model": "fsdp", "title": part.what, "batch": args.batch, "precision": "fp32",
                           "stage": "done", "rows": rows, "device": info})  # fmt: skip


def run_speed(child: Child, part: Part, device: Any, deadline: float, info: dict[str, Any]) -> None:
    from gpu_speed import MODELS, bench

    def report(result: dict[str, Any]) -> None:
        child.save(part.name, {**result, "device": info})

    if part.model == "fsdp":
        try:
            run_sharded(child, part, device, deadline, info)
        except Exception as err:  # reported in the part, like a model that failed to build
            report({"model": "fsdp", "title": part.what, "batch": None, "precision": "", "stage": "failed",
                    "rows": [{"variant": "all", "rounds": 0, "error": f"{type(err).__name__}: {err}"}]})  # fmt: skip
        return

    try:
        bench(MODELS[part.model], device, child.args.dry_run, deadline, report,
              rounds=3 if child.args.dry_run else 20, warmup=1 if child.args.dry_run else 2)  # fmt: skip
    except Exception as err:  # the model itself failed to build: report it in the part
        report({"model": part.model, "title": MODELS[part.model].title, "batch": None, "precision": "",
                "stage": "failed", "rows": [{"variant": "all", "rounds": 0, "error": f"{type(err).__name__}: {err}"}]})  # fmt: skip


class CheckPlugin:
    """pytest plugin of a correctness child: keeps the cuda-marked tests of the wanted parts (on the wanted
    device), orders them by part, reports each part's start and end, records every outcome as it comes, and
    skips the tests that would start past their part's time box."""

    def __init__(self, child: Child, parts: list[Part], info: dict[str, Any]) -> None:
        self.child, self.info = child, info
        self.parts = {p.test_part: p for p in parts}
        self.order = [p.test_part for p in parts]
        self.device = "cpu" if child.args.dry_run else "cuda"
        self.results: dict[str, list[dict[str, Any]]] = {p.name: [] for p in parts}
        self.current: Part | None = None
        self.deadline = 0.0

    @staticmethod
    def _part_of(item: Any) -> str | None:
        marker = item.get_closest_marker("cuda")
        return marker.args[0] if marker is not None and marker.args else None

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        keep, seen = [], set()
        for item in items:
            part = self._part_of(item)
            params = getattr(item, "callspec", None)
            device = params.params.get("device") if params is not None else None
            if part not in self.parts or device != self.device:
                continue
            if self.child.args.dry_run:  # the dry run: each test function's first cpu case
                if item.originalname in seen:
                    continue
                seen.add(item.originalname)
            keep.append(item)
        keep.sort(key=lambda item: self.order.index(self._part_of(item)))  # stable: the file's order within
        deselected = [i for i in items if i not in keep]
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep
        for item in keep:
            self.results[self.parts[self._part_of(item)].name].append(
                {"id": item.nodeid.split("::", 1)[1], "outcome": "not run"}
            )
        for part in self.parts.values():
            if not self.results[part.name]:
                self.child.event(part.name, "start")
                self._save(part)
                self.child.event(part.name, "end")

    def _switch(self, part: Part | None) -> None:
        if self.current is not None and self.current is not part:
            self._save(self.current)
            self.child.event(self.current.name, "end")
        if part is not None and self.current is not part:
            self.child.event(part.name, "start")
            self.deadline = self.child.deadline(part.name)
        self.current = part

    def _save(self, part: Part) -> None:
        self.child.save(part.name, {"tests": self.results[part.name], "device": self.info})

    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> None:
        self._switch(self.parts[self._part_of(item)])  # type: ignore[index]

    def pytest_runtest_setup(self, item: Any) -> None:
        import pytest

        if time.monotonic() > self.deadline:
            pytest.skip("not run: its part's time box was spent")

    def pytest_runtest_logreport(self, report: Any) -> None:
        part = self.current
        if part is None:
            return
        entry = next((t for t in self.results[part.name] if report.nodeid.endswith(t["id"])), None)
        if entry is None:
            return
        if report.when == "setup" and report.skipped and "time box" in str(report.longrepr):
            entry.update(outcome="not run")
        elif report.when == "setup" and report.skipped:
            entry.update(
                outcome="skipped",
                message=str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "",
            )
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
            entry.update(outcome=outcome, message=_short(report))
        elif report.when == "call":
            xfail = hasattr(report, "wasxfail")
            outcome = ("xfailed" if report.skipped else "xpassed") if xfail else "passed"
            entry.update(outcome=outcome, **({"message": report.wasxfail} if xfail else {}))
        if report.when in ("call", "teardown") or report.skipped:
            entry["duration_s"] = round(entry.get("duration_s", 0) + report.duration, 2)
            self._save(part)

    def pytest_sessionfinish(self, session: Any) -> None:
        self._switch(None)


def _short(report: Any) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-3:]
    return " ".join(ln[1:].strip() if ln.startswith("E ") else ln.strip() for ln in lines)[:600]


def run_tests(child: Child, parts: list[Part], info: dict[str, Any]) -> int:
    import pytest

    # before the skipping plugin's setup (a skipif would stop the time box's check) and before any report
    for hook in ("pytest_runtest_protocol", "pytest_runtest_setup"):
        setattr(CheckPlugin, hook, pytest.hookimpl(tryfirst=True)(getattr(CheckPlugin, hook)))

    args = [str(ROOT / TESTS), "-p", "no:cacheprovider", "-q", "-rN", "--color=no", "-o", "addopts=",
            "-W", "ignore::DeprecationWarning", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]  # fmt: skip
    code = pytest.main(args, plugins=[CheckPlugin(child, parts, info)])
    return (
        0 if code in (0, 1) else int(code)
    )  # failures are in the results; only a broken session is an error


# ======================================================================================================
def _boxes(values: list[str]) -> dict[str, float]:
    out = {}
    for value in values:
        name, _, seconds = value.partition("=")
        if name not in {p.name for p in PARTS} or not seconds:
            raise SystemExit(
                f"--box takes PART=SECONDS with a part of {[p.name for p in PARTS]}, got {value!r}"
            )
        out[name] = float(seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for results.json, results.md and children.log")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same code on the CPU at tiny sizes (≤ 60 s)"
    )
    parser.add_argument("--parts", default=None, help="comma-separated part names (default: all, in order)")
    parser.add_argument(
        "--box", action="append", default=[], metavar="PART=S", help="override a part's time box"
    )
    parser.add_argument(
        "--total", type=float, default=None, help=f"the whole check's box (default {TOTAL_S:.0f} s)"
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds past a box before the kill")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--box-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return Child(args).run(args.child.split(","))
    args.box = _boxes(args.box)
    args.total = args.total if args.total is not None else (DRY_TOTAL_S if args.dry_run else TOTAL_S)
    names = args.parts.split(",") if args.parts else [p.name for p in PARTS]
    unknown = set(names) - {p.name for p in PARTS}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; the parts are {[p.name for p in PARTS]}")
    parts = [p for p in PARTS if p.name in names]
    check = Check(args, parts)
    check.write()
    groups: list[list[Part]] = [
        [p for p in parts if p.kind == "tests"],
        [p for p in parts if p.kind == "speed"],
    ]
    for group in filter(None, groups):
        check.run_group(group)
    imports: dict[str, list[str]] = {}
    for path in check.work.glob("imports-*.json"):
        for dist, mods in json.loads(path.read_text()).items():
            imports[dist] = sorted(set(imports.get(dist, [])) | set(mods))
    check.record["check"]["imported_distributions"] = dict(sorted(imports.items()))
    check.write()
    text = (check.out / "results.md").read_text()
    print(text)
    # the part table once more, last: a reader of the output's tail (the device tool returns 12,000 chars) sees it
    table = [
        ln
        for ln in text.splitlines()
        if ln.startswith(("| part |", "| correctness", "| speed")) or ln == "|---|---|---|---|---|"
    ]
    print(
        "\n".join([f"exit status {check.exit_status()}; {check.out}/results.md has the tables above", *table])
    )
    shutil.rmtree(check.work, ignore_errors=True)
    return check.exit_status()


if __name__ == "__main__":
    sys.exit(main())
