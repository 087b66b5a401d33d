"""The asynchronous strategies a ServerApp uses: ``AsyncStrategy.start()``, ``GSGM`` and the
baselines, their arguments and hooks.
"""
