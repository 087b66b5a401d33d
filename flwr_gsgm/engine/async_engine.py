"""The asynchronous engine: a push/pull loop over a Flower ``Grid`` with no round barrier.

The loop (:meth:`AsyncEngine.run`) ties together, each in its own module:

- membership (:mod:`flwr_gsgm.nodes.membership`): who is in the federation (discovery,
  joins, losses, refusals), keyed on the ``partition-id`` nodes report; node events
  (:mod:`flwr_gsgm.nodes.events`) carry each join, failure (back-off, exclusion),
  loss and rejection to the optimizer, the ledger and the dispatcher; how a run
  ends (:mod:`flwr_gsgm.engine.run_end`): "failed" when no node is left to train;
- what is in flight (:mod:`flwr_gsgm.engine.in_flight`): train dispatches and queries,
  replies, deadlines; and which idle node gets a freed slot
  (:mod:`flwr_gsgm.engine.dispatch_policy`);
- reply intake (:mod:`flwr_gsgm.intake.reply`, :mod:`flwr_gsgm.intake.norm_bound`);
- the books (:mod:`flwr_gsgm.engine.ledger`, :mod:`flwr_gsgm.nodes.stats`), evaluation
  (:mod:`flwr_gsgm.evaluation.central`),
  checkpoints (:mod:`flwr_gsgm.engine.state`, :mod:`flwr_gsgm.checkpoint.files`) and the
  final report (:mod:`flwr_gsgm.engine.report`);

and hands every update to a framework-free server optimizer (``flwr_gsgm.core``),
which decides its outcome and staleness (``docs/ARCHITECTURE.md``, layer 2).

Per reply: intake -> ``optimizer.on_update`` -> record -> send work to idle nodes
-> maybe evaluate / checkpoint. With ``max_in_flight`` at most that many nodes
train at once and a :class:`~flwr_gsgm.engine.dispatch_policy.DispatchPolicy` picks the next
idle node when a slot frees; without it every active node is kept busy.

With a :class:`~flwr_gsgm.simulation.virtual_clock.VirtualClock` (simulation), each dispatch
gets a virtual finish time when it is sent and replies are applied in that order,
so the run is reproducible whatever the machine's load. Without one (deployment),
replies are applied in arrival order and the clock is wall time since the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.core import Outcome, ServerOptimizer, UpdateRejected
from flwr_gsgm.engine import state as engine_state
from flwr_gsgm.engine.dispatcher import Dispatcher
from flwr_gsgm.engine.in_flight import Dispatch, InFlight
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.engine.memory import MemoryEstimate, available_memory, size_text
from flwr_gsgm.engine.report import EngineReport, build_report
from flwr_gsgm.engine.run_end import RunEnd, RunFailed
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.evaluation.central import EvaluateFn, Evaluator, wall_since
from flwr_gsgm.evaluation.federated import FederatedEvaluator
from flwr_gsgm.intake.norm_bound import RelativeNormBound, initial_scale
from flwr_gsgm.intake.reply import ReplyIntake
from flwr_gsgm.model.layout import ModelLayout
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.nodes import events as node_events
from flwr_gsgm.nodes.membership import Membership, Node
from flwr_gsgm.nodes.stats import NodeStats
from flwr_gsgm.strategy.hooks import OnEvaluate, TrainConfigFn

__all__ = ["EngineSettings", "AsyncEngine", "EngineReport", "EvaluateFn", "OptimizerFactory"]

OptimizerFactory = Callable[[list[np.ndarray], list[int]], ServerOptimizer]


def _log_resolved_choices(rule: ServerOptimizer) -> None:
    """Log what each ``"auto"`` parameter of the rule resolved to (GSGM's averaging)."""
    for key, value in rule.resolved_choices().items():
        log(INFO, "[async] %s: %s = auto -> %r", rule.name, key, value)


class AsyncEngine:
    """One asynchronous training run over a Flower ``Grid``.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The grid to push train/query messages to and pull replies from.
    initial_arrays : ArrayRecord
        Initial global model (e.g. ``ArrayRecord(model.state_dict())``): its keys,
        in order, are the model's; trainable arrays must be float32, buffers may have
        any dtype (a 0-d int64 ``num_batches_tracked`` is kept as is).
    optimizer_factory : callable
        ``(weights: list[np.ndarray float32], partition_ids: list[int]) -> ServerOptimizer``,
        called once the nodes are known with the trainable arrays only.
    train_config : ConfigRecord
        Sent in every train message; the engine adds ``model-version``, ``seed`` and,
        under the virtual clock, ``virtual-duration``.
    settings : EngineSettings
    evaluate_fn : callable, optional
        ``(updates_received: int, arrays: ArrayRecord) -> MetricRecord | None`` with
        keys ``accuracy`` and ``loss``; called at 0, every ``eval_every`` updates and
        at the end.
    trainable_keys : iterable of str, optional
        The arrays the server rule trains (:mod:`flwr_gsgm.model.layout`); default:
        the floating arrays whose names do not look like buffers. The others are
        buffers (:mod:`flwr_gsgm.model.buffers`).
    train_config_fn : callable, optional
        ``(node_id, model_version, updates_received) -> ConfigRecord`` merged over
        ``train_config`` for each train message (:mod:`flwr_gsgm.strategy.hooks`).
    on_evaluate : callable, optional
        ``(updates, arrays, metrics) -> None`` after each evaluation row.

    Raises
    ------
    ValueError
        If a trainable array is not float32, none is, or ``trainable_keys`` names a
        key the model does not have.
    RuntimeError
        If fewer than ``min_nodes`` nodes answer the start-up query within
        ``startup_timeout``.
    """

    def __init__(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        optimizer_factory: OptimizerFactory,
        train_config: ConfigRecord,
        settings: EngineSettings,
        evaluate_fn: EvaluateFn | None = None,
        trainable_keys: Iterable[str] | None = None,
        train_config_fn: TrainConfigFn | None = None,
        on_evaluate: OnEvaluate | None = None,
    ) -> None:
        self.layout, self.initial = ModelLayout.from_record(initial_arrays, trainable_keys)
        self.keys = self.layout.keys
        self.make_optimizer = optimizer_factory
        self.settings = settings
        self.optimizer: ModelOptimizer | None = None
        self.ledger = Ledger()
        self.in_flight = InFlight(
            grid,
            self.keys,
            settings.message_ttl,
            settings.virtual_clock is not None,
            on_replay=self._on_replay,
            query_ttl=settings.startup_timeout,
        )
        self.members = Membership(grid, self.in_flight, settings, self.ledger)
        self.stats = NodeStats()
        self.end = RunEnd(settings, self.members)
        scale = initial_scale(self.layout.trainable_of(self.initial))
        self.norm_bound = RelativeNormBound(settings.max_norm_ratio, scale)
        self.intake = ReplyIntake(self.layout, lambda pid: self.members.nodes[pid].identified)
        self.evaluator = Evaluator(self.keys, evaluate_fn, settings.max_updates, on_evaluate)
        self.federated = FederatedEvaluator(grid, self.keys, settings, self.ledger)
        self.dispatcher = Dispatcher(
            settings, train_config, self.members, self.in_flight, train_config_fn
        )
        self.policy = self.dispatcher.policy
        self.rows: list[dict[str, float]] = []
        self.received = 0
        self.budget_spent = False  # the time budget (virtual clock) ended the run
        self.stop_requested = False
        # The engine clock (s): virtual seconds under the virtual clock, else wall
        # seconds since the start (deployment); the core's ``now`` and virtual_time.
        self.clock_now = 0.0
        self.t0 = time.monotonic()
        # The expected peak memory (logged at start) and the memory available then.
        self.memory: MemoryEstimate | None = None
        self.available: tuple[int, str] | None = None
        self.aborted = False  # out of memory, or a checkpoint could not be written

    # ------------------------------------------------------------------ the loop
    def run(self) -> EngineReport:
        """Train until a budget is spent, no node is left or the model diverged.

        A run with no node left ends with ``status`` "failed", one whose model diverged
        with "diverged", and the reason (:mod:`flwr_gsgm.engine.run_end`); the strategy raises.

        Raises
        ------
        RuntimeError
            If fewer than ``min_nodes`` nodes answer the start-up query in time.
        SystemExit
            On SIGTERM with checkpoints on, once the checkpoint is saved.
        flwr_gsgm.engine.run_end.RunFailed
            If the server runs out of memory while its rule is built (no report yet).
            Later, running out of memory or a checkpoint that cannot be written ends
            the run "failed" with the reason (the expected peak memory; the file and
            the OS error) and the report so far.
        """
        self.t0 = time.monotonic()
        saved = engine_state.load_for_resume(self)  # fails before any message
        try:
            self._start(saved)
            with checkpoint.on_sigterm(
                self.settings.checkpoint_every, lambda: setattr(self, "stop_requested", True)
            ):
                while not self._finished():
                    self.in_flight.pull()
                    self.federated.poll(self.rows)
                    progressed = self._apply_ready()
                    node_events.check_deadlines(self)
                    node_events.register_joins(self)
                    self._stop_if_requested()
                    if not progressed:
                        node_events.idle(self)
        except MemoryError as err:
            self._abort(self._out_of_memory(err), err)
        except checkpoint.CheckpointWriteError as err:
            self._abort(f"{err} (at {self.received} updates)", err)
        if not self.aborted:  # an aborted run reports what it has, without more work
            self._final_evaluation()
            self.federated.finish(self.rows, self.settings.poll_interval)
        return build_report(self)

    def _abort(self, reason: str, err: BaseException) -> None:
        """The run cannot go on: it fails with ``reason``; without an optimizer yet
        (its construction failed) there is no report, so :class:`RunFailed` now."""
        self.aborted = True
        self.end.fail(reason)
        if self.optimizer is None:
            raise RunFailed(reason) from err

    def _out_of_memory(self, err: MemoryError) -> str:
        """The reason of a run that ran out of memory: where, and the estimate."""
        detail = f": {err}" if str(err) else ""
        where = f"after {self.received} of {self.settings.max_updates} updates"
        if self.memory is None:
            return (
                f"out of memory (MemoryError{detail}) {where}, while the server rule was "
                "built (before the peak memory was estimated: the model alone is too large)"
            )
        return (
            f"out of memory (MemoryError{detail}) {where}; the expected peak server memory "
            f"is {self.memory.describe()}, the memory available at start "
            f"{self._available_text()}: {self.memory.advice()}"
        )

    def _available_text(self) -> str:
        if self.available is None:
            return "unknown"
        return f"{size_text(self.available[0])} ({self.available[1]})"

    def _estimate_memory(self, pids: list[int], model_bytes: int) -> None:
        """Log the expected peak memory; warn (and keep it for summary.json) when it
        exceeds the memory available. Reads only what each part says of itself."""
        assert self.optimizer is not None
        rule = self.optimizer.rule
        self.memory = MemoryEstimate(
            rule=rule.name or type(rule).__name__,
            averaging=getattr(rule, "averaging_in_use", None),
            nodes=len(pids),
            rule_copies=rule.model_copies(len(pids)),
            trainable_bytes=int(rule.flat_weights.nbytes),
            model_bytes=model_bytes,
            in_flight=self.dispatcher.messages_in_flight(len(pids)),
            copies_per_message=self.dispatcher.copies_per_message(),
        )
        self.available = available_memory()
        log(
            INFO,
            "[async] expected peak server memory %s; memory available %s",
            self.memory.describe(),
            self._available_text(),
        )
        if self.available is not None and self.memory.total_bytes > self.available[0]:
            self.stats.warn(
                f"the expected peak server memory {self.memory.describe()} exceeds the memory "
                f"available {self._available_text()}: {self.memory.advice()}"
            )

    def _start(self, saved: dict[str, Any] | None) -> None:
        """Discover the nodes, build the optimizer, then resume or send the first work."""
        pids = self.members.discover(self.lose)
        model_bytes = sum(int(a.nbytes) for a in self.initial)
        self.optimizer = ModelOptimizer(self.layout, self.initial, self.make_optimizer, pids)
        self.initial = []  # the optimizer holds its own copy: no model copy kept here
        self._estimate_memory(pids, model_bytes)
        self.members.start(pids)
        self.dispatcher.describe()
        if saved is not None:
            engine_state.restore_state(self, saved)  # an "auto" choice comes from the state
            _log_resolved_choices(self.optimizer.rule)
            self.top_up()
            return
        _log_resolved_choices(self.optimizer.rule)
        self._evaluate()
        self.dispatcher.start(self.optimizer, self.received, self.clock_now)

    def _finished(self) -> bool:
        if self.end.diverged or self.received >= self.settings.max_updates or self.end.failed:
            return True
        if self.settings.virtual_clock is None and self.settings.beyond_time_budget(
            wall_since(self.t0)
        ):
            return True
        if self.in_flight:
            return False
        if self.budget_spent or not self.dispatcher.may_dispatch(self.received, self.clock_now):
            return True  # the time budget is spent
        return self.end.nothing_in_flight(self.received)

    def _final_evaluation(self) -> None:
        """Evaluate the final weights unless the last row already did (or they diverged)."""
        if not self.end.diverged and (not self.rows or self.rows[-1]["updates"] != self.received):
            self._evaluate()

    def _stop_if_requested(self) -> None:
        if self.stop_requested:
            engine_state.save_checkpoint(self)
            raise SystemExit(f"SIGTERM: checkpoint saved at {self.received} updates")

    def top_up(self) -> None:
        """Fill the slots that may have freed (:meth:`Dispatcher.top_up`)."""
        assert self.optimizer is not None
        self.dispatcher.top_up(self.optimizer, self.received, self.clock_now)

    def lose(self, pid: int, why: str, may_return: bool = False) -> None:
        """Partition ``pid`` leaves (:func:`flwr_gsgm.nodes.events.lose`)."""
        node_events.lose(self, pid, why, may_return)

    # ------------------------------------------------------------------- replies
    def _apply_ready(self) -> bool:
        """Handle every reply that is due; return True if any was."""
        progressed = False
        while not self._finished():
            dispatch = self.in_flight.next_ready()
            if dispatch is None:
                break
            if self.settings.virtual_clock is not None and self.settings.beyond_time_budget(
                dispatch.v_finish
            ):
                self.in_flight.clear()  # time budget spent: in-flight work is not applied
                self.budget_spent = True
                break
            self._handle(dispatch)
            progressed = True
        return progressed

    def _handle(self, dispatch: Dispatch) -> None:
        reply = self.in_flight.finish(dispatch)
        self.clock_now = (
            max(self.clock_now, dispatch.v_finish)
            if self.settings.virtual_clock is not None
            else wall_since(self.t0)
        )
        node = self.members.nodes[dispatch.partition_id]
        self.policy.on_reply(node.partition_id, self.clock_now, counted=not reply.has_error())
        if reply.has_error():
            node_events.on_error_reply(self, node, reply)
            node_events.on_virtual_time(self)
            return
        node.failures = 0
        self.received += 1
        self._on_update(node, dispatch, reply)
        self.top_up()
        node_events.on_virtual_time(self)  # back-offs over by now, after the update
        if self.received % self.settings.eval_every == 0:
            self._evaluate()
        if not self.end.diverged:  # federated evaluation at its points, beside training
            self.federated.maybe_send(self.received, self.optimizer, self.members.nodes)
        if self.settings.checkpoint_every and self.received % self.settings.checkpoint_every == 0:
            engine_state.save_checkpoint(self)

    def _on_update(self, node: Node, dispatch: Dispatch, reply: Message) -> None:
        """Intake, then the optimizer, then the ledger (a rejection: a node event)."""
        assert self.optimizer is not None
        pid = node.partition_id
        try:
            update = self.intake.unpack(dispatch, reply)
            norm = self.norm_bound.check(pid, update.trainable)
            outcome = self.optimizer.on_update(
                pid, update, dispatch.base_version, now=self.clock_now
            )
        except UpdateRejected as err:  # intake's ReplyRejected, the norm bound's, the rule's
            node_events.on_rejected(self, node, err)
            node_events.record_outcome(self, pid, None)
            return
        self.norm_bound.accept(pid, norm)
        node_events.record_outcome(self, pid, outcome)
        node.rejections_in_row = 0
        staleness = self.optimizer.last_staleness
        assert staleness is not None  # set by every valid update
        self.ledger.record_update(staleness, self.intake.train_loss(reply))
        if outcome is Outcome.STALE:
            log(
                INFO,
                "[async] dropped stale update from partition %d (staleness %d)",
                pid,
                staleness,
            )

    def _on_replay(self, mid: str, why: str) -> None:
        """A replayed reply (not an answer to a dispatch in flight): counted, ignored."""
        self.ledger.record_rejection("duplicate")
        log(WARNING, "[async] ignored a replayed reply (duplicate): %s", why)

    # ------------------------------------------------ evaluation and checkpoints
    def _evaluate(self) -> None:
        assert self.optimizer is not None
        row, diverged = self.evaluator.row(
            self.received, self.optimizer, self.ledger, self.clock_now, wall_since(self.t0)
        )
        self.rows.append(row)
        self.end.diverge(diverged, self.received)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run bit-identically (:mod:`engine_state`)."""
        return engine_state.save_state(self)
