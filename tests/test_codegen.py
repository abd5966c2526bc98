"""What the compiler makes of the logits loads of the sampled kernels (sm90 PTX, compiled ahead
of time on the CPU like ``generator --arch``).

The record and draw kernels keep the row stride unspecialised (one compiled kernel per constexpr
set, so a warmed-up plan captures without compiling). Triton then cannot prove a row 16-byte
aligned, and a multiple-of hint on the scalar stride, on a loop variable or on an argument of a
``@jit`` helper is dropped: every logits element became its own 2-byte load (measured on the
H200: the greedy rows of a sampled step at 2.4x the greedy local stage's time). With ``ALIGNED``
(the host checked ``stride % 16 == 0``) the hints sit on computed offsets (``row_offset``,
``segment``) and whole tiles load as 16-byte vectors (``ld.global.v4.b32``); this test pins that
down as the runtime compiles it -- pointer arguments 16-byte aligned (Triton's JIT
specialisation) -- with the Triton installed here (the H200 image runs 3.6).
"""

from __future__ import annotations

from tests._aot import run_compiled

CASES = [
    ("sampled_record_bf16_b2048", {"TOPK": False, "NOISE": False, "BEST_SLOTS": 1}),
    ("sampled_record_bf16_b4096", {"TOPK": False, "NOISE": False, "INDIRECT": True}),
    ("sampled_record_fp32_b1024", {"TOPK": False, "NOISE": False}),
    ("sampled_record_bf16_b1024", {"TOPK": False}),
    ("sampled_draw_bf16_b2048", {}),
    ("sampled_draw_fp16_b2048", {"KEPT": True}),
]
"""(variant, constexprs over its CONSTEXPRS): phase 1 (direct and INDIRECT), one pass, the draw
(plain and top-p's kept sets)."""

_SCRIPT = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from generator.aot import load_module
from generator.render import generated_dir
vector = re.compile(r"ld\\.global(\\.\\w+)*\\.v4\\.b32")
out = {}
for name, over in json.loads(sys.argv[1]):
    mod = load_module(generated_dir() / f"{name}.py")
    sig = dict(mod.SIGNATURE)
    # the runtime's JIT specialisation of 16-byte-aligned pointer arguments
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    for aligned in (True, False):
        src = triton.compiler.ASTSource(
            fn=mod.kernel, signature=sig, attrs=attrs,
            constexprs={**mod.CONSTEXPRS, **over, "ALIGNED": aligned},
        )
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[f"{name} {sorted(over.items())} aligned={aligned}"] = len(vector.findall(ptx.asm["ptx"]))
print(json.dumps(out))
"""


def test_aligned_rows_load_whole_tiles_as_vectors() -> None:
    """Every case compiles to 16-byte vector loads with ``ALIGNED`` and to none without (a
    subprocess: the AOT compiler needs Triton without the interpreter)."""
    loads = run_compiled(_SCRIPT, CASES)
    assert len(loads) == 2 * len(CASES)
    for key, n in loads.items():
        assert (n > 0) == key.endswith("aligned=True"), (key, n)
