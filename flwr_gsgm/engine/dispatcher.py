"""Sending work: which idle nodes get the current weights, and what each message carries.

:class:`Dispatcher` fills free slots (every idle active node without a
concurrency limit; otherwise the :mod:`dispatch policy <flwr_gsgm.engine.dispatch_policy>`'s
picks up to ``max_in_flight``) within the update and time budgets, and builds each
train message: the weights, ``model-version``, the dispatch's derived ``seed`` and
its finish time, as the engine clock knows it (:meth:`Clock.stamp
<flwr_gsgm.engine.clock.Clock.stamp>`: under the virtual clock a ``virtual-duration``
for the message's local work and bytes; in deployment its arrival).
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from flwr.common.logger import log

from flwr_gsgm.engine.clock import Clock
from flwr_gsgm.engine.dispatch_policy import make_dispatch_policy
from flwr_gsgm.engine.hooks import TrainConfigFn, merge_train_config
from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.engine.membership import Membership
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.intake.dispatch import Dispatch
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.scheduling.work_scheduler import WorkScheduler
from flwr_gsgm.simulation.virtual_clock import derive_seed

__all__ = ["Dispatcher"]


class _Unset:
    """A key a train config does not have, in the change log line."""

    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()


class Dispatcher:
    """Sends train messages to idle active nodes within the budgets and the in-flight limit.

    Each message's local work is the run's train config, unless work scheduling
    (``work``, :class:`~flwr_gsgm.scheduling.work_scheduler.WorkScheduler`) sizes it
    by the node's measured speed at the engine clock's now: then ``local-steps`` is
    its assignment and ``local-epochs`` 0. A rule that schedules its own work
    (FedCompass) has the engine replace ``work`` with its scheduler, which may also
    hold idle nodes back and order them (:meth:`WorkScheduler.ready`).

    ``seq`` counts dispatches sent (their tie-break order); it is checkpointed with
    the dispatch policy's state (:meth:`state_dict`). The update budget is
    ``settings.max_updates``, the time budget the ``clock``'s. ``train_config_fn``
    (:mod:`flwr_gsgm.engine.hooks`), if given, is called for each train message and
    its keys are merged over ``train_config``.
    """

    def __init__(
        self,
        settings: EngineSettings,
        train_config: ConfigRecord,
        members: Membership,
        in_flight: InFlight,
        clock: Clock,
        train_config_fn: TrainConfigFn | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.train_config = train_config
        self.train_config_fn = train_config_fn
        # train_config_fn's last config (the run's before its first): a change is logged.
        self._fn_config = dict(train_config)
        self.members = members
        self.in_flight = in_flight
        # "auto" is resolved by the strategy, which knows the rule; an engine driven
        # directly with "auto" dispatches at random.
        name = "random" if settings.dispatch == "auto" else settings.dispatch
        self.policy = make_dispatch_policy(name, settings.seed)
        self.work = WorkScheduler(settings.work_scheduling, name=members.name)
        self.seq = 0

    def may_dispatch(self, received: int) -> bool:
        """True if the update budget and the time budget (the clock's) leave room."""
        budget_left = received + len(self.in_flight) < self.settings.max_updates
        return budget_left and self.clock.time_left()

    def messages_in_flight(self, nodes: int) -> int:
        """Most train messages in flight with ``nodes`` active nodes: ``max_in_flight``
        if it binds, else each node's dispatches (2 with ``prefetch``)."""
        most = nodes * self.settings.dispatches_per_node
        limit = self.settings.max_in_flight
        return most if limit is None else min(limit, most)

    def copies_per_message(self) -> int:
        """Model copies the server holds per train message in flight: the message
        sent and its reply, plus the weights sent when the dispatch keeps them
        (checkpoints on, or "weights" client mode: see :class:`Dispatch`)."""
        keeps = bool(self.settings.checkpoint_every) or self.train_config.get("mode") == "weights"
        return 2 + int(keeps)

    def describe(self) -> None:
        """Log the in-flight limit and the dispatch policy (nothing without a limit)."""
        if self.settings.max_in_flight is not None:
            log(
                INFO,
                "[async] at most %d node(s) in flight, dispatch %s",
                self.settings.max_in_flight,
                self.settings.dispatch,
            )

    def start(self, optimizer: ModelOptimizer, received: int) -> None:
        """The first work of a fresh run.

        When the limit leaves room for every node (or there is none), every node is
        dispatched in partition-id order, as before the limit existed (no budget
        check: the run needs its first replies), then with ``prefetch`` every node's
        second message; otherwise :meth:`top_up`.
        """
        limit = self.settings.max_in_flight
        if limit is None or limit >= len(self.members.nodes):
            for pid in sorted(self.members.nodes):
                self.dispatch(optimizer, pid, received)
            if self.settings.prefetch:
                self.top_up(optimizer, received)
        else:
            self.top_up(optimizer, received)

    def top_up(self, optimizer: ModelOptimizer, received: int) -> None:
        """Give idle active nodes the work the budgets and the in-flight limit allow.

        Called whenever a slot may have freed: at start, after a reply, an error
        reply, a loss, a join and a resume. Without a limit, or when the limit leaves
        room for every idle node, every idle active node is dispatched in
        partition-id order, so a limit at or above the number of nodes changes
        nothing. Otherwise the dispatch policy picks among the idle active nodes
        until ``max_in_flight`` nodes are busy. A node the rule holds
        (:meth:`ModelOptimizer.holds`: GSGM's ``apply_at = "close"`` until the cycle
        closes) is not idle for this. With ``prefetch`` every active node
        is topped up to two dispatches.
        """
        depth = self.settings.dispatches_per_node  # 2 with prefetch (no limit then)
        ready = self.work.ready(self.members.idle_active(depth))
        idle = [p for p in ready if not optimizer.holds(p)]
        limit = self.settings.max_in_flight
        if limit is None or len(self.in_flight) + len(idle) <= limit:
            for pid in idle:
                while self.in_flight.count(pid) < depth and self.may_dispatch(received):
                    if not self.dispatch(optimizer, pid, received):
                        break  # offline: it gets work when it is back
            return
        while idle and len(self.in_flight) < limit and self.may_dispatch(received):
            pid = self.policy.pick(idle)
            idle.remove(pid)
            self.dispatch(optimizer, pid, received)

    def dispatch(self, optimizer: ModelOptimizer, pid: int, received: int) -> bool:
        """Send the current weights to partition ``pid``; ``received`` is the client
        updates received so far (``train_config_fn``'s). False, and nothing sent, if
        the time model has the node offline now: it goes offline until it is back
        (:meth:`Membership.go_offline`).

        Under the time model's availability a message whose node goes offline before
        its reply is lost: nothing is sent (its reply would never come), and it is due
        when the node goes offline, with the time it is back
        (:meth:`InFlight.push_lost <flwr_gsgm.engine.in_flight.InFlight.push_lost>`).

        Raises
        ------
        flwr_gsgm.engine.hooks.HookFailed, TypeError, ValueError
            From ``train_config_fn`` (:func:`flwr_gsgm.engine.hooks.merge_train_config`),
            before anything of this dispatch is counted or sent.
        """
        node = self.members.nodes[pid]
        back_at = self.clock.offline_until(pid)
        if back_at is not None:
            self.members.go_offline(pid, back_at, lost=False, freed=False)
            return False
        version = optimizer.version
        if self.train_config_fn is None:
            config = ConfigRecord(dict(self.train_config))
        else:
            config = merge_train_config(
                self.train_config, self.train_config_fn, node.node_id, version, received
            )
            self._log_config_change(config, node.name, received)
        # Work scheduling sets the message's local work last, over train_config_fn's.
        steps = self.work.steps_for(pid, self.members.active_ids(), now=self.clock.now())
        if steps is not None:
            config["local-steps"] = steps
            config["local-epochs"] = 0
        if self.work.policy != "off":
            self.work.sent(pid, steps)
        index = node.dispatches
        node.dispatches += 1
        config["model-version"] = version
        config["seed"] = derive_seed(self.settings.seed, pid, index)
        weights = [np.array(w, copy=True) for w in optimizer.weights]
        message_bytes = sum(int(w.nbytes) for w in weights)  # the reply: the same size
        v_finish = self.clock.stamp(config, node.speed, pid, index, message_bytes)
        self.seq += 1
        dispatch = Dispatch(
            v_finish,
            self.seq,
            pid,
            version,
            dict(config),
            weights if self.settings.checkpoint_every or config.get("mode") == "weights" else None,
            scheduled_steps=steps,
        )
        optimizer.on_dispatch(pid)
        loss = self.clock.loss(pid, v_finish)
        if loss is not None:
            dispatch.v_finish, dispatch.back_at = loss
            self.in_flight.push_lost(dispatch, node.node_id)
        else:
            self.in_flight.push_train(dispatch, node.node_id, weights)
        return True

    def _log_config_change(self, config: ConfigRecord, node: str, received: int) -> None:
        """Log at INFO the keys in which ``config`` (``train_config_fn``'s, merged)
        differs from the previous message's, once per change: a schedule leaves a trace
        in the log (FedAvg's CustomFedAvg logs "Adjusted learning rate")."""
        new = dict(config)
        old, self._fn_config = self._fn_config, new
        keys = [k for k in {**old, **new} if old.get(k, _UNSET) != new.get(k, _UNSET)]
        if not keys:
            return
        changes = ", ".join(f"{k} {old.get(k, _UNSET)!r} -> {new.get(k, _UNSET)!r}" for k in keys)
        log(
            INFO,
            "[async] train_config_fn changed the train config at %d updates received (%s): %s",
            received,
            node,
            changes,
        )

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The dispatches counted (``seq``), the dispatch policy's state (``dispatch``)
        and work scheduling's measurements (``work_scheduling``)."""
        return {
            "seq": self.seq,
            "dispatch": self.policy.state_dict(),
            "work_scheduling": self.work.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises
        ------
        ValueError
            The checkpoint's policy is another one.
        """
        self.seq = state["seq"]
        self.policy.load_state_dict(state["dispatch"])
        self.work.load_state_dict(state["work_scheduling"])
