#!/usr/bin/env bash
# The main job (README): generator + tuner + dispatcher on the detected hardware.
#  - every machine: render templates -> generated/ and AOT-compile every variant for sm90 and
#    gfx950; the demo (argmax, greedy and sampled verification steps, the top-p kept sets of a
#    few rows and a top-p step over them at V=200064, TP4, ids checked against torch.argmax / the references, bytes on the
#    wire).
#  - a GPU: the tuner's quick sweep for this GPU's arch (writes generated/<arch>/*.json + .png;
#    with 2+ GPUs also the transport/plain sweep over NCCL), the AOT report again (its launches
#    follow the new tables), then the quick benchmark.
#  - no GPU: the tuner's CPU mode (Triton interpreter: a tiny sweep end to end; timings are
#    meaningless and no table is written).
# Long steps show progress: a bar on a terminal, a line with an ETA every few items in a log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")

echo "== generator: templates/ -> generated/, AOT compile for sm90 and gfx950"
python -m generator --arch all

echo "== demo: vocab-parallel argmax, verification steps, top-p kept sets and a top-p step (every TP rank emulated)"
python -m shardmax.demo

if [ "$NGPU" -ge 1 ]; then
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  echo "== tuner: quick sweep on this GPU"
  python -m tuner --quick
  if [ "$NGPU" -ge 2 ]; then
    echo "== tuner: transport and plain path over NCCL at TP=$NGPU"
    torchrun --nproc-per-node "$NGPU" -m tuner --distributed --quick
  fi
  echo "== generator: the AOT report's launches follow the new tables (spill check per warps)"
  python -m generator --arch all
  echo "== benchmark (quick)"
  python -m benchmarks --quick
else
  echo "== tuner: CPU mode (interpreter, tiny sweep, no table written)"
  studies=$(mktemp -d)  # throw-away Optuna studies of the CPU run, removed when it ends
  trap 'rm -rf "$studies"' EXIT
  python -m tuner --studies-dir "$studies"
fi

echo "== dispatcher: what a serving process would launch"
python - <<'PY'
from shardmax.runtime.dispatch import Problem, detect_arch, select
arch = detect_arch()
print(f"arch: {arch or 'none (CPU: built-in portable default)'}")
for op in ("argmax", "verify", "sampled"):
    for tp, width in ((1, 200064), (4, 50016), (8, 25008)):
        for rows in (4, 96, 512):
            s = select(Problem(op, "bf16", tp, rows, width, 16))
            print(f"  {op:7} V=200064 TP{tp} rows={rows:4}: {s.variant} {s.launch} "
                  f"tuned={s.is_tuned} ({s.source.split('/')[-1]})")
PY
