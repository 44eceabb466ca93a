"""What the strategy hands the engine (lightning_dp/engine/batch.py and the engine's input methods).

The engine's inputs are set through one method each (``begin_batch``, ``begin_chunk``, ``halt``,
``share_release``, ``use_train_data``, ``use_sinks``, ``carry_prior``, ``settle_normalisation``) and read as
properties: no module writes an engine attribute, and a refused release leaves nothing pending.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dp import ConstantNoise, FlatClipping, Poisson, Step
from lightning_dp.core.batches import UnitInfo
from lightning_dp.core.errors import BatchDimensionError
from lightning_dp.engine import PendingChunks, PrivateStepEngine

ROOT = Path(__file__).resolve().parents[2]
INPUTS = (
    "units", "chunk_batch", "realised_batch", "batch", "sampled_batch", "releases_this_batch", "halted",
    "pending_ctx", "train_data", "gradient_sink", "sum_sink", "prior_events", "prior_num_samples",
    "normalisation_settled", "rank", "world_size", "all_reduce",
)  # fmt: skip


def _engine(sigma: float = 0.0, clip: float = 1e6) -> tuple[PrivateStepEngine, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    engine = PrivateStepEngine(
        sampler=Poisson(seed=0), clipping=FlatClipping(), noise=ConstantNoise(sigma), step=Step(),
        max_grad_norm=clip, delta=1e-5, target_epsilon=None, accountant="rdp", loss_reduction="sum", seed=0,
    )  # fmt: skip
    engine.sampler.bind(100, 8)
    engine.attach(model)
    return engine, model


def _engine_writes(source: str, where: str) -> list[str]:
    """``<x>.engine.<attr> = …`` or ``engine.<attr> = …`` (also augmented) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for leaf in ast.walk(target):
                if not isinstance(leaf, ast.Attribute):
                    continue
                owner = leaf.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                if name in ("engine", "_engine"):
                    found.append(f"{where}:{node.lineno} .{leaf.attr}")
    return found


def test_no_module_writes_an_engine_attribute() -> None:
    """The strategy, the checks, the recipes and the benchmarks hand the engine its inputs through its methods."""
    files = [
        p
        for folder in ("lightning_dp", "bench", "recipes")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "lightning_dp/engine/" not in p.as_posix()
    ]
    writes = [w for p in files for w in _engine_writes(p.read_text(), str(p.relative_to(ROOT)))]
    assert not writes, "write through the engine's input methods, not its attributes:\n" + "\n".join(writes)


def test_the_scan_sees_a_write() -> None:
    """The scan above finds the blackboard writes it forbids (a strategy's ``self.engine.units = …``)."""
    source = "def f(self, engine):\n    self.engine.units = None\n    engine.chunk_batch += 1\n"
    assert _engine_writes(source, "probe") == ["probe:2 .units", "probe:3 .chunk_batch"]


@pytest.mark.parametrize("name", INPUTS)
def test_the_inputs_are_read_only(name: str) -> None:
    engine, _ = _engine()
    with pytest.raises(AttributeError):
        setattr(engine, name, None)


def test_begin_batch_and_begin_chunk_hand_in_the_rows_and_their_units() -> None:
    engine, _ = _engine()
    units = UnitInfo(torch.tensor([0, 0, 1, 2, 2, 2]), "sum")
    engine.begin_batch(6, data="the batch", units=units)
    assert (engine.realised_batch, engine.chunk_batch, engine.batch) == (6, 6, "the batch")
    assert engine.units is units
    assert engine.sampled_batch.units is units
    assert engine.releases_this_batch == 0
    assert not engine.halted
    chunk = UnitInfo(torch.tensor([0, 1, 1, 1]), "sum")
    engine.begin_chunk(4, chunk)
    assert (engine.chunk_batch, engine.units) == (4, chunk)
    assert engine.sampled_batch.units is units
    assert engine.realised_batch == 6
    engine.halt()
    assert engine.halted
    engine.begin_batch(None)
    assert not engine.halted
    assert engine.units is None
    assert engine.batch is None


def test_pending_chunks_add_take_and_drop() -> None:
    pending = PendingChunks()
    assert pending.empty
    assert pending.take() == (None, 0, 0)
    pending.add([torch.ones(2)], units=2, rows=3)
    pending.add([torch.full((2,), 2.0)], units=1, rows=1)
    sums, units, rows = pending.take()
    assert sums is not None
    assert torch.equal(sums[0], torch.full((2,), 3.0))
    assert (units, rows) == (3, 4)
    assert pending.empty
    pending.add([torch.ones(2)], units=1, rows=2)
    pending.drop()
    assert pending.take() == (None, 0, 0)


def test_chunks_sum_to_the_whole_batch_step() -> None:
    """Two physical chunks handed in with begin_chunk release what the whole batch releases (σ = 0)."""
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)

    def released(chunks: list[slice]) -> list[torch.Tensor]:
        engine, model = _engine(clip=0.5)
        engine.begin_batch(6, data=(x, y))
        for i, rows in enumerate(chunks):
            if len(chunks) > 1:
                engine.begin_chunk(rows.stop - rows.start, None)
            ((model(x[rows]) - y[rows]) ** 2).sum().backward()
            if i < len(chunks) - 1:
                engine.accumulate_chunk()
        ctx = engine.privatize()
        assert ctx.batch_size == 6
        assert ctx.extras["rows"] == 6
        return [p.grad.clone() for p in model.parameters()]

    for whole, chunked in zip(released([slice(0, 6)]), released([slice(0, 4), slice(4, 6)]), strict=True):
        torch.testing.assert_close(whole, chunked, rtol=1e-5, atol=1e-6)  # the clipped sums are fp32


def test_a_refused_release_leaves_no_chunk_pending() -> None:
    """A release refused for its size drops the chunks accumulated before it: the next batch starts clean."""
    engine, model = _engine()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    engine.begin_batch(5)  # the sampler drew 5, but 6 rows are backpropagated
    engine.begin_chunk(4, None)
    ((model(x[:4]) - y[:4]) ** 2).sum().backward()
    engine.accumulate_chunk()
    engine.begin_chunk(2, None)
    ((model(x[4:]) - y[4:]) ** 2).sum().backward()
    with pytest.raises(BatchDimensionError):
        engine.privatize()
    engine.begin_batch(6)
    for p in model.parameters():
        p.grad = None
    ((model(x) - y) ** 2).sum().backward()
    assert engine.privatize().extras["rows"] == 6  # nothing of the refused batch's chunks was added
