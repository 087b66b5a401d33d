"""A device profile file: the user's own fleet, one entry per node, for the time model.

Run config ``device-profile`` may name a ``.csv`` or ``.toml`` file instead of a
built-in profile (``docs/GSGM.md``, "Time model"). Each entry gives one node's

- ``partition-id``: the node's partition-id, an integer >= 0, each at most once;
- ``step-seconds``: seconds of one step of local work on that node, a number > 0;
- ``bandwidth``: bytes per second, each way, a number > 0; empty or ``inf``: bytes
  are free;
- ``latency-seconds``: fixed seconds per message (both ways together), a number >= 0.

and, optionally (read with run config ``availability = "device-profile"``,
:mod:`flwr_gsgm.simulation.availability`), when the node is online, either

- ``online-intervals``: its online intervals in virtual seconds, each ``start:end``
  (``0 <= start < end``, sorted, not overlapping), separated by spaces in a CSV cell,
  or a TOML array of ``[start, end]`` pairs; outside them the node is offline; or
- ``mean-online-seconds`` and ``mean-offline-seconds``: the mean lengths (> 0) of its
  online and offline intervals, drawn as the built-in two-state process is.

A file gives these columns or keys for every node or for none; in a CSV file a row
leaves empty the cells of the form it does not use.

CSV: a header row with those column names (in any order), then one row per node;
blank lines are skipped::

    partition-id,step-seconds,bandwidth,latency-seconds
    0,0.05,2500000,0.05
    1,0.20,,0.05
    2,0.11,1.2e6,0.30

TOML: one ``[[node]]`` table per node with those keys (``bandwidth = inf`` or ``""``
for free bytes)::

    [[node]]
    partition-id = 0
    step-seconds = 0.05
    bandwidth = 2.5e6
    latency-seconds = 0.05
    online-intervals = [[0, 300], [900, 1500]]

Both are read with the standard library (``csv``, ``tomllib``). A malformed file is
refused with a ``ValueError`` naming the file, where (CSV: the line number, counting
the header as line 1; TOML: the ``[[node]]`` table's number, counting from 1), the
field and what was expected.
"""

from __future__ import annotations

import csv
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from flwr_gsgm.simulation.availability import OnOffModel

__all__ = [
    "AVAILABILITY_FIELDS",
    "FIELDS",
    "PROFILE_FILE_SUFFIXES",
    "NodeProfile",
    "read_profile_file",
]

#: The fields of one entry, in the order of the docs' examples.
FIELDS = ("partition-id", "step-seconds", "bandwidth", "latency-seconds")
#: The optional fields of a node's availability (intervals, or the two means).
AVAILABILITY_FIELDS = ("online-intervals", "mean-online-seconds", "mean-offline-seconds")
#: The file name endings ``device-profile`` reads as a profile file (case-insensitive).
PROFILE_FILE_SUFFIXES = (".csv", ".toml")


@dataclass(frozen=True)
class NodeProfile:
    """One node of a profile file.

    Parameters
    ----------
    step_seconds : float
        Seconds of one step of local work on this node (> 0).
    bandwidth : float
        Bytes per second, each way (> 0); ``math.inf``: bytes are free.
    latency_seconds : float
        Fixed seconds per message, both ways together (>= 0).
    availability : OnOffModel | tuple[tuple[float, float], ...] | None
        When the node is online: a two-state model of mean durations, its online
        intervals ``(start, end)`` in seconds, or None (the file gives none).
    """

    step_seconds: float
    bandwidth: float
    latency_seconds: float
    availability: OnOffModel | tuple[tuple[float, float], ...] | None = None


def read_profile_file(path: str | Path) -> dict[int, NodeProfile]:
    """Read a profile file: ``{partition_id: NodeProfile}``, in the file's order.

    Parameters
    ----------
    path : str | Path
        A ``.csv`` or ``.toml`` file (the format follows the ending, in any case).

    Raises
    ------
    ValueError
        If the file does not exist, has another ending, cannot be decoded, has no
        node, or an entry is malformed (a missing or unknown column or key, a value
        that is not a number, out of range, a partition-id given twice); the message
        names the file, the CSV line or TOML ``[[node]]`` number, the field, the value
        and what was expected.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in PROFILE_FILE_SUFFIXES:
        raise ValueError(
            f"device profile file {str(path)!r}: expected a name ending in .csv or .toml"
        )
    if not path.is_file():
        raise ValueError(f"device profile file {str(path)!r}: no such file")
    nodes = _read_csv(path) if suffix == ".csv" else _read_toml(path)
    if not nodes:
        raise ValueError(
            f"device profile file {str(path)!r}: no node; expected one entry per node "
            f"with {', '.join(FIELDS)}"
        )
    return nodes


def _read_csv(path: Path) -> dict[int, NodeProfile]:
    # utf-8-sig: a spreadsheet's byte order mark is not part of the first column's name.
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        fail = _Failure(path, "line 1")
        if header is None:
            fail.whole(f"empty; expected a header row {','.join(FIELDS)}")
        columns = [c.strip() for c in header]
        _check_names(fail, "column", columns)
        nodes: dict[int, NodeProfile] = {}
        where: dict[int, str] = {}
        for row in reader:
            if not any(c.strip() for c in row):
                continue  # a blank line
            fail = _Failure(path, f"line {reader.line_num}")
            if len(row) != len(columns):
                fail.whole(f"{len(row)} fields; expected {len(columns)} ({','.join(columns)})")
            _add(fail, nodes, where, dict(zip(columns, (c.strip() for c in row))))
    return nodes


def _read_toml(path: Path) -> dict[int, NodeProfile]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"device profile file {str(path)!r}: not valid TOML: {err}") from err
    other = sorted(set(data) - {"node"})
    if other:
        raise ValueError(
            f"device profile file {str(path)!r}: unknown top-level key(s) {other}; expected "
            "only [[node]] tables"
        )
    tables = data.get("node", [])
    if not isinstance(tables, list):
        raise ValueError(
            f"device profile file {str(path)!r}: 'node' is a {type(tables).__name__}; "
            "expected [[node]] tables (an array of tables)"
        )
    nodes: dict[int, NodeProfile] = {}
    where: dict[int, str] = {}
    for number, table in enumerate(tables, start=1):
        fail = _Failure(path, f"[[node]] {number} (counting from 1)")
        if not isinstance(table, dict):
            fail.whole(f"a {type(table).__name__}; expected a table")
        _check_names(fail, "key", list(table))
        _add(fail, nodes, where, table)
    return nodes


@dataclass(frozen=True)
class _Failure:
    """Raises the ``ValueError`` of one place in the file."""

    path: Path
    where: str

    def whole(self, what: str) -> NoReturn:
        raise ValueError(f"device profile file {str(self.path)!r}, {self.where}: {what}")

    def field(self, name: str, value: Any, expected: str) -> NoReturn:
        raise ValueError(
            f"device profile file {str(self.path)!r}, {self.where}: {name} = {value!r}: "
            f"expected {expected}"
        )


def _check_names(fail: _Failure, kind: str, names: list[str]) -> None:
    """Every one of :data:`FIELDS`, and optionally :data:`AVAILABILITY_FIELDS`: a
    missing, unknown or repeated one is refused."""
    expected = f"{', '.join(FIELDS)}, optionally {', '.join(AVAILABILITY_FIELDS)}"
    missing = [f for f in FIELDS if f not in names]
    if missing:
        fail.whole(f"missing {kind}(s) {missing}; expected {expected}")
    unknown = [n for n in names if n not in FIELDS + AVAILABILITY_FIELDS]
    if unknown:
        fail.whole(f"unknown {kind}(s) {unknown}; expected {expected}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        fail.whole(f"{kind}(s) {repeated} given more than once")


def _add(
    fail: _Failure, nodes: dict[int, NodeProfile], where: dict[int, str], entry: dict[str, Any]
) -> None:
    """Check one entry (CSV strings or TOML values) and add it to ``nodes``."""
    pid = _integer(fail, "partition-id", entry["partition-id"])
    if pid in nodes:
        fail.field("partition-id", pid, f"each partition-id once; it is already on {where[pid]}")
    step = _number(fail, "step-seconds", entry["step-seconds"], "a finite number > 0 (seconds)")
    if not (math.isfinite(step) and step > 0):
        fail.field("step-seconds", entry["step-seconds"], "a finite number > 0 (seconds)")
    raw_bw = entry["bandwidth"]
    what_bw = "a number > 0 (bytes per second), or empty or inf (free)"
    if raw_bw == "" or (isinstance(raw_bw, str) and raw_bw.lower() in ("inf", "+inf")):
        bandwidth = math.inf
    else:
        bandwidth = _number(fail, "bandwidth", raw_bw, what_bw)
        if not bandwidth > 0:  # nan is refused too
            fail.field("bandwidth", raw_bw, what_bw)
    latency = _number(fail, "latency-seconds", entry["latency-seconds"], "a finite number >= 0")
    if not (math.isfinite(latency) and latency >= 0):
        fail.field("latency-seconds", entry["latency-seconds"], "a finite number >= 0 (seconds)")
    nodes[pid] = NodeProfile(step, bandwidth, latency, _availability(fail, entry))
    where[pid] = fail.where


def _availability(
    fail: _Failure, entry: dict[str, Any]
) -> OnOffModel | tuple[tuple[float, float], ...] | None:
    """An entry's availability: its ``online-intervals``, or its two means, or None.
    An empty CSV cell is a field the entry does not give."""
    given = {k: entry[k] for k in AVAILABILITY_FIELDS if k in entry and entry[k] != ""}
    if not given:
        return None
    means = ("mean-online-seconds", "mean-offline-seconds")
    if "online-intervals" in given:
        if len(given) > 1:
            fail.whole(
                f"both online-intervals and {sorted(set(given) - {'online-intervals'})}; "
                "expected online-intervals or the two means, not both"
            )
        return _intervals(fail, given["online-intervals"])
    if len(given) == 1:
        (key,) = given
        other = means[1] if key == means[0] else means[0]
        fail.whole(f"{key} without {other}; expected both means, or online-intervals")
    what = "a finite number > 0 (seconds)"
    values = []
    for key in means:
        value = _number(fail, key, given[key], what)
        if not (math.isfinite(value) and value > 0):
            fail.field(key, given[key], what)
        values.append(value)
    return OnOffModel(values[0], values[1], source="the device profile file")


def _intervals(fail: _Failure, raw: Any) -> tuple[tuple[float, float], ...]:
    """``online-intervals``: a CSV cell ``"0:300 900:1500"`` or a TOML array of pairs;
    each ``0 <= start < end``, finite, sorted and not overlapping."""
    what = (
        "online intervals start:end in seconds (a TOML array of [start, end] pairs, or "
        "'0:300 900:1500' in a CSV cell), 0 <= start < end, sorted, not overlapping"
    )
    pairs: list[Any]
    if isinstance(raw, str):
        pairs = [p.split(":") for p in raw.split()]
    elif isinstance(raw, list):
        pairs = raw
    else:
        fail.field("online-intervals", raw, what)
    out: list[tuple[float, float]] = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            fail.field("online-intervals", raw, what)
        start, end = (_number(fail, "online-intervals", v, what) for v in pair)
        previous_end = out[-1][1] if out else 0.0
        if not (math.isfinite(end) and previous_end <= start < end):
            fail.field("online-intervals", raw, what)
        out.append((start, end))
    if not out:
        fail.field("online-intervals", raw, what)
    return tuple(out)


def _integer(fail: _Failure, name: str, raw: Any) -> int:
    expected = "an integer >= 0"
    if isinstance(raw, bool):
        fail.field(name, raw, expected)
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str):
        try:
            value = int(raw)
        except ValueError:
            fail.field(name, raw, expected)
    else:
        fail.field(name, raw, expected)
    if value < 0:
        fail.field(name, raw, expected)
    return value


def _number(fail: _Failure, name: str, raw: Any, expected: str) -> float:
    """``raw`` as a float: a TOML int or float, or a CSV string that ``float`` reads."""
    if isinstance(raw, bool):
        fail.field(name, raw, expected)
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            pass
    fail.field(name, raw, expected)
