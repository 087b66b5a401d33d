"""Named asynchronous strategies for a ServerApp: ``GSGM`` and the baselines.

Each is :class:`~flwr_gsgm.strategy.async_strategy.AsyncStrategy` bound to one server rule of
:mod:`flwr_gsgm.core`, whose module cites the paper and documents the rule. The
optimizer keyword arguments and their defaults are the rule's declaration
(``PARAMS``), appended to each class docstring; parameters common to all
(``server_learning_rate``, client work, virtual clock, engine settings, seed) are documented on
``AsyncStrategy``.

:data:`STRATEGIES` has one class per registered rule, each written out below under the
core class's name without its ``Rule`` suffix (``CA2FLRule`` -> ``CA2FL``), so that an
editor's go-to-definition finds every one; a new rule adds its class here
(``tests/config/test_rule_declarations.py`` fails on a rule without one).
"""

from __future__ import annotations

from typing import Any, ClassVar

from flwr_gsgm.core import declared_params
from flwr_gsgm.core.params import describe
from flwr_gsgm.strategy.async_strategy import AsyncStrategy

__all__ = [
    "GSGM",
    "ASGD",
    "MomentumASGD",
    "DCASGD",
    "FedAsync",
    "FedBuff",
    "CA2FL",
    "ACE",
    "DelayAdaptiveASGD",
    "FedCompass",
    "RuleStrategy",
    "STRATEGIES",
]


class RuleStrategy(AsyncStrategy):
    """An :class:`AsyncStrategy` bound to the rule named by the class attribute ``rule``.

    Keyword arguments are those of ``AsyncStrategy`` (without ``optimizer``) and the
    rule's declared parameters.

    Raises
    ------
    ValueError
        As ``AsyncStrategy``: an unknown keyword argument (named), a bad value.
    """

    #: Name of the rule in :data:`flwr_gsgm.core.OPTIMIZERS`.
    rule: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        doc = describe(declared_params(cls.rule), rename={"lr": "server_learning_rate"})
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + doc

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(self.rule, **kwargs)


class GSGM(RuleStrategy):
    """Gradient Scheduling with Global Momentum (Li et al. 2019; Wang et al. 2022).

    See :class:`flwr_gsgm.core.GSGMRule` for the rule (white-list scheduling per cycle,
    running-mean pending slots, cycle-level global momentum) and
    ``docs/GSGM.md`` for its definition in this project.

    The defaults (ema momentum, beta 0.5, quorum 0.5, ``averaging="auto"``: table
    averaging with every node in flight, slot averaging under a ``max-in-flight``
    limit (docs/GSGM.md, "Averaging under a limit"), updates applied
    on arrival with the learning rate counted per cycle, ``lr_scaling="cycle"``, and
    ``server_learning_rate=0.1`` per cycle in gradient mode) are the choice of the scale
    preset's tuning stage: every grid point on seed 0 at 10 nodes (Fashion-MNIST, 2
    classes per node), used unchanged at 30, 100 and 300 nodes;
    ``docs/results/fashion_mnist_scale/README.md`` has the grid. In delta and weights
    modes the server learning rate is a fraction of each node's displacement, with its
    own declared default (below; docs/GSGM.md, "Client modes"). Table averaging's
    memory grows with the number of nodes times the model size.
    """

    rule = "gsgm"


class ASGD(RuleStrategy):
    """Plain asynchronous SGD: ``w <- w - lr * g`` for every arrival."""

    rule = "asgd"


class MomentumASGD(RuleStrategy):
    """Asynchronous SGD with naive server momentum ``beta`` in [0, 1)."""

    rule = "masgd"


class DCASGD(RuleStrategy):
    """Delay-compensated ASGD (Zheng et al., ICML 2017), ``dc_lambda`` >= 0."""

    rule = "dcasgd"


class FedAsync(RuleStrategy):
    """FedAsync (Xie et al., 2019): staleness-weighted mixing ``alpha * (s + 1) ** -poly_a``."""

    rule = "fedasync"


class FedBuff(RuleStrategy):
    """FedBuff (Nguyen et al., AISTATS 2022): mean of ``buffer_size`` buffered updates."""

    rule = "fedbuff"


class CA2FL(RuleStrategy):
    """CA2FL (Wang et al., ICLR 2024): buffered aggregation with cached update calibration.

    See :class:`flwr_gsgm.core.ca2fl.CA2FLRule` for the rule.
    """

    rule = "ca2fl"


class ACE(RuleStrategy):
    """ACE (Chang et al., 2025): a step along the mean of every node's latest update.

    See :class:`flwr_gsgm.core.ace.ACERule` for the rule.
    """

    rule = "ace"


class DelayAdaptiveASGD(RuleStrategy):
    """Delay-adaptive ASGD (Mishchenko et al.; Koloskova et al., NeurIPS 2022): the step
    shrinks when the delay exceeds the number of workers.

    See :class:`flwr_gsgm.core.delay_adaptive_asgd.DelayAdaptiveASGDRule` for the rule.
    """

    rule = "daasgd"


class FedCompass(RuleStrategy):
    """FedCompass (Li et al., ICLR 2024): semi-asynchronous aggregation of arrival groups,
    weighted by staleness; its scheduler sizes each node's local steps.

    See :class:`flwr_gsgm.core.fedcompass.FedCompassRule` for the rule and
    :mod:`flwr_gsgm.scheduling.compass` for its scheduler.
    """

    rule = "fedcompass"


#: rule name -> strategy class, for every registered rule, in registry order.
STRATEGIES: dict[str, type[RuleStrategy]] = {
    cls.rule: cls
    for cls in (
        GSGM,
        ASGD,
        MomentumASGD,
        DCASGD,
        FedAsync,
        FedBuff,
        CA2FL,
        ACE,
        DelayAdaptiveASGD,
        FedCompass,
    )
}
