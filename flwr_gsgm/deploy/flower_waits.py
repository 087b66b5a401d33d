"""Flower 1.42's fixed waits on the update path, replaced by shorter ones.

None of these waits has a setting in Flower 1.42:

- SuperNode (``flwr.supernode.start_client_internal``): ``time.sleep(3)`` after every
  empty poll of the SuperLink, the main loop's only idle wait. It hits every update:
  the SuperNode polls right after uploading a reply, before the ServerApp can have
  pushed the next message. Replaced by a :class:`~flwr_gsgm.deploy.poll.PollSchedule`
  (fast for a few seconds after a message, then back to the stock 3 s).
- SuperNode: ``time.sleep(0.5)`` while waiting for the ClientApp's reply and for each
  of its objects. Replaced by a short constant poll of the SuperNode's own state.
- SuperNode and ServerApp: ``pull_objects`` backs off 1 s (doubling, capped at 10 s)
  when an object of a message is not uploaded yet, which happens whenever a message
  is pulled between its registration and its upload. Replaced by a shorter back-off.

Each replacement first checks that the installed Flower has the code it replaces
(:func:`check_supernode_waits`, :func:`check_grid_pull`; pinned by
``tests/packaging/test_private_apis.py``) and refuses to start otherwise.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from importlib.metadata import version
from types import ModuleType
from typing import Any

from flwr_gsgm.deploy.poll import PollSchedule

__all__ = [
    "FLOWER_SUPPORTED",
    "SUPERNODE_IDLE_SLEEP",
    "SUPERNODE_REPLY_POLL",
    "check_grid_pull",
    "check_supernode_waits",
    "shorten_reply_pull_backoff",
    "shorten_supernode_waits",
]

#: Flower release series whose private code this module replaces.
FLOWER_SUPPORTED = "1.42"
#: The SuperNode's idle sleep and reply poll in that series (seconds).
SUPERNODE_IDLE_SLEEP = 3
SUPERNODE_REPLY_POLL = 0.5


def _refuse(what: str) -> RuntimeError:
    return RuntimeError(
        f"flwr-gsgm replaces {what} of Flower {FLOWER_SUPPORTED}.x, but flwr "
        f"{version('flwr')} is installed and does not have it: run the stock "
        f"flower-supernode (and flower-superexec), or install flwr=={FLOWER_SUPPORTED}.*"
    )


def _supernode_module() -> ModuleType:
    from flwr.supernode import start_client_internal as module

    return module


def check_supernode_waits() -> None:
    """Raise RuntimeError (naming both Flower versions) unless the SuperNode loop has
    the waits replaced here: ``time.sleep(3)`` in ``start_client_internal``,
    ``time.sleep(0.5)`` in ``_push_messages``, and ``pull_objects`` with back-off
    arguments in the module's namespace."""
    module = _supernode_module()
    loop = inspect.getsource(module.start_client_internal)
    push = inspect.getsource(getattr(module, "_push_messages", lambda: None))
    if getattr(module, "time", None) is not time and not isinstance(module.time, _SuperNodeClock):
        raise _refuse("the SuperNode's `time` module")
    if f"time.sleep({SUPERNODE_IDLE_SLEEP})" not in loop or "_pull_and_store_message(" not in loop:
        raise _refuse(f"the SuperNode's idle `time.sleep({SUPERNODE_IDLE_SLEEP})`")
    if push.count(f"time.sleep({SUPERNODE_REPLY_POLL})") != 2:
        raise _refuse(f"the SuperNode's reply poll `time.sleep({SUPERNODE_REPLY_POLL})`")
    _check_pull_objects(getattr(module, "pull_objects", None), "the SuperNode's object pull")


def check_grid_pull() -> None:
    """Raise RuntimeError unless the ServerApp's HTTP grid pulls reply objects with
    ``pull_objects`` taking back-off arguments."""
    from flwr.superlink.grid import http_grid

    _check_pull_objects(getattr(http_grid, "pull_objects", None), "the ServerApp's object pull")


def _check_pull_objects(fn: Any, what: str) -> None:
    original = getattr(fn, "func", fn)  # a partial installed here already
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        raise _refuse(what) from None
    if getattr(original, "__name__", "") != "pull_objects" or not {
        "initial_backoff",
        "backoff_cap",
    } <= set(params):
        raise _refuse(what)


class _SuperNodeClock:
    """Stands in for the ``time`` module inside ``start_client_internal``: its idle sleep
    follows a poll schedule, its reply poll is shorter, everything else is ``time``."""

    def __init__(self, idle: PollSchedule, reply_poll: float) -> None:
        self.idle = idle
        self.reply_poll = reply_poll

    def sleep(self, seconds: float) -> None:
        if seconds == SUPERNODE_IDLE_SLEEP:
            time.sleep(self.idle.next_wait())
        elif seconds == SUPERNODE_REPLY_POLL:
            time.sleep(self.reply_poll)
        else:
            time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _noting_activity(fn: Callable, schedule: PollSchedule, when: Callable[[Any], bool]):
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if when(result):
            schedule.activity()
        return result

    wrapper.__wrapped_by_flwr_gsgm__ = True
    return wrapper


def shorten_supernode_waits(
    idle: PollSchedule, reply_poll: float, object_backoff: float, object_backoff_cap: float
) -> None:
    """Replace the SuperNode's waits in this process (before it starts).

    Parameters
    ----------
    idle : PollSchedule
        Wait after an empty poll of the SuperLink; activity = a message received or a
        reply sent. ``PollSchedule(0.1, 5, 3)``: 0.1 s polls for 5 s, back to 3 s.
    reply_poll : float
        Seconds between checks for the ClientApp's reply and its objects (> 0).
    object_backoff, object_backoff_cap : float
        First and longest back-off (seconds) when a message object is not uploaded yet.

    Raises
    ------
    RuntimeError
        If the installed Flower lacks the replaced code (:func:`check_supernode_waits`).
    ValueError
        If ``reply_poll`` or a back-off is not > 0, or the cap is below the first.
    """
    _check_positive(reply_poll=reply_poll, object_backoff=object_backoff)
    if object_backoff_cap < object_backoff:
        raise ValueError(
            f"object_backoff_cap must be >= object_backoff ({object_backoff}), "
            f"got {object_backoff_cap!r}"
        )
    check_supernode_waits()
    module = _supernode_module()
    module.time = _SuperNodeClock(idle, reply_poll)
    for name, when in (
        ("_pull_and_store_message", lambda run_id: run_id is not None),
        ("_push_messages", lambda _: True),
    ):
        fn = getattr(module, name)
        if not getattr(fn, "__wrapped_by_flwr_gsgm__", False):
            setattr(module, name, _noting_activity(fn, idle, when))
    original = getattr(module.pull_objects, "func", module.pull_objects)
    module.pull_objects = functools.partial(
        original, initial_backoff=object_backoff, backoff_cap=object_backoff_cap
    )


def shorten_reply_pull_backoff(initial: float = 0.02, cap: float = 1.0) -> None:
    """Replace the ServerApp's 1 s back-off for reply objects not uploaded yet (this
    process; Flower's HTTP grid, the deployment's ServerApp).

    Raises
    ------
    RuntimeError
        If the installed Flower lacks the replaced code (:func:`check_grid_pull`).
    ValueError
        If ``initial`` is not > 0 or ``cap`` < ``initial``.
    """
    _check_positive(initial=initial)
    if cap < initial:
        raise ValueError(f"cap must be >= initial ({initial}), got {cap!r}")
    check_grid_pull()
    from flwr.superlink.grid import http_grid

    original = getattr(http_grid.pull_objects, "func", http_grid.pull_objects)
    http_grid.pull_objects = functools.partial(original, initial_backoff=initial, backoff_cap=cap)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
