"""Block-sparse attention through ``torch.compile(flex_attention)`` (portable GPU backend).

Calls outside flex's limits run the torch kernel instead, with one warning per reason
(``unsupported_reason``): a head dim below 16, and a block size that is not a multiple of
the tile that flex's compiled kernel picks for that head dim and dtype (found when the compile
refuses it, then remembered). Such calls are small (tiny test models, block sizes under 16).

Two K/V layouts:

- ``LocalKV`` (this rank's shard, ``(B, S, H, D)``): flex reads ``k.transpose(1, 2)`` in
  place, one K/V head per query head, with a ``(B, H, nQ, n)`` ``BlockMask`` of block indices
  within ``S``. A short last block is the end of each head's sequence; flex masks keys past
  ``S`` itself.
- ``KVBuffer`` (a packed payload, ONE buffer for all heads): the full blocks are viewed as a
  single shared K/V head ``(1, 1, N, D)``, the queries as ``(1, B*H, Sq, D)`` with
  ``enable_gqa=True``, and a per-head ``BlockMask`` names the buffer blocks each query block
  reads. Short blocks (at most one per row, all ``short_len`` long: the owner's tail) run as a
  second call over a per-head scratch ``(1, B*H, short_len, D)`` gathered with one
  ``index_select``, one block per query block; the two partials merge by LSE.

Compilation (docs/design.md "Kernels and transports"): every tensor shape handed to
flex is fixed by the geometry, never by the demand pattern, so new lists change only tensor
contents. Each geometry key (the kind of call, shapes, strides, dtype, block size, index
width) gets its OWN compiled entry function, a copy of ``_flex_entry`` with a distinct code
object: dynamo keeps its cache per code object, so each entry holds one graph and no number
of geometries in one process reaches the recompile limit (8 per code object by default; with
``fullgraph=True`` going past it raises, and without fullgraph flex would silently run eagerly,
i.e. densely, since eager flex ignores block indices).

LSE base: the ``flex_attention`` frontend returns natural-log LSE (its kernel keeps log2
statistics and the frontend multiplies by ln 2 since PyTorch 2.5, pytorch#133159), which is
what ``torch_ref`` and the merge use. The GPU tests check it.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
from typing import Callable

import torch
from torch import Tensor

from ..caches import per_geometry
from . import torch_ref
from .buffer import KVBuffer, fit_width, packed_result, split_lists
from .local import LocalKV
from .merge import fold

__all__ = ["FLEX_AVAILABLE", "block_sparse_attention", "compiled_entries", "dense", "flex_available",
           "unsupported_reason"]

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    FLEX_AVAILABLE = True
except ImportError:  # torch < 2.5
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]
    FLEX_AVAILABLE = False

try:
    # torch >= 2.9: ``return_lse`` is deprecated in favour of ``return_aux`` (same values).
    from torch.nn.attention.flex_attention import AuxRequest

    _AUX_LSE = AuxRequest(lse=True)  # one constant object: dynamo's guards stay trivial
except ImportError:
    AuxRequest = None  # type: ignore[assignment,misc]
    _AUX_LSE = None

# Inference only: skip building the transposed (q-side) indices, which the backward pass
# alone reads; for a packed buffer of all heads they are as large as a dense block mask.
_FORWARD_ONLY: dict = {}
if FLEX_AVAILABLE and "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
    _FORWARD_ONLY = {"compute_q_blocks": False}

# The torch.compile backend; CPU tests set "eager" (guards and graphs do not depend on it).
_BACKEND = "inductor"
# One compiled entry per geometry key (see the module docstring).
_COMPILED = per_geometry("kernels: compiled flex entries")  # key -> Callable
# (head dim, dtype, block size) whose compile flex refused: its tile does not divide the block
_REFUSED = per_geometry("kernels: block sizes flex refused")  # key -> reason
_MIN_HEAD_DIM = 16  # flex_attention's kernels take head dims from 16 up
_WARNED: set[str] = set()


def unsupported_reason(q: Tensor, block_size: int) -> str | None:
    """Why this call runs the torch kernel instead of flex, or ``None``."""
    D = q.shape[-1]
    if D < _MIN_HEAD_DIM:
        return f"head dim {D} (flex_attention takes {_MIN_HEAD_DIM} and more)"
    return _REFUSED.get((D, q.dtype, block_size))


def _refused(e: Exception) -> bool:
    """The compile error flex raises for a block size its tile does not divide."""
    return "must be divisible by BLOCK_M and BLOCK_N" in str(e)


def _instead(reason: str, q: Tensor, kv, kv_num_blocks: Tensor, kv_indices: Tensor,
             scale: float | None) -> tuple[Tensor, Tensor]:
    text = f"sparsp kernel 'flex': {reason}; running the torch kernel instead"
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    return torch_ref.block_sparse_attention(q, kv, kv_num_blocks, kv_indices, scale=scale)


def flex_available(device: torch.device | str) -> bool:
    """Whether this backend can run on ``device``.

    CUDA only: on CPU, ``torch.compile(flex_attention)`` refuses ``return_lse`` ("torch.compile
    on CPU only supports inference and `return_lse` is not supported yet", torch 2.13), and
    uncompiled flex ignores the block indices (it applies only ``mask_mod``).
    """
    return FLEX_AVAILABLE and torch.device(device).type == "cuda"


def compiled_entries() -> int:
    """How many geometry keys have a compiled entry in this process (tests, diagnostics)."""
    return len(_COMPILED)


def _flex_entry(q, k, v, block_mask, scale, enable_gqa):
    if _AUX_LSE is not None:
        out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                  enable_gqa=enable_gqa, return_aux=_AUX_LSE)
        return out, aux.lse
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          return_lse=True)


def _entry(key: tuple) -> Callable:
    fn = _COMPILED.get(key)
    if fn is None:
        # A distinct code object per key: dynamo's cache (and its recompile limit) is per code
        # object, so this entry only ever holds the graph of its own geometry.
        code = _flex_entry.__code__.replace(co_name=f"_flex_entry_{len(_COMPILED)}")
        fresh = types.FunctionType(code, _flex_entry.__globals__, code.co_name)
        fn = torch.compile(fresh, backend=_BACKEND, dynamic=False, fullgraph=True)
        _COMPILED[key] = fn
    return fn


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float,
               enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """Compiled flex on ``(B', Hq, Sq, D)`` queries and ``(B', Hk, Skv, D)`` keys -> out, lse.

    Kept separate so CPU tests can substitute a dense emulation of the same ``BlockMask``."""
    key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), q.dtype,
           q.device, block_mask.BLOCK_SIZE, tuple(block_mask.kv_indices.shape), enable_gqa)
    return _entry(key)(q, k, v, block_mask, scale, enable_gqa)


def _run(q: Tensor, k: Tensor, v: Tensor, num: Tensor, idx: Tensor, bs: int, scale: float,
         enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """One flex call with block lists ``num [B', Hq, nQ]``, ``idx [B', Hq, nQ, W]``; rows with
    no block get the documented empty result (out 0, lse -inf)."""
    Sq, Skv = q.shape[2], k.shape[2]
    block_mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=bs, seq_lengths=(Sq, Skv),
                                          **_FORWARD_ONLY)
    out, lse = _flex_call(q, k, v, block_mask, scale, enable_gqa)
    # Pin the empty-row result instead of relying on the kernel's handling of rows whose loop
    # never runs; cheap, elementwise, no sync.
    empty = (num == 0).repeat_interleave(bs, dim=-1)[..., :Sq]
    lse = torch.where(empty, float("-inf"), lse.float())
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    return out, lse


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer | LocalKV,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention with flex; semantics as ``torch_ref.block_sparse_attention``.

    Args: q ``(B, H, Sq, D)``; kv a ``KVBuffer`` or ``LocalKV``; kv_num_blocks int
    ``[B, H, nQ]``; kv_indices int ``[B, H, nQ, K]`` (any order, duplicate-free),
    ``nQ = ceil(Sq / kv.block_size)``. A packed buffer's lists may name at most one short
    block per row (``KVBuffer``'s rules).

    Returns:
        ``out`` ``(B, H, Sq, D)`` in ``q.dtype`` and ``lse`` ``(B, H, Sq)`` float32, natural
        log. A query row with no selected block gets ``out = 0``, ``lse = -inf``.
    """
    if not FLEX_AVAILABLE:
        raise RuntimeError(f"flex_attention is not available in torch {torch.__version__}")
    n_q = torch_ref.check_inputs(q, kv, kv_num_blocks, kv_indices)
    reason = unsupported_reason(q, kv.block_size)
    if reason is not None:
        return _instead(reason, q, kv, kv_num_blocks, kv_indices, scale)
    D = q.shape[-1]
    scaled = 1.0 / math.sqrt(D) if scale is None else float(scale)
    num = kv_num_blocks.to(device=q.device, dtype=torch.int32).contiguous()
    idx = kv_indices.to(device=q.device)
    try:
        if isinstance(kv, LocalKV):
            out, lse = _run(q, kv.k.transpose(1, 2), kv.v.transpose(1, 2), num,
                            fit_width(idx, kv.num_blocks), kv.block_size, scaled, False)
            return out.to(q.dtype), lse
        return _packed(q, kv, num, idx, n_q, scaled)
    except Exception as e:  # the compile's refusal is the only one handled: others propagate
        if not _refused(e):
            raise
        reason = _REFUSED[(D, q.dtype, kv.block_size)] = (
            f"block_size {kv.block_size} at head dim {D}, {q.dtype} (flex's tile does not divide it)")
        return _instead(reason, q, kv, kv_num_blocks, kv_indices, scale)


def _packed(q: Tensor, kv: KVBuffer, num: Tensor, idx: Tensor, n_q: int,
            scale: float) -> tuple[Tensor, Tensor]:
    B, H, Sq, D = q.shape
    BH, N, bs = B * H, kv.capacity, kv.block_size
    qf = q.reshape(1, BH, Sq, D)
    # The lists are padded to W = ceil(N / bs), a width fixed by the capacity alone (the
    # width the measured version of this backend used; flex reads only the used slots).
    split = split_lists(kv, num, idx, math.ceil(N / bs))
    out: Tensor | None = None
    lse: Tensor | None = None
    if kv.num_aligned > 0:
        out, lse = _run(qf, kv.k.view(1, 1, N, D), kv.v.view(1, 1, N, D),
                        split.num.reshape(1, BH, n_q), split.idx.reshape(1, BH, n_q, -1),
                        bs, scale, True)
    if split.rows is not None:
        length = split.rows.shape[1]
        rows = split.rows.reshape(-1)
        k_s = kv.k.index_select(0, rows).view(1, BH, length, D)
        v_s = kv.v.index_select(0, rows).view(1, BH, length, D)
        s_num = split.has_short.to(torch.int32).reshape(1, BH, n_q)
        s_idx = torch.zeros(1, BH, n_q, 1, dtype=torch.int32, device=q.device)
        s_out, s_lse = _run(qf, k_s, v_s, s_num, s_idx, bs, scale, False)
        out, lse = fold(out, lse, s_out, s_lse)
    return packed_result(q, out, lse)


def dense(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Dense compiled flex on ``(B, H, S, D)`` tensors (no block mask): the benchmark's dense
    baseline for this backend. Returns out and natural-log lse."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    key = ("dense", tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), q.dtype, q.device)
    return _entry(key)(q, k, v, None, scale, False)
