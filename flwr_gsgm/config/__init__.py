"""Run config: its keys and checks, the strategy a run config asks for, and the files a run
writes.
"""
