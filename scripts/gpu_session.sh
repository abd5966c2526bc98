#!/usr/bin/env bash
# One batched run on the 2xH200 machine (device tool): multi-GPU parity tests, the tuner's quick
# sweep (single GPU) + transport/plain sweep at TP2 (torchrun), the dispatcher check, and the
# benchmarks. Every stage has its own time limit so the whole run ends inside 10 minutes;
# results come back as one archive: $OUT/results.tar.gz (+ logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "install failed"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

stamp "multi-GPU parity tests (NCCL, eager + CUDA graphs)"
timeout 150 python3 -m pytest -m multigpu -q -p no:cacheprovider tests/test_distributed.py 2>&1 | tail -4

stamp "tuner --quick (one GPU; local stage + finish per TP shard width)"
timeout 200 python3 -m tuner --quick --n-trials 24 --timeout 2.5 --no-progress > "$OUT/tune_single.log" 2>&1
echo "rc=$?"; tail -4 "$OUT/tune_single.log"

stamp "tuner --distributed --quick at TP2 (transport + plain path, real NCCL)"
timeout 110 torchrun --nproc-per-node 2 -m tuner --distributed --quick --vocab 200064 \
  --rows 4 32 96 512 --n-trials 16 --timeout 3 --no-progress > "$OUT/tune_tp2.log" 2>&1
echo "rc=$?"; tail -4 "$OUT/tune_tp2.log"

stamp "dispatcher on this GPU"
python3 - <<'PY'
from shardmax.dispatch import Problem, select
for op in ("argmax", "verify"):
    for tp, w in ((4, 50016), (2, 100032), (1, 200064)):
        s = select(Problem(op, "bf16", tp, 96, w, 16))
        print(f"  {op:6} V=200064 TP{tp} 96 rows -> {s.variant} {s.launch} is_tuned={s.is_tuned}")
PY

stamp "benchmarks (local kernel + TP2 step)"
timeout 190 python3 -m benchmarks --quick --budget-s 150 --out benchmarks/results/sm90 > "$OUT/bench.log" 2>&1
echo "rc=$?"; tail -45 "$OUT/bench.log"

tar czf "$OUT/results.tar.gz" generated/sm90 benchmarks/results/sm90 2>/dev/null
stamp "done"
