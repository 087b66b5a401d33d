"""The parts of a node's life the engine's membership (:mod:`flwr_gsgm.engine.membership`)
uses: the back-off schedule, query replies, Flower error codes and per-node counts.
"""
