"""The project's ServerApp: run config -> strategy -> asynchronous run -> outputs.

``flwr run .`` starts it (``[tool.flwr.app.components] serverapp =
"serverapp.server_app:app"``). It belongs to the app layer, like ``clients/``: the
``flwr-gsgm`` wheel ships only the library ``flwr_gsgm``. A bad run config, or a key
neither the library nor the app declares (:mod:`serverapp.app_config`), raises
``ValueError`` naming the key before any message is sent.
"""

from __future__ import annotations

from logging import ERROR, INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment

app = ServerApp()

#: The ServerApp's last log line starts with this; ``scripts/run_simulation.sh`` reads
#: it (Flower's simulation runtime may keep ``flwr run`` waiting for a ClientApp that
#: never returns after the ServerApp has ended).
END_MARKER = "[flwr-gsgm] run ended:"


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, then run the experiment it describes on ``grid``.

    Logs :data:`END_MARKER` with the run's status ("completed", "diverged: <why>" or
    "failed: <why>") last, and re-raises any error (a failed run raises
    :class:`~flwr_gsgm.engine.run_end.RunFailed`, a diverged one
    :class:`~flwr_gsgm.engine.run_end.RunDiverged`), so Flower marks the run failed and
    ``flwr run`` (``scripts/run_simulation.sh``) exits non-zero.
    """
    try:
        cfg = parse_app_config(context.run_config)
        summary = run_experiment(grid, cfg)
    except BaseException as err:
        status = getattr(err, "status", "failed")
        log(ERROR, "%s %s: %s", END_MARKER, status, getattr(err, "reason", None) or err)
        raise
    log(INFO, "%s %s", END_MARKER, summary["status"])
