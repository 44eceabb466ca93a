"""The run around the private step, above ``checks/`` and below ``strategies/``: what a fit prepares and leaves.

``prepare`` (the module made trainable with per-example clipping), ``callbacks`` (``PrivacyCallback``:
the ``dp/*`` metrics, the budget stop), ``run_length`` (who ends the run), ``report`` (the privacy
report) and ``checkpointing`` (atomic checkpoint files, damaged-file diagnosis).
"""
