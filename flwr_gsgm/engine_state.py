"""The engine's checkpoint state: what each part of the engine saves and restores.

The state is plain numpy/python values (see :mod:`flwr_gsgm.checkpoint` for the
file). Its top-level keys are those of checkpoints written before the engine was
split into parts, so such checkpoints still load (their ``last_digest``, the
memory of the content-based replay check that is gone, is ignored).
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log

from flwr_gsgm import checkpoint
from flwr_gsgm.in_flight import Dispatch

if TYPE_CHECKING:
    from flwr_gsgm.async_engine import AsyncEngine

__all__ = ["save_state", "restore_state", "save_checkpoint"]


def save_state(engine: AsyncEngine) -> dict[str, Any]:
    """Everything needed to continue ``engine``'s run bit-identically.

    In-flight dispatches are saved with the weights they carried; a resumed run
    re-sends them with the same seed and virtual finish time.
    """
    assert engine.optimizer is not None
    in_flight = [
        {k: v for k, v in asdict(d).items() if k not in Dispatch.TRANSIENT}
        for d in sorted(engine.in_flight.dispatches.values())
    ]
    return {
        "keys": list(engine.keys),
        "optimizer": engine.optimizer.state_dict(),
        **engine.members.state_dict(),
        **engine.ledger.state_dict(),
        "in_flight": in_flight,
        "rows": [dict(r) for r in engine.rows],
        "received": engine.received,
        "diverged": engine.diverged,
        "seq": engine.dispatcher.seq,
        "clock_now": engine.clock_now,
        "dispatch": engine.policy.state_dict(),
        "node_stats": engine.stats.state_dict(),
        "norm_bound": engine.norm_bound.state_dict(),
    }


def restore_state(engine: AsyncEngine, state: dict[str, Any]) -> None:
    """Load :func:`save_state`'s output into ``engine`` and re-send its in-flight work.

    Raises
    ------
    ValueError
        If the checkpoint's model keys, optimizer or dispatch policy differ from the run's.
    """
    assert engine.optimizer is not None
    if state["keys"] != engine.keys:
        raise ValueError(f"checkpoint model keys {state['keys'][:3]}... differ from the model's")
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.ledger.load_state_dict(state)
    engine.members.load_state_dict(state)
    engine.rows = [dict(r) for r in state["rows"]]
    engine.received, engine.diverged = state["received"], state["diverged"]
    engine.dispatcher.seq, engine.clock_now = state["seq"], state["clock_now"]
    if "dispatch" in state:  # checkpoints written before dispatch policies lack it
        engine.policy.load_state_dict(state["dispatch"])
    if "node_stats" in state:  # ... and before the per-node counts and the norm bound
        engine.stats.load_state_dict(state["node_stats"])
        engine.norm_bound.load_state_dict(state["norm_bound"])
    for saved in state["in_flight"]:
        dispatch = Dispatch(**saved)
        node = engine.members.nodes[dispatch.partition_id]
        if node.active:
            engine.in_flight.push_train(dispatch, node.node_id, dispatch.arrays)
    log(
        INFO,
        "[async] resumed at %d updates (version %d, virtual time %.1f s)",
        engine.received,
        engine.optimizer.version,
        engine.clock_now,
    )


def save_checkpoint(engine: AsyncEngine) -> None:
    """Write :func:`save_state` to the checkpoint file, if checkpoints are on."""
    settings = engine.settings
    if settings.checkpoint_path is None or not settings.checkpoint_every:
        return
    checkpoint.save(settings.checkpoint_path, save_state(engine))
    log(INFO, "[async] checkpoint at %d updates -> %s", engine.received, settings.checkpoint_path)
