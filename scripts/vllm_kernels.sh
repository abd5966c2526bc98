#!/usr/bin/env bash
# Extract vLLM's own verification kernels (the oracle of the strict-mode GPU parity test) from an
# installed vLLM into a minimal import tree, without vLLM's package __init__ chain (which needs a
# full vLLM install). Nothing of vLLM is committed: the tree goes to an ignored folder.
#
#   bash scripts/vllm_kernels.sh [SITE_PACKAGES] [OUT]
#     SITE_PACKAGES  where vllm/ is installed (default: the e2e venv .venv-vllm, set up if needed)
#     OUT            default .vllm-kernels  (carry it to the GPU; tests/test_gpu.py finds it there
#                    or through SHARDMAX_VLLM_KERNELS)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SITE="${1:-}"
OUT="${2:-$REPO/.vllm-kernels}"
if [ -z "$SITE" ]; then
  VENV="${SHARDMAX_VLLM_VENV:-$REPO/.venv-vllm}"
  [ -f "$VENV/.shardmax-e2e-ready" ] || "$REPO/tests/e2e_vllm/setup_env.sh" "$VENV"
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
fi
SRC="$SITE/vllm"
[ -f "$SRC/v1/worker/gpu/spec_decode/rejection_sampler_utils.py" ] || {
  echo "no vLLM model-runner-V2 kernels under $SRC" >&2; exit 1; }
rm -rf "$OUT"
LEAVES=(
  v1/worker/gpu/sample/gumbel.py
  v1/worker/gpu/sample/watermark.py
  v1/worker/gpu/spec_decode/rejection_sampler_utils.py
  v1/watermarking/prfs/philox.py
  v1/watermarking/prfs/base.py
)
for f in "${LEAVES[@]}"; do
  mkdir -p "$OUT/vllm/$(dirname "$f")"
  cp "$SRC/$f" "$OUT/vllm/$f"
done
# empty package markers instead of vLLM's __init__ chain
for d in vllm vllm/v1 vllm/v1/worker vllm/v1/worker/gpu vllm/v1/worker/gpu/sample \
         vllm/v1/worker/gpu/spec_decode vllm/v1/watermarking vllm/v1/watermarking/prfs; do
  : > "$OUT/$d/__init__.py"
done
mkdir -p "$OUT/vllm/triton_utils"
cat > "$OUT/vllm/triton_utils/__init__.py" <<'PY'
# shardmax test shim: the names vLLM's kernels import from vllm.triton_utils, straight from Triton.
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
PY
version=$(sed -n 's/^Version: //p' "$SITE"/vllm*.dist-info/METADATA 2>/dev/null | head -1)
echo "${version:-unknown}" > "$OUT/VLLM_VERSION"
echo "vLLM ${version:-?} kernels -> $OUT"
