"""The asynchronous engine: the push/pull loop, what is in flight, dispatch, membership,
evaluation, the books, checkpoint state, budgets and how a run ends.
"""
