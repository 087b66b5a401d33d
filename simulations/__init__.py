"""Sweeps of flwr-gsgm experiments: presets, a resumable runner, tuning, report.

- :mod:`simulations.preset`: a TOML preset -> the runs it asks for;
- :mod:`simulations.sweep`: ``python -m simulations.sweep PRESET.toml`` (tune on
  seed 0, then the reporting runs; ``runs.csv``);
- :mod:`simulations.worker`: one run in its own process (in-process Flower grid);
- :mod:`simulations.results`: one run's folder -> a ``runs.csv`` row (divergence,
  time to target);
- :mod:`simulations.report`: ``python -m simulations.report OUT`` (plots and the
  Markdown results table).
"""
