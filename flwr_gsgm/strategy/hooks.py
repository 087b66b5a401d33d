"""The documented path of :class:`~flwr_gsgm.engine.hooks.HookFailed` (docs/PORTING.md).

The hooks a strategy takes (``train_config_fn``, ``on_evaluate``,
``on_federated_evaluate``) are called by the engine, so their types and
:class:`HookFailed` are defined in :mod:`flwr_gsgm.engine.hooks`, below the strategy
(docs/ARCHITECTURE.md, "The layers"). This module only keeps the name a ServerApp
catches, ``flwr_gsgm.strategy.hooks.HookFailed``, working; the library itself imports
it from :mod:`flwr_gsgm.engine.hooks`.
"""

from __future__ import annotations

from flwr_gsgm.engine.hooks import HookFailed

__all__ = ["HookFailed"]
