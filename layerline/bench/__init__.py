"""Benchmarks: `layerline bench` (`run`) and this machine's floor for an extra hop (`hop_floor`).

Sits above the services and the launcher, below the command line; transformers, the baseline,
is imported only while measuring.
"""
