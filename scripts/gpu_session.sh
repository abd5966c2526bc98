#!/usr/bin/env bash
# Batched GPU work on the 2xH200 machine (device tool), in stages of under 10 minutes each.
#   bash scripts/gpu_session.sh A   GPU checks (every gpu/multigpu test), then the full bf16 sweep
#                                   at TP 1/2 (argmax on GPU 0, verify on GPU 1, in parallel)
#   bash scripts/gpu_session.sh B   the sampled GPU test, the transport + plain-path sweep at TP2
#                                   over real NCCL (bf16, fp32, V=200064), then bf16/fp32 sweeps at
#                                   TP 4/8/1 for V=200064, 262144, 151936
#   bash scripts/gpu_session.sh C   the full benchmarks with the tables of A and B
#   bash scripts/gpu_session.sh D   the sampled GPU test and the step benchmark again (after a
#                                   change of the sampled kernels), then the bf16 TP2 sweep of the
#                                   vocabularies other than 200064
#   bash scripts/gpu_session.sh E   the sampled GPU tests (temperature, top-k, top-p, min-p) and the
#                                   step benchmark (greedy, sampled, sampled_nucleus rows)
#   bash scripts/gpu_session.sh F   every GPU check (strict mode against vLLM's own kernels
#                                   included: carry .vllm-kernels from scripts/vllm_kernels.sh),
#                                   then the step benchmark (fast and strict sampled rows)
#   bash scripts/gpu_session.sh G   the step benchmark alone
#   bash scripts/gpu_session.sh H   the sampled GPU tests (every C), then the sampled record
#                                   kernel's sweep (block, splits, warps, C): V=151936 on GPU 0,
#                                   V=200064 on GPU 1, merged into out/tables/sm90/sampled.json
#   bash scripts/gpu_session.sh I   the GPU tests of every C (GPU 0) next to the full sampled grid
#                                   with C = 32 admitted (--top-k-max 31; V=151936 TP2, rows 1 and
#                                   256; GPU 1; journal only, no table), then the step benchmark
#   bash scripts/gpu_session.sh J   the sampled sweep of stage H for fp32 (merged into the sampled
#                                   table carried in out/tables), then the step benchmark with it
#   bash scripts/gpu_session.sh K   one H200: every GPU test (sampled calls twice, bit-compared),
#                                   the fuzz corpus under compute-sanitizer memcheck (value checks
#                                   off), the engine-faithful loop (benchmarks/engine.py)
#   bash scripts/gpu_session.sh L   one H200: the capture test, the engine loop against vLLM
#                                   0.33's native chain, the sampled GPU tests, strict mode and
#                                   the native chain against vLLM's kernels (0.32, 0.33)
#   bash scripts/gpu_session.sh M   one H200: per-request resolution against vLLM's chains (both
#                                   pipelines, fast and strict, twice each), the engine loop with
#                                   the plug-in's resolving call
#   bash scripts/gpu_session.sh N   one H200: every kernel GPU test and the fuzz corpus under
#                                   compute-sanitizer memcheck on the final code
#   bash scripts/gpu_session.sh O   one H200: the level-histogram top-p replay against vLLM 0.33's
#                                   own top-p kernels and chain (benchmarks/topp_replay.py)
#   bash scripts/gpu_session.sh P   one H200: the top-p replay kernels (topp_hist / topp_replay):
#                                   their GPU tests, then against the plain-torch replay and vLLM
#                                   0.33's own top-p mask, twice per step, timed
#                                   (benchmarks/topp_kernels.py)
#   bash scripts/gpu_session.sh Q   one H200: top-p steps verified from level histograms against
#                                   every carried vLLM chain (twice, bit-compared), their flags and
#                                   bytes (benchmarks/flags.py) and the engine-faithful loop
#   bash scripts/gpu_session.sh R   one H200: one top-p step as the plug-in calls it at TP 2/4/8
#                                   (emulated) against vLLM's path (benchmarks/topp_step.py),
#                                   then the histogram path's flags and bytes on 20 steps
#   bash scripts/gpu_session.sh S   stage R's step benchmark alone, more steps per case
#   bash scripts/gpu_session.sh T   one H200: the captured resolution's GPU tests, the top-p step
#                                   with it vs the eager resolution and vLLM's path, a profile
#   bash scripts/gpu_session.sh U   one H200: graphs split at the collectives and replayed on a
#                                   static logits copy (GPU tests), then the top-p step with them
#   bash scripts/gpu_session.sh V   one H200: the engine-faithful loop alone
#   bash scripts/gpu_session.sh W   one H200: the captured resolution's GPU test, stage V, then
#                                   stage U's top-p step benchmark
#   bash scripts/gpu_session.sh X   one H200: graph, resolution and histogram top-p GPU tests
#   bash scripts/gpu_session.sh Y   one H200: flags and bytes of the histogram path, then stage
#                                   U's top-p step benchmark
#   bash scripts/gpu_session.sh DF  one H200: the device-decided fallback's GPU tests (conditional
#                                   graphs, vLLM's chain inside them, buckets), every graph GPU
#                                   test (table_copy, the fetched output slots), then the engine
#                                   loop
#   bash scripts/gpu_session.sh FP  one H200: the conditional graphs' and the device fallback's
#                                   GPU tests (TESTS=0: none), then the folded call's host cost
#                                   by part with a cProfile of it
#   bash scripts/gpu_session.sh TH  one H200: the top-p histogram GPU tests, then the engine loop
#                                   on top-p traffic
#   bash scripts/gpu_session.sh EN  one H200: the engine-faithful loop alone (MIXES=...;
#                                   FRESH=N: N realistic batches per shape, one per step;
#                                   CHURN=N: N batch shapes per row count, one per step;
#                                   CHURN_ORDER=walk: a random walk over them; CHURN_WARM=1:
#                                   each shape's first calls before the loop, timed apart;
#                                   ROWS=..., STEPS=...)
#   bash scripts/gpu_session.sh PR  one H200: host profiles of the engine loop's paths (MIXES,
#                                   ROWS) into $OUT/profile.log
#   bash scripts/gpu_session.sh CR  one H200: the compact resolution of a flagged step's body
#                                   (nested conditional graphs, resolve_select, the fallback's
#                                   GPU tests); then stage EN with MIXES=top_p
#   bash scripts/gpu_session.sh KB  one H200: the engine loop's paths by kernel (MIXES, ROWS),
#                                   then the top-p histogram / replay kernels at TP 1
#   bash scripts/gpu_session.sh FM  one H200: the GPU memory the folded device fallback holds
#   bash scripts/gpu_session.sh FT  one H200: the fallback GPU tests, then the engine loop on
#                                   top-p traffic (the folded fallback behind histogram top-p)
#   bash scripts/gpu_session.sh PL  one H200: the shared graph pool's GPU tests (a capture after
#                                   every graph of the pool was released), the conditional-graph
#                                   and the resolution GPU tests, then stage FT
#   bash scripts/gpu_session.sh HP  one H200: the host's elementary costs (the flag read, a graph
#                                   replay, a launch; PROFILE=1: host profiles of the plug-in's
#                                   replayed call and of a resolving top-p step)
#   bash scripts/gpu_session.sh RA  one H200: the host read's, the graph sync and vLLM pipeline
#                                   GPU tests, then the resolution GPU tests (resolve_apply)
#   bash scripts/gpu_session.sh GR  one H200: the sampled record and draw kernels' GPU tests
#                                   (histogram top-p included), then one rank's sampled step
#                                   with the tuned tables (no sweeps)
#   bash scripts/gpu_session.sh SL  one H200: the host costs of the replayed call by part, the
#                                   engine-faithful loop, then the phase-1 sweep of one rank's
#                                   sampled step (for tuner --phases-from) into
#                                   $OUT/sampled_sweep (the graph GPU tests: stage SLT)
#   bash scripts/gpu_session.sh SLT one H200: every graph GPU test, then stage GR's sampled step
#                                   with the tuned tables (after tuner --phases-from)
#   bash scripts/gpu_session.sh LA  one H200: the host costs, the engine loop (host at most 2 steps
#                                   ahead, as vLLM's async scheduling), then its greedy rows with
#                                   the host unbounded (--lookahead 0), same machine session
#   bash scripts/gpu_session.sh GL  one H200: every graph GPU test, then stage LA
#   bash scripts/gpu_session.sh GT  one H200: every graph GPU test, then the host costs
#   bash scripts/gpu_session.sh TL  one H200: every graph GPU test, the sampled GPU tests that
#                                   read top-p, then stage LA
#   bash scripts/gpu_session.sh PD  one H200: the PDL GPU tests (on against off, bit for bit), the
#                                   draw / phase-1 kernel tests, then one rank's sampled step with
#                                   the tuned tables (PDL on and off timed in the same run)
#   bash scripts/gpu_session.sh CX  one H200: the split-graph GPU tests, the host costs (replayed
#                                   TP > 1 steps gathering into the next graph's buffers against
#                                   gather + copy), host profiles of resolving top-p engine calls
#   bash scripts/gpu_session.sh RS  one H200: a resolving top-p step part by part (benchmarks.resolution)
#   bash scripts/gpu_session.sh T2  two H200s: the 2-GPU tests over NCCL, then the engine-faithful
#                                   loop at TP 2 (benchmarks.engine --tp 2)
#   bash scripts/gpu_session.sh Z   one H200: the resolution GPU tests, then stage U's top-p step
#                                   benchmark (after a change of the resolution's host path)
# Tables accumulate in out/tables/<arch>/ (carry it from one stage to the next; copy the final
# ones into generated/<arch>/). Everything comes back as $OUT/results.tar.gz plus the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?stage A-Z}
OUT=${OUT:-out/session}; mkdir -p "$OUT"
TABLES=$PWD/out/tables; mkdir -p "$TABLES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  # only the wheels of packages the image lacks (never shadow its numpy, yaml, ...)
  mapfile -t WHEELS < <(for w in .whl/*.whl; do
    m=$(basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    case $m in pyyaml) m=yaml ;; typing_extensions) ;; esac
    python3 -c "import $m" 2>/dev/null || echo "$w"
  done)
  if [ ${#WHEELS[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${WHEELS[@]}"
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "install failed"
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0))s] $*"; }
left() { echo $((${1} - ($(date +%s) - T0))); }  # seconds left of a stage deadline

# tune GPU OP LOG ARGS...: one single-GPU sweep writing into $TABLES
tune() {
  local gpu=$1 op=$2 log=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu python3 -m tuner --op "$op" --out "$TABLES" --no-progress \
    --space quick --rounds 3 "$@" >"$OUT/$log" 2>&1
  echo "  $op: rc=$? $(grep -c -- '->' "$OUT/$log") rows; $(grep -E 'budget spent|wrote' "$OUT/$log" | cut -c1-120 | tr '\n' ' ')"
}
pair() {  # pair LOGTAG ARGS...: argmax on GPU 0 and verify on GPU 1 at the same time
  local tag=$1
  shift
  tune 0 argmax "tune_${tag}_argmax.log" "$@" &
  tune 1 verify "tune_${tag}_verify.log" "$@" &
  wait
}

# host_and_engine STAGE HOST_DEADLINE ENGINE_DEADLINE: the replayed call's host costs into
# $OUT/host_costs, then the engine-faithful loop into $OUT/engine
host_and_engine() {
  stamp "host costs"
  timeout "$(left "$2")" python3 -m benchmarks.host_costs --out "$OUT/host_costs" \
    >"$OUT/host_costs_$1.log" 2>&1
  echo "  rc=$?"; grep -E " rows=|Error" "$OUT/host_costs_$1.log"
  stamp "engine-faithful loop"
  timeout "$(left "$3")" python3 -m benchmarks.engine --steps 100 --out "$OUT/engine" \
    >"$OUT/engine_$1.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) .*shardmax  |Error" "$OUT/engine_$1.log"
}

# engine_loop STAGE DEADLINE MIXES: the engine-faithful loop on MIXES into $OUT/STAGE.tar.gz
# (its log $OUT/engine_STAGE.log)
engine_loop() {
  stamp "engine loop ($3)"
  local warm=()
  [ "${CHURN_WARM:-0}" = 0 ] || warm=(--churn-warm)
  timeout "$(left "$2")" python3 -m benchmarks.engine --steps "${STEPS:-100}" --mixes "$3" \
    --rows "${ROWS:-4,32,96,256,512}" --fresh "${FRESH:-1}" --churn "${CHURN:-0}" \
    --churn-order "${CHURN_ORDER:-cycle}" "${warm[@]}" --out "$OUT/engine" \
    >"$OUT/engine_$1.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) .*(shardmax|vllm )|Error" \
    "$OUT/engine_$1.log" | head -60
  tar -czf "$OUT/$1.tar.gz" -C "$OUT" engine 2>/dev/null
  rm -rf "$OUT/engine"
}

# engine_diag LOG DEADLINE FLAG MIXES ROWS PATTERN: a short engine loop (20 steps) with one of
# its diagnostic flags (--profile, --kernels) into $OUT/LOG.log, its PATTERN lines shown
engine_diag() {
  stamp "engine loop $3"
  timeout "$(left "$2")" python3 -m benchmarks.engine --mixes "$4" --rows "$5" --steps 20 \
    --rounds 2 "$3" --out "$OUT/$1" >"$OUT/$1.log" 2>&1
  echo "  rc=$?"; grep -E "$6|Error" "$OUT/$1.log" | head -20
  rm -rf "${OUT:?}/$1"
}

# sampled_tuned_step STAGE DEADLINE: one rank's sampled step with the tuned tables (no sweeps;
# PDL on and off where supported) into $OUT/STAGE.tar.gz
sampled_tuned_step() {
  stamp "sampled step, tuned tables"
  timeout "$(left "$2")" python3 -m benchmarks.sampled_local --draw-sweep "" --eager 50 \
    --out "$OUT/sampled_tuned" >"$OUT/sampled_local_$1.log" 2>&1
  echo "  rc=$?"; grep -E "Error|DIFFER|NONDET|!!" "$OUT/sampled_local_$1.log" | head -5
  tar -czf "$OUT/$1.tar.gz" -C "$OUT" sampled_tuned 2>/dev/null
  rm -rf "$OUT/sampled_tuned"
}

# graph_tests STAGE DEADLINE: every graph GPU test (tests/test_graphs.py)
graph_tests() {
  stamp "graph GPU tests"
  timeout "$(left "$2")" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
    tests/test_graphs.py >"$OUT/graphs_$1.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/graphs_$1.log" | tail -8
}

# topp_step_hist STAGE DEADLINE: the top-p step as the plug-in calls it (histogram paths, graphs
# and eager) against vLLM's path, emulated TP, into $OUT/topp_step
topp_step_hist() {
  timeout "$(left "$2")" python3 -m benchmarks.topp_step --tp "${STEP_TP:-2,8}" \
    --steps "${STEP_STEPS:-8}" --calls "${STEP_CALLS:-6}" --paths shardmax-hist,shardmax-hist-eager \
    --out "$OUT/topp_step" >"$OUT/topp_step_$1.log" 2>&1
  echo "  rc=$?"; grep -E "^V=|Error|captured" "$OUT/topp_step_$1.log" | tail -40
}

# resolve_gpu_tests STAGE DEADLINE: the per-request resolution's GPU tests (vs vLLM's chains,
# eager and captured, every call twice)
resolve_gpu_tests() {
  stamp "resolution GPU tests"
  SHARDMAX_RESOLVE_GPU_SEEDS=${RESOLVE_SEEDS:-4} timeout "$(left "$2")" python3 -m pytest -m gpu \
    -q -p no:cacheprovider -s tests/test_resolve.py >"$OUT/resolve_$1.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED|\[captured|\[resolve" "$OUT/resolve_$1.log" | tail -24
}

# sanitized_fuzz STAGE DEADLINE: the fuzz corpus under compute-sanitizer memcheck, value checks off
sanitized_fuzz() {
  stamp "fuzz corpus under compute-sanitizer memcheck (value checks off)"
  SHARDMAX_FUZZ_VALUE_CHECKS=0 SHARDMAX_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-8} timeout "$(left "$2")" \
    compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider -W default -rf --tb=short tests/test_fuzz.py \
    >"$OUT/sanitizer_$1.log" 2>&1
  echo "  rc=$?"; grep -E "ERROR SUMMARY|passed|failed|^FAILED" "$OUT/sanitizer_$1.log" | tail -6
}

case "$STAGE" in
A)
  stamp "GPU checks"
  OUT="$OUT/checks" timeout 240 bash scripts/gpu_checks.sh 2>&1 | tail -40
  stamp "full bf16 sweep, TP 1/2"
  pair A --dtype bf16 --tp 1 2 --n-trials 10 --budget-s "$(left 520)"
  ;;
B)
  stamp "sampled verification on the GPU (fast mode vs the reference)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -k sampled tests/test_gpu.py 2>&1 | tail -3
  stamp "transport + plain path at TP2 over NCCL (bf16, fp32; V=200064)"
  timeout 200 torchrun --nproc-per-node 2 -m tuner --distributed --out "$TABLES" \
    --no-progress --space quick --rounds 3 --dtype bf16 fp32 --vocab 200064 --n-trials 10 \
    --rows 1 4 32 96 512 2048 --budget-s 170 >"$OUT/tune_B_tp2.log" 2>&1
  echo "  rc=$? $(grep -c -- '->' "$OUT/tune_B_tp2.log") rows; $(grep -E 'budget spent' "$OUT/tune_B_tp2.log" | cut -c1-300)"
  stamp "bf16 TP 4/8 and fp32 TP 1/4/8 sweeps (V=200064, 262144, 151936)"
  pair B1 --dtype bf16 --tp 4 8 --vocab 200064 262144 151936 --rows 1 4 16 32 96 256 512 2048 \
    --n-trials 8 --budget-s "$(($(left 560) * 3 / 5))"
  pair B2 --dtype fp32 --tp 1 4 8 --vocab 200064 --rows 1 4 16 32 96 256 512 2048 \
    --n-trials 8 --budget-s "$(left 560)"
  ;;
C)
  stamp "benchmarks (full matrix) with the new tables"
  SHARDMAX_TABLES_DIR=$TABLES timeout "$(left 560)" python3 -m benchmarks \
    --budget-s "$(left 500)" --out benchmarks/results/sm90 >"$OUT/bench.log" 2>&1
  echo "  rc=$?"
  tail -30 "$OUT/bench.log"
  ;;
D)
  stamp "sampled verification on the GPU (record splits on)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -k sampled tests/test_gpu.py 2>&1 | tail -3
  stamp "step benchmark again (greedy + sampled paths)"
  SHARDMAX_TABLES_DIR=$TABLES timeout 150 python3 -m benchmarks --part step --budget-s 120 \
    --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
  echo "  rc=$?"
  tail -20 "$OUT/bench_step.log"
  stamp "bf16 TP2 sweep for the other vocabularies (single GPU each op)"
  pair D --dtype bf16 --tp 2 --vocab 50257 128256 151936 152064 163840 262144 \
    --n-trials 8 --budget-s "$(left 500)"
  ;;
E)
  stamp "sampled verification on the GPU (temperature, top-k, top-p, min-p)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k sampled tests/test_gpu.py 2>&1 | tail -15
  stamp "step benchmark (greedy + sampled paths)"
  SHARDMAX_TABLES_DIR=$TABLES timeout 200 python3 -m benchmarks --part step --budget-s 170 \
    --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
  echo "  rc=$?"
  tail -30 "$OUT/bench_step.log"
  ;;
F)
  stamp "GPU checks (every gpu/multigpu test; strict mode vs vLLM's kernels)"
  OUT="$OUT/checks" timeout 330 bash scripts/gpu_checks.sh -s 2>&1 \
    | grep -E '^\[strict|^GPU test|^test_|^TOTAL|passed|failed|Error' | tail -70
  stamp "step benchmark (greedy, sampled fast + strict, sampled_nucleus fast + strict)"
  SHARDMAX_TABLES_DIR=$TABLES timeout "$(left 570)" python3 -m benchmarks --part step \
    --budget-s "$(left 540)" --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
  echo "  rc=$?"
  tail -30 "$OUT/bench_step.log"
  ;;
G)
  stamp "step benchmark"
  SHARDMAX_TABLES_DIR=$TABLES timeout 400 python3 -m benchmarks --part step --budget-s 360 \
    --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
  echo "  rc=$?"
  tail -22 "$OUT/bench_step.log"
  ;;
H | J)
  SWEEP_DTYPE=bf16 DEADLINE=540
  if [ "$STAGE" = J ]; then
    SWEEP_DTYPE=fp32 DEADLINE=400
  else
    stamp "sampled GPU tests (every C a table may pick, record candidates, fast mode)"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -k "sampled or record_candidates or strict or layout" \
      tests/test_gpu.py tests/test_strict_vllm.py 2>&1 | tail -6
  fi
  stamp "sampled sweep: V=151936 on GPU 0, V=200064 on GPU 1 ($SWEEP_DTYPE, TP 2/4/8)"
  budget=$(($(left $DEADLINE) - 30))
  for g in 0 1; do
    vocab=$([ $g = 0 ] && echo 151936 || echo 200064)
    tune $g sampled "tune_H_$vocab.log" --out "$TABLES/g$g" --studies-dir "$OUT/studies_g$g" \
      --dtype $SWEEP_DTYPE --tp 2 4 8 --vocab "$vocab" --rows 1 4 16 64 256 1024 \
      --n-trials 14 --budget-s "$budget" &
  done
  wait
  python3 - "$TABLES" <<'PY'
import json, sys
from pathlib import Path
from shardmax.tuner import export
root = Path(sys.argv[1])
tables = [export.read_table(root / f"g{g}" / "sm90" / "sampled.json") for g in (0, 1)]
tables = [t for t in tables if t is not None]
if tables:
    new = list({json.dumps(r["match"], sort_keys=True): r for t in tables for r in t["rows"]
                if r["match"] and r.get("tuned", True)}.values())  # one row per match
    prov = dict(tables[0]["provenance"], mode="single-gpu record kernel step (record + merge + "
                "finish on tp copies of one rank's buffer); two GPUs, one vocabulary each")
    path = export.write_table(root, "sm90", "sampled", new, prov, tuned=True)
    print(f"  merged {len(new)} tuned rows -> {path}")
    from shardmax.tuner.plot import plot_table
    print(f"  plot {plot_table(path)}")
PY
  if [ "$STAGE" = J ]; then
    stamp "step benchmark"
    SHARDMAX_TABLES_DIR=$TABLES timeout "$(left 570)" python3 -m benchmarks --part step \
      --budget-s "$(left 545)" --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
    echo "  rc=$?"
    tail -22 "$OUT/bench_step.log"
  fi
  ;;
I)
  stamp "GPU tests of every C (GPU 0) | sampled grid with C = 32 admitted (GPU 1)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -k "every_candidate_count or record_candidates" tests/test_gpu.py >"$OUT/tests_I.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m tuner --op sampled --top-k-max 31 --vocab 151936 \
    --tp 2 --rows 1 256 --space quick --rounds 3 --no-write-table --no-progress \
    --studies-dir "$OUT/studies_c32" --out "$OUT/c32" >"$OUT/tune_I_c32.log" 2>&1 &
  wait
  tail -4 "$OUT/tests_I.log"
  grep -E -- '->|budget' "$OUT/tune_I_c32.log"
  stamp "step benchmark"
  timeout "$(left 560)" python3 -m benchmarks --part step --budget-s "$(left 530)" \
    --out benchmarks/results/sm90 >"$OUT/bench_step.log" 2>&1
  echo "  rc=$?"
  tail -22 "$OUT/bench_step.log"
  ;;
K)
  # runtime v2 on one H200: the GPU tests (sampled calls twice, bit-compared), the fuzz corpus
  # under compute-sanitizer memcheck with the value checks off, the engine-faithful loop (with a
  # host profile of shardmax's call), strict mode against vLLM's kernels of every carried version
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "GPU tests"
  timeout "$(left 220)" python3 -m pytest -q -p no:cacheprovider -m gpu -W default -rf --tb=line \
    tests/test_gpu.py ${TESTS_K:-} >"$OUT/tests_K.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/tests_K.log" | tail -12
  sanitized_fuzz K 300
  stamp "engine-faithful loop"
  timeout "$(left ${ENGINE_END:-540})" python3 -m benchmarks.engine --steps 100 ${ENGINE_ARGS:-} \
    --out "$OUT/engine" >"$OUT/engine_K.log" 2>&1
  echo "  rc=$?"; grep -vE "^ +[0-9]+ +[0-9.]+" "$OUT/engine_K.log" | tail -60
  ;;
L)
  # runtime v2, second H200 run: the capture test, the engine-faithful loop against vLLM 0.33's
  # native chain, the sampled GPU tests (twice each, bit-compared), strict mode and the native
  # chain against vLLM's kernels of every carried version
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "capture after warm-up"
  timeout "$(left 60)" python3 -m pytest -x -q -p no:cacheprovider -W default --tb=short \
    tests/test_gpu.py::test_capture_after_warmup_never_compiles 2>&1 | tail -25
  stamp "engine-faithful loop"
  timeout "$(left 300)" python3 -m benchmarks.engine --steps 100 ${ENGINE_ARGS:-} \
    --out "$OUT/engine" >"$OUT/engine_L.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) " "$OUT/engine_L.log"
  stamp "sampled GPU tests"
  timeout "$(left 430)" python3 -m pytest -q -p no:cacheprovider -m gpu -W default -rf \
    --tb=short -k "sampled or candidate or strict" tests/test_gpu.py >"$OUT/tests_L.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests_L.log" | tail -12
  stamp "strict mode and the native chain vs vLLM's kernels (0.32, 0.33)"
  timeout "$(left 565)" python3 -m pytest -q -p no:cacheprovider -m gpu -W default -rf \
    --tb=short tests/test_strict_vllm.py tests/test_vllm_chain.py >"$OUT/vllm_L.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/vllm_L.log" | tail -12
  ;;
M)
  # per-request resolution on one H200: flagged top-p requests resolved from their own rows ==
  # vLLM's chain on the whole step (0.32, 0.33; split and monolithic pipelines; fast and strict;
  # twice, bit-compared), then the engine-faithful loop with the plug-in's resolving call
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "resolution vs vLLM's chains"
  SHARDMAX_RESOLVE_GPU_SEEDS=${RESOLVE_SEEDS:-110} timeout "$(left 260)" python3 -m pytest -q -s \
    -p no:cacheprovider -m gpu -W default -rf --tb=short tests/test_resolve.py \
    >"$OUT/resolve_M.log" 2>&1
  echo "  rc=$?"; grep -E "resolve gpu|passed|failed|^FAILED|^E " "$OUT/resolve_M.log" | tail -40
  stamp "engine-faithful loop"
  timeout "$(left 570)" python3 -m benchmarks.engine --steps 100 ${ENGINE_ARGS:-} \
    --out "$OUT/engine" >"$OUT/engine_M.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) " "$OUT/engine_M.log"
  ;;
N)
  # the final code on one H200: every GPU test of the kernels (sampled calls twice,
  # bit-compared) and the fuzz corpus under compute-sanitizer memcheck, value checks off
  stamp "GPU tests"
  timeout "$(left 300)" python3 -m pytest -q -p no:cacheprovider -m gpu -W default -rf --tb=line \
    tests/test_gpu.py >"$OUT/tests_N.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/tests_N.log" | tail -12
  sanitized_fuzz N 570
  ;;
O)
  # the level-histogram top-p replay on realistic steps against vLLM 0.33's own top-p kernels
  # and chain on CUDA (carry .vllm-kernels): coverage, bytes, oracle mismatches
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "top-p replay vs vLLM 0.33"
  timeout "$(left 570)" python3 -m benchmarks.topp_replay --steps "${TOPP_STEPS:-30}" \
    --workers "$(($(nproc) - 2))" --out "$OUT/topp_replay" \
    >"$OUT/topp_replay_O.log" 2>&1
  echo "  rc=$?"; tail -n 20 "$OUT/topp_replay_O.log"
  ;;
Q)
  # top-p steps verified from level histograms (issue 18) on one H200: vs every carried vLLM
  # chain (twice, bit-compared), flags and bytes on realistic traffic, the engine-faithful loop
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "histogram top-p vs vLLM's chains (every call twice)"
  SHARDMAX_TOPP_GPU_SEEDS=${TOPP_SEEDS:-6} timeout "$(left 200)" python3 -m pytest -m gpu -q -s \
    -p no:cacheprovider -W default -rf --tb=short tests/test_topp_verify.py \
    >"$OUT/topp_verify_Q.log" 2>&1
  echo "  rc=$?"; grep -E "topp gpu|passed|failed|^FAILED|^E " "$OUT/topp_verify_Q.log" | tail -20
  stamp "flags and bytes, histogram path"
  timeout "$(left 420)" python3 -m benchmarks.flags --paths histogram --seeds "${FLAG_SEEDS:-10}" \
    --out "$OUT/flags_hist" >"$OUT/flags_Q.log" 2>&1
  echo "  rc=$?"; tail -n 16 "$OUT/flags_Q.log"
  stamp "engine-faithful loop, top-p"
  timeout "$(left 580)" python3 -m benchmarks.engine --mixes top_p --rows "${ENGINE_ROWS:-32,160}" \
    --steps "${ENGINE_STEPS:-60}" --out "$OUT/engine_topp" >"$OUT/engine_Q.log" 2>&1
  echo "  rc=$?"; grep -E "^top_p " "$OUT/engine_Q.log"
  ;;
R)
  # one top-p step as the plug-in calls it at TP > 1 (emulated in-process) against vLLM's path,
  # then the histogram path's flags and bytes on more steps; results tarred in one file
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  timeout "$(left 330)" python3 -m benchmarks.topp_step --steps "${STEP_STEPS:-3}" \
    --calls "${STEP_CALLS:-10}" --out "$OUT/topp_step" >"$OUT/topp_step_R.log" 2>&1
  echo "  rc=$?"; grep -E "^V=|Error" "$OUT/topp_step_R.log" | tail -40
  stamp "flags and bytes, histogram path"
  timeout "$(left 560)" python3 -m benchmarks.flags --paths histogram --seeds "${FLAG_SEEDS:-20}" \
    --out "$OUT/flags_hist" >"$OUT/flags_R.log" 2>&1
  echo "  rc=$?"; tail -n 16 "$OUT/flags_R.log"
  tar -czf "$OUT/R.tar.gz" -C "$OUT" topp_step flags_hist 2>/dev/null
  rm -rf "$OUT/topp_step" "$OUT/flags_hist"
  ;;
S)
  # stage R's step benchmark alone, on more steps per case (STEP_TP, STEP_STEPS, STEP_CALLS)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  timeout "$(left 540)" python3 -m benchmarks.topp_step --tp "${STEP_TP:-2,8}" \
    --steps "${STEP_STEPS:-12}" --calls "${STEP_CALLS:-6}" --out "$OUT/topp_step" \
    >"$OUT/topp_step_S.log" 2>&1
  echo "  rc=$?"; grep -E "^V=|Error" "$OUT/topp_step_S.log" | tail -40
  tar -czf "$OUT/S.tar.gz" -C "$OUT" topp_step 2>/dev/null
  rm -rf "$OUT/topp_step"
  ;;
T)
  # the captured resolution: its GPU tests (against every carried vLLM chain, replays compared
  # bit for bit), then the top-p step with it against the eager resolution and vLLM's path, then
  # where the host time of a resolving step goes (cProfile)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "resolution GPU tests"
  SHARDMAX_RESOLVE_GPU_SEEDS=${RESOLVE_SEEDS:-6} timeout "$(left 200)" python3 -m pytest -m gpu -q \
    -p no:cacheprovider -s tests/test_resolve.py >"$OUT/resolve_T.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|\[captured|\[resolve" "$OUT/resolve_T.log" | tail -24
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  topp_step_hist T 500
  stamp "profile"
  timeout "$(left 560)" python3 -m benchmarks.topp_step --profile --tp 2 --reqs 40 \
    --vocab 200064 --steps 6 >"$OUT/profile_T.log" 2>&1
  echo "  rc=$?"
  tar -czf "$OUT/T.tar.gz" -C "$OUT" topp_step 2>/dev/null
  rm -rf "$OUT/topp_step"
  ;;
U)
  # graphs split at the collectives + static-logits replay (strict, top-p histograms): the graph
  # GPU tests and the other graph checks, then the top-p step as the plug-in now calls it
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "graph GPU tests"
  timeout "$(left 240)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py \
    tests/test_gpu.py -k "graph or replay" >"$OUT/graphs_U.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED" "$OUT/graphs_U.log" | tail -20
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  topp_step_hist U 560
  tar -czf "$OUT/U.tar.gz" -C "$OUT" topp_step 2>/dev/null
  rm -rf "$OUT/topp_step"
  ;;
V)
  # the engine-faithful loop with the plug-in's current call (graphs, captured resolution)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "engine-faithful loop"
  timeout "$(left 570)" python3 -m benchmarks.engine --steps 100 ${ENGINE_ARGS:-} \
    --out "$OUT/engine" >"$OUT/engine_V.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) |Error" "$OUT/engine_V.log"
  tar -czf "$OUT/V.tar.gz" -C "$OUT" engine 2>/dev/null
  rm -rf "$OUT/engine"
  ;;
W)
  # the captured resolution's GPU test, then stage V's engine loop and stage U's top-p step
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "captured resolution GPU test"
  SHARDMAX_RESOLVE_GPU_SEEDS=${RESOLVE_SEEDS:-6} timeout "$(left 120)" python3 -m pytest -m gpu -q \
    -p no:cacheprovider -s tests/test_resolve.py -k captured >"$OUT/resolve_W.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|\[captured" "$OUT/resolve_W.log" | tail -12
  stamp "engine-faithful loop"
  timeout "$(left 300)" python3 -m benchmarks.engine --steps 100 ${ENGINE_ARGS:-} \
    --out "$OUT/engine" >"$OUT/engine_W.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) |Error" "$OUT/engine_W.log" | grep -v "eager"
  stamp "top-p step"
  topp_step_hist W 560
  tar -czf "$OUT/W.tar.gz" -C "$OUT" engine topp_step 2>/dev/null
  rm -rf "$OUT/engine" "$OUT/topp_step"
  ;;
X)
  # the resolution gathering only uncertified rows (synthetic rows for the certified ones): the
  # graph GPU tests, the resolution GPU tests and the histogram top-p GPU tests against every
  # carried vLLM chain (every call twice, bit-compared)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "graph GPU tests"
  timeout "$(left 200)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py \
    tests/test_gpu.py -k "graph or replay" >"$OUT/graphs_X.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED" "$OUT/graphs_X.log" | tail -12
  resolve_gpu_tests X 400
  stamp "histogram top-p vs vLLM's chains (every call twice)"
  SHARDMAX_TOPP_GPU_SEEDS=${TOPP_SEEDS:-4} timeout "$(left 570)" python3 -m pytest -m gpu -q -s \
    -p no:cacheprovider -rf --tb=short tests/test_topp_verify.py >"$OUT/topp_verify_X.log" 2>&1
  echo "  rc=$?"; grep -E "topp gpu|passed|failed|^FAILED|^E " "$OUT/topp_verify_X.log" | tail -16
  ;;
Y)
  # stage X's change measured: flags and bytes of the histogram path (every request compared
  # with vLLM 0.33's chain, the flagged ones resolved), then the top-p step as the plug-in calls it
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "flags and bytes, histogram path"
  timeout "$(left 300)" python3 -m benchmarks.flags --paths histogram --seeds "${FLAG_SEEDS:-20}" \
    --out "$OUT/flags_hist" >"$OUT/flags_Y.log" 2>&1
  echo "  rc=$?"; tail -n 16 "$OUT/flags_Y.log"
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  topp_step_hist Y 570
  tar -czf "$OUT/Y.tar.gz" -C "$OUT" flags_hist topp_step 2>/dev/null
  rm -rf "$OUT/flags_hist" "$OUT/topp_step"
  ;;
Z)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  resolve_gpu_tests Z 200
  stamp "top-p step: plug-in call vs vLLM (emulated TP)"
  topp_step_hist Z 570
  tar -czf "$OUT/Z.tar.gz" -C "$OUT" topp_step 2>/dev/null
  rm -rf "$OUT/topp_step"
  ;;
P)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "top-p replay kernels: GPU tests (every call twice, bit-compared)"
  timeout "$(left 200)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_topp_kernels.py \
    >"$OUT/topp_kernels_tests.log" 2>&1
  echo "  rc=$?"; tail -n 3 "$OUT/topp_kernels_tests.log"
  stamp "top-p replay kernels vs the reference and vLLM 0.33"
  timeout "$(left 570)" python3 -m benchmarks.topp_kernels --steps "${TOPP_STEPS:-3}" \
    --out "$OUT/topp_kernels" >"$OUT/topp_kernels_P.log" 2>&1
  echo "  rc=$?"; tail -n 30 "$OUT/topp_kernels_P.log"
  ;;
HP)
  # the host's elementary costs (benchmarks/host_costs.py: reading the flags, a graph replay, a
  # launch) and the host read's GPU test; PROFILE=1 adds host profiles of the plug-in's replayed
  # call and of a resolving top-p step (cProfile)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "host read GPU test"
  timeout "$(left 60)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host.py \
    >"$OUT/host_HP.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error" "$OUT/host_HP.log" | tail -3
  stamp "host costs"
  timeout "$(left 200)" python3 -m benchmarks.host_costs --out "$OUT/host_costs" \
    >"$OUT/host_costs_HP.log" 2>&1
  echo "  rc=$?"; grep -E "^reqs=|GPU (idle|busy)| rows=|Error" "$OUT/host_costs_HP.log"
  if [ -n "${PROFILE:-}" ]; then
    stamp "engine loop host profile"
    timeout "$(left 420)" python3 -m benchmarks.engine --steps 50 --rows 32,512 \
      --mixes greedy,temperature --profile --out "$OUT/engine" >"$OUT/engine_HP.log" 2>&1
    echo "  rc=$?"; grep -E "^(greedy|temperature) |Error" "$OUT/engine_HP.log"
    stamp "top-p step host profile"
    timeout "$(left 560)" python3 -m benchmarks.topp_step --vocab 200064 --tp 2 --reqs 40 \
      --steps 6 --calls 4 --paths shardmax-hist --profile --out "$OUT/topp_step" \
      >"$OUT/topp_step_HP.log" 2>&1
    echo "  rc=$?"
  fi
  tar -czf "$OUT/HP.tar.gz" -C "$OUT" host_costs engine topp_step 2>/dev/null
  rm -rf "$OUT/host_costs" "$OUT/engine" "$OUT/topp_step"
  ;;
GR)
  # after a change of the sampled record / draw kernels: their GPU tests (adversarial greedy
  # rows, fast mode vs the reference with and without candidates, two-phase vs vLLM 0.33, the
  # level-histogram top-p steps vs vLLM's chains; every call twice, bit-compared), then one
  # rank's sampled step with the tuned tables at TP 1/2/4/8 (benchmarks.sampled_local without
  # sweeps) into $OUT/sampled_tuned
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "sampled record / draw GPU tests"
  timeout "$(left 200)" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
    tests/test_sampled_verify.py tests/test_two_phase.py \
    "tests/test_gpu.py::test_sampled_verify_fast_mode_on_gpu" >"$OUT/sampled_GR.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED" "$OUT/sampled_GR.log" | tail -8
  stamp "histogram top-p vs vLLM's chains (every call twice)"
  SHARDMAX_TOPP_GPU_SEEDS=${TOPP_SEEDS:-1} timeout "$(left 300)" python3 -m pytest -m gpu -q -s \
    -p no:cacheprovider -rf --tb=short tests/test_topp_verify.py >"$OUT/topp_verify_GR.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/topp_verify_GR.log" | tail -6
  stamp "sampled step, tuned tables"
  timeout "$(left 380)" python3 -m benchmarks.sampled_local --draw-sweep "" \
    --out "$OUT/sampled_tuned" >"$OUT/sampled_local_GR.log" 2>&1
  echo "  rc=$?"; grep -E "Error|DIFFER|!!" "$OUT/sampled_local_GR.log" | head -5
  python3 -m benchmarks.sampled_local --plot "$OUT/sampled_tuned/sampled_local.csv" >/dev/null \
    && sed -n '/## Targets/,/## Per-kernel/p' "$OUT/sampled_tuned/SAMPLED.md"
  tar -czf "$OUT/GR.tar.gz" -C "$OUT" sampled_tuned 2>/dev/null
  ;;
SL)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  host_and_engine SL 170 300
  stamp "phase-1 sweep"
  timeout "$(left 585)" python3 -m benchmarks.sampled_local --draw-sweep "" --eager 50 \
    --phase1-sweep "${SWEEP:-1024,2048,4096:2,4,8,16,32:4,8}" --out "$OUT/sampled_sweep" \
    >"$OUT/sampled_sweep_SL.log" 2>&1
  echo "  rc=$?"; grep -E "Error|DIFFER|!!" "$OUT/sampled_sweep_SL.log" | head -5
  tar -czf "$OUT/SL.tar.gz" -C "$OUT" host_costs engine sampled_sweep 2>/dev/null
  rm -rf "$OUT/host_costs" "$OUT/engine" "$OUT/sampled_sweep"
  ;;
SLT)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  graph_tests SLT 420
  sampled_tuned_step SLT 585
  ;;
TL)
  # the replayed step's page-locked tables and fp32 top-p: the graph GPU tests, the sampled
  # GPU tests that read top-p (fast mode, candidates; top-p steps against vLLM's chains), then
  # stage LA in a fresh process (its own deadlines)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  graph_tests TL 260
  stamp "sampled GPU tests reading top-p"
  timeout "$(left 420)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_resolve.py tests/test_topp_verify.py -k "fast_mode or candidate or top_p or topp" \
    >"$OUT/topp_TL.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/topp_TL.log" | tail -8
  OUT=$OUT bash "$0" LA
  ;;
GT)
  # after a change of the replayed step: the graph GPU tests, then its host costs
  graph_tests GT 300
  stamp "host costs"
  timeout "$(left 470)" python3 -m benchmarks.host_costs --out "$OUT/host_costs" \
    >"$OUT/host_costs_GT.log" 2>&1
  echo "  rc=$?"; grep -E " rows=|Error" "$OUT/host_costs_GT.log"
  ;;
GL)
  graph_tests GL 300
  OUT=$OUT bash "$0" LA
  ;;
PD)
  # programmatic dependent launch: its GPU tests (on against off, bit for bit; every launched
  # binary waits exactly when launched with it), the compiled draw / phase-1 kernel tests, then
  # one rank's sampled step with the tuned tables (PDL on and off in the same run)
  stamp "PDL and kernel GPU tests"
  timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py \
    tests/test_draw_kernel.py tests/test_phase1_tiles.py >"$OUT/pdl_PD.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/pdl_PD.log" | tail -6
  sampled_tuned_step PD 420
  ;;
LA)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  host_and_engine LA 90 330
  stamp "engine loop, greedy, host unbounded"
  timeout "$(left 450)" python3 -m benchmarks.engine --steps 100 --lookahead 0 --mixes greedy \
    --out "$OUT/engine_unbounded" >"$OUT/engine_unbounded_LA.log" 2>&1
  echo "  rc=$?"; grep -E "^greedy .*shardmax  |Error" "$OUT/engine_unbounded_LA.log"
  tar -czf "$OUT/LA.tar.gz" -C "$OUT" host_costs engine engine_unbounded 2>/dev/null
  rm -rf "$OUT/host_costs" "$OUT/engine" "$OUT/engine_unbounded"
  ;;
CX)
  # replayed TP > 1 steps gathering into the next graph's buffers: the split-graph GPU tests
  # (each step's replay == its launches, twice, no host sync), the host costs (section 4: into
  # against gather + copy on the same graphs), then host profiles of the engine loop's resolving
  # top-p calls (where a resolving step's host time goes)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "split-graph GPU tests"
  timeout "$(left 200)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py \
    -k "split or sync or allreduce" >"$OUT/graphs_CX.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/graphs_CX.log" | tail -6
  stamp "host costs"
  timeout "$(left 330)" python3 -m benchmarks.host_costs --out "$OUT/host_costs" \
    >"$OUT/host_costs_CX.log" 2>&1
  echo "  rc=$?"; grep -E "^split |Error" "$OUT/host_costs_CX.log"
  stamp "resolving top-p calls, host profile"
  timeout "$(left 560)" python3 -m benchmarks.engine --steps 20 --rounds 2 --rows "${PROF_ROWS:-96}" \
    --mixes top_p --profile --out "$OUT/engine_prof" >"$OUT/engine_prof_CX.log" 2>&1
  echo "  rc=$?"; grep -E "^top_p |Error" "$OUT/engine_prof_CX.log"
  tar -czf "$OUT/CX.tar.gz" -C "$OUT" host_costs engine_prof 2>/dev/null
  rm -rf "$OUT/host_costs" "$OUT/engine_prof"
  ;;
RS)
  # a resolving top-p step part by part (benchmarks/resolution.py: flag read, rows, gather, the
  # captured resolution's host and GPU time, its kernels)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "resolution by part"
  timeout "$(left 400)" python3 -m benchmarks.resolution --rows "${RS_ROWS:-96,512}" \
    --out "$OUT/resolution" >"$OUT/resolution_RS.log" 2>&1
  echo "  rc=$?"; grep -E "^\| |Error" "$OUT/resolution_RS.log" | head -40
  tar -czf "$OUT/RS.tar.gz" -C "$OUT" resolution 2>/dev/null
  rm -rf "$OUT/resolution"
  stamp "the tuner's per-warps spill check with this image's Triton (compiles 2 launches)"
  timeout "$(left 60)" python3 - <<'PY' 2>&1 | grep -v -i fusion | tail -4
from shardmax.generator.aot import launch_resources
from shardmax.generator.render import generated_dir
for w in (4, 8):
    r = launch_resources(str(generated_dir()), "sm90", "sampled_record_bf16_b4096", w)
    print(f"  sampled_record_bf16_b4096 at {w} warps: {r['registers']} registers, "
          f"{r['spill_bytes']} B spilled")
PY
  stamp "CUDA-graph conditional nodes with this image's torch (a device-decided resolution?)"
  timeout "$(left 60)" python3 - <<'PY' 2>&1 | grep -v -i fusion | tail -6
import time
import torch
G = torch.cuda.CUDAGraph
print("  begin_capture_to_if_node:", hasattr(G, "begin_capture_to_if_node"),
      "get_currently_capturing_graph:", hasattr(G, "get_currently_capturing_graph"))
pred = torch.zeros((), dtype=torch.bool, device="cuda")
x = torch.zeros(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    x.add_(1)  # warm-up outside capture
torch.cuda.synchronize()
with torch.cuda.graph(g, stream=s):
    x.add_(1)
    cur = G.get_currently_capturing_graph()
    cur.begin_capture_to_if_node(pred)
    for _ in range(8):
        x.mul_(2)
    cur.end_capture_to_conditional_node()
x.zero_(); pred.fill_(False); g.replay(); torch.cuda.synchronize(); off = x[0].item()
x.zero_(); pred.fill_(True); g.replay(); torch.cuda.synchronize(); on = x[0].item()
def timed(v):
    pred.fill_(v); torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(200):
        g.replay()
    e1.record(); torch.cuda.synchronize(); return e0.elapsed_time(e1) * 1000 / 200
print(f"  body skipped -> {off} (want 1.0), taken -> {on} (want 256.0); "
      f"replay GPU us: skipped {timed(False):.1f}, taken {timed(True):.1f}")
PY
  ;;
T2)
  # two H200s (kind nvidia-h200-x2): the 2-GPU tests over NCCL (greedy parity eager and
  # graphed, a sampled step replayed from graphs split at its all_gathers == its launches),
  # then the engine-faithful loop at TP 2 (every path on each rank's shard; vLLM's after the
  # full-logits all-gather)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "2-GPU tests"
  timeout "$(left 240)" python3 -m pytest -m multigpu -q -p no:cacheprovider \
    tests/test_distributed.py >"$OUT/multigpu_T2.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/multigpu_T2.log" | tail -6
  stamp "engine loop, TP 2"
  timeout "$(left 585)" python3 -m benchmarks.engine --tp 2 --steps "${TP2_STEPS:-60}" \
    --rounds 3 --out "$OUT/engine_tp2" >"$OUT/engine_tp2_T2.log" 2>&1
  echo "  rc=$?"; grep -E "^(greedy|temperature|top_p) .*(shardmax|vllm) |Error" \
    "$OUT/engine_tp2_T2.log" | head -40
  tar -czf "$OUT/T2.tar.gz" -C "$OUT" engine_tp2 2>/dev/null
  rm -rf "$OUT/engine_tp2"
  ;;
DF)
  # the device-decided fallback: conditional CUDA graphs built through the driver API (GPU
  # tests: body skipped / taken, launch cost), the fallback against vLLM's chain (twice per
  # step, no host sync), then the engine loop with its path (shardmax+device)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "conditional graph + device fallback GPU tests"
  timeout "$(left 240)" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_conditional.py \
    tests/test_fallback.py >"$OUT/fallback_DF.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E |\[if-graph\]|\[device fallback\]" \
    "$OUT/fallback_DF.log" | tail -14
  stamp "every graph GPU test (table_copy, the fetched output slots)"
  timeout "$(left 330)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py \
    >"$OUT/graphs_DF.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/graphs_DF.log" | tail -6
  stamp "engine loop"
  timeout "$(left 585)" python3 -m benchmarks.engine --steps "${DF_STEPS:-100}" \
    --mixes "${DF_MIXES:-greedy,temperature}" --out "$OUT/engine" >"$OUT/engine_DF.log" 2>&1
  echo "  rc=$?"; grep -E "^(temperature|top_p|greedy) .*(shardmax|vllm)|Error|not measured" \
    "$OUT/engine_DF.log" | head -60
  tar -czf "$OUT/DF.tar.gz" -C "$OUT" engine 2>/dev/null
  rm -rf "$OUT/engine"
  ;;
FP)
  # the folded call's host cost by part (benchmarks.host_costs --only-fold: the call with and
  # without the folded device fallback, the fold's own work, its conditional graph's launch
  # against the plain replay, a cProfile of the folded call), after the conditional graphs'
  # and the fallback's GPU tests
  # (TESTS=0: the measurement alone)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  if [ "${TESTS:-1}" != 0 ]; then
    stamp "conditional graph + device fallback GPU tests"
    timeout "$(left 240)" python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_conditional.py tests/test_fallback.py >"$OUT/fallback_FP.log" 2>&1
    echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/fallback_FP.log" | tail -8
  fi
  stamp "folded call host cost by part"
  timeout "$(left 420)" python3 -m benchmarks.host_costs --only-fold \
    --out "$OUT/host_costs_fold" >"$OUT/fold_parts.log" 2>&1
  echo "  rc=$?"; grep -E "^(temperature|top_p)|nodes|tottime|Error|^ +[0-9]" "$OUT/fold_parts.log" | head -120
  ;;
PL)
  # after a change of the graph pools: their own GPU tests and the conditional graphs', the
  # resolution's (its captures share one pool), then stage FT (the fallback's)
  stamp "graph pool + conditional graph GPU tests"
  timeout "$(left 60)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pools.py \
    tests/test_conditional.py >"$OUT/pools_PL.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED|^E " "$OUT/pools_PL.log" | tail -8
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  RESOLVE_SEEDS=${RESOLVE_SEEDS:-2} resolve_gpu_tests PL 200
  bash "$0" FT
  ;;
FT)
  # the folded fallback on top-p steps: the fallback GPU tests (the top-p fold's among them),
  # then the engine loop on top-p traffic (shardmax-hist+fold, the fold behind histogram top-p)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "device fallback GPU tests"
  timeout "$(left 200)" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_fallback.py \
    >"$OUT/fallback_FT.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E |\[folded" "$OUT/fallback_FT.log" | tail -14
  engine_loop FT 540 top_p
  ;;
TH)
  # after a change of how top-p's level histograms read the logits: the GPU tests that run the
  # histogram plans (replayed and eager, PDL on and off, the top-p kernels and verification,
  # the folded fallback behind them), then the engine loop on top-p traffic
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "top-p histogram GPU tests"
  timeout "$(left 330)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py \
    tests/test_pdl.py tests/test_topp_kernels.py tests/test_topp_verify.py tests/test_fallback.py \
    -k "top_p_hist or topp or hist" >"$OUT/topp_TH.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/topp_TH.log" | tail -8
  engine_loop TH 560 top_p
  ;;
CR)
  # after a change of the fallback's body (its compact resolution: nested IF nodes, the flagged
  # requests picked on the device): the conditional graphs' and the fallback's GPU tests
  # (TESTS=0 skips them), then the engine loop (MIXES, default top_p: the flagged batches)
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  if [ "${TESTS:-1}" != 0 ]; then
    stamp "conditional graph + device fallback GPU tests"
    timeout "$(left 330)" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/test_conditional.py tests/test_fallback.py >"$OUT/fallback_CR.log" 2>&1
    echo "  rc=$?"; grep -E "passed|failed|^FAILED|^E |\[compact|\[folded|\[device" \
      "$OUT/fallback_CR.log" | tail -24
  fi
  [ "${ENGINE:-1}" = 0 ] || engine_loop CR 570 "${MIXES:-top_p}"
  ;;
PR)
  # host profiles (cProfile, 300 calls each) of the engine loop's paths (MIXES, default
  # greedy,top_p; ROWS, default 32,512), then their short timed loop, into $OUT/profile.log
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  engine_diag profile 560 --profile "${MIXES:-greedy,top_p}" "${ROWS:-32,512}" "host profile"
  ;;
EN)
  # the engine-faithful loop alone (MIXES: its traffic mixes, default every one), into
  # $OUT/EN.tar.gz
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  engine_loop EN 570 "${MIXES:-greedy,temperature,top_p}"
  ;;
KB)
  # where a step's GPU time goes: the engine loop's paths by kernel (MIXES, default top_p;
  # ROWS, default 4,32), then the top-p histogram / replay kernels at TP 1 (splits and warps
  # swept) against vLLM's top-p kernel, into $OUT/kernels.log and $OUT/topp_kernels.log
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  engine_diag kernels 300 --kernels "${MIXES:-top_p}" "${ROWS:-4,32}" "^--- kernels"
  stamp "top-p kernels at TP 1"
  timeout "$(left 560)" python3 -m benchmarks.topp_kernels --tp 1 --reqs 1 2 8 --vocab 200064 \
    --steps 2 --out "$OUT/tk" >"$OUT/topp_kernels.log" 2>&1
  echo "  rc=$?"; grep -E "topp_kernels\]|Error" "$OUT/topp_kernels.log" | head -20
  rm -rf "$OUT/tk"
  ;;
FM)
  # the GPU memory the folded device fallback holds (benchmarks.fallback_memory), after the
  # plug-in's helper test
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "device fallback memory"
  timeout "$(left 400)" python3 -m benchmarks.fallback_memory \
    --out "$OUT/fallback_memory" >"$OUT/fallback_memory.log" 2>&1
  echo "  rc=$?"; grep -E "^rows=|^\||Error" "$OUT/fallback_memory.log" | head -30
  ;;
RA)
  # after a change of resolve_apply / the host read: the host read's GPU test, the resolution
  # GPU tests (vs vLLM's chains, captured, no write into an earlier step), the graph tests'
  # sync checks and vLLM's pipelines without a host sync
  export SHARDMAX_VLLM_KERNELS=$PWD/.vllm-kernels
  stamp "host read + graph sync GPU tests"
  timeout "$(left 150)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host.py \
    tests/test_graphs.py -k "host or sync or split" >"$OUT/host_RA.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED" "$OUT/host_RA.log" | tail -6
  timeout "$(left 250)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_vllm_chain.py \
    -k pipelines_mask_on_gpu >"$OUT/chain_RA.log" 2>&1
  echo "  rc=$?"; grep -E "passed|failed|Error|^FAILED" "$OUT/chain_RA.log" | tail -6
  [ -n "${SKIP_RESOLVE:-}" ] || resolve_gpu_tests RA 450
  ;;
*)
  echo "unknown stage $STAGE" >&2
  exit 2
  ;;
esac

stamp "dispatcher with the new tables"
SHARDMAX_TABLES_DIR=$TABLES python3 - <<'PY'
from shardmax.runtime.dispatch import Problem, select
for op in ("argmax", "verify", "sampled"):
    for tp, w in ((4, 50016), (2, 100032), (1, 200064)):
        s = select(Problem(op, "bf16", tp, 96, w, 16))
        print(f"  {op:6} V=200064 TP{tp} 96 rows -> {s.variant} {s.launch} tuned={s.is_tuned}")
PY
tar czf "$OUT/results.tar.gz" -C out tables -C .. benchmarks/results/sm90 2>/dev/null
stamp "done"
