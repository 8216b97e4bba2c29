"""``ulysses``: all-to-all from sequence shards to head shards and back (SGLang/xDiT style).

Rank r receives Q, K, V of heads [r·H/G, (r+1)·H/G) for every token, runs the same sparse
kernel over the full sequence, and sends each rank the output of its tokens back. The mask is
computed on the gathered sequence with the same per-slice blocks as the other strategies, so
all five agree. Bytes: 3 · (other tokens) · H/G · D in, (my tokens) · (other heads) · D back.
"""

from __future__ import annotations

import torch

from ..kernels.merge import update_out_and_lse
from ..masks import PooledBlocks, key_sum, pool_blocks, select_blocks
from ..plan import kernel_indices, layout, pack
from .base import Call, flush


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
        h = t.fetch(src, out.view(-1))
        flush(t)
        h.wait()
        t.release(src)
        got[src] = out
    return got


def run(call: Call) -> None:
    r, G, sh = call.rank, call.world, call.shapes
    B, H, D, bs = sh.batch, sh.heads, sh.head_dim, sh.block_size
    hp = H // G
    heads = slice(r * hp, (r + 1) * hp)
    qkv = torch.stack([call.q, call.k, call.v], dim=3)  # (B, S_r, H, 3, D)
    pieces = {p: qkv[:, :, p * hp:(p + 1) * hp].contiguous() for p in range(G) if p != r}
    got = _all_to_all(call, pieces, {p: (B, sh.seq_lens[p], hp, 3, D) for p in range(G) if p != r})
    got[r] = qkv[:, :, heads]
    full = torch.cat([got[p] for p in range(G)], dim=1)  # (B, S, hp, 3, D), rank order
    q, k, v = full.unbind(dim=3)
    segments = torch.tensor(sh.seq_lens).cumsum(0).tolist()
    bounds = list(zip([0] + segments[:-1], segments))

    mask = _mask(call, q, k, bounds, heads) if call.global_mask is None else call.global_mask[:, heads]
    out = torch.zeros(B, hp, q.shape[1], D, dtype=torch.float32, device=q.device)
    kernel = call.kernel
    # One kernel call per (query slice, key slice): slices may end in short blocks, and each
    # kernel call needs block-aligned queries and an aligned K/V buffer.
    for pq, (a, b) in enumerate(bounds):
        q_hm = q[:, a:b].permute(0, 2, 1, 3).contiguous()
        acc_o = acc_l = None
        for pk, (c, d) in enumerate(bounds):
            rows = mask[:, :, sh.blocks_of(pq), sh.blocks_of(pk)]
            if not rows.any():
                continue
            sel = torch.ones(B * hp, sh.num_blocks[pk], dtype=torch.bool, device=q.device)
            lay = layout(sel, d - c, bs)
            buf = torch.empty(lay.num_rows * 2 * D, dtype=q.dtype, device=q.device)
            pack(k[:, c:d].contiguous(), v[:, c:d].contiguous(), lay, hp, buf)
            kv_num, kv_idx = kernel_indices(rows, lay, sh.num_blocks[pk])
            o, l = kernel(q_hm, lay.buffer(buf, D), kv_num, kv_idx, scale=D**-0.5)
            acc_o, acc_l = update_out_and_lse(acc_o, acc_l, o, l)
        if acc_o is not None:  # else no query row of this slice reads a block: zeros
            out[:, :, a:b] = acc_o
    out = out.permute(0, 2, 1, 3).to(call.q.dtype)  # (B, S, hp, D)
    back = {p: out[:, bounds[p][0]:bounds[p][1]].contiguous() for p in range(G) if p != r}
    got = _all_to_all(call, back, {p: (B, sh.seq_lens[r], hp, D) for p in range(G) if p != r})
    got[r] = out[:, bounds[r][0]:bounds[r][1]]
    call.final = torch.cat([got[p] for p in range(G)], dim=2).contiguous()  # (B, S_r, H, D)


def _mask(call: Call, q, k, bounds, heads) -> torch.Tensor:
    """Block mask of my heads over the whole sequence, blocks cut per slice (as everywhere)."""
    if call.config.dense:
        n = call.shapes.total_blocks
        return torch.ones(q.shape[0], q.shape[2], n, n, dtype=torch.bool, device=q.device)
    bs = call.shapes.block_size
    center = key_sum(k) / k.shape[1]
    pq = PooledBlocks.cat([pool_blocks(q[:, a:b], bs) for a, b in bounds])
    pk = PooledBlocks.cat([pool_blocks(k[:, a:b], bs, center=center) for a, b in bounds])
    H = call.shapes.heads
    cdf = call.config.cdf_tensor(H)
    sim = call.config.sim_tensor(H)
    cdf = cdf[heads] if isinstance(cdf, torch.Tensor) else cdf
    sim = sim[heads] if isinstance(sim, torch.Tensor) else sim
    return select_blocks(pq, pk, cdf_threshold=cdf, sim_threshold=sim)
