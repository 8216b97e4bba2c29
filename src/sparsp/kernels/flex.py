"""Block-sparse attention through ``torch.compile(flex_attention)`` (GPU backend).

All query heads read the ONE packed KV buffer directly: ``kv.k``/``kv.v`` are viewed as a
single KV head ``(1, 1, N, D)``, the queries as ``(1, B*H, Sq, D)`` with ``enable_gqa=True``,
and a per-head ``BlockMask`` of shape ``(1, B*H, nQ, W)`` names, for every query block, the
buffer blocks it reads. Nothing is scattered back into a dense ``(B, H, S, D)`` layout.

A ``BlockMask`` can only address aligned ``bs``-token blocks, so flex handles the first
``kv.num_aligned`` buffer blocks; ids of short tail blocks (which may sit at any offset) go
to the torch backend on just those entries, and the two partials are combined with the one
LSE merge.

Static shapes: every tensor handed to the compiled function has a shape fixed by the
geometry (``B*H``, ``Sq``, ``D``, the buffer capacity ``N``, ``bs``), never by the demand
pattern: a different selection changes only tensor *contents*, so ``torch.compile`` compiles
once per geometry (DESIGN "Design consequence for the flex kernel").

LSE base: the ``flex_attention`` frontend returns natural-log LSE (its kernel keeps log2
statistics and the frontend multiplies by ln 2 since PyTorch 2.5, pytorch#133159), which is
what ``torch_ref`` and the merge use, so no conversion is applied. The GPU tests check it.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import Tensor

from . import torch_ref
from .buffer import KVBuffer
from .merge import update_out_and_lse

__all__ = ["FLEX_AVAILABLE", "block_sparse_attention", "flex_available"]

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

    # Built once and reused (a fresh one per call does not recompile in torch 2.13 either,
    # but a constant argument keeps dynamo's guards trivially stable across versions).
    _AUX_LSE = AuxRequest(lse=True)
except ImportError:
    AuxRequest = None  # type: ignore[assignment,misc]
    _AUX_LSE = None

# Module-level cache: one compiled callable per process. ``dynamic=False`` specialises on
# shapes, which are static per geometry (see module docstring). ``fullgraph=True`` matters for
# correctness, not only speed: past dynamo's recompile limit (8 geometries per process by
# default, shared with any other user of flex_attention) a non-fullgraph function silently
# runs flex eagerly, and eager flex applies only ``mask_mod`` and ignores the block indices,
# i.e. it would compute DENSE attention. With fullgraph it raises instead.
_COMPILED: dict[str, Callable] = {}

# Inference only: skip building the transposed (q-side) indices, which the backward pass
# alone reads; for a packed buffer of all heads they are as large as a dense block mask.
_FORWARD_ONLY: dict = {}
if FLEX_AVAILABLE and "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
    _FORWARD_ONLY = {"compute_q_blocks": False}


def flex_available(device: torch.device | str) -> bool:
    """Whether this backend can run on ``device``.

    CUDA only: on CPU, ``torch.compile(flex_attention)`` refuses ``return_lse`` ("torch.compile
    on CPU only supports inference and `return_lse` is not supported yet", torch 2.13), and
    uncompiled flex ignores the block indices (it applies only ``mask_mod``).
    """
    return FLEX_AVAILABLE and torch.device(device).type == "cuda"


def _compiled_flex() -> Callable:
    fn = _COMPILED.get("flex_attention")
    if fn is None:
        fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        _COMPILED["flex_attention"] = fn
    return fn


def _flex_call(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float
) -> tuple[Tensor, Tensor]:
    """Run compiled flex: q ``(1, BH, Sq, D)``, k/v ``(1, 1, N, D)`` -> out, natural-log lse.

    Kept separate so CPU tests can substitute a dense emulation of the same ``BlockMask``.
    """
    fn = _compiled_flex()
    if _AUX_LSE is not None:
        out, aux = fn(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=_AUX_LSE
        )
        return out, aux.lse
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention with flex on aligned blocks and torch on short blocks.

    Args and semantics as ``torch_ref.block_sparse_attention``: q ``(B, H, Sq, D)``,
    kv_num_blocks int ``[B, H, nQ]``, kv_indices int ``[B, H, nQ, K]`` (buffer block ids,
    any order, duplicate-free), ``nQ = ceil(Sq / kv.block_size)``.

    Returns:
        ``out`` ``(B, H, Sq, D)`` in ``q.dtype`` and ``lse`` ``(B, H, Sq)`` float32, natural
        log. A query row with no selected block gets ``out = 0``, ``lse = -inf``.
    """
    if not FLEX_AVAILABLE:
        raise RuntimeError(f"flex_attention is not available in torch {torch.__version__}")
    n_q = torch_ref.check_inputs(q, kv, kv_num_blocks, kv_indices)
    B, H, Sq, D = q.shape
    bs, BH, N = kv.block_size, B * H, kv.capacity
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    slots = kv_indices.shape[-1]
    idx = kv_indices.to(device=q.device)
    used = torch.arange(slots, device=q.device) < kv_num_blocks.to(q.device).unsqueeze(-1)
    is_aligned = idx < kv.num_aligned

    out: Tensor | None = None
    lse: Tensor | None = None
    if kv.num_aligned > 0:
        # BlockMask sizes its dense scratch mask by the index width, so every id must be
        # below it: W = ceil(N / bs) fits any aligned id and depends only on the capacity.
        width = math.ceil(N / bs)
        if kv.num_blocks == kv.num_aligned:
            # Every id is aligned: use the lists as given, cut or zero-padded to W. Cutting is
            # safe because duplicate-free counts are <= num_aligned <= W; slots past a count
            # are ignored by from_kv_blocks whatever they hold.
            a_num = kv_num_blocks.to(device=q.device, dtype=torch.int32).reshape(1, BH, n_q)
            a_idx = idx.to(torch.int32).reshape(1, BH, n_q, slots)[..., :width]
            a_idx = torch.nn.functional.pad(a_idx, (0, width - a_idx.shape[-1])).contiguous()
        else:
            a_num, a_idx = torch_ref.compact_indices(
                (used & is_aligned).reshape(1, BH, n_q, slots),
                idx.reshape(1, BH, n_q, slots),
                width,
            )
        block_mask = BlockMask.from_kv_blocks(
            a_num, a_idx, BLOCK_SIZE=bs, seq_lengths=(Sq, N), **_FORWARD_ONLY
        )
        f_out, f_lse = _flex_call(
            q.reshape(1, BH, Sq, D), kv.k.view(1, 1, N, D), kv.v.view(1, 1, N, D),
            block_mask, scale,
        )
        # Pin the documented empty-row result (out 0, lse -inf) instead of relying on the
        # kernel's handling of rows whose loop never runs; cheap, elementwise, no sync.
        empty = (a_num == 0).reshape(B, H, n_q).repeat_interleave(bs, dim=-1)[..., :Sq]
        lse = torch.where(empty, float("-inf"), f_lse.reshape(B, H, Sq).float())
        out = torch.where(empty.unsqueeze(-1), 0.0, f_out.reshape(B, H, Sq, D)).to(q.dtype)

    n_short = kv.num_blocks - kv.num_aligned
    if n_short > 0:
        # Few entries (at most one tail block per segment and peer), so the torch backend
        # on a compacted index list of width <= n_short is cheap. Both counts are Python
        # ints fixed by the geometry: no host sync to decide whether to run this.
        s_num, s_idx = torch_ref.compact_indices(used & ~is_aligned, idx, min(slots, n_short))
        s_out, s_lse = torch_ref.block_sparse_attention(q, kv, s_num, s_idx, scale=scale)
        if out is None:
            out, lse = s_out, s_lse
        else:
            out, lse = update_out_and_lse(out.float(), lse, s_out, s_lse)

    if out is None or lse is None:  # an empty buffer: nothing to attend
        return (
            torch.zeros_like(q),
            torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device),
        )
    return out.to(q.dtype), lse
