"""``ulysses``: all-to-all from sequence shards to head shards and back (SGLang/xDiT style).

Rank r receives Q, K, V of heads [r·H/G, (r+1)·H/G) for every token, runs the same sparse
kernel over the full sequence, and sends each rank the output of its tokens back. Its mask is
the call's whole mask (``plan.gather_metadata``) restricted to its heads, with the same
per-slice blocks as the other strategies, so all five agree. Bytes: 3 · (other tokens) · H/G ·
D in, (my tokens) · (other heads) · D back (the ``all-to-all`` byte rule).

Heads go to ranks by density: the heads of one layer differ in how much of the mask they keep
(real models: by an order of magnitude), and a rank that computes whole heads waits for the
densest group. Each call orders its heads by ``cost.balance.balanced_heads`` of their kept token pairs
(``cost.figures.head_pairs``, read on the host with the call's counts; every rank holds the same mask, so every rank derives
the same order): rank r computes the r-th group of that order. Attention per head is
independent, so the order changes which rank computes a head, not its output; where balancing
gains nothing the contiguous order (rank r: heads [r·H/G, (r+1)·H/G)) stays and no head moves.

When every slice but the last is a whole number of blocks (``sparsp.placement`` cuts at blocks),
the slices' blocks are the whole sequence's blocks: the received Q, K and V land in place in
full-sequence tensors (one message per tensor and peer), and ONE kernel call over the whole
sequence (``LocalKV``) gives the output, with no K/V packing and no merge. Otherwise each
slice's K/V is packed once and the kernel runs per (query slice, key slice), merged by LSE.
"""

from __future__ import annotations

import itertools

import torch

from ..caches import lru_get, per_geometry
from ..cost.balance import balanced_heads, contiguous_heads
from ..kernels import KVBuffer, LocalKV, kernel_indices, update_out_and_lse
from ..packing import layout, pack
from .call import Call
from .registry import register_strategy


def _exchange(call: Call, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
    """For every peer p, in rounds: each tensor of ``sends[p]`` to p, and each tensor of
    ``recvs[p]`` filled from p (the same count each way), one message per tensor. A
    contiguous destination is fetched into in place; another through a temporary."""
    r, G, t = call.rank, call.world, call.transport
    for k in range(1, G):
        dst, src = (r + k) % G, (r - k) % G
        for piece, into in zip(sends[dst], recvs[src], strict=True):
            with call.phase("pack"):
                buf = t.send_buffer(dst, piece.numel(), piece.dtype)
                buf.view(piece.shape).copy_(piece)
            t.publish(dst, buf)
            target = into if into.is_contiguous() else torch.empty(into.shape, dtype=into.dtype,
                                                                   device=into.device)
            call.fetch(src, target.view(-1)).wait()
            t.release(src)
            if target is not into:
                into.copy_(target)


def _spans(sh, G: int) -> tuple[list[slice], list[slice]]:
    """Each rank's heads (H/G each) and each rank's tokens in the whole sequence (rank order)."""
    hp = sh.heads // G
    ends = list(itertools.accumulate(sh.seq_lens))
    return ([slice(p * hp, (p + 1) * hp) for p in range(G)],
            [slice(a, b) for a, b in zip([0] + ends[:-1], ends)])


def _whole_blocks(sh) -> bool:
    """Every slice but the last is a whole number of blocks: the slices' blocks are then the
    blocks of the concatenated sequence."""
    return all(s % sh.block_size == 0 for s in sh.seq_lens[:-1])


_ORDERS = per_geometry("ulysses: head orders as index tensors")


@register_strategy("ulysses", sparse=True, heads_divisible=True, placement="contiguous",
                   byte_rule="all-to-all", color="C5",
                   description="all-to-all of Q, K, V to head shards, output back; block-sparse "
                               "on the full sequence")
def run(call: Call) -> None:
    H = call.shapes.heads
    order = None
    if call.head_work is not None:
        order = balanced_heads(call.head_work, call.world)
        order = None if order == contiguous_heads(H) else order
    q, k, v, mask = call.q, call.k, call.v, call.full_mask
    if order is not None:  # this call's heads in rank order: rank r computes the r-th group
        idx, back = _orders(order, q.device)
        q, k, v = (x.index_select(2, idx) for x in (q, k, v))
        mask = mask.index_select(1, idx)
    final = (_run_whole if _whole_blocks(call.shapes) else _run_slices)(call, q, k, v, mask)
    if order is not None:  # back to the caller's head order
        final = final.index_select(2, back)
    call.output.set_final(final)


def _orders(order: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A head order and its inverse as index tensors on ``device``, made once per order (a
    denoising loop's calls repeat their orders: no host-to-device copy per call)."""
    def make():
        idx = torch.tensor(order, device=device)
        return idx, torch.argsort(idx)

    return lru_get(_ORDERS, (order, str(device)), make, 256)


def _run_whole(call: Call, q, k, v, full_mask) -> torch.Tensor:
    """Q, K, V of this rank's heads for every token, landed in place; one kernel call. The
    output, (B, S_r, H, D) in the heads' order of ``q``."""
    r, G, sh = call.rank, call.world, call.shapes
    B, H, D, bs = sh.batch, sh.heads, sh.head_dim, sh.block_size
    hp = H // G
    heads, toks = _spans(sh, G)
    inputs = (q, k, v)
    full = [torch.empty(B, toks[-1].stop, hp, D, dtype=q.dtype, device=q.device) for _ in inputs]
    for t, x in zip(full, inputs):  # this rank's own tokens of its heads
        t[:, toks[r]] = x[:, :, heads[r]]
    _exchange(call, {p: [x[:, :, heads[p]] for x in inputs] for p in range(G) if p != r},
              {p: [t[:, toks[p]] for t in full] for p in range(G) if p != r})
    kv = LocalKV(full[1], full[2], bs)
    mask = (full_mask[:, heads[r]] if full_mask is not None else
            torch.ones(B, hp, kv.num_blocks, kv.num_blocks, dtype=torch.bool, device=q.device))
    with call.phase("compute"):
        kv_num, kv_idx = kernel_indices(mask, kv.block_ids(), kv.num_blocks)
        o, _ = call.kernel(full[0].permute(0, 2, 1, 3), kv, kv_num, kv_idx, scale=D**-0.5)
    # the kernel may return fp32 (the torch kernel on the CPU): the exchange sends q's dtype
    out = o.transpose(1, 2).to(q.dtype)  # (B, S, hp, D): every token of this rank's heads
    final = torch.empty(B, sh.seq_lens[r], H, D, dtype=q.dtype, device=q.device)
    final[:, :, heads[r]] = out[:, toks[r]]
    _exchange(call, {p: [out[:, toks[p]]] for p in range(G) if p != r},
              {p: [final[:, :, heads[p]]] for p in range(G) if p != r})
    return final


def _run_slices(call: Call, q, k, v, full_mask) -> torch.Tensor:
    """Slices that end in short blocks: each slice's K/V packed once, one kernel call per
    (query slice, key slice), merged by LSE. The output, as ``_run_whole``'s."""
    r, G, sh = call.rank, call.world, call.shapes
    B, H, D, bs = sh.batch, sh.heads, sh.head_dim, sh.block_size
    hp = H // G
    head_spans, toks = _spans(sh, G)
    heads = head_spans[r]
    dtype = q.dtype
    qkv = torch.stack([q, k, v], dim=3)  # (B, S_r, H, 3, D)
    got = {p: torch.empty(B, sh.seq_lens[p], hp, 3, D, dtype=dtype, device=q.device)
           for p in range(G) if p != r}
    _exchange(call, {p: [qkv[:, :, head_spans[p]]] for p in range(G) if p != r},
              {p: [got[p]] for p in got})
    got[r] = qkv[:, :, heads]
    q = torch.cat([got[p][:, :, :, 0] for p in range(G)], dim=1)  # (B, S, hp, D), rank order
    bounds = [(t.start, t.stop) for t in toks]

    mask = None if full_mask is None else full_mask[:, heads]
    kv = []
    for p, (c, d) in enumerate(bounds):
        n = sh.num_blocks[p]
        sel = torch.ones(B * hp, n, dtype=torch.bool, device=q.device)
        lay = layout(sel, d - c, bs, counts=(B * hp * n, B * hp if sh.has_tail(p) else 0))
        buf = torch.empty(lay.num_rows * 2 * D, dtype=q.dtype, device=q.device)
        pack(got[p][:, :, :, 1].contiguous(), got[p][:, :, :, 2].contiguous(), lay, hp, buf)
        kv.append((lay, KVBuffer.from_payload(buf, rows=lay.num_rows, block_start=lay.block_start,
                                              block_len=lay.block_len, num_aligned=lay.num_aligned,
                                              block_size=bs, head_dim=D)))
    out = torch.zeros(B, hp, q.shape[1], D, dtype=torch.float32, device=q.device)
    for pq, (a, b) in enumerate(bounds):
        q_hm = q[:, a:b].permute(0, 2, 1, 3).contiguous()
        acc_o = acc_l = None
        for pk, (lay, kvbuf) in enumerate(kv):
            if mask is None:
                rows = torch.ones(B, hp, sh.num_blocks[pq], sh.num_blocks[pk], dtype=torch.bool,
                                  device=q.device)
            else:
                rows = mask[:, :, sh.blocks_of(pq), sh.blocks_of(pk)]
            with call.phase("compute"):
                kv_num, kv_idx = kernel_indices(rows, lay.block_ids, sh.num_blocks[pk])
                o, l = call.kernel(q_hm, kvbuf, kv_num, kv_idx, scale=D**-0.5)
            with call.phase("merge"):
                acc_o, acc_l = update_out_and_lse(acc_o, acc_l, o, l)
        out[:, :, a:b] = acc_o
    out = out.permute(0, 2, 1, 3).to(dtype)  # (B, S, hp, D)
    final = torch.empty(B, sh.seq_lens[r], H, D, dtype=dtype, device=out.device)
    final[:, :, heads] = out[:, toks[r]]
    _exchange(call, {p: [out[:, toks[p]]] for p in range(G) if p != r},
              {p: [final[:, :, head_spans[p]]] for p in range(G) if p != r})
    return final
