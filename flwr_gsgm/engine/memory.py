"""The server's expected peak memory, and the memory the machine has for it.

At start the engine logs a :class:`MemoryEstimate` (rule, averaging, nodes, model
bytes, messages in flight) and warns when it exceeds :func:`available_memory`; a
``MemoryError`` during the run becomes a failed run whose reason quotes the estimate
(:mod:`flwr_gsgm.engine.run_end`). Each part says what it keeps: the rule its model copies
(:meth:`flwr_gsgm.core.ServerOptimizer.model_copies`), the dispatcher the messages
in flight and the copies each costs (:class:`flwr_gsgm.engine.dispatcher.Dispatcher`).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from pathlib import Path

from flwr.common.logger import log

__all__ = ["MemoryEstimate", "PeakMemory", "available_memory", "size_text"]

#: Files read for the memory available: /proc/meminfo, then the cgroup's limit.
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def size_text(nbytes: float) -> str:
    """``nbytes`` in bytes, KiB, MiB or GiB with one decimal: ``"12 B"``, ``"4.0 MiB"``."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit, shift in (("KiB", 10), ("MiB", 20)):
        if nbytes < 1 << (shift + 10):
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes / (1 << 30):.1f} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected peak memory of the server's model state, in bytes.

    Parameters
    ----------
    rule : str
        The server rule's name.
    averaging : str | None
        GSGM's averaging in use ("slot" or "table"); None for the other rules.
    nodes : int
        Active nodes at start.
    rule_copies : int
        Model copies the rule keeps at most (trainable float32 each).
    trainable_bytes : int
        Bytes of one trainable copy (4 per trainable value).
    model_bytes : int
        Bytes of the whole model (every array, buffers included): a message's size.
    in_flight : int
        Train messages in flight at most.
    copies_per_message : int
        Model copies each message in flight costs the server.
    """

    rule: str
    averaging: str | None
    nodes: int
    rule_copies: int
    trainable_bytes: int
    model_bytes: int
    in_flight: int
    copies_per_message: int

    @property
    def total_bytes(self) -> int:
        """The rule's copies plus the engine's copies of the messages in flight."""
        engine = self.in_flight * self.copies_per_message * self.model_bytes
        return self.rule_copies * self.trainable_bytes + engine

    def describe(self) -> str:
        """One line: the total, then what it is made of."""
        averaging = f", averaging={self.averaging!r}" if self.averaging else ""
        return (
            f"{size_text(self.total_bytes)} ({self.rule}{averaging}, {self.nodes} nodes: "
            f"{self.rule_copies} model copies of {size_text(self.trainable_bytes)} in the rule + "
            f"{self.in_flight} messages in flight x {self.copies_per_message} copies of "
            f"{size_text(self.model_bytes)})"
        )

    def advice(self) -> str:
        """What lowers the peak: slot averaging and a ``max-in-flight`` limit."""
        return (
            'lower it with averaging="slot" (GSGM: at most 2 + nodes model copies, table '
            "averaging 3 + 2 x nodes) or max-in-flight (fewer messages in flight: each costs "
            f"{self.copies_per_message} model copies), or use fewer nodes or a smaller model"
        )


class PeakMemory:
    """The expected peak memory of a run and the memory available at its start.

    :meth:`at_start` logs them; :meth:`out_of_memory` is the reason of a run that
    ran out of memory (where, and the estimate). Before :meth:`at_start` (the rule
    could not be built) the reason says so.
    """

    def __init__(self) -> None:
        self.estimate: MemoryEstimate | None = None
        self.available: tuple[int, str] | None = None  # (bytes, source)

    def at_start(self, estimate: MemoryEstimate) -> str | None:
        """Log ``estimate`` beside the memory available now; return the warning to
        give (None if the estimate fits, or the memory available is unknown)."""
        self.estimate, self.available = estimate, available_memory()
        log(
            INFO,
            "[async] expected peak server memory %s; memory available %s",
            estimate.describe(),
            self.available_text(),
        )
        if self.available is None or estimate.total_bytes <= self.available[0]:
            return None
        return (
            f"the expected peak server memory {estimate.describe()} exceeds the memory "
            f"available {self.available_text()}: {estimate.advice()}"
        )

    def available_text(self) -> str:
        """The memory available at start, with its source, or "unknown"."""
        if self.available is None:
            return "unknown"
        return f"{size_text(self.available[0])} ({self.available[1]})"

    def out_of_memory(self, err: MemoryError, received: int, max_updates: int) -> str:
        """The reason of a run that ran out of memory (``err``) after ``received`` of
        ``max_updates`` updates: where, and the estimate with its advice."""
        detail = f": {err}" if str(err) else ""
        where = f"after {received} of {max_updates} updates"
        if self.estimate is None:
            return (
                f"out of memory (MemoryError{detail}) {where}, while the server rule was "
                "built (before the peak memory was estimated: the model alone is too large)"
            )
        return (
            f"out of memory (MemoryError{detail}) {where}; the expected peak server memory "
            f"is {self.estimate.describe()}, the memory available at start "
            f"{self.available_text()}: {self.estimate.advice()}"
        )


def available_memory() -> tuple[int, str] | None:
    """``(bytes, source)`` of the memory available to this process, or None if unknown.

    The lower of ``MemAvailable`` in /proc/meminfo and the cgroup's room (cgroup v2
    ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``; an unlimited cgroup gives none); ``source`` names the
    one used. Unreadable files count as unknown, never as an error.
    """
    found: list[tuple[int, str]] = []
    meminfo = _meminfo_available()
    if meminfo is not None:
        found.append((meminfo, "MemAvailable in /proc/meminfo"))
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_int(CGROUP / limit), _read_int(CGROUP / usage)
        # v1 reports "no limit" as a huge number: the lower of the two wins anyway.
        if cap is not None and used is not None:
            found.append((max(0, cap - used), f"cgroup {CGROUP / limit} less {usage}"))
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    """The integer in ``path``; None if missing, unreadable or "max" (no limit)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
