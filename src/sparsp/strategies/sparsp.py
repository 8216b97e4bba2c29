"""``sparsp``: demand-directed direct routing (paper §5).

Round k = 1..G−1: rank r sends to (r+k) mod G exactly the blocks that peer demanded (per head,
packed row-major over (batch·head, block)) and fetches from (r−k) mod G exactly its own demand
D[r, ·, (r−k) mod G]. No block is relayed; bytes equal ``demand.comm_bytes(..., "sparsp")``.
Fetches run ``config.prefetch`` rounds ahead of the kernel, so transfers overlap compute; the
local shard is computed first, while the first payloads are in flight.
"""

from __future__ import annotations

from collections import deque

from ..plan import exchange_demand
from .base import Call, flush


def run(call: Call) -> None:
    r, G, sh = call.rank, call.world, call.shapes
    need = {p: call.mask[..., sh.blocks_of(p)].any(dim=2) for p in range(G) if p != r}
    provide = exchange_demand(need, sh, call.group, call.config.timeout_s)
    t = call.transport
    D = call.q.shape[-1]
    free = deque(call.payload_buffer() for _ in range(call.config.prefetch + 1))
    inflight: deque = deque()

    def start(k: int) -> None:
        dst, src = (r + k) % G, (r - k) % G
        send = call.layout_of(provide[dst], r)
        if send.num_rows:  # both ends derive the same size: nothing is sent for an empty set
            buf = t.send_buffer(dst, send.num_rows * 2 * D, call.q.dtype)
            call.pack_local(send, buf)
            t.publish(dst, buf)
        recv = call.layout_of(need[src], src)
        out = free.popleft()
        handle = t.fetch(src, out[: recv.num_rows * 2 * D]) if recv.num_rows else None
        flush(t)  # a send with no fetch in the same round goes out now
        inflight.append((src, recv, out, handle))

    for k in range(1, min(G, call.config.prefetch + 1)):
        start(k)
    local, local_buf = call.full_layout(r), call.payload_buffer()
    call.pack_local(local, local_buf)
    call.attend(local_buf, local, r)
    for k in range(1, G):
        src, recv, out, handle = inflight.popleft()
        if handle is not None:
            handle.wait()
        if k + call.config.prefetch < G:
            start(k + call.config.prefetch)  # uses the one free buffer: overlaps this compute
        if recv.num_rows:
            call.attend(out, recv, src)
            t.release(src)
        free.append(out)
