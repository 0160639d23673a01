"""Model adapters: where a model's PLE table meets the library's lookups.

* :mod:`.hf`: transformers in general: which module of which model holds the PLE table (``SPECS``), the live
  swap and the class patch, loading a checkpoint with its tables streamed into host memory.
* :mod:`.gemma3n`, :mod:`.qwen4_exp`: each model's entry points (Qwen4Exp's n-gram embedding over host tables,
  its ids hashed on the GPU); :mod:`.ngram_tables`: Qwen4Exp's tables from a checkpoint's shards.
* :mod:`.vllm`: the vLLM plugin (vLLM's own model classes with their PLE tables in uvaple host memory).

Each imports transformers or vLLM lazily, on first use: importing ``uvaple`` needs neither.
"""
