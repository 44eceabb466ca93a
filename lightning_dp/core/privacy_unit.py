"""What one neighbouring data set adds or removes: the privacy unit a run's ε is about.

Example-level runs protect one item of the training ``Dataset``; user-level runs
(``DPStrategy(privacy_unit="user", ...)``, ``docs/user-level.md``) protect a user's whole contribution.
The strategy builds one :class:`PrivacyUnit` at set-up; the fit-start line and ``privacy_report.json``
read it, so the report always names what its ε covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PrivacyUnit:
    """The privacy unit of a run: its kind, how many units the training set has, and the public bounds.

    ``kind``: ``"example"`` (add/remove one item) or ``"user"`` (add/remove one user with all their items).
    ``num_units``: N examples or U users (public: the ledger's sample rate is ``units_per_step / num_units``).
    ``examples_per_user``: k, the most rows one sampled user contributes to a step (user-level runs).
    ``max_examples_per_user``: for example-level runs, a declared and enforced bound on the items one user
    owns, from which the report states a user-level ε (``None``: no user-level statement).
    ``augmentation_multiplicity``: K augmented views of each example, clipped as one unit (ε unchanged).
    """

    kind: Literal["example", "user"] = "example"
    num_units: int = 0
    examples_per_user: int | None = None
    max_examples_per_user: int | None = None
    augmentation_multiplicity: int = 1

    @property
    def adjacency(self) -> str:
        """The neighbouring relation in words, as the report prints it."""
        if self.kind == "user":
            return "add/remove one user with all of their examples"
        return "add/remove one example"
