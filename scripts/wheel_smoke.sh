#!/usr/bin/env bash
# Packaging check (CI, after scripts/test.sh): build the sdist and the wheel (`python -m build`:
# the wheel is built from the sdist, so a file missing from either fails here), check that the
# wheel holds every tracked file the package needs, install it (not editable) into a fresh venv
# (no system site-packages: torch==2.13.0 first, so pip takes the CPU wheel, then shardmax with
# its dependencies) and smoke-test it from outside the checkout:
#   import shardmax (from the venv), the console scripts' --help, `shardmax-generate --check`
#   (render check of the installed templates against the installed generated/; the AOT compile
#   is left to scripts/test.sh: it takes minutes and needs nothing from the wheel), the
#   benchmark's refusal on a CPU machine (exit 2), and emulated verifications under
#   TRITON_INTERPRET=1 compared == to the reference: scripts/cpu_example.py (the README's
#   example: argmax + greedy verification) and one sampled step (fast mode, TP 4).
# Usage: bash scripts/wheel_smoke.sh   (PYTHON= the interpreter for build + venv; WORK= a folder,
#   kept; without it a temporary one, removed when the check passes)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}
if [ -z "${WORK:-}" ]; then
  # our own scratch folder (~2 GB: a venv with torch): removed when the check passes, kept
  # (with its logs) when it fails. CI runs on a machine with a few GB of free disk.
  WORK=$(mktemp -d -t shardmax-wheel-XXXXXX)
  trap 'rc=$?; if [ "$rc" = 0 ]; then rm -rf "$WORK"; else echo "wheel smoke: logs kept in $WORK" >&2; fi' EXIT
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
stamp() { echo "[wheel $(($(date +%s) - T0))s] $*"; }

stamp "build: sdist + wheel -> $WORK/dist"
"$PY" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; echo "wheel smoke: build FAILED" >&2; exit 1; }
WHEEL=$(ls "$WORK"/dist/shardmax-*.whl)
ls -l "$WORK"/dist

stamp "wheel contents: every tracked package file"
"$PY" - "$REPO" "$WHEEL" <<'PY'
import subprocess, sys, zipfile
repo, wheel = sys.argv[1], sys.argv[2]
have = set(zipfile.ZipFile(wheel).namelist())
# repository folder -> import path, as pyproject.toml's package-dir maps them
where = {"shardmax/": "shardmax/", "generator/": "shardmax/generator/",
         "generated/": "shardmax/generated/", "templates/": "shardmax/templates/",
         "tuner/": "shardmax/tuner/", "benchmarks/": "shardmax/benchmarks/"}
tracked = subprocess.run(["git", "-C", repo, "ls-files"], check=True, capture_output=True,
                         text=True).stdout.split()
want = []
for f in tracked:
    for src, dst in where.items():
        if not f.startswith(src):
            continue
        rest = f[len(src):]
        code = f.endswith(".py") and (src != "benchmarks/" or "/" not in rest)
        data = (src == "templates/" and f.endswith(".j2")) or (
            src == "generated/" and f.endswith((".json", ".png")))
        if code or data:
            want.append(dst + rest)
missing = sorted(set(want) - have)
if missing:
    sys.exit(f"wheel smoke: {len(missing)} tracked files missing from the wheel: {missing[:20]}")
print(f"  {len(want)} tracked package files, all in {wheel.rsplit('/', 1)[-1]}")
PY

stamp "fresh venv (no system site-packages): torch==2.13.0 (CPU), then the wheel"
python3 -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --progress-bar off "torch==2.13.0" >"$WORK/pip_torch.log" 2>&1 \
  || { tail -20 "$WORK/pip_torch.log"; exit 1; }
"$VPY" -m pip install --progress-bar off "$WHEEL" >"$WORK/pip_wheel.log" 2>&1 \
  || { tail -20 "$WORK/pip_wheel.log"; exit 1; }
grep -E "^Successfully installed" "$WORK/pip_wheel.log" | cut -c1-200

cd "$WORK"  # outside the checkout: nothing can come from the working tree
export TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1
stamp "import and console scripts"
"$VPY" -W error -c "
import shardmax, shardmax.generator, shardmax.tuner, shardmax.benchmarks, shardmax.generated
assert shardmax.__file__.startswith('$WORK/venv/'), shardmax.__file__
print('  shardmax', shardmax.__version__, 'from', shardmax.__file__)
"
for s in shardmax-generate shardmax-tune shardmax-bench; do
  "$WORK/venv/bin/$s" --help | head -1
done
"$VPY" -m shardmax.generator --help | head -1
"$VPY" -m shardmax.tuner --help | head -1
"$VPY" -m shardmax.benchmarks --help | head -1
"$WORK/venv/bin/shardmax-generate" --check
rc=0
"$WORK/venv/bin/shardmax-bench" --quick 2>"$WORK/bench.err" || rc=$?
[ "$rc" = 2 ] || { cat "$WORK/bench.err"; echo "wheel smoke: shardmax-bench on CPU returned $rc, want 2" >&2; exit 1; }
echo "  shardmax-bench without a GPU: refused (exit 2)"

stamp "emulated verification == reference (interpreter)"
"$VPY" -W error "$REPO/scripts/cpu_example.py"
"$VPY" -W error - <<'PY'
import torch
from shardmax.reference.sampled import verify_sampled
from shardmax.testing import emulate_verify, random_verify_batch

batch = random_verify_batch(6, 3, 20000, seed=3)  # fp32 logits, vLLM's batch layout
a, kw = batch.args(), batch.kwargs()
temps = torch.rand(batch.seed.shape[0]) + 0.5  # temperature 0.5..1.5 per request slot
res = emulate_verify(batch.logits, 4, *a[:5], temps, *a[5:], **kw)  # fast mode, TP 4
want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
keep = ~res.fallback
assert keep.any(), "every request fell back"
for got, ref in zip(res[:3], want, strict=True):
    assert torch.equal(got[keep], ref[keep])
print(f"  sampled step, TP 4: {int(keep.sum())}/{keep.numel()} requests sharded, == reference")
PY
stamp "wheel smoke passed"
