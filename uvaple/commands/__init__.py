"""The command line, the top floor of the package: ``uvaple`` (:mod:`.cli`: the parser and the workloads of
``uvaple.perf``), ``uvaple doctor`` (:mod:`.doctor`: can this machine serve a host table to its GPU) and
``uvaple shm`` (:mod:`.shm`: the shared segments). Nothing else in the package imports it."""
