"""``sparsp``: demand-directed direct routing (paper §5) with a chunked pipeline (§7).

Round k = 1..G−1: rank r sends to (r+k) mod G exactly the blocks that peer demands (per head,
packed row-major over (batch·head, block)) and fetches from (r−k) mod G exactly its own demand
D[r, ·, (r−k) mod G]. No block is relayed; bytes equal the ``direct`` byte rule. Both ends
derive both selections from the call's whole mask (``Call.need``), so no demand is exchanged.
Fetches run ``config.prefetch`` rounds ahead of the kernel, so transfers overlap compute; the
local shard is computed first, while the first payloads are in flight.

Chunks (§7, ``cost/chunks.py``, docs/pipeline.md): a payload may travel as several messages, one
per head group, each computed on its heads as soon as it landed. The plan cuts each payload's
selection into head-group *units* (a count from config + shapes: ``SparspConfig.chunks`` for
the steady rounds 1..G−2, ``drain_chunks`` for the last round), so their sizes come back from
the call's one host sync; ``chunks.schedule`` then merges units into chunks and orders them
from those sizes. Sender and consumer of a pair run the same functions on the same selection,
so they agree on every message without exchanging anything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import reduce

import torch

from ..caches import per_geometry
from ..packing import Layout, layout
from ..cost import chunks
from .call import Call
from .registry import register_strategy


@dataclass(frozen=True)
class Chunk:
    """One message of a payload: the blocks of heads ``heads`` (None: every head) in ``lay``
    (None: an empty message, which moves nothing but keeps the round's step)."""

    heads: tuple[int, int] | None
    lay: Layout | None

    @property
    def rows(self) -> int:
        return 0 if self.lay is None else self.lay.num_rows


def _pair_cost(call: Call, consumer: int, known: tuple[int, int] | None = None) -> chunks.PairCost:
    """The pair's ``PairCost``; with ``known`` (packed rows, kept block pairs) of its payload
    in an earlier call, the reads per selected block are those measured, not estimated (the
    same figures on both ends, so both schedule alike)."""
    sh = call.shapes
    n = sh.num_blocks[consumer]
    return chunks.pair_cost(call.fabric(), head_dim=sh.head_dim, dtype_bytes=call.q.element_size(),
                            block_size=sh.block_size, consumer_blocks=n,
                            read_fraction=chunks.read_fraction(known, block_size=sh.block_size, consumer_blocks=n))


def _known(call: Call, k: int, owner: int) -> tuple[int, int] | None:
    """(packed rows, kept block pairs) of round k's payload from ``owner`` in the geometry's
    first call, for the drain (the last round) only: ``Call.drain_figures``."""
    if k != call.world - 1:
        return None
    return call.drain_figures.get("send" if owner == call.rank else "recv")


def _requested(call: Call, k: int) -> int | None:
    return call.config.drain_chunks if k == call.world - 1 else call.config.chunks


def _units(call: Call, k: int, owner: int, consumer: int) -> list[tuple[int, int]]:
    """The head groups of round k's payload owner → consumer (config + shapes only: both
    ends compute the same before the host sync)."""
    sh = call.shapes
    known = _known(call, k, owner)
    n = chunks.unit_count(_requested(call, k), drain=k == call.world - 1, heads=sh.heads,
                          cost=_pair_cost(call, consumer, known),
                          max_rows=sh.batch * sh.heads * sh.seq_lens[owner], known=known)
    return chunks.head_groups(sh.heads, n)


_UNIT_HEADS = per_geometry("sparsp: head-group masks")


def _units_of(sel: torch.Tensor, batch: int, units: list[tuple[int, int]]) -> torch.Tensor:
    """``sel`` [B·H, n] as one selection per head group [U, B·H, n], every row outside the
    group's heads cleared: one kernel, and one set of layout kernels for all units
    (``Metadata.stage``). The groups' head masks are made once per (groups, device), on the
    eager first call of a geometry, so a captured stage only reads them."""
    key = (tuple(units), str(sel.device))
    heads = _UNIT_HEADS.get(key)
    if heads is None:
        H = units[-1][1]
        heads = torch.zeros(len(units), 1, H, 1, dtype=torch.bool)
        for u, (h0, h1) in enumerate(units):
            heads[u, :, h0:h1] = True
        heads = _UNIT_HEADS[key] = heads.to(sel.device)
    whole = sel.view(batch, -1, sel.shape[-1])
    return (whole.unsqueeze(0) & heads).view(len(units), *sel.shape)


def _pairs(call: Call, k: int):
    """(name, owner, consumer) of round k's two payloads on this rank."""
    r, G = call.rank, call.world
    return (("send", r, (r + k) % G), ("recv", (r - k) % G, r))


def plan(call: Call) -> dict:
    out = {}
    for k in range(1, call.world):
        for name, owner, consumer in _pairs(call, k):
            sel = call.need(consumer, owner)
            units = _units(call, k, owner, consumer)
            # a received payload's block lists need no count: the plan stage makes them, for
            # the whole payload or each unit (a chunk of one unit uses them as they are)
            if len(units) == 1:
                out[(name, k)] = (sel, owner)
                if name == "recv":
                    call.consumes[(name, k)] = (owner, None)
                continue
            out[(name, k)] = (_units_of(sel, call.shapes.batch, units), owner)  # → (name, k, i)
            if name == "recv":
                call.consumes.update({(name, k, i): (owner, heads) for i, heads in enumerate(units)})
    return out


def payload_chunks(call: Call, name: str, k: int) -> list[Chunk]:
    """The messages of round k's ``name`` ("send" or "recv") payload, in sending order
    (after the host sync: ``call.layouts`` holds the units' sizes). Never empty."""
    _, owner, consumer = next(p for p in _pairs(call, k) if p[0] == name)
    units = _units(call, k, owner, consumer)
    if len(units) == 1:
        return [Chunk(None, call.layouts[(name, k)])]
    lays = [call.layouts[(name, k, i)] for i in range(len(units))]
    pieces = [chunks.Piece(h, lay.num_blocks, lay.num_rows) for h, lay in zip(units, lays)]
    requested = _requested(call, k)
    picked = chunks.schedule(pieces, count=None if requested is None else len(units),
                             cost=_pair_cost(call, consumer, _known(call, k, owner)))
    out = []
    for idx in picked:
        heads = (units[idx[0]][0], units[idx[-1]][1])
        lay = lays[idx[0]] if len(idx) == 1 else _merged([lays[i] for i in idx], call.shapes, owner)
        out.append(Chunk(None if heads == (0, call.shapes.heads) else heads, lay))
    return out or [Chunk(None, None)]


def _merged(lays: list[Layout], sh, owner: int) -> Layout:
    """The layout of several units' blocks together, from their host counts (no host sync)."""
    sel = reduce(torch.logical_or, (lay.selected for lay in lays))
    n_sel = sum(lay.num_blocks for lay in lays)
    n_short = sum(lay.num_blocks - lay.num_aligned for lay in lays)
    return layout(sel, sh.seq_lens[owner], sh.block_size, counts=(n_sel, n_short))


def _region(call: Call, buf: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    """The part of a payload buffer that holds heads [h0, h1): a fixed size per head count
    (the heads' share of a full shard), so the kernel's shapes do not depend on the demand."""
    if heads is None:
        return buf
    sh = call.shapes
    per_head = 2 * sh.batch * max(sh.num_blocks) * sh.block_size * sh.head_dim
    return buf[heads[0] * per_head: heads[1] * per_head]


def _remember_drain(call: Call) -> None:
    """The first call of a geometry leaves its last round's (packed rows, kept block pairs) of
    both payloads for the drain rule of every later call (``Call.drain_figures``); kept once, so
    the unit count, and with it a captured plan stage, stays the same from the second call on."""
    geo, G, r = call._geo, call.world, call.rank
    if geo.drain is not None or G < 2:
        return
    rows = {"send": 0, "recv": 0}
    for key, lay in call.layouts.items():
        if isinstance(key, tuple) and len(key) > 1 and key[0] in rows and key[1] == G - 1 and lay is not None:
            rows[key[0]] += lay.num_rows
    geo.drain = {"send": (rows["send"], call.kept_by.get((r - 1) % G, 0)),
                 "recv": (rows["recv"], call.kept.get((r + 1) % G, 0))}


@dataclass
class _Round:
    """One round's messages on this rank: its steps are issued in order, the first ``window``
    at once and each later one after a landed chunk's kernel (``_Pipeline``)."""

    src: int
    dst: int
    sends: list[Chunk]
    recvs: list[Chunk]
    out: torch.Tensor  # the payload buffer the received chunks land in
    free_after: torch.cuda.Event | None  # the compute stream's last use of ``out`` (a late step)
    issued: int = 0  # steps issued so far
    landing: list = field(default_factory=list)  # (chunk, region, handle) of each issued fetch

    @property
    def steps(self) -> int:
        return max(len(self.sends), len(self.recvs))


@register_strategy("sparsp", sparse=True, placement="periodic", byte_rule="direct", plan=plan, local_first=True,
                   primary=True, copy_engine=True, color="C6",
                   ablation=(("periodic", "nccl", "+periodic, direct routing"),
                             ("periodic", "copy-engine", "+periodic, direct, copy-engine transport"),
                             ("periodic", "copy-engine", "+periodic, direct, copy-engine, chunked drain"),
                             ("periodic", "copy-engine", "+periodic, direct, copy-engine, CUDA graphs"),
                             ("periodic", "copy-engine", "+periodic, direct, copy-engine, CUDA graphs, local first")),
                   description="round k: exactly D[r,·,(r−k) mod G] from its owner, per head; "
                               "chunked by head groups, merged as chunks land")
def run(call: Call) -> None:
    _remember_drain(call)
    G, prefetch = call.world, call.config.prefetch
    rounds = _Pipeline(call)
    with call.side():  # beside the local kernel the call may have queued already
        for k in range(1, min(G, prefetch + 1)):
            rounds.start(k)
    if call.q.device.type == "cuda" and rounds.window is not None:
        call.stage_side()  # where a late step's stream starts: before the local kernel
    call.attend_local()  # while the first payloads are in flight (done already when early)
    for k in range(1, G):
        rounds.land(k)


class _Pipeline:
    """The rounds of one call in flight: the payload buffers free for the next round (each with
    the compute stream's last use of it), the rounds issued and not yet computed, and how many
    steps a round issues at once.

    Slot transports (``ipc``, ``host``) hold ``window`` messages per peer
    (``Transport.window``): the step after that waits on the host until the peer released the
    first, i.e. until a whole chunk travelled. Issued before the local kernel's launch, that
    wait left the device idle for it (a 4-chunk drain at Wan 2.1 size over the host fabric: the
    local kernel started ≈ 11 ms late); so a round issues ``window`` steps at once and each
    later one after the kernel of a landed chunk, on the side stream (``Call.side``) so that
    neither its pack nor its copy queues behind the compute stream's kernels. A transport
    without a window (None: ``nccl``) takes every step at once."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.window = call.transport.window
        self.free = deque((buf, None) for buf in call.payload_buffers(call.config.prefetch + 1))
        self.inflight: deque[_Round] = deque()

    def start(self, k: int) -> None:
        """Round k's messages into the one free buffer: its first ``window`` steps issued now."""
        call = self.call
        r, G = call.rank, call.world
        sends, recvs = payload_chunks(call, "send", k), payload_chunks(call, "recv", k)
        if call.timer is not None and k == G - 1:  # benchmarks: how the drain travelled
            call.timer.drain_chunks = len(recvs)
        out, free_after = self.free.popleft()
        rnd = _Round((r - k) % G, (r + k) % G, sends, recvs, out, free_after)
        self.issue(rnd, rnd.steps if self.window is None else self.window)
        self.inflight.append(rnd)

    def issue(self, rnd: _Round, upto: int) -> None:
        """Steps of ``rnd`` up to ``upto`` (exclusive). One step per message: publish the
        i-th chunk for dst, then fetch the i-th from src (transport/base.py's round rule, per
        step; a side with fewer chunks sends or fetches 0 elements, which moves nothing and
        takes no slot). Every rank walks its steps in the same order, so a wait only ever
        depends on an earlier step of a peer."""
        call, t = self.call, self.call.transport
        D = call.q.shape[-1]
        late = rnd.issued > 0
        while rnd.issued < min(upto, rnd.steps):
            i = rnd.issued
            if late and rnd.free_after is not None:  # the side stream: after the buffer's last kernel
                torch.cuda.current_stream(call.q.device).wait_event(rnd.free_after)
                rnd.free_after = None
            send = rnd.sends[i] if i < len(rnd.sends) else Chunk(None, None)
            buf = t.send_buffer(rnd.dst, send.rows * 2 * D, call.q.dtype)
            if send.rows:  # both ends derive the same size: nothing moves for an empty set
                call.pack_local(send.lay, buf)
            t.publish(rnd.dst, buf)
            if i < len(rnd.recvs):
                region = _region(call, rnd.out, rnd.recvs[i].heads)
                handle = call.fetch(rnd.src, region[: rnd.recvs[i].rows * 2 * D])
                rnd.landing.append((rnd.recvs[i], region, handle))
            else:
                t.fetch(rnd.src, rnd.out[:0])  # ends the step; any sends it carries are fenced
            # Released at once: the transports queue the 'released' signal behind the copy
            # (slots.py; nccl has no slots), so the producer's slot frees as soon as it is
            # copied. Released after the wait instead, a round with more chunks for one peer
            # than its window has slots would deadlock: both ends wait in send_buffer for a
            # release that only comes once their own round has been issued.
            t.release(rnd.src)
            rnd.issued += 1

    def land(self, k: int) -> None:
        """Round k's chunks computed as they land; once its last chunk landed, round
        k + prefetch starts in the buffer freed before it (its transfer overlaps this compute),
        and each chunk's landing lets one more late step go (a slot of that peer frees)."""
        call = self.call
        prefetch = call.config.prefetch
        rnd = self.inflight.popleft()
        for j, (chunk, region, handle) in enumerate(rnd.landing):  # grows as late steps issue
            handle.wait()
            last = j == len(rnd.recvs) - 1
            if last and k + prefetch < call.world:
                # the round's transfer is complete: the next one may use the link
                with call.side():  # the round's last steps (sends only) go first
                    self.issue(rnd, rnd.steps)
                self.start(k + prefetch)  # into the one free buffer: overlaps this compute
            if chunk.rows:
                call.attend(region, chunk.lay, rnd.src, heads=chunk.heads)
            if rnd.issued < rnd.steps:  # a slot of this peer frees as this chunk lands there
                with call.side():
                    self.issue(rnd, rnd.steps if last else rnd.issued + 1)
        done = None
        if call.q.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.free.append((rnd.out, done))
