"""``ring`` and ``ring-sparse``: full shards circulate around the ring (ring-flash-attn style).

Hop k = 1..G−1: rank r sends the shard it holds to r+1 and receives the shard that started at
(r−k) mod G from r−1, double-buffered so the transfer of the next shard overlaps the kernel on
the current one. ``ring`` is the dense baseline (every block attended: what runs without
sparsity, thresholds ignored); ``ring-sparse`` is the paper's Diffusers + SpargeAttn baseline:
the same full shards, the sparse mask picks blocks inside each received shard.
"""

from __future__ import annotations

from .call import Call
from .registry import register_strategy


def run(call: Call) -> None:
    r, G = call.rank, call.world
    t = call.transport
    nxt, prv = (r + 1) % G, (r - 1) % G
    D = call.q.shape[-1]
    cap = call.shapes.capacity_rows * 2 * D  # full capacity: static kernel shapes
    final = call.payload_buffers(1)[0]

    def buffer(last: bool):
        # The next hop forwards what arrives now: receive straight into the next send buffer.
        return final if last else t.send_buffer(nxt, cap, call.q.dtype)

    lay = call.full_layout(r)
    cur = buffer(G == 1)
    with call.side(G > 1):  # the first hop beside the local kernel (Call.side)
        call.pack_local(lay, cur)
    for k in range(1, G):
        origin = (r - k + 1) % G  # whose shard ``cur`` holds
        with call.side(k == 1):
            t.publish(nxt, cur[: lay.num_rows * 2 * D])
            incoming = call.full_layout((r - k) % G)
            nbuf = buffer(k == G - 1)
            handle = call.fetch(prv, nbuf[: incoming.num_rows * 2 * D])
        if k == 1:
            call.attend_local()  # our own shard, as given (cur holds it packed for the peer)
        else:
            call.attend(cur, lay, origin)
        handle.wait()
        t.release(prv)
        cur, lay = nbuf, incoming
    if G == 1:
        call.attend_local()
    else:
        call.attend(cur, lay, (r + 1) % G)


register_strategy("ring", sparse=False, placement="contiguous", byte_rule="full-shards",
                  local_first=True, baseline=True, color="C2",
                  description="full shards, relayed G−1 hops, double-buffered; dense compute "
                              "(thresholds ignored): the no-sparsity baseline")(run)
register_strategy("ring-sparse", sparse=True, placement="contiguous", byte_rule="full-shards",
                  local_first=True, color="C3",
                  ablation=(("contiguous", "nccl", "baseline"), ("periodic", "nccl", "+periodic placement")),
                  description="full shards as ring; block-sparse compute (the paper's Diffusers "
                              "+ SpargeAttn baseline)")(run)
