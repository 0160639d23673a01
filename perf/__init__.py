"""What ``uvaple bench`` runs (``uvaple.perf.bench``): its workloads (``ple`` in ``sweep``, ``ngram``,
``hotset``, ``host`` in ``host_cost``), providers and the peers they measure (``uvaple.perf.peers``), timing
and the report; ``uvaple.perf.command`` holds what every workload's command line shares (``--out``,
``--smoke``, the refusals up front, progress on stderr).

Studies, probes and tuners are scripts in ``perf/studies/`` beside this package, not installed; the runs the
docs cite are in ``perf/results/`` and their figures in ``docs/RESULTS.md``.

Nothing is imported here: the modules import torch and Triton, which are slow to import.
"""
