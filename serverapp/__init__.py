"""The project's Flower ServerApp (the app layer, not part of the ``flwr-gsgm`` wheel).

- :mod:`serverapp.server_app`: the ``ServerApp`` that ``flwr run .`` starts
  (``[tool.flwr.app.components] serverapp``);
- :mod:`serverapp.experiment`: one experiment from a run config (model and data
  from ``clients/``, strategy from :mod:`flwr_gsgm`, outputs), shared by the
  ServerApp, the in-process runs and the sweep runner;
- :mod:`serverapp.app_config`: the app's run config keys (data, evaluation, the
  ClientApp's threads) beside the library's, and the check of a whole run config;
- :mod:`serverapp.plot`: ``accuracy.png``.
"""
