"""What a SuperNode runs in a real deployment, shipped as commands of the library.

- :mod:`flwr_gsgm.deploy.executor` (``flwr-gsgm-executor``): a warm ClientApp
  executor for ``flower-supernode --isolation process``: one long-lived process that
  serves every ClientApp task of its SuperNode with the ClientApp loaded once per FAB.
- :mod:`flwr_gsgm.deploy.supernode` (``flwr-gsgm-supernode``): ``flower-supernode``
  with shorter idle and reply polls, optionally supervising the warm executor.
- :mod:`flwr_gsgm.deploy.app_cache`: the loaded ClientApp of one FAB.
- :mod:`flwr_gsgm.deploy.poll`: a poll schedule, fast after activity, slow when idle.
- :mod:`flwr_gsgm.deploy.flower_waits`: Flower 1.42's fixed waits (SuperNode idle
  sleep, reply poll, object pull back-off) replaced, with the checks that the
  installed Flower still has them.

Nothing here imports ``clients/`` or ``simulations/``.
"""
