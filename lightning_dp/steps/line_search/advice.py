"""End-of-run advice from LineSearch's released search results (post-processing: no privacy cost)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

#: Share of the searches that accepted the largest candidate η0 above which the run is told that η0, not
#: the loss, capped its steps. Measured with bench/mechanisms.py (2026-11-27): on the MNIST CNN (C = 0.1,
#: 3 epochs) the default η0 = 1/C was accepted in most searches and LineSearch ended 2.2 points below a
#: DP-SGD whose lr was tuned, and 4·η0 closed the gap; on the text model it was not capped. (Letting η0
#: grow with the accepted steps, ``eta0_growth=True``, did not help there: 0.74.)
CAPPED_SHARE = 0.5

#: Fewer searches than this say too little to advise on.
MIN_SEARCHES = 20


def warn_if_capped_by_eta0(stats: Mapping[str, int], eta0: float) -> None:
    """Say so when most searches accepted their largest candidate: the steps were capped by η0."""
    searches, top = stats["searches"], stats["at_eta0"]
    if searches < MIN_SEARCHES or top < CAPPED_SHARE * searches:
        return
    warnings.warn(
        f"LineSearch accepted its largest candidate η0 = {eta0:.3g} in {top} of its {searches} searches "
        f"({100 * top / searches:.0f} %): its steps were capped by η0, not by the loss, so it may have "
        f"trained slower than it could. Start the search higher: LineSearch(eta0={4 * eta0:.3g}).",
        stacklevel=3,
    )
