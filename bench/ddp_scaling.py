"""Throughput of 1 vs N processes: plain Lightning (single device vs DDP) and lightning-dp (DPStrategy vs
DPDDPStrategy), same model, same *logical* batch, in-memory MNIST-shaped data.

Configurations, each fitted in its own subprocess (``python bench/ddp_scaling.py --worker CONFIG ...``):

* ``plain-single``  ``SingleDeviceStrategy``, DataLoader ``batch_size = B``
* ``plain-ddp``     ``DDPStrategy`` on N processes; Lightning's batch_size is per device, so ``B / N``
                    per device (a ``DistributedSampler`` splits the data) keeps the logical batch at B
* ``dp-single``     ``DPStrategy(noise_multiplier=1.0)``, ``batch_size = B`` (Poisson, expected size B)
* ``dp-ddp``        ``DPDDPStrategy(noise_multiplier=1.0)`` on N processes; its ``batch_size`` already means
                    the logical batch, so ``B`` (each rank draws about ``B / N`` a step)

A callback times every step from ``on_train_batch_start`` to ``on_train_batch_end`` (synchronising CUDA on
GPUs) and counts the examples of each rank's batch; after ``--warmup`` steps, examples/s is all ranks'
examples divided by rank 0's wall time from the first timed step's start to the last step's end (so the
fetch and collate of each next batch is included). Rank 0 writes the result to a JSON file; the driver runs
every configuration ``--repeats`` times (alternating the order) and prints one table per model: medians,
the range over the fits, and how many cores other processes kept busy meanwhile (from ``/proc/stat``).

Run from the repository root::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/ddp_scaling.py [--json results.json]
"""

from __future__ import annotations

import os
import sys

# One intra-op thread per process, set before torch is imported (Lightning's launcher passes the
# environment on to the other ranks).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import json
import logging
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _harness import cpu_name, trainer_kwargs
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp
from lightning_dp import DPDDPStrategy, DPStrategy, PrivacyCallback
from recipes.models import mlp, tramer_boneh_cnn

SIGMA = 1.0
MAX_GRAD_NORM = 1.0
LR = 0.05
INPUT_SHAPE = (1, 28, 28)  # MNIST-shaped random tensors; the MLP flattens them
WORKER_TIMEOUT_S = 900
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _busy_cpu_s() -> float | None:
    """CPU-seconds every core of the machine has spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ModelSpec:
    key: str
    title: str
    build: Callable[[], nn.Module]


MODELS = {
    "cnn": ModelSpec("cnn", "Tramèr & Boneh MNIST CNN", tramer_boneh_cnn),
    "mlp": ModelSpec("mlp", "MLP 784-1000-10", lambda: mlp(784, [1000], 10)),
}


@dataclass(frozen=True)
class Config:
    key: str
    family: str  # "plain" or "lightning-dp"
    strategy: str
    distributed: bool


CONFIGS = {
    c.key: c
    for c in (
        Config("plain-single", "plain", "SingleDeviceStrategy", False),
        Config("plain-ddp", "plain", "DDPStrategy", True),
        Config("dp-single", "lightning-dp", "DPStrategy", False),
        Config("dp-ddp", "lightning-dp", "DPDDPStrategy", True),
    )
}


# -- worker: one fit in this process (and, for the distributed configurations, its sibling ranks) ----------
class _Classifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _batch_len(batch: Any) -> int:
    """Examples in this rank's batch; 0 for lightning-dp's EmptyBatch (an empty Poisson draw)."""
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], Tensor):
        return len(batch[-1])
    return 0


class StepTimer(L.Callback):
    """Per-step times (on_train_batch_start → on_train_batch_end) and examples; rank 0 writes the JSON."""

    def __init__(self, out: Path, warmup: int, meta: dict[str, Any]) -> None:
        self.out, self.warmup, self.meta = out, warmup, meta
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.sizes: list[int] = []
        self.cpu_start = self.cpu_end = 0.0  # this process's CPU time (all its threads) over the window
        self.busy_start: float | None = None  # the whole machine's busy CPU time over the window
        self.busy_end: float | None = None

    @staticmethod
    def _sync(pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        if len(self.starts) == self.warmup:
            self.busy_start, self.cpu_start = _busy_cpu_s(), time.process_time()
        self.starts.append(time.perf_counter())
        self.sizes.append(_batch_len(batch))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        self.ends.append(time.perf_counter())
        self.busy_end, self.cpu_end = _busy_cpu_s(), time.process_time()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        skip = min(self.warmup, len(self.starts) - 1)
        # Every rank's examples per step, summed over ranks: the logical batch actually processed.
        local = torch.tensor(self.sizes, dtype=torch.float64, device=pl_module.device)
        gathered = trainer.strategy.all_gather(local)
        per_step = gathered.reshape(-1, len(self.sizes)).sum(0).cpu().tolist()
        ours = trainer.strategy.all_gather(
            torch.tensor(self.cpu_end - self.cpu_start, dtype=torch.float64, device=pl_module.device)
        )
        if trainer.global_rank != 0:
            return
        steps = [e - s for s, e in zip(self.starts, self.ends)]
        window = self.ends[-1] - self.starts[skip]
        # Cores kept busy by anything but this run's ranks (other jobs, the OS) during the window.
        others = None
        if self.busy_start is not None and self.busy_end is not None and skip == self.warmup:
            others = max(0.0, (self.busy_end - self.busy_start) - float(ours.sum())) / window
        examples = sum(per_step[skip:])
        record = {
            **self.meta,
            "world_size": trainer.world_size,
            "threads": torch.get_num_threads(),
            "steps": len(steps),
            "timed_steps": len(steps) - skip,
            "step_s": steps,
            "rank0_batch_sizes": self.sizes,
            "logical_batch_sizes": per_step,
            "median_step_ms": statistics.median(steps[skip:]) * 1e3,
            "window_s": window,
            "examples": examples,
            "examples_per_s": examples / window,
            "mean_logical_batch": examples / (len(steps) - skip),
            "rank_cpu_s": ours.reshape(-1).cpu().tolist(),
            "others_cores": others,
        }
        self.out.write_text(json.dumps(record, indent=1))


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_dp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def run_worker(args: argparse.Namespace) -> int:
    _quiet()
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    cfg, spec = CONFIGS[args.worker], MODELS[args.model]
    procs = args.devices if cfg.distributed else 1
    B = args.batch_size
    n = B * (args.steps + 1)  # one epoch holds every step: no epoch boundary inside the timed window
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn((n, *INPUT_SHAPE), generator=g), torch.randint(0, 10, (n,), generator=g))
    gpu = args.accelerator == "gpu"
    callbacks: list[L.Callback] = []
    if cfg.key == "plain-single":
        strategy: Any = SingleDeviceStrategy(device=torch.device("cuda", 0) if gpu else torch.device("cpu"))
        loader_batch = B
    elif cfg.key == "plain-ddp":
        strategy = DDPStrategy(process_group_backend="nccl" if gpu else "gloo")
        loader_batch = B // procs  # Lightning's per-device batch: B / N per device = B logical
    elif cfg.key == "dp-single":
        strategy = DPStrategy(noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM, seed=0)
        loader_batch = B
    else:
        strategy = DPDDPStrategy(noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM, seed=0)
        loader_batch = B  # DPDDPStrategy's batch_size is the logical batch over all ranks
    if cfg.family == "lightning-dp":
        callbacks.append(PrivacyCallback(report=False))  # the default ε logging, without the report file
    meta = {
        "config": cfg.key,
        "strategy": cfg.strategy,
        "family": cfg.family,
        "model": spec.key,
        "accelerator": args.accelerator,
        "processes": procs,
        "logical_batch": B,
        "loader_batch_size": loader_batch,
        "warmup": args.warmup,
    }
    timer = StepTimer(Path(args.out), args.warmup, meta)
    torch.manual_seed(0)
    module = _Classifier(spec.build())
    loader = DataLoader(data, batch_size=loader_batch, shuffle=True, drop_last=True)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            **trainer_kwargs(
                accelerator=args.accelerator,
                devices=procs,
                strategy=strategy,
                max_steps=args.steps,
                max_epochs=1,
                callbacks=[*callbacks, timer],  # the privacy callback first: its ε logging is inside the step
                default_root_dir=root,
            )
        )
        trainer.fit(module, train_dataloaders=loader)
    return 0


# -- driver ---------------------------------------------------------------------------------------------------
def run_config(
    cfg: Config, spec: ModelSpec, args: argparse.Namespace, workdir: Path, repeat: int
) -> dict[str, Any]:
    out = workdir / f"{cfg.key}.{spec.key}.{repeat}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        cfg.key,
        "--model",
        spec.key,
        "--out",
        str(out),
        "--accelerator",
        args.accelerator,
        "--devices",
        str(args.devices),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {WORKER_TIMEOUT_S} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        return {"error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"}
    record = json.loads(out.read_text())
    record["subprocess_s"] = wall
    return record


def _label(cfg: Config, args: argparse.Namespace) -> str:
    n = args.devices
    if cfg.key == "plain-ddp":
        return f"plain DDPStrategy ({args.batch_size // n}/device)"
    if cfg.key == "dp-ddp":
        return f"dp DPDDPStrategy (~{args.batch_size / n:g}/rank)"
    return f"{'plain' if cfg.family == 'plain' else 'dp'} {cfg.strategy}"


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the repeats: median examples/s, median of every timed step, worst ``others``."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    steps = [s for r in runs for s in r["step_s"][r["steps"] - r["timed_steps"] :]]
    others = [r["others_cores"] for r in runs if r.get("others_cores") is not None]
    rates = [r["examples_per_s"] for r in runs]
    return {
        "logical_batch": runs[0]["logical_batch"],
        "mean_logical_batch": sum(r["examples"] for r in runs) / sum(r["timed_steps"] for r in runs),
        "median_step_ms": statistics.median(steps) * 1e3,
        "examples_per_s": statistics.median(rates),
        "examples_per_s_runs": rates,
        "others_cores": max(others) if others else None,
    }


def print_table(spec: ModelSpec, rows: list[tuple[Config, dict[str, Any]]], args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in spec.build().parameters())
    print(f"\n{spec.title} ({params:,} parameters), {args.accelerator}, logical batch {args.batch_size}")
    header = (
        f"{'configuration':<34}{'procs':>6}{'logical batch':>16}{'median step ms':>16}"
        f"{'examples/s':>12}{'runs':>14}{'speed-up':>10}{'others':>8}"
    )
    print(header)
    print("-" * len(header))
    single: dict[str, float] = {}
    for cfg, r in rows:
        label = _label(cfg, args)
        procs = args.devices if cfg.distributed else 1
        if "error" in r:
            print(f"{label:<34}{procs:>6}  n/a ({r['error']})")
            continue
        rate = r["examples_per_s"]
        if not cfg.distributed:
            single[cfg.family] = rate
        speedup = f"{rate / single[cfg.family]:.2f}×" if cfg.family in single else "n/a"
        batch = (
            f"{r['logical_batch']}"
            if cfg.family == "plain"
            else f"~{r['logical_batch']} ({r['mean_logical_batch']:.0f})"
        )
        others = "n/a" if r.get("others_cores") is None else f"{r['others_cores']:.2f}"
        runs = r["examples_per_s_runs"]
        spread = f"{min(runs):.0f}-{max(runs):.0f}" if len(runs) > 1 else ""
        print(
            f"{label:<34}{procs:>6}{batch:>16}{r['median_step_ms']:>16.1f}{rate:>12.0f}{spread:>14}"
            f"{speedup:>10}{others:>8}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--devices", type=int, default=2, help="processes for the DDP configurations (1 vs this)")
    p.add_argument("--steps", type=int, default=100, help="training steps per fit")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the timings")
    p.add_argument("--batch-size", type=int, default=256, help="logical batch over all processes")
    p.add_argument(
        "--repeats", type=int, default=2, help="fits per configuration (alternating order); medians"
    )
    p.add_argument("--models", default="cnn,mlp", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--json", metavar="PATH", help="also write every configuration's record as JSON")
    p.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--model", choices=sorted(MODELS), default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        if not args.out:
            p.error("--worker needs --out")
        return args
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; choose from {list(CONFIGS)}")
    if args.devices < 2:
        p.error("--devices must be at least 2 (the configurations compare 1 process with --devices)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.steps <= args.warmup or args.warmup < 0:
        p.error("--steps must exceed --warmup ≥ 0")
    if args.batch_size < args.devices or args.batch_size % args.devices:
        p.error(
            f"--batch-size {args.batch_size} must be a multiple of --devices {args.devices} "
            "(plain DDP gets batch_size / devices per device)"
        )
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        p.error("--accelerator gpu: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpus = torch.cuda.device_count() if args.accelerator == "gpu" else 0
    print(
        f"ddp_scaling: torch {torch.__version__}, lightning {L.__version__}, lightning-dp "
        f"{lightning_dp.__version__}; {args.accelerator}"
        + (f" ({gpus} × {torch.cuda.get_device_name(0)})" if gpus else "")
        + f", CPU {cpu_name()}, {cores} cores available, 1 torch thread per process"
    )
    print(
        f"{args.repeats} fit(s) per configuration, alternating order; {args.steps} steps per fit, the "
        f"first {args.warmup} untimed; random MNIST-shaped data in memory; "
        f"SGD lr={LR}; dp: σ={SIGMA}, C={MAX_GRAD_NORM}, Poisson, ε logged every step"
    )
    if args.accelerator == "cpu" and args.devices >= cores:
        print(
            f"note: {args.devices} processes on a {cores}-core machine share the cores with each other, "
            "the driver and everything else on the box (gloo's threads, the OS), so the speed-up is "
            f"bounded well below {args.devices}×."
        )
    if hasattr(os, "getloadavg"):
        print(f"load average before the run: {os.getloadavg()[0]:.2f} (1 min)")
    results: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddp_scaling.") as tmp:
        for key in args.models:
            spec = MODELS[key]
            runs: dict[str, list[dict[str, Any]]] = {ckey: [] for ckey in args.configs}
            t0 = time.perf_counter()
            for repeat in range(args.repeats):
                # Alternate the order so a drift of the machine does not favour one configuration.
                for ckey in args.configs if repeat % 2 == 0 else args.configs[::-1]:
                    cfg = CONFIGS[ckey]
                    if cfg.distributed and args.accelerator == "gpu" and gpus < args.devices:
                        record: dict[str, Any] = {"error": f"needs {args.devices} GPUs, {gpus} available"}
                    else:
                        record = run_config(cfg, spec, args, Path(tmp), repeat)
                    runs[ckey].append(record)
                    results.append({"config": ckey, "model": key, "repeat": repeat, **record})
            rows = [(CONFIGS[ckey], combine(runs[ckey])) for ckey in args.configs]
            print_table(spec, rows, args)
            count = len(args.configs) * args.repeats
            print(f"  ({time.perf_counter() - t0:.0f} s for {count} fits, each in its own subprocess)")
    print(
        "\n  median step ms: rank 0, on_train_batch_start → on_train_batch_end (forward, backward, for dp the\n"
        "  clipping, noise and ε readout, the all-reduce, the optimizer step), median of every fit's timed\n"
        "  steps. examples/s: every rank's examples after warm-up / rank 0's wall time from the first timed\n"
        "  step's start to the last step's end (includes fetching the next batch); median over the fits,\n"
        "  runs = lowest-highest fit. dp's logical batch is Poisson: configured (observed mean). speed-up:\n"
        "  median examples/s over the same family's 1-process one. others: cores kept busy by other\n"
        "  processes during the timed window (/proc/stat busy time minus the ranks' own CPU time; highest\n"
        "  fit); well above 0 means the run shared the machine and its numbers, above all the speed-ups,\n"
        "  are low."
    )
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results},
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
