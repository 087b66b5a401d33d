"""Flower's synchronous strategies, run round by round on the engine's parts.

The baselines FedAvg and FedAvgM are Flower's own strategies
(``flwr.serverapp.strategy``), and the time-budget anchors (time-budget FedAvg,
FedNova: :mod:`flwr_gsgm.strategy.time_budget_fedavg`, :mod:`flwr_gsgm.strategy.fednova`)
subclass Flower's FedAvg. Their ``configure_train``, ``aggregate_train``,
``configure_evaluate`` and ``aggregate_evaluate`` are used as they are;
:class:`SynchronousRun` calls them in the order of Flower's ``Strategy.start``
(Flower 1.42, ``flwr/serverapp/strategy/strategy.py``: the initial centralized
evaluation, then per round train, aggregate, federated evaluation, centralized
evaluation), with the parts the asynchronous engine uses where the two kinds of run
must agree:

- **the budgets**: ``max-updates`` client trainings as whole rounds, ``max-seconds``
  through the engine clock (:mod:`flwr_gsgm.engine.clock`): under wall time no round
  starts once the budget is spent (the round running then finishes); under virtual
  time a round that ends past the budget is not applied (as the engine applies no
  reply that finishes past it);
- **the clock**: a round lasts its slowest trained node's time in the time model
  (:meth:`VirtualClock.duration
  <flwr_gsgm.simulation.virtual_clock.VirtualClock.duration>`: node p's draw number
  round - 1), and the server's queue of its replies where the model has one, so
  ``virtual_time`` is that of the asynchronous runs; in a deployment it is the wall
  clock, as for them;
- **the evaluation rows and the divergence checks**: the engine's
  :class:`~flwr_gsgm.engine.central_evaluation.Evaluator` (the same ``metrics.csv``
  columns; checks 2-3 of :mod:`flwr_gsgm.engine.divergence` on each row);
- **federated evaluation**: Flower's own, in the rounds whose client trainings cross a
  multiple of ``federated-eval-every``, in the columns the asynchronous runs use
  (:func:`~flwr_gsgm.engine.federated_evaluation.column_name`).

- **availability** (the time model's, :mod:`flwr_gsgm.simulation.availability`): a
  round samples among the nodes online when it starts (it waits, in virtual time, for
  the strategy's ``min_available_nodes``), and a sampled node that goes offline before
  its reply answers with Flower's node-unavailable error once the server learns of it
  (``offline-detection-seconds``); the round ends when every message is answered or at
  its ``timeout`` (``dispatch-timeout``, as Flower's ``start(timeout=...)``), whichever
  is first, with the replies it has: a reply later than the timeout is not aggregated.

Replies are handed to the strategy sorted by node id: Flower's FedAvg sums them in
the order given, and float32 sums in another order differ in their last bits, so a
fixed order makes a simulation repeat bit for bit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flwr_gsgm.engine.central_evaluation import EvaluateFn, Evaluator
from flwr_gsgm.engine.clock import Clock, VirtualTime
from flwr_gsgm.engine.federated_evaluation import column_name
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.nodes.query_reply import NO_PARTITION, read_query_reply
from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg

__all__ = ["RoundModel", "SynchronousReport", "SynchronousRun", "partitions_of_nodes"]


@dataclass
class RoundModel:
    """The global model after ``version`` rounds, as an evaluation row reads it
    (:class:`~flwr_gsgm.engine.central_evaluation.Evaluator`): its arrays in model
    order and the outcome counters of a synchronous round (none: every reply of a
    round is averaged)."""

    version: int
    weights: list[np.ndarray]
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class SynchronousReport:
    """What a synchronous run produced.

    Attributes
    ----------
    rows : list[dict]
        The evaluation rows (``metrics.csv``), with the federated columns of the rounds
        that had a federated evaluation.
    counters : dict[str, int]
        ``updates_received`` (the replies of the rounds applied: rounds x nodes per
        round when every node is always online), ``updates_applied`` (the same: a
        round averages every reply it has), ``steps_applied`` (rounds),
        ``lost_in_flight`` (messages whose node went offline before its reply) and
        ``dispatch_timeouts`` (messages whose reply would have come after the round's
        timeout), plus ``diverged`` = 1 for a diverged run.
    rounds : int
        Rounds applied.
    diverged : str | None
        Why the model diverged (the run stopped at that row), None if it did not.
    """

    rows: list[dict[str, Any]]
    counters: dict[str, int]
    rounds: int
    diverged: str | None = None


def partitions_of_nodes(grid: Grid, timeout: float) -> dict[int, int]:
    """node id -> partition-id, from each node's answer to the ``query`` message of
    the message protocol (docs/PORTING.md), read as the engine's membership reads it
    (:func:`~flwr_gsgm.nodes.query_reply.read_query_reply`); a node that cannot answer,
    or answers with a malformed partition-id, is left out."""
    node_ids = list(grid.get_node_ids())
    messages = [
        Message(RecordDict({"config": ConfigRecord()}), node_id, "query") for node_id in node_ids
    ]
    found: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node_id = reply.metadata.src_node_id
        answer = read_query_reply(node_id, reply, False, len(node_ids))
        if answer.partition_id not in (None, NO_PARTITION):
            found[node_id] = answer.partition_id
    return found


def _in_node_order(replies: Iterable[Message]) -> list[Message]:
    """The replies sorted by sending node id (see the module docstring)."""
    return sorted(replies, key=lambda reply: reply.metadata.src_node_id)


class _OnlineGrid:
    """``grid`` as a round sees it under the time model's availability: its node ids
    are those online at ``now`` (``online(node_id)``); everything else is the grid's."""

    def __init__(self, grid: Grid, online: Callable[[int], bool]) -> None:
        self._grid = grid
        self._online = online

    def get_node_ids(self) -> list[int]:
        return [n for n in self._grid.get_node_ids() if self._online(n)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class SynchronousRun:
    """Runs a Flower strategy's rounds with the engine's budgets, clock and rows.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.FedAvg
        Flower's FedAvg or FedAvgM, or a time-budget anchor (a
        :class:`~flwr_gsgm.strategy.time_budget_fedavg.TimeBudgetFedAvg`), built with
        the sampling it should do (``fraction_train``).
    clock : flwr_gsgm.engine.clock.Clock
        The engine clock, its ``max_seconds`` the run's time budget (None: none).
    max_updates : int
        Client trainings: ``max_updates // per_round`` rounds (at least 1).
    per_round : int
        Nodes that train in a round (all the nodes, or ``max-in-flight`` of them).
    num_nodes : int
        Nodes of the run (partition-ids ``0 .. num_nodes - 1`` under the virtual clock).
    eval_every : int
        Client trainings between centralized evaluations: a row in every round whose
        trainings cross a multiple of it, and after the first and the last round.
    federated_eval_every : int
        The same for Flower's federated evaluation (0: none).
    seed : int
        Seeds the module-level ``random`` Flower samples a round's nodes with, so that
        a simulation samples the same nodes every time.
    timeout : float
        Seconds a round waits for its replies (``dispatch-timeout``).
    model_bytes : int
        Bytes of the model sent (the time model charges the reply the same).
    train_config : ConfigRecord
        Every train message's config (the client work, weights mode).

    The strategy's ``configure_train`` messages are sent as they are; under the
    virtual clock a time-budget anchor's messages also carry
    ``virtual-train-seconds``, the compute part of their duration (what a simulated
    device reports as ``train-seconds``, from which the anchor measures its speed).
    """

    def __init__(
        self,
        strategy: FedAvg,
        clock: Clock,
        *,
        max_updates: int,
        per_round: int,
        num_nodes: int,
        eval_every: int,
        federated_eval_every: int,
        seed: int,
        timeout: float,
        model_bytes: int,
        train_config: ConfigRecord,
    ) -> None:
        self.strategy = strategy
        self.train_config = train_config
        self.clock = clock
        self.per_round = per_round
        self.num_nodes = num_nodes
        self.rounds = max(1, max_updates // per_round)
        self.eval_every = eval_every
        self.federated_eval_every = federated_eval_every
        self.seed = seed
        self.timeout = timeout
        self.model_bytes = model_bytes
        self.model = clock.model if isinstance(clock, VirtualTime) else None
        # The time model's availability (None: every node always online); set by start.
        self.online = None
        # Under availability: client trainings received so far, and when the round ends.
        self.received = 0
        self.replied = 0  # train replies without error in the current round
        # Messages of the counted rounds whose node went offline before its reply
        # (lost_in_flight), or whose reply would come after the timeout; and the
        # current round's.
        self.lost = self.timed_out = 0
        self.round_lost = self.round_timed_out = 0
        self.round_work: list[tuple[int, int]] = []
        self.round_end: float | None = None
        self.speeds = clock.speed_factors(num_nodes)
        # The time model's steps of each partition's message in the current round, and
        # which node holds which partition (time-budget anchors under the virtual clock).
        self.sent_steps: dict[int, int] = {}
        self.partition_of: dict[int, int] = {}
        self.trained: list[int] = []  # partition-ids of the current round's train replies
        self.federated: dict[int, tuple[MetricRecord, int]] = {}
        self.evaluator: Evaluator | None = None  # set by start()
        # Stays empty: a synchronous round has no staleness, rejection or deferral, and
        # the rows read the same (zero) figures from it as the asynchronous runs' do.
        self.ledger = Ledger()

    def start(
        self,
        grid: Grid,
        initial: ArrayRecord,
        evaluate_fn: EvaluateFn | None,
    ) -> SynchronousReport:
        """Run the rounds on ``grid`` from ``initial`` and return the rows and counters;
        ``evaluate_fn(updates, arrays)`` is the centralized evaluation (``accuracy``,
        ``loss``). A diverged model ends the run at the row that shows it
        (:attr:`SynchronousReport.diverged`)."""
        evaluator = Evaluator(
            list(initial.keys()),
            evaluate_fn,
            self.rounds * self.per_round,
            virtual=self.clock.virtual,
        )
        self.evaluator = evaluator
        self.clock.start()
        timed_work = isinstance(self.strategy, TimeBudgetFedAvg)
        if isinstance(self.clock, VirtualTime):
            speeds = {p: self.speeds.get(p, 1.0) for p in range(self.num_nodes)}
            self.clock.start_fleet(speeds, self.train_config, self.model_bytes)
            if self.model is not None and self.model.availability != "always":
                self.online = self.clock.online
        if self.model is not None and (timed_work or self.online is not None):
            self.partition_of = partitions_of_nodes(grid, self.timeout)
        random.seed(self.seed)
        log(
            INFO,
            "[sync] %s: %d rounds of %d nodes",
            type(self.strategy).__name__,
            self.rounds,
            self.per_round,
        )

        arrays, applied = initial, 0
        diverged = self._row(0, initial)
        for server_round in range(1, self.rounds + 1):
            if diverged is not None or self.clock.out_of_time():
                break
            new_arrays = self._train(grid, server_round, arrays)
            if self.model is not None and not self._timed(server_round):
                break  # the round ended past the budget: its model does not count
            arrays, applied = new_arrays, server_round
            self._federated(grid, server_round, arrays)
            if server_round == self.rounds or self._crossed(server_round, self.eval_every):
                diverged = self._row(server_round, arrays)
        if diverged is not None:
            log(WARNING, "[sync] diverged at round %d; stopping: %s", applied, diverged)
        elif applied < self.rounds:
            log(
                INFO,
                "[sync] max-seconds=%s spent: no round after %d",
                self.clock.max_seconds,
                applied,
            )
            if evaluator.rows[-1]["version"] != applied:  # the last round's model, evaluated
                diverged = self._row(applied, arrays)
        rows = evaluator.rows
        for r in rows:  # the federated columns of the asynchronous runs
            if r["version"] in self.federated:
                metrics, nodes = self.federated[r["version"]]
                r["federated_nodes"] = nodes
                r.update({column_name(k): v for k, v in metrics.items() if not isinstance(v, list)})
        received = applied * self.per_round if self.online is None else self.received
        # Every reply of a counted round is averaged: applied = received.
        counters = {
            "updates_received": received,
            "updates_applied": received,
            "steps_applied": applied,
            "lost_in_flight": self.lost,
            "dispatch_timeouts": self.timed_out,
        }
        if diverged is not None:
            counters["diverged"] = 1
        return SynchronousReport(rows, counters, applied, diverged)

    def _row(self, version: int, arrays: ArrayRecord) -> str | None:
        """The evaluation row of the model after ``version`` rounds (``arrays``), at the
        clock's now; why the model diverged, None if it did not."""
        model = RoundModel(version, arrays.to_numpy_ndarrays())
        updates = version * self.per_round if self.online is None else self.received
        reason = self.evaluator.evaluate(
            updates, model, self.ledger, self.clock.now(), self.clock.wall()
        )
        joules = self.clock.joules()
        if joules is not None:  # the fleet's energy so far (a device-power model)
            self.evaluator.rows[-1]["joules"] = round(joules, 3)
        return reason

    def _crossed(self, server_round: int, every: int) -> bool:
        """The round's client trainings cross a multiple of ``every``."""
        n = self.per_round
        return (server_round * n) // every != ((server_round - 1) * n) // every

    def _train(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """One training round: the strategy's messages (``train_config``), sent; its
        aggregate of the replies (``arrays`` unchanged if it has none)."""
        config = self.train_config
        if self.online is not None:
            grid = self._online_grid(grid)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._stamp(server_round, messages)
        if self.online is not None:
            messages = self._answered(server_round, messages)
        replies = _in_node_order(grid.send_and_receive(messages, timeout=self.timeout))
        self.trained = sorted(
            int(r.content["metrics"]["partition-id"])
            for r in replies
            if not r.has_error()
            and "metrics" in r.content
            and "partition-id" in r.content["metrics"]
        )
        self.replied = sum(not r.has_error() for r in replies)
        aggregated, metrics = self.strategy.aggregate_train(server_round, replies)
        if metrics is not None:
            log(INFO, "[sync] round %d train metrics: %s", server_round, metrics)
        return arrays if aggregated is None else aggregated

    def _online_grid(self, grid: Grid) -> Grid:
        """``grid`` with only the nodes online now; first, with fewer online than the
        strategy needs (``min_available_nodes``, ``min_train_nodes``), the clock moves
        to the first time enough are (Flower's sampling waits for them).

        Raises
        ------
        RuntimeError
            If that many nodes are never online again.
        """
        assert self.online is not None
        online, partition_of = self.online, self.partition_of
        need = max(
            1,
            int(getattr(self.strategy, "min_available_nodes", 1)),
            int(getattr(self.strategy, "min_train_nodes", 1)),
        )
        pids = sorted(partition_of.values())
        t = self.clock.now()
        while sum(online.online(p, t) for p in pids) < need:
            t = min(online.online_from(p, t + 1e-9) for p in pids if not online.online(p, t))
            if math.isinf(t):
                raise RuntimeError(
                    f"fewer than {need} nodes are online for the rest of the run (the time "
                    "model's availability): the synchronous run cannot sample a round"
                )
        self.clock.jump_to(t)
        return _OnlineGrid(  # type: ignore[return-value]
            grid, lambda node_id: online.online(partition_of.get(node_id, -1), t)
        )

    def _answered(self, server_round: int, messages: list[Message]) -> list[Message]:
        """Under availability: the round's messages whose reply reaches the server by
        the timeout; sets when the round ends (:attr:`round_end`): when every message
        is answered (a reply, or the node-unavailable error of a node that went
        offline, ``offline-detection-seconds`` after it went) or at the timeout,
        whichever is first. The replies are served one at a time as
        :meth:`VirtualClock.serve` says."""
        assert self.model is not None and self.online is not None
        now = self.clock.now()
        deadline = now + self.timeout
        kept, finishes, errors = [], [], []
        self.round_lost = self.round_timed_out = 0
        self.round_work = []  # (partition, steps) of each message: its energy
        for message in messages:
            p = self.partition_of[message.metadata.dst_node_id]
            steps = self.sent_steps.get(p)
            if steps is None:
                steps = self._steps(p, message.content["config"])
            self.round_work.append((p, steps))
            seconds = self.model.duration(
                self.speeds[p], p, server_round - 1, steps, self.model_bytes
            )
            lost = self.online.loss(p, now, now + seconds)
            if lost is not None:
                errors.append(lost[0] + self.model.offline_detection_seconds)
                self.round_lost += 1
            elif now + seconds <= deadline:
                kept.append(message)
                finishes.append(now + seconds)
            else:
                errors.append(math.inf)  # no reply by the timeout
                self.round_timed_out += 1
        end = max([self.model.serve(now, finishes), *errors])
        self.round_end = min(end, deadline)
        if len(kept) < len(messages):
            log(
                INFO,
                "[sync] round %d: %d of %d replies by %.1f s (offline or past the timeout of %g s)",
                server_round,
                len(kept),
                len(messages),
                self.round_end,
                self.timeout,
            )
        return kept

    def _federated(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> None:
        """Flower's federated evaluation of ``arrays`` in a round that crosses a multiple
        of ``federated_eval_every``: the strategy's messages and its aggregate, kept
        with the count of replies without error for the round's row."""
        every = self.federated_eval_every
        if not every or not self._crossed(server_round, every):
            return
        messages = self.strategy.configure_evaluate(server_round, arrays, ConfigRecord(), grid)
        replies = _in_node_order(grid.send_and_receive(messages, timeout=self.timeout))
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if metrics is not None:
            log(INFO, "[sync] round %d federated evaluation: %s", server_round, metrics)
            self.federated[server_round] = (metrics, sum(not r.has_error() for r in replies))

    def _steps(self, partition_id: int, config: ConfigRecord) -> int:
        """Steps of local work ``config`` asks of ``partition_id`` (the time model's)."""
        assert isinstance(self.clock, VirtualTime)
        return self.clock.work_steps(partition_id, config)

    def _stamp(self, server_round: int, messages: list[Message]) -> None:
        """Each train message's steps; a time-budget anchor's messages also get the
        compute seconds of their node's draw ``round - 1`` as ``virtual-train-seconds``."""
        self.sent_steps = {}
        if self.model is None or not self.partition_of:
            return
        for message in messages:
            p = self.partition_of.get(message.metadata.dst_node_id)
            if p is None or p not in self.speeds:
                continue  # not known to the clock: timed as the run's own work
            config = message.content["config"]
            self.sent_steps[p] = self._steps(p, config)
            config["virtual-train-seconds"] = self.model.compute_seconds(
                self.speeds[p], p, server_round - 1, self.sent_steps[p]
            )

    def _timed(self, server_round: int) -> bool:
        """Move the virtual clock to the end of the round: when the server has handled
        the trained nodes' replies (:meth:`VirtualClock.serve`; with no server cost,
        the slowest node's duration), each timed for the steps its message asked
        (``train_config``'s, the run's own work, where it was not stamped). False, and
        the clock left where it was, if that end is past the budget."""
        assert self.model is not None
        if self.online is not None:  # the round's end was set with its losses
            assert self.round_end is not None
            if self.clock.past_budget(self.round_end):
                return False
            self.clock.jump_to(self.round_end)
            self.received += self.replied
            self.lost += self.round_lost
            self.timed_out += self.round_timed_out
            for p, steps in self.round_work:
                self._charge(p, server_round, steps)
            return True
        trained = self.trained if self.per_round < self.num_nodes else range(self.num_nodes)
        seconds = [
            self.model.duration(
                self.speeds[p],
                p,
                server_round - 1,
                self.sent_steps[p] if p in self.sent_steps else self._steps(p, self.train_config),
                self.model_bytes,
            )
            for p in trained
            if p in self.speeds
        ]
        now = self.clock.now()
        # The round ends when the server has handled its last reply (VirtualClock.serve).
        end = self.model.serve(now, [now + s for s in seconds])
        if self.clock.past_budget(end):
            return False
        self.clock.jump_to(end)
        for p in trained:
            if p in self.speeds:
                steps = self.sent_steps.get(p)
                self._charge(p, server_round, steps or self._steps(p, self.train_config))
        return True

    def _charge(self, p: int, server_round: int, steps: int) -> None:
        """The energy of partition ``p``'s message of ``steps`` steps in ``server_round``
        (its compute and communication draws), with a device-power model."""
        assert self.model is not None and isinstance(self.clock, VirtualTime)
        if self.model.power is None:
            return
        compute = self.model.compute_seconds(self.speeds[p], p, server_round - 1, steps)
        communication = self.model.communication_seconds(p, server_round - 1, self.model_bytes)
        self.clock.charge(compute, communication)
