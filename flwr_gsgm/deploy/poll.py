"""A poll schedule: fast right after activity, backing off to a slow idle poll.

A SuperNode (or its executor) that has just answered a message is likely to get the
next one within a fraction of a second, so it polls fast for a short window; a node
nobody sends work to must not spin, so after the window the wait doubles per empty
poll up to the idle interval.
"""

from __future__ import annotations

import math
import time

__all__ = ["PollSchedule"]


class PollSchedule:
    """Seconds to wait before the next poll.

    Parameters
    ----------
    fast : float
        Wait (seconds) while within ``window`` seconds of the last activity; > 0.
    window : float
        Seconds after an activity during which polls stay fast; >= 0.
    idle : float
        Longest wait (seconds), reached by doubling ``fast`` once the window has
        passed; >= ``fast``.

    Raises
    ------
    ValueError
        If a value is out of range (the message names it).
    """

    def __init__(self, fast: float, window: float, idle: float) -> None:
        for name, value, ok, expected in (
            ("fast", fast, fast > 0, "> 0 seconds"),
            ("window", window, window >= 0, ">= 0 seconds"),
            ("idle", idle, idle >= fast, f">= fast ({fast}) seconds"),
        ):
            if not (ok and math.isfinite(value)):
                raise ValueError(f"poll {name} must be {expected}, got {value!r}")
        self.fast, self.window, self.idle = float(fast), float(window), float(idle)
        self.last_activity = -math.inf
        self._wait = self.fast

    def activity(self, now: float | None = None) -> None:
        """Note work done at ``now`` (``time.monotonic()`` seconds; default: now)."""
        self.last_activity = time.monotonic() if now is None else now
        self._wait = self.fast

    def next_wait(self, now: float | None = None) -> float:
        """Seconds to wait before the next poll (one empty poll has just happened)."""
        now = time.monotonic() if now is None else now
        if now - self.last_activity <= self.window:
            return self.fast
        self._wait = min(self.idle, self._wait * 2)
        return self._wait
