"""What ``uvaple bench`` runs (``uvaple.perf.bench``): its workloads (``ple`` in ``sweep``, ``ngram``,
``hotset``), providers and the peers they measure (``uvaple.perf.peers``), timing and the report.

Studies, probes and tuners are scripts in ``perf/studies/`` beside this package, not installed; the runs the
docs cite are in ``perf/results/`` and their figures in ``docs/RESULTS.md``.

Nothing is imported here: the modules import torch and Triton, which are slow to import.
"""
