"""Benchmarks: `layerline bench` (`run`, `clusters`) and this machine's floors under a split (`hop_floor`).

Sits above the services and the launcher, below the command line; transformers, the baseline,
is imported only while measuring.
"""
