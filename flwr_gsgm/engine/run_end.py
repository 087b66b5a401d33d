"""How a run ends: "completed" (a budget is spent), "diverged" or "failed".

A run diverges when its model does (:mod:`flwr_gsgm.engine.divergence`: non-finite weights,
a non-finite or exploding test loss, or most recent replies of every node rejected as
out of scale); it ends at once, ``summary.json`` records ``status`` "diverged" and
the reason, and ``start()`` raises :class:`RunDiverged` (a :class:`RunFailed`).

A run fails when no node is left to train before its budget is spent: every node
was excluded or refused, or the nodes that left the federation did not come back
within ``rejoin-timeout`` wall seconds (the run waits for them as long as nothing is
in flight and no node is backing off). The reason names each partition's state (the
first :data:`NAMED_IN_REASON`; the others are counted);
``summary.json`` records ``status`` and ``status_reason``, and the strategy's
``start()`` raises :class:`RunFailed` with the reason, so the ServerApp ends with an
error and ``flwr run`` reports the run as failed (never as "completed").

A run fails the same way, at once, when the server runs out of memory (the reason
quotes the expected peak the engine logged at start, :mod:`flwr_gsgm.engine.memory`) or a
checkpoint cannot be written (the reason names the file and the OS error; the
previous checkpoint stays valid).
"""

from __future__ import annotations

import time
from logging import WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log

from flwr_gsgm.engine.divergence import DivergenceWatch

if TYPE_CHECKING:
    from flwr_gsgm.engine.membership import Membership

__all__ = ["COMPLETED", "DIVERGED", "FAILED", "RunDiverged", "RunEnd", "RunFailed"]

COMPLETED = "completed"
FAILED = "failed"
DIVERGED = "diverged"
#: Partitions a failed run's reason names one by one; the rest are counted.
NAMED_IN_REASON = 5


class RunFailed(RuntimeError):
    """The run ended before its budget was spent: no node was left to train.

    Attributes
    ----------
    reason : str
        Why (each partition's state, the budget reached).
    result : Any
        The strategy's result up to the failure (an ``AsyncResult``: rows, counters,
        final weights), so a caller can still write its outputs; None if unknown.
    status : str
        The run's ``status``: "failed" (:class:`RunDiverged`: "diverged").
    """

    status = FAILED

    def __init__(self, reason: str, result: Any = None) -> None:
        super().__init__(f"the run {self.status}: {reason}")
        self.reason = reason
        self.result = result


class RunDiverged(RunFailed):
    """The run's model diverged (:mod:`flwr_gsgm.engine.divergence`); the run ended there.

    A :class:`RunFailed` (an ``except RunFailed`` catches both), with ``status``
    "diverged"; ``reason`` starts with one of :data:`flwr_gsgm.engine.divergence.KINDS`,
    ``result`` holds the ``AsyncResult`` so far (its report's ``last_finite`` the
    model of the last evaluation before the divergence, if any), or None (Flower's
    FedAvg and FedAvgM).
    """

    status = DIVERGED


class RunEnd:
    """Decides when a run with nothing in flight must end, and says why (see module)."""

    def __init__(self, max_updates: int, rejoin_timeout: float, members: Membership) -> None:
        """``max_updates`` (the update budget, for the reason) and ``rejoin_timeout``
        (seconds to wait for a lost node) are the two settings it reads."""
        self.max_updates = max_updates
        self.rejoin_timeout = rejoin_timeout
        self.members = members
        self.status = COMPLETED
        self.reason = ""
        self.waiting_since: float | None = None  # wall time the wait for lost nodes began
        self.watch = DivergenceWatch()  # check 4 of flwr_gsgm.engine.divergence

    @property
    def failed(self) -> bool:
        """True once the run has failed."""
        return self.status == FAILED

    @property
    def diverged(self) -> bool:
        """True once the run's model has diverged."""
        return self.status == DIVERGED

    def on_reply(self, partition_id: int, rejected: str | None, received: int) -> bool:
        """An update received from ``partition_id`` (``rejected``: why it was rejected,
        None if accepted); True if the run diverged by it (check 4 of
        :mod:`flwr_gsgm.engine.divergence`: every node's recent updates out of scale)."""
        self.diverge(self.watch.reply(partition_id, rejected, self.members.active_ids()), received)
        return self.diverged

    def diverge(self, reason: str | None, received: int) -> None:
        """The model diverged (``reason``: :mod:`flwr_gsgm.engine.divergence`; None: it did
        not) at ``received`` updates: the run ends."""
        if reason is None or self.status != COMPLETED:
            return
        self.status = DIVERGED
        self.reason = reason
        log(WARNING, "[async] diverged at %d updates; stopping: %s", received, reason)

    def fail(self, reason: str) -> None:
        """The run cannot go on (out of memory, a checkpoint that cannot be written):
        it fails with ``reason`` (unless it already ended otherwise)."""
        if self.status != COMPLETED:
            return
        self.status = FAILED
        self.reason = reason
        log(WARNING, "[async] run failed: %s", reason)

    def nothing_in_flight(self, received: int) -> bool:
        """Nothing is in flight and the budgets leave room: True if the run must end now.

        False while a node is active, backing off or offline (until a time of the time
        model's availability), or, for up to ``rejoin_timeout``
        wall seconds, while a node that left may come back; then the run fails.
        """
        states = {pid: node.state for pid, node in self.members.nodes.items()}
        if any(s in ("active", "backing-off", "offline") for s in states.values()):
            self.waiting_since = None
            return False
        nodes = self.members.nodes
        lost = sorted(p for p, n in nodes.items() if n.state == "lost" and n.may_return)
        now = time.monotonic()
        if lost and self.waiting_since is None:
            self.waiting_since = now
            log(
                WARNING,
                "[async] no node left to train; waiting up to rejoin-timeout=%s s for "
                "%s to come back",
                self.rejoin_timeout,
                self.members.names(lost),
            )
        if lost and now - self.waiting_since <= self.rejoin_timeout:
            return False
        self._fail(received, lost)
        return True

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``diverged`` (always False: a diverged run saves no checkpoint) and the
        divergence window (``divergence``)."""
        return {"diverged": self.diverged, "divergence": self.watch.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (its ``diverged`` is False: only the window loads)."""
        self.watch.load_state_dict(state["divergence"])

    def _fail(self, received: int, lost: list[int]) -> None:
        nodes = sorted(self.members.nodes.items())
        parts = [
            f"{node.name} excluded ({node.excluded})"
            if node.excluded
            else f"{node.name} lost (left the federation)"
            for _, node in nodes[:NAMED_IN_REASON]
        ]
        rest = [node for _, node in nodes[NAMED_IN_REASON:]]
        if rest:  # 300 nodes made a 100 kB reason; each exclusion was logged when it happened
            excluded = sum(bool(node.excluded) for node in rest)
            parts.append(
                f"{len(rest)} more nodes ({excluded} excluded, {len(rest) - excluded} "
                "lost; each logged when it happened)"
            )
        wait = f"; none came back within rejoin-timeout={self.rejoin_timeout} s" if lost else ""
        self.status = FAILED
        self.reason = (
            f"no node left to train after {received} of {self.max_updates} updates: "
            + "; ".join(parts)
            + wait
        )
        log(WARNING, "[async] run failed: %s", self.reason)
