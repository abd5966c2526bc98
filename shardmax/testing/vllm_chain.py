"""vLLM's native verification chain on extracted kernel trees: the oracle of the tests and
benchmarks, one :class:`NativeChain` per vLLM version whose tree ``scripts/vllm_kernels.sh``
extracted (``.vllm-kernels/<version>``), each tree imported on its own
(:func:`shardmax.testing.vllm_oracle.import_tree`) so 0.32 and 0.33 live side by side in one
process. The chain itself -- what it reproduces of vLLM and how -- is
:mod:`shardmax.integrations.vllm.chain` (also the plug-in's per-request resolver); this module
adds finding and loading the trees and :func:`verify_inputs`, the chain's arguments from a test
batch.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardmax.integrations.vllm import chain as _chain
from shardmax.integrations.vllm.chain import (
    MODULES,
    ChainModules,
    ChainOutput,
    Launch,
    _interpreter_loop_tensors,
    installed_chain,
    max_chunk_logits,
    request_chunks,
)
from shardmax.testing.vllm_oracle import _version_key, import_tree, kernel_trees, tree_version

__all__ = [
    "MODULES",
    "ChainModules",
    "ChainOutput",
    "Launch",
    "NativeChain",
    "_interpreter_loop_tensors",
    "chain_trees",
    "installed_chain",
    "load_chain",
    "max_chunk_logits",
    "request_chunks",
    "verify_inputs",
]


def chain_trees(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The kernel trees (:func:`shardmax.testing.vllm_oracle.kernel_trees`) that hold the chain's
    modules (extracted by a ``scripts/vllm_kernels.sh`` that knows them), in version order."""
    out = []
    for tree in kernel_trees(root):
        if all((tree / (m.replace(".", "/") + ".py")).is_file() for m in MODULES.values()):
            out.append(tree)
    return out


_LOADED: dict[str, ChainModules] = {}
_LOAD_LOCK = threading.Lock()


def load_chain(tree: str | os.PathLike[str]) -> ChainModules:
    """The chain modules of one tree, imported once per process (its own copy, apart from
    :func:`shardmax.testing.vllm_oracle.load_tree`'s).

    Raises:
        ImportError: a module is missing from the tree or does not import (named).
    """
    root = str(Path(tree).resolve())
    with _LOAD_LOCK:
        got = _LOADED.get(root)
        if got is None:
            mods = import_tree(root, tuple(MODULES.values()))
            got = ChainModules(tree_version(root), root, **{k: mods[m] for k, m in MODULES.items()})
            _LOADED[root] = got
    return got


class NativeChain(_chain.NativeChain):
    """:class:`shardmax.integrations.vllm.chain.NativeChain`, loadable from extracted trees."""

    @classmethod
    def load(cls, tree: str | os.PathLike[str], **options: Any) -> NativeChain:
        """The chain of one tree (:func:`load_chain`); ``options`` as the constructor's."""
        return cls(load_chain(tree), **options)

    @classmethod
    def discover(
        cls, root: str | os.PathLike[str] | None = None, **options: Any
    ) -> list[NativeChain]:
        """One chain per vLLM version whose tree holds the chain's modules (:func:`chain_trees`
        under ``root``, default ``$SHARDMAX_VLLM_KERNELS`` or ``<repo>/.vllm-kernels``), oldest
        first; a tree that does not import is left out (its error printed). An installed vLLM is
        not used (extract it with ``scripts/vllm_kernels.sh``)."""
        found: list[NativeChain] = []
        for tree in chain_trees(root):
            try:
                found.append(cls.load(tree, **options))
            except Exception as e:
                print(f"[vllm_chain] chain of {tree} does not load: {e!r}", file=sys.stderr)
        return sorted(found, key=lambda c: _version_key(c.version))


# --------------------------------------------------------------------------------------------
# arguments from a test batch
# --------------------------------------------------------------------------------------------


def _slot_tensor(t: torch.Tensor | None, default: float, n: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
    if t is None:
        return torch.full((n,), default, dtype=dtype, device=device)
    return t.to(device=device, dtype=dtype)


def verify_inputs(
    batch: Any,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every argument of :meth:`NativeChain.verify` but ``logits``, from a vLLM-layout batch
    (:class:`shardmax.testing.VerifyBatch`, :class:`shardmax.testing.traffic.TrafficBatch`, or any
    object with their fields): ``chain.verify(batch.logits, **verify_inputs(batch))``.

    Per-slot sampling tensors come from the keyword arguments, else from the batch's fields of the
    same name (``temperature`` is required one way or the other), and are stored as vLLM's
    ``SamplingStates`` stores them: fp32 temperature / top-p / min-p, int32 top-k with
    ``k <= 0`` or ``k > V`` -> V (``add_request``); unset = off (top-k V, top-p 1, min-p 0, then
    left out when off everywhere). ``expanded_idx_mapping`` is ``idx_mapping`` repeated per
    logits row; the host copies are read here (device syncs: call it once per batch, outside any
    timed region). Without ``seq_lens`` / ``prefill_len`` in the batch nobody is prefilling
    (``seq_lens`` = each request's last position + 1, ``prefill_len`` = 0).

    Raises:
        ValueError: no temperature, or a sampling tensor that is not 1-D of ``max_num_reqs``.
    """
    logits = batch.logits
    device = logits.device
    vocab = int(logits.shape[1])
    cu = batch.cu_num_logits.to(device)
    idx = batch.idx_mapping.to(device)
    max_reqs = int(batch.seed.shape[0])
    temp = temperature if temperature is not None else getattr(batch, "temperature", None)
    if temp is None:
        raise ValueError("verify_inputs: no temperature (pass temperature= or a batch with one)")
    chosen = {
        "top_k": top_k if top_k is not None else getattr(batch, "top_k", None),
        "top_p": top_p if top_p is not None else getattr(batch, "top_p", None),
        "min_p": min_p if min_p is not None else getattr(batch, "min_p", None),
        "temperature": temp,
    }
    for name, t in chosen.items():
        if t is not None and tuple(t.shape) != (max_reqs,):
            raise ValueError(
                f"verify_inputs: {name} must be 1-D [max_num_reqs = {max_reqs}], got "
                f"{list(t.shape)}"
            )
    temp_gpu = _slot_tensor(temp, 0.0, max_reqs, torch.float32, device)
    k_t = chosen["top_k"]
    k_gpu = _slot_tensor(k_t, vocab, max_reqs, torch.int64, device)
    k_gpu = torch.where((k_gpu <= 0) | (k_gpu > vocab), vocab, k_gpu).to(torch.int32)
    p_gpu = _slot_tensor(chosen["top_p"], 1.0, max_reqs, torch.float32, device)
    m_gpu = _slot_tensor(chosen["min_p"], 0.0, max_reqs, torch.float32, device)
    cu_np = cu.cpu().numpy()
    counts = torch.from_numpy(np.diff(cu_np.astype(np.int64))).to(device)
    eim = torch.repeat_interleave(idx.to(torch.int64), counts).to(torch.int32)
    seq_lens = getattr(batch, "seq_lens", None)
    prefill = getattr(batch, "prefill_len", None)
    if seq_lens is None or prefill is None:
        last = cu[1:].to(torch.int64) - 1
        seq_lens = (batch.pos.to(device)[last] + 1).to(torch.int32)
        prefill = torch.zeros(max_reqs, dtype=torch.int32, device=device)
    out: dict[str, Any] = {
        "draft_sampled": batch.draft_sampled.to(device),
        "cu_num_logits": cu,
        "pos": batch.pos.to(device),
        "idx_mapping": idx,
        "expanded_idx_mapping": eim,
        "expanded_local_pos": batch.expanded_local_pos.to(device),
        "temperature_gpu": temp_gpu,
        "seed_gpu": batch.seed.to(device=device, dtype=torch.int64),
        "num_speculative_steps": int(batch.num_speculative_steps),
        "idx_mapping_np": idx.cpu().numpy(),
        "cu_num_logits_np": cu_np,
        "temperature_np": temp_gpu.cpu().numpy(),
        "seq_lens": seq_lens.to(device),
        "prefill_len": prefill.to(device),
    }
    for name, gpu in (("top_k", k_gpu), ("top_p", p_gpu), ("min_p", m_gpu)):
        if chosen[name] is not None:
            out[f"{name}_gpu"] = gpu
            out[f"{name}_np"] = gpu.cpu().numpy()
    rates = getattr(batch, "synthetic_conditional_rates", None)
    if rates is not None:
        out["synthetic_conditional_rates"] = rates.to(device)
        out["rejection_sample_method"] = "synthetic"
    return out
