"""The capture's parameters: which layers hold them, which are trainable now, and where their gradient came from.

Every trainable parameter is covered by the calls of the layers that hold it (:class:`ParameterPaths`). Two
watches on autograd's own accumulation (:class:`GradientWatch`) show a gradient that came another way: on
the first batch, a parameter that got a gradient but no per-example one; on every batch, a gradient into a
parameter its layer's forward had frozen (the book-keeping that skips weight gradients), which only a use
outside that forward can put there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_dp.per_example.layers import steps_itself
from lightning_dp.per_example.materialized import direct_params


class ParameterPaths:
    """Which layers hold which parameters, which of them train now, and which layers are running."""

    def __init__(
        self, root: nn.Module, layers: Sequence[tuple[str, nn.Module]], swapped: Iterable[nn.Module]
    ) -> None:
        self.root = root
        self.all: dict[nn.Module, list[nn.Parameter]] = {
            m: [p for _, p in direct_params(m, trainable=False)] for _, m in layers
        }
        for module in swapped:  # their parts are called inside their forward
            self.all[module] = [p for _, p in direct_params(module, trainable=False)]
        self.own: dict[nn.Module, list[nn.Parameter]] = {}
        """Each layer's parameters that are trainable now."""
        self.params: list[nn.Parameter] = []
        """Each trainable parameter once, tied ones included (their uses are summed per example)."""
        self.names = {p: name for name, p in root.named_parameters()}
        self.holders: dict[nn.Parameter, list[nn.Module]] = {}
        self.uses: Counter[nn.Parameter] = Counter()
        """How many captured layer calls use each parameter since the last ``collect`` (shared if > 1)."""
        self.running: Counter[nn.Module] = Counter()
        """Layers whose forward is running (a parameter read outside all its holders' forwards is traced)."""
        self._flags: tuple[bool, ...] = ()

    def refresh(self, layers: Sequence[tuple[str, nn.Module]]) -> list[nn.Parameter] | None:
        """Read which parameters are trainable now; the trainable ones (``params`` is left to the caller to
        set once they are checked), or None when nothing changed since the last call."""
        flags = tuple(p.requires_grad for ps in self.all.values() for p in ps)
        if steps_itself(self.root):
            flags += tuple(p.requires_grad for _, p in direct_params(self.root, trainable=False))
        if flags == self._flags:
            return None
        self._flags = flags
        self.own = {m: [p for p in ps if p.requires_grad] for m, ps in self.all.items()}
        loose = [p for _, p in direct_params(self.root)] if steps_itself(self.root) else []
        self.holders = {p: [] for p in loose}
        for m, ps in self.all.items():
            for p in ps:
                self.holders.setdefault(p, []).append(m)
        return list(dict.fromkeys([*loose, *(p for _, m in layers for p in self.own[m])]))

    def used_outside(self, param: nn.Parameter) -> bool:
        """A trainable parameter read while no layer holding it runs its forward."""
        holders = self.holders.get(param)
        return holders is not None and param.requires_grad and not any(self.running[m] for m in holders)

    def enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        del args
        self.running[module] += 1

    def leave(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        del args, output
        self.running[module] -= 1


class GradientWatch:
    """Hooks on autograd's accumulation into the parameters: gradients that no per-example path gave."""

    def __init__(self) -> None:
        self.reached: set[nn.Parameter] = set()
        """Parameters autograd accumulated a gradient into since the last ``collect`` (first batch only)."""
        self.froze: set[nn.Parameter] = set()
        """Parameters frozen during their layer's forward since the last ``collect``."""
        self.thawed: set[nn.Parameter] = set()
        """Parameters that some holder uses unfrozen (a recomputed layer): their gradient always accumulates."""
        self.outside: set[nn.Parameter] = set()
        """Of the frozen ones, those autograd still accumulated a gradient into: used outside their layer's forward."""
        self._reach_handles: list[RemovableHandle] = []
        self._outside_handles: list[RemovableHandle] = []

    def watch(self, params: Sequence[nn.Parameter]) -> None:
        """Watch newly trainable parameters (the first batch after checks whether each was reached)."""
        self._reach_handles += [p.register_post_accumulate_grad_hook(self.reached.add) for p in params]
        self._outside_handles += [p.register_post_accumulate_grad_hook(self._note_outside) for p in params]

    @property
    def checking_reach(self) -> bool:
        return bool(self._reach_handles)

    def _note_outside(self, param: Tensor) -> None:
        """A gradient accumulated into a parameter its layer's forward had frozen: another use reached it
        (``h @ emb.weight.T``, the loss reading it), which no per-example path covers."""
        if param in self.froze and param not in self.thawed:
            self.outside.add(param)  # type: ignore[arg-type]

    def take_outside(self, covered: set[nn.Parameter]) -> set[nn.Parameter]:
        """The parameters used outside their layers this step, less those the tracer covered; a fresh start."""
        outside = self.outside - covered
        self.outside, self.froze = set(), set()
        return outside

    def unreached(self, params: Sequence[nn.Parameter], captured: set[nn.Parameter]) -> list[nn.Parameter]:
        """Parameters autograd reached that no per-example path did (the reach seen so far is forgotten)."""
        missed = [p for p in params if p in self.reached and p not in captured]
        self.reached.clear()
        return missed

    def stop_reach(self) -> None:
        """The reach was checked: later steps pay nothing for it."""
        for handle in self._reach_handles:
            handle.remove()
        self._reach_handles = []

    def forget(self) -> None:
        """Forget a pass as if it never ran."""
        self.froze, self.outside = set(), set()

    def remove(self) -> None:
        for handle in [*self._reach_handles, *self._outside_handles]:
            handle.remove()
        self._reach_handles, self._outside_handles = [], []
