"""The engine's checkpoint state: what each part of the engine saves and restores.

The state is plain numpy/python values (see :mod:`flwr_gsgm.checkpoint.files` for the
file). Its top-level keys are those of checkpoints written before the engine was
split into parts, so such checkpoints still load (their ``last_digest``, the
memory of the content-based replay check that is gone, is ignored).

A resume (:func:`check_settings`, :func:`restore_state`) is refused, naming the
checkpoint and each key, if the run's settings differ from the checkpoint's in what
changes the result (:mod:`flwr_gsgm.checkpoint.resume`) or its nodes report another
number of partitions, unless run config ``resume-allow-changes`` lists the key.
Every node that answers at the restart is in the run again: one lost before the
checkpoint rejoins, one active then but silent now is lost until it comes back.

A checkpoint of a delta- or weights-mode run records ``displacement_updates``
(:data:`DISPLACEMENT_UPDATES`): its updates are displacements ``w_sent - w_local``
and its server learning rate a fraction of them. One written before (the updates
were ``(w_sent - w_local) / local-lr``) is refused (:func:`check_update_meaning`):
its optimizer state (momentum, buffers, caches, tables) holds updates in the old
scale and no resume can continue it; the message gives the server learning rate
that takes the same steps in a new run, old / local-lr.
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.checkpoint.resume import ResumeRefused, check_resume, fingerprint
from flwr_gsgm.core import OPTIMIZERS
from flwr_gsgm.core.params import DISPLACEMENT_MODES
from flwr_gsgm.engine.in_flight import Dispatch

if TYPE_CHECKING:
    from flwr_gsgm.engine.async_engine import AsyncEngine

__all__ = [
    "DISPLACEMENT_UPDATES",
    "check_settings",
    "check_update_meaning",
    "load_for_resume",
    "save_state",
    "restore_state",
    "save_checkpoint",
]

#: Top-level keys every engine checkpoint has (later ones are optional).
REQUIRED = ("keys", "optimizer", "nodes", "speeds", "num_partitions", "in_flight", "rows")
#: Key of a checkpoint whose delta/weights updates are displacements ``w_sent -
#: w_local`` (True): written by every engine since the server learning rate of those
#: modes became a fraction of the displacement (issue 22).
DISPLACEMENT_UPDATES = "displacement_updates"


def _fingerprint(engine: AsyncEngine, with_optimizer: bool) -> dict[str, Any]:
    optimizer = engine.optimizer
    params = optimizer.rule.params if with_optimizer and optimizer is not None else {}
    return fingerprint(engine.settings.run_config, params, dict(engine.dispatcher.train_config))


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
        "diverged": engine.end.diverged,
        "divergence": engine.end.watch.state_dict(),
        "seq": engine.dispatcher.seq,
        "clock_now": engine.clock_now,
        "dispatch": engine.policy.state_dict(),
        "node_stats": engine.stats.state_dict(),
        "norm_bound": engine.norm_bound.state_dict(),
        "fingerprint": _fingerprint(engine, with_optimizer=True),
        DISPLACEMENT_UPDATES: True,
    }


def load_for_resume(engine: AsyncEngine) -> dict[str, Any] | None:
    """The verified checkpoint to resume from (None without ``resume``), checked
    against the run's settings: called before any message is sent.

    Raises
    ------
    CheckpointError
        No checkpoint, or a damaged one (:func:`flwr_gsgm.checkpoint.files.load`), or not
        an engine state.
    ResumeRefused
        The run config differs in what changes the result (:func:`check_settings`).
    """
    saved = checkpoint.load_for_resume(engine.settings.checkpoint_path, engine.settings.resume)
    if saved is not None:
        check_settings(engine, saved)
    return saved


def check_settings(engine: AsyncEngine, state: dict[str, Any]) -> None:
    """Before any message: ``state`` is an engine state whose run config matches.

    Raises
    ------
    ValueError
        A key every engine state has is missing (not a checkpoint of this engine), or
        the run config differs in a key that changes the result and
        ``resume-allow-changes`` does not list it (:func:`resume_check.check_resume`).
    """
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise checkpoint.CheckpointError(
            f"checkpoint {engine.settings.checkpoint_path} is not an engine state of "
            f"flwr-gsgm: it lacks {missing}"
        )
    check_update_meaning(engine.settings.checkpoint_path, state)
    if engine.settings.run_config is None:
        return  # compared once the optimizer exists (restore_state)
    if "fingerprint" not in state:
        log(
            WARNING,
            "[async] resume: checkpoint %s was written before checkpoints recorded the "
            "run config; the settings are not compared",
            engine.settings.checkpoint_path,
        )
        return
    check_resume(
        engine.settings.checkpoint_path,
        state["fingerprint"],
        _fingerprint(engine, with_optimizer=False),
        engine.settings.resume_allow_changes,
    )


def check_update_meaning(path: object, state: dict[str, Any]) -> None:
    """Refuse a delta/weights-mode checkpoint written before updates were displacements.

    The client mode is the checkpoint's run config ``client-mode`` (or, for a
    strategy started from Python, its train config ``mode``; for a checkpoint
    without a fingerprint, the mode of its in-flight messages). A gradient-mode
    checkpoint passes: that meaning did not change.

    Raises
    ------
    ResumeRefused
        A delta- or weights-mode checkpoint without :data:`DISPLACEMENT_UPDATES`; the
        message names the checkpoint and gives the server learning rate of a new run
        that takes the same steps: old / local-lr.
    """
    if state.get(DISPLACEMENT_UPDATES):
        return
    saved = state.get("fingerprint") or {}
    mode = saved.get("client-mode", saved.get("train.mode"))
    if mode is None:
        modes = {d.get("config", {}).get("mode") for d in state.get("in_flight", [])}
        mode = next((m for m in modes if m in DISPLACEMENT_MODES), None)
    if mode not in DISPLACEMENT_MODES:
        return
    old_lr, local_lr = _old_learning_rates(saved)
    if old_lr is not None and local_lr:
        convert = (
            f"server-learning-rate = old / local-lr = {old_lr:g} / {local_lr:g} = "
            f"{old_lr / local_lr:.6g}"
        )
    else:
        convert = "server-learning-rate = (its server learning rate) / (its local-lr)"
    raise ResumeRefused(
        f"resume refused: checkpoint {path} was written in {mode} client mode before the "
        "server learning rate of the delta and weights modes became a fraction of the "
        "node's displacement w_sent - w_local (it multiplied (w_sent - w_local) / local-lr); "
        "its optimizer state holds updates in that scale and cannot be continued. Start "
        f"the run afresh (resume=false, or another run-name) with {convert} for the same steps"
    )


def _old_learning_rates(saved: dict[str, Any]) -> tuple[float | None, float | None]:
    """The old server learning rate (the rule's gradient default for 0) and local-lr."""
    if "client-mode" in saved:  # a run config
        lr, local_lr = saved.get("server-learning-rate"), saved.get("local-lr")
        if not lr and saved.get("strategy") in OPTIMIZERS:
            # 0: the rule's own default, the same number in every mode before
            lr = OPTIMIZERS[saved["strategy"]].defaults()["lr"]
        return (float(lr) if lr else None), local_lr
    lr = saved.get("optimizer.lr")
    return (float(lr) if lr else None), saved.get("train.local-lr")


def restore_state(engine: AsyncEngine, state: dict[str, Any]) -> None:
    """Load :func:`save_state`'s output into ``engine`` and re-send its in-flight work.

    The rule's parameters are this run's (equal to the checkpoint's, or changed as
    ``resume-allow-changes`` allowed).

    Raises
    ------
    ResumeRefused
        The nodes report another number of partitions (unless allowed), or (a
        strategy started without a run config) the rule's parameters or train
        config differ.
    CheckpointError
        Anything else in the state does not fit the run (model keys, optimizer
        state, dispatch policy): the message names the checkpoint and the cause.
    """
    try:
        _restore(engine, state)
    except (ResumeRefused, checkpoint.CheckpointError):
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise checkpoint.CheckpointError(
            f"checkpoint {engine.settings.checkpoint_path} cannot be resumed: "
            f"{type(err).__name__}: {err}"
        ) from err


def _restore(engine: AsyncEngine, state: dict[str, Any]) -> None:
    assert engine.optimizer is not None
    settings = engine.settings
    if state["keys"] != engine.keys:
        raise ValueError(f"checkpoint model keys {state['keys'][:3]}... differ from the model's")
    if settings.run_config is None and "fingerprint" in state:
        check_resume(
            settings.checkpoint_path,
            state["fingerprint"],
            _fingerprint(engine, with_optimizer=True),
            settings.resume_allow_changes,
        )
    check_resume(
        settings.checkpoint_path,
        {"num-partitions": state["num_partitions"]},
        {"num-partitions": engine.members.num_partitions},
        settings.resume_allow_changes,
    )
    # The rule's parameters are this run's (equal, or allowed to change: checked above).
    engine.optimizer.load_state_dict(_with_params(state["optimizer"], engine.optimizer.rule.params))
    engine.ledger.load_state_dict(state)
    num_partitions = engine.members.num_partitions
    engine.members.load_state_dict(state)
    engine.members.num_partitions = num_partitions
    engine.rows = [dict(r) for r in state["rows"]]
    engine.evaluator.initial_loss = engine.rows[0]["loss"] if engine.rows else None
    engine.received = state["received"]
    if state["diverged"]:  # written before diverged runs stopped saving checkpoints
        engine.end.diverge("non-finite weights: the checkpoint's model had diverged", 0)
    if "divergence" in state:  # ... and before the divergence window was kept
        engine.end.watch.load_state_dict(state["divergence"])
    engine.dispatcher.seq, engine.clock_now = state["seq"], state["clock_now"]
    if "dispatch" in state:  # checkpoints written before dispatch policies lack it
        engine.policy.load_state_dict(state["dispatch"])
    if "node_stats" in state:  # ... and before the per-node counts and the norm bound
        engine.stats.load_state_dict(state["node_stats"])
        engine.norm_bound.load_state_dict(state["norm_bound"])
    _reconcile_nodes(engine)
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
    """Write :func:`save_state` to the checkpoint file, if checkpoints are on and the
    model has not diverged (then the previous checkpoint resumes from before it)."""
    settings = engine.settings
    if settings.checkpoint_path is None or not settings.checkpoint_every:
        return
    if engine.end.diverged:  # not the diverged model: the previous checkpoint stays
        return
    checkpoint.save(settings.checkpoint_path, save_state(engine))
    log(INFO, "[async] checkpoint at %d updates -> %s", engine.received, settings.checkpoint_path)


def _with_params(optimizer_state: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_state`` (a ModelOptimizer's, or a rule's alone) with the rule's
    parameters replaced by ``params``."""
    state = dict(optimizer_state)
    if isinstance(state.get("rule"), dict):
        state["rule"] = {**state["rule"], "params": dict(params)}
    else:  # written before models had buffers: the rule's state alone
        state["params"] = dict(params)
    return state


def _reconcile_nodes(engine: AsyncEngine) -> None:
    """The nodes that answered now are the run's: rejoin the ones lost before the
    checkpoint, lose those active then that did not answer (they rejoin if they come)."""
    assert engine.optimizer is not None
    before = engine.optimizer.rule.active_nodes
    for pid, node in sorted(engine.members.nodes.items()):
        if node.active and pid not in before:
            engine.optimizer.on_node_joined(pid, now=engine.clock_now)
            engine.ledger.count("nodes_joined")
            log(INFO, "[async] partition %d rejoined at the resume (node %d)", pid, node.node_id)
        elif not node.active and pid in before:
            node.may_return = True
            engine.optimizer.on_node_lost(pid, now=engine.clock_now)
            engine.ledger.count("nodes_lost")
            log(
                WARNING,
                "[async] partition %d lost: it did not answer at the resume (it rejoins "
                "when it comes back)",
                pid,
            )
