"""The front doors, the top floor: what drives whole runs, above the strategies.

``cli`` (the ``lightning-dp`` command), ``lightning_cli`` (``DPLightningCLI``, which the command and each
tuning trial build), ``audit`` (the one-run privacy audit, ``lightning_dp.audit``) and ``tuning/``
(private hyperparameter tuning, ``lightning_dp.tune``).
"""
