"""Evaluation of an asynchronous run: centralized rows, federated evaluation, and the stability
figures.
"""
