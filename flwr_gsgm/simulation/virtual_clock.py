"""Seeded virtual clock: reproducible compute and communication times for simulation.

In a simulation every node runs on the same machine, so real arrival order depends
on the machine's load. The engine instead draws each dispatch's *virtual* duration
when it sends the message, and applies replies in order of virtual finish time
(``docs/ARCHITECTURE.md``, "Making asynchronous simulation reproducible").

The time model (``docs/GSGM.md``, "Time model"): a message's duration is

    compute       = work_steps x seconds_per_step x speed_factor[node] x jitter_c
    communication = (latency + 2 x message_bytes / bandwidth[node]) x jitter_m
    duration      = compute + communication
    applied       = max(server free, sent + duration) + server_seconds

where ``work_steps`` is the local work the message asks for (mini-batches in
gradient mode, SGD steps in delta and weights modes, see :meth:`VirtualClock.work_steps`)
and ``message_bytes`` the model's bytes, charged once down and once up (a reply in
every client mode is model-sized). The device profile (:data:`DEVICE_PROFILES`)
gives the seconds per step, the per-node speed factors and bandwidths, the latency
and the server's seconds per reply; run config ``device-profile`` names one, or the
path of a ``.csv`` or ``.toml`` file with each node's own figures
(:mod:`flwr_gsgm.simulation.profile_file`). The server handles one reply at a time
(``server_seconds`` each: pull, checks, the rule's step, the next push), so replies
that finish together wait their turn (:meth:`VirtualClock.serve`); a node's next
message leaves when its reply is handled.

Every draw depends only on ``(seed, partition_id, dispatch_index)`` (each quantity
from its own derived stream), never on the order in which draws are made, so two
runs with the same seed see the same durations whatever happens in between. The
compute jitter keeps the stream of the clock before communication was modelled,
so the ``uniform`` profile with one step of work gives the same durations, bit for
bit, as before.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from flwr_gsgm.simulation.availability import (
    ALWAYS,
    AVAILABILITY_MODELS,
    FROM_PROFILE,
    Availability,
)
from flwr_gsgm.simulation.power import POWER_MODELS, Power
from flwr_gsgm.simulation.profile_file import (
    PROFILE_FILE_SUFFIXES,
    NodeProfile,
    read_profile_file,
)
from flwr_gsgm.simulation.seeds import derive_seed
from flwr_gsgm.simulation.speed_variance import NONE, SPEED_VARIANCE_MODELS, slowdown

__all__ = [
    "APPFL10_STEP_SECONDS",
    "DEVICE_PROFILES",
    "DEVICE_PROFILE_EXPECTED",
    "LOOPBACK_LATENCY_SECONDS",
    "LOOPBACK_STEP_SECONDS",
    "OFFLINE_DETECTION_SECONDS",
    "DeviceProfile",
    "VirtualClock",
    "derive_seed",
    "is_device_profile",
]


# Stream tags of derive_seed: one per quantity, so adding one leaves the others unchanged.
_SLOW_SET = 0x5EED  # which nodes are slow (slow-set speeds); the pre-time-model tag
_SPEED = 0x5BEED  # a node's log-normal compute factor
_BANDWIDTH = 0xBA4D  # a node's log-normal bandwidth
_COMMUNICATION = 0xC044  # a message's communication jitter

#: Seconds of one SGD step of the Fashion-MNIST CNN (``clients.models.SmallCNN``) at
#: batch 32, one thread, on the project's machine: median of 8 repetitions of 200
#: steps with SGD momentum 0.9 (0.0174-0.0205 s), measured 2025 for the time model.
LOOPBACK_STEP_SECONDS = 0.018
#: Seconds the server spends on each reply (pull, checks, the rule's step, the next
#: push), one reply at a time, in a deployment on this machine: the deployment race's
#: reference probe, 10 SuperNodes answering at once, 7.646 s per round trip over its 10
#: replies (``docs/results/deployment_race``; ``benchmarks/race_deployment.py``
#: ``server_seconds``).
LOOPBACK_SERVER_SECONDS = 0.765
#: Seconds a message spends in Flower's transport with the warm executor on loopback,
#: the server's own time aside: the race's quiet probe (2 SuperNodes, one batch per
#: message) measured a latency of 1.669 s per round trip, less the server's
#: ``LOOPBACK_SERVER_SECONDS`` (``model_latency`` in the race script). The earlier
#: figure, 2.167 s (docs/DEPLOYMENT.md section 8), counted no server queue.
LOOPBACK_LATENCY_SECONDS = 0.904
#: Seconds after a node goes offline until the server learns of it: Flower's SuperLink
#: holds a node online for HEARTBEAT_PATIENCE heartbeat intervals after its last
#: heartbeat (Flower 1.42, ``flwr/common/constant.py``: 2 x 30 s), then answers its
#: messages with a node-unavailable error; a node that leaves without a word (its
#: battery, its network) is lost that late.
OFFLINE_DETECTION_SECONDS = float(HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL)
#: Seconds per local step of APPFL's 10 clients, as measured for FedCompass's
#: efficiency benchmark (CIFAR-10, ResNet-18): Li et al., "FedCompass: Efficient
#: Cross-Silo Federated Learning on Heterogeneous Client Devices Using a
#: Computing Power-Aware Scheduler", ICLR 2024, arXiv 2309.14675; APPFL
#: (github.com/APPFL/APPFL). Slowest / fastest: 0.889 / 0.099 = 9.0x; median 0.312 s.
APPFL10_STEP_SECONDS = (0.244, 0.340, 0.112, 0.102, 0.581, 0.727, 0.865, 0.889, 0.099, 0.284)


@dataclass(frozen=True)
class DeviceProfile:
    """What a kind of device costs: compute speed, network, and their spread.

    Parameters
    ----------
    name : str
        The value of run config ``device-profile``.
    step_seconds : float | None
        Seconds of one step of local work (one mini-batch of the Fashion-MNIST CNN at
        batch 32) on a node of speed factor 1; None: the clock's ``base_duration``.
    latency_seconds : float
        Fixed seconds per message (both ways together), before its bytes.
    bandwidth : float
        Bytes per second of a median node, each way; ``math.inf``: bytes are free.
    speeds : str
        ``"slow-set"``: a seeded ``slow_fraction`` of the nodes are ``slow_factor``
        times slower, the rest factor 1; ``"log-normal"``: each node's factor is
        ``exp(speed_sigma * z)``, z standard normal (median 1); ``"table"``: node
        ``p``'s factor is ``speed_table[p % len(speed_table)]``; ``"file"``: each
        node's from a profile file (the clock builds that profile itself).
    speed_sigma, bandwidth_sigma : float
        Log-normal spread (sigma of the log) of the per-node compute factor and of the
        per-node bandwidth (0: every node the median).
    source : str
        Where the figures come from (``docs/GSGM.md``, "Time model").
    speed_table : tuple[float, ...]
        ``"table"`` speeds: the factors (dimensionless, 1 = ``step_seconds``).
    server_seconds : float
        Seconds the server spends on each reply, one reply at a time (0: free, replies
        never wait for each other).
    """

    name: str
    step_seconds: float | None
    latency_seconds: float
    bandwidth: float
    speeds: str
    speed_sigma: float = 0.0
    bandwidth_sigma: float = 0.0
    source: str = ""
    speed_table: tuple[float, ...] = ()
    server_seconds: float = 0.0


#: The named device profiles (run config ``device-profile``); ``docs/GSGM.md``,
#: "Time model", gives each one's figures and sources.
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            "uniform",
            step_seconds=None,
            latency_seconds=0.0,
            bandwidth=math.inf,
            speeds="slow-set",
            source="the clock of the published runs: compute only",
        ),
        DeviceProfile(
            "edge",
            step_seconds=4 * LOOPBACK_STEP_SECONDS,
            latency_seconds=0.05,
            bandwidth=2.5e6,
            speeds="log-normal",
            speed_sigma=0.6,
            bandwidth_sigma=0.8,
            source="FedScale's log-normal device speed (sigma 0.6); assumed phone network",
        ),
        DeviceProfile(
            "loopback",
            step_seconds=LOOPBACK_STEP_SECONDS,
            latency_seconds=LOOPBACK_LATENCY_SECONDS,
            bandwidth=1e9,
            speeds="slow-set",
            source="measured on the project's machine (docs/results/deployment_race)",
            server_seconds=LOOPBACK_SERVER_SECONDS,
        ),
        DeviceProfile(
            "appfl10",
            # The median device's seconds per step is edge's (an assumption): APPFL's
            # seconds are of ResNet-18 on CIFAR-10, not of this model; only their ratios
            # (each client's time over the median's) are taken.
            step_seconds=4 * LOOPBACK_STEP_SECONDS,
            latency_seconds=0.05,
            bandwidth=2.5e6,
            speeds="table",
            bandwidth_sigma=0.8,
            source="APPFL's measured seconds per step of 10 clients (FedCompass, Li et al., "
            "ICLR 2024, arXiv 2309.14675) over their median; edge's network",
            speed_table=tuple(
                s / statistics.median(APPFL10_STEP_SECONDS) for s in APPFL10_STEP_SECONDS
            ),
        ),
    )
}

WORK_MODES = ("gradient", "delta", "weights")

#: What run config ``device-profile`` accepts, in words (error messages, the reference).
DEVICE_PROFILE_EXPECTED = (
    f"one of {', '.join(DEVICE_PROFILES)}, or the path of an existing "
    f"{' or '.join(PROFILE_FILE_SUFFIXES)} profile file"
)


def _is_profile_path(value: str) -> bool:
    return Path(value).suffix.lower() in PROFILE_FILE_SUFFIXES


def is_device_profile(value: object) -> bool:
    """Whether ``value`` may be run config ``device-profile``: a name in
    :data:`DEVICE_PROFILES`, or the path of an existing file ending in ``.csv`` or
    ``.toml`` (not read here: :class:`VirtualClock` reads it, and refuses a malformed
    one)."""
    if not isinstance(value, str):
        return False
    return value in DEVICE_PROFILES or (_is_profile_path(value) and Path(value).is_file())


@dataclass(frozen=True)
class VirtualClock:
    """The time model: per-node speed factors and bandwidths, per-message durations.

    Parameters
    ----------
    seed : int
        Run seed; every draw is a function of it.
    base_duration : float
        ``uniform`` profile: virtual seconds of one step of local work on a node of
        speed factor 1 (with the default one step of work, one client computation).
    slow_fraction : float
        Slow-set profiles (``uniform``, ``loopback``): fraction in [0, 1] of the nodes
        that are slow, a seeded choice of ``round(slow_fraction * num_nodes)``
        partitions. Unused by ``edge``, ``appfl10`` and profile files.
    slow_factor : float
        Slow-set profiles: how many times longer a slow node takes (>= 1).
    jitter : float
        Relative jitter in [0, 1): compute and communication times are each
        multiplied by a factor drawn uniformly from ``[1 - jitter, 1 + jitter]``.
    device_profile : str
        A name in :data:`DEVICE_PROFILES`: ``"uniform"`` (default), ``"edge"``,
        ``"loopback"`` or ``"appfl10"``; or the path of a ``.csv`` or ``.toml``
        profile file (:mod:`flwr_gsgm.simulation.profile_file`), read once, here. A
        file's node runs a step in its ``step-seconds``: its speed factor is that over
        the median of the file's ``step-seconds`` (the profile's seconds per step);
        its bandwidth and latency are its own.
    step_seconds : float
        Seconds per step of local work at speed factor 1; 0 (default): the profile's
        (``base_duration`` for ``uniform``, the median node's for a file).
    latency_seconds : float
        Seconds of fixed latency per message, every node; 0 (default): the profile's
        (a file: each node's own).
    server_seconds : float
        Seconds the server spends on each reply, one at a time (:meth:`serve`); 0
        (default): the profile's (a file: 0).
    partition_examples : Mapping[int, int] | None
        Training examples per partition-id, needed for epoch work
        (:meth:`work_steps` with ``local_epochs > 0``).
    availability : str
        When each node is online (:mod:`flwr_gsgm.simulation.availability`):
        ``"always"`` (default), a built-in model, or ``"device-profile"`` (each node's
        own, from the profile file named by ``device_profile``).
    speed_variance : str
        Per-message slowdowns (:mod:`flwr_gsgm.simulation.speed_variance`): ``"none"``
        (default) or a built-in model.
    device_power : str
        What each device draws (:mod:`flwr_gsgm.simulation.power`): ``"none"``
        (default: no energy accounting) or a built-in model.
    offline_detection_seconds : float
        Seconds (>= 0) from a node going offline to the server learning of it, when
        its message in flight is known lost: default
        :data:`OFFLINE_DETECTION_SECONDS`, Flower's heartbeat expiry (60 s); 0: a
        node that says goodbye (a SuperNode stopped with SIGTERM).

    Every profile charges compute in proportion to the local work: ``uniform`` with
    one step (the published runs: gradient mode, ``local-batches`` 1) gives exactly
    the durations of the clock before the time model; an old run with more local work
    (``local-batches`` or ``local-steps`` > 1) now lasts that many times longer.

    Raises
    ------
    ValueError
        If a parameter is outside its range, the profile is unknown, or its file is
        missing or malformed (:func:`~flwr_gsgm.simulation.profile_file.read_profile_file`:
        the message names the file, line or ``[[node]]`` and field); the message names
        the value and what was expected.
    """

    seed: int = 0
    base_duration: float = 1.0
    slow_fraction: float = 0.25
    slow_factor: float = 4.0
    jitter: float = 0.1
    device_profile: str = "uniform"
    step_seconds: float = 0.0
    latency_seconds: float = 0.0
    server_seconds: float = 0.0
    partition_examples: Mapping[int, int] | None = field(default=None, hash=False, repr=False)
    availability: str = ALWAYS
    speed_variance: str = NONE
    offline_detection_seconds: float = OFFLINE_DETECTION_SECONDS
    device_power: str = "none"
    # Set by __post_init__: the profile, a profile file's nodes (None: a built-in) and
    # who is online when.
    _profile: DeviceProfile = field(init=False, repr=False, compare=False, hash=False)
    _nodes: Mapping[int, NodeProfile] | None = field(
        init=False, default=None, repr=False, compare=False, hash=False
    )
    # The profile file's availability per node, for "device-profile" (None: none).
    _own_online: Mapping[int, Any] | None = field(
        init=False, default=None, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if not self.base_duration > 0:
            raise ValueError(f"base-duration must be > 0 seconds, got {self.base_duration!r}")
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise ValueError(f"slow-fraction must be in [0, 1], got {self.slow_fraction!r}")
        if not self.slow_factor >= 1.0:
            raise ValueError(f"slow-factor must be >= 1, got {self.slow_factor!r}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")
        if self.device_profile in DEVICE_PROFILES:
            object.__setattr__(self, "_profile", DEVICE_PROFILES[self.device_profile])
        elif isinstance(self.device_profile, str) and _is_profile_path(self.device_profile):
            nodes = read_profile_file(self.device_profile)
            object.__setattr__(self, "_nodes", nodes)
            object.__setattr__(self, "_profile", _file_profile(self.device_profile, nodes))
        else:
            raise ValueError(
                f"device-profile {self.device_profile!r} is unknown; expected one of "
                f"{sorted(DEVICE_PROFILES)}, or the path of a "
                f"{' or '.join(PROFILE_FILE_SUFFIXES)} profile file"
            )
        for key, value in (
            ("step-seconds", self.step_seconds),
            ("latency-seconds", self.latency_seconds),
            ("server-seconds", self.server_seconds),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"{key} must be a finite number >= 0 seconds (0: the profile's), got {value!r}"
                )
        detect = self.offline_detection_seconds
        if not (isinstance(detect, (int, float)) and math.isfinite(detect) and detect >= 0):
            raise ValueError(
                f"offline-detection-seconds must be a finite number >= 0 seconds, got {detect!r}"
            )
        if self.speed_variance != NONE and self.speed_variance not in SPEED_VARIANCE_MODELS:
            raise ValueError(
                f"speed-variance {self.speed_variance!r} is unknown; expected one of "
                f"{[NONE, *SPEED_VARIANCE_MODELS]}"
            )
        if self.device_power != "none" and self.device_power not in POWER_MODELS:
            raise ValueError(
                f"device-power {self.device_power!r} is unknown; expected one of "
                f"{['none', *POWER_MODELS]}"
            )
        object.__setattr__(self, "_own_online", self._availability_entries())

    @property
    def power(self) -> Power | None:
        """What each device draws (None: no energy accounting)."""
        return POWER_MODELS.get(self.device_power)

    def _availability_entries(self) -> Mapping[int, Any] | None:
        """The profile file's availability per node for ``"device-profile"`` (None for
        the other kinds), checked.

        Raises
        ------
        ValueError
            An unknown kind; ``"device-profile"`` without a profile file, or with one
            of whose nodes has no availability; a file that gives availability while
            the run's is another (it would be silently unused).
        """
        kind = self.availability
        if kind not in (ALWAYS, FROM_PROFILE, *AVAILABILITY_MODELS):
            raise ValueError(
                f"availability {kind!r} is unknown; expected one of "
                f"{[ALWAYS, *AVAILABILITY_MODELS, FROM_PROFILE]}"
            )
        given = {
            pid: n.availability
            for pid, n in (self._nodes or {}).items()
            if n.availability is not None
        }
        if kind != FROM_PROFILE:
            if given:
                raise ValueError(
                    f"device profile file {self.device_profile!r} gives the availability of "
                    f"partition-ids {sorted(given)}, but availability is {kind!r}: set "
                    'availability = "device-profile" to use it, or remove it from the file'
                )
            return None
        if self._nodes is None:
            raise ValueError(
                f"availability 'device-profile' needs device-profile to be a profile file, "
                f"got the built-in {self.device_profile!r}"
            )
        missing = sorted(set(self._nodes) - set(given))
        if missing:
            raise ValueError(
                f"availability 'device-profile': device profile file {self.device_profile!r} "
                f"gives no online-intervals or mean-online-seconds/mean-offline-seconds for "
                f"partition-ids {missing}; expected them for every node"
            )
        return given

    @property
    def counts_in_rounds(self) -> bool:
        """Whether the availability model counts in rounds of the fleet
        (:meth:`round_seconds` must then be given to :meth:`availability_of`)."""
        model = AVAILABILITY_MODELS.get(self.availability)
        return model is not None and model.in_rounds

    def availability_of(self, round_seconds: float | None = None) -> Availability:
        """Who is online when (:class:`~flwr_gsgm.simulation.availability.Availability`);
        ``round_seconds``: the fleet's round, the unit of a model that counts in rounds
        (:attr:`counts_in_rounds`; :meth:`round_seconds`).

        Raises
        ------
        ValueError
            A model in rounds without a ``round_seconds`` > 0.
        """
        return Availability(self.availability, self.seed, self._own_online, round_seconds)

    def round_seconds(self, message_seconds: Iterable[float]) -> float:
        """The fleet's round: the median of each node's message seconds (its compute
        and communication for the run's work, without jitter), the unit of an
        availability model that counts in rounds."""
        return float(statistics.median(message_seconds))

    def message_seconds(
        self, speed_factor: float, partition_id: int, work_steps: int, message_bytes: int
    ) -> float:
        """Seconds of a message of ``work_steps`` steps and ``message_bytes`` bytes each
        way on node ``partition_id`` without jitter or slowdown: the time model's
        typical message of the node."""
        bandwidth = self.bandwidth(partition_id)
        return float(
            self.seconds_per_step * int(work_steps) * speed_factor
            + self.latency_of(partition_id)
            + (2 * int(message_bytes) / bandwidth if message_bytes else 0.0)
        )

    @property
    def profile(self) -> DeviceProfile:
        """The :class:`DeviceProfile` named by ``device_profile`` (a file: its median
        node's seconds per step, bandwidth and latency; each node's are its own)."""
        return self._profile

    def _node(self, partition_id: int) -> NodeProfile:
        """A profile file's entry for ``partition_id``.

        Raises
        ------
        ValueError
            If the file has no entry for it (naming the file and the ids it has).
        """
        assert self._nodes is not None
        node = self._nodes.get(int(partition_id))
        if node is None:
            raise ValueError(
                f"partition-id {int(partition_id)} has no entry in device profile file "
                f"{self.device_profile!r}; it has partition-ids {sorted(self._nodes)}: "
                "expected one entry per node of the run"
            )
        return node

    @property
    def seconds_per_step(self) -> float:
        """Seconds of one step on a node of speed factor 1: ``step_seconds`` if > 0,
        else the profile's (``base_duration`` for ``uniform``)."""
        if self.step_seconds > 0:
            return float(self.step_seconds)
        own = self.profile.step_seconds
        return float(self.base_duration if own is None else own)

    @property
    def latency(self) -> float:
        """Seconds of fixed latency per message: ``latency_seconds`` if > 0, else the
        profile's (a file: its median node's; each node's is :meth:`latency_of`)."""
        return float(self.latency_seconds or self.profile.latency_seconds)

    @property
    def seconds_per_reply(self) -> float:
        """Seconds the server spends on each reply: ``server_seconds`` if > 0, else the
        profile's (0 for a file)."""
        return float(self.server_seconds or self.profile.server_seconds)

    def serve(self, free_at: float, finishes: Iterable[float]) -> float:
        """When the server has handled replies that finish (reach it) at ``finishes``,
        seconds, if it is busy until ``free_at``: one reply at a time, in order of
        finish, each :attr:`seconds_per_reply` (a FIFO queue with one server). With no
        server cost, ``max(free_at, *finishes)``, the same float.

        Measured by the deployment race (docs/results/deployment_race/README.md): with
        every node answering at once, the round trip grows by about this much per reply
        in the queue."""
        cost = self.seconds_per_reply
        for finish in sorted(finishes):
            free_at = max(free_at, finish) + cost
        return free_at

    def latency_of(self, partition_id: int) -> float:
        """Seconds of fixed latency per message of node ``partition_id``:
        ``latency_seconds`` if > 0, else the file's entry for the node, else
        :attr:`latency`.

        Raises
        ------
        ValueError
            A profile file without an entry for ``partition_id``.
        """
        if self._nodes is None or self.latency_seconds:
            return self.latency
        return float(self._node(partition_id).latency_seconds)

    def speed_factors(self, partition_ids: list[int]) -> dict[int, float]:
        """Return ``{partition_id: factor}``: how many times a step takes
        :attr:`seconds_per_step` on each node.

        Slow-set profiles: 1.0 for fast nodes, ``slow_factor`` for slow; the slow set
        is a seeded choice among the given partition ids (sorted first, so the order
        of the argument does not matter). Log-normal profiles: each node's own seeded
        draw (independent of the other ids). ``appfl10``: entry ``p % 10`` of its
        table (a fleet of more than 10 nodes repeats the 10 devices). A profile file:
        the node's ``step-seconds`` over the file's median.

        Raises
        ------
        ValueError
            A profile file without an entry for one of ``partition_ids``.
        """
        pids = sorted(int(p) for p in partition_ids)
        profile = self.profile
        if profile.speeds == "log-normal":
            return {p: _log_normal(self.seed, _SPEED, p, profile.speed_sigma) for p in pids}
        if profile.speeds == "table":
            table = profile.speed_table
            return {p: table[p % len(table)] for p in pids}
        if profile.speeds == "file":
            median = float(profile.step_seconds or 0.0)
            return {p: self._node(p).step_seconds / median for p in pids}
        num_slow = int(round(self.slow_fraction * len(pids)))
        rng = np.random.default_rng(derive_seed(self.seed, _SLOW_SET))
        slow = set(rng.choice(pids, size=num_slow, replace=False).tolist()) if num_slow else set()
        return {p: (self.slow_factor if p in slow else 1.0) for p in pids}

    def bandwidth(self, partition_id: int) -> float:
        """Bytes per second of node ``partition_id``, each way (``math.inf``: free):
        the profile's median times the node's seeded log-normal factor; a profile
        file: the node's entry.

        Raises
        ------
        ValueError
            A profile file without an entry for ``partition_id``.
        """
        if self._nodes is not None:
            return float(self._node(partition_id).bandwidth)
        profile = self.profile
        if math.isinf(profile.bandwidth) or not profile.bandwidth_sigma:
            return float(profile.bandwidth)
        factor = _log_normal(self.seed, _BANDWIDTH, partition_id, profile.bandwidth_sigma)
        return float(profile.bandwidth * factor)

    def work_steps(
        self,
        partition_id: int,
        mode: str,
        *,
        batch_size: int,
        local_batches: int,
        local_steps: int,
        local_epochs: int = 0,
    ) -> int:
        """Steps of local work one train message asks of node ``partition_id``.

        Gradient mode: ``local_batches`` mini-batches. Delta and weights modes:
        ``local_steps`` SGD steps, or with ``local_epochs > 0``
        ``local_epochs x ceil(examples of the partition / batch_size)``.

        Raises
        ------
        ValueError
            On an unknown mode, or epoch work for a partition whose example count is
            not in ``partition_examples``.
        """
        if mode not in WORK_MODES:
            raise ValueError(f"client mode {mode!r} is unknown; expected one of {WORK_MODES}")
        if mode == "gradient":
            return int(local_batches)
        if local_epochs <= 0:
            return int(local_steps)
        examples = (self.partition_examples or {}).get(int(partition_id))
        if examples is None:
            raise ValueError(
                f"local-epochs = {local_epochs} needs the number of training examples of "
                f"partition {partition_id} to time its work, but the virtual clock has "
                f"none (VirtualClock(partition_examples=...) holds "
                f"{len(self.partition_examples or {})} partitions)"
            )
        return int(local_epochs) * math.ceil(int(examples) / int(batch_size))

    def compute_seconds(
        self, speed_factor: float, partition_id: int, dispatch_index: int, work_steps: int = 1
    ) -> float:
        """Virtual seconds of the local work of a partition's ``dispatch_index``-th
        message: ``seconds_per_step x work_steps x speed_factor x jitter``, times its
        slowdown under a ``speed_variance`` model
        (:func:`~flwr_gsgm.simulation.speed_variance.slowdown`)."""
        rng = np.random.default_rng(derive_seed(self.seed, int(partition_id), int(dispatch_index)))
        noise = rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)
        # Multiplied in the order of the clock before the time model (base x speed x
        # noise, with base = seconds_per_step x 1 for one step): the same floats.
        seconds = self.seconds_per_step * int(work_steps) * speed_factor * noise
        if self.speed_variance != NONE:  # "none" multiplies nothing: the same floats
            seconds *= slowdown(self.speed_variance, self.seed, partition_id, dispatch_index)
        return float(seconds)

    def communication_seconds(
        self, partition_id: int, dispatch_index: int, message_bytes: int = 0
    ) -> float:
        """Virtual seconds a message and its reply spend on the network:
        ``(latency + 2 x message_bytes / bandwidth) x jitter`` (0.0 for ``uniform``,
        with no draw), the node's latency (:meth:`latency_of`) and bandwidth
        (:meth:`bandwidth`)."""
        bandwidth = self.bandwidth(partition_id)
        seconds = self.latency_of(partition_id) + (
            2 * int(message_bytes) / bandwidth if message_bytes else 0.0
        )
        if seconds == 0.0:
            return 0.0
        rng = np.random.default_rng(
            derive_seed(self.seed, _COMMUNICATION, int(partition_id), int(dispatch_index))
        )
        return float(seconds * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter))

    def duration(
        self,
        speed_factor: float,
        partition_id: int,
        dispatch_index: int,
        work_steps: int = 1,
        message_bytes: int = 0,
    ) -> float:
        """Virtual seconds of a partition's ``dispatch_index``-th message: its compute
        (``work_steps`` steps at ``speed_factor``) plus its communication
        (``message_bytes`` bytes each way).

        Parameters
        ----------
        speed_factor : float
            The node's factor from :meth:`speed_factors`.
        partition_id, dispatch_index : int
            Which node and which of its messages (0, 1, ...): the draws' seeds.
        work_steps : int
            Steps of local work the message asks for (:meth:`work_steps`).
        message_bytes : int
            Bytes of the model sent; the reply is charged the same.
        """
        compute = self.compute_seconds(speed_factor, partition_id, dispatch_index, work_steps)
        return compute + self.communication_seconds(partition_id, dispatch_index, message_bytes)


def _file_profile(path: str, nodes: Mapping[int, NodeProfile]) -> DeviceProfile:
    """The :class:`DeviceProfile` of a profile file: its medians (seconds per step,
    bandwidth, latency), ``"file"`` speeds."""
    return DeviceProfile(
        path,
        step_seconds=statistics.median(n.step_seconds for n in nodes.values()),
        latency_seconds=statistics.median(n.latency_seconds for n in nodes.values()),
        bandwidth=statistics.median(n.bandwidth for n in nodes.values()),
        speeds="file",
        source=f"the user's fleet, {len(nodes)} nodes ({path})",
    )


def _log_normal(seed: int, stream: int, partition_id: int, sigma: float) -> float:
    """``exp(sigma * z)``, z standard normal drawn from ``(seed, stream, partition_id)``."""
    rng = np.random.default_rng(derive_seed(seed, stream, int(partition_id)))
    return float(math.exp(sigma * rng.standard_normal()))
