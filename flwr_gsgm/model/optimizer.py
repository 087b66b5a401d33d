"""The whole model as the engine sees it: a core rule on the trainable arrays, plus buffers.

The core rules (:mod:`flwr_gsgm.core`) own one flat float32 buffer of the trainable
parameters and know nothing of names or buffers. :class:`ModelOptimizer` joins a
rule with the model's :class:`~flwr_gsgm.model.buffers.ModelBuffers` through its
:class:`~flwr_gsgm.model.layout.ModelLayout`, and gives the engine the calls of a
rule (``weights``, ``version``, ``counters``, ``last_staleness``, ``on_dispatch``, ``holds``,
``on_update``, ``on_node_joined``, ``on_node_lost``, ``state_dict``) over the whole
model, every array in model order and in its own dtype.

The rule is built by a :data:`RuleFactory` once the nodes are known, with the
engine's concurrency limit as an argument: :class:`RuleSpec` (a rule's name and
parameters, what a strategy hands the engine) is the factory the library uses, so
nothing the engine calls reaches back into the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flwr_gsgm.core import Outcome, ServerOptimizer, make_optimizer
from flwr_gsgm.model.buffers import ModelBuffers
from flwr_gsgm.model.layout import ModelLayout, ModelUpdate

__all__ = ["ModelOptimizer", "RuleFactory", "RuleSpec"]

#: ``(trainable weights: list of float32 arrays, partition_ids: list[int],
#: concurrency: int | None) -> ServerOptimizer``; ``concurrency`` is the engine's
#: limit on nodes training at once (None: every active node).
RuleFactory = Callable[[list[np.ndarray], list[int], "int | None"], ServerOptimizer]


@dataclass(frozen=True)
class RuleSpec:
    """A core rule by name with its parameters: the :data:`RuleFactory` a strategy hands
    the engine.

    Attributes
    ----------
    name : str
        The rule's name in :data:`flwr_gsgm.core.OPTIMIZERS`.
    params : Mapping[str, Any]
        Every parameter the rule is built with (``lr`` included). A declared
        ``concurrency`` left None (GSGM's, which scales its step by the nodes in
        flight) takes the engine's limit when the rule is built.
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __call__(
        self, weights: list[np.ndarray], partition_ids: list[int], concurrency: int | None
    ) -> ServerOptimizer:
        """The rule on ``weights`` (float32 arrays, kept) for the nodes ``partition_ids``,
        under the engine's ``concurrency`` limit (None: every node in flight).

        Raises
        ------
        ValueError
            As :func:`flwr_gsgm.core.make_optimizer`: an unknown rule or parameter, a
            value out of range.
        """
        params = dict(self.params)
        if "concurrency" in params and params["concurrency"] is None:
            # Given by the user it stays; else the rule learns the engine's limit.
            params["concurrency"] = concurrency
        return make_optimizer(self.name, weights, partition_ids, **params)


class ModelOptimizer:
    """A core rule on the trainable arrays and the buffer rule on the others.

    Parameters
    ----------
    layout : ModelLayout
    arrays : sequence of np.ndarray
        The initial model, in model order (copied).
    make_rule : callable
        :data:`RuleFactory` (e.g. a :class:`RuleSpec`), called with copies of the
        trainable arrays, ``partition_ids`` and ``concurrency``.
    partition_ids : list[int]
        The initially active nodes.
    concurrency : int | None
        The engine's limit on nodes training at once (``max-in-flight``); None (the
        default): every active node.

    Raises
    ------
    ValueError
        As ``make_rule``.
    """

    def __init__(
        self,
        layout: ModelLayout,
        arrays: Sequence[np.ndarray],
        make_rule: RuleFactory,
        partition_ids: list[int],
        concurrency: int | None = None,
    ) -> None:
        self.layout = layout
        self.rule = make_rule(
            [np.array(a, copy=True) for a in layout.trainable_of(arrays)],
            partition_ids,
            concurrency,
        )
        self.buffers = ModelBuffers(layout, layout.buffers_of(arrays))

    @property
    def weights(self) -> list[np.ndarray]:
        """The whole model in model order: the rule's float32 views and the buffers.

        Views of live state: copy before sending them away or keeping them.
        """
        return self.layout.join(self.rule.weights, self.buffers.values)

    @property
    def version(self) -> int:
        """Steps the rule applied (:attr:`ServerOptimizer.version`)."""
        return self.rule.version

    @property
    def counters(self) -> dict[str, int]:
        """The rule's counters (:attr:`ServerOptimizer.counters`)."""
        return self.rule.counters

    @property
    def last_staleness(self) -> int | None:
        """Staleness of the last valid update (:attr:`ServerOptimizer.last_staleness`)."""
        return self.rule.last_staleness

    def on_dispatch(self, partition_id: int) -> None:
        """The current weights were sent to ``partition_id``."""
        self.rule.on_dispatch(partition_id)

    def holds(self, partition_id: int) -> bool:
        """The rule keeps ``partition_id`` idle now (:meth:`ServerOptimizer.holds`)."""
        return self.rule.holds(partition_id)

    def on_update(
        self, partition_id: int, update: ModelUpdate, base_version: int, now: float = 0.0
    ) -> Outcome:
        """The rule on ``update.trainable``; then, unless dropped as stale, the buffers.

        Raises
        ------
        UpdateRejected
            From the rule's validation; the buffers are then unchanged too.
        """
        outcome = self.rule.on_update(partition_id, update.trainable, base_version, now=now)
        if outcome is not Outcome.STALE:
            self.buffers.record(partition_id, update.buffers)
        return outcome

    def next_deadline(self) -> float | None:
        """The rule's next deadline (:meth:`ServerOptimizer.next_deadline`)."""
        return self.rule.next_deadline()

    def on_deadline(self, now: float) -> None:
        """A deadline passed with no other event (:meth:`ServerOptimizer.on_deadline`)."""
        self.rule.on_deadline(now)

    def on_node_joined(self, partition_id: int, now: float = 0.0) -> None:
        """``partition_id`` becomes active (:meth:`ServerOptimizer.on_node_joined`)."""
        self.rule.on_node_joined(partition_id, now=now)

    def on_node_lost(self, partition_id: int, now: float = 0.0) -> None:
        """``partition_id`` left: the rule forgets it and its buffer reports leave the means."""
        self.rule.on_node_lost(partition_id, now=now)
        self.buffers.forget(partition_id)

    def state_dict(self) -> dict[str, Any]:
        """The rule's state and the buffers' (copies)."""
        return {
            "rule": self.rule.state_dict(),
            "buffers": self.buffers.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises
        ------
        ValueError
            As :meth:`ServerOptimizer.load_state_dict` and
            :meth:`ModelBuffers.load_state_dict`.
        """
        backup = self.buffers.state_dict()
        self.buffers.load_state_dict(state["buffers"])
        try:
            self.rule.load_state_dict(state["rule"])
        except Exception:
            self.buffers.load_state_dict(backup)  # all or nothing, as the rule itself
            raise
