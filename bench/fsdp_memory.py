"""Step time and memory per rank of ``dp_fsdp`` against ``dp_ddp`` and plain ``ModelParallelStrategy`` (FSDP2).

One GPT-2-shaped model (built from a transformers config), one logical batch, Adam, W = 1 and 2 processes
(gloo on CPU, NCCL on GPUs). Configurations, each fitted in its own processes
(``python bench/fsdp_memory.py --worker CONFIG --devices W ...``):

* ``plain-fsdp``  Lightning's ``ModelParallelStrategy``, ``fully_shard`` per block, no privacy; batch B / W
                  per device (its batch_size is per device)
* ``dp-ddp``      ``DPDDPStrategy(noise_multiplier=1.0)``: the model replicated on every rank
* ``dp-fsdp``     ``DPFSDPStrategy(noise_multiplier=1.0)``: the same sharding as ``plain-fsdp``

Per rank, after ``--warmup`` steps: the median step time (``on_train_batch_start`` to ``on_train_batch_end``,
CUDA synchronised) and what the rank holds: its parameters, gradients and optimizer state between steps
(the bytes of the tensors themselves: local shards under FSDP2); during the steps (every one, the first with
its run-time checks included), the most full-size parameter bytes alive at once (FSDP2's unsharded storage,
read before every layer's forward and at every layer's output gradient in backward; ``dp-ddp``: the whole
replicated model) and, for ``dp-fsdp``, the most full-size clipped-sum bytes held at once (one FSDP unit's,
at its reduce-scatter); and on CUDA the peak of ``torch.cuda.max_memory_allocated`` over the timed steps
(activations included). The table gives each number as a ratio to ``dp-ddp`` at the same W. Run from the repository root, under ``nice``
on a shared machine::

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 10 .venv/bin/python bench/fsdp_memory.py [--accelerator cuda]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

CONFIGS = ("plain-fsdp", "dp-ddp", "dp-fsdp")


def build_module(config: str, batch: int, steps: int, size: dict[str, int]) -> Any:
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    import lightning_dp

    class GPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = GPT2Config(vocab_size=size["vocab"], n_embd=size["width"], n_layer=size["layers"], n_head=4,
                             n_positions=size["length"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
            self.net = GPT2LMHeadModel(cfg)
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, size["vocab"], (batch * (steps + 2), size["length"]), generator=g)

        def configure_model(self) -> None:
            if config == "dp-ddp":
                return
            from torch.distributed.fsdp import fully_shard

            for block in self.net.transformer.h:
                fully_shard(block)
            fully_shard(self.net)

        def training_step(self, b, i):
            logits = self.net(input_ids=b[0]).logits
            return lightning_dp.per_example_token_loss(logits, b[0], shift=True).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            per_device = batch // self.trainer.world_size if config == "plain-fsdp" else batch
            return DataLoader(TensorDataset(self.ids), batch_size=per_device, shuffle=True)

    return GPT()


def _bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Fit one configuration on ``args.devices`` processes (this one and, on several devices, the ones
    Lightning launches); rank 0 writes ``args.out`` (if given) and every rank returns the result."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_dp import Checks, DPDDPStrategy, DPFSDPStrategy

    warnings.filterwarnings("ignore")
    size = json.loads(args.size)
    cuda = args.accelerator == "cuda"

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.held: int = 0
            self.gathered: int = 0
            self.sums: int = 0
            self.peak = 0
            self.active = False

        def on_train_start(self, trainer, module):
            from torch.distributed.fsdp import FSDPModule

            found = [m for m in module.modules() if isinstance(m, FSDPModule)]
            params = [
                fp for m in found for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params
            ]
            if not found:  # replicated: the whole model is full-size throughout
                self.gathered = _bytes(module.parameters())
                return

            def read(*_: Any) -> None:
                if self.active:
                    alive = sum(fp._unsharded_param.untyped_storage().nbytes() for fp in params
                                if hasattr(fp, "_unsharded_param"))  # fmt: skip
                    self.gathered = max(self.gathered, alive)

            def output(layer: Any, inputs: Any, out: Any) -> None:
                read()
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda grad: read())

            for layer in module.modules():
                layer.register_forward_pre_hook(read)
                layer.register_forward_hook(output)
            shards = getattr(trainer.strategy, "shards", None)
            if shards is not None:  # dp_fsdp's clipped sum, one unit at a time
                take = shards.take

                def counted(ps: Any, sums: list[Any]) -> Any:
                    self.sums = max(self.sums, sum(x.numel() * x.element_size() for x in sums))
                    return take(ps, sums)

                shards.take = counted

        def on_train_batch_start(self, trainer, module, batch, idx):
            if cuda:
                torch.cuda.synchronize()
                if idx == args.warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.active = True
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, idx):
            if cuda:
                torch.cuda.synchronize()
            self.active = False
            if idx >= args.warmup:
                self.times.append(time.perf_counter() - self.start)
            optimizer = trainer.optimizers[0]
            optimizer = getattr(optimizer, "original_optimizer", optimizer)
            state = [
                t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
            ]
            params = list(module.parameters())
            grads = [p.grad for p in params if p.grad is not None]
            self.held = max(self.held, _bytes(params) + _bytes(grads) + _bytes(state))
            if cuda:
                self.peak = torch.cuda.max_memory_allocated()

    if args.worker == "plain-fsdp":
        strategy: Any = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.worker == "dp-ddp":
        strategy = DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, checks=Checks(sensitivity=False))
    else:
        strategy = DPFSDPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, checks=Checks(sensitivity=False))
    measure = Measure()
    trainer = Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, max_steps=args.warmup + args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[measure], num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(build_module(args.worker, args.batch, args.warmup + args.steps, size))
    mine = {"step_s": statistics.median(measure.times), "held": measure.held, "gathered": measure.gathered,
            "sums": measure.sums, "peak": measure.peak}  # fmt: skip
    ranks: list[Any] = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    result = {"config": args.worker, "devices": args.devices, "ranks": ranks}
    if trainer.global_rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def in_process(args: argparse.Namespace, config: str) -> dict[str, Any]:
    """One configuration on one device in this process (no new interpreter: what a 1-GPU check runs)."""
    return worker(argparse.Namespace(**{**vars(args), "worker": config, "devices": 1, "out": None}))


def run(args: argparse.Namespace, config: str, devices: int, deadline: float) -> dict[str, Any] | None:
    """One configuration on ``devices`` processes (Lightning launches the others); None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--devices", str(devices),
               "--accelerator", args.accelerator, "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--size", args.size, "--out", str(out)]  # fmt: skip
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0 or not out.exists():
            print(f"{config} on {devices}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def table(results: list[dict[str, Any]]) -> str:
    """Per W: each configuration's worst rank, as ratios to dp-ddp at the same W."""
    lines = ["| W | config | step time | params+grads+optimizer state per rank | full-size parameters alive "
             "in a step | full-size clipped sum held | CUDA peak |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for devices in sorted({r["devices"] for r in results}):
        rows = {r["config"]: r for r in results if r["devices"] == devices}
        base = rows.get("dp-ddp")

        def worst(r: dict[str, Any], key: str) -> float:
            return max(rank[key] for rank in r["ranks"])

        for config in CONFIGS:
            r = rows.get(config)
            if r is None:
                lines.append(f"| {devices} | {config} | failed or out of time | | | | |")
                continue
            cells = []
            for key, unit in (
                ("step_s", "s"),
                ("held", "MB"),
                ("gathered", "MB"),
                ("sums", "MB"),
                ("peak", "MB"),
            ):
                value = worst(r, key) if all(key in rank for rank in r["ranks"]) else 0.0
                shown = f"{value:.3f} s" if unit == "s" else f"{value / 2**20:.1f} MB"
                ratio = f" (×{value / worst(base, key):.2f})" if base is not None and worst(base, key) else ""
                cells.append(shown + ratio)
            lines.append(f"| {devices} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sharded(
    args: argparse.Namespace, deadline: float, configs: tuple[str, ...] = CONFIGS
) -> list[dict[str, Any]]:
    """Every configuration on each W in ``args.world_sizes`` until ``deadline`` (time.monotonic())."""
    results = []
    for devices in args.world_sizes:
        for config in configs:
            if time.monotonic() >= deadline:
                return results
            found = run(args, config, devices, deadline)
            if found is not None:
                results.append(found)
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=16, help="the logical batch (examples per step, all ranks)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", default=json.dumps({"vocab": 2048, "width": 256, "layers": 4, "length": 64}))
    p.add_argument("--budget", type=float, default=1800.0, help="seconds for all configurations")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    results = sharded(args, time.monotonic() + args.budget)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
