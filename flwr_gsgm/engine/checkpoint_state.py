"""The engine's checkpoint state: the file's top level, and what a resume must match.

The state is plain numpy/python values (:mod:`flwr_gsgm.checkpoint.files` writes the
file), composed by :meth:`AsyncEngine.state_dict
<flwr_gsgm.engine.async_engine.AsyncEngine.state_dict>` from each part's
``state_dict()``. Its top-level keys are those of checkpoints written before the
engine was split into parts, so such checkpoints still load (their ``last_digest``,
the memory of the content-based replay check that is gone, is ignored):

- ``keys`` (the model's), ``received`` (updates received), ``fingerprint``
  (:func:`flwr_gsgm.checkpoint.resume.fingerprint`) and :data:`DISPLACEMENT_UPDATES`:
  the engine's own;
- under their own key: ``optimizer`` (the model optimizer), ``node_stats`` (the
  per-node counts), ``norm_bound``;
- at the top level, the entries of the parts whose state is several: membership
  (``nodes``, ``speeds``, ``num_partitions``), the ledger (``counters``,
  ``rejections``, ``window``), what is in flight (``in_flight``), the dispatcher
  (``seq``, ``dispatch``, ``work_scheduling``), how the run ends (``diverged``,
  ``divergence``), the clock (``clock_now``) and the evaluation rows (``rows``).

A resume (:func:`check_before_start`, :func:`check_after_start`) is refused, naming
the checkpoint and each key, if the run's settings differ from the checkpoint's in
what changes the result (:mod:`flwr_gsgm.checkpoint.resume`) or its nodes report
another number of partitions, unless run config ``resume-allow-changes`` lists the
key. Every node that answers at the restart is in the run again: one lost before the
checkpoint rejoins, one active then but silent now is lost until it comes back
(:meth:`Membership.reconcile <flwr_gsgm.engine.membership.Membership.reconcile>`).

A checkpoint of a delta- or weights-mode run records ``displacement_updates``
(:data:`DISPLACEMENT_UPDATES`): its updates are displacements ``w_sent - w_local``
and its server learning rate a fraction of them. One written before (the updates
were ``(w_sent - w_local) / local-lr``) is refused (:func:`check_update_meaning`):
its optimizer state (momentum, buffers, caches, tables) holds updates in the old
scale and no resume can continue it; the message gives the server learning rate
that takes the same steps in a new run, old / local-lr.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.checkpoint.resume import ResumeRefused, check_resume, fingerprint
from flwr_gsgm.core import OPTIMIZERS
from flwr_gsgm.core.params import DISPLACEMENT_MODES
from flwr_gsgm.engine.settings import EngineSettings

__all__ = [
    "DISPLACEMENT_UPDATES",
    "REQUIRED",
    "check_after_start",
    "check_before_start",
    "check_update_meaning",
    "run_fingerprint",
    "with_params",
]

#: Top-level keys every engine checkpoint has (later ones are optional).
REQUIRED = ("keys", "optimizer", "nodes", "speeds", "num_partitions", "in_flight", "rows")
#: Key of a checkpoint whose delta/weights updates are displacements ``w_sent -
#: w_local`` (True): written by every engine since the server learning rate of those
#: modes became a fraction of the displacement (issue 22).
DISPLACEMENT_UPDATES = "displacement_updates"


def run_fingerprint(
    settings: EngineSettings, train_config: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, Any]:
    """What a resume must share with its checkpoint: the run config (or, without one,
    the rule's ``params`` and the ``train_config``)."""
    return fingerprint(settings.run_config, dict(params), dict(train_config))


def check_before_start(
    settings: EngineSettings, state: dict[str, Any], train_config: Mapping[str, Any]
) -> None:
    """Before any message: ``state`` is an engine state whose run config matches.

    Raises
    ------
    CheckpointError
        A key every engine state has is missing (not a checkpoint of this engine).
    ResumeRefused
        A delta/weights checkpoint of the old update meaning
        (:func:`check_update_meaning`), or the run config differs in a key that
        changes the result and ``resume-allow-changes`` does not list it
        (:func:`flwr_gsgm.checkpoint.resume.check_resume`).
    """
    path = settings.checkpoint_path
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} is not an engine state of flwr-gsgm: it lacks {missing}"
        )
    check_update_meaning(path, state)
    if settings.run_config is None:
        return  # compared once the rule exists (check_after_start)
    if "fingerprint" not in state:
        log(
            WARNING,
            "[async] resume: checkpoint %s was written before checkpoints recorded the "
            "run config; the settings are not compared",
            path,
        )
        return
    check_resume(
        path,
        state["fingerprint"],
        run_fingerprint(settings, train_config, {}),
        settings.resume_allow_changes,
    )


def check_after_start(
    settings: EngineSettings,
    state: dict[str, Any],
    keys: list[str],
    current: dict[str, Any],
    num_partitions: int,
) -> None:
    """Once the nodes answered and the rule exists: ``state`` fits this run.

    ``keys`` are the model's, ``current`` this run's fingerprint with the rule's
    parameters (:func:`run_fingerprint`), ``num_partitions`` what the nodes report.

    Raises
    ------
    ValueError
        The model keys differ.
    ResumeRefused
        The nodes report another number of partitions (unless allowed), or (a
        strategy started without a run config) the rule's parameters or train
        config differ.
    """
    path = settings.checkpoint_path
    if state["keys"] != keys:
        raise ValueError(f"checkpoint model keys {state['keys'][:3]}... differ from the model's")
    if settings.run_config is None and "fingerprint" in state:
        check_resume(path, state["fingerprint"], current, settings.resume_allow_changes)
    check_resume(
        path,
        {"num-partitions": state["num_partitions"]},
        {"num-partitions": num_partitions},
        settings.resume_allow_changes,
    )


def check_update_meaning(path: Path | None, state: dict[str, Any]) -> None:
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


def with_params(optimizer_state: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_state`` (a ModelOptimizer's, or a rule's alone) with the rule's
    parameters replaced by ``params``."""
    state = dict(optimizer_state)
    if isinstance(state.get("rule"), dict):
        state["rule"] = {**state["rule"], "params": dict(params)}
    else:  # written before models had buffers: the rule's state alone
        state["params"] = dict(params)
    return state
