"""The ground floor: what every other floor may import; it imports nothing of lightning_dp above it.

``errors`` (the exceptions a user can catch), ``validation`` (argument checks), ``rng`` (the sampling
and noise generators), ``draws`` (one Poisson draw), ``batches`` (what the private train loader yields),
``privacy_unit`` (what a run's ε is about), ``losses``, ``version`` and ``_logging``.
"""
