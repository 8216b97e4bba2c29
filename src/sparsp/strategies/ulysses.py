"""``ulysses``: all-to-all from sequence shards to head shards and back (SGLang/xDiT style).

Rank r receives Q, K, V of heads [r·H/G, (r+1)·H/G) for every token, runs the same sparse
kernel over the full sequence, and sends each rank the output of its tokens back. Its mask is
the call's whole mask (``plan.gather_metadata``) restricted to its heads, with the same
per-slice blocks as the other strategies, so all five agree. Bytes: 3 · (other tokens) · H/G ·
D in, (my tokens) · (other heads) · D back (the ``all-to-all`` byte rule).
"""

from __future__ import annotations

import torch

from ..kernels import KVBuffer, kernel_indices, update_out_and_lse
from ..packing import layout, pack
from .base import Call
from .registry import register_strategy


def _all_to_all(call: Call, pieces: dict[int, torch.Tensor], shapes_in: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """Send ``pieces[p]`` to every peer p, receive a tensor of ``shapes_in[p]`` from each."""
    r, G, t = call.rank, call.world, call.transport
    got = {}
    for k in range(1, G):
        dst, src = (r + k) % G, (r - k) % G
        buf = t.send_buffer(dst, pieces[dst].numel(), pieces[dst].dtype)
        buf.view(pieces[dst].shape).copy_(pieces[dst])
        t.publish(dst, buf)
        out = torch.empty(shapes_in[src], dtype=call.q.dtype, device=call.q.device)
        h = call.fetch(src, out.view(-1))
        h.wait()
        t.release(src)
        got[src] = out
    return got


@register_strategy("ulysses", sparse=True, heads_divisible=True, placement="contiguous",
                   byte_rule="all-to-all",
                   description="all-to-all of Q, K, V to head shards, output back; block-sparse "
                               "on the full sequence")
def run(call: Call) -> None:
    r, G, sh = call.rank, call.world, call.shapes
    B, H, D, bs = sh.batch, sh.heads, sh.head_dim, sh.block_size
    hp = H // G
    heads = slice(r * hp, (r + 1) * hp)
    qkv = torch.stack([call.q, call.k, call.v], dim=3)  # (B, S_r, H, 3, D)
    pieces = {p: qkv[:, :, p * hp:(p + 1) * hp].contiguous() for p in range(G) if p != r}
    got = _all_to_all(call, pieces, {p: (B, sh.seq_lens[p], hp, 3, D) for p in range(G) if p != r})
    got[r] = qkv[:, :, heads]
    q = torch.cat([got[p][:, :, :, 0] for p in range(G)], dim=1)  # (B, S, hp, D), rank order
    segments = torch.tensor(sh.seq_lens).cumsum(0).tolist()
    bounds = list(zip([0] + segments[:-1], segments))

    mask = None if call.full_mask is None else call.full_mask[:, heads]
    # Each slice's K/V packed once (slices may end in short blocks; a kernel call needs an
    # aligned K/V buffer), then one kernel call per (query slice, key slice).
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
    out = out.permute(0, 2, 1, 3).to(call.q.dtype)  # (B, S, hp, D)
    back = {p: out[:, bounds[p][0]:bounds[p][1]].contiguous() for p in range(G) if p != r}
    got = _all_to_all(call, back, {p: (B, sh.seq_lens[r], hp, D) for p in range(G) if p != r})
    got[r] = out[:, bounds[r][0]:bounds[r][1]]
    call.final = torch.cat([got[p] for p in range(G)], dim=2).contiguous()  # (B, S_r, H, D)
