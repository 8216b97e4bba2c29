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
from ..timing import phase_of
from .call import Call
from .registry import register_strategy


def exchange(transport, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]], *,
             fetch=None, phase=None) -> None:
    """For every peer p of ``transport``'s group, in rounds: each tensor of ``sends[p]`` to p,
    and each tensor of ``recvs[p]`` filled from p (the same count each way), one message per
    tensor. A contiguous destination is fetched into in place; another through a temporary.
    ``fetch``: the fetch to use (``Call.fetch``, timed; default the transport's); ``phase``:
    ``phase(name)`` times the packs (``Call.phase``; default untimed)."""
    r, G, t = transport.rank, transport.world_size, transport
    fetch = fetch or t.fetch
    phase = phase or (lambda name: phase_of(None, name))
    for k in range(1, G):
        dst, src = (r + k) % G, (r - k) % G
        for piece, into in zip(sends[dst], recvs[src], strict=True):
            with phase("pack"):
                buf = t.send_buffer(dst, piece.numel(), piece.dtype)
                buf.view(piece.shape).copy_(piece)
            t.publish(dst, buf)
            target = into if into.is_contiguous() else torch.empty(into.shape, dtype=into.dtype,
                                                                   device=into.device)
            fetch(src, target.view(-1)).wait()
            t.release(src)
            if target is not into:
                into.copy_(target)


def _exchange(call: Call, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
    """``exchange`` over the call's transport, its transfers and packs timed with the call's."""
    exchange(call.transport, sends, recvs, fetch=call.fetch, phase=call.phase)


def to_heads(xs: list[torch.Tensor], heads: list[slice], toks: list[slice], rank: int, move) -> list[torch.Tensor]:
    """Sequence shards to head shards: ``xs`` (B, S_rank, H, D) tensors of this rank's tokens
    ``toks[rank]`` with every head → the same tensors for every token (``toks`` in order, the
    last ending the sequence) of this rank's heads ``heads[rank]``. ``move(sends, recvs)``
    exchanges them (``exchange``): one message per tensor and peer, landing in place."""
    B, _, _, D = xs[0].shape
    hp = heads[rank].stop - heads[rank].start
    full = [torch.empty(B, toks[-1].stop, hp, D, dtype=x.dtype, device=x.device) for x in xs]
    for t, x in zip(full, xs):  # this rank's own tokens of its heads
        t[:, toks[rank]] = x[:, :, heads[rank]]
    peers = [p for p in range(len(toks)) if p != rank]
    move({p: [x[:, :, heads[p]] for x in xs] for p in peers}, {p: [t[:, toks[p]] for t in full] for p in peers})
    return full


def to_tokens(out: torch.Tensor, heads: list[slice], toks: list[slice], rank: int, move) -> torch.Tensor:
    """Head shards back to sequence shards (``to_heads`` undone): ``out`` (B, S, hp, D), every
    token of this rank's heads → (B, S_rank, H, D), this rank's tokens of every head."""
    B, _, _, D = out.shape
    final = torch.empty(B, toks[rank].stop - toks[rank].start, heads[-1].stop, D, dtype=out.dtype, device=out.device)
    final[:, :, heads[rank]] = out[:, toks[rank]]
    peers = [p for p in range(len(toks)) if p != rank]
    move({p: [out[:, toks[p]]] for p in peers}, {p: [final[:, :, heads[p]]] for p in peers})
    return final


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
    order = balanced_order(call.head_work, call.world)
    q, k, v, mask, back = ordered(order, call.q, call.k, call.v, call.full_mask)
    final = (_run_whole if _whole_blocks(call.shapes) else _run_slices)(call, q, k, v, mask)
    if back is not None:  # back to the caller's head order
        final = final.index_select(2, back)
    call.output.set_final(final)


def balanced_order(head_work: list[int] | None, ranks: int) -> tuple[int, ...] | None:
    """The head order by density (``cost.balance.balanced_heads`` of the kept work per head:
    rank r computes its r-th group), or None where it is the contiguous order or there is no
    work to balance by (a dense call)."""
    if head_work is None:
        return None
    order = balanced_heads(head_work, ranks)
    return None if order == contiguous_heads(len(head_work)) else order


def ordered(order: tuple[int, ...] | None, q, k, v, mask):
    """``q, k, v`` (heads on dim 2) and ``mask`` (heads on dim 1, or None) in ``order``, and
    the index that puts an output's heads back in the caller's order (None: ``order`` is None,
    nothing moves)."""
    if order is None:
        return q, k, v, mask, None
    idx, back = _orders(order, q.device)
    q, k, v = (x.index_select(2, idx) for x in (q, k, v))
    return q, k, v, None if mask is None else mask.index_select(1, idx), back


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
    move = lambda sends, recvs: _exchange(call, sends, recvs)  # noqa: E731
    full = to_heads([q, k, v], heads, toks, r, move)
    kv = LocalKV(full[1], full[2], bs)
    mask = (full_mask[:, heads[r]] if full_mask is not None else
            torch.ones(B, hp, kv.num_blocks, kv.num_blocks, dtype=torch.bool, device=q.device))
    with call.phase("compute"):
        kv_num, kv_idx = kernel_indices(mask, kv.block_ids(), kv.num_blocks)
        o, _ = call.kernel(full[0].permute(0, 2, 1, 3), kv, kv_num, kv_idx, scale=D**-0.5)
    # the kernel may return fp32 (the torch kernel on the CPU): the exchange sends q's dtype
    out = o.transpose(1, 2).to(q.dtype)  # (B, S, hp, D): every token of this rank's heads
    return to_tokens(out, heads, toks, r, move)


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
    return to_tokens(out, head_spans, toks, r, lambda sends, recvs: _exchange(call, sends, recvs))
