"""The strategies a ServerApp uses: ``AsyncStrategy.start()``, ``GSGM`` and the
asynchronous baselines, their arguments and hooks; and the synchronous time-budget
anchors on Flower's FedAvg, ``TimeBudgetFedAvg`` and ``FedNova``.
"""
