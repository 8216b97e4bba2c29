"""``ring-relay``: a relay ring with selective K/V (paper §3.3, §5.1's conventional routing).

Hop k = 1..G−1 into rank r carries the blocks of origin p = (r−k) mod G that *any* consumer
still downstream on the ring (r, r+1, …, p−1) needs, per head: a relay forwards blocks it does
not use itself. This is the ablation's "direct routing off"; its bytes equal the ``relay``
byte rule and exceed ``sparsp``'s as G grows (Figure 5).

Every rank must know everyone's demand to cut what it forwards; it derives it from the call's
whole mask (``Call.demand``), with no exchange.
"""

from __future__ import annotations

import torch

from ..packing import halves, pack
from .call import Call
from .registry import register_strategy


def _carried(call: Call, k: int, into: int) -> torch.Tensor:
    """bool [B·H, n_origin]: what hop k into rank ``into`` carries — origin (into−k)'s blocks
    that any of into, into+1, …, origin−1 needs."""
    G = call.world
    origin = (into - k) % G
    want = call.need((origin + k) % G, origin).clone()
    for j in range(k + 1, G):
        want |= call.need((origin + j) % G, origin)
    return want


def plan(call: Call) -> dict:
    r, G = call.rank, call.world
    out = {}
    for k in range(1, G):
        nxt = (r + 1) % G
        out[("send", k)] = (_carried(call, k, nxt), (nxt - k) % G)
        out[("recv", k)] = (_carried(call, k, r), (r - k) % G)
    return out


@register_strategy("ring-relay", sparse=True, placement="periodic", byte_rule="relay", plan=plan, local_first=True,
                   color="C4", ablation=(("periodic", "nccl", "+periodic, relay routing"),),
                   description="each hop carries the blocks any downstream consumer still needs "
                               "(§3.3, 'direct routing off')")
def run(call: Call) -> None:
    r, G, sh = call.rank, call.world, call.shapes
    t = call.transport
    D = call.q.shape[-1]
    nxt, prv = (r + 1) % G, (r - 1) % G
    bufs = call.payload_buffers(2)
    cur, cur_lay, cur_origin = None, None, r  # what this rank holds (and forwards a subset of)
    for k in range(1, G):
        with call.side(k == 1):  # the first hop beside the local kernel (Call.side)
            send = call.layouts[("send", k)]  # hop k out of r is hop k into r+1
            buf = t.send_buffer(nxt, send.num_rows * 2 * D, call.q.dtype)
            if send.num_rows:
                if k == 1:
                    call.pack_local(send, buf)
                else:
                    pack(*halves(cur, cur_lay, D), send, sh.heads, buf, source=cur_lay)
            t.publish(nxt, buf)
            recv = call.layouts[("recv", k)]
            nbuf = bufs[k % 2]
            handle = call.fetch(prv, nbuf[: recv.num_rows * 2 * D])
        if cur is None:
            call.attend_local()  # overlaps the hop in flight
        else:
            call.attend(cur, cur_lay, cur_origin)
        handle.wait()
        t.release(prv)
        cur, cur_lay, cur_origin = nbuf, recv, (r - k) % G
    if cur is None:
        call.attend_local()  # G == 1
    else:
        call.attend(cur, cur_lay, cur_origin)
