"""Benchmarks: `layerline bench` (`run`, `clusters`), this machine's floors under a split (`hop_floor`, `relay_stage`).

Sits above the services and the launcher, below the command line; transformers, the baseline,
is imported only while measuring.
"""
