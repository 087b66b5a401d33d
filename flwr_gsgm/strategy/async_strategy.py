"""Asynchronous Flower strategies: a ``start()`` like Flower's, with no round barrier.

``AsyncStrategy.start(grid, initial_arrays, ...)`` mirrors
``flwr.serverapp.strategy.Strategy.start`` and returns a ``Result`` (an
:class:`AsyncResult`, which adds the evaluation rows and run counters), but runs the
asynchronous engine of :mod:`flwr_gsgm.engine.async_engine` instead of rounds. The server
rule is a framework-free optimizer from :mod:`flwr_gsgm.core`, selected by name.

Use it in your own ServerApp::

    from flwr_gsgm import GSGM

    @app.main()
    def main(grid, context):
        strategy = GSGM(client_mode="weights", local_lr=0.01)  # a FedAvg-style ClientApp
        result = strategy.start(grid, ArrayRecord(model.state_dict()), max_updates=3000)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flwr_gsgm.core.params import DISPLACEMENT_MODES
from flwr_gsgm.engine.async_engine import AsyncEngine, EngineReport, EngineSettings, EvaluateFn
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.engine.hooks import OnEvaluate, OnFederatedEvaluate, TrainConfigFn, check_hook
from flwr_gsgm.engine.run_end import DIVERGED, FAILED, RunDiverged, RunFailed
from flwr_gsgm.model.optimizer import RuleSpec
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.arguments import (
    CLIENT_MODES,
    check_prefetch,
    client_work,
    learning_rate_source,
    resolve_optimizer_params,
)
from flwr_gsgm.strategy.arguments import trainable_keys as _trainable_keys
from flwr_gsgm.strategy.fedavg_keywords import fedavg_refusal

__all__ = ["AsyncStrategy", "AsyncResult", "CLIENT_MODES", "DISPLACEMENT_MODES"]


@dataclass
class AsyncResult(Result):
    """Flower ``Result`` plus what an asynchronous run measured.

    ``evaluate_metrics_serverapp``, ``evaluate_metrics_clientapp`` (federated
    evaluation) and ``train_metrics_clientapp`` are keyed by the number of client
    updates received at the evaluation point (where Flower keys by round).
    ``rows`` holds one dict per evaluation (see ``metrics.csv``) and ``report`` the
    engine's counters.
    """

    rows: list[dict[str, float]] = field(default_factory=list)
    report: EngineReport | None = None


class AsyncStrategy:
    """An asynchronous strategy: one server optimizer on the asynchronous engine.

    Parameters
    ----------
    optimizer : str
        Name in :data:`flwr_gsgm.core.OPTIMIZERS` ("gsgm", "asgd", "masgd",
        "dcasgd", "fedasync", "fedbuff", and any rule registered since).
    server_learning_rate : float | None
        Server learning rate eta (> 0), the optimizer's ``lr``. Gradient mode: a step
        per gradient; delta and weights modes: a fraction of each node's displacement
        ``w_sent - w_local`` (1.0 applies it whole), whatever the client's lr. None
        (default): the rule's declared default for the client mode, gradient then
        displacement (GSGM: 0.1 and 1.0, the first per cycle, tuned in
        docs/results/fashion_mnist_scale, the second the whole mean displacement of a
        cycle at its close, FedAvg's step, where GSGM's ``apply_at = "auto"`` steps in
        these modes: docs/GSGM.md "FedAvg parity per client training"; ASGD 0.02 and
        0.05; docs/GSGM.md "Client modes" lists every rule).
    client_mode : str
        What the clients return, sent as ``mode`` in every train message:
        "gradient" (mean gradient of ``local_batches`` mini-batches at the received
        weights), "delta" (the displacement ``w_received - w_local`` after the local
        SGD steps) or "weights" (the trained weights ``w_local``, as for Flower's
        FedAvg: the server forms the displacement ``w_sent - w_local`` from the
        weights it sent in that dispatch, so the rule sees what delta mode would
        send). Choose "weights" for a ClientApp written for FedAvg, or any client
        that returns its model (it costs the server one model copy per message in
        flight); "delta" for the same local work with half the server memory;
        "gradient" for the cheapest client step (one gradient, no local SGD).
    batch_size, local_batches, local_steps : int | None
        Client work per update, sent in every train message (each >= 1).
    local_epochs : int | None
        Delta and weights modes: passes over the node's partition per message, each
        ``ceil(N / batch_size)`` SGD steps; 0: ``local_steps`` steps.
    local_lr : float | None
        Client learning rate of delta and weights modes (> 0; DC-ASGD's gradient
        estimate is ``displacement / local_lr``: DC-ASGD needs it in those modes).
    local_momentum : float | None
        SGD momentum of the local steps in [0, 1), torch.optim.SGD's; 0: plain SGD;
        FedAvg-style clients use 0.9.

        None (the default): in gradient and delta modes the protocol's default (batch
        32, one batch, one step, no epochs, lr 0.05, no momentum), sent; in weights
        mode not sent: the ClientApp's own (a FedAvg ClientApp keeps its epochs,
        learning rate and momentum; the strategy's summary says so). Work
        scheduling (``EngineSettings.work_scheduling``) sets ``local-steps`` per
        message once a node's speed is measured.
    virtual_clock : VirtualClock | None
        Simulation clock (reproducible order) or None for real arrival order.
    engine : EngineSettings | None
        Engine parameters except budgets, clock and seed, which ``start`` sets.
    seed : int
        Run seed for per-dispatch client seeds and the virtual clock.
    trainable_keys : iterable of str | None
        The model arrays the server rule trains, e.g. ``[n for n, _ in
        model.named_parameters()]``; None (default): every floating-point array
        whose name's last dotted part is not ``running_mean``, ``running_var`` or
        ``num_batches_tracked``. The other arrays are buffers: never stepped,
        floating ones averaged over the nodes' latest reports, integer ones taken
        from the latest report (:mod:`flwr_gsgm.model.buffers`). Replies are matched
        to the model by array name.
    federated_evaluation : FederatedEvaluation | None
        Evaluation on the nodes (their ClientApp's ``@app.evaluate()``) every
        ``every`` updates, on a fraction of them, aggregated as Flower's FedAvg does,
        without pausing training; None: none [``federated-eval-every``,
        ``fraction-evaluate``]. See :mod:`flwr_gsgm.engine.federated_evaluation`.
    train_config_fn : callable | None
        ``train_config_fn(node_id: int, model_version: int, updates_received: int)
        -> ConfigRecord``, called once for every train message the engine sends, just
        before it is built (the first messages at 0 updates, then each time a node
        gets work again; a resumed run re-sends its checkpointed messages without
        calling it). ``node_id`` is the Flower node id the message goes to,
        ``model_version`` the server steps applied so far (the version of the
        weights sent, also sent as ``model-version``), ``updates_received`` the
        client updates received so far (the unit of ``max_updates``). The keys it
        returns are merged over ``start``'s train config (the client work and
        ``train_config``) for that message only, e.g. ``ConfigRecord({"local-lr":
        0.05})`` for a learning-rate schedule (FedAvg's ``configure_train``
        override; a round r of FedAvg with n nodes is about ``r x n`` updates).
        Under the virtual clock a changed ``local-steps`` etc. changes that
        message's duration. It may not set ``mode``, ``model-version``, ``seed`` or
        ``virtual-duration`` (ValueError); DC-ASGD's gradient estimate keeps the
        constructor's ``local_lr``. None (default): every message carries the
        same config.
    on_evaluate : callable | None
        ``on_evaluate(updates: int, arrays: ArrayRecord, metrics: MetricRecord)``,
        called after each server (centralized) evaluation: at 0 updates, every
        ``eval_every`` client updates received and at the end, the diverging one
        included, in that order (federated evaluations: ``on_federated_evaluate``).
        ``updates`` is the
        client updates received, ``arrays`` the global model evaluated (a copy of
        its own: keep it for a best-model checkpoint, do not modify it), ``metrics``
        the evaluation row of ``metrics.csv`` (``updates``, ``version``,
        ``virtual_time`` and ``wall_time`` in seconds, ``accuracy`` and ``loss``
        from ``evaluate_fn``, the window's ``staleness_mean``, ``staleness_max``,
        ``train_loss``, ``deferred``, ``rejected``, ``dropped``) plus the other keys
        ``evaluate_fn`` returned; a value the run does not have is left out
        (``train_loss`` at 0 updates, ``accuracy`` and ``loss`` without
        ``evaluate_fn``: ``metrics.get(...)`` is None), so the metrics are strict
        JSON. The first call, at 0 updates, is the untrained model: a best-model
        checkpoint skips it (``if updates == 0: return``). Its return value is
        ignored: logging (W&B), best-model checkpoints (FedAvg's
        ``aggregate_evaluate`` or ``evaluate_fn`` side effects).
    on_federated_evaluate : callable | None
        ``on_federated_evaluate(updates: int, metrics: MetricRecord)``, called when a
        federated evaluation's aggregate arrives (with ``federated_evaluation``),
        while training goes on: ``updates`` is the client updates received when the
        model was sent to the nodes (the key of ``evaluate_metrics_clientapp`` and
        of the ``metrics.csv`` row its ``federated_*`` columns go to), ``metrics`` the
        nodes' metrics aggregated as Flower's FedAvg does (weighted by
        ``num-examples``; keys as the ClientApp's ``@app.evaluate()`` returns them,
        e.g. ``eval-loss``, ``eval-acc``; a copy of its own). It comes after the
        ``on_evaluate`` of the same ``updates`` (the nodes answer later), possibly
        after later ones. Its return value is ignored: live logging (W&B) of what
        FedAvg's ``aggregate_evaluate`` returns.
    **optimizer_params
        The optimizer's declared parameters (``PARAMS`` of its class in
        :mod:`flwr_gsgm.core`), e.g. ``beta`` for GSGM; every rule takes
        ``max_staleness`` (drop updates staler than this many versions) and
        ``max_norm`` (reject updates with a larger L2 norm), both None (no bound) by
        default. A parameter not given takes its declared default.

    Attributes
    ----------
    optimizer_params : dict[str, Any]
        Every parameter of the optimizer, ``lr`` included, with its value.
    rule_spec : RuleSpec
        The rule and ``optimizer_params``: the factory the engine builds the rule
        with, handing it its ``max_in_flight`` (a GSGM ``concurrency`` left None
        takes it).

    Raises
    ------
    ValueError
        On an unknown optimizer or client mode, a keyword argument that is neither
        a strategy parameter nor a parameter of the optimizer (the message lists
        both; for one of Flower FedAvg's, e.g. ``fraction_train``, it names the
        counterpart: :mod:`flwr_gsgm.strategy.fedavg_keywords`), or a value out of range
        (checked here, before any message is sent).
    TypeError
        If ``train_config_fn``, ``on_evaluate`` or ``on_federated_evaluate`` is
        neither None nor callable.

    A hook that raises during the run stops it with
    :class:`flwr_gsgm.engine.hooks.HookFailed` (naming the hook and the exception); a
    ``train_config_fn`` that returns anything but a ConfigRecord stops it with a
    TypeError naming what came back.
    """

    def __init__(
        self,
        optimizer: str = "gsgm",
        *,
        server_learning_rate: float | None = None,
        client_mode: str = "gradient",
        batch_size: int | None = None,
        local_batches: int | None = None,
        local_steps: int | None = None,
        local_epochs: int | None = None,
        local_lr: float | None = None,
        local_momentum: float | None = None,
        virtual_clock: VirtualClock | None = None,
        engine: EngineSettings | None = None,
        seed: int = 0,
        trainable_keys: Iterable[str] | None = None,
        federated_evaluation: FederatedEvaluation | None = None,
        train_config_fn: TrainConfigFn | None = None,
        on_evaluate: OnEvaluate | None = None,
        on_federated_evaluate: OnFederatedEvaluate | None = None,
        **optimizer_params: Any,
    ) -> None:
        refusal = fedavg_refusal(optimizer_params)
        if refusal:  # before the generic message: a ported FedAvg app learns the name
            raise ValueError(refusal)
        check_hook("train_config_fn", train_config_fn)
        check_hook("on_evaluate", on_evaluate)
        check_hook("on_federated_evaluate", on_federated_evaluate)
        # Checked first: a bad value fails before anything is built.
        self.client_work = client_work(
            optimizer,
            client_mode,
            batch_size=batch_size,
            local_batches=local_batches,
            local_steps=local_steps,
            local_epochs=local_epochs,
            local_lr=local_lr,
            local_momentum=local_momentum,
        )
        self.optimizer_name = optimizer
        self.optimizer_params = resolve_optimizer_params(
            optimizer, server_learning_rate, optimizer_params, client_mode, local_lr
        )
        self.server_learning_rate = float(self.optimizer_params["lr"])
        self.server_learning_rate_source = learning_rate_source(server_learning_rate, client_mode)
        self.client_mode = client_mode
        self.virtual_clock = virtual_clock
        self.engine = engine or EngineSettings()
        check_prefetch(optimizer, self.engine, virtual_clock)
        if self.engine.work_scheduling != "off" and client_mode not in DISPLACEMENT_MODES:
            raise ValueError(
                f"work-scheduling = {self.engine.work_scheduling!r} sizes each message's "
                f"local SGD steps: it needs client-mode delta or weights, got {client_mode!r}"
            )
        self.seed = int(seed)
        self.trainable_keys = _trainable_keys(trainable_keys)
        self.federated_evaluation = federated_evaluation
        self.train_config_fn = train_config_fn
        self.on_evaluate = on_evaluate
        self.on_federated_evaluate = on_federated_evaluate
        self.rule_spec = RuleSpec(optimizer, self.optimizer_params)
        # Fail now, not after the nodes answered: build the optimizer on a dummy model.
        rule = self.rule_spec([np.zeros(2, np.float32)], [0], self.engine.max_in_flight)
        # Who sizes local-steps: work-scheduling, or a rule's own scheduler (FedCompass's
        # replaces it in the engine); the summary must not call that the ClientApp's own.
        self._work_scheduler = rule.WORK_SCHEDULER or self.engine.work_scheduling

    @property
    def dispatch_policy(self) -> str:
        """The engine's dispatch policy, with "auto" resolved for this rule.

        "auto" is "scheduled" for a rule that schedules its nodes (GSGM's white list,
        ``scheduling=True``): under a concurrency limit the least-contributed idle node
        goes first; "random" (the FedBuff / CA2FL setting) for every other rule.
        """
        if self.engine.dispatch != "auto":
            return self.engine.dispatch
        return "scheduled" if self.optimizer_params.get("scheduling") else "random"

    def summary(self) -> None:
        """Log the strategy's configuration: the rule, the server learning rate, the
        client work (what the strategy sends; in weights mode the rest is the
        ClientApp's own settings, whatever keys it reads; with work scheduling, that it
        sends ``local-steps``), federated evaluation, hooks and clock."""
        log(INFO, "\t├── Server optimizer: %s %s", self.optimizer_name, self.optimizer_params)
        lr, source = self.server_learning_rate, self.server_learning_rate_source
        log(INFO, "\t├── Server learning rate: %g (%s)", lr, source)
        # Name no ClientApp key here: a ported ClientApp may read none of the library's
        # (advanced-pytorch reads "lr"), so only what the strategy sends is a fact.
        if self.client_work:
            sent = f"the strategy sends {self.client_work}"
            if self.client_mode == "weights":
                sent += " (the ClientApp's own settings for the rest)"
        else:
            sent = "the strategy sends no client work (the ClientApp trains with its own settings)"
        if self._work_scheduler != "off":
            # The dispatcher sets local-steps (and local-epochs 0) in every message once
            # the node's speed is measured; its first message carries the run's own work.
            sent += (
                f"; work scheduling ({self._work_scheduler}) sends local-steps (and "
                "local-epochs 0) once a node's speed is measured by its first reply"
            )
        log(INFO, "\t├── Client work: mode=%s; %s", self.client_mode, sent)
        if self.engine.work_scheduling != "off":
            log(
                INFO,
                "\t├── Work scheduling: %s (local-steps per message from its node's "
                "measured speed; longer-than-mean updates scaled down by their steps)",
                self.engine.work_scheduling,
            )
        log(INFO, "\t├── Federated evaluation: %s", self.federated_evaluation)
        hooks = {
            "train_config_fn": self.train_config_fn,
            "on_evaluate": self.on_evaluate,
            "on_federated_evaluate": self.on_federated_evaluate,
        }
        given = [name for name, fn in hooks.items() if fn is not None]
        if given:
            log(INFO, "\t├── Hooks: %s", ", ".join(given))
        log(INFO, "\t└── Virtual clock: %s", self.virtual_clock)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        max_updates: int | None = None,
        max_seconds: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        eval_every: int | None = None,
        evaluate_config: ConfigRecord | None = None,
        **fedavg_keywords: Any,
    ) -> AsyncResult:
        """Train asynchronously until ``max_updates`` client updates were received.

        Parameters
        ----------
        grid : Grid
            The Grid instance used to send/receive Messages.
        initial_arrays : ArrayRecord
            Initial model, e.g. ``ArrayRecord(model.state_dict())``: float32
            trainable arrays, buffers of any dtype (see ``trainable_keys``).
        max_updates : int | None
            Budget in client updates received (client computations); None (default)
            keeps the engine settings' (the run config default, 4000).
        max_seconds : float | None
            Budget in virtual seconds (virtual clock) or wall seconds (deployment);
            0 = none; None (default) keeps the engine settings' (none by default).
        train_config : ConfigRecord | None
            Extra keys sent in every train message (the strategy adds ``mode``,
            ``batch-size``, ``local-batches``, ``local-steps``, ``local-epochs``,
            ``local-lr``, ``local-momentum``, ``model-version``, ``seed`` and ``virtual-duration``).
        evaluate_fn : callable | None
            ``(updates_received, arrays) -> MetricRecord`` with ``accuracy`` and
            ``loss``; centralized evaluation.
        eval_every : int | None
            Evaluate every this many updates received (default: the engine's).
        evaluate_config : ConfigRecord | None
            Keys sent in every federated evaluate message (with
            ``federated_evaluation``; the engine adds ``model-version``).
        **fedavg_keywords
            None is accepted: FedAvg's ``num_rounds`` and ``timeout`` are refused
            with their counterpart named, any other keyword as Python does.

        Returns
        -------
        AsyncResult

        Raises
        ------
        TypeError
            On a keyword argument ``start`` does not take (FedAvg's ``num_rounds``,
            ``timeout``: the message names the counterpart), before any message is
            sent; or a ``train_config_fn`` that returned no ConfigRecord.
        flwr_gsgm.engine.hooks.HookFailed
            If ``train_config_fn``, ``on_evaluate`` or ``on_federated_evaluate`` raised
            (the run stops there).
        flwr_gsgm.engine.run_end.RunFailed
            If no node was left to train before the budget was spent (every node
            excluded, or lost and not back within ``rejoin-timeout``); its ``reason``
            says why and its ``result`` holds the :class:`AsyncResult` so far.
        flwr_gsgm.engine.run_end.RunDiverged
            A ``RunFailed`` raised when the model diverged and the run ended there
            (:mod:`flwr_gsgm.engine.divergence`: non-finite weights, a non-finite or
            exploding test loss, or most recent replies of every node rejected as
            out of scale); ``reason`` starts with the kind, ``result`` holds the
            :class:`AsyncResult` so far, whose ``report.last_finite`` is
            ``(updates, model)`` of the last evaluation before the divergence (keep
            that one, not ``result.arrays``), or None.
        RuntimeError
            If fewer than ``min-nodes`` nodes answer within ``startup-timeout``.
        """
        if fedavg_keywords:
            refusal = fedavg_refusal(fedavg_keywords)
            if refusal is None:
                name = next(iter(fedavg_keywords))
                refusal = f"start() got an unexpected keyword argument {name!r}"
            raise TypeError(refusal)
        log(INFO, "Starting %s asynchronous strategy:", self.optimizer_name.upper())
        self.summary()
        settings = self._engine_settings(max_updates, max_seconds, eval_every, evaluate_config)
        config = self._train_config(train_config)
        engine = AsyncEngine(
            grid,
            initial_arrays,
            self.rule_spec,
            config,
            settings,
            evaluate_fn,
            trainable_keys=self.trainable_keys,
            train_config_fn=self.train_config_fn,
            on_evaluate=self.on_evaluate,
            on_federated_evaluate=self.on_federated_evaluate,
        )
        report = engine.run()
        result = _result(report)
        if report.status == FAILED:
            raise RunFailed(report.status_reason, result)
        if report.status == DIVERGED:
            raise RunDiverged(report.status_reason, result)
        log(INFO, "Asynchronous run finished: %s", report.counters)
        return result

    def _train_config(self, extra: ConfigRecord | None) -> ConfigRecord:
        """Every train message's config: client mode and work, then ``extra``'s keys."""
        config = ConfigRecord({"mode": self.client_mode, **self.client_work})
        for key, value in dict(extra or {}).items():
            config[key] = value
        return config

    def _engine_settings(
        self,
        max_updates: int | None,
        max_seconds: float | None,
        eval_every: int | None,
        evaluate_config: ConfigRecord | None,
    ) -> EngineSettings:
        """The engine settings with this call's budgets and evaluate config, and the
        strategy's clock, seed, dispatch policy and federated evaluation."""
        return replace(
            self.engine,
            max_updates=self.engine.max_updates if max_updates is None else int(max_updates),
            max_seconds=self.engine.max_seconds if max_seconds is None else max_seconds,
            eval_every=int(eval_every or self.engine.eval_every),
            virtual_clock=self.virtual_clock,
            seed=self.seed,
            dispatch=self.dispatch_policy,
            federated_evaluation=self.federated_evaluation
            and self.federated_evaluation.with_config(evaluate_config),
        )


def _result(report: EngineReport) -> AsyncResult:
    """The run's :class:`AsyncResult`: Flower's per-step metric records and the report.

    A metric without a finite value at a step (``train-loss`` before any update, the
    loss of a diverged model) is left out of that step's record, so that a port that
    writes the records with ``json.dump`` writes strict JSON, as FedAvg's do."""
    result = AsyncResult(arrays=report.arrays, rows=report.rows, report=report)
    result.evaluate_metrics_clientapp.update(report.federated)
    for row in report.rows:
        step = int(row["updates"])
        result.evaluate_metrics_serverapp[step] = _finite(
            {"accuracy": row["accuracy"], "loss": row["loss"]}
        )
        result.train_metrics_clientapp[step] = _finite(
            {"train-loss": row["train_loss"], "staleness-mean": row["staleness_mean"]}
        )
    return result


def _finite(metrics: dict[str, float]) -> MetricRecord:
    """A MetricRecord of the finite values of ``metrics`` (NaN and infinities left out)."""
    return MetricRecord({k: v for k, v in metrics.items() if math.isfinite(v)})
