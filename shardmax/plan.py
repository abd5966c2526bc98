"""Plan once, run every step: the runtime API an engine uses (FlashInfer-style wrappers).

A :class:`VocabShard` is one TP rank's vocab shard of the LM head: its group, its
``(vocab_start, num_valid)``, the padded local width ``W``, the logits dtype and device. It is
built once, on every rank at the same point of the program (it checks the shard geometry with
one small collective, :mod:`shardmax.runtime.geometry`). Its ``plan`` methods do the host work
of one kind of step once -- dispatch, launch parameters, buffer layout, the strict layout -- and
return a plan whose ``run`` only launches kernels and the collective::

    shard = shardmax.VocabShard(vocab_start=s, num_valid=n, width=W, dtype=torch.bfloat16,
                                device="cuda", group=tp_group)
    ids = shard.argmax(rows).run(local_logits)                        # draft-side argmax
    batch = shardmax.check_step_batch(...)                           # host checks only
    sampled, num_sampled, num_rejected = shard.greedy_verify(num_logits).run(local_logits, batch)
    res = shard.verify(num_logits, mode="fast", with_candidates=True).run(local_logits, batch)

``run`` never reads the device (no host sync), never allocates beyond its outputs (intermediates
live in the shard's workspace, shared by its plans) and is CUDA-graph capturable once it ran
eagerly (that first run compiles the kernels). A captured graph keeps pointers into the
workspace, which grows when a plan of a larger shape is made: make every plan you will capture
before capturing (or give captured steps a shard of their own). Plans are cached by their arguments, so asking
for the plan of a shape again costs a dictionary lookup. Runs of one shard's plans must be
ordered on one stream; a plan's outputs are new tensors that the caller may keep.

For an engine that calls verification eagerly (vLLM's model runner V2), :meth:`VocabShard.graphed`
wraps a plan's ``run`` in CUDA-graph replay (:mod:`shardmax.runtime.graphs`): the same outputs,
bit for bit, for a few writes into a host buffer and one graph launch of host time per step::

    step = shard.graphed(shard.greedy_verify(num_logits))
    sampled, num_sampled, num_rejected = step.run(local_logits, batch)   # every step

A replayed step's outputs are new tensor objects on the memory of one of a few static output
slots; a slot is handed out again only once nothing refers to that memory any more, so outputs
the caller keeps are never rewritten (:mod:`shardmax.runtime.graphs`).

Value checks (the syncing ones of :mod:`shardmax.runtime.validation`) are not run by ``run``:
call :func:`shardmax.runtime.validation.check_batch_values` yourself where you need them (the
functional ops :func:`shardmax.sharded_verify` etc. do, by default).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from shardmax.ops.argmax import ArgmaxPlan
from shardmax.ops.greedy import GreedyVerifyPlan
from shardmax.ops.sampled import RecordLaunch, SampledVerifyPlan
from shardmax.reference.nucleus_replay import PipelineConfig
from shardmax.runtime.collectives import resolve
from shardmax.runtime.dispatch import override_key
from shardmax.runtime.geometry import Geometry, exchange_geometry
from shardmax.runtime.graphs import GraphedStep
from shardmax.runtime.keys import MAX_VOCAB
from shardmax.runtime.shard import ShardContext, canonical_device
from shardmax.runtime.validation import (
    SUPPORTED_DTYPES,
    check_device_type,
    check_int,
)

__all__ = ["VocabShard"]

MAX_PLANS = 64
"""Plans a shard keeps (least recently used first out)."""


class VocabShard:
    """One TP rank's vocab shard (see the module docstring).

    Args:
        vocab_start: global token id of local column 0 (vLLM ``org_vocab_start_index``).
        num_valid: real columns of the shard (the rest of ``width`` is padding, never read).
        width: padded local width ``W`` (the LM-head shard's columns; the same on every rank).
        dtype: the logits dtype (bf16 / fp16 / fp32).
        device: where the logits live (a CUDA/ROCm device, or the CPU under the interpreter).
        group: None (one rank), a ``torch.distributed`` ProcessGroup, a vLLM
            ``GroupCoordinator`` or a :class:`shardmax.runtime.collectives.Collective`.
        geometry: every rank's ranges, already checked (the functional ops and the emulator pass
            it; the constructor then does not communicate).

    Raises:
        TypeError / ValueError naming the argument; ValueError (on every rank) when the ranks'
        geometries disagree (:func:`shardmax.runtime.geometry.exchange_geometry`).
    """

    def __init__(
        self,
        *,
        vocab_start: int,
        num_valid: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        group: Any = None,
        geometry: Geometry | None = None,
    ) -> None:
        coll = resolve(group)
        width = check_int("width", width, 1)
        vocab_start = check_int("vocab_start", vocab_start, 0)
        num_valid = check_int("num_valid", num_valid, 0)
        if num_valid > width:
            raise ValueError(f"num_valid: {num_valid} exceeds the shard width {width}")
        if vocab_start + num_valid > MAX_VOCAB:
            raise ValueError(
                f"vocab_start + num_valid = {vocab_start + num_valid} exceeds the largest "
                f"supported vocabulary {MAX_VOCAB}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype: {dtype} not supported; expected bf16, fp16 or fp32")
        dev = canonical_device(device)
        check_device_type("device", dev)
        if geometry is None:
            geometry = exchange_geometry(coll, width, dtype, vocab_start, num_valid, dev)
        if geometry.tp != coll.world_size or geometry.ranges[coll.rank] != (vocab_start, num_valid):
            raise ValueError(
                f"geometry: {geometry.ranges} does not hold rank {coll.rank}'s range "
                f"({vocab_start}, {num_valid}) of a group of {coll.world_size}"
            )
        if geometry.width != width or geometry.dtype != dtype:
            raise ValueError(f"geometry: width/dtype {geometry.width}/{geometry.dtype} differ")
        if geometry.vocab == 0 or (coll.world_size == 1 and num_valid == 0):
            raise ValueError(
                f"num_valid: 0 real columns (vocab_start={vocab_start}, width={width}): the "
                "vocabulary is empty"
            )
        self.ctx = ShardContext(coll, geometry, coll.rank, dev)
        self._plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._graphed: dict[int, GraphedStep] = {}

    @property
    def geometry(self) -> Geometry:
        return self.ctx.geometry

    @property
    def vocab(self) -> int:
        """Global vocabulary size (one past the largest real id of any rank)."""
        return self.ctx.geometry.vocab

    def __repr__(self) -> str:
        c = self.ctx
        return (
            f"VocabShard(rank={c.rank}/{c.tp}, vocab_start={c.vocab_start}, "
            f"num_valid={c.num_valid}, width={c.width}, dtype={c.dtype}, device={c.device})"
        )

    def _plan(self, key: tuple[Any, ...], make: Any) -> Any:
        key = (*key, override_key())
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            self._plans[key] = plan
            if len(self._plans) > MAX_PLANS:
                _, old = self._plans.popitem(last=False)
                self._graphed.pop(id(old), None)
        else:
            self._plans.move_to_end(key)
        return plan

    def _stride(self, row_stride: int | None) -> int:
        return self.ctx.width if row_stride is None else check_int("row_stride", row_stride, 1)

    def argmax(self, rows: int, *, row_stride: int | None = None) -> ArgmaxPlan:
        """Plan of the vocab-parallel argmax of ``rows`` rows (:class:`~shardmax.ops.argmax.
        ArgmaxPlan`); ``row_stride`` of the local logits (default ``W``)."""
        rows, stride = check_int("rows", rows, 0), self._stride(row_stride)
        return self._plan(("argmax", rows, stride), lambda: ArgmaxPlan(self.ctx, rows, stride))

    def greedy_verify(self, num_logits: int, *, row_stride: int | None = None) -> GreedyVerifyPlan:
        """Plan of greedy (and synthetic) verification over ``num_logits`` logits rows
        (:class:`~shardmax.ops.greedy.GreedyVerifyPlan`)."""
        rows, stride = check_int("num_logits", num_logits, 0), self._stride(row_stride)
        return self._plan(
            ("verify", rows, stride), lambda: GreedyVerifyPlan(self.ctx, rows, stride)
        )

    def verify(
        self,
        num_logits: int,
        *,
        mode: str = "fast",
        use_fp64_gumbel: bool = False,
        with_candidates: bool = False,
        logits_processed: bool = False,
        row_stride: int | None = None,
        launch: RecordLaunch | None = None,
        topp: PipelineConfig | None = None,
    ) -> SampledVerifyPlan:
        """Plan of sampled verification over ``num_logits`` logits rows
        (:class:`~shardmax.ops.sampled.SampledVerifyPlan`): ``mode`` "fast" | "strict";
        ``with_candidates`` when the steps carry top-k / top-p / min-p tensors;
        ``logits_processed`` vLLM's chunk gate (strict mode); ``launch`` forces the record launch
        (the tuner), else the dispatcher's; ``topp`` verifies top-p steps (without top-k /
        min-p) from level histograms with this vLLM pipeline instead of candidates
        (:class:`~shardmax.ops.sampled.SampledVerifyPlan`)."""
        rows, stride = check_int("num_logits", num_logits, 0), self._stride(row_stride)
        for name, v in (
            ("use_fp64_gumbel", use_fp64_gumbel),
            ("with_candidates", with_candidates),
            ("logits_processed", logits_processed),
        ):
            if not isinstance(v, bool):
                raise TypeError(
                    f"{name}: expected a Python bool, got {v!r} "
                    f"({type(v).__module__}.{type(v).__qualname__})"
                )
        processed = logits_processed if mode == "strict" else False
        key = (
            "sampled", rows, stride, mode, use_fp64_gumbel, with_candidates, processed, launch,
            topp,
        )  # fmt: skip
        return self._plan(
            key,
            lambda: SampledVerifyPlan(
                self.ctx, rows, stride, mode=mode, use_fp64_gumbel=use_fp64_gumbel,
                with_candidates=with_candidates, processed=processed, launch=launch, topp=topp,
            ),
        )  # fmt: skip

    def graphed(self, plan: GreedyVerifyPlan | SampledVerifyPlan) -> GraphedStep:
        """The CUDA-graph replay of one of this shard's verification plans (one per plan, kept
        while the plan is): :class:`~shardmax.runtime.graphs.GraphedStep`, whose ``run(
        local_logits, batch)`` returns what ``plan.run`` returns, bit for bit.

        Raises:
            ValueError: a plan of another shard, or one that cannot be replayed (the plain
                path: :meth:`GraphedStep.unsupported`). Strict-mode plans replay on a static copy
                of the logits; at TP > 1 the graphs are split at
                the collectives, which run eagerly between the replays.
        """
        if getattr(plan, "ctx", None) is not self.ctx:
            raise ValueError(f"plan: {type(plan).__name__} was not made by this shard")
        got = self._graphed.get(id(plan))
        if got is None or got.plan is not plan:
            got = self._graphed[id(plan)] = GraphedStep(plan)
        return got
