"""Checkpoints of a run: the files, atomic writes, and what a resume must share with its
checkpoint (the engine's own checkpoint state: :mod:`flwr_gsgm.engine.checkpoint_state`).
"""
