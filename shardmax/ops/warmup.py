"""Compile every kernel the dispatcher can choose before CUDA-graph capture.

Launching must never compile while a graph is being captured (design §4): :func:`warmup` runs
each problem's plan once -- local stage and finish, on one emulated rank whose gathered bytes
are its own repeated (no collective) -- with vLLM's index dtypes, so every kernel a real step of
that shape launches is compiled, the sampled merge and finish included.
"""

from __future__ import annotations

import torch

from shardmax.ops.argmax import ArgmaxPlan
from shardmax.ops.greedy import GreedyVerifyPlan
from shardmax.ops.sampled import SampledVerifyPlan
from shardmax.runtime.dispatch import PLAIN, Problem, select
from shardmax.runtime.geometry import Geometry
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.validation import check_step_batch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _NoComm:
    """A rank-0 stand-in group of ``tp`` ranks: warm-up never communicates."""

    def __init__(self, tp: int) -> None:
        self.world_size, self.rank = tp, 0

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat(self.world_size, *([1] * (t.dim() - 1)))

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _batch(rows: int, k: int, dev: torch.device, synthetic: bool, prefill: bool, sampled: bool):
    i32, i64 = torch.int32, torch.int64
    reqs = max(1, -(-rows // (k + 1)))
    cu = torch.tensor([min(r * (k + 1), rows) for r in range(reqs)] + [rows], dtype=i32)
    return check_step_batch(
        rows, dev,
        torch.zeros(rows, dtype=i32, device=dev), cu.to(dev),
        torch.arange(rows, dtype=i64, device=dev), torch.arange(reqs, dtype=i32, device=dev),
        torch.zeros(rows, dtype=i32, device=dev), torch.zeros(reqs, dtype=i64, device=dev), k,
        torch.ones(k, dtype=torch.float32, device=dev) if synthetic else None,
        torch.ones(reqs, dtype=i32, device=dev) if prefill else None,
        torch.zeros(reqs, dtype=i32, device=dev) if prefill else None,
        temperature=torch.ones(reqs, dtype=torch.float32, device=dev) if sampled else None,
    )  # fmt: skip


def warmup(
    problems: list[Problem],
    *,
    num_speculative_steps: tuple[int, ...] = (),
    device: torch.device | str | None = None,
) -> list[str]:
    """Run the plan of every problem once so that its kernels are compiled.

    ``argmax`` problems: local stage + finish. ``verify``: per K in ``num_speculative_steps``,
    with and without synthetic acceptance and chunked prefill. ``sampled``: per K, fast mode,
    fp32 and fp64 Gumbel, with and without candidates (row parameters, records, merge, finish).
    Index dtypes are vLLM's (int32 drafts, cu_num_logits, idx_mapping, seq_lens, prefill_len;
    int64 positions and seeds). Sizes are not specialised by the kernels, so afterwards a CUDA
    graph of any batch size of these problems captures without compiling. No collective is
    issued. Strict mode's kernels compile on its first eager step.

    Returns the names of what was run.
    """
    dev = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    launched: list[str] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for p in problems:
        sel = select(p)
        if sel.variant == PLAIN:
            continue
        width = p.width
        stride = width if p.align == 1 or width % 16 == 0 else width + 16 - width % 16
        rows = max(1, p.rows)
        dtype = _DTYPES[p.dtype]
        full = torch.randn(rows, stride, generator=gen).to(dtype).to(dev)
        logits = full[:, :width]
        geo = Geometry(tuple((r * width, width) for r in range(p.tp)), width, dtype)
        ctx = ShardContext(_NoComm(p.tp), geo, 0, dev)
        row_stride = logits.stride(0) if rows > 1 else width
        if p.op == "argmax":
            ArgmaxPlan(ctx, rows, row_stride).run(logits)
            launched.append(f"{sel.variant}+{sel.finish_variant('argmax', p.tp)}")
            continue
        for k in num_speculative_steps:
            if p.op == "verify":
                plan = GreedyVerifyPlan(ctx, rows, row_stride)
                for synthetic in (False, True):
                    for prefill in (False, True):
                        plan.run(logits, _batch(rows, k, dev, synthetic, prefill, False))
                launched.append(f"{sel.variant}+{plan.finish_variant}[K={k}]")
                continue
            for fp64 in (False, True):
                for cand in (False, True):
                    plan_s = SampledVerifyPlan(
                        ctx, rows, row_stride, use_fp64_gumbel=fp64, with_candidates=cand
                    )
                    batch = _batch(rows, k, dev, False, False, True)
                    if cand:
                        batch = batch._replace(top_k=torch.zeros_like(batch.idx_mapping))
                    plan_s.run(logits, batch)
                    tag = ",".join([*(["fp64"] if fp64 else []), *(["C"] if cand else [])])
                    launched.append(f"{plan_s.launch.variant}[K={k}{',' + tag if tag else ''}]")
    return launched
