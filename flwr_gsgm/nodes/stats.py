"""Per-node counts of a run, and the warnings they call for.

``summary.json`` ``per_node`` holds, for each node by its name ("node 8123 (partition
6)", :attr:`~flwr_gsgm.engine.membership.Node.name`), its ``node_id`` and
``partition_id`` (null for a node without one), what happened to its replies
(:data:`PER_NODE_COUNTS`, the names of the run's own counters) and its state at the end
("active", "backing-off", "lost", "excluded", with the reason of an exclusion). Three
patterns a run's totals hide are logged as warnings and listed in
``summary.json`` ``warnings``:

- a node whose updates are mostly dropped as stale (more than
  :data:`MOSTLY_DROPPED` of at least :data:`MIN_UPDATES_FOR_WARNING` received): the
  model is biased toward the other nodes (raise ``max-staleness``);
- a node whose data barely reach the model: at the end of the run, its updates taken
  into the model (applied or deferred: neither rejected nor dropped as stale) are
  fewer than :data:`LOW_SHARE` of its fair share (those updates of every node over
  the nodes), judged once the fair share is at least :data:`MIN_FAIR_SHARE` updates
  (one node 1000x slower than two others gets about 1 of 3000);
- the model waits on silent nodes: its version has not changed over
  :data:`STALL_FACTOR` x (active nodes) updates received, and some active nodes sent
  nothing since it last changed (e.g. ``cycle-quorum`` 1.0 with a silent node).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any, Protocol

from flwr.common.logger import log

from flwr_gsgm.core import Outcome

__all__ = [
    "LOW_SHARE",
    "MIN_FAIR_SHARE",
    "MIN_UPDATES_FOR_WARNING",
    "MOSTLY_DROPPED",
    "NodeStats",
    "PER_NODE_COUNTS",
]

#: Per-node counts, named as the run's counters in summary.json.
PER_NODE_COUNTS = (
    "updates_received",
    "updates_applied",
    "updates_deferred",
    "updates_stale",
    "rejected",
    "error_replies",
    "dispatch_timeouts",
    "backoffs",
)
#: Fraction of a node's updates dropped as stale above which the run warns.
MOSTLY_DROPPED = 0.5
#: Updates a node must have sent before its stale fraction is judged.
MIN_UPDATES_FOR_WARNING = 4
#: Fraction of its fair share of the updates taken into the model below which a node
#: is named (its data barely reach the model).
LOW_SHARE = 0.1
#: Fair share (updates taken into the model per node) from which shares are judged:
#: below it, one update more or less is a large fraction and says nothing.
MIN_FAIR_SHARE = 10
#: The model "waits" once its version is unchanged over this many updates per active node.
STALL_FACTOR = 10


class NodeView(Protocol):
    """What the per-node report reads of a node (a :class:`~flwr_gsgm.engine.membership.Node`)."""

    @property
    def node_id(self) -> int: ...

    @property
    def identified(self) -> bool: ...

    @property
    def name(self) -> str: ...

    @property
    def excluded(self) -> str: ...

    @property
    def state(self) -> str: ...


class Members(Protocol):
    """What the per-node report reads of the run's nodes (a
    :class:`~flwr_gsgm.engine.membership.Membership`, which counts through this module:
    it is not imported here)."""

    @property
    def nodes(self) -> Mapping[int, NodeView]: ...


class NodeStats:
    """Per-node counts, the stall watch and the run's warnings (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: dict[int, Counter[str]] = {}
        self.warnings: list[str] = []
        self.version = -1  # model version when it last changed ...
        self.since = 0  # ... at this many updates received
        self.last_reply: dict[int, int] = {}  # partition-id -> updates received at its reply
        self.stall_warned = False
        # How warnings name a node: the run's Membership.name sets it ("node 8123
        # (partition 6)"); alone, by its key.
        self.name: Callable[[int], str] = lambda pid: f"partition {pid}"

    def count(self, pid: int, what: str, n: int = 1) -> None:
        """Add ``n`` to count ``what`` (one of :data:`PER_NODE_COUNTS`) of partition ``pid``.

        Raises
        ------
        ValueError
            If ``what`` is not a per-node count.
        """
        if what not in PER_NODE_COUNTS:
            raise ValueError(f"unknown per-node count {what!r}; expected one of {PER_NODE_COUNTS}")
        self.counts.setdefault(pid, Counter())[what] += n

    def record_update(
        self, pid: int, outcome: Outcome | None, received: int, version: int, active: list[int]
    ) -> None:
        """A reply with an update from ``pid``: its outcome (None = rejected), then the
        stall watch with the run's ``received`` count, model ``version`` and ``active`` nodes."""
        self.count(pid, "updates_received")
        name = {
            Outcome.APPLIED: "updates_applied",
            Outcome.DEFERRED: "updates_deferred",
            Outcome.STALE: "updates_stale",
            None: "rejected",
        }[outcome]
        self.count(pid, name)
        self.last_reply[pid] = received
        self._watch_stall(received, version, active)

    def _watch_stall(self, received: int, version: int, active: list[int]) -> None:
        if version != self.version:
            self.version, self.since, self.stall_warned = version, received, False
            return
        if self.stall_warned or received - self.since < STALL_FACTOR * max(1, len(active)):
            return
        silent = [p for p in active if self.last_reply.get(p, -1) < self.since]
        if silent:
            self.stall_warned = True
            self.warn(
                f"the model has not changed over {received - self.since} updates received "
                f"(version {version}): it waits on {', '.join(map(self.name, silent))}, silent "
                f"since update "
                f"{self.since} (lower cycle-quorum, set a cycle budget or a shorter "
                "dispatch-timeout)"
            )

    def warn(self, text: str) -> None:
        """Log ``text`` as a warning and keep it for summary.json (once)."""
        if text not in self.warnings:
            self.warnings.append(text)
            log(WARNING, "[async] warning: %s", text)

    def finish(self, max_staleness: int | None, members: Members | None = None) -> None:
        """End of the run: warn about nodes whose updates were mostly dropped as stale,
        and (with ``members``, the run's nodes) about nodes whose share of the updates
        taken into the model is below :data:`LOW_SHARE` of their fair share (a node
        already named for its stale updates is not named twice)."""
        named: set[int] = set()
        for pid in sorted(self.counts):
            c = self.counts[pid]
            received, stale = c["updates_received"], c["updates_stale"]
            if received >= MIN_UPDATES_FOR_WARNING and stale > MOSTLY_DROPPED * received:
                named.add(pid)
                self.warn(
                    f"{self.name(pid)}: {stale} of its {received} updates were dropped as stale "
                    f"(max-staleness={max_staleness}); the model is biased toward the other "
                    "nodes (raise max-staleness)"
                )
        if members is not None:
            self._warn_low_shares(members, named)

    def _warn_low_shares(self, members: Members, named: set[int]) -> None:
        # An excluded node is already named with its reason; the share is over the others.
        pids = sorted(p for p, node in members.nodes.items() if not node.excluded)
        used = {p: self._used(p) for p in pids}
        total = sum(used.values())
        if not pids or total < MIN_FAIR_SHARE * len(pids):
            return
        fair = total / len(pids)
        for pid in pids:
            if used[pid] < LOW_SHARE * fair and pid not in named:
                self.warn(
                    f"{members.nodes[pid].name}: only {used[pid]} of "
                    f"the {total} updates taken into the model (applied or deferred) came "
                    f"from it, below {LOW_SHARE:.0%} of its fair share {fair:.1f} "
                    f"({total} / {len(pids)} nodes): its data barely reach the model (a slow "
                    "or failing node; see per_node in summary.json)"
                )

    def _used(self, pid: int) -> int:
        """Updates of ``pid`` taken into the model: applied now or deferred to a later step."""
        c = self.counts.get(pid, Counter())
        return int(c["updates_applied"] + c["updates_deferred"])

    def report(self, members: Members) -> dict[str, dict[str, Any]]:
        """``{node name: node_id, partition_id, counts, "state" and "excluded" (the
        reason, or "")}``, in key order; the name and ids as Flower gives them (a node
        without a partition-id: ``partition_id`` None; a key no node holds: named by it,
        ``node_id`` None)."""
        out: dict[str, dict[str, Any]] = {}
        for pid in sorted(set(self.counts) | set(members.nodes)):
            c = self.counts.get(pid, Counter())
            node = members.nodes.get(pid)
            key = node.name if node is not None else f"partition {pid}"
            out[key] = {
                "node_id": node.node_id if node is not None and node.node_id >= 0 else None,
                "partition_id": pid if node is None or node.identified else None,
                **{name: int(c[name]) for name in PER_NODE_COUNTS},
                "state": node.state if node is not None else "refused",
                "excluded": node.excluded if node is not None else "",
            }
        return out

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counts, warnings and the stall watch as python values."""
        return {
            "counts": {pid: dict(c) for pid, c in self.counts.items()},
            "warnings": list(self.warnings),
            "stall": [self.version, self.since, self.stall_warned, dict(self.last_reply)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.counts = {int(pid): Counter(c) for pid, c in state["counts"].items()}
        self.warnings = list(state["warnings"])
        self.version, self.since, self.stall_warned, last = state["stall"]
        self.last_reply = {int(p): int(v) for p, v in last.items()}
