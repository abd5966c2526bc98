"""Objective of one ``sampled`` bucket: exactness gate first, then timing (design §5 rules 2-3).

:class:`SampledRunner` has :class:`tuner.objective.Runner`'s interface (``gate``, ``bench``,
``bench_safe``, ``evaluate``), so the study, the export and :class:`tuner.objective.Lockstep`
drive it unchanged. One GPU only: the all_gather is the only transport of sampled verification
and is not timed (as the greedy ops' single-GPU mode).

1. gate -- :func:`shardmax.testing.emulate_verify` with the candidate's selection (record
   variant, splits, warps, C) over ``tp`` emulated ranks of the bucket's vocabulary, on a seeded
   batch that mixes every kind of request the record kernel serves (:data:`REQUEST_KINDS`:
   greedy, temperature only, top-k 20 with a tie planted at its boundary, top-k ``C - 1`` and
   ``C``, top-p 0.95, top-k 20 + top-p 0.8, min-p 0.05, a flat top-p 0.99 row whose nucleus is
   wider than any C, and a peaked top-k 20 + top-p 0.9 request whose boundaries are decidable
   at every C). Rejected unless every request that is not flagged gives ``==`` sampled /
   num_sampled / num_rejected against :func:`shardmax.reference.sampled.verify_sampled`, greedy
   requests are never flagged, the top-k ``C`` request comes back ``TOPK_CAPACITY`` (when
   ``C < V``) and the top-k ``C - 1`` request never does (so the candidate really ran with its
   C), and the peaked request runs sharded (a config that flags everything is not exact).
2. timing -- one rank's candidate step of a batch of ``rows // (K + 1)`` requests sampled as
   Qwen3's default (temperature 1, top-k 20, top-p 0.95; :data:`TIMED_SAMPLING`): the record
   kernel on the rank's ``[rows, W]`` shard, then ``sampled_merge`` + ``sampled_finish`` on a
   buffer holding ``tp`` copies of the rank's records and candidates (the all_gather's layout).
   Temperature-only steps run the same record launch without the candidate pass.
"""

from __future__ import annotations

from typing import Any

import torch

from shardmax.ops.sampled import FallbackReason, RecordLaunch, SampledVerifyPlan
from shardmax.reference.sampled import verify_sampled
from shardmax.runtime.dispatch import Selection
from shardmax.runtime.geometry import Geometry
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.validation import SUPPORTED_DTYPES, check_step_batch
from shardmax.testing import emulate_verify, random_verify_batch
from shardmax.testing.emulate import RepeatedRank
from shardmax.testing.shards import vllm_shard_ranges

from . import timing
from .objective import Dist, Outcome
from .problems import PAD_TO, Bucket, step_cu_num_logits
from .space import Config

TORCH_DTYPE = {v: k for k, v in SUPPORTED_DTYPES.items()}
REQUEST_KINDS = (
    "greedy",
    "temperature",
    "top_k_20_tie",
    "top_k_c_minus_1",
    "top_k_c",
    "top_p_0.95",
    "top_k_20_top_p_0.8",
    "min_p_0.05",
    "flat_top_p_0.99",
    "peaked_top_k_20_top_p_0.9",
)
"""One gate request of each kind (in this order, cycled when the batch is larger)."""
TIMED_SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.95}
"""What every request of the timed step uses (Qwen3's recommended sampling)."""


def _kind_state(kind: str, c: int) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) of a request kind for candidates ``c``."""
    return {
        "greedy": (0.0, 0, 1.0, 0.0),
        "temperature": (0.7, 0, 1.0, 0.0),
        "top_k_20_tie": (1.0, 20, 1.0, 0.0),
        "top_k_c_minus_1": (1.0, c - 1, 1.0, 0.0),
        "top_k_c": (1.0, c, 1.0, 0.0),
        "top_p_0.95": (1.0, 0, 0.95, 0.0),
        "top_k_20_top_p_0.8": (0.7, 20, 0.8, 0.0),
        "min_p_0.05": (1.0, 0, 1.0, 0.05),
        "flat_top_p_0.99": (1.0, 0, 0.99, 0.0),
        "peaked_top_k_20_top_p_0.9": (1.0, 20, 0.9, 0.0),
    }[kind]


PEAK_TOP = 40.0
PEAK_STEP = 0.25
"""The peaked request's rows: ``PEAK_TOP - PEAK_STEP * i`` at up to 100 random ids (exact in
bf16 / fp16 / fp32, no ties; gaps far above every guard's resolution), the rest random normal."""


class SampledRunner:
    """Gate + timing of ``sampled`` configs for one bucket on one device."""

    def __init__(
        self,
        bucket: Bucket,
        device: torch.device,
        *,
        dist: Dist | None = None,
        cold: bool = False,
        launches: int = timing.LAUNCHES,
        replays: int = timing.REPLAYS,
    ) -> None:
        if bucket.op != "sampled":
            raise ValueError(f"bucket: op {bucket.op!r}, expected 'sampled'")
        if dist is not None:
            raise ValueError("op sampled is tuned on one GPU (no --distributed)")
        self.bucket = bucket
        self.device = device
        self.dist: Dist | None = None
        self.cold = cold
        self.launches = launches
        self.replays = replays
        self.tp = bucket.tp
        self.dtype = TORCH_DTYPE[bucket.dtype]
        self._inputs: dict[str, Any] | None = None

    # ------------------------------------------------------------------ gate
    def gate(self, cfg: Config, seed: int, scale: int = 1) -> str | None:
        """None if exact (see the module docstring), else the reason."""
        try:
            return self._gate(cfg, seed, scale)
        except Exception as e:  # compile/launch errors reject the point, they never time it
            return f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _gate(self, cfg: Config, seed: int, scale: int) -> str | None:
        b, dev = self.bucket, self.device
        sel = cfg.selection(b.dtype, b.align)
        c = sel.candidates
        num_reqs = len(REQUEST_KINDS) * scale
        gen = torch.Generator().manual_seed(seed)
        rows_max = num_reqs * (b.k + 1)
        logits = torch.randn(rows_max, b.vocab, generator=gen) * 3.0
        batch = random_verify_batch(
            num_reqs, b.k, b.vocab, seed=seed, logits=logits, prefill_prob=0.0
        )
        x = batch.logits  # fp32 [num_logits, V]: plant per request before the dtype cast
        n_slots = batch.max_num_reqs
        temp = torch.zeros(n_slots)
        top_k = torch.zeros(n_slots, dtype=torch.int64)
        top_p = torch.ones(n_slots)
        min_p = torch.zeros(n_slots)
        cu = batch.cu_num_logits.tolist()
        kinds = [REQUEST_KINDS[i % len(REQUEST_KINDS)] for i in range(num_reqs)]
        for i, kind in enumerate(kinds):
            slot = int(batch.idx_mapping[i])
            temp[slot], top_k[slot], top_p[slot], min_p[slot] = _kind_state(kind, c)
            first = x[cu[i]]
            if kind == "top_k_20_tie":  # the 21st value equals the 20th: ties by lowest id
                order = torch.sort(first, descending=True, stable=True).indices
                first[order[20]] = first[order[19]]
            elif kind == "flat_top_p_0.99":
                x[cu[i] : cu[i + 1]] = torch.randn(cu[i + 1] - cu[i], b.vocab, generator=gen) * 0.01
            elif kind == "peaked_top_k_20_top_p_0.9":
                n = min(100, b.vocab // 2)
                for row in range(cu[i], cu[i + 1]):
                    ids = torch.randperm(b.vocab, generator=gen)[:n]
                    x[row, ids] = PEAK_TOP - PEAK_STEP * torch.arange(float(n))
        full = x.to(self.dtype).to(dev)
        draft, cu_t, pos, idx, local_pos, seeds = (t.to(dev) for t in batch.args()[:6])
        kw: dict[str, Any] = {
            k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in batch.kwargs().items()
        }
        kw.update(top_k=top_k.to(dev), top_p=top_p.to(dev), min_p=min_p.to(dev))
        t = temp.to(dev)
        got = emulate_verify(
            full, self.tp, draft, cu_t, pos, idx, local_pos, t, seeds, b.k,
            pad_to=PAD_TO, selection=sel, **kw,
        )  # fmt: skip
        want = verify_sampled(full, draft, cu_t, pos, idx, local_pos, t, seeds, b.k, **kw)
        ok = ~got.fallback
        for name, g, w in zip(
            ("sampled", "num_sampled", "num_rejected"), got[:3], want, strict=True
        ):
            bad = ((g != w).reshape(g.shape[0], -1).any(dim=1) & ok).nonzero().flatten().tolist()
            if bad:
                r = bad[0]
                return (
                    f"{len(bad)} unflagged requests differ in {name}; first {r} ({kinds[r]}): "
                    f"got {g[r].tolist()} want {w[r].tolist()}"
                )
        reason = got.reason.cpu().tolist()
        for r, kind in enumerate(kinds):
            if kind == "greedy" and reason[r] != 0:
                return f"greedy request {r} flagged (reason {reason[r]})"
            if kind == "top_k_c" and c < b.vocab and reason[r] != FallbackReason.TOPK_CAPACITY:
                return f"top-k {c} request {r} not flagged TOPK_CAPACITY (reason {reason[r]})"
            if kind == "peaked_top_k_20_top_p_0.9" and b.vocab >= 200 and reason[r] != 0:
                return (
                    f"the peaked top-k 20 + top-p 0.9 request {r} came back flagged (reason "
                    f"{reason[r]}); a config must verify what it can decide"
                )
            if kind == "top_k_c_minus_1" and reason[r] == FallbackReason.TOPK_CAPACITY:
                return f"top-k {c - 1} request {r} flagged TOPK_CAPACITY with C={c}"
        return None

    # ------------------------------------------------------------------ timing
    def _timing_inputs(self) -> dict[str, Any]:
        if self._inputs is not None:
            return self._inputs
        b, dev = self.bucket, self.device
        gen = torch.Generator().manual_seed(1234)
        one = (torch.randn(b.rows, b.width, generator=gen) * 3.0).to(self.dtype)
        nbytes = one.numel() * one.element_size()
        copies = timing.copies_for_cold(nbytes, dev) if self.cold else 1
        xs = [one.to(dev)] + [one.roll(i, dims=1).to(dev) for i in range(1, copies)]
        k = b.k
        cu = step_cu_num_logits(b.rows, k)
        n = len(cu) - 1
        i32 = torch.int32
        draft = torch.randint(0, b.vocab, (b.rows,), generator=gen, dtype=i32).to(dev)
        pos = torch.arange(b.rows, dtype=torch.int64, device=dev)
        batch = check_step_batch(
            b.rows, dev, draft, torch.tensor(cu, dtype=i32, device=dev), pos,
            torch.arange(n, dtype=i32, device=dev), torch.zeros_like(draft),
            torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64).to(dev), k,
            temperature=torch.full((n,), TIMED_SAMPLING["temperature"], device=dev),
            top_k=torch.full((n,), int(TIMED_SAMPLING["top_k"]), dtype=i32, device=dev),
            top_p=torch.full((n,), TIMED_SAMPLING["top_p"], dtype=torch.float64, device=dev),
        )  # fmt: skip
        # rank 0 of vLLM's layout, the other ranks' bytes stood in by rank 0's (one GPU)
        ranges = tuple((s, n) for s, n, _ in vllm_shard_ranges(b.vocab, self.tp, PAD_TO))
        geo = Geometry(ranges, b.width, self.dtype)
        self._inputs = {
            "xs": xs,
            "batch": batch,
            "ctx": ShardContext(RepeatedRank(self.tp), geo, 0, dev),
        }
        return self._inputs

    def _plan(self, sel: Selection, inp: dict[str, Any]) -> SampledVerifyPlan:
        return SampledVerifyPlan(
            inp["ctx"], self.bucket.rows, self.bucket.width, with_candidates=True,
            launch=RecordLaunch.of(sel),
        )  # fmt: skip

    def bench(self, cfg: Config, *, replays: int | None = None) -> timing.Timing:
        b = self.bucket
        sel = cfg.selection(b.dtype, b.align)
        inp = self._timing_inputs()
        xs, batch = inp["xs"], inp["batch"]
        plan = self._plan(sel, inp)
        gathered = plan.local(xs[0], batch).repeat(self.tp, 1)

        def step(i: int) -> Any:
            plan.local(xs[i], batch)
            return plan.finish(gathered, batch)

        return timing.measure(
            step,
            len(xs),
            self.device,
            launches=self.launches,
            replays=replays or self.replays,
            cold=self.cold,
        )

    def bench_safe(self, cfg: Config, replays: int | None = None) -> timing.Timing | None:
        """:meth:`bench`, None on error (export re-measure; never raises)."""
        try:
            return self.bench(cfg, replays=replays)
        except Exception:
            return None

    def evaluate(self, cfg: Config, seed: int) -> Outcome:
        """Gate, then time. Never raises."""
        reason = self.gate(cfg, seed)
        if reason is not None:
            return Outcome(False, reason)
        try:
            return Outcome(True, "", self.bench(cfg))
        except Exception as e:
            return Outcome(False, f"timing error: {type(e).__name__}: {e}")
