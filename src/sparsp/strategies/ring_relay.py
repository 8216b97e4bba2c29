"""``ring-relay``: a relay ring with selective K/V (paper §3.3, §5.1's conventional routing).

Hop k = 1..G−1 into rank r carries the blocks of origin p = (r−k) mod G that *any* consumer
still downstream on the ring (r, r+1, …, p−1) needs, per head: a relay forwards blocks it does
not use itself. This is the ablation's "direct routing off"; its bytes equal
``demand.comm_bytes(..., "ring-relay")`` and exceed ``sparsp``'s as G grows (Figure 5).

Every rank must know everyone's demand to cut what it forwards, so demand is all-gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import halves, pack, wait
from .base import Call, flush


def _all_demand(call: Call) -> torch.Tensor:
    """Bool [G, B, H, total_blocks]: every rank's remote demand (own blocks excluded)."""
    sh = call.shapes
    need = call.mask.any(dim=2)
    need[..., sh.blocks_of(call.rank)] = False
    parts = [torch.empty_like(need, dtype=torch.uint8) for _ in range(sh.world_size)]
    wait(dist.all_gather(parts, need.to(torch.uint8), group=call.group, async_op=True),
         call.config.timeout_s, f"rank {call.rank}: demand all-gather")
    return torch.stack(parts).bool()


def run(call: Call) -> None:
    r, G, sh = call.rank, call.world, call.shapes
    t = call.transport
    D = call.q.shape[-1]
    heads = sh.heads
    nxt, prv = (r + 1) % G, (r - 1) % G
    need = _all_demand(call) if G > 1 else None

    def carried(k: int, into: int):
        """Layout of hop k into rank ``into``: origin (into−k)'s blocks any of into..origin−1 need."""
        origin = (into - k) % G
        want = torch.zeros_like(need[0][..., sh.blocks_of(origin)])
        for j in range(k, G):
            want |= need[(origin + j) % G][..., sh.blocks_of(origin)]
        return call.layout_of(want, origin)

    local, local_buf = call.full_layout(r), call.payload_buffer()
    call.pack_local(local, local_buf)
    cur, cur_lay, cur_origin = local_buf, local, r  # what this rank holds (and forwards a subset of)
    for k in range(1, G):
        send = carried(k, nxt)  # hop k out of r is hop k into r+1
        if send.num_rows:
            buf = t.send_buffer(nxt, send.num_rows * 2 * D, call.q.dtype)
            if k == 1:
                call.pack_local(send, buf)
            else:
                pack(*halves(cur, cur_lay, D), send, heads, buf, source=cur_lay)
            t.publish(nxt, buf)
        recv = carried(k, r)
        nbuf = call.payload_buffer()
        handle = t.fetch(prv, nbuf[: recv.num_rows * 2 * D]) if recv.num_rows else None
        flush(t)
        call.attend(cur, cur_lay, cur_origin)  # overlaps the hop in flight
        if handle is not None:
            handle.wait()
            t.release(prv)
        cur, cur_lay, cur_origin = nbuf, recv, (r - k) % G
    call.attend(cur, cur_lay, cur_origin)
