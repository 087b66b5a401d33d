"""The stability figures of a finished run (docs/GSGM.md: MASD, time to a target).

The evaluation a run does while it trains (centralized rows, federated evaluation) is
the engine's: :mod:`flwr_gsgm.engine.central_evaluation` and
:mod:`flwr_gsgm.engine.federated_evaluation`, next to the ledger and the divergence
checks they read.
"""
