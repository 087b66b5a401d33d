"""The project's ServerApp: run config -> strategy -> asynchronous run -> outputs.

``flwr run .`` starts it (``[tool.flwr.app.components] serverapp =
"serverapp.server_app:app"``). It belongs to the app layer, like ``clients/``: the
``flwr-gsgm`` wheel ships only the library ``flwr_gsgm``. A bad run config
raises ``ValueError`` naming the key before any message is sent.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flwr_gsgm.run_config import parse_run_config
from serverapp.experiment import run_experiment

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, then run the experiment it describes on ``grid``."""
    cfg = parse_run_config(context.run_config)
    run_experiment(grid, cfg)
