#!/usr/bin/env bash
# On the GPU machine: check and unpack carried parts of vLLM 0.33.0 into /tmp/vllm_carry (assemble.py).
#   bash perf/vllm_carry/assemble.sh PART_DIR...      one call per part, back to back in one lease
#   bash perf/vllm_carry/assemble.sh --install        once all are in: pip --no-deps --target /tmp/vllm_site
#   bash perf/vllm_carry/assemble.sh --status         which parts are in
# Exit status: 0 done; 3 parts missing for --install; 4 a part failed its check (carry it again).
set -u
exec python3 "$(dirname "$0")/assemble.py" "$@"
