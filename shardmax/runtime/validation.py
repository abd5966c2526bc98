"""Input checks of the public ops: clear ValueError/TypeError naming the argument.

The contract (README "The semantics contract"):

* **Shapes, dtypes, devices** are checked on the host on every call (no device read).
* **Strides.** ``local_logits`` needs a contiguous last dim (its row stride may exceed ``W``).
  Every other tensor argument may have any stride: it is made contiguous once here (a copy
  only for a strided view), so every op and every kernel sees unit-stride index tensors.
* **Values** -- draft ids in range, ``cu_num_logits`` consistent with the rows, request-state
  slots in range, temperatures / top-p / min-p in their domains -- need a device->host read;
  they are checked only while :func:`value_checks` is on (the default) and no CUDA graph is
  being captured. Hot paths that have validated their batch (the vLLM plug-in, a
  :class:`shardmax.plan.VocabShard` plan's ``run``) turn them off. Kernels never read out of
  bounds even then: every index they load is clamped, so a malformed batch gives unspecified
  outputs, never a crash or a value planted outside the inputs.
* **Temperatures** are read as fp32, the dtype vLLM stores them in; ``0`` is greedy. A positive
  temperature that becomes 0 in fp32 (below ~1.4e-45) is refused when value checks are on: it
  would silently turn a sampled request greedy. (vLLM's ``SamplingParams`` raises any
  temperature in ``(0, 0.01)`` to 0.01, so the engine never sends one.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple, cast

import torch

from shardmax.runtime.keys import MAX_VOCAB

SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEVICE_TYPES = ("cuda", "cpu")
"""Where kernels run: a CUDA/ROCm device, or the CPU under the Triton interpreter."""

_value_checks = True


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Enable or disable the value checks (those that read the device) inside the block. Every
    rank of a group must use the same setting: it decides whether the functional ops check the
    shard geometry with a collective (:mod:`shardmax.runtime.geometry`)."""
    global _value_checks
    old, _value_checks = _value_checks, bool(enabled)
    try:
        yield
    finally:
        _value_checks = old


def value_checks_enabled(device: torch.device) -> bool:
    if not _value_checks:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_int(name: str, v: object, lo: int | None = None) -> int:
    """A Python int (bools refused), optionally ``>= lo``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    return v


def check_device_type(name: str, device: torch.device) -> None:
    if device.type not in DEVICE_TYPES:
        raise ValueError(
            f"{name}: on device {device}, expected a CUDA/ROCm device or the CPU (Triton "
            "interpreter); a meta or other device tensor holds no values to reduce"
        )


def check_local_logits(
    local_logits: object, vocab_start: object, num_valid: object
) -> tuple[torch.Tensor, int, int]:
    """Validate the local shard; returns ``(logits, vocab_start, num_valid)``."""
    if not isinstance(local_logits, torch.Tensor):
        raise TypeError(f"local_logits: expected a torch.Tensor, got {type(local_logits).__name__}")
    if local_logits.dim() != 2:
        raise ValueError(
            f"local_logits: expected 2 dims [rows, W], got shape {tuple(local_logits.shape)}"
        )
    if local_logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"local_logits: dtype {local_logits.dtype} not supported; expected one of "
            "torch.bfloat16, torch.float16, torch.float32"
        )
    check_device_type("local_logits", local_logits.device)
    if local_logits.shape[1] > 1 and local_logits.shape[0] > 0 and local_logits.stride(1) != 1:
        raise ValueError(
            f"local_logits: last dim must be contiguous (stride(1) == 1), got strides "
            f"{tuple(local_logits.stride())}"
        )
    if local_logits.shape[0] > 1 and local_logits.stride(0) < 1:
        raise ValueError(
            f"local_logits: row stride {local_logits.stride(0)} (rows broadcast, e.g. by "
            f"expand()) for shape {tuple(local_logits.shape)}; expected rows of their own "
            "(.contiguous())"
        )
    if local_logits.is_neg():  # the kernels read the storage, not torch's lazy negation
        raise ValueError(
            "local_logits: carries torch's lazy negation bit (is_neg()); pass "
            "local_logits.resolve_neg()"
        )
    width = local_logits.shape[1]
    vocab_start = check_int("vocab_start", vocab_start, 0)
    if num_valid is None:
        num_valid = width
    if isinstance(num_valid, bool) or not isinstance(num_valid, int):
        raise TypeError(f"num_valid: expected an int or None, got {type(num_valid).__name__}")
    if not 0 <= num_valid <= width:
        raise ValueError(
            f"num_valid: {num_valid} out of range [0, {width}] for local_logits of shape "
            f"{tuple(local_logits.shape)}"
        )
    if vocab_start + num_valid > MAX_VOCAB:
        raise ValueError(
            f"vocab_start + num_valid = {vocab_start + num_valid} exceeds the largest supported "
            f"vocabulary {MAX_VOCAB} (2**31 - 1 ids: ids never travel as floats)"
        )
    if local_logits.shape[0] > 0 and local_logits.stride(0) > MAX_VOCAB:
        raise ValueError(f"local_logits: row stride {local_logits.stride(0)} exceeds 2**31 - 1")
    return local_logits, vocab_start, num_valid


def check_index_tensor(
    name: str,
    t: object,
    device: torch.device,
    dims: int = 1,
    length: int | None = None,
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
) -> torch.Tensor:
    """Validate one integer batch tensor (dtype, rank, length, device); returns it contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not supported; expected one of {dtypes}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dim(s), got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] < length:
        raise ValueError(f"{name}: expected at least {length} entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the logits' device {device}")
    return t.contiguous()


def check_float_tensor(
    name: str,
    t: object,
    device: torch.device,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Validate a 1-D float tensor on ``device``; returns it contiguous, cast to ``dtype`` (a
    tuple: kept when its dtype is one of them, else cast to the first)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected 1 dim, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the logits' device {device}")
    # (a no-op .to() still costs ~2 us of host, a real cast a kernel launch: 70-78 us
    # p50 on the H200's host for top-p, benchmarks/results/sm90/host_costs_tables/before_fp32_top_p)
    if isinstance(dtype, tuple):
        if t.dtype not in dtype:
            t = t.to(dtype[0])
    elif dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


class StepBatch(NamedTuple):
    """vLLM model runner V2's batch tensors of one verification step, validated: unit-stride,
    on the logits' device, of the documented dtypes (README "The API")."""

    draft_sampled: torch.Tensor  # int32/int64 [num_logits]
    cu_num_logits: torch.Tensor  # int32/int64 [num_reqs + 1]
    pos: torch.Tensor  # int64 [num_logits]
    idx_mapping: torch.Tensor  # int32/int64 [num_reqs]
    seed: torch.Tensor  # int64 [max_num_reqs]
    num_speculative_steps: int
    synthetic_conditional_rates: torch.Tensor | None  # fp32 [K]
    seq_lens: torch.Tensor | None  # int32/int64 [num_reqs]
    prefill_len: torch.Tensor | None  # int32/int64 [max_num_reqs]
    temperature: torch.Tensor | None = None  # fp32 [max_num_reqs]
    top_k: torch.Tensor | None = None  # int32/int64 [max_num_reqs]
    top_p: torch.Tensor | None = None  # fp32 (as vLLM keeps it) or fp64 [max_num_reqs]
    min_p: torch.Tensor | None = None  # fp32 [max_num_reqs]

    @property
    def num_logits(self) -> int:
        return self.draft_sampled.numel()  # 1-D: its length (numel: cheaper on the host)

    @property
    def num_reqs(self) -> int:
        return self.idx_mapping.numel()

    @property
    def num_slots(self) -> int:
        """Request-state slots every per-slot tensor holds (the kernels clamp slots below it)."""
        per_slot = [self.seed, self.prefill_len, self.temperature, self.top_k]
        per_slot += [self.top_p, self.min_p]
        return max(1, min(t.shape[0] for t in per_slot if t is not None))


def check_step_batch(
    num_logits: int,
    device: torch.device,
    draft_sampled: object,
    cu_num_logits: object,
    pos: object,
    idx_mapping: object,
    expanded_local_pos: object,
    seed: object,
    num_speculative_steps: object,
    synthetic_conditional_rates: object = None,
    seq_lens: object = None,
    prefill_len: object = None,
    temperature: object = None,
    top_k: object = None,
    top_p: object = None,
    min_p: object = None,
) -> StepBatch:
    """Host checks of one step's batch tensors against ``num_logits`` logits rows on
    ``device``; returns the normalised :class:`StepBatch`. Sampling tensors (``temperature``,
    ``top_k``, ``top_p``, ``min_p``) are per request-state slot, like ``seed``."""
    k = check_int("num_speculative_steps", num_speculative_steps, 1)
    dev = device if type(device) is torch.device else torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # a tensor's device always has its index
        dev = torch.device("cuda", torch.cuda.current_device())
    fast = _fast_step_batch(
        num_logits, dev, k, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_local_pos,
        seed, synthetic_conditional_rates, seq_lens, prefill_len, temperature, top_k, top_p,
        min_p,
    )  # fmt: skip
    if fast is not None:
        return fast
    draft = check_index_tensor("draft_sampled", draft_sampled, dev)
    if draft.shape[0] != num_logits:
        raise ValueError(
            f"draft_sampled: shape {tuple(draft.shape)} does not match the {num_logits} logits rows"
        )
    idx = check_index_tensor("idx_mapping", idx_mapping, dev)
    num_reqs = idx.shape[0]
    cu = check_index_tensor("cu_num_logits", cu_num_logits, dev)
    if cu.shape[0] != num_reqs + 1:
        raise ValueError(
            f"cu_num_logits: expected {num_reqs + 1} entries (num_reqs + 1 for idx_mapping of "
            f"shape {tuple(idx.shape)}), got shape {tuple(cu.shape)}"
        )
    pos_t = check_index_tensor("pos", pos, dev, dtypes=(torch.int64,))
    elp = check_index_tensor("expanded_local_pos", expanded_local_pos, dev)
    for name, t in (("pos", pos_t), ("expanded_local_pos", elp)):
        if t.shape[0] != num_logits:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {num_logits} rows")
    seed_t = check_index_tensor("seed", seed, dev, dtypes=(torch.int64,))
    rates = None
    if synthetic_conditional_rates is not None:
        r = synthetic_conditional_rates
        if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or r.dim() != 1:
            raise TypeError("synthetic_conditional_rates: expected a 1-D float32 tensor or None")
        if r.shape[0] != k:
            raise ValueError(
                f"synthetic_conditional_rates: shape {tuple(r.shape)}, expected [{k}] "
                "(one conditional rate per draft step)"
            )
        if r.device != dev:
            raise ValueError(f"synthetic_conditional_rates: on {r.device}, expected {dev}")
        rates = r.contiguous()
    if (seq_lens is None) != (prefill_len is None):
        raise ValueError("seq_lens and prefill_len: pass both or neither")
    lens = pre = None
    if seq_lens is not None:
        lens = check_index_tensor("seq_lens", seq_lens, dev, length=num_reqs)
        pre = check_index_tensor("prefill_len", prefill_len, dev)
    temp = None if temperature is None else check_float_tensor(
        "temperature", temperature, dev, torch.float32
    )  # fmt: skip
    tk = None if top_k is None else check_index_tensor("top_k", top_k, dev)
    # fp32 (vLLM's) or fp64 as given, widened to fp64 where the kernels load it: a host cast
    # would launch a kernel every step
    tp = None if top_p is None else check_float_tensor(
        "top_p", top_p, dev, (torch.float32, torch.float64)
    )  # fmt: skip
    mp = None if min_p is None else check_float_tensor("min_p", min_p, dev, torch.float32)
    return StepBatch(draft, cu, pos_t, idx, seed_t, k, rates, lens, pre, temp, tk, tp, mp)


def _fast_step_batch(
    num_logits: int,
    dev: torch.device,
    k: int,
    draft: object,
    cu: object,
    pos: object,
    idx: object,
    elp: object,
    seed: object,
    rates: object,
    lens: object,
    pre: object,
    temp: object,
    tk: object,
    tp: object,
    mp: object,
) -> StepBatch | None:
    """:func:`check_step_batch` of the batch every engine step sends -- every tensor 1-D of
    an accepted dtype on ``dev`` and of the right length, the sampling tensors of the dtype
    the kernels load (no cast), no synthetic rates -- in one pass without a call per argument
    (host time every step); None for anything else, which the per-argument checks then take
    (and name in their errors). Its ``contiguous()`` calls run in the checks' order, so an
    argument that cannot be made contiguous (a sparse tensor, ...) raises as it does there."""
    if rates is not None or (lens is None) != (pre is None):
        return None
    T, ix = torch.Tensor, INDEX_DTYPES
    for t in (draft, cu, pos, idx, elp, seed):
        if type(t) is not T or t.dtype not in ix or t.dim() != 1 or t.device != dev:
            return None
    for t, ok in ((lens, ix), (pre, ix), (tk, ix), (temp, _FP32), (tp, _FP32_64), (mp, _FP32)):
        if t is not None and (
            type(t) is not T or t.dtype not in ok or t.dim() != 1 or t.device != dev
        ):
            return None
    d, c_, p, i, e, s = cast("tuple[torch.Tensor, ...]", (draft, cu, pos, idx, elp, seed))
    opt = cast("tuple[torch.Tensor | None, ...]", (lens, pre, temp, tk, tp, mp))
    num_reqs = i.numel()  # (1-D: the length, in half the host time of shape[0])
    if (
        p.dtype is not torch.int64
        or s.dtype is not torch.int64
        or d.numel() != num_logits
        or p.numel() != num_logits
        or e.numel() != num_logits
        or c_.numel() != num_reqs + 1
        or (opt[0] is not None and opt[0].numel() < num_reqs)
    ):
        return None
    # ``contiguous()`` in the checks' order, ``expanded_local_pos`` included (its result unused
    # there too): a tensor it raises on raises the same here
    d, i, c_, p = d.contiguous(), i.contiguous(), c_.contiguous(), p.contiguous()
    e.contiguous()
    s = s.contiguous()
    lens_c, pre_c, temp_c, tk_c, tp_c, mp_c = [None if t is None else t.contiguous() for t in opt]
    return StepBatch(d, c_, p, i, s, k, None, lens_c, pre_c, temp_c, tk_c, tp_c, mp_c)


_FP32 = (torch.float32,)
_FP32_64 = (torch.float32, torch.float64)


def check_batch_values(
    batch: StepBatch,
    vocab: int,
    *,
    temperature: torch.Tensor | None = None,
) -> None:
    """The checks that read values (device->host copies): ``cu_num_logits`` starts at 0, ends at
    the rows and gives every request 1..K+1 rows; request-state slots are in range of every
    per-slot tensor; draft ids in ``[-1, vocab)``; used temperatures ``>= 0``, not NaN and not
    flushed to 0 by fp32 (``temperature``: the caller's original tensor); used top-p in
    ``(0, 1]``, min-p in ``[0, 1]``.

    Raises:
        ValueError naming the argument and the offending values.
    """
    k = batch.num_speculative_steps
    cu_h = batch.cu_num_logits.tolist()
    num_logits = batch.num_logits
    if cu_h[0] != 0 or cu_h[-1] != num_logits:
        raise ValueError(
            f"cu_num_logits: must start at 0 and end at the {num_logits} logits rows, got "
            f"{cu_h[0]} .. {cu_h[-1]}"
        )
    for r in range(len(cu_h) - 1):
        n = cu_h[r + 1] - cu_h[r]
        if not 1 <= n <= k + 1:
            raise ValueError(
                f"cu_num_logits: request {r} has {n} logits rows, expected 1..K+1 = 1..{k + 1} "
                f"(num_speculative_steps={k})"
            )
    if batch.num_reqs:
        lo, hi = int(batch.idx_mapping.min()), int(batch.idx_mapping.max())
        per_slot = {
            "seed": batch.seed,
            "prefill_len": batch.prefill_len,
            "temperature": batch.temperature,
            "top_k": batch.top_k,
            "top_p": batch.top_p,
            "min_p": batch.min_p,
        }
        for name, t in per_slot.items():
            if t is not None and (lo < 0 or hi >= t.shape[0]):
                raise ValueError(
                    f"idx_mapping: values must be in [0, {t.shape[0]}) (request-state slots of "
                    f"{name}), got [{lo}, {hi}]"
                )
    if batch.draft_sampled.numel():
        lo, hi = int(batch.draft_sampled.min()), int(batch.draft_sampled.max())
        if lo < -1 or hi >= vocab:
            raise ValueError(
                f"draft_sampled: token ids must be in [-1, {vocab}) (-1 is a placeholder "
                f"draft), got [{lo}, {hi}]"
            )
    if not batch.num_reqs:
        return
    slots = batch.idx_mapping.long()
    if batch.temperature is not None:
        used = batch.temperature[slots]
        if bool((used < 0).any()) or bool(torch.isnan(used).any()):
            raise ValueError(
                f"temperature: must be >= 0 and not NaN on used slots, got {used.tolist()}"
            )
        if temperature is not None and temperature.dtype == torch.float64:
            flushed = (temperature[slots] > 0) & (used == 0)
            if bool(flushed.any()):
                raise ValueError(
                    "temperature: a positive value becomes 0 (greedy) in fp32, vLLM's storage "
                    f"dtype, on used slots: {temperature[slots][flushed].tolist()}; pass 0 for "
                    "greedy or a temperature of at least ~1.4e-45 (vLLM raises any "
                    "temperature in (0, 0.01) to 0.01)"
                )
    if batch.top_p is not None:
        p = batch.top_p[slots]
        if bool(((p <= 0) | (p > 1) | torch.isnan(p)).any()):
            raise ValueError(f"top_p: must be in (0, 1] on used slots, got {p.tolist()}")
    if batch.min_p is not None:
        m = batch.min_p[slots].double()
        if bool(((m < 0) | (m > 1) | torch.isnan(m)).any()):
            raise ValueError(f"min_p: must be in [0, 1] on used slots, got {m.tolist()}")
