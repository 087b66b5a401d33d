"""The asynchronous engine: a push/pull loop over a Flower ``Grid`` with no round barrier.

:meth:`AsyncEngine.run` reads as Flower's ``Strategy.start``: set up (discover the
nodes, build the optimizer, resume or send the first work), a loop of named steps,
and the teardown (the final evaluation and the report). Each turn of the loop:

1. pull the replies that are here (train, query and evaluate messages);
2. apply every reply that is due (under the virtual clock in virtual-finish order,
   else in arrival order): intake -> ``optimizer.on_update`` -> the books -> send
   work to the freed slot -> maybe evaluate / checkpoint;
3. fail the nodes whose reply is overdue, end the back-offs that are over;
4. register the nodes that joined;
5. on SIGTERM, save a checkpoint and stop;
6. with nothing applied, wait for a reply (or jump the virtual clock to a back-off's end).

The engine owns its parts, each in its own module, each holding its own state
(:meth:`AsyncEngine.state_dict` composes theirs):

- the clock (:mod:`flwr_gsgm.engine.clock`): virtual or wall seconds, and what the
  time budget means;
- membership (:mod:`flwr_gsgm.engine.membership`): who is in the federation and each
  node's state and transitions (joins, back-offs, losses, exclusions, rejoins),
  told to the optimizer, the norm bound and the dispatcher through a
  :class:`~flwr_gsgm.engine.membership.NodeListener`;
- what is in flight (:mod:`flwr_gsgm.engine.in_flight`) and the dispatcher
  (:mod:`flwr_gsgm.engine.dispatcher`, :mod:`flwr_gsgm.engine.dispatch_policy`);
- reply intake (:mod:`flwr_gsgm.intake.reply`, :mod:`flwr_gsgm.intake.norm_bound`) and
  the model optimizer (:mod:`flwr_gsgm.model.optimizer`), which hands every update
  to a framework-free server rule (``flwr_gsgm.core``) that decides its outcome and
  staleness (``docs/ARCHITECTURE.md``, layer 2);
- the books (:mod:`flwr_gsgm.engine.ledger`, :mod:`flwr_gsgm.nodes.stats`), evaluation
  (:mod:`flwr_gsgm.engine.central_evaluation`,
  :mod:`flwr_gsgm.engine.federated_evaluation`), how the run ends
  (:mod:`flwr_gsgm.engine.run_end`), checkpoints
  (:mod:`flwr_gsgm.engine.checkpoint_state`, :mod:`flwr_gsgm.checkpoint.files`) with the
  reply log beside them (:mod:`flwr_gsgm.engine.reply_log`) and the report
  (:mod:`flwr_gsgm.engine.report`).

With ``max_in_flight`` at most that many nodes train at once and a
:class:`~flwr_gsgm.engine.dispatch_policy.DispatchPolicy` picks the next idle node
when a slot frees; without it every active node is kept busy.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.checkpoint.resume import ResumeRefused
from flwr_gsgm.core import Outcome, UpdateRejected
from flwr_gsgm.engine import checkpoint_state as engine_state
from flwr_gsgm.engine.central_evaluation import EvaluateFn, Evaluator
from flwr_gsgm.engine.clock import make_clock
from flwr_gsgm.engine.dispatcher import Dispatcher
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluator
from flwr_gsgm.engine.hooks import OnEvaluate, OnFederatedEvaluate, TrainConfigFn
from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.engine.membership import Membership, Node, NodeListener
from flwr_gsgm.engine.memory import MemoryEstimate, PeakMemory
from flwr_gsgm.engine.reply_log import FILE_NAME as REPLY_LOG
from flwr_gsgm.engine.reply_log import ReplyLog, ReplyLogWriteError
from flwr_gsgm.engine.report import EngineReport
from flwr_gsgm.engine.run_end import RunEnd, RunFailed
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.intake.dispatch import Dispatch
from flwr_gsgm.intake.norm_bound import RelativeNormBound, initial_scale
from flwr_gsgm.intake.reply import ReplyIntake
from flwr_gsgm.model.layout import ModelLayout
from flwr_gsgm.model.optimizer import ModelOptimizer, RuleFactory
from flwr_gsgm.nodes.stats import NodeStats
from flwr_gsgm.scheduling.compass import CompassScheduler

__all__ = ["EngineSettings", "AsyncEngine", "EngineReport", "EvaluateFn", "OptimizerFactory"]

#: The rule factory the engine calls once the nodes are known:
#: :data:`flwr_gsgm.model.optimizer.RuleFactory` (``(weights, partition_ids,
#: concurrency) -> ServerOptimizer``), e.g. a :class:`~flwr_gsgm.model.optimizer.RuleSpec`.
OptimizerFactory = RuleFactory


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
        ``(weights: list[np.ndarray float32], partition_ids: list[int], concurrency:
        int | None) -> ServerOptimizer`` (:data:`OptimizerFactory`, e.g. a
        :class:`~flwr_gsgm.model.optimizer.RuleSpec`), called once the nodes are known
        with the trainable arrays only and the engine's ``max_in_flight`` (None: every
        node in flight).
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
        ``train_config`` for each train message (:mod:`flwr_gsgm.engine.hooks`).
    on_evaluate : callable, optional
        ``(updates, arrays, metrics) -> None`` after each evaluation row.
    on_federated_evaluate : callable, optional
        ``(updates, metrics) -> None`` when a federated evaluation's aggregate arrives
        (:class:`~flwr_gsgm.engine.federated_evaluation.FederatedEvaluator`).

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
        on_federated_evaluate: OnFederatedEvaluate | None = None,
    ) -> None:
        self.layout, self.initial = ModelLayout.from_record(initial_arrays, trainable_keys)
        self.keys = self.layout.keys
        self.make_optimizer = optimizer_factory
        self.settings = settings
        self.optimizer: ModelOptimizer | None = None  # built once the nodes are known
        self.clock = make_clock(settings)
        self.ledger = Ledger()
        self.stats = NodeStats()
        self.in_flight = InFlight(
            grid,
            self.keys,
            settings.message_ttl,
            self.clock.virtual,
            on_replay=self._on_replay,
            query_ttl=settings.startup_timeout,
        )
        self.members = Membership(
            grid, self.in_flight, settings, self.ledger, self.stats, self.clock
        )
        self.end = RunEnd(settings.max_updates, settings.rejoin_timeout, self.members)
        scale = initial_scale(self.layout.trainable_of(self.initial))
        self.norm_bound = RelativeNormBound(settings.max_norm_ratio, scale)
        self.intake = ReplyIntake(self.layout, lambda pid: self.members.nodes[pid].identified)
        self.evaluator = Evaluator(
            self.keys, evaluate_fn, settings.max_updates, on_evaluate, self.clock.virtual
        )
        self.federated = FederatedEvaluator(
            grid, self.keys, settings, self.ledger, on_federated_evaluate
        )
        self.dispatcher = Dispatcher(
            settings, train_config, self.members, self.in_flight, self.clock, train_config_fn
        )
        self.policy = self.dispatcher.policy
        self.memory = PeakMemory()
        # Beside the checkpoint: what became of every reply across resumes.
        path = settings.checkpoint_path
        resumable = path is not None and (settings.checkpoint_every or settings.resume)
        self.replies = ReplyLog(path.with_name(REPLY_LOG) if resumable else None)
        self.received = 0  # client updates received (the update budget counts them)
        self.budget_spent = False  # the time budget ended the run (a reply past it)
        self.stop_requested = False  # SIGTERM with checkpoints on
        self.aborted = False  # out of memory, or a checkpoint could not be written

    # ------------------------------------------------------------------ the run
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
        flwr_gsgm.checkpoint.files.CheckpointError, flwr_gsgm.checkpoint.resume.ResumeRefused
            On resume: no checkpoint, a damaged one, or one this run cannot continue
            (before any message is sent when the run config tells).
        flwr_gsgm.engine.run_end.RunFailed
            If the server runs out of memory while its rule is built (no report yet).
            Later, running out of memory, or a checkpoint or the reply log that
            cannot be written, ends the run "failed" with the reason (the expected
            peak memory; the file and the OS error) and the report so far.
        """
        self.clock.start()
        saved = self._checkpoint_to_resume()  # fails before any message
        try:
            self._setup(saved)
            with checkpoint.on_sigterm(self.settings.checkpoint_every, self._request_stop):
                while not self._finished():
                    self.in_flight.pull()
                    self.federated.poll(self.evaluator.rows)
                    progressed = self._apply_ready()
                    self.members.check_deadlines()
                    self.members.register_joins()
                    self._stop_if_requested()
                    if not progressed:
                        self._idle()
        except MemoryError as err:
            self._abort(
                self.memory.out_of_memory(err, self.received, self.settings.max_updates), err
            )
        except (checkpoint.CheckpointWriteError, ReplyLogWriteError) as err:
            self._abort(f"{err} (at {self.received} updates)", err)
        finally:
            self.replies.close()
        return self._teardown()

    # ------------------------------------------------------------------ set-up
    def _checkpoint_to_resume(self) -> dict[str, Any] | None:
        """The verified checkpoint to resume from (None without ``resume``), checked
        against the run's settings
        (:func:`flwr_gsgm.engine.checkpoint_state.check_before_start`)."""
        path, resume = self.settings.checkpoint_path, self.settings.resume
        saved = checkpoint.load_for_resume(path, resume)
        if saved is not None:
            engine_state.check_before_start(self.settings, saved, self.dispatcher.train_config)
        return saved

    def _setup(self, saved: dict[str, Any] | None) -> None:
        """Discover the nodes, build the optimizer, then resume or send the first work."""
        pids = self.members.discover()
        model_bytes = sum(int(a.nbytes) for a in self.initial)
        self.optimizer = ModelOptimizer(
            self.layout, self.initial, self.make_optimizer, pids, self.settings.max_in_flight
        )
        self.initial = []  # the optimizer holds its own copy: no model copy kept here
        self._rule_work_scheduler()
        self._estimate_memory(pids, model_bytes)
        speeds = {pid: self.members.nodes[pid].speed for pid in pids}
        self.clock.start_fleet(speeds, self.dispatcher.train_config, model_bytes)
        self.members.start(pids, self._node_listener())
        self.dispatcher.describe()
        if saved is not None:
            self.load_state_dict(saved)  # an "auto" choice comes from the state
            self.replies.open(resumed_at=self.received)
            self._log_resolved_choices()
            self.top_up()
            return
        self._log_resolved_choices()
        self.replies.open(resumed_at=None)
        self._evaluate()
        self.dispatcher.start(self.optimizer, self.received)

    def _rule_work_scheduler(self) -> None:
        """A rule that schedules its nodes' work itself (``WORK_SCHEDULER``: FedCompass's
        "compass") gets its scheduler in the dispatcher, in place of work-scheduling's;
        the engine hands the state they share (the arrival groups) to both.

        Raises
        ------
        ValueError
            If the rule names a work scheduler this engine does not have.
        """
        assert self.optimizer is not None
        rule = self.optimizer.rule
        if rule.WORK_SCHEDULER is None:
            return
        if rule.WORK_SCHEDULER not in CompassScheduler.POLICIES:
            raise ValueError(
                f"rule {rule.name!r} asks for work scheduler {rule.WORK_SCHEDULER!r}; "
                f"expected one of {CompassScheduler.POLICIES}"
            )
        if self.settings.work_scheduling != "off":
            log(
                WARNING,
                "[async] work-scheduling = %r is replaced by %s's own scheduler (%s)",
                self.settings.work_scheduling,
                rule.name,
                rule.WORK_SCHEDULER,
            )
        work = CompassScheduler(**rule.schedule_params())
        work.name = self.members.name  # its reasons name nodes as the log does
        rule.share_schedule(work.book)
        self.dispatcher.work = work

    def _node_listener(self) -> NodeListener:
        """Who hears of a node's transitions: the optimizer (joined, left), the norm
        bound (it forgets a node that left the federation) and the dispatcher."""
        assert self.optimizer is not None
        return NodeListener(
            joined=self.optimizer.on_node_joined,
            left=self.optimizer.on_node_lost,
            forget=self.norm_bound.forget,
            freed=self.top_up,
        )

    def _estimate_memory(self, pids: list[int], model_bytes: int) -> None:
        """Log the expected peak memory; warn (and keep it for summary.json) when it
        exceeds the memory available. Reads only what each part says of itself."""
        assert self.optimizer is not None
        rule = self.optimizer.rule
        estimate = MemoryEstimate(
            rule=rule.name or type(rule).__name__,
            averaging=getattr(rule, "averaging_in_use", None),
            nodes=len(pids),
            rule_copies=rule.model_copies(len(pids)),
            trainable_bytes=int(rule.flat_weights.nbytes),
            model_bytes=model_bytes,
            in_flight=self.dispatcher.messages_in_flight(len(pids)),
            copies_per_message=self.dispatcher.copies_per_message(),
        )
        warning = self.memory.at_start(estimate)
        if warning is not None:
            self.stats.warn(warning)

    def _log_resolved_choices(self) -> None:
        """Log what each ``"auto"`` parameter of the rule resolved to (GSGM's averaging)."""
        assert self.optimizer is not None
        rule = self.optimizer.rule
        for key, value in rule.resolved_choices().items():
            log(INFO, "[async] %s: %s = auto -> %r", rule.name, key, value)

    # ---------------------------------------------------------- loop: the steps
    def _finished(self) -> bool:
        """True once a budget is spent, the model diverged or no node is left."""
        if self.end.diverged or self.received >= self.settings.max_updates or self.end.failed:
            return True
        if self.clock.out_of_time():
            return True
        if self.in_flight:
            return False
        if self.budget_spent or not self.dispatcher.may_dispatch(self.received):
            return True  # the time budget is spent
        return self.end.nothing_in_flight(self.received)

    def _apply_ready(self) -> bool:
        """Handle every reply that is due; return True if any was."""
        progressed = False
        while not self._finished():
            progressed |= self._bring_back_online()
            progressed |= self._act_on_deadline()
            dispatch = self.in_flight.next_ready()
            if dispatch is None:
                break
            if self.clock.too_late(dispatch):
                self.in_flight.clear()  # time budget spent: in-flight work is not applied
                self.budget_spent = True
                break
            self._handle(dispatch)
            progressed = True
        return progressed

    def _bring_back_online(self) -> bool:
        """Under the time model's availability, bring back the nodes that are online
        again before the next reply is due, at the virtual second each is back (so it
        gets work then, not at the next reply); True if any came back. With nothing
        in flight :meth:`_idle` jumps there instead; nothing past the time budget."""
        back = self.members.next_online()
        if back is None or not self.clock.virtual or self.clock.past_budget(back):
            return False
        first = self.in_flight.first_due()
        if first is None or first.v_finish <= back:
            return False
        self.clock.jump_to(back)
        self.members.end_backoffs()
        return True

    def _act_on_deadline(self) -> bool:
        """Under the virtual clock, a rule's deadline (FedCompass's group deadline) that
        passes before the next reply is due acts at its time, as APPFL's timer does:
        the clock moves just past it, the rule acts, the freed slots get work. True if
        one did; nothing past the time budget."""
        assert self.optimizer is not None
        deadline = self.optimizer.next_deadline()
        if deadline is None or not self.clock.virtual:
            return False
        tick = float(np.nextafter(deadline, np.inf))  # "past" it: a deadline is inclusive
        first = self.in_flight.first_due()
        if first is None or first.v_finish <= tick or self.clock.past_budget(tick):
            return False
        self.clock.jump_to(tick)
        self.optimizer.on_deadline(self.clock.now())
        self.top_up()
        return True

    def _stop_if_requested(self) -> None:
        """On SIGTERM (checkpoints on): save a checkpoint, then stop."""
        if self.stop_requested:
            self._save_checkpoint()
            raise SystemExit(f"SIGTERM: checkpoint saved at {self.received} updates")

    def _request_stop(self) -> None:
        self.stop_requested = True

    def _idle(self) -> None:
        """Nothing was applied: wait for replies, or, with nothing in flight, jump the
        clock to the end of the earliest back-off (a virtual clock can)."""
        retry = None if self.in_flight else self.members.next_retry()
        if retry is not None and self.clock.jump_to(retry):
            self.members.end_backoffs()
        else:
            self.in_flight.idle(self.settings.poll_interval)

    def top_up(self) -> None:
        """Fill the slots that may have freed (:meth:`Dispatcher.top_up`)."""
        assert self.optimizer is not None
        self.dispatcher.top_up(self.optimizer, self.received)

    # ---------------------------------------------------------------- a reply
    def _handle(self, dispatch: Dispatch) -> None:
        """One reply: an error (a failure of its node) or an update; then work for the
        freed slot, the back-offs over by now, and the evaluation / checkpoint due."""
        reply = self.in_flight.finish(dispatch)
        if reply is None:  # lost with its node (the time model's availability)
            self._lost(dispatch)
            return
        now = self.clock.at_reply(dispatch)
        self.clock.charge_dispatch(dispatch)
        node = self.members.nodes[dispatch.partition_id]
        self.policy.on_reply(node.partition_id, now, counted=not reply.has_error())
        assert self.optimizer is not None
        if reply.has_error():
            self.members.on_error_reply(node.partition_id, reply)
            self.replies.error(dispatch, self.received, reply.error.code, self.optimizer.version)
            self.members.end_backoffs()
            return
        self.members.replied(node.partition_id)
        self.received += 1
        outcome = self._on_update(node, dispatch, reply)
        staleness = None if outcome is None else self.optimizer.last_staleness
        self.replies.update(dispatch, self.received, outcome, staleness, self.optimizer.version)
        self.top_up()
        self.members.end_backoffs()  # back-offs over by now, after the update
        if self.received % self.settings.eval_every == 0:
            self._evaluate()
        if not self.end.diverged:  # federated evaluation at its points, beside training
            self.federated.maybe_send(self.received, self.optimizer, self.members.nodes)
        if self.settings.checkpoint_every and self.received % self.settings.checkpoint_every == 0:
            self._save_checkpoint()

    def _lost(self, dispatch: Dispatch) -> None:
        """A message lost with its node: at the virtual second the node went offline
        (no reply reaches the server, so it costs the server nothing), the node is
        offline until it is back; counted, logged, and the freed slot gets work."""
        assert self.optimizer is not None and dispatch.back_at is not None
        self.clock.jump_to(dispatch.v_finish)
        self.clock.charge_dispatch(dispatch)  # the node worked until it went (at most)
        pid = dispatch.partition_id
        self.policy.on_reply(pid, self.clock.now(), counted=False)
        self.replies.lost(dispatch, self.received, self.optimizer.version)
        self.members.go_offline(pid, dispatch.back_at, lost=True)
        self.members.end_backoffs()

    def _on_update(self, node: Node, dispatch: Dispatch, reply: Message) -> Outcome | None:
        """Intake, then the optimizer, then the books (a rejection: :meth:`_on_rejected`);
        the update's outcome, None if it was rejected."""
        assert self.optimizer is not None
        pid = node.partition_id
        try:
            update = self.intake.unpack(dispatch, reply)
            update.trainable = self._weigh(pid, dispatch, reply, update.trainable)
            norm = self.norm_bound.check(pid, update.trainable)
            outcome = self.optimizer.on_update(
                pid, update, dispatch.base_version, now=self.clock.now()
            )
        except UpdateRejected as err:  # intake's ReplyRejected, the norm bound's, the rule's
            self._on_rejected(pid, err)
            self._record_outcome(pid, None)
            return None
        self.norm_bound.accept(pid, norm)
        self._record_outcome(pid, outcome)
        self.members.accepted(pid)
        staleness = self.optimizer.last_staleness
        assert staleness is not None  # set by every valid update
        self.ledger.record_update(staleness, self.intake.train_loss(reply))
        if outcome is Outcome.STALE:
            log(
                INFO,
                "[async] dropped stale update from %s (staleness %d)",
                self.members.name(pid),
                staleness,
            )
        return outcome

    def _weigh(
        self, pid: int, dispatch: Dispatch, reply: Message, trainable: list[np.ndarray]
    ) -> list[np.ndarray]:
        """The update's trainable arrays times work scheduling's weight for it (its
        steps against the fleet's: :meth:`WorkScheduler.on_reply
        <flwr_gsgm.scheduling.work_scheduler.WorkScheduler.on_reply>`); unchanged
        while scheduling is off. A reply that shows the ClientApp cannot take part
        turns scheduling off, said once."""
        work = self.dispatcher.work
        if work.policy == "off":
            return trainable
        was_active = work.active
        steps, seconds = self.intake.work_report(reply)
        total = self.clock.message_seconds(dispatch)
        weight = work.on_reply(pid, dispatch.scheduled_steps, steps, seconds, total)
        if was_active and not work.active:
            log(WARNING, "[async] work scheduling off: %s", work.off_reason)
        if weight == 1.0:
            return trainable
        return [np.multiply(a, np.float32(weight), dtype=np.float32) for a in trainable]

    def _on_rejected(self, pid: int, err: UpdateRejected) -> None:
        """A rejected update: counted, logged and blamed on its node (too many in a row
        exclude it), unless every node's recent updates are rejected as out of scale:
        then the model diverged (check 4 of :mod:`flwr_gsgm.engine.divergence`) and
        the run ends without blaming any node."""
        self.ledger.record_rejection(err.reason)
        log(
            WARNING,
            "[async] rejected update from %s (%s): %s",
            self.members.name(pid),
            err.reason,
            err.message,
        )
        diverged = self.end.on_reply(pid, err.reason, self.received)
        self.members.rejected(pid, f"{err.reason}: {err.message}", blame=not diverged)

    def _record_outcome(self, pid: int, outcome: Outcome | None) -> None:
        """The per-node counts of ``pid``'s update (``outcome`` None: rejected); an
        accepted one counts in the divergence window."""
        assert self.optimizer is not None
        version, active = self.optimizer.version, self.members.active_ids()
        self.stats.record_update(pid, outcome, self.received, version, active)
        if outcome is not None:
            self.end.on_reply(pid, None, self.received)

    def _on_replay(self, mid: str, why: str) -> None:
        """A replayed reply (not an answer to a dispatch in flight): counted, ignored."""
        self.ledger.record_rejection("duplicate")
        log(WARNING, "[async] ignored a replayed reply (duplicate): %s", why)

    # ------------------------------------------------ evaluation and checkpoints
    def _evaluate(self) -> None:
        """An evaluation row now; a diverged model ends the run."""
        assert self.optimizer is not None
        diverged = self.evaluator.evaluate(
            self.received, self.optimizer, self.ledger, self.clock.now(), self.clock.wall()
        )
        joules = self.clock.joules()
        if joules is not None:  # the fleet's energy so far (a device-power model)
            self.evaluator.rows[-1]["joules"] = round(joules, 3)
        self.end.diverge(diverged, self.received)

    def _save_checkpoint(self) -> None:
        """Write :meth:`state_dict` to the checkpoint file, if checkpoints are on and the
        model has not diverged (then the previous checkpoint resumes from before it)."""
        path = self.settings.checkpoint_path
        if path is None or not self.settings.checkpoint_every or self.end.diverged:
            return
        checkpoint.save(path, self.state_dict())
        self.replies.checkpoint(self.received)
        log(INFO, "[async] checkpoint at %d updates -> %s", self.received, path)

    # ---------------------------------------------------------------- teardown
    def _abort(self, reason: str, err: BaseException) -> None:
        """The run cannot go on: it fails with ``reason``; without an optimizer yet
        (its construction failed) there is no report, so :class:`RunFailed` now."""
        self.aborted = True
        self.end.fail(reason)
        if self.optimizer is None:
            raise RunFailed(reason) from err

    def _teardown(self) -> EngineReport:
        """The final evaluation and the evaluations still out (unless the run was
        aborted: it reports what it has, without more work), the end-of-run warnings,
        then the report."""
        assert self.optimizer is not None
        if not self.aborted:
            if not self.end.diverged and (
                not self.evaluator.rows or self.evaluator.rows[-1]["updates"] != self.received
            ):
                self._evaluate()  # the final weights, unless the last row has them
            self.federated.finish(self.evaluator.rows, self.settings.poll_interval)
        self.stats.finish(self.optimizer.rule.params.get("max_staleness"), self.members)
        work = self.dispatcher.work
        if work.policy != "off":
            # What each node was last asked to do and how fast it was measured: the
            # only place the log shows the local-steps that scheduling chose.
            log(INFO, "[async] work scheduling %s: %s", work.policy, work.nodes_line())
        return EngineReport.from_parts(
            keys=self.keys,
            optimizer=self.optimizer,
            received=self.received,
            ledger=self.ledger,
            end=self.end,
            stats=self.stats,
            members=self.members,
            evaluator=self.evaluator,
            federated=self.federated,
            clock=self.clock,
            work=self.dispatcher.work,
        )

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run bit-identically: each part's
        ``state_dict()`` under the checkpoint's top-level keys
        (:mod:`flwr_gsgm.engine.checkpoint_state`).

        In-flight dispatches are saved with the weights they carried; a resumed run
        re-sends them with the same seed and virtual finish time.
        """
        assert self.optimizer is not None
        params = self.optimizer.rule.params
        return {
            "keys": list(self.keys),
            "optimizer": self.optimizer.state_dict(),
            **self.members.state_dict(),
            **self.ledger.state_dict(),
            **self.in_flight.state_dict(),
            **self.evaluator.state_dict(),
            "received": self.received,
            **self.end.state_dict(),
            **self.dispatcher.state_dict(),
            **self.clock.state_dict(),
            "node_stats": self.stats.state_dict(),
            "norm_bound": self.norm_bound.state_dict(),
            "fingerprint": engine_state.run_fingerprint(
                self.settings, self.dispatcher.train_config, params
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output into each part, reconcile the nodes that
        answered now with the checkpoint's, and re-send its in-flight work.

        The rule's parameters are this run's (equal to the checkpoint's, or changed as
        ``resume-allow-changes`` allowed).

        Raises
        ------
        ResumeRefused
            The nodes report another number of partitions (unless allowed), or (a
            strategy started without a run config) the rule's parameters or train
            config differ (:func:`flwr_gsgm.engine.checkpoint_state.check_after_start`).
        CheckpointError
            Anything else in the state does not fit the run (model keys, optimizer
            state, dispatch policy): the message names the checkpoint and the cause.
        """
        try:
            self._load_parts(state)
        except (ResumeRefused, checkpoint.CheckpointError):
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise checkpoint.CheckpointError(
                f"checkpoint {self.settings.checkpoint_path} cannot be resumed: "
                f"{type(err).__name__}: {err}"
            ) from err
        assert self.optimizer is not None
        log(
            INFO,
            "[async] resumed at %d updates (version %d, virtual time %.1f s)",
            self.received,
            self.optimizer.version,
            self.clock.now(),
        )

    def _load_parts(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        params = self.optimizer.rule.params
        current = engine_state.run_fingerprint(self.settings, self.dispatcher.train_config, params)
        engine_state.check_after_start(
            self.settings, state, self.keys, current, self.members.num_partitions
        )
        self.optimizer.load_state_dict(engine_state.with_params(state["optimizer"], params))
        self.ledger.load_state_dict(state)
        self.members.load_state_dict(state)
        self.evaluator.load_state_dict(state)
        self.received = state["received"]
        self.end.load_state_dict(state)
        self.dispatcher.load_state_dict(state)
        self.clock.load_state_dict(state)
        self.stats.load_state_dict(state["node_stats"])
        self.norm_bound.load_state_dict(state["norm_bound"])
        self.members.reconcile(self.optimizer.rule.active_nodes)
        active = {pid: n.node_id for pid, n in self.members.nodes.items() if n.active}
        self.in_flight.load_state_dict(state, active)
