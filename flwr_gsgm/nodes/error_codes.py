"""What the Flower error code of an error reply means, for logs and exclusion reasons.

Flower answers a message with an error reply when the ClientApp raised (code 2),
could not be loaded (1) or crashed (8), when the message's TTL expired before the
node answered (3) or the reply's TTL before it was pulled (4), when the node missed
its heartbeats (5), ... (``flwr.common.constant.ErrorCode``). TTL expiry is named as
such, with the run's ``message-ttl``.
"""

from __future__ import annotations

from flwr.app import Message
from flwr.common.constant import ErrorCode

__all__ = ["ERROR_MEANINGS", "describe_error", "error_summary", "last_line"]

#: What each Flower error code of a reply means.
ERROR_MEANINGS: dict[int, str] = {
    ErrorCode.UNKNOWN: "unknown error",
    ErrorCode.LOAD_CLIENT_APP_EXCEPTION: "the ClientApp failed to load",
    ErrorCode.CLIENT_APP_RAISED_EXCEPTION: "the ClientApp raised an exception",
    ErrorCode.MESSAGE_UNAVAILABLE: "TTL expiry: the message was not answered within "
    "message-ttl={ttl} s (or was removed from the SuperLink)",
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "TTL expiry: the reply expired (message-ttl={ttl} s) "
    "before it was pulled",
    ErrorCode.NODE_UNAVAILABLE: "the node is unavailable (it missed its heartbeats)",
    ErrorCode.MOD_FAILED_PRECONDITION: "a mod's precondition failed",
    ErrorCode.INVALID_FAB: "the FAB is invalid",
    ErrorCode.CLIENT_APP_CRASHED: "the ClientApp crashed",
}


def describe_error(code: int, message_ttl: float) -> str:
    """What Flower error ``code`` means (TTL expiry named with ``message_ttl`` seconds)."""
    return ERROR_MEANINGS.get(code, f"unknown error code {code}").format(ttl=message_ttl)


def last_line(reply: Message) -> str:
    """The last line of an error reply's reason (a traceback's exception line)."""
    lines = (reply.error.reason or "").strip().splitlines()
    return lines[-1] if lines else ""


def error_summary(reply: Message, message_ttl: float) -> str:
    """``code N: meaning: last line of the reason`` of an error reply."""
    code = reply.error.code
    last = last_line(reply)
    return f"code {code}: {describe_error(code, message_ttl)}" + (f": {last}" if last else "")
