"""The strategies a ServerApp uses: ``AsyncStrategy.start()``, ``GSGM`` and the
asynchronous baselines, their arguments and hooks; the synchronous time-budget anchors
on Flower's FedAvg, ``TimeBudgetFedAvg`` and ``FedNova``; and ``SynchronousRun``, which
runs Flower's FedAvg, FedAvgM and those anchors on the engine's clock and rows.
"""
