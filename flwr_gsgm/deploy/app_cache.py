"""The ClientApp of one FAB, installed and loaded once, reloaded when the FAB changes.

``flwr-clientapp`` installs the FAB and imports the ClientApp in a new process for
every message. A warm executor keeps the imported app (and whatever its modules
cache: data, models) between tasks. It holds one FAB at a time: a task of another
FAB (a new version of the app, another run's app) unloads the modules imported from
the old FAB's folder before importing the new one, so memory does not grow with the
number of FABs seen and a new version never runs old code.
"""

from __future__ import annotations

import gc
import importlib
import sys
from logging import INFO
from pathlib import Path

from flwr.cli.install import install_from_fab
from flwr.clientapp import ClientApp
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_project_dir
from flwr.supercore import log
from flwr.supercore.fab import Fab
from flwr.supercore.run import Run

__all__ = ["AppCache"]


class AppCache:
    """Installs and loads the ClientApp of a task's FAB, keeping the last one loaded.

    Attributes
    ----------
    fab_hash : str | None
        SHA-256 hex digest of the FAB whose ClientApp is loaded (None: none yet).
    loads : int
        How many times a ClientApp was imported (once per FAB change).
    """

    def __init__(self) -> None:
        self.fab_hash: str | None = None
        self.app: ClientApp | None = None
        self.app_dir: Path | None = None
        self.loads = 0

    def get(self, run: Run, fab: Fab) -> ClientApp:
        """The ClientApp of ``fab`` (``run`` names its FAB id and version).

        Loaded on the first task of a FAB; every later task of the same FAB gets the
        same object.

        Raises
        ------
        click.ClickException
            If the FAB is malformed (from Flower's ``install_from_fab``).
        flwr.clientapp.client_app.LoadClientAppError
            If the FAB's ``pyproject.toml`` names no loadable ClientApp.
        Exception
            Whatever importing the app's module raises (ImportError, ...).
        """
        if self.app is not None and fab.hash_str == self.fab_hash:
            return self.app
        self.unload()
        # install_from_fab keeps an existing install of the same FAB (skip_prompt).
        install_from_fab(fab.content, skip_prompt=True)
        app_dir = get_project_dir(run.fab_id, run.fab_version, fab.hash_str)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self.app_dir = app_dir.resolve()  # so that unload() can clean a failed import
        app = load(run.fab_id, run.fab_version, fab.hash_str)
        self.app, self.fab_hash = app, fab.hash_str
        self.loads += 1
        log(INFO, "[executor] loaded the ClientApp of %s %s", run.fab_id, run.fab_version)
        return app

    def unload(self) -> None:
        """Forget the loaded app: its modules, its sys.path entry, and the memory they held."""
        if self.app_dir is None:
            return
        for name in [n for n, m in sys.modules.items() if _under(m, self.app_dir)]:
            del sys.modules[name]
        # Flower's loader put the app folder first on sys.path (by its absolute path).
        for entry in [p for p in sys.path if p and _is_dir(p, self.app_dir)]:
            sys.path.remove(entry)
        importlib.invalidate_caches()
        self.app, self.fab_hash, self.app_dir = None, None, None
        gc.collect()  # module globals (cached data, models) can hold reference cycles


def _under(module: object, folder: Path) -> bool:
    """True if ``module`` was imported from a file or package inside ``folder``.

    Any object can sit in ``sys.modules`` (torch puts a namespace whose ``__path__``
    is no list there): what is not a path is not in ``folder``.
    """
    paths = [getattr(module, "__file__", None)]
    package_path = getattr(module, "__path__", None)
    if isinstance(package_path, (list, tuple)) or type(package_path).__name__ == "_NamespacePath":
        paths += list(package_path)
    for path in paths:
        if isinstance(path, str) and Path(path).resolve().is_relative_to(folder):
            return True
    return False


def _is_dir(entry: str, folder: Path) -> bool:
    try:
        return Path(entry).resolve() == folder
    except OSError:
        return False
