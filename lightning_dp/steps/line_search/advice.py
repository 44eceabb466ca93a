"""End-of-run advice from LineSearch's released search results (post-processing: no privacy cost)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

#: Share of the searches that accepted the largest candidate η0 above which η0, not the loss, capped the
#: steps. Measured with bench/mechanisms.py (2026-11-27): on the MNIST CNN (C = 0.1, 3 epochs, DP-SGD's
#: tuned lr 32) η0 = 1/C = 10 was accepted in 54-58 % of the searches and LineSearch ended 2.2 points
#: below that DP-SGD at ε = 3; η0 = lr = 32 closed the gap (0.970 against 0.972, 2 seeds).
CAPPED_SHARE = 0.5

#: Fewer searches than this say too little to advise on.
MIN_SEARCHES = 20


def warn_if_capped_by_eta0(stats: Mapping[str, int], eta0: float, lr: float) -> None:
    """Say so when most searches accepted their largest candidate η0 and the optimizer's learning rate
    ``lr`` (unused by LineSearch; tuned for DP-SGD, whose step is lr·ĝ as LineSearch's is η·ĝ) is larger.

    The acceptance share alone does not tell: on the digits MLP (50-53 %) and the text model (49 %) η0 = 1
    was accepted about as often, but there DP-SGD's tuned lr is 0.25-0.5, and on the MLP 2·η0 or 4·η0
    cost 5-30 points.
    """
    searches, top = stats["searches"], stats["at_eta0"]
    if searches < MIN_SEARCHES or top < CAPPED_SHARE * searches or lr <= eta0:
        return
    warnings.warn(
        f"LineSearch accepted its largest candidate η0 = {eta0:.3g} in {top} of its {searches} searches "
        f"({100 * top / searches:.0f} %): its steps were capped by η0, not by the loss, and your optimizer's "
        f"learning rate lr = {lr:.3g} (which LineSearch does not use) steps {lr / eta0:.3g}× further. "
        f"Start the search there: LineSearch(eta0={lr:.3g}).",
        stacklevel=3,
    )
