"""Sending work: which idle nodes get the current weights, and what each message carries.

:class:`Dispatcher` fills free slots (every idle active node without a
concurrency limit; otherwise the :mod:`dispatch policy <flwr_gsgm.engine.dispatch_policy>`'s
picks up to ``max_in_flight``) within the update and time budgets, and builds each
train message: the weights, ``model-version``, the dispatch's derived ``seed`` and,
under the virtual clock, its ``virtual-duration`` and virtual finish time. The
duration charges the message's local work (read from the train config: ``mode``,
``batch-size``, ``local-batches``, ``local-steps``, ``local-epochs``) and the bytes of
the weights sent (:class:`~flwr_gsgm.simulation.virtual_clock.VirtualClock`).
"""

from __future__ import annotations

from logging import INFO

import numpy as np
from flwr.app import ConfigRecord
from flwr.common.logger import log

from flwr_gsgm.engine.dispatch_policy import make_dispatch_policy
from flwr_gsgm.engine.in_flight import Dispatch, InFlight
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.nodes.membership import Membership
from flwr_gsgm.simulation.virtual_clock import derive_seed
from flwr_gsgm.strategy.hooks import TrainConfigFn, merge_train_config

__all__ = ["Dispatcher"]


class Dispatcher:
    """Sends train messages to idle active nodes within the budgets and the in-flight limit.

    ``seq`` counts dispatches sent (their tie-break order); it is checkpointed.
    ``train_config_fn`` (:mod:`flwr_gsgm.strategy.hooks`), if given, is called for each train
    message and its keys are merged over ``train_config``.
    """

    def __init__(
        self,
        settings: EngineSettings,
        train_config: ConfigRecord,
        members: Membership,
        in_flight: InFlight,
        train_config_fn: TrainConfigFn | None = None,
    ) -> None:
        self.settings = settings
        self.train_config = train_config
        self.train_config_fn = train_config_fn
        self.members = members
        self.in_flight = in_flight
        # "auto" is resolved by the strategy, which knows the rule; an engine driven
        # directly with "auto" dispatches at random.
        name = "random" if settings.dispatch == "auto" else settings.dispatch
        self.policy = make_dispatch_policy(name, settings.seed)
        self.seq = 0

    def may_dispatch(self, received: int, clock_now: float) -> bool:
        """True if the update budget and the time budget (engine seconds) leave room."""
        budget_left = received + len(self.in_flight) < self.settings.max_updates
        time_left = self.settings.max_seconds is None or clock_now < self.settings.max_seconds
        return budget_left and time_left

    def messages_in_flight(self, nodes: int) -> int:
        """Most train messages in flight with ``nodes`` active nodes: ``max_in_flight``
        if it binds, else each node's dispatches (2 with ``prefetch``)."""
        most = nodes * self.settings.dispatches_per_node
        limit = self.settings.in_flight_limit
        return most if limit is None else min(limit, most)

    def copies_per_message(self) -> int:
        """Model copies the server holds per train message in flight: the message
        sent and its reply, plus the weights sent when the dispatch keeps them
        (checkpoints on, or "weights" client mode: see :class:`Dispatch`)."""
        keeps = bool(self.settings.checkpoint_every) or self.train_config.get("mode") == "weights"
        return 2 + int(keeps)

    def describe(self) -> None:
        """Log the in-flight limit and the dispatch policy (nothing without a limit)."""
        if self.settings.in_flight_limit is not None:
            log(
                INFO,
                "[async] at most %d node(s) in flight, dispatch %s",
                self.settings.in_flight_limit,
                self.settings.dispatch,
            )

    def start(self, optimizer: ModelOptimizer, received: int, clock_now: float) -> None:
        """The first work of a fresh run.

        When the limit leaves room for every node (or there is none), every node is
        dispatched in partition-id order, as before the limit existed (no budget
        check: the run needs its first replies), then with ``prefetch`` every node's
        second message; otherwise :meth:`top_up`.
        """
        limit = self.settings.in_flight_limit
        if limit is None or limit >= len(self.members.nodes):
            for pid in sorted(self.members.nodes):
                self.dispatch(optimizer, pid, clock_now, received)
            if self.settings.prefetch:
                self.top_up(optimizer, received, clock_now)
        else:
            self.top_up(optimizer, received, clock_now)

    def top_up(self, optimizer: ModelOptimizer, received: int, clock_now: float) -> None:
        """Give idle active nodes the work the budgets and the in-flight limit allow.

        Called whenever a slot may have freed: at start, after a reply, an error
        reply, a loss, a join and a resume. Without a limit, or when the limit leaves
        room for every idle node, every idle active node is dispatched in
        partition-id order, so a limit at or above the number of nodes changes
        nothing. Otherwise the dispatch policy picks among the idle active nodes
        until ``max_in_flight`` nodes are busy. With ``prefetch`` every active node
        is topped up to two dispatches.
        """
        depth = self.settings.dispatches_per_node  # 2 with prefetch (no limit then)
        idle = self.members.idle_active(depth)
        limit = self.settings.in_flight_limit
        if limit is None or len(self.in_flight) + len(idle) <= limit:
            for pid in idle:
                while self.in_flight.count(pid) < depth and self.may_dispatch(received, clock_now):
                    self.dispatch(optimizer, pid, clock_now, received)
            return
        while idle and len(self.in_flight) < limit and self.may_dispatch(received, clock_now):
            pid = self.policy.pick(idle)
            idle.remove(pid)
            self.dispatch(optimizer, pid, clock_now, received)

    def work_steps(self, pid: int, config: ConfigRecord | None = None) -> int:
        """Steps of local work a train message asks of partition ``pid``, from its train
        config (default: the run's; absent keys: gradient mode, one batch or step of 32;
        no epochs), as the virtual clock counts them (:meth:`VirtualClock.work_steps`).

        Raises
        ------
        ValueError
            Epoch work (``local-epochs`` > 0) without the partition's example count.
        """
        cfg = self.train_config if config is None else config
        return self.settings.virtual_clock.work_steps(
            pid,
            str(cfg.get("mode", "gradient")),
            batch_size=int(cfg.get("batch-size", 32)),
            local_batches=int(cfg.get("local-batches", 1)),
            local_steps=int(cfg.get("local-steps", 1)),
            local_epochs=int(cfg.get("local-epochs", 0)),
        )

    def dispatch(
        self, optimizer: ModelOptimizer, pid: int, clock_now: float, received: int
    ) -> None:
        """Send the current weights to partition ``pid``; ``clock_now`` is the engine clock
        (s), ``received`` the client updates received so far (``train_config_fn``'s).

        Raises
        ------
        flwr_gsgm.strategy.hooks.HookFailed, TypeError, ValueError
            From ``train_config_fn`` (:func:`flwr_gsgm.strategy.hooks.merge_train_config`),
            before anything of this dispatch is counted or sent.
        """
        node = self.members.nodes[pid]
        version = optimizer.version
        if self.train_config_fn is None:
            config = ConfigRecord(dict(self.train_config))
        else:
            config = merge_train_config(
                self.train_config, self.train_config_fn, node.node_id, version, received
            )
        index = node.dispatches
        node.dispatches += 1
        config["model-version"] = version
        config["seed"] = derive_seed(self.settings.seed, pid, index)
        weights = [np.array(w, copy=True) for w in optimizer.weights]
        v_finish = 0.0  # unused without the virtual clock: replies go in arrival order
        clock = self.settings.virtual_clock
        if clock is not None:
            message_bytes = sum(int(w.nbytes) for w in weights)  # the reply: the same size
            duration = clock.duration(
                node.speed, pid, index, self.work_steps(pid, config), message_bytes
            )
            config["virtual-duration"] = duration
            v_finish = clock_now + duration
        self.seq += 1
        dispatch = Dispatch(
            v_finish,
            self.seq,
            pid,
            version,
            dict(config),
            weights if self.settings.checkpoint_every or config.get("mode") == "weights" else None,
        )
        optimizer.on_dispatch(pid)
        self.in_flight.push_train(dispatch, node.node_id, weights)
