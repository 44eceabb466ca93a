"""The strategies read as a checklist: every Lightning hook they override is marked and short."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_dp import DPDDPStrategy, DPStrategy
from lightning_dp.strategies import DPStrategyBase

MAX_HOOK_LINES = 15
LIGHTNING_BASES = {
    DPStrategyBase: SingleDeviceStrategy,
    DPStrategy: SingleDeviceStrategy,
    DPDDPStrategy: DDPStrategy,
}


def _function(member: object) -> object:
    return member.fget if isinstance(member, property) else getattr(member, "__func__", member)


def _overridden(cls: type) -> list[tuple[str, object]]:
    """The members ``cls`` itself defines that also exist on its Lightning base (or on ``DPStrategyBase``)."""
    lightning = LIGHTNING_BASES[cls]
    ours = DPStrategyBase if cls is not DPStrategyBase else None
    return [
        (name, _function(member))
        for name, member in vars(cls).items()
        if callable(_function(member))
        and not name.startswith("__")
        and (hasattr(lightning, name) or (ours is not None and name in vars(ours)))
    ]


@pytest.mark.parametrize("cls", list(LIGHTNING_BASES))
def test_every_overridden_hook_is_marked_override(cls):
    unmarked = [name for name, function in _overridden(cls) if not getattr(function, "__override__", False)]
    assert not unmarked, f"{cls.__name__} overrides {unmarked} without @override"


@pytest.mark.parametrize("cls", list(LIGHTNING_BASES))
def test_every_hook_is_a_few_lines(cls):
    """The body of each hook (docstring and signature excluded) fits in MAX_HOOK_LINES: the work is in
    the modules beside the strategy (refusals, loaders, checkpoints, routing, norm_pass)."""
    too_long = {}
    for name, function in _overridden(cls):
        if name == "__init__":
            continue
        definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
        assert isinstance(definition, ast.FunctionDef)
        body = definition.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        lines = (body[-1].end_lineno or 0) - body[0].lineno + 1 if body else 0
        if lines > MAX_HOOK_LINES:
            too_long[name] = lines
    assert not too_long, f"{cls.__name__}: hooks longer than {MAX_HOOK_LINES} lines: {too_long}"
