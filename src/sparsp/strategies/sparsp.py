"""``sparsp``: demand-directed direct routing (paper §5).

Round k = 1..G−1: rank r sends to (r+k) mod G exactly the blocks that peer demands (per head,
packed row-major over (batch·head, block)) and fetches from (r−k) mod G exactly its own demand
D[r, ·, (r−k) mod G]. No block is relayed; bytes equal the ``direct`` byte rule. Both ends
derive both selections from the call's whole mask (``Call.need``), so no demand is exchanged.
Fetches run ``config.prefetch`` rounds ahead of the kernel, so transfers overlap compute; the
local shard is computed first, while the first payloads are in flight.
"""

from __future__ import annotations

from collections import deque

from .base import Call
from .registry import register_strategy


def plan(call: Call) -> dict:
    r, G = call.rank, call.world
    out = {}
    for k in range(1, G):
        dst, src = (r + k) % G, (r - k) % G
        out[("send", k)] = (call.need(dst, r), r)  # what dst demands of me
        out[("recv", k)] = (call.need(r, src), src)  # what I demand of src
    return out


@register_strategy("sparsp", sparse=True, placement="periodic", byte_rule="direct", plan=plan,
                   description="round k: exactly D[r,·,(r−k) mod G] from its owner, per head; "
                               "merged as payloads land")
def run(call: Call) -> None:
    r, G = call.rank, call.world
    t = call.transport
    D = call.q.shape[-1]
    free = deque(call.payload_buffers(call.config.prefetch + 1))
    inflight: deque = deque()

    def start(k: int) -> None:
        dst, src = (r + k) % G, (r - k) % G
        send = call.layouts[("send", k)]
        buf = t.send_buffer(dst, send.num_rows * 2 * D, call.q.dtype)
        if send.num_rows:  # both ends derive the same size: nothing moves for an empty set
            call.pack_local(send, buf)
        t.publish(dst, buf)
        recv = call.layouts[("recv", k)]
        out = free.popleft()
        handle = call.fetch(src, out[: recv.num_rows * 2 * D])  # the round's end (base.py rules)
        inflight.append((src, recv, out, handle))

    for k in range(1, min(G, call.config.prefetch + 1)):
        start(k)
    call.attend_local()  # while the first payloads are in flight
    for k in range(1, G):
        src, recv, out, handle = inflight.popleft()
        handle.wait()
        t.release(src)  # the payload is in our buffer: the producer may reuse its slot
        if k + call.config.prefetch < G:
            start(k + call.config.prefetch)  # uses the one free buffer: overlaps this compute
        if recv.num_rows:
            call.attend(out, recv, src)
        free.append(out)
