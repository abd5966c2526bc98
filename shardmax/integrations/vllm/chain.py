"""vLLM's own native verification chain, runnable outside vLLM's runner, one :class:`NativeChain`
per vLLM version: the plug-in's per-request resolver (:func:`installed_chain`, vLLM's modules as
installed) and, on the trees ``scripts/vllm_kernels.sh`` extracts, the oracle of the tests and
benchmarks (:mod:`shardmax.testing.vllm_chain` loads those). Nothing of vLLM is copied into
shardmax.

What it reproduces: one step of model runner V2's ``RejectionSampler.__call__`` for one-hot drafts
(``draft_logits is None``, vLLM's default) on the logits tensor ``compute_logits`` returns
(``[num_logits, V]`` in the model dtype; at TP > 1 the all-gathered tensor -- the caller gathers),
from the point where ``gather_draft_sampled`` has produced ``draft_sampled`` / ``pos``:

1. ``_verify_in_chunks``: requests grouped into chunks of at most ``2**30 // (4 V)`` logits rows
   (host-side, from ``cu_num_logits_np``; one chunk whenever the step fits);
2. per chunk, ``Sampler.apply_sampling_params`` as ``_verify`` calls it (top-k/top-p included):
   the raw chunk when no request of it needs processing (vLLM's ``needs_logits_processing`` gate:
   ``T != 0 and (T != 1 or min_p != 0 or top_k != V or top_p != 1)``), else an fp32 copy
   (``torch.empty_like(chunk, dtype=float32).copy_(chunk)``) processed in vLLM's order by vLLM's
   kernels: ``apply_temperature`` (skipped when every T is 0 or 1), ``apply_min_p`` (skipped when
   no min-p), then ``SamplingStates.apply_top_k_top_p``'s decisions (``top_k`` / ``top_p``
   gathered per logits row only when some request of the chunk uses them; 0.33 also computes
   ``has_topp_only_rows``) and ``apply_top_k_top_p`` = ``apply_top_k_top_p_triton`` (vLLM's
   ``HAS_TRITON`` branch; its top-k/top-p kernels launched by vLLM's own jit-warm-up dispatcher);
3. per chunk, ``rejection_sample(processed, None, draft_sampled, chunk_cu, pos, idx_mapping,
   expanded_idx_mapping, expanded_local_pos, temperature, seeds, K, synthetic_rates,
   use_fp64=..., use_block_verification=False[, fly_window_size=0, fly_entropy_threshold=0.3,
   fly_entropy_top_k=3 on 0.33])``;
4. ``torch.cat`` of the chunks' outputs (only when there are several), then
   ``get_num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx_mapping,
   prefill_len)`` (in place on ``num_sampled``, as vLLM).

Every kernel is vLLM's -- the installed vLLM's, or those of a tree ``scripts/vllm_kernels.sh``
extracts (``.vllm-kernels/<version>``: see that script for the shims of ``vllm.platforms`` /
``vllm.envs`` / ``vllm.utils``); the host-side decisions above are restated here from vLLM's
``v1/worker/gpu/spec_decode/rejection_sampler.py``, ``v1/worker/gpu/sample/sampler.py``
(``apply_sampling_params``), ``v1/worker/gpu/sample/states.py`` and
``v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``), whose modules import too much of
vLLM to be extracted. Each tree is imported on its own (:func:`shardmax.testing.vllm_oracle.
import_tree`), so 0.32 and 0.33 live side by side in one process.

:meth:`NativeChain.verify_requests` runs the chain on SOME requests of a step from their rows
only, with the whole step's per-chunk decisions (the per-request resolution of
:mod:`shardmax.ops.resolve`).

Host syncs: none in this module (argument checks read shapes, dtypes, devices and the host-side
numpy arrays only). vLLM itself syncs in this chain only on the first top-k/top-p call per device
(``apply_top_k_top_p_triton`` uploads its two lookup tables with ``logits.new_tensor(list)``
inside ``gpu_sync_allowed()``); its workspaces are allocated on first use too.

The top-p pipeline (research §1.1/§1.5): vLLM 0.32/0.33 run the *split* pipeline
(``_topp_sb_stats_kernel``, 5 x ``_topp_sb_step_kernel``, ``_topp_sb_mask_kernel``) when top-p is
active, the chunk has at most ``_SPLIT_MAX_BATCH`` (64) rows and the logits are on a CUDA device,
for the rows without an active top-k; everything else goes through the *monolithic*
``_topk_topp_kernel`` (launch parameters per device type: 8192/4096-wide tiles and 8 warps on
CUDA, 256/128 and 4 warps on CPU). On CPU (the Triton interpreter) only the monolithic kernel runs.
:meth:`NativeChain.topp_pipeline_for` states vLLM's choice, :attr:`NativeChain.last_pipelines`
holds it for each chunk of the last step, :meth:`NativeChain.record_launches` records every vLLM
kernel launched (name, grid, scalar launch arguments) -- the proof of which one ran -- and
``NativeChain(..., topp_pipeline="monolithic")`` makes a CUDA run use the monolithic kernel at
any row count (vLLM's split threshold set to 0 for the duration of the call).

Under ``TRITON_INTERPRET=1`` the interpreter gives ``tl.range`` loop variables as Python ints,
where the compiler gives int32/int64 scalars; vLLM's top-k/top-p kernels call ``.to`` on theirs,
so for the duration of that call the interpreter's ``tl.range`` yields scalar tensors (int64 when
a bound is int64, else int32, like the compiler). Nothing else of the interpreter is changed.

Not supported (``NotImplementedError``): logits processors (bias, allowed ids, min tokens,
penalties, bad words, custom), thinking budgets, logprobs, draft logits, block verification, FLy,
watermarking.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from shardmax.ops.resolve import check_requests
from shardmax.runtime.host import stage

__all__ = [
    "MODULES",
    "ChainModules",
    "ChainOutput",
    "Launch",
    "NativeChain",
    "installed_chain",
    "max_chunk_logits",
    "request_chunks",
]

MODULES = {
    "gumbel": "vllm.v1.worker.gpu.sample.gumbel",
    "min_p": "vllm.v1.worker.gpu.sample.min_p",
    "rejection": "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils",
    "input_batch": "vllm.v1.worker.gpu.input_batch",
    "topk_topp": "vllm.v1.sample.ops.topk_topp_triton",
}
"""The vLLM modules the chain calls (``scripts/vllm_kernels.sh`` extracts them)."""

MAX_CHUNK_BYTES = 2**30
"""vLLM's cap on the fp32 chunk ``apply_sampling_params`` materialises (``rejection_sampler.py``)."""

Pipeline = Literal["none", "split", "monolithic", "monolithic+split"]
_PIPELINE_OPTIONS = ("auto", "monolithic")


def max_chunk_logits(vocab_size: int) -> int:
    """vLLM's ``get_max_chunk_logits``: the most logits rows one verification chunk holds,
    ``max(1, 2**30 // (4 * vocab_size))`` (1766 at V = 151936)."""
    return max(1, MAX_CHUNK_BYTES // (4 * vocab_size))


def request_chunks(cu_num_logits_np: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """vLLM's request chunks of one step (``_verify_in_chunks``): ``[(start, end), ...]`` request
    ranges. One chunk ``(0, num_reqs)`` when ``num_logits <= max_rows``; otherwise, from each
    ``start``, the largest ``end`` with ``cu[end] - cu[start] <= max_rows`` and at least one
    request (requests are never split).

    Raises:
        ValueError: ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    num_reqs = len(cu_num_logits_np) - 1
    if int(cu_num_logits_np[-1]) <= max_rows:
        return [(0, num_reqs)]
    out: list[tuple[int, int]] = []
    start = 0
    while start < num_reqs:
        limit = int(cu_num_logits_np[start]) + max_rows
        end = int(np.searchsorted(cu_num_logits_np, limit, side="right")) - 1
        end = min(num_reqs, max(start + 1, end))
        out.append((start, end))
        start = end
    return out


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainModules:
    """One vLLM version's chain modules (:data:`MODULES`), imported from ``source``."""

    version: str
    source: str
    gumbel: Any
    min_p: Any
    rejection: Any
    input_batch: Any
    topk_topp: Any


def installed_chain() -> NativeChain:
    """The chain of the importable vLLM (``vllm.…`` as installed, vLLM's own module objects: the
    ones its engine runs), built once per process; the vLLM plug-in's per-request resolver.

    Raises:
        ImportError: no vLLM, or one of :data:`MODULES` does not import (named).
        RuntimeError: the modules lack a name the chain calls (a vLLM version it does not know).
    """
    import importlib

    with _INSTALLED_LOCK:
        got = _INSTALLED.get("chain")
        if got is None:
            import vllm

            mods = {k: importlib.import_module(m) for k, m in MODULES.items()}
            version = str(getattr(vllm, "__version__", "unknown"))
            got = _INSTALLED["chain"] = NativeChain(ChainModules(version, "installed", **mods))
    return got


_INSTALLED: dict[str, NativeChain] = {}
_INSTALLED_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------------
# launch records and the interpreter's loop variables
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One vLLM kernel launch: the kernel's name (vLLM's ``@triton.jit`` function), its grid, and
    the launch arguments passed by keyword whose values are scalars (constexprs, ``num_warps``)."""

    kernel: str
    grid: tuple[Any, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)


def _jit_types() -> tuple[type, ...]:
    import triton

    types_: list[type] = [triton.runtime.jit.JITFunction]
    with contextlib.suppress(ImportError, AttributeError):
        from triton.runtime.interpreter import InterpretedFunction

        types_.append(InterpretedFunction)
    return tuple(types_)


def _kernel_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)
    return str(getattr(inner, "__name__", repr(fn)))


class _RecordingKernel:
    """Stands in for one vLLM kernel while recording: ``kernel[grid](...)`` logs and launches."""

    def __init__(self, fn: Any, log: list[Launch]) -> None:
        self._fn = fn
        self._log = log
        self._name = _kernel_name(fn)

    def __getitem__(self, grid: Any) -> Any:
        launcher = self._fn[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            meta = {
                k: v
                for k, v in kwargs.items()
                if v is None or isinstance(v, bool | int | float | str)
            }
            g = tuple(grid) if isinstance(grid, tuple | list) else (grid,)
            self._log.append(Launch(self._name, g, meta))
            return launcher(*args, **kwargs)

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def _interpreting(mods: ChainModules) -> bool:
    with contextlib.suppress(ImportError, AttributeError):
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(mods.topk_topp._topk_topp_kernel, InterpretedFunction)
    return False


@contextlib.contextmanager
def _interpreter_loop_tensors() -> Iterator[None]:
    """While active, the Triton interpreter's ``tl.range`` yields scalar tensors (module docstring)."""
    import triton.language as tl
    import triton.runtime.interpreter as ti

    original = ti._patch_lang_core

    def value(x: Any) -> int:
        return int(x.handle.data.item()) if isinstance(x, tl.tensor) else int(x)

    def tensor_range(arg1: Any, arg2: Any = None, step: Any = None, **_: Any) -> Iterator[Any]:
        lo, hi = (0, arg1) if arg2 is None else (arg1, arg2)
        step = 1 if step is None else step
        wide = any(isinstance(b, tl.tensor) and b.dtype == tl.int64 for b in (lo, hi, step))
        vals = range(value(lo), value(hi), value(step))
        wide = wide or any(not -(2**31) <= v < 2**31 for v in (vals.start, vals.stop))
        np_dt, tl_dt = (np.int64, tl.int64) if wide else (np.int32, tl.int32)
        for i in vals:
            yield tl.tensor(ti.TensorHandle(np.array([i], dtype=np_dt), tl_dt), tl_dt)

    def patched(lang: Any, scope: Any) -> None:
        original(lang, scope)
        scope.set_attr(lang, "range", tensor_range)

    ti._patch_lang_core = patched
    try:
        yield
    finally:
        ti._patch_lang_core = original


# --------------------------------------------------------------------------------------------
# the chain
# --------------------------------------------------------------------------------------------


class ChainOutput(NamedTuple):
    """``RejectionSampler.__call__``'s tokens and counts: ``sampled`` int64 ``[num_reqs, K + 1]``
    (vLLM leaves the columns ``>= num_sampled`` uninitialised -- compare ``[:num_sampled]``),
    ``num_sampled`` / ``num_rejected`` int32 ``[num_reqs]`` (0 / 0 for chunked-prefill
    requests)."""

    sampled: torch.Tensor
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor


_UNSUPPORTED_PROCESSING = (
    "logits processors (logit bias, allowed token ids, min tokens, penalties, bad words, custom) "
    "and thinking budgets"
)


def _tensor(name: str, t: Any, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None,
            device: torch.device) -> torch.Tensor:  # fmt: skip
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    want = "/".join(str(d).replace("torch.", "") for d in dtypes)
    if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != shape):
        exp = f"{want} {list(shape) if shape is not None else '[...]'}"
        raise ValueError(f"{name}: expected {exp}, got {t.dtype} {list(t.shape)} on {t.device}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the logits' device {device}")
    return t


def _array(name: str, a: Any, length: int, kind: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray (the host copy), got {type(a).__name__}")
    if a.shape != (length,) or a.dtype.kind not in kind:
        raise ValueError(
            f"{name}: expected a 1-D numpy array of {length} "
            f"{'integers' if kind == 'iu' else 'numbers'}, got {a.dtype} {a.shape}"
        )
    return a


_INDEX = (torch.int32, torch.int64)


class _Chunk(NamedTuple):
    """One ``rejection_sample`` call's tensors (a vLLM chunk, or some requests of one)."""

    logits: torch.Tensor
    draft_sampled: torch.Tensor
    cu_num_logits: torch.Tensor
    pos: torch.Tensor
    idx_mapping: torch.Tensor
    eim: torch.Tensor
    expanded_local_pos: torch.Tensor
    gates: NativeChain._Gates


class NativeChain:
    """vLLM's native verification chain of one version (module docstring).

    Args:
        modules: :func:`load_chain` of the version's tree.
        topp_pipeline: ``"auto"`` -- vLLM's own choice; ``"monolithic"`` -- vLLM's monolithic
            ``_topk_topp_kernel`` for every top-k/top-p chunk, also where vLLM would run the split
            pipeline (CUDA, <= 64 rows): the answer those rows get inside a step of more rows.
        max_chunk_rows: the chunk limit in logits rows; default vLLM's :func:`max_chunk_logits`
            of the step's vocabulary (set it small to exercise the chunking).

    Raises:
        ValueError: an unknown ``topp_pipeline`` or ``max_chunk_rows < 1``.
        RuntimeError: the modules lack a name the chain calls (a vLLM version it does not know).
    """

    def __init__(
        self,
        modules: ChainModules,
        *,
        topp_pipeline: Literal["auto", "monolithic"] = "auto",
        max_chunk_rows: int | None = None,
    ) -> None:
        if topp_pipeline not in _PIPELINE_OPTIONS:
            raise ValueError(
                f"topp_pipeline: {topp_pipeline!r}, expected one of {_PIPELINE_OPTIONS}"
            )
        if max_chunk_rows is not None and max_chunk_rows < 1:
            raise ValueError(f"max_chunk_rows must be >= 1, got {max_chunk_rows}")
        needed = {
            "gumbel": ("apply_temperature",),
            "min_p": ("apply_min_p",),
            "rejection": ("rejection_sample",),
            "input_batch": ("get_num_sampled_and_rejected",),
            "topk_topp": ("apply_top_k_top_p_triton", "_SPLIT_MAX_BATCH", "_topk_topp_kernel"),
        }
        for mod, names in needed.items():
            for n in names:
                if not hasattr(getattr(modules, mod), n):
                    raise RuntimeError(f"vLLM {modules.version}: {MODULES[mod]} has no {n}")
        self.modules = modules
        self.topp_pipeline = topp_pipeline
        self.max_chunk_rows = max_chunk_rows
        topk_params = inspect.signature(modules.topk_topp.apply_top_k_top_p_triton).parameters
        self.passes_has_topp_only_rows = "has_topp_only_rows" in topk_params
        """0.33: ``apply_top_k_top_p_triton(..., has_topp_only_rows=...)``; 0.32 has no such
        argument (it runs the split pipeline after the monolithic kernel whenever it may)."""
        rs_params = inspect.signature(modules.rejection.rejection_sample).parameters
        self.passes_fly = "fly_window_size" in rs_params
        """0.33's ``_verify`` passes FLy's three arguments: window 0 (off) and the threshold /
        top-k defaults, which are ``rejection_sample``'s own (0.3 / 3, ``SpeculativeConfig``'s)."""
        self._fly_defaults = {
            k: rs_params[k].default
            for k in ("fly_entropy_threshold", "fly_entropy_top_k")
            if k in rs_params
        }
        self.last_pipelines: list[Pipeline] = []
        """vLLM's top-k/top-p pipeline for each chunk of the last :meth:`verify` (or the one
        chunk of the last :meth:`apply_sampling_params`)."""
        self._interpreted = _interpreting(modules)
        self._sources: dict[str, str] = {}

    # ---- construction -------------------------------------------------------------------

    @property
    def version(self) -> str:
        return self.modules.version

    @property
    def id(self) -> str:
        suffix = "" if self.topp_pipeline == "auto" else f"-{self.topp_pipeline}"
        return f"vllm{self.version}{suffix}"

    def __repr__(self) -> str:
        return f"NativeChain(vLLM {self.version} from {self.modules.source}, {self.topp_pipeline})"

    def with_options(self, **options: Any) -> NativeChain:
        """A chain of the same modules with other constructor ``options``."""
        base = {"topp_pipeline": self.topp_pipeline, "max_chunk_rows": self.max_chunk_rows}
        return type(self)(self.modules, **{**base, **options})

    # ---- the pipeline vLLM picks ----------------------------------------------------------

    def topp_pipeline_for(
        self,
        num_rows: int,
        *,
        top_k_active: bool,
        top_p_active: bool,
        has_topp_only_rows: bool,
        device_type: str,
    ) -> Pipeline:
        """The top-k/top-p kernels vLLM's ``apply_top_k_top_p_triton`` of this version runs on a
        chunk of ``num_rows`` logits rows (with this chain's ``topp_pipeline``): ``"none"`` (no
        top-k / top-p in the chunk), ``"split"`` (top-p, no top-k, <= 64 rows, CUDA),
        ``"monolithic"`` or ``"monolithic+split"`` (top-k and top-p, <= 64 rows, CUDA: the split
        pipeline then handles the rows without a top-k -- on 0.33 only when
        ``has_topp_only_rows``). :meth:`record_launches` shows what really ran."""
        if not (top_k_active or top_p_active):
            return "none"
        threshold = (
            0 if self.topp_pipeline == "monolithic" else self.modules.topk_topp._SPLIT_MAX_BATCH
        )
        use_split = top_p_active and num_rows <= threshold and device_type == "cuda"
        if use_split and not top_k_active:
            return "split"
        if use_split and (has_topp_only_rows or not self.passes_has_topp_only_rows):
            return "monolithic+split"
        return "monolithic"

    # ---- launch records -------------------------------------------------------------------

    def _source(self, mod_key: str) -> str:
        src = self._sources.get(mod_key)
        if src is None:
            src = self._sources[mod_key] = inspect.getsource(getattr(self.modules, mod_key))
        return src

    @contextlib.contextmanager
    def record_launches(self) -> Iterator[list[Launch]]:
        """Record every vLLM kernel this chain's modules launch while the block runs: the list
        yielded fills with :class:`Launch` entries in launch order -- the kernels launched from
        vLLM's host functions (``kernel[grid](...)``) and those vLLM's jit-warm-up dispatcher
        launches (``_topk_topp``, ``_topp_split_*``: their ``kernel`` replaced for the block).
        Costs one Python call per launch; nothing is wrapped outside the block. Not re-entrant,
        and it records launches of every chain sharing these modules (one per version)."""
        log: list[Launch] = []
        jit = _jit_types()
        undo: list[tuple[Any, str, Any]] = []
        try:
            for key in MODULES:
                mod = getattr(self.modules, key)
                src = self._source(key)
                for name, obj in list(vars(mod).items()):
                    if isinstance(obj, jit) and f"{name}[" in src:
                        undo.append((mod, name, obj))
                        setattr(mod, name, _RecordingKernel(obj, log))
                    elif callable(getattr(obj, "_dispatch_fn", None)) and isinstance(
                        getattr(obj, "kernel", None), jit
                    ):
                        undo.append((obj, "kernel", obj.kernel))
                        obj.kernel = _RecordingKernel(obj.kernel, log)
            yield log
        finally:
            for owner, name, original in reversed(undo):
                setattr(owner, name, original)

    # ---- one chunk: Sampler.apply_sampling_params -------------------------------------------

    def apply_sampling_params(
        self,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        *,
        temperature_gpu: torch.Tensor,
        temperature_np: np.ndarray,
        top_k_gpu: torch.Tensor | None = None,
        top_k_np: np.ndarray | None = None,
        top_p_gpu: torch.Tensor | None = None,
        top_p_np: np.ndarray | None = None,
        min_p_gpu: torch.Tensor | None = None,
        min_p_np: np.ndarray | None = None,
    ) -> torch.Tensor:
        """vLLM's ``Sampler.apply_sampling_params`` on ONE chunk as ``_verify`` calls it (top-k /
        top-p included): the tensor ``rejection_sample`` reads. Returns ``logits`` itself when no
        request of the chunk needs processing, else a new fp32 ``[rows, V]`` tensor (vLLM's copy,
        processed in place; -inf where min-p / top-k / top-p masked). Arguments as
        :meth:`verify`'s (``logits`` = the chunk's rows, ``idx_mapping_np`` its requests' slots).

        Raises:
            ValueError / TypeError: as :meth:`verify`.
        """
        device = logits.device
        vocab = self._check_logits(logits)
        rows = logits.shape[0]
        _tensor("expanded_idx_mapping", expanded_idx_mapping, _INDEX, (rows,), device)
        state = self._sampling_state(
            vocab, device, temperature_gpu, temperature_np, top_k_gpu, top_k_np, top_p_gpu,
            top_p_np, min_p_gpu, min_p_np,
        )  # fmt: skip
        if not isinstance(idx_mapping_np, np.ndarray) or idx_mapping_np.ndim != 1:
            raise TypeError("idx_mapping_np: expected a 1-D numpy array (the chunk's slots)")
        slots = self._slots(idx_mapping_np, len(idx_mapping_np), len(state.temperature_np))
        self.last_pipelines = []
        gates = self._gates(slots, state, vocab, rows)
        return self._process_chunk(logits, expanded_idx_mapping, state, vocab, gates)

    # ---- one step: RejectionSampler.__call__ ---------------------------------------------

    def verify(
        self,
        logits: torch.Tensor,
        draft_sampled: torch.Tensor,
        cu_num_logits: torch.Tensor,
        pos: torch.Tensor,
        idx_mapping: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        temperature_gpu: torch.Tensor,
        seed_gpu: torch.Tensor,
        num_speculative_steps: int,
        *,
        idx_mapping_np: np.ndarray,
        cu_num_logits_np: np.ndarray,
        temperature_np: np.ndarray,
        seq_lens: torch.Tensor,
        prefill_len: torch.Tensor,
        top_k_gpu: torch.Tensor | None = None,
        top_k_np: np.ndarray | None = None,
        top_p_gpu: torch.Tensor | None = None,
        top_p_np: np.ndarray | None = None,
        min_p_gpu: torch.Tensor | None = None,
        min_p_np: np.ndarray | None = None,
        use_fp64_gumbel: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        draft_logits: torch.Tensor | None = None,
        rejection_sample_method: str = "standard",
        logits_processing: bool = False,
        num_logprobs: int | None = None,
        watermark_key: int | None = None,
        checks: bool = True,
    ) -> ChainOutput:
        """One verification step exactly as vLLM's ``RejectionSampler.__call__`` -> ``_verify``
        runs it for one-hot drafts, after ``gather_draft_sampled`` (module docstring for the
        call sequence and syncs). Tensors on one device, in the dtypes of vLLM's buffers where
        the kernels read them as such:

        Args:
            logits: ``[num_logits, V]`` bf16/fp16/fp32, ``stride(-1) == 1`` (``compute_logits``'
                output; at TP > 1 the all-gathered, unpadded tensor).
            draft_sampled: int32/int64 ``[num_logits]``: the input id of each logits row
                (``gather_draft_sampled``: slot ``cu[r]`` is the last sampled token, ``cu[r]+i+1``
                draft ``i``; -1 = placeholder).
            cu_num_logits: int32/int64 ``[num_reqs + 1]``.
            pos: int64 (or int32) ``[num_logits]`` positions.
            idx_mapping: int32/int64 ``[num_reqs]`` request -> request-state slot.
            expanded_idx_mapping: int32/int64 ``[num_logits]`` logits row -> slot.
            expanded_local_pos: int32/int64 ``[num_logits]`` row index inside its request.
            temperature_gpu: fp32 ``[max_num_reqs]`` (``SamplingStates.temperature.gpu``).
            seed_gpu: int64 ``[max_num_reqs]`` (``SamplingStates.seeds.gpu``).
            num_speculative_steps: K >= 0 (every request has 1..K+1 rows).
            idx_mapping_np, cu_num_logits_np: the host copies vLLM keeps of ``idx_mapping`` /
                ``cu_num_logits`` (``InputBatch.idx_mapping_np`` / ``cu_num_logits_np``); they
                decide the gates and the chunks, as in vLLM. Must hold the device tensors' values
                (not checked: that would sync).
            temperature_np: ``[max_num_reqs]`` host copy of ``temperature_gpu`` (``.np``); >= 0.
            seq_lens: int32 ``[num_reqs]`` (``InputBatch.seq_lens``).
            prefill_len: int32 ``[max_num_reqs]`` (``RequestState.prefill_len.gpu``).
            top_k_gpu / top_k_np: int32 ``[max_num_reqs]`` device tensor and its host copy, as
                ``SamplingStates`` stores them (1..V, V = off); both or neither (neither = off
                for every slot).
            top_p_gpu / top_p_np: fp32 / its host copy, in (0, 1] (1 = off); both or neither.
            min_p_gpu / min_p_np: fp32 / its host copy, in [0, 1] (0 = off); both or neither.
            use_fp64_gumbel: ``model_config.use_fp64_gumbel``.
            synthetic_conditional_rates: fp32 ``[K]`` for ``rejection_sample_method ==
                "synthetic"`` (passed to ``rejection_sample`` as vLLM does), else None.
            draft_logits, logits_processing, num_logprobs, watermark_key,
            rejection_sample_method ``"block"`` / ``"fly"``: not supported (module docstring).
            checks: check every argument (default). ``False`` skips the shape / dtype / device /
                host-array checks (the refusals of unsupported features stay) so that a timed
                loop measures vLLM's host work only; wrong input is then undefined behaviour.

        Returns:
            :class:`ChainOutput` ``(sampled, num_sampled, num_rejected)``.

        Raises:
            NotImplementedError: an unsupported feature is asked for.
            TypeError: an argument of the wrong type (named).
            ValueError: shapes, dtypes, devices, inconsistent host arrays or out-of-range
                sampling parameters (named, with what was expected).
        """
        self._refuse_unsupported(
            draft_logits, rejection_sample_method, synthetic_conditional_rates,
            logits_processing, num_logprobs, watermark_key,
        )  # fmt: skip
        k = num_speculative_steps
        vocab = int(logits.shape[1])
        if checks:
            vocab = self._check_logits(logits)
            state, slots, cu_np = self._check_step(
                logits.device, vocab, logits.shape[0], k, draft_sampled, cu_num_logits, pos,
                idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature_gpu,
                seed_gpu, idx_mapping_np, cu_num_logits_np, temperature_np, seq_lens,
                prefill_len, top_k_gpu, top_k_np, top_p_gpu, top_p_np, min_p_gpu, min_p_np,
                synthetic_conditional_rates,
            )  # fmt: skip
        else:
            state = NativeChain._State(
                temperature_gpu, temperature_np, top_k_gpu, top_k_np, top_p_gpu, top_p_np,
                min_p_gpu, min_p_np,
            )  # fmt: skip
            slots, cu_np = idx_mapping_np, cu_num_logits_np

        limit = self.max_chunk_rows or max_chunk_logits(vocab)
        parts = []
        for start, end in request_chunks(cu_np, limit):
            lo, hi = int(cu_np[start]), int(cu_np[end])
            parts.append(
                _Chunk(
                    logits[lo:hi],
                    draft_sampled[lo:hi],
                    cu_num_logits[start : end + 1] - lo,
                    pos[lo:hi],
                    idx_mapping[start:end],
                    expanded_idx_mapping[lo:hi],
                    expanded_local_pos[lo:hi],
                    self._gates(slots[start:end], state, vocab, hi - lo),
                )
            )
        return self._rejection(
            parts, state, vocab, k, temperature_gpu, seed_gpu, synthetic_conditional_rates,
            use_fp64_gumbel, seq_lens, cu_num_logits, idx_mapping, prefill_len,
        )  # fmt: skip

    def _check_step(
        self,
        device: torch.device,
        vocab: int,
        num_logits: int,
        k: Any,
        draft_sampled: Any,
        cu_num_logits: Any,
        pos: Any,
        idx_mapping: Any,
        expanded_idx_mapping: Any,
        expanded_local_pos: Any,
        temperature_gpu: Any,
        seed_gpu: Any,
        idx_mapping_np: Any,
        cu_num_logits_np: Any,
        temperature_np: Any,
        seq_lens: Any,
        prefill_len: Any,
        top_k_gpu: Any,
        top_k_np: Any,
        top_p_gpu: Any,
        top_p_np: Any,
        min_p_gpu: Any,
        min_p_np: Any,
        synthetic_conditional_rates: Any,
    ) -> tuple[NativeChain._State, np.ndarray, np.ndarray]:
        """:meth:`verify`'s checks of a step's arguments (``num_logits`` rows, vocabulary
        ``vocab``); returns the sampling state, the request slots and ``cu_num_logits_np``."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_speculative_steps: expected an int >= 0, got {k!r}")
        if not isinstance(cu_num_logits, torch.Tensor) or cu_num_logits.dim() != 1:
            raise ValueError("cu_num_logits: expected a 1-D tensor [num_reqs + 1]")
        num_reqs = cu_num_logits.shape[0] - 1
        if num_reqs < 1:
            raise ValueError(f"cu_num_logits: expected >= 2 entries, got {cu_num_logits.shape[0]}")
        _tensor("cu_num_logits", cu_num_logits, _INDEX, (num_reqs + 1,), device)
        _tensor("draft_sampled", draft_sampled, _INDEX, (num_logits,), device)
        _tensor("pos", pos, _INDEX, (num_logits,), device)
        _tensor("idx_mapping", idx_mapping, _INDEX, (num_reqs,), device)
        _tensor("expanded_idx_mapping", expanded_idx_mapping, _INDEX, (num_logits,), device)
        _tensor("expanded_local_pos", expanded_local_pos, _INDEX, (num_logits,), device)
        _tensor("seq_lens", seq_lens, _INDEX, (num_reqs,), device)
        state = self._sampling_state(
            vocab, device, temperature_gpu, temperature_np, top_k_gpu, top_k_np, top_p_gpu,
            top_p_np, min_p_gpu, min_p_np,
        )  # fmt: skip
        max_reqs = len(state.temperature_np)
        _tensor("seed_gpu", seed_gpu, (torch.int64,), (max_reqs,), device)
        _tensor("prefill_len", prefill_len, _INDEX, (max_reqs,), device)
        if synthetic_conditional_rates is not None:
            _tensor("synthetic_conditional_rates", synthetic_conditional_rates,
                    (torch.float32,), (k,), device)  # fmt: skip
        slots = self._slots(idx_mapping_np, num_reqs, max_reqs)
        cu_np = _array("cu_num_logits_np", cu_num_logits_np, num_reqs + 1, "iu")
        sizes = np.diff(cu_np.astype(np.int64))
        if (
            int(cu_np[0]) != 0
            or int(cu_np[-1]) != num_logits
            or bool(((sizes < 1) | (sizes > k + 1)).any())
        ):
            raise ValueError(
                f"cu_num_logits_np: expected 0 = cu[0] < ... < cu[num_reqs] = num_logits = "
                f"{num_logits} with 1..K+1 = 1..{k + 1} rows per request, got {cu_np.tolist()}"
            )
        return state, slots, cu_np

    def _rejection(
        self,
        parts: list[_Chunk],
        state: NativeChain._State,
        vocab: int,
        k: int,
        temperature_gpu: torch.Tensor,
        seed_gpu: torch.Tensor,
        synthetic_conditional_rates: torch.Tensor | None,
        use_fp64_gumbel: bool,
        seq_lens: torch.Tensor,
        cu_num_logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        prefill_len: torch.Tensor,
    ) -> ChainOutput:
        """``_verify`` per chunk (``apply_sampling_params`` with the chunk's gates, then
        ``rejection_sample``), the chunks' outputs concatenated, then
        ``get_num_sampled_and_rejected`` over the requests of ``parts`` (in order)."""
        rs = self.modules.rejection.rejection_sample
        extra: dict[str, Any] = {"use_fp64": use_fp64_gumbel, "use_block_verification": False}
        if self.passes_fly:
            extra.update(fly_window_size=0, **self._fly_defaults)
        self.last_pipelines = []
        sampled_parts: list[torch.Tensor] = []
        num_sampled_parts: list[torch.Tensor] = []
        for c in parts:
            processed = self._process_chunk(c.logits, c.eim, state, vocab, c.gates)
            sampled_c, num_sampled_c = rs(
                processed, None, c.draft_sampled, c.cu_num_logits, c.pos, c.idx_mapping, c.eim,
                c.expanded_local_pos, temperature_gpu, seed_gpu, k, synthetic_conditional_rates,
                **extra,
            )  # fmt: skip
            del processed
            sampled_parts.append(sampled_c)
            num_sampled_parts.append(num_sampled_c)
        if len(sampled_parts) == 1:
            sampled, num_sampled = sampled_parts[0], num_sampled_parts[0]
        else:
            sampled, num_sampled = torch.cat(sampled_parts), torch.cat(num_sampled_parts)
        num_sampled, num_rejected = self.modules.input_batch.get_num_sampled_and_rejected(
            num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len
        )
        return ChainOutput(sampled, num_sampled, num_rejected)

    def verify_requests(
        self,
        rows_logits: torch.Tensor,
        requests: np.ndarray,
        *,
        draft_sampled: torch.Tensor,
        cu_num_logits: torch.Tensor,
        pos: torch.Tensor,
        idx_mapping: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        temperature_gpu: torch.Tensor,
        seed_gpu: torch.Tensor,
        num_speculative_steps: int,
        idx_mapping_np: np.ndarray,
        cu_num_logits_np: np.ndarray,
        temperature_np: np.ndarray,
        seq_lens: torch.Tensor,
        prefill_len: torch.Tensor,
        top_k_gpu: torch.Tensor | None = None,
        top_k_np: np.ndarray | None = None,
        top_p_gpu: torch.Tensor | None = None,
        top_p_np: np.ndarray | None = None,
        min_p_gpu: torch.Tensor | None = None,
        min_p_np: np.ndarray | None = None,
        use_fp64_gumbel: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        rejection_sample_method: str = "standard",
        checks: bool = True,
    ) -> ChainOutput:
        """vLLM's answer for SOME requests of a step, from their logits rows only: exactly what
        :meth:`verify` on the whole step's logits gives for ``requests`` (per-request resolution:
        only these rows need to cross the TP ranks).

        Every decision vLLM takes per chunk is taken from the WHOLE chunk the request sits in
        (``_verify_in_chunks`` on the step's ``cu_num_logits_np``): the fp32 copy or the raw
        tensor, the temperature / min-p launches, whether top-k / top-p rows are passed, 0.33's
        ``has_topp_only_rows``, and the top-p pipeline with its split count (the chunk's row
        count). Everything else vLLM computes is a function of one row (stats, LSE, masks) or one
        request (acceptance, keyed Gumbel of ``(seed, pos, token)``), so a row verified apart
        gets the bits it gets inside its step (checked against :meth:`verify` by
        ``tests/test_resolve.py``: on the CPU with mixed greedy / temperature / top-p requests
        and several chunks; on the H200 with realistic T = 1 / top-p 0.95 steps over both
        top-p pipelines -- top-k, min-p, synthetic and fp64 rows on the CPU only).

        Args:
            rows_logits: ``[m, V]`` the logits rows of ``requests`` in step order (the rows
                ``cu[r]:cu[r+1]`` of each), in the layout ``compute_logits`` gives them (any
                row stride, ``stride(-1) == 1``), model dtype.
            requests: int ``[n]`` step request indices, strictly increasing (host).
            everything else: the WHOLE step's arguments, as :meth:`verify` takes them.

        Returns:
            :class:`ChainOutput` of the ``n`` requests: ``sampled [n, K + 1]``, ``num_sampled``,
            ``num_rejected`` ``[n]`` (after ``get_num_sampled_and_rejected``).

        Raises:
            ValueError / TypeError: ``requests`` not strictly increasing in ``[0, num_reqs)``,
                ``rows_logits`` not ``[m, V]`` for them; with ``checks`` (default), every check
                :meth:`verify` makes of the step's arguments (``checks=False``: the plug-in's
                call on vLLM's own tensors; wrong input is then undefined behaviour).
            NotImplementedError: as :meth:`verify`.
        """
        self._refuse_unsupported(
            None, rejection_sample_method, synthetic_conditional_rates, False, None, None
        )
        vocab = self._check_logits(rows_logits)
        device = rows_logits.device
        cu_np = np.asarray(cu_num_logits_np, dtype=np.int64)
        num_reqs = len(cu_np) - 1
        req = check_requests(requests, num_reqs)
        sizes = cu_np[1:] - cu_np[:-1]
        m = int(sizes[req].sum()) if req.size else 0
        if rows_logits.shape[0] != m:
            raise ValueError(
                f"rows_logits: expected the {m} logits rows of the {req.size} requests, got "
                f"{list(rows_logits.shape)}"
            )
        if checks:
            num_logits = draft_sampled.shape[0] if isinstance(draft_sampled, torch.Tensor) else -1
            state, slots, _ = self._check_step(
                device, vocab, num_logits, num_speculative_steps, draft_sampled, cu_num_logits,
                pos, idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature_gpu,
                seed_gpu, idx_mapping_np, cu_num_logits_np, temperature_np, seq_lens,
                prefill_len, top_k_gpu, top_k_np, top_p_gpu, top_p_np, min_p_gpu, min_p_np,
                synthetic_conditional_rates,
            )  # fmt: skip
        else:
            state = NativeChain._State(
                temperature_gpu, temperature_np, top_k_gpu, top_k_np, top_p_gpu, top_p_np,
                min_p_gpu, min_p_np,
            )  # fmt: skip
            slots = idx_mapping_np
        k = num_speculative_steps
        if req.size == 0:
            empty = torch.empty((0, k + 1), dtype=torch.int64, device=device)
            zero = torch.empty((0,), dtype=torch.int32, device=device)
            return ChainOutput(empty, zero, zero.clone())
        row_of = np.concatenate([np.arange(cu_np[r], cu_np[r + 1]) for r in req])
        sub_cu_np = np.concatenate([[0], np.cumsum(sizes[req])])
        parts = []
        limit = self.max_chunk_rows or max_chunk_logits(vocab)
        for start, end in request_chunks(cu_np, limit):
            sel = np.flatnonzero((req >= start) & (req < end))  # positions in `requests`
            if sel.size == 0:
                continue
            lo, hi = int(sub_cu_np[sel[0]]), int(sub_cu_np[sel[-1] + 1])
            rows_t = stage(row_of[lo:hi], device)
            chunk_cu = stage(sub_cu_np[sel[0] : sel[-1] + 2] - lo, device).to(cu_num_logits.dtype)
            gates = self._gates(
                np.asarray(slots[start:end]), state, vocab, int(cu_np[end] - cu_np[start])
            )
            parts.append(
                _Chunk(
                    rows_logits[lo:hi],
                    draft_sampled[rows_t],
                    chunk_cu,
                    pos[rows_t],
                    idx_mapping[stage(req[sel], device)],
                    expanded_idx_mapping[rows_t],
                    expanded_local_pos[rows_t],
                    gates,
                )
            )
        req_t = stage(req, device)
        sub_cu = stage(sub_cu_np, device).to(cu_num_logits.dtype)
        return self._rejection(
            parts, state, vocab, k, temperature_gpu, seed_gpu, synthetic_conditional_rates,
            use_fp64_gumbel, seq_lens[req_t], sub_cu, idx_mapping[req_t], prefill_len,
        )  # fmt: skip

    # ---- internals ------------------------------------------------------------------------

    @staticmethod
    def _refuse_unsupported(
        draft_logits: Any,
        method: str,
        synthetic: Any,
        processing: bool,
        num_logprobs: int | None,
        watermark_key: int | None,
    ) -> None:
        if draft_logits is not None:
            raise NotImplementedError("draft_logits: the native chain covers one-hot drafts only")
        if method in ("block", "fly"):
            raise NotImplementedError(f"rejection_sample_method={method!r} is not supported")
        if method not in ("standard", "synthetic"):
            raise ValueError(
                f"rejection_sample_method: {method!r}, expected 'standard' or 'synthetic'"
            )
        if (method == "synthetic") != (synthetic is not None):
            raise ValueError(
                "synthetic_conditional_rates: given exactly when rejection_sample_method is "
                f"'synthetic' (method {method!r}, rates {'set' if synthetic is not None else 'None'})"
            )
        if processing:
            raise NotImplementedError(f"{_UNSUPPORTED_PROCESSING} are not supported")
        if num_logprobs is not None:
            raise NotImplementedError("logprobs are not supported by the native chain")
        if watermark_key is not None:
            raise NotImplementedError("watermarking is not supported by the native chain")

    @staticmethod
    def _check_logits(logits: Any) -> int:
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
        ok = (torch.bfloat16, torch.float16, torch.float32)
        if logits.dim() != 2 or logits.dtype not in ok or logits.shape[1] < 1:
            raise ValueError(
                f"logits: expected a 2-D bf16/fp16/fp32 tensor [num_logits, V], got "
                f"{logits.dtype} {list(logits.shape)} on {logits.device}"
            )
        if logits.shape[1] > 1 and logits.stride(1) != 1:
            raise ValueError(
                f"logits: vLLM's kernels need stride(-1) == 1, got strides {logits.stride()}"
            )
        return int(logits.shape[1])

    @staticmethod
    def _slots(idx_mapping_np: Any, num_reqs: int, max_reqs: int) -> np.ndarray:
        slots = _array("idx_mapping_np", idx_mapping_np, num_reqs, "iu")
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= max_reqs):
            raise ValueError(
                f"idx_mapping_np: slots must lie in [0, {max_reqs}), got "
                f"[{int(slots.min())}, {int(slots.max())}]"
            )
        return slots

    @dataclass(frozen=True)
    class _State:
        temperature_gpu: torch.Tensor
        temperature_np: np.ndarray
        top_k_gpu: torch.Tensor | None
        top_k_np: np.ndarray | None
        top_p_gpu: torch.Tensor | None
        top_p_np: np.ndarray | None
        min_p_gpu: torch.Tensor | None
        min_p_np: np.ndarray | None

    def _sampling_state(
        self,
        vocab: int,
        device: torch.device,
        temperature_gpu: Any,
        temperature_np: Any,
        top_k_gpu: Any,
        top_k_np: Any,
        top_p_gpu: Any,
        top_p_np: Any,
        min_p_gpu: Any,
        min_p_np: Any,
    ) -> NativeChain._State:
        if not isinstance(temperature_gpu, torch.Tensor) or temperature_gpu.dim() != 1:
            raise ValueError("temperature_gpu: expected a 1-D fp32 tensor [max_num_reqs]")
        max_reqs = temperature_gpu.shape[0]
        _tensor("temperature_gpu", temperature_gpu, (torch.float32,), (max_reqs,), device)
        t_np = _array("temperature_np", temperature_np, max_reqs, "iuf")
        if bool((~(t_np >= 0)).any()):
            raise ValueError("temperature_np: temperatures must be >= 0 and not NaN")
        pairs = {
            "top_k": (top_k_gpu, top_k_np, torch.int32, "iu"),
            "top_p": (top_p_gpu, top_p_np, torch.float32, "iuf"),
            "min_p": (min_p_gpu, min_p_np, torch.float32, "iuf"),
        }
        got: dict[str, Any] = {}
        for name, (gpu, host, dtype, kind) in pairs.items():
            if (gpu is None) != (host is None):
                raise ValueError(
                    f"{name}_gpu / {name}_np: give both (device tensor and its host copy) or neither"
                )
            if gpu is not None:
                _tensor(f"{name}_gpu", gpu, (dtype,), (max_reqs,), device)
                _array(f"{name}_np", host, max_reqs, kind)
            got[name] = (gpu, host)
        k_np, p_np, m_np = got["top_k"][1], got["top_p"][1], got["min_p"][1]
        if k_np is not None and bool(((k_np < 1) | (k_np > vocab)).any()):
            raise ValueError(
                f"top_k_np: expected SamplingStates' values 1..V = 1..{vocab} (V = off), got "
                f"[{int(k_np.min())}, {int(k_np.max())}]"
            )
        if p_np is not None and bool((~((p_np > 0) & (p_np <= 1))).any()):
            raise ValueError("top_p_np: expected values in (0, 1] (1 = off)")
        if m_np is not None and bool((~((m_np >= 0) & (m_np <= 1))).any()):
            raise ValueError("min_p_np: expected values in [0, 1] (0 = off)")
        return NativeChain._State(
            temperature_gpu, t_np, got["top_k"][0], k_np, got["top_p"][0], p_np,
            got["min_p"][0], m_np,
        )  # fmt: skip

    @dataclass(frozen=True)
    class _Gates:
        """``apply_sampling_params``' host decisions for one chunk (read from its slots)."""

        processed: bool  # an fp32 copy is processed (else the raw chunk is verified)
        scale: bool  # apply_temperature launches (some T not in {0, 1})
        min_p: bool  # apply_min_p launches
        do_k: bool  # top-k rows passed to apply_top_k_top_p
        do_p: bool  # top-p rows passed
        only_p: bool  # 0.33's has_topp_only_rows
        rows: int  # logits rows of the chunk (vLLM's top-p pipeline depends on it)

    @staticmethod
    def _gates(slots: np.ndarray, st: NativeChain._State, vocab: int, rows: int) -> _Gates:
        """The gates of a chunk whose requests sit in ``slots`` (``SamplingStates`` rules)."""
        t = st.temperature_np[slots]
        top_k = st.top_k_np[slots] if st.top_k_np is not None else None
        top_p = st.top_p_np[slots] if st.top_p_np is not None else None
        min_p = st.min_p_np[slots] if st.min_p_np is not None else None
        # SamplingStates.add_request's needs-processing rule (no logits processor, no budget)
        other = t != 1.0
        if min_p is not None:
            other = other | (min_p != 0.0)
        if top_k is not None:
            other = other | (top_k != vocab)
        if top_p is not None:
            other = other | (top_p != 1.0)
        processed = bool(np.any((t != 0.0) & other))
        do_k = top_k is not None and bool(np.any(top_k != vocab))
        do_p = top_p is not None and bool(np.any(top_p != 1.0))
        only_p = bool(
            do_p
            and top_p is not None
            and np.any(((top_k >= vocab) if top_k is not None else True) & (top_p < 1.0))
        )
        return NativeChain._Gates(
            processed=processed,
            # SamplingStates.apply_temperature: no launch when every T is 0 or 1
            scale=not bool(np.all((t == 0.0) | (t == 1.0))),
            # SamplingStates.apply_min_p: no launch when nobody uses min-p
            min_p=min_p is not None and not bool(np.all(min_p == 0.0)),
            do_k=do_k,
            do_p=do_p,
            only_p=only_p,
            rows=rows,
        )

    def _process_chunk(
        self,
        chunk: torch.Tensor,
        eim: torch.Tensor,
        st: NativeChain._State,
        vocab: int,
        gates: NativeChain._Gates,
    ) -> torch.Tensor:
        """``Sampler.apply_sampling_params`` (0.32 / 0.33, identical) with the chunk's ``gates``
        (:meth:`_gates` of the chunk's slots, as ``SamplingStates`` reads them; for some
        requests of a chunk, :meth:`verify_requests`, the whole chunk's)."""
        if not gates.processed:
            self.last_pipelines.append("none")
            return chunk
        x = torch.empty_like(chunk, dtype=torch.float32).copy_(chunk)
        if gates.scale:
            self.modules.gumbel.apply_temperature(x, eim, st.temperature_gpu)
        if gates.min_p:
            self.modules.min_p.apply_min_p(x, eim, st.min_p_gpu)
        # SamplingStates.get_top_k_top_p (0.33 adds has_topp_only_rows)
        k_rows = st.top_k_gpu[eim] if gates.do_k and st.top_k_gpu is not None else None
        p_rows = st.top_p_gpu[eim] if gates.do_p and st.top_p_gpu is not None else None
        pipeline = self.topp_pipeline_for(
            gates.rows,
            top_k_active=gates.do_k,
            top_p_active=gates.do_p,
            has_topp_only_rows=gates.only_p,
            device_type=x.device.type,
        )
        self.last_pipelines.append(pipeline)
        if k_rows is None and p_rows is None:
            return x
        return self._top_k_top_p(x, k_rows, p_rows, gates.only_p, gates.rows, pipeline, vocab)

    def _top_k_top_p(
        self,
        x: torch.Tensor,
        k: torch.Tensor | None,
        p: torch.Tensor | None,
        only_p: bool,
        chunk_rows: int,
        pipeline: Pipeline,
        vocab: int,
    ) -> torch.Tensor:
        """``apply_top_k_top_p`` (vLLM's ``HAS_TRITON`` branch) -> ``apply_top_k_top_p_triton``.

        ``x`` may hold only some rows of a chunk of ``chunk_rows`` rows: each row's mask is a
        function of the row, of the pipeline and, in the split pipeline, of the slice count
        ``S(rows, V, #SMs)`` -- so the split pipeline runs on ``x`` padded to ``chunk_rows`` rows
        (zeros, top-k off, top-p 1: rows no kernel masks), and a chunk of more rows than vLLM's
        split threshold keeps the monolithic kernel for fewer rows (split threshold 0 for the
        call, as with ``topp_pipeline="monolithic"``)."""
        mod = self.modules.topk_topp
        kwargs = {"has_topp_only_rows": only_p} if self.passes_has_topp_only_rows else {}
        rows = x.shape[0]
        pad = chunk_rows - rows if "split" in pipeline else 0
        if pad > 0:
            x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
            if k is not None:
                k = torch.cat([k, k.new_full((pad,), vocab)])
            if p is not None:
                p = torch.cat([p, p.new_ones((pad,))])
        with contextlib.ExitStack() as stack:
            if self._interpreted:
                stack.enter_context(_interpreter_loop_tensors())
            if self.topp_pipeline == "monolithic" or chunk_rows > mod._SPLIT_MAX_BATCH:
                # vLLM's own call on the chunk does not use the split pipeline (nor sets
                # SPLIT_COVERS_PONLY): keep it so for fewer rows
                stack.enter_context(_module_value(mod, "_SPLIT_MAX_BATCH", 0))
            out = mod.apply_top_k_top_p_triton(x, k, p, **kwargs)
        return out[:rows] if pad > 0 else out


@contextlib.contextmanager
def _module_value(mod: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, old)
