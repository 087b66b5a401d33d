"""The asynchronous engine: the push/pull loop, what is in flight, dispatch, the books, budgets
and how a run ends.
"""
