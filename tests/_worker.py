"""The one preamble of the multi-process test workers (``tests/*_worker.py``) and the helpers that launch them.

A worker script begins with ``from _worker import start, finish_distributed`` (its folder is on the path
when it runs as a script) and ``OUT, ARGS = start()``; it ends with ``finish_distributed()``. Tests launch
a worker with :func:`run_worker` (run to success) or :func:`launch` (a process to watch or kill).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, in every rank
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
if str(ROOT) not in sys.path:  # a worker runs as a script: the repository is not on its path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def start() -> tuple[Path, list[str]]:
    """A worker's first call: one thread, no warnings on stderr; returns (OUT, the other arguments)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return Path(sys.argv[1]), sys.argv[2:]


def finish_distributed() -> None:
    """End of a DDP worker script: destroy the process group while the interpreter is alive.

    Otherwise Gloo's worker threads can abort the exit with SIGABRT ("terminate called without an
    active exception") after the run itself succeeded (pytorch/pytorch#190489).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def ddp_trainer(out: Path, strategy: Any, **kwargs: Any) -> Any:
    """A 2-process CPU Trainer for a DDP worker: no logger, checkpoints, progress bar or sanity steps."""
    from lightning.pytorch import Trainer

    options: dict[str, Any] = dict(
        accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(out),
    )  # fmt: skip
    options.update(kwargs)
    return Trainer(strategy=strategy, **options)


def dump(out: Path, name: str, strategy: Any, **extra: Any) -> None:
    """Write ``out/<name>.rank<r>.json``: the rank, its private steps and ε, plus ``extra``."""
    record = {
        "rank": strategy.global_rank,
        "steps": strategy.engine.steps,
        "epsilon": strategy.epsilon,
        **extra,
    }
    (out / f"{name}.rank{strategy.global_rank}.json").write_text(json.dumps(record))


DISTRIBUTED_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
)
"""What an in-process fit leaves in ``os.environ`` (Lightning sets MASTER_PORT when it picks one, and its
store may still hold that port): a worker inherits none of it, so it picks its own port."""


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker: one thread, the repository on the path, no inherited rendezvous
    (:data:`DISTRIBUTED_VARIABLES`), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def launch(script: str, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``tests/<script> OUT ARGS...`` in a fresh interpreter, stderr merged into its stdout pipe."""
    return subprocess.Popen(
        [sys.executable, str(TESTS / script), str(out), *args],
        env=worker_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_worker(script: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests/<script> OUT ARGS...`` in a fresh interpreter (in OUT) and require it to succeed;
    multi-process workers launch their other ranks themselves."""
    run = subprocess.run(
        [sys.executable, str(TESTS / script), str(out), *args],
        cwd=out,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    return run


def launch_ranks(
    script: str, out: Path, *args: str, world_size: int = 2, timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    """Every rank of ``tests/<script>`` at once (Lightning sees LOCAL_RANK and does not spawn), so their
    imports overlap; a rank still running after ``timeout`` seconds (left waiting for a dead peer) is killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        rank_env = worker_env(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), NODE_RANK="0",
            LOCAL_RANK=str(rank), GLOBAL_RANK=str(rank),
        )  # fmt: skip
        procs.append(launch(script, out, *args, env=rank_env))
    done = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, text))
    return done
