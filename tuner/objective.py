"""Objective of one bucket: exactness gate FIRST, then timing (design §5 rules 2-3).

:class:`Runner` owns the bucket's inputs on one device (one rank). ``evaluate(config)``:

1. gate -- the candidate runs on the seeded adversarial suite (planted ties inside blocks, at
   block and shard edges, across shards, +-inf, -0.0, NaN, all -inf, padding that wins if
   unmasked; small verify batches with and without synthetic acceptance) and is compared with
   ``==`` to :mod:`shardmax.reference`. Single process: through
   ``shardmax.testing.emulate_*(..., selection=...)`` (every rank emulated on this device).
   ``--distributed``: each rank runs the real path on its shard with the real collective.
   Any mismatch or error -> ``reject`` reason (the Optuna objective raises ``TrialPruned``).
2. timing -- :func:`.timing.measure` of one step: local kernel + collective + finish.
   Single GPU: the collective is not timed; the finish reads a buffer holding ``tp`` copies of
   the keys (the gathered layout). Distributed: real NCCL/RCCL collective, MAX over ranks.

Plain path ("plain"): all-gather the full padded logits, drop padding, ``torch.argmax`` (for
verify too: the rejection step is the same small kernel on both paths and is not timed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardmax import reference
from shardmax.ops.argmax import argmax_pick, shard_keys
from shardmax.ops.greedy import verify_finish
from shardmax.runtime.collectives import Collective, SingleRank
from shardmax.runtime.dispatch import Selection
from shardmax.runtime.validation import SUPPORTED_DTYPES, StepBatch, check_step_batch
from shardmax.testing import (
    ADVERSARIAL_CASES,
    adversarial_logits,
    emulate_greedy_verify,
    emulate_vocab_parallel_argmax,
    random_verify_batch,
    shard_like_vllm,
)
from shardmax.testing.shards import vllm_shard_ranges

from . import timing
from .problems import PAD_TO, Bucket, step_cu_num_logits
from .space import Config

TORCH_DTYPE = {v: k for k, v in SUPPORTED_DTYPES.items()}
GATE_ROWS = len(ADVERSARIAL_CASES)
"""One row per adversarial case; export re-verification doubles it with another seed."""
GATE_REQS = 8


def step_batch(vargs: tuple[Any, ...]) -> StepBatch:
    """The :class:`StepBatch` of a tuner verify tuple ``(draft, cu, pos, idx, seed, K, rates,
    seq_lens, prefill_len)``."""
    d, cu, pos, idx, seed, k, rates, seq_lens, prefill = vargs
    exp = torch.zeros_like(pos, dtype=torch.int32)
    return check_step_batch(
        d.shape[0], d.device, d, cu, pos, idx, exp, seed, k, rates, seq_lens, prefill
    )


@dataclass
class Dist:
    """The torch.distributed group of a ``--distributed`` sweep (rank 0 owns the study)."""

    rank: int
    world: int
    device: torch.device
    group: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def bcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def reduce_max(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in t.tolist()]

    def gather_str(self, s: str) -> list[str]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, s, group=self.group)
        return [str(x) for x in out]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group, device_ids=[self.device.index or 0])

    def collective(self) -> Collective:
        from shardmax.runtime.collectives import TorchDistributed

        return TorchDistributed(self.group)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str = ""
    timing: timing.Timing | None = None


def _first_mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu().to(got.dtype)
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    if not bad:
        return None
    r = bad[0]
    case = ADVERSARIAL_CASES[r % len(ADVERSARIAL_CASES)] if name == "ids" else f"request {r}"
    return (
        f"{len(bad)} mismatching rows in {name}; first row {r} ({case}): got "
        f"{got[r].tolist()} want {want[r].tolist()}"
    )


class Runner:
    """Gate + timing of configs for one bucket on this rank's device."""

    def __init__(
        self,
        bucket: Bucket,
        device: torch.device,
        *,
        dist: Dist | None = None,
        cold: bool = False,
        gate_rows: int = GATE_ROWS,
        launches: int = timing.LAUNCHES,
        replays: int = timing.REPLAYS,
    ) -> None:
        self.bucket = bucket
        self.device = device
        self.dist = dist
        self.cold = cold
        self.gate_rows = gate_rows
        self.launches = launches
        self.replays = replays
        self.tp = bucket.tp
        if dist is not None and dist.world != bucket.tp:
            raise ValueError(f"--distributed: bucket tp={bucket.tp} != world size {dist.world}")
        self.dtype = TORCH_DTYPE[bucket.dtype]
        self.ranges = vllm_shard_ranges(bucket.vocab, bucket.tp, PAD_TO)
        self.rank = dist.rank if dist is not None else 0
        self.coll: Collective = dist.collective() if dist is not None else SingleRank()
        self._inputs: dict[str, Any] | None = None

    # ------------------------------------------------------------------ gate
    def gate(self, cfg: Config, seed: int, scale: int = 1) -> str | None:
        """None if exact on the adversarial suite, else the reason (same on every rank)."""
        try:
            reason = self._gate(cfg, seed, scale)
        except Exception as e:  # compile/launch errors reject the point, they never time it
            reason = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.dist is not None:
            reasons = [r for r in self.dist.gather_str(reason or "") if r]
            return reasons[0] if reasons else None
        return reason

    def _gate(self, cfg: Config, seed: int, scale: int) -> str | None:
        b = self.bucket
        sel = cfg.selection(b.dtype, b.align)
        rows = self.gate_rows * scale
        block = cfg.block or None
        x = adversarial_logits(
            rows, b.vocab, dtype=self.dtype, seed=seed, tp_size=self.tp, block=block
        )
        if b.op == "argmax":
            want = reference.argmax(x)
            real = self.dist is not None
            got = self._real(sel, x, None)[0] if real else self._emulate_argmax(x, sel)
            return _first_mismatch("ids", got, want)
        for synthetic in (False, True):
            batch = random_verify_batch(
                GATE_REQS * scale,
                b.k,
                b.vocab,
                seed=seed + synthetic,
                dtype=self.dtype,
                logits=x,
                synthetic=synthetic,
                device=self.device,
            )
            want3 = batch.reference()  # on the device: synthetic draws need Triton there
            if self.dist is None:
                got3 = self._emulate_verify(batch, sel)
            else:
                got3 = self._real(sel, batch.logits, batch)
            for name, g, w in zip(
                ("sampled", "num_sampled", "num_rejected"), got3, want3, strict=True
            ):
                why = _first_mismatch(name, g, w)
                if why:
                    return f"{'synthetic ' if synthetic else ''}verify: {why}"
        return None

    def _emulate_argmax(self, x: torch.Tensor, sel: Selection) -> torch.Tensor:
        x = x.to(self.device)
        if sel.variant == "plain":
            shards = shard_like_vllm(x, self.tp, PAD_TO)
            return torch.argmax(self._drop_padding([s.local_logits for s in shards]), dim=-1)
        return emulate_vocab_parallel_argmax(x, self.tp, selection=sel, pad_to=PAD_TO)

    def _emulate_verify(self, batch: Any, sel: Selection) -> tuple[torch.Tensor, ...]:
        if sel.variant == "plain":
            shards = shard_like_vllm(batch.logits, self.tp, PAD_TO)
            full = self._drop_padding([s.local_logits for s in shards])
            return reference.greedy_verify(full, *batch.args(), **batch.kwargs())
        return emulate_greedy_verify(
            batch.logits, self.tp, *batch.args(), **batch.kwargs(), selection=sel, pad_to=PAD_TO
        )

    def _drop_padding(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p[:, :n] for p, (_, n, _) in zip(parts, self.ranges, strict=True)], dim=1)

    def _real(self, sel: Selection, x: torch.Tensor, batch: Any) -> tuple[torch.Tensor, ...]:
        """This rank's real path on its shard of ``x`` (distributed gate)."""
        shard = shard_like_vllm(x, self.tp, PAD_TO)[self.rank]
        local = shard.local_logits.to(self.device)
        vargs = None
        if batch is not None:
            vargs = (
                batch.draft_sampled,
                batch.cu_num_logits,
                batch.pos,
                batch.idx_mapping,
                batch.seed,
                batch.num_speculative_steps,
                batch.synthetic_conditional_rates,
                batch.seq_lens,
                batch.prefill_len,
            )
        return self._path(sel, local, shard.vocab_start, shard.num_valid, vargs, None)

    # ------------------------------------------------------------------ path
    def _path(
        self,
        sel: Selection,
        local: torch.Tensor,
        vocab_start: int,
        num_valid: int,
        vargs: tuple[Any, ...] | None,
        gathered: torch.Tensor | None = None,
        timing_only: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Local stage + collective + finish on this rank. ``gathered``: single-GPU timing
        buffer standing in for the collective's output; ``timing_only``: plain verify times
        the gather + argmax only."""
        tp, coll = self.tp, self.coll
        if sel.variant == "plain":
            if tp > 1 and coll.world_size != tp:
                raise ValueError("plain path with tp > 1 needs a real group (--distributed)")
            full_parts = list(coll.all_gather_dim0(local).chunk(tp)) if tp > 1 else [local]
            full = self._drop_padding(full_parts)
            if vargs is None or timing_only:
                return (torch.argmax(full, dim=-1),)
            d, cu, pos, idx, seed, k, rates, seq_lens, prefill = vargs
            exp = torch.zeros_like(pos, dtype=torch.int32)
            return reference.greedy_verify(
                full,
                d,
                cu,
                pos,
                idx,
                exp,
                seed,
                k,
                synthetic_conditional_rates=rates,
                seq_lens=seq_lens,
                prefill_len=prefill,
            )
        keys = shard_keys(local, vocab_start, num_valid, sel)
        if gathered is not None:
            keys = gathered if tp > 1 else keys
        elif tp > 1:
            keys = (
                coll.all_reduce_max(keys)
                if sel.transport == "allreduce"
                else coll.all_gather_dim0(keys)
            )
        op = self.bucket.op
        if vargs is None:
            return (argmax_pick(keys, local.shape[0], tp, sel.finish_variant(op, tp)),)
        return verify_finish(keys, tp, sel.finish_variant(op, tp), step_batch(vargs))

    # ------------------------------------------------------------------ timing
    def _timing_inputs(self) -> dict[str, Any]:
        if self._inputs is not None:
            return self._inputs
        b, dev = self.bucket, self.device
        gen = torch.Generator().manual_seed(1234 + self.rank)
        one = torch.randn(b.rows, b.width, generator=gen).to(self.dtype)
        nbytes = one.numel() * one.element_size()
        copies = timing.copies_for_cold(nbytes, dev) if self.cold else 1
        xs = [one.to(dev)] + [one.roll(i, dims=1).to(dev) for i in range(1, copies)]
        vocab_start, num_valid, _ = self.ranges[self.rank]
        vargs = None
        if b.op == "verify":
            k = b.k
            cu = step_cu_num_logits(b.rows, k)
            n = len(cu) - 1
            i32 = torch.int32
            vargs = (
                torch.randint(0, b.vocab, (b.rows,), generator=gen, dtype=i32).to(dev),
                torch.tensor(cu, dtype=i32, device=dev),
                torch.arange(b.rows, dtype=torch.int64, device=dev),
                torch.arange(n, dtype=i32, device=dev),
                torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64).to(dev),
                k,
                None,
                None,
                None,
            )
        self._inputs = {
            "xs": xs,
            "vocab_start": vocab_start,
            "num_valid": max(num_valid, 1),
            "vargs": vargs,
        }
        return self._inputs

    def bench(self, cfg: Config, *, replays: int | None = None) -> timing.Timing:
        b = self.bucket
        sel = cfg.selection(b.dtype, b.align)
        inp = self._timing_inputs()
        xs, vs, nv, vargs = inp["xs"], inp["vocab_start"], inp["num_valid"], inp["vargs"]
        gathered = None
        if self.dist is None and self.tp > 1 and not cfg.is_plain:
            keys = shard_keys(xs[0], vs, nv, sel)
            gathered = keys.repeat(self.tp, 1)
        if self.dist is None and self.tp > 1 and cfg.is_plain:
            raise timing.TimingError("plain path with tp > 1 needs --distributed")

        def step(i: int) -> Any:
            return self._path(sel, xs[i], vs, nv, vargs, gathered, timing_only=True)

        barrier: Callable[[], None] | None = self.dist.barrier if self.dist else None
        t = timing.measure(
            step,
            len(xs),
            self.device,
            launches=self.launches,
            replays=replays or self.replays,
            barrier=barrier,
            cold=self.cold,
        )
        if self.dist is not None:
            p20, p50, p80 = self.dist.reduce_max([t.p20, t.p50, t.p80])
            t = timing.Timing(p20, p50, p80, t.samples, t.metric)
        return t

    def bench_safe(self, cfg: Config, replays: int | None = None) -> timing.Timing | None:
        """:meth:`bench`, None on error on any rank (export re-measure; never raises)."""
        try:
            t: timing.Timing | None = self.bench(cfg, replays=replays)
            err = ""
        except Exception as e:
            t, err = None, f"{type(e).__name__}: {e}"
        if self.dist is not None:
            err = "".join(self.dist.gather_str(err))
        return None if err else t

    def evaluate(self, cfg: Config, seed: int) -> Outcome:
        """Gate, then time. Never raises (a distributed sweep must stay in lock step)."""
        reason = self.gate(cfg, seed)
        if reason is not None:
            return Outcome(False, reason)
        try:
            t = self.bench(cfg)
            err = ""
        except Exception as e:
            t, err = None, f"timing error: {type(e).__name__}: {e}"
        if self.dist is not None:
            errs = [r for r in self.dist.gather_str(err) if r]
            err = errs[0] if errs else ""
        if err or t is None:
            return Outcome(False, err or "timing failed")
        return Outcome(True, "", t)


class BucketRunner(Protocol):
    """What the study and the export drive: :class:`Runner` (greedy ops) or
    :class:`tuner.sampled.SampledRunner` (op ``sampled``)."""

    bucket: Bucket
    dist: Dist | None

    def gate(self, cfg: Config, seed: int, scale: int = 1) -> str | None: ...

    def bench_safe(self, cfg: Config, replays: int | None = None) -> timing.Timing | None: ...

    def evaluate(self, cfg: Config, seed: int) -> Outcome: ...


class Lockstep:
    """Rank 0's handle on a :class:`BucketRunner`: in a distributed sweep every call is first
    broadcast to the other ranks (:func:`worker_loop`), so all ranks run the same gates, the
    same timings and thus the same number of collectives; single process: a plain proxy."""

    def __init__(self, runner: BucketRunner) -> None:
        self.runner = runner
        self.bucket = runner.bucket

    def _call(self, method: str, *args: Any) -> Any:
        if self.runner.dist is not None:
            self.runner.dist.bcast((method, args))
        return getattr(self.runner, method)(*args)

    def evaluate(self, cfg: Config, seed: int) -> Outcome:
        return self._call("evaluate", cfg, seed)

    def gate(self, cfg: Config, seed: int, scale: int = 1) -> str | None:
        return self._call("gate", cfg, seed, scale)

    def bench(self, cfg: Config, replays: int | None = None) -> timing.Timing:
        return self._call("bench_safe", cfg, replays)

    def stop(self) -> None:
        if self.runner.dist is not None:
            self.runner.dist.bcast(None)


def worker_loop(runner: BucketRunner) -> None:
    """Ranks != 0 of a distributed sweep: run what rank 0 broadcasts until ``None``."""
    assert runner.dist is not None
    while True:
        msg = runner.dist.bcast(None)
        if msg is None:
            return
        method, args = msg
        getattr(runner, method)(*args)


def optuna_objective(runner: Lockstep, names: list[str], seed: int) -> Callable[[Any], float]:
    """The Optuna objective of one bucket (rank 0)."""
    import optuna

    b = runner.bucket

    def objective(trial: optuna.Trial) -> float:
        name = str(trial.suggest_categorical("config", names))
        cfg = Config.parse(name)
        trial.set_user_attr("variant", cfg.variant(b.dtype, b.align))
        trial.set_user_attr("launch", cfg.launch())
        trial.set_user_attr("bucket", b.slug)
        out = runner.evaluate(cfg, seed)
        if not out.ok or out.timing is None:
            trial.set_user_attr("reject", out.reason)
            raise optuna.TrialPruned(out.reason)
        for k, v in out.timing.attrs().items():
            trial.set_user_attr(k, v)
        return out.timing.p50

    return objective
