#!/usr/bin/env bash
# One call on the GPU machine: install, doctor, the whole test suite on CUDA, the tile sweep, table
# readiness, the benchmarks, the Gemma 3n end-to-end run and the E4B levers run. Logs go to $OUT
# (default ./gpu-out): run.log (everything) and results.tar.gz (per-step logs, benchmark JSON/CSV/PNG).
#   usage: bash perf/gpu_check.sh [steps...], from the repository root (the studies, probes and tuners run as
#   scripts from perf/studies/, which is not installed; the benchmarks through `uvaple bench`)
#   steps: doctor tests soak memcheck memlock lifetime host tunecopy tiles ready probe ngram hotset rates prefetch
#   split costs vllm startup bench e2e levers ngramlayer disk vllm_engine vllm_decode qwen4e2e
#   (default: all but soak, memcheck, memlock, probe, rates, prefetch, split, costs, ngramlayer, disk, vllm_engine,
#   vllm_decode and qwen4e2e)
#   qwen4e2e: perf/studies/qwen4_exp_e2e.py with QWEN4_E2E_ARGS, started in the background by the lease's first call
#   of it; each call waits until QWEN4_E2E_WAIT_S (540) seconds into the call and brings back what it wrote so far
#   vllm_engine: vLLM 0.33's real engine with the plugin (perf/vllm_carry/engine_check.py), once the parts that
#   perf/vllm_carry/build.py made were carried and unpacked by perf/vllm_carry/assemble.sh in the same lease:
#   installs them (pip --no-deps --target /tmp/vllm_site), then Gemma 3n and Qwen4Exp against HBM: vLLM's host
#   path, the plugin's placements and levers, eager and CUDA graphs, vllm serve; VLLM_ENGINE_ARGS="--models gemma3n"
#   narrows it; a later call continues where the last one stopped (results kept in /tmp/vllm_engine)
#   vllm_decode: the same install, then perf/vllm_carry/decode_bench.py (decode tokens/s and TTFT of a Qwen4Exp at
#   the served dimensions: HBM, vLLM's host path, the plugin; VLLM_DECODE_ARGS="--configs hbm,uva"; "--model gemma3n":
#   Gemma 3n E4B's text model, HBM / uva / the hot set / fp8 rows); continues too
#   TEST_GROUPS="a.py b.py;c.py": the tests step runs each ';'-separated group in its own process, side by side;
#   TEST_GROUPS=suite: every test file in the thirteen groups below (a file in none of them runs as a fourteenth),
#   with TESTS_TIMEOUT_S=560 (in seven groups it took about 7 minutes on the H200, and on a slower H100 host three
#   of them ran past 540 s: perf/results/h100_2026-12-06/, runs 3 and 4)
#   PROFILE_ARGS="--by rows --share 0.45": the split step profiles once more with these arguments
#   digest: print the digest of the tree's sources and stop (anywhere: the copy of .git that travels to the GPU
#   machine may name an older commit, so its log prints this digest; `bash perf/gpu_check.sh digest` on a
#   checkout of a commit says whether the GPU ran that commit's sources)
set -u
digest() {  # every tracked-or-not source file the tests and the package read, by path and content
  find kernels uva integration uvaple perf tests tests_vllm pyproject.toml -type f \( -name '*.py' -o -name '*.sh' \
    -o -name '*.toml' \) -not -path '*/__pycache__/*' -not -path 'perf/results/*' 2>/dev/null | LC_ALL=C sort |
    xargs sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = digest ]; then digest; exit 0; fi
OUT=${OUT:-$PWD/gpu-out}
R=$OUT/r
mkdir -p "$R" "$R/vllm" "$R/ngram"
STEPS=${*:-doctor tests lifetime host tunecopy tiles ready ngram hotset vllm startup bench e2e levers}
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv
grep -E "MemTotal|MemAvailable|HugePages_Total|AnonHugePages" /proc/meminfo
cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
df -h /dev/shm /tmp; nproc; ulimit -l; git log --oneline -1 2>/dev/null
echo "source digest: $(digest) (bash perf/gpu_check.sh digest on a checkout: the same digest, the same sources)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warning" | tail -3

if has doctor; then
  step "uvaple doctor"
  uvaple doctor | tee "$R/doctor.txt"; echo "doctor exit: ${PIPESTATUS[0]}"
fi
# the whole suite in groups of about equal time side by side (measured on an H100 and the H200, 2026-12-05)
SUITE_GROUPS="tests/test_fuzz.py tests/test_sorted_gather.py;tests/test_gather.py tests/test_gpu_lookup.py tests/test_reaper.py \
tests/test_ngram_hash.py tests/test_gather_ngram.py;tests/test_lookup.py tests/test_cli.py tests/test_gpu_uva.py \
tests/test_eager_call.py tests/test_eager_call_gpu.py;\
tests/test_gpu_lifetime.py tests/test_copy_backend.py;tests/test_copy_backend_gpu.py tests/test_metrics.py \
tests/test_equivalence.py;tests/test_host_table.py tests/test_encodings.py tests/test_layers.py tests/test_quantize.py \
tests/test_hotset.py tests/test_table_file.py tests/test_row_cache.py tests/test_disk_lookup.py tests/test_disk_read_ahead.py \
tests/test_page_reader.py tests/test_table_cli.py tests/test_file_embedding.py tests/test_qwen4_exp_disk.py;\
tests/test_shared.py;tests/test_lifetime.py tests/test_fork.py tests/test_vllm_tables.py tests/test_vllm_config.py tests/test_vllm_disk_shard.py;\
tests/test_perf_tools.py tests/test_bench.py;tests/test_qwen4_exp_e2e_study.py;tests/test_vllm_perf.py tests/test_compile_sm90.py \
tests/test_vllm_carry.py tests/test_disk_bench.py tests/test_uring.py;tests/test_qwen4_exp.py;tests/test_gemma3n.py \
tests/test_gemma3n_e2e.py tests/test_gemma3n_fp8.py tests/test_gemma3n_levers.py"
if has tests && [ -n "${TEST_GROUPS:-}" ]; then
  # groups of test files separated by ';', each its own pytest process, side by side on the one GPU
  suite=0; [ "$TEST_GROUPS" != suite ] || { suite=1; TEST_GROUPS=$SUITE_GROUPS; }
  left=$(for f in tests/test_*.py; do [[ " ${TEST_GROUPS//;/ } " == *" $f "* ]] || echo -n " $f"; done)
  if [ -n "$left" ] && [ $suite = 1 ]; then
    TEST_GROUPS="$TEST_GROUPS;${left# }"; echo "test files in none of the suite's groups, run as a group of their own:$left"
  elif [ -n "$left" ]; then
    echo "WARNING: test files in no group (not run):$left"
  fi
  step "pytest in parallel groups: $TEST_GROUPS"
  i=0; pids=(); IFS=';' read -ra groups <<< "$TEST_GROUPS"
  for g in "${groups[@]}"; do
    i=$((i + 1))
    # at the deadline pytest is interrupted (SIGINT), so it still prints the failures so far and their summary
    # (a SIGTERM would lose them with the process); killed 30 s later if it has not stopped. Inductor compiles in
    # each group's own process (TORCHINDUCTOR_COMPILE_THREADS=1): a pool of compile workers per group, a dozen
    # groups on 16 cores, once left a group waiting 150 s on a worker that never answered, and hung at its exit
    ( TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT -k 30 ${TESTS_TIMEOUT_S:-480} python3 -m pytest -q -ra --timeout 150 --durations=8 \
      -p no:cacheprovider $g > "$R/pytest_group$i.log" 2>&1; echo "group $i ($g) exit $?" >> "$R/pytest_group$i.log" ) &
    pids+=($!)
  done
  wait "${pids[@]}"  # these only: a bare wait would also wait for the log's tee, which never ends
  for f in "$R"/pytest_group*.log; do
    echo "--- $f"; tail -14 "$f"
    grep -E "^(FAILED|ERROR) |KeyboardInterrupt" "$f" | grep -vxFf <(tail -14 "$f") || true  # not in the tail
  done
elif has tests; then
  step "pytest (CUDA present: compiled kernels, GPU tests un-skipped; ${UVAPLE_EQUIV_SCHEDULES:-1000} equivalence schedules)"
  UVAPLE_EQUIV_SCHEDULES=${UVAPLE_EQUIV_SCHEDULES:-1000} UVAPLE_EQUIV_SUMMARY="$R/equivalence.json" timeout 480 python3 -m pytest -q -ra --timeout 150 --durations=15 -p no:cacheprovider \
    ${TESTS:-tests} 2>&1 | tee "$R/pytest.log" | tail -40
fi
if has soak; then
  step "overlapped-schedule soak: ${SOAK_SCHEDULES:-10000} schedules in ${SOAK_WORKERS:-14} processes (depth 1-8, cancels, closes, admission, memory back to baseline)"
  timeout 570 python3 perf/studies/soak.py --schedules ${SOAK_SCHEDULES:-10000} --workers ${SOAK_WORKERS:-14} \
    --deadline-s ${SOAK_DEADLINE_S:-420} --timeout-s ${SOAK_TIMEOUT_S:-520} --json "$R/soak.json" 2>&1 | tee "$R/soak.log" | tail -16
fi
if has memcheck; then
  step "compute-sanitizer memcheck over the fuzzed kernel paths (${MEMCHECK_TESTS:-tests/test_fuzz.py -k every_id_class})"
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$cs" ]; then
    timeout ${MEMCHECK_TIMEOUT_S:-560} "$cs" --tool memcheck --leak-check no --log-file "$R/memcheck.log" python3 -m pytest -q -p no:cacheprovider \
      ${MEMCHECK_TESTS:-tests/test_fuzz.py -k every_id_class} 2>&1 | tail -5
    tail -5 "$R/memcheck.log"
  else echo "compute-sanitizer not found on this machine"; fi
fi
if has memlock; then
  step "registration under a low ulimit -l (64 KiB; as is, and without CAP_IPC_LOCK), a ${MEMLOCK_GIB:-1} GiB table"
  timeout 300 python3 perf/studies/memlock_probe.py --gib ${MEMLOCK_GIB:-1} --json "$R/memlock.json" 2>&1 | tee "$R/memlock.log"
  echo "memlock exit: ${PIPESTATUS[0]}"
fi
if has lifetime; then
  step "host-table lifetime at full size (8 GiB finalizer release, fork, 16 GiB shared by 4 processes)"
  timeout 300 python3 perf/studies/lifetime_gpu.py --json "$R/lifetime.json" 2>&1 | tee "$R/lifetime.log"
  echo "lifetime exit: ${PIPESTATUS[0]}"
fi
if has host; then
  step "uvaple bench --workload host ${HOST_ARGS:-} (host us per eager call at 1/64/1024 ids: lookup, operator, torch)"
  timeout 180 uvaple bench --workload host ${HOST_ARGS:-} --out "$R/host" 2>&1 | tee "$R/host.log"
fi
if has tunecopy; then
  step "copy backend: serial/parallel CPU-gather threshold sweep on this host"
  timeout 240 python3 perf/studies/tune_copy.py --out "$R/tune_copy.log" | tail -5
fi
if has tiles; then
  step "tile sweep"
  timeout 120 python3 perf/studies/tune_gather.py --out "$R/tiles.log" | tail -60
fi
if has ready; then
  step "64 GiB table readiness"
  timeout 120 python3 perf/studies/table_ready.py --gib 64 --threads 16 | tee "$R/ready.log"
fi
if has probe; then
  step "table readiness by variant: page commit, page size, files, registration, fill-allocates (${PROBE_GIB:-48} GiB)"
  huge=/mnt/uvaple-huge; echo "uid $(id -u)"
  if mkdir -p $huge && mount -t tmpfs -o huge=always,size=$(( ${PROBE_GIB:-48} + 4 ))G uvaple-huge $huge; then
    echo "mounted a huge=always tmpfs at $huge"; dirv=",dir:threads:one,dir:fill:one"
  else echo "no huge-page tmpfs here (mount refused)"; dirv=""; fi
  timeout 420 python3 perf/studies/ready_probe.py --gib ${PROBE_GIB:-48} --json "$R/ready_probe.json" --dir $huge \
    --variants ${PROBE_VARIANTS:-private:threads:one,private:fill:one,shm:threads:one,shm:fill:one,shm16:threads:one,shm16:fill:one,shm64:fill:one}$dirv \
    2>&1 | tee "$R/ready_probe.log"
  umount $huge 2>/dev/null
fi
if has ngram; then
  step "uvaple bench --workload ngram ${NGRAM_ARGS:---sweep} (160-B fp8 rows, ${NGRAM_TABLE_GIB:-24} GiB table)"
  timeout 500 uvaple bench --workload ngram --table-gib ${NGRAM_TABLE_GIB:-24} ${NGRAM_ARGS:---sweep} --out "$R/ngram" 2>&1 | tee "$R/ngram/ngram.log" | tail -60
fi
if has hotset; then
  step "uvaple bench --workload hotset ${HOTSET_ARGS:-} (E4B rows: hot set, dedup, fp8 rows, all three vs the peer)"
  timeout 500 uvaple bench --workload hotset ${HOTSET_ARGS:-} --out "$R/hotset" 2>&1 | tee "$R/hotset.log" | tail -20
fi
if has rates; then
  step "random 160-B rows by reader: CPU threads (torch, numba), GPU (direct, sorted), GPU and CPU at once"
  timeout 400 python3 perf/studies/host_rates.py --table-gib ${NGRAM_TABLE_GIB:-24} ${RATES_ARGS:-} --out "$R/ngram/host_rates.json" \
    2>&1 | tee "$R/ngram/host_rates.log"
fi
if has prefetch; then
  step "CPU gather of random 160-B rows: index_select, numba, numba prefetching 4/8/16 rows ahead (${PREFETCH_THREADS:-16} threads)"
  timeout 300 python3 perf/studies/cpu_prefetch_probe.py ${PREFETCH_THREADS:-16} ${NGRAM_TABLE_GIB:-24} 2>&1 | tee "$R/ngram/cpu_prefetch_probe.log"
fi
if has split; then
  step "split lookup by stage (160-B fp8 rows, ${NGRAM_TABLE_GIB:-24} GiB): GPU share, CPU gather by threads, H2D, whole"
  timeout 300 python3 perf/studies/split_profile.py --table-gib ${NGRAM_TABLE_GIB:-24} 2>&1 | tee "$R/ngram/split_profile.log"
  if [ -n "${PROFILE_ARGS:-}" ]; then  # a second profile, e.g. "--by rows --share 0.45"
    timeout 300 python3 perf/studies/split_profile.py --table-gib ${NGRAM_TABLE_GIB:-24} $PROFILE_ARGS 2>&1 | tee "$R/ngram/split_profile_2.log"
  fi
fi
if has costs; then
  step "split lookup's host steps one at a time (160-B fp8 rows, ${NGRAM_TABLE_GIB:-24} GiB): ${COSTS_ARGS:-}"
  timeout 300 python3 perf/studies/split_costs.py --table-gib ${NGRAM_TABLE_GIB:-24} ${COSTS_ARGS:-} 2>&1 | tee "$R/ngram/split_costs.log"
fi
if has vllm; then
  step "vLLM shapes in CUDA graphs: ours vs the vLLM-shape peer (${VLLM_TABLE_GIB:-24} GiB n-gram table, Gemma 3n rows)"
  timeout 300 python3 -m uvaple.perf.vllm_shapes --table-gib ${VLLM_TABLE_GIB:-24} --out "$R/vllm" 2>&1 | tee "$R/vllm/shapes.log" | tail -30
fi
if has vllm_engine; then
  step "vLLM 0.33's engine with the plugin: Gemma 3n and Qwen4Exp, tokens and logprobs against HBM, every configuration (${VLLM_ENGINE_ARGS:-all})"
  mkdir -p "$R/vllm_engine"
  python3 perf/vllm_carry/assemble.py --install 2>&1 | tee "$R/vllm_engine/assemble.log"
  if [ "${PIPESTATUS[0]}" = 0 ]; then
    PYTHONPATH=${VLLM_CARRY_SITE:-/tmp/vllm_site}${PYTHONPATH:+:$PYTHONPATH} timeout ${VLLM_ENGINE_TIMEOUT_S:-540} \
      python3 perf/vllm_carry/engine_check.py --out "$R/vllm_engine" --deadline-s ${VLLM_ENGINE_DEADLINE_S:-470} \
      ${VLLM_ENGINE_ARGS:-} 2>&1 | tail -60
    mkdir -p "$R/vllm_engine/runs" && cp /tmp/vllm_engine/runs/*.log /tmp/vllm_engine/runs/*.json "$R/vllm_engine/runs/" 2>/dev/null
    cp -r /tmp/vllm_engine/runs/*.graphs "$R/vllm_engine/runs/" 2>/dev/null  # the compiled graphs of graph runs
  else echo "vLLM is not assembled here: carry its parts first (python3 perf/vllm_carry/build.py prints the calls)"; fi
fi
if has vllm_decode; then
  step "vLLM 0.33's engine, decode tokens/s and TTFT: Qwen4Exp at the served dimensions (or Gemma 3n E4B), HBM / vLLM's host path / the plugin (${VLLM_DECODE_ARGS:-defaults})"
  mkdir -p "$R/vllm_decode"
  python3 perf/vllm_carry/assemble.py --install 2>&1 | tail -3
  if [ "${PIPESTATUS[0]}" = 0 ]; then
    PYTHONPATH=${VLLM_CARRY_SITE:-/tmp/vllm_site}${PYTHONPATH:+:$PYTHONPATH} timeout ${VLLM_DECODE_TIMEOUT_S:-570} \
      python3 perf/vllm_carry/decode_bench.py --out "$R/vllm_decode" --deadline-s ${VLLM_DECODE_DEADLINE_S:-530} \
      ${VLLM_DECODE_ARGS:-} 2>&1 | tail -40
    cp /tmp/vllm_decode/results/*.log /tmp/vllm_decode/results/*.json "$R/vllm_decode/" 2>/dev/null
    [ -d /tmp/vllm_decode_gemma3n/results ] && mkdir -p "$R/vllm_decode/gemma3n" && \
      cp /tmp/vllm_decode_gemma3n/results/*.log /tmp/vllm_decode_gemma3n/results/*.json "$R/vllm_decode/gemma3n/" 2>/dev/null
  else echo "vLLM is not assembled here: carry its parts first (python3 perf/vllm_carry/build.py prints the calls)"; fi
fi
if has startup; then
  shm_gib=$(df --output=avail -B1G /dev/shm | tail -1 | tr -d ' ')
  gib=${VLLM_STARTUP_GIB:-48}; (( shm_gib - 2 < gib )) && gib=$(( shm_gib - 2 ))  # /dev/shm holds the segment
  step "vLLM plugin-path startup: $gib GiB fp8 n-gram table, stage by stage, in /dev/shm (4 KiB pages here)"
  timeout 280 python3 perf/studies/vllm_startup.py --gib $gib --keep --out "$R/vllm" 2>&1 | tee "$R/vllm/startup.log"
  huge=/mnt/uvaple-huge
  if mkdir -p $huge && mount -t tmpfs -o huge=always,size=$(( gib + 4 ))G uvaple-huge $huge; then
    step "the same in a huge=always tmpfs (segment_dir=$huge)"
    timeout 280 python3 perf/studies/vllm_startup.py --gib $gib --segment-dir $huge --tag _huge_tmpfs --out "$R/vllm" \
      2>&1 | tee "$R/vllm/startup_huge_tmpfs.log"
    umount $huge
  else echo "no huge-page tmpfs here (mount refused)"; fi
  rm -rf /tmp/uvaple-startup
fi
if has bench; then
  step "uvaple bench ${BENCH_ARGS:---full}"
  timeout 540 uvaple bench ${BENCH_ARGS:---full} --out "$R/bench" 2>&1 | tail -80
fi
if has ngramlayer; then
  step "one Qwen4Exp n-gram embedding, eager: transformers' own with its table in HBM, ours (hash kernel + uva), the hash both ways"
  timeout 300 python3 perf/studies/ngram_layer.py --json "$R/ngram_layer.json" 2>&1 | tee "$R/ngram_layer.log"
  echo "ngram_layer exit: ${PIPESTATUS[0]}"
fi
if has disk; then
  # the disk under a disk placement, its readers, then the placement's decode steps against the table pinned and an
  # mmap table (the GPU's gather); DISK_ARGS="--file-gib 48 --mmap-cap-gib 12" for a real-size fp8 n-gram table
  step "uvaple bench --workload disk (${DISK_ARGS:---file-gib 8}): random reads by depth, fio if installed, the readers, the disk placement's steps"
  timeout 560 uvaple bench --workload disk --dir "${DISK_DIR:-/root}" --out "$R/disk" ${DISK_ARGS:---file-gib 8} 2>&1 \
    | tee "$R/disk.log" | grep -v "it/s\]" | tail -20
fi
if has e2e; then
  step "Gemma 3n E2B end to end"
  timeout 500 python3 perf/studies/gemma3n_e2e.py --out "$R/e2e" ${E2E_ARGS:-} 2>&1 | tail -60
fi
if has qwen4e2e; then
  # Qwen4Exp in transformers at its default dimensions with a real-size n-gram table (perf/studies/qwen4_exp_e2e.py):
  # longer than one call, so the first call of a lease starts it in its own session (it outlives the call) and
  # every call, this one too, waits for it until QWEN4_E2E_WAIT_S seconds into the call, bringing back its log and
  # JSON as they grow (the study saves the JSON after every stage). Other QWEN4_E2E_ARGS than the running study's,
  # or QWEN4_E2E_RESTART=1, start afresh once it has ended. flash-linear-attention, where carried as .fla-carry, is
  # installed for it.
  W=/tmp/qwen4_e2e
  step "Qwen4Exp end to end in transformers (${QWEN4_E2E_ARGS:-defaults}), in the background"
  mkdir -p "$R/qwen4e2e"
  if [ -e "$W/args" ] && { [ "${QWEN4_E2E_RESTART:-0}" = 1 ] || [ "$(cat "$W/args")" != "${QWEN4_E2E_ARGS:-}" ]; }; then
    if [ -e "$W/rc" ] || ! kill -0 "$(cat "$W/pid" 2>/dev/null)" 2>/dev/null; then
      echo "the earlier study (with: $(cat "$W/args")) has ended: starting afresh"; mv "$W" "$W.$(date +%s)"
    else
      echo "the study started with other arguments ($(cat "$W/args")) is still running: waiting on it, not starting"
    fi
  fi
  mkdir -p "$W"
  if [ ! -e "$W/args" ]; then
    FLA=""
    if ls .fla-carry/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-deps --no-compile --target /tmp/fla_site .fla-carry/*.whl && FLA=/tmp/fla_site
    fi
    echo "${QWEN4_E2E_ARGS:-}" > "$W/args"
    PYTHONPATH="$FLA${PYTHONPATH:+${FLA:+:}$PYTHONPATH}" setsid bash -c "python3 perf/studies/qwen4_exp_e2e.py \
      ${QWEN4_E2E_ARGS:-} --json $W/e2e.json > $W/e2e.log 2>&1; echo \$? > $W/rc" < /dev/null > /dev/null 2>&1 &
    echo $! > "$W/pid"
    echo "started (pid $!)"
  else
    echo "started by an earlier call of this lease, with: $(cat "$W/args")"
  fi
  while :; do  # until it ends, dies, or the call's own deadline (SECONDS: since this script started)
    cp "$W/e2e.log" "$W/e2e.json" "$R/qwen4e2e/" 2>/dev/null
    [ -e "$W/rc" ] && break
    if ! kill -0 "$(cat "$W/pid")" 2>/dev/null; then echo "the study's process is gone without an exit status"; break; fi
    [ "$SECONDS" -lt "${QWEN4_E2E_WAIT_S:-540}" ] || break
    sleep 5
  done
  grep -v "it/s\]" "$W/e2e.log" 2>/dev/null | tail -30
  if [ -e "$W/rc" ]; then echo "qwen4_exp_e2e exit: $(cat "$W/rc")"
  elif kill -0 "$(cat "$W/pid")" 2>/dev/null; then
    echo "still running: the same step in another call of this lease waits on (bash perf/gpu_check.sh qwen4e2e)"
  fi
fi
if has levers; then
  step "Gemma 3n E4B levers: hot set, sorted+dedup, fp8 rows vs the table in HBM (graph decode, greedy tokens, logits)"
  timeout 480 python3 perf/studies/gemma3n_levers.py --out "$R/levers" ${LEVERS_ARGS:-} 2>&1 | tail -40
fi
step "done"
tar -czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$R"
ls -la "$OUT"
