#!/usr/bin/env bash
# GPU checks: run on the H200 machine (1 or 2 GPUs). Installs shardmax into the image's Python
# (no network: carried wheels in .whl/ for optuna if present), runs every GPU-marked test of
# tests/ (gpu, multigpu), then prints a short table. Usage:
#   bash scripts/gpu_checks.sh [--part I/N] [extra pytest args] [test paths]
# Without test paths it collects the whole of tests/. The full set (about 12 minutes on an
# H100) takes longer than one 10-minute machine command: run it as --part 1/3, 2/3, 3/3
# (consecutive slices of the selected tests, tests/conftest.py), one command each, and add up
# the tables. Each part prints its slice and the selection id of the whole set: the ids must
# agree (a machine missing .vllm-kernels collects fewer tests and its slices shift); a slice
# with no test counts as a pass.
# Writes the JUnit XML and the log under ${OUT:-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out}
mkdir -p "$OUT_DIR"
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
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT_DIR/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT_DIR/install.log"; exit 1; }
python3 - <<'PY'
import torch, triton
n = torch.cuda.device_count()
print(f"torch {torch.__version__} triton {triton.__version__} GPUs {n}: "
      f"{[torch.cuda.get_device_name(i) for i in range(n)]}")
PY
# vLLM's kernels as the oracle (strict mode, the native chain, the per-request resolution):
# carry .vllm-kernels (bash scripts/vllm_kernels.sh [the 0.33 wheel]); without it those skip
[ -d .vllm-kernels ] && export SHARDMAX_VLLM_KERNELS=${SHARDMAX_VLLM_KERNELS:-$PWD/.vllm-kernels}
start=$(date +%s)
# an argument that names an existing file or folder (and is no option) is a test path
paths=() part=0
for a in "$@"; do
  case $a in
    --part | --part=*) part=1 ;;
    -*) ;;
    *) [ -e "${a%%::*}" ] && paths+=("$a") ;;
  esac
done
[ ${#paths[@]} -gt 0 ] || set -- "$@" tests/
python3 -m pytest -m "gpu or multigpu" -q -p no:cacheprovider --junitxml="$OUT_DIR/gpu-tests.xml" "$@" \
  2>&1 | tee "$OUT_DIR/gpu-tests.log" | tail -25
rc=${PIPESTATUS[0]}
if [ "$rc" = 5 ] && [ "$part" = 1 ]; then
  echo "(no test in this slice: pytest's exit code 5 counted as a pass)"
  rc=0
fi
python3 - "$OUT_DIR/gpu-tests.xml" "$(( $(date +%s) - start ))" <<'PY'
import collections, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
rows = collections.OrderedDict()
for case in root.iter("testcase"):
    group = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name", "").split("[")[0]
    r = rows.setdefault(group, collections.Counter())
    state = "failed" if case.find("failure") is not None or case.find("error") is not None else (
        "skipped" if case.find("skipped") is not None else "passed")
    r[state] += 1
print(f"\n{'GPU test':62} {'pass':>5} {'fail':>5} {'skip':>5}")
for g, c in rows.items():
    print(f"{g[:62]:62} {c['passed']:5d} {c['failed']:5d} {c['skipped']:5d}")
tot = sum(rows.values(), collections.Counter())
print(f"{'TOTAL (' + sys.argv[2] + ' s)':62} {tot['passed']:5d} {tot['failed']:5d} {tot['skipped']:5d}")
PY
exit "$rc"
