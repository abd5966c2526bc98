"""Part 2: the whole step on 2 GPUs (one process per GPU, NCCL), plus bytes on the wire.

Every rank holds its vLLM shard ``[rows, W]`` of the same seeded full logits ``[rows, V]``
(V = 200064, W = 100032). Paths (``op``/``path`` columns of ``step_tp2.csv``):

``argmax/sharded_allgather``, ``argmax/sharded_allreduce``
    ``shardmax.vocab_parallel_argmax(..., group=<NCCL group>)`` with the dispatcher's variant
    and launch but the transport forced (``shardmax.runtime.dispatch.override`` in this process);
    ``dispatched=1`` marks the transport ``select(...)`` picks.
``verify/sharded_allgather``, ``verify/sharded_allreduce``
    ``shardmax.sharded_greedy_verify(...)`` the same way, on a vLLM-shaped batch (K = 3).
``argmax/plain``
    the public op with ``Selection("plain")``: all_gather of the full padded logits in the
    logits' dtype, drop padding, ``torch.argmax``.
``verify/plain``
    the same gather + argmax, then the same finish kernel (``verify_finish_allreduce`` on the
    argmax ids) -- ``reference.greedy_verify`` reads values on the host and cannot be captured;
    it is the correctness oracle instead.
``argmax/vllm_unfused``
    vLLM ``get_top_tokens`` (spec §3.3): local max + all_gather of (value, id) fp32 pairs +
    argmax over ranks.
``collective/floor_allreduce_int64``
    all_reduce(MAX) of one int64 per row: the collective's small-message floor.
``sampled/sharded_fast``
    ``shardmax.sharded_verify(..., mode="fast")`` on the same batch with temperature 1.0 on
    every request: one all_gather of 24-byte records per row and rank, then the finish kernel.
    ``flag_rate`` = fraction of requests returned with ``fallback`` (eager check), checked
    ``==`` :func:`shardmax.reference.sampled.verify_sampled` on every other request.
``sampled/plain``
    all_gather of the full padded logits, then the same sampled kernels on the full logits
    (one rank's records + finish): the unsharded step with the same arithmetic.
``sampled_nucleus/sharded_fast``, ``sampled_nucleus/plain``
    the same with top-k 20 and top-p 0.95 on every request (candidates path: each record
    split's top-64 keys ride the all_gather; exact nucleus where the guard passes).
``sampled/sharded_strict_eager``, ``sampled/sharded_strict_eager_hostread``, ``sampled/plain_eager``
    the strict and plain sampled steps called eagerly, as vLLM 0.32's V2 runner calls
    ``sample`` (verification is not graph-captured there) and as the plug-in calls them (value
    checks off: ``shardmax.runtime.validation.value_checks(False)``): mean wall time per call over a fixed
    number of calls on every rank (MAX over ranks), ``_hostread`` adding the plug-in's
    ``bool(fallback.any())`` after every call -- the device sync that decides a native re-run.
``sampled/sharded_strict``, ``sampled_nucleus/sharded_strict``
    ``mode="strict"``: vLLM's acceptance LSE rebuilt bit for bit (:mod:`shardmax.ops.strict`); the
    same all_gather also carries vLLM's per-8192-block statistics of each rank's whole blocks
    and the raw values of the block its shard edge cuts. ``logits_processed`` as vLLM's chunk
    gate decides it: False for the temperature-1.0 batch (vLLM verifies the raw logits), True
    with top-k / top-p.

Every path is checked against the reference on the full logits before it is timed; timing is
CUDA-graph replay (fixed counts on every rank, warm-up before capture, barrier before every
replay), p20/p50/p80 are the MAX over ranks (``p50_us_rank0`` is rank 0's own median).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import timing
from .outcome import PartOutcome, analyze
from .report import STEP_FIELDS, CsvAppender

LOG = functools.partial(print, flush=True)
VOCAB = 200064
K = 3
EAGER_CALLS = 50
"""Eager calls timed per path (the same on every rank)."""
KEY_BYTES = 8
SAMPLED_RECORD_BYTES = 24
SAMPLED_TEMPERATURE = 1.0
NUCLEUS_TOP_K = 20
NUCLEUS_TOP_P = 0.95


@dataclass(frozen=True)
class StepPlan:
    dtypes: tuple[str, ...]
    rows: tuple[int, ...]
    vocab: int = VOCAB
    k: int = K


def wire_bytes_per_rank(
    path: str,
    rows: int,
    *,
    splits: int = 1,
    width: int = 0,
    elem_size: int = 0,
    candidates: int = 64,
) -> int:
    """Bytes each rank contributes to the step's collective (what crosses the link from it).

    ``sharded_allgather`` / ``sharded_allreduce``: ``8 * splits * rows`` (int64 keys);
    ``plain``: ``rows * width * elem_size`` (the padded shard in the logits' dtype);
    ``vllm_unfused``: ``8 * rows`` (an fp32 (value, id) pair per row);
    ``floor_allreduce_int64``: ``8 * rows``;
    ``sharded_fast`` (sampled verification): ``24 * splits * rows`` (one fp32-Gumbel record per
    row and record split, :func:`shardmax.ops.sampled.record_launch`);
    ``sharded_nucleus`` (+ top-k / top-p): ``(32 + 8 * C) * splits * rows`` (the record gains
    the split's smallest finite value; each record split sends its top-C candidate keys,
    ``C = candidates``).
    """
    if rows < 0 or splits < 1:
        raise ValueError(f"rows={rows}, splits={splits}")
    if path in ("sharded_allgather", "sharded_allreduce"):
        return KEY_BYTES * splits * rows
    if path == "plain":
        if width <= 0 or elem_size <= 0:
            raise ValueError("plain needs width and elem_size")
        return rows * width * elem_size
    if path in ("vllm_unfused", "floor_allreduce_int64"):
        return 8 * rows
    if path == "sharded_fast":
        return SAMPLED_RECORD_BYTES * splits * rows
    if path == "sharded_nucleus":
        return (SAMPLED_RECORD_BYTES + 8 + 8 * candidates) * splits * rows
    raise ValueError(f"unknown path {path!r}")


def strict_extra_bytes(rows: int, vocab: int, tp: int, elem_size: int) -> int:
    """Bytes strict mode adds per rank to the sampled all_gather (vLLM's layout of the shards,
    :func:`shardmax.ops.strict.extras_words`): 8 per whole local 8192-block and row + the raw pieces
    of cut blocks in the logits' dtype."""
    import torch

    from shardmax.ops.strict import extras_words, plan
    from shardmax.testing.shards import default_pad_to, vllm_shard_ranges

    geometry = [(s, n) for s, n, _ in vllm_shard_ranges(vocab, tp, default_pad_to(vocab, tp))]
    dtype = {2: torch.bfloat16, 4: torch.float32}[elem_size]
    return 8 * extras_words(plan(geometry), rows, dtype)


def request_counts(rows: int, k: int) -> list[int]:
    """Logits rows per request for a batch of exactly ``rows`` rows: full requests of K+1
    rows (K drafts + bonus), then one shorter request for the remainder."""
    if rows < 1 or k < 1:
        raise ValueError(f"rows={rows}, k={k}")
    counts = [k + 1] * (rows // (k + 1))
    if rows % (k + 1):
        counts.append(rows % (k + 1))
    return counts


def make_verify_batch(target: Any, k: int, vocab: int, seed: int) -> Any:
    """A vLLM-shaped greedy batch with exactly ``len(target)`` logits rows.

    ``target`` is the int64 argmax of every row (device tensor). Drafts accept a random prefix:
    each draft is the target of its row with probability 0.6, ``-1`` with 0.1, else another id.
    Same conventions as :func:`shardmax.testing.random_verify_batch` (int32 index tensors,
    int64 ``pos``/``seed``); no chunked prefill, no synthetic acceptance.
    """
    import torch

    from shardmax.testing import VerifyBatch

    dev = target.device
    rows = target.shape[0]
    counts = request_counts(rows, k)
    n = len(counts)
    gen = torch.Generator().manual_seed(seed)
    t = target.cpu()
    draft = torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int64)
    u = torch.rand(rows, generator=gen)
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    for r in range(n):
        for i in range(counts[r] - 1):  # draft i of request r sits at row cu[r] + i + 1
            row = cu[r] + i
            if u[row] < 0.6:
                draft[row + 1] = t[row]
            elif u[row] < 0.7:
                draft[row + 1] = -1
            elif draft[row + 1] == t[row]:
                draft[row + 1] = (t[row] + 1) % vocab
    max_reqs = 2 * n + 1
    i32 = torch.int32
    return VerifyBatch(
        logits=torch.empty(0, vocab),  # the full logits stay with the caller
        draft_sampled=draft.to(device=dev, dtype=i32),
        cu_num_logits=torch.tensor(cu, dtype=i32, device=dev),
        pos=torch.arange(rows, dtype=torch.int64, device=dev) + 1000,
        idx_mapping=torch.randperm(max_reqs, generator=gen)[:n].to(device=dev, dtype=i32),
        expanded_local_pos=torch.tensor(
            [j for c in counts for j in range(c)], dtype=i32, device=dev
        ),
        seed=torch.randint(-(2**62), 2**62, (max_reqs,), generator=gen).to(dev),
        num_speculative_steps=k,
        synthetic_conditional_rates=None,
        seq_lens=None,
        prefill_len=None,
    )


@contextlib.contextmanager
def forced_selection(sel: Any) -> Iterator[None]:
    """Make the public ops of this process use ``sel`` (``shardmax.runtime.dispatch.override``
    of its variant and launch parameters)."""
    from shardmax.runtime.dispatch import override

    launch = {k: v for k, v in sel.launch.items() if k in ("transport", "splits", "num_warps",
                                                          "num_stages")}  # fmt: skip
    with override(variant=sel.variant, **launch):
        yield


def with_transport(sel: Any, transport: str) -> Any:
    from shardmax.runtime.dispatch import Selection

    launch = {**sel.launch, "transport": transport}
    return Selection(sel.variant, launch, sel.is_tuned, f"{sel.source} [transport={transport}]")


# ------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_step(
    plan: StepPlan,
    out_dir: Path,
    deadline: float,
    log: Callable[[str], None] = LOG,
    world: int = 2,
    backend: str = "nccl",
    show_progress: bool = True,
) -> PartOutcome:
    """Spawn ``world`` processes (one per GPU) that run :func:`_worker`; wait until
    ``deadline`` (then kill them: rows already written stay in ``out_dir/step_tp2.csv``).

    Returns the part's :class:`PartOutcome`: rank 0 records the shapes the budget cut in
    ``step_tp2.skipped`` and writes ``step_tp2.done`` when its loop ends, so workers stopped at
    the deadline or dead count as skipped / failed. ``unavailable`` is set (nothing run) with
    fewer than ``world`` GPUs on NCCL.
    """
    import torch
    import torch.multiprocessing as mp

    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world:
            log(f"[step] needs {world} GPUs, found {n}: skipped")
            return analyze("step", None, unavailable=f"needs {world} GPUs, found {n}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast stays off (never turn on)
        torch.cuda.empty_cache()
    out = out_dir / "step_tp2.csv"
    CsvAppender(out, STEP_FIELDS)  # header; rank 0 appends
    skipped_file, done_file = out.with_suffix(".skipped"), out.with_suffix(".done")
    skipped_file.write_text("")
    done_file.unlink(missing_ok=True)
    port = free_port()
    ctx = mp.start_processes(
        _worker,
        args=(world, port, plan, str(out), deadline, backend, show_progress),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    grace = 30.0
    failed: list[str] = []
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline + grace:
                log("[step] deadline passed: stopping the workers (rows so far are kept)")
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                break
    except Exception as e:  # a worker failed: its traceback is printed by mp
        log(f"[step] worker failed: {type(e).__name__}: {str(e)[-2000:]}")
        failed.append(f"worker: {type(e).__name__}: {str(e)[-300:]}")
    skipped = [s for s in skipped_file.read_text().splitlines() if s]
    if not done_file.exists() and not failed:
        skipped.append("workers stopped before the end of the plan")
    return analyze("step", out, skipped=skipped, failed=failed)


def _worker(
    rank: int,
    world: int,
    port: int,
    plan: StepPlan,
    out: str,
    deadline: float,
    backend: str,
    show_progress: bool = True,
) -> None:
    from datetime import timedelta

    from . import ensure_shardmax_layout

    ensure_shardmax_layout()
    import torch
    import torch.distributed as dist
    from shardmax.generator.console import progress

    if backend == "nccl":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=180), device_id=dev,
        )  # fmt: skip
    else:  # gloo on CPU: smoke runs of the harness only
        dev = torch.device("cpu")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=180),
        )  # fmt: skip
    log = LOG if rank == 0 else (lambda s: None)
    writer = CsvAppender(Path(out), STEP_FIELDS, new_file=False) if rank == 0 else None
    shapes = [(d, r) for d in plan.dtypes for r in plan.rows]
    out_path = Path(out)
    try:
        bench = _StepBench(rank, world, dev, plan, writer, log)
        with progress(
            len(shapes), "[step] shapes", enabled=show_progress and rank == 0, every=1
        ) as bar:
            for dtype, rows in shapes:
                bar.set_postfix_str(f"{dtype} rows={rows}")
                go = bench.agree(time.monotonic() < deadline)
                if not go:
                    log(f"[step] time budget spent: skipping {dtype} rows={rows}")
                    if rank == 0:
                        with out_path.with_suffix(".skipped").open("a") as f:
                            f.write(f"{dtype} rows={rows}\n")
                    bar.update(1)
                    continue
                try:
                    bench.one_shape(dtype, rows)
                except Exception as e:
                    msg = f"{type(e).__name__}: {e}"
                    log(f"[step] {dtype} rows={rows} FAILED: {msg}")
                    traceback.print_exc()
                    bench._write({"dtype": dtype, "vocab": plan.vocab, "tp": world,
                                  "rows": rows, "op": "shape"}, error=msg)  # fmt: skip
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                bar.update(1)
        if rank == 0:
            out_path.with_suffix(".done").write_text("done\n")
    finally:
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


class _StepBench:
    def __init__(
        self,
        rank: int,
        world: int,
        dev: Any,
        plan: StepPlan,
        writer: CsvAppender | None,
        log: Callable[[str], None],
    ) -> None:
        import torch.distributed as dist

        from shardmax.runtime.collectives import TorchDistributed
        from shardmax.testing.shards import vllm_shard_ranges

        self.rank, self.world, self.dev, self.plan = rank, world, dev, plan
        self.writer, self.log = writer, log
        self.pg = dist.group.WORLD
        self.coll = TorchDistributed(self.pg)
        self.ranges = vllm_shard_ranges(plan.vocab, world, 64)
        self.vocab_start, self.num_valid, self.width = self.ranges[rank]

    # -------------------------------------------------------------- rank agreement
    def agree(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank (a CPU-side MIN over ranks)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def reduce_max(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.dev.type == "cuda":
            dist.barrier(device_ids=[self.dev.index])
        else:
            dist.barrier()

    # -------------------------------------------------------------- one shape
    def one_shape(self, dtype_name: str, rows: int) -> None:
        import torch
        import torch.distributed as dist

        import shardmax
        from shardmax import reference
        from shardmax.ops.greedy import verify_finish
        from shardmax.runtime.dispatch import PLAIN, Selection, alignment_of, select
        from shardmax.runtime.validation import SUPPORTED_DTYPES, check_step_batch

        from .local import DTYPE_BYTES, dispatched_selection

        plan, dev, tp = self.plan, self.dev, self.world
        torch_dtype = {v: k for k, v in SUPPORTED_DTYPES.items()}[dtype_name]
        es = DTYPE_BYTES[dtype_name]
        vs, nv, width = self.vocab_start, self.num_valid, self.width
        num_pad = width - nv

        gen = torch.Generator(device=dev).manual_seed(7 + rows)
        full = torch.randn(rows, plan.vocab, generator=gen, device=dev).to(torch_dtype)
        dist.broadcast(full, src=0)  # every rank shards the very same full logits
        nbytes = rows * width * es
        copies = timing.copies_for_cold(nbytes, dev, cap=16)
        xs = []
        for c in range(copies):
            if c == 0:
                x = torch.zeros(rows, width, dtype=torch_dtype, device=dev)
                x[:, :nv] = full[:, vs : vs + nv]
            else:  # timing copies: other random values, same on no rank in particular
                g = torch.Generator(device=dev).manual_seed(10_000 * c + 31 * self.rank + rows)
                x = torch.randn(rows, width, generator=g, device=dev).to(torch_dtype)
                x[:, nv:] = 0
            xs.append(x)
        want_ids = torch.argmax(full, dim=-1)
        batch = make_verify_batch(want_ids, plan.k, plan.vocab, seed=rows)
        vargs, vkw = batch.args(), batch.kwargs()
        want_v = reference.greedy_verify(full, *vargs, **vkw)
        step_batch = check_step_batch(rows, dev, *vargs, **vkw)
        from shardmax.ops.sampled import record_launch
        from shardmax.reference.sampled import verify_sampled

        temps = torch.full(
            (batch.seed.shape[0],), SAMPLED_TEMPERATURE, dtype=torch.float32, device=dev
        )
        want_s = verify_sampled(full, *vargs[:5], temps, *vargs[5:], **vkw)
        slots_n = batch.seed.shape[0]
        nucleus_kw = {
            "top_k": torch.full((slots_n,), NUCLEUS_TOP_K, dtype=torch.int32, device=dev),
            "top_p": torch.full((slots_n,), NUCLEUS_TOP_P, dtype=torch.float32, device=dev),
        }
        want_n = verify_sampled(full, *vargs[:5], temps, *vargs[5:], **vkw, **nucleus_kw)
        del full

        base = {"dtype": dtype_name, "vocab": plan.vocab, "tp": tp, "width": width,
                "rows": rows}  # fmt: skip
        align = alignment_of(xs[0])
        sels = {}
        for op in ("argmax", "verify"):
            from shardmax.runtime.dispatch import Problem

            raw = select(Problem(op, dtype_name, tp, rows, width, align))
            sel = dispatched_selection(op, dtype_name, tp, rows, width, align)
            sels[op] = (raw, sel)

        def same_ids(got: Any) -> bool:
            return bool(torch.equal(got.to(torch.int64), want_ids))

        def same_verify(got: Any) -> bool:
            return all(
                torch.equal(a.cpu().to(torch.int64), b.cpu().to(torch.int64))
                for a, b in zip(got, want_v, strict=True)
            )

        # ---- sharded paths through the public ops, transport forced
        for op in ("argmax", "verify"):
            raw, sel = sels[op]
            for transport in ("allgather", "allreduce"):
                fsel = with_transport(sel, transport)
                if op == "argmax":

                    def fn(i: int) -> Any:
                        return shardmax.vocab_parallel_argmax(
                            xs[i], vocab_start=vs, num_valid=nv, group=self.pg
                        )

                    check = same_ids
                else:

                    def fn(i: int) -> Any:
                        return shardmax.sharded_greedy_verify(
                            xs[i], *vargs, vocab_start=vs, num_valid=nv, group=self.pg, **vkw
                        )

                    check = same_verify
                dispatched = raw.variant != PLAIN and raw.transport == transport
                row = {**base, "op": op, "path": f"sharded_{transport}", "transport": transport,
                       "dispatched": dispatched, "variant": fsel.variant, "splits": fsel.splits,
                       "source": fsel.source,
                       "wire_bytes_per_rank": wire_bytes_per_rank(
                           f"sharded_{transport}", rows, splits=fsel.splits)}  # fmt: skip
                with forced_selection(fsel):
                    self._path(fn, check, copies, row)

        # ---- plain paths
        plain = Selection(PLAIN, {}, False, "forced plain")
        wire_plain = wire_bytes_per_rank("plain", rows, width=width, elem_size=es)

        def plain_argmax(i: int) -> Any:
            return shardmax.vocab_parallel_argmax(
                xs[i], vocab_start=vs, num_valid=nv, group=self.pg
            )

        with forced_selection(plain):
            self._path(plain_argmax, same_ids, copies,
                       {**base, "op": "argmax", "path": "plain", "dispatched":
                        sels["argmax"][0].variant == PLAIN, "variant": "plain",
                        "wire_bytes_per_rank": wire_plain})  # fmt: skip
        geometry = self.ranges
        finish = "verify_finish_allreduce"

        def plain_full(x: Any) -> Any:
            gathered = self.coll.all_gather_dim0(x)
            parts = gathered.chunk(tp)
            return torch.cat([p[:, :n] for p, (_, n, _) in zip(parts, geometry, strict=True)], 1)

        def plain_verify(i: int) -> Any:
            ids = torch.argmax(plain_full(xs[i]), dim=-1)
            keys = (0xFFFFFFFF - ids).view(-1, 1)  # the packed key of an id (value word 0)
            return verify_finish(keys, 1, finish, step_batch)

        self._path(plain_verify, same_verify, copies,
                   {**base, "op": "verify", "path": "plain", "variant": f"plain+{finish}",
                    "dispatched": sels["verify"][0].variant == PLAIN,
                    "wire_bytes_per_rank": wire_plain})  # fmt: skip

        # ---- sampled verification (temperature 1.0 everywhere), fast mode vs gather + same
        # kernels; "sampled" = temperature only, "sampled_nucleus" = + top-k 20 and top-p 0.95
        flagged: list[float] = []
        launch = record_launch(xs[0].dtype, tp, rows, width)  # what sharded_verify selects
        for op, extra, want_x in (("sampled", {}, want_s), ("sampled_nucleus", nucleus_kw, want_n)):

            def same_sampled(got: Any, want_x: Any = want_x) -> bool:
                keep = ~got.fallback
                flagged.append(float(got.fallback.float().mean()))
                return all(
                    torch.equal(a[keep].cpu(), b[keep].cpu())
                    for a, b in zip(got[:3], want_x, strict=True)
                )

            def sampled_sharded(i: int, extra: Any = extra) -> Any:
                return shardmax.sharded_verify(
                    xs[i], *vargs[:5], temps, *vargs[5:], vocab_start=vs, num_valid=nv,
                    group=self.pg, mode="fast", **vkw, **extra,
                )  # fmt: skip

            def sampled_plain(i: int, extra: Any = extra) -> Any:
                return shardmax.sharded_verify(
                    plain_full(xs[i]), *vargs[:5], temps, *vargs[5:], vocab_start=0,
                    mode="fast", **vkw, **extra,
                )  # fmt: skip

            def sampled_strict(i: int, extra: Any = extra) -> Any:
                return shardmax.sharded_verify(
                    xs[i], *vargs[:5], temps, *vargs[5:], vocab_start=vs, num_valid=nv,
                    group=self.pg, mode="strict", logits_processed=bool(extra), **vkw, **extra,
                )  # fmt: skip

            wire_s = wire_bytes_per_rank(
                "sharded_fast" if not extra else "sharded_nucleus", rows, splits=launch.splits,
                candidates=launch.candidates,
            )  # fmt: skip
            variant = f"T={SAMPLED_TEMPERATURE:g} fast" + (
                f" top_k={NUCLEUS_TOP_K} top_p={NUCLEUS_TOP_P:g}" if extra else ""
            )
            variant += f" {launch.variant.removeprefix('sampled_record_')} x{launch.splits}"
            variant += f" w{launch.num_warps}" + (f" C={launch.candidates}" if extra else "")
            wire_strict = wire_s + strict_extra_bytes(rows, plan.vocab, tp, es)
            for path, fn, wire in (
                ("sharded_fast", sampled_sharded, wire_s),
                ("sharded_strict", sampled_strict, wire_strict),
                ("plain", sampled_plain, wire_plain),
            ):
                flagged.clear()
                self._path(fn, same_sampled, copies,
                           {**base, "op": op, "path": path, "transport": "allgather",
                            "variant": variant.replace(" fast", " strict")
                            if path == "sharded_strict" else variant,
                            "dispatched": path == "sharded_fast",
                            "wire_bytes_per_rank": wire},
                           flag_rate=lambda: flagged[0] if flagged else "")  # fmt: skip

        # ---- eager calls (vLLM's V2 runner does not capture verification) and the host read
        from shardmax.runtime.validation import value_checks

        def strict_call(i: int) -> Any:
            with value_checks(False):  # as the vLLM plug-in calls it (no value-check syncs)
                return shardmax.sharded_verify(
                    xs[i], *vargs[:5], temps, *vargs[5:], vocab_start=vs, num_valid=nv,
                    group=self.pg, mode="strict", logits_processed=False, **vkw,
                )  # fmt: skip

        def plain_call(i: int) -> Any:
            with value_checks(False):
                return shardmax.sharded_verify(
                    plain_full(xs[i]), *vargs[:5], temps, *vargs[5:], vocab_start=0,
                    mode="fast", **vkw,
                )  # fmt: skip

        for path, fn, hostread in (
            ("sharded_strict_eager", strict_call, False),
            ("sharded_strict_eager_hostread", strict_call, True),
            ("plain_eager", plain_call, False),
        ):
            us = self.reduce_max([self._eager_us(fn, copies, hostread)])[0]
            self._write({**base, "op": "sampled", "path": path, "transport": "allgather",
                         "variant": f"T={SAMPLED_TEMPERATURE:g} "
                         + ("fast" if path == "plain_eager" else "strict"),
                         "dispatched": False, "p50_us": us, "p50_us_rank0": us,
                         "launches": EAGER_CALLS, "copies": copies, "correct": True,
                         "metric": "eager, mean us per call" + (
                             " + bool(fallback.any())" if hostread else "")})  # fmt: skip

        # ---- vLLM unfused get_top_tokens (spec §3.3)
        from .local import vllm_unfused_local

        def vllm_step(i: int) -> Any:
            pair = vllm_unfused_local(xs[i], num_pad, vs, tp, upcast=False)
            g = self.coll.all_gather_dim0(pair).view(tp, rows, 2).transpose(0, 1)
            rbest = torch.argmax(g[..., 0], dim=-1, keepdim=True)
            return g[..., 1].gather(1, rbest).squeeze(1).to(torch.int64)

        self._path(vllm_step, same_ids, copies,
                   {**base, "op": "argmax", "path": "vllm_unfused", "variant": "get_top_tokens",
                    "wire_bytes_per_rank": wire_bytes_per_rank("vllm_unfused", rows)})  # fmt: skip

        # ---- collective floor: all_reduce(MAX) of one int64 per row
        bufs = [torch.full((rows, 1), self.rank, dtype=torch.int64, device=dev)
                for _ in range(copies)]  # fmt: skip

        def floor_step(i: int) -> Any:
            return self.coll.all_reduce_max(bufs[i])

        self._path(floor_step, lambda got: bool((got == tp - 1).all()), copies,
                   {**base, "op": "collective", "path": "floor_allreduce_int64",
                    "variant": "all_reduce MAX int64",
                    "wire_bytes_per_rank": wire_bytes_per_rank("floor_allreduce_int64", rows)})  # fmt: skip
        self.log(f"[step] {dtype_name} rows={rows} done")

    def _eager_us(self, fn: Callable[[int], Any], copies: int, hostread: bool) -> float:
        """Mean wall time (us) of ``EAGER_CALLS`` eager calls (2 on CPU) after 3 warm-ups."""
        import torch

        def sync() -> None:
            if getattr(self.dev, "type", "cpu") == "cuda":
                torch.cuda.synchronize(self.dev)

        calls = EAGER_CALLS if getattr(self.dev, "type", "cpu") == "cuda" else 2
        for i in range(3):
            fn(i % copies)
        sync()
        self.barrier()
        t0 = time.perf_counter()
        for i in range(calls):
            res = fn(i % copies)
            if hostread:
                bool(res.fallback.any())
        sync()
        return (time.perf_counter() - t0) / calls * 1e6

    def _path(
        self,
        fn: Callable[[int], Any],
        check: Callable[[Any], bool],
        copies: int,
        row: dict[str, Any],
        flag_rate: Callable[[], Any] | None = None,
    ) -> None:
        """Eager check, then timing; all ranks agree at each stage; rank 0 writes the row."""
        err = ""
        ok = False
        try:
            ok = bool(check(fn(0)))
        except Exception as e:
            err = f"eager: {type(e).__name__}: {e}"
        if not self.agree(not err):
            self._write(row, error=err or "failed on another rank")
            self.log(f"[step] {row['op']}/{row['path']} rows={row['rows']} FAILED: {err}")
            return
        ok = self.agree(ok)
        if flag_rate is not None:
            row = {**row, "flag_rate": flag_rate()}
        if not ok:
            self.log(f"[step] MISMATCH {row['op']}/{row['path']} {row['dtype']} rows={row['rows']}")
        try:
            st = timing.measure(fn, copies, self.dev, dist_sync=self.agree, barrier=self.barrier)
            err = ""
        except Exception as e:
            st, err = None, f"{type(e).__name__}: {e}"
        if not self.agree(not err) or st is None:
            self._write(row, error=err or "failed on another rank", correct=ok)
            self.log(f"[step] {row['op']}/{row['path']} rows={row['rows']} timing FAILED: {err}")
            return
        p20, p50, p80 = self.reduce_max([st.p20, st.p50, st.p80])
        self._write(row, p20_us=p20, p50_us=p50, p80_us=p80, p50_us_rank0=st.p50,
                    launches=st.launches, copies=st.copies, metric=st.metric, correct=ok)  # fmt: skip

    def _write(self, row: dict[str, Any], **extra: Any) -> None:
        if self.writer is None:
            return
        full = dict.fromkeys(STEP_FIELDS, "")
        full.update(row)
        full.update(extra)
        if "error" in extra:
            full["error"] = str(extra["error"])[:300]
        self.writer.write(full)
