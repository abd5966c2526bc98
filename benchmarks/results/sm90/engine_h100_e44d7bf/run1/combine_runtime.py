"""GPU: the runtime's topp_histograms at 2/3/4/8/16 splits (parts4 now at 4 warps) == 1 split."""

import torch

from shardmax.ops.topp import HIST_LEVELS, RECORD_WORDS, topp_histograms
from shardmax.testing.traffic import realistic_batch

V = 200064
ok = True
for reqs in (1, 40, 64):
    b = realistic_batch(reqs, 3, V, seed=5 + reqs, device="cuda")
    rows = b.logits.shape[0]
    t = torch.ones(rows, device="cuda")
    ref = None
    for splits in (1, 2, 3, 4, 8, 16):
        out = torch.empty((rows, RECORD_WORDS), dtype=torch.int32, device="cuda")
        topp_histograms(b.logits, t, num_valid=V, vocab_start=0, block=4096, splits=splits, out=out)
        torch.cuda.synchronize()
        w = out[:, : HIST_LEVELS // 2].clone()
        if ref is None:
            ref = w
        same = bool(torch.equal(w, ref))
        ok &= same
        print(f"rows={rows} splits={splits}: level words == 1 split: {same}", flush=True)
print("ALL EQUAL", ok)
