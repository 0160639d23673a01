"""Benchmarks behind ``uvaple bench`` (``uvaple.perf.bench``) and the peer providers they measure
(``uvaple.perf.peers``). ``perf/results/`` holds committed runs.

Nothing is imported here: the modules import torch and Triton, which are slow to import.
"""
