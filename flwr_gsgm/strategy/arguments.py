"""The checks and resolution of :class:`~flwr_gsgm.strategy.async_strategy.AsyncStrategy`'s
arguments, before any message is sent: client work, the rule's parameters with the
defaults of the client mode (the server learning rate has one for gradients, one
for displacements: :meth:`flwr_gsgm.core.Param.default_for`), prefetch, trainable keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from flwr_gsgm.core import OPTIMIZERS, declared_params
from flwr_gsgm.core.backups import DispatchBackups
from flwr_gsgm.core.params import DISPLACEMENT_MODES
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.simulation.virtual_clock import VirtualClock

__all__ = [
    "CLIENT_MODES",
    "STRATEGY_KEYWORDS",
    "client_work",
    "check_prefetch",
    "learning_rate_source",
    "resolve_optimizer_params",
    "trainable_keys",
]

CLIENT_MODES = ("gradient", "delta", "weights")
#: Keyword arguments of AsyncStrategy itself (the rest are the optimizer's).
STRATEGY_KEYWORDS = (
    "server_learning_rate",
    "client_mode",
    "batch_size",
    "local_batches",
    "local_steps",
    "local_epochs",
    "local_lr",
    "local_momentum",
    "virtual_clock",
    "engine",
    "seed",
    "trainable_keys",
    "federated_evaluation",
    "train_config_fn",
    "on_evaluate",
    "on_federated_evaluate",
)


def learning_rate_source(server_learning_rate: float | None, client_mode: str) -> str:
    """Where a strategy's server learning rate comes from, for the log: "given", or
    the rule's "gradient-mode default" / "displacement-mode default", with what it
    multiplies in ``client_mode``."""
    source = "given" if server_learning_rate is not None else "the rule's default"
    if client_mode in DISPLACEMENT_MODES:
        return f"{source}, {client_mode} mode: a fraction of each node's displacement"
    return f"{source}, gradient mode"


def client_work(
    optimizer: str,
    client_mode: str,
    *,
    batch_size: int | None = None,
    local_batches: int | None = None,
    local_steps: int | None = None,
    local_epochs: int | None = None,
    local_lr: float | None = None,
    local_momentum: float | None = None,
) -> dict[str, Any]:
    """The client work every train message carries, by its run config key, checked.

    Gradient and delta modes (the project's protocol): every key, None read as the
    protocol's default (batch 32, one batch, one step, no epochs, lr 0.05, no
    momentum). Weights mode (a FedAvg ClientApp): only the keys given (not None);
    what the strategy does not set is the ClientApp's own (its epochs, learning rate
    and momentum), and a message never carries a default the user did not choose.

    Raises
    ------
    ValueError
        On an unknown optimizer or client mode, a size below 1 (``local-epochs``:
        below 0), a ``local-lr`` not above 0 or a ``local-momentum`` outside [0, 1);
        the message names the key and the value.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"strategy {optimizer!r} is unknown; expected one of {sorted(OPTIMIZERS)}")
    if client_mode not in CLIENT_MODES:
        raise ValueError(f"client-mode {client_mode!r} is unknown; expected one of {CLIENT_MODES}")
    for key, value in {
        "batch-size": batch_size,
        "local-batches": local_batches,
        "local-steps": local_steps,
    }.items():
        if value is not None and int(value) < 1:
            raise ValueError(f"{key} must be >= 1, got {value!r}")
    if local_lr is not None and not local_lr > 0:
        raise ValueError(f"local-lr must be > 0, got {local_lr!r}")
    if local_epochs is not None and (
        isinstance(local_epochs, bool) or int(local_epochs) != local_epochs or local_epochs < 0
    ):
        raise ValueError(f"local-epochs must be an integer >= 0, got {local_epochs!r}")
    if local_momentum is not None and not 0 <= local_momentum < 1:
        raise ValueError(f"local-momentum must be in [0, 1), got {local_momentum!r}")
    if client_mode != "weights":  # the protocol's client work: sent in full
        batch_size = 32 if batch_size is None else batch_size
        local_batches = 1 if local_batches is None else local_batches
        local_steps = 1 if local_steps is None else local_steps
        local_epochs = 0 if local_epochs is None else local_epochs
        local_lr = 0.05 if local_lr is None else local_lr
        local_momentum = 0.0 if local_momentum is None else local_momentum
    work = {
        "batch-size": None if batch_size is None else int(batch_size),
        "local-batches": None if local_batches is None else int(local_batches),
        "local-steps": None if local_steps is None else int(local_steps),
        "local-epochs": None if local_epochs is None else int(local_epochs),
        "local-lr": None if local_lr is None else float(local_lr),
        "local-momentum": None if local_momentum is None else float(local_momentum),
    }
    return {key: value for key, value in work.items() if value is not None}


def resolve_optimizer_params(
    optimizer: str,
    server_learning_rate: float | None,
    given: dict[str, Any],
    client_mode: str = "gradient",
    local_lr: float | None = None,
) -> dict[str, Any]:
    """Every declared parameter of ``optimizer``: given values over declared defaults.

    The defaults are those of ``client_mode`` (:meth:`Param.default_for`: the server
    learning rate has one for gradients, one for displacements); a rule that reads
    its updates' scale (``update_scale``, DC-ASGD) gets ``local_lr`` in the
    displacement modes unless given, and one that reads the kind of update
    (``displacement``, GSGM's ``apply_at = "auto"``) whether it is a displacement.

    Raises
    ------
    ValueError
        An unknown keyword; DC-ASGD in a displacement mode with neither
        ``update_scale`` nor ``local_lr`` (its gradient estimate is the displacement
        over the client's learning rate, which it must know).
    """
    declared = {p.name: p.default_for(client_mode) for p in declared_params(optimizer)}
    unknown = sorted(k for k in given if k not in declared or k == "lr")
    if unknown:
        own = ", ".join(k for k in declared if k != "lr")
        raise ValueError(
            f"strategy {optimizer!r}: unknown keyword argument(s) "
            f"{', '.join(repr(k) for k in unknown)}; the optimizer takes {own} "
            f"(and server_learning_rate); the strategy takes {', '.join(STRATEGY_KEYWORDS)}"
        )
    params = {**declared, **given}
    if "update_scale" in declared and "update_scale" not in given:
        if client_mode == "delta" and local_lr is None:
            local_lr = 0.05  # the protocol's default, which a delta-mode client uses
        if client_mode in DISPLACEMENT_MODES and local_lr is None:
            raise ValueError(
                f"strategy {optimizer!r} in {client_mode} mode estimates a gradient as the "
                "displacement / the client's learning rate: expected local_lr (the "
                "ClientApp's SGD learning rate) or update_scale"
            )
        params["update_scale"] = local_lr if client_mode in DISPLACEMENT_MODES else None
    if "displacement" in declared and "displacement" not in given:
        params["displacement"] = client_mode in DISPLACEMENT_MODES
    if server_learning_rate is not None:
        params["lr"] = server_learning_rate
    return params


def check_prefetch(
    optimizer: str, engine: EngineSettings, virtual_clock: VirtualClock | None
) -> None:
    """Raise ValueError if ``engine.prefetch`` is ruled out by the clock or the rule."""
    if not engine.prefetch:
        return
    replace(engine, virtual_clock=virtual_clock)  # EngineSettings checks the clock
    if issubclass(OPTIMIZERS[optimizer], DispatchBackups):
        # Its one copy per node of the weights sent would belong to the second message.
        raise ValueError(
            f"prefetch: strategy {optimizer!r} keeps the weights sent to each node for "
            "one message in flight per node; expected prefetch = false"
        )


def trainable_keys(keys: Iterable[str] | None) -> list[str] | None:
    """``keys`` as a list (None stays None); a lone string is refused (ValueError)."""
    if isinstance(keys, str):
        raise ValueError(f"trainable_keys must be a list of array names, got the string {keys!r}")
    return None if keys is None else list(keys)
