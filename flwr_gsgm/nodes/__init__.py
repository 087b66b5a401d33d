"""The nodes of a run: membership and each node's state (joins, back-off, loss, exclusion),
their query replies and per-node counts.
"""
