"""Checkpoints of a run: the files, atomic writes, and what a resume must share with its
checkpoint.
"""
