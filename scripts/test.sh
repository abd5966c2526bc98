#!/usr/bin/env bash
# The test command (README): set-up, lint, types, generated-code freshness + AOT compile of
# every variant for sm90 and gfx950, then the pytest suite (CPU: Triton interpreter; GPU
# tests skip without a device). CI (.ci/run) runs exactly this, then the wheel smoke test and the
# vLLM end-to-end test. Usage: bash scripts/test.sh [--slow] [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
echo "== lint (ruff) and types (mypy)"
ruff check shardmax generator tuner tests benchmarks
ruff format --check shardmax generator tuner tests benchmarks
mypy shardmax generator tuner
echo "== generator: generated/ up to date, every variant compiles for sm90 and gfx950"
python -m generator --check --arch all
echo "== pytest"
# the interpreter is single-threaded: one worker per core (at most 4; SHARDMAX_TEST_WORKERS=0
# runs in this process). --slow also runs the tests marked slow (deselected by default).
# No -q: with -q, xdist prints "bringing up nodes..." twice instead of "N workers [M items]".
ARGS=()
for a in "$@"; do
  if [ "$a" = "--slow" ]; then ARGS+=(-m "not e2e"); else ARGS+=("$a"); fi
done
python -m pytest -n "${SHARDMAX_TEST_WORKERS:-auto}" --maxprocesses 4 ${ARGS[@]+"${ARGS[@]}"}
