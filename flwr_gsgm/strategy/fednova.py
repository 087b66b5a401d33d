"""FedNova: normalised averaging of updates made with different numbers of local steps.

Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020, arXiv 2007.07481. When nodes do
different numbers of local steps, FedAvg's average of their models optimises a
surrogate objective weighted toward the nodes that did more; FedNova divides each
node's displacement by its step count before averaging, then takes one common
effective number of steps, which removes that inconsistency.

With the global weights w sent in a round and node i's returned weights w_i:

    d_i      = w - w_i                               (its displacement)
    p_i      = n_i / sum_j n_j                       (n_i: its reply's num-examples)
    a_i      = sum_{t=1..tau_i} (1 - rho^t) / (1 - rho)
             = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)   (tau_i if rho = 0)
    tau_eff  = sum_i p_i a_i
    w'       = w - eta_s * tau_eff * sum_i p_i d_i / a_i

tau_i is the ``train-steps`` the node reports; rho the momentum of its local SGD
(``local_momentum``: torch's SGD with a fresh momentum buffer each message, no
dampening, as the project's ClientApp; a_i is then the l1 norm of the paper's
vector a_i, the coefficient sum of the accumulated gradients, the
``local_normalizing_vec`` of the authors' code and of Flower's FedNova baseline,
baselines/fednova); eta_s the server learning rate (1.0: the paper's FedNova).
Neither the proximal term (FedProx's mu) nor the server ("global") momentum of the
authors' code is implemented. Arrays that are not floating point (counters) take
FedAvg's weighted mean.

Each node's local steps are those of time-budget FedAvg
(:class:`~flwr_gsgm.strategy.time_budget_fedavg.TimeBudgetFedAvg`): the same
seconds for every node once its speed is measured, which is the heterogeneous-steps
setting FedNova was made for. A round whose replies do not all report
``train-steps`` is averaged as FedAvg (FedNova with equal a_i), logged once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg, reported_work

__all__ = ["FedNova", "fednova_aggregate", "normalising_steps"]


def normalising_steps(steps: int, local_momentum: float = 0.0) -> float:
    """FedNova's a_i (its l1 norm) for ``steps`` local SGD steps at momentum rho:
    ``sum_{t=1..steps} (1 - rho^t) / (1 - rho)``; ``steps`` for rho = 0.

    Example: 2 steps at rho = 0.5 give 1 + 1.5 = 2.5.

    Raises
    ------
    ValueError
        If ``steps`` < 1 or ``local_momentum`` is not in [0, 1).
    """
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not 0.0 <= local_momentum < 1.0:
        raise ValueError(f"local_momentum must be in [0, 1), got {local_momentum!r}")
    rho = float(local_momentum)
    if rho == 0.0:
        return float(steps)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


def fednova_aggregate(
    global_arrays: Mapping[str, np.ndarray],
    replies: Sequence[tuple[Mapping[str, np.ndarray], float, int]],
    local_momentum: float = 0.0,
    server_learning_rate: float = 1.0,
) -> dict[str, np.ndarray]:
    """FedNova's new weights ``w - eta_s * tau_eff * sum_i p_i (w - w_i) / a_i``.

    Parameters
    ----------
    global_arrays : Mapping[str, np.ndarray]
        w, the weights the round sent, by name (any shapes; floating dtypes).
    replies : Sequence[tuple[Mapping[str, np.ndarray], float, int]]
        Per node: (w_i by the same names and shapes, n_i its num-examples > 0,
        tau_i its local steps >= 1).
    local_momentum : float
        rho of the nodes' local SGD, in [0, 1) (:func:`normalising_steps`).
    server_learning_rate : float
        eta_s > 0.

    Returns
    -------
    dict[str, np.ndarray]
        The new weights, each in its global array's dtype and shape (summed in
        float64). Example: w = 0, two nodes with n = 1 and 3, tau = 2 and 8, w_i =
        -1 and -4 (d_i = 1 and 4): p = 0.25, 0.75; tau_eff = 6.5; the sum is
        0.25 * 1/2 + 0.75 * 4/8 = 0.5; w' = -3.25 (FedAvg: -3.25 too, since here
        d_i is proportional to tau_i; with d_i = 1 and 1 FedNova gives
        -6.5 * (0.125 + 0.09375) = -1.421875, FedAvg -1).

    Raises
    ------
    ValueError
        No replies; a reply whose names or shapes differ from w's (naming the
        name); n_i <= 0 or not finite; tau_i < 1; eta_s <= 0; rho outside [0, 1).
    """
    if not replies:
        raise ValueError("fednova_aggregate needs at least one reply, got none")
    if not server_learning_rate > 0:
        raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate!r}")
    examples = [float(n) for _, n, _ in replies]
    if not all(np.isfinite(n) and n > 0 for n in examples):
        raise ValueError(f"every reply's num-examples must be a finite number > 0, got {examples}")
    norms = [normalising_steps(tau, local_momentum) for _, _, tau in replies]
    total = sum(examples)
    shares = [n / total for n in examples]
    tau_eff = sum(p * a for p, a in zip(shares, norms))
    out: dict[str, np.ndarray] = {}
    for name, w in global_arrays.items():
        w64 = np.asarray(w, dtype=np.float64)
        step = np.zeros_like(w64)
        for (arrays, _, _), p, a in zip(replies, shares, norms):
            if name not in arrays:
                raise ValueError(
                    f"a reply has no array {name!r}; expected the sent arrays {list(global_arrays)}"
                )
            w_i = np.asarray(arrays[name], dtype=np.float64)
            if w_i.shape != w64.shape:
                raise ValueError(
                    f"a reply's array {name!r} has shape {w_i.shape}; expected {w64.shape}"
                )
            step += (p / a) * (w64 - w_i)
        out[name] = (w64 - server_learning_rate * tau_eff * step).astype(np.asarray(w).dtype)
    return out


class FedNova(TimeBudgetFedAvg):
    """FedNova's normalised averaging, with time-budget FedAvg's local steps.

    Parameters
    ----------
    *args, **kwargs
        Flower's :class:`flwr.serverapp.strategy.FedAvg` arguments (n_i is the
        reply metric ``weighted_by_key``, default ``num-examples``).
    server_learning_rate : float
        eta_s > 0 (default 1.0, the paper's FedNova; the name of Flower's FedAvgM).
    local_momentum : float
        rho of the ClientApp's local SGD, in [0, 1) (default 0.0: plain SGD). Pass the
        momentum the train config sends (the project's run config ``local-momentum``).
    work_scheduling : str
        ``"equal-time"`` (default) or ``"off"`` (every node does the run's own work;
        the averaging is still normalised by each reply's ``train-steps``).

    Raises
    ------
    ValueError
        On ``server_learning_rate`` <= 0, ``local_momentum`` outside [0, 1), or an
        unknown ``work_scheduling``.
    """

    def __init__(
        self,
        *args: Any,
        server_learning_rate: float = 1.0,
        local_momentum: float = 0.0,
        work_scheduling: str = "equal-time",
        **kwargs: Any,
    ) -> None:
        if not server_learning_rate > 0:
            raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate!r}")
        if not 0.0 <= local_momentum < 1.0:
            raise ValueError(f"local_momentum must be in [0, 1), got {local_momentum!r}")
        super().__init__(*args, work_scheduling=work_scheduling, **kwargs)
        self.server_learning_rate = float(server_learning_rate)
        self.local_momentum = float(local_momentum)
        self.current_arrays: ArrayRecord | None = None
        self._said_unnormalised = False

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Time-budget FedAvg's messages; keeps w, the weights sent."""
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's checks and metrics, then :func:`fednova_aggregate` of the
        successful replies (FedAvg's mean if one reports no ``train-steps``)."""
        replies = list(replies)
        averaged, metrics = super().aggregate_train(server_round, replies)
        if averaged is None or self.current_arrays is None:
            return averaged, metrics
        valid = [r for r in replies if not r.has_error()]
        steps = [reported_work(r)[0] for r in valid]
        if any(s is None or s < 1 for s in steps):
            if not self._said_unnormalised:
                self._said_unnormalised = True
                log(
                    WARNING,
                    "[FedNova] round %d: a reply reports no train-steps (got %s): this "
                    "round, and any other like it, is averaged as FedAvg",
                    server_round,
                    steps,
                )
            return averaged, metrics
        sent = self.current_arrays.to_numpy_ndarrays()
        names = list(self.current_arrays.keys())
        floating = {k: np.issubdtype(a.dtype, np.floating) for k, a in zip(names, sent)}
        nodes = []
        for reply, tau in zip(valid, steps):
            record = next(iter(reply.content.array_records.values()))
            metric = next(iter(reply.content.metric_records.values()))
            arrays = dict(zip(record.keys(), record.to_numpy_ndarrays()))
            nodes.append((arrays, float(metric[self.weighted_by_key]), int(tau)))
        new = fednova_aggregate(
            {k: a for k, a in zip(names, sent) if floating[k]},
            nodes,
            self.local_momentum,
            self.server_learning_rate,
        )
        result = ArrayRecord({k: Array(new[k]) if floating[k] else averaged[k] for k in names})
        self.current_arrays = result
        return result, metrics
