"""What a device draws: the energy part of the time model.

Run config ``device-power`` names a device's power draw while it computes, while it
communicates and while it idles (:data:`POWER_MODELS`); every node of the fleet draws
it. The fleet's energy at virtual second t is

    joules(t) = idle x nodes x t + sum over the messages handled by t of
        (compute - idle) x compute seconds + (communication - idle) x communication seconds

(every node is powered for the whole run, idling when it has no message). ``"none"``
(the default) counts nothing and adds no column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NONE", "POWER_MODELS", "Power"]

#: Run config ``device-power``: no energy accounting.
NONE = "none"


@dataclass(frozen=True)
class Power:
    """Watts a device draws while computing, communicating and idle.

    Parameters
    ----------
    compute_watts, communication_watts, idle_watts : float
        Watts (finite, >= 0) while the device trains, while it sends or receives the
        model, and while it waits.
    source : str
        Where the figures come from (``docs/GSGM.md``, "Time model").

    Raises
    ------
    ValueError
        If a figure is not a finite number >= 0 (the message names it).
    """

    compute_watts: float
    communication_watts: float
    idle_watts: float
    source: str = ""

    def __post_init__(self) -> None:
        for key, value in (
            ("compute-watts", self.compute_watts),
            ("communication-watts", self.communication_watts),
            ("idle-watts", self.idle_watts),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0 watts, got {value!r}")

    def message_joules(self, compute_seconds: float, communication_seconds: float) -> float:
        """Joules a message costs above idling: ``(compute - idle) x compute seconds +
        (communication - idle) x communication seconds``."""
        return (self.compute_watts - self.idle_watts) * compute_seconds + (
            self.communication_watts - self.idle_watts
        ) * communication_seconds


#: A Raspberry Pi 4 Model B draws 0.6 A idle and 1.2 A on average under stress at
#: 5.1 V (Raspberry Pi's documentation, "Power supply": typical bare-board active
#: current consumption, June 2019 firmware): 3.06 W and 6.12 W.
PI4_VOLTS, PI4_IDLE_AMPS, PI4_STRESS_AMPS = 5.1, 0.6, 1.2

#: The built-in power models (run config ``device-power``), besides ``"none"``.
#:
#: ``"raspberry-pi-4"``: computing at the stress figure, idle at the idle figure; no
#: published figure gives the board's draw while it only transfers the model, so
#: communication is taken at the idle draw (an assumption: the transfer is short next
#: to the training, and the CPU mostly waits on the network).
POWER_MODELS: dict[str, Power] = {
    "raspberry-pi-4": Power(
        compute_watts=PI4_VOLTS * PI4_STRESS_AMPS,
        communication_watts=PI4_VOLTS * PI4_IDLE_AMPS,
        idle_watts=PI4_VOLTS * PI4_IDLE_AMPS,
        source="Raspberry Pi 4 Model B, 0.6 A idle and 1.2 A under stress at 5.1 V "
        "(Raspberry Pi documentation, power supply); communication at idle (assumed)",
    ),
}
