#!/usr/bin/env bash
# Set-up shared by scripts/run.sh and scripts/test.sh: a virtual environment in .venv with
# shardmax installed editable (+ dev tools). Safe to re-run; sourced, not executed.
#  - On a CPU machine: torch is pinned to the CPU build: torch==2.13.0 from a local wheelhouse
#    where pip has one (the project's dev / CI machines), else from PyTorch's CPU index (a plain
#    `pip install torch` could pull a multi-GB CUDA build).
#  - On a GPU machine whose Python already has a CUDA/ROCm torch: the venv sees the system
#    packages and keeps that torch and Triton.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    $PY -m venv --system-site-packages .venv
  else
    $PY -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing the CPU build of torch (torch==2.13.0; about a minute)"
  # a local wheelhouse (pip's find-links, as on the project's dev / CI machines) first; else
  # PyTorch's CPU index next to PyPI, whose Linux torch is the multi-GB CUDA build (the CPU
  # index's 2.13.0+cpu sorts above it, so pip takes it)
  extra=()
  if ! python -m pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  python -m pip install "torch==2.13.0" ${extra[@]+"${extra[@]}"}
fi
if ! python -c "import shardmax, optuna, ruff, mypy, pytest" 2>/dev/null \
    || [ pyproject.toml -nt .venv/.shardmax-installed ]; then
  echo "[setup] installing shardmax (editable) with dev tools (about a minute)"
  python -m pip install -e ".[dev]"
  touch .venv/.shardmax-installed
fi
# Triton 3.9+ warns until the FP-fusion default is explicit; keep the default vLLM runs with.
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1  # no GPU: every Triton kernel runs in the interpreter
fi
