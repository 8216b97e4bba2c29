"""The call every strategy runs on: one ``sp_attention`` call on one rank (``Call``).

Strategies own communication (through a ``Transport``) and call the kernel through
``Call.attend`` / ``Call.attend_local``; every partial result goes to the call's
``MergedOutput`` (``strategies/merged.py``: the single LSE merge of ``kernels.merge``,
docs/design.md "Conventions"), so a comparison between strategies measures only how K/V moves.
Packs and transfers issued beside queued kernels go through ``Call.side``
(``strategies/side.py``).

A strategy has two phases (``registry.register_strategy``): ``plan(call)`` names the payload
selections it will move (device tensors; nothing is read on the host), the call resolves them
in its one host synchronisation (``plan.Metadata.stage`` / ``finish``, ``strategies/request.py``),
then ``run(call)`` moves and computes with ``call.layouts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..caches import per_geometry
from ..config import SparspConfig
from ..demand import remote_demand
from ..groups import marker as record_function  # a no-op unless a profiler records
from ..kernels import KVBuffer, LocalKV, get_kernel, kernel_indices, reads_token_major, resolve_kernel
from ..packing import Layout, layout, pack
from ..plan import Shapes
from ..timing import PhaseTimer, TimedHandle, phase_of
from ..transport import Transport
from ..cost import chunks
from .merged import MergedOutput
from .side import SideStream


def head_slice(t: torch.Tensor, batch: int, heads: tuple[int, int]) -> torch.Tensor:
    """The rows of heads [h0, h1) of a (batch·head)-major tensor: ``t`` [B·H, ...] →
    [B·(h1 − h0), ...] (row ``b·H + h`` for every batch ``b`` and head ``h0 <= h < h1``)."""
    h0, h1 = heads
    rest = t.shape[1:]
    return t.reshape(batch, -1, *rest)[:, h0:h1].reshape(-1, *rest)


class _Geometry:
    """What stays the same for every call of one geometry: full layouts, payload buffers."""

    def __init__(self) -> None:
        self.full: dict[int, Layout] = {}
        self.buffers: list[torch.Tensor] = []
        self.last_round: tuple[int, int] | None = None  # Call._remember_round
        self.drain: dict | None = None  # sparsp's first call: its last round's figures


_GEOMETRIES = per_geometry("strategies: full layouts and payload buffers")  # key -> _Geometry


@dataclass
class Call:
    """One attention call on one rank: inputs, the call's mask, layouts, its merged output
    (``output``) and its side stream (``side_stream``)."""

    q: torch.Tensor  # (B, S, H, D) as given
    k: torch.Tensor
    v: torch.Tensor
    shapes: Shapes
    config: SparspConfig
    group: object
    transport: Transport
    full_mask: torch.Tensor | None = None  # bool [B, H, N, N], all ranks' rows; None: dense
    # this rank's rows of the mask, bool [B, H, n_local, N], where the whole mask is not at
    # hand (a call that reuses a kept plan: ``strategies/schedule.py``)
    rows: torch.Tensor | None = None
    masked: bool | None = None  # the call runs under a mask (default: it has one)

    def __post_init__(self) -> None:
        if self.masked is None:
            self.masked = self.full_mask is not None or self.rows is not None
        self.kernel_name = resolve_kernel(self.config.kernel, self.q.device)
        self.kernel = get_kernel(self.kernel_name, self.q.device)
        self._q_hm: torch.Tensor | None = None
        self._lists: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # kernel block lists
        self.consumes: dict = {}  # plan key -> (origin, heads or None): payloads it computes
        # two ranks: each head-sliced partial after the local one is its heads' last
        self.output = MergedOutput(self.q.shape, self.q.dtype, self.q.device,
                                   last_slices=self.shapes.world_size == 2)
        self.scale = self.q.shape[-1] ** -0.5
        self.layouts: dict = {}
        self.kept: dict[int, int] = {}  # kept (query block, key block) pairs per origin
        self._demand: torch.Tensor | None = None
        self._local_done = False
        self.side_stream = SideStream(self.q.device)  # packs and transfers beside queued kernels
        key = (id(self.group), self.shapes, self.q.dtype, str(self.q.device))
        self._geo = _GEOMETRIES.setdefault(key, _Geometry())
        # (packed rows, kept block pairs) of the last round's payloads ("send", "recv") in the
        # geometry's first call, read once here: a call's plan and its run see the same figures
        self.drain_figures: dict = self._geo.drain or {}
        self.kept_by: dict[int, int] = {}
        self.dense_kernel = None  # a group of one whose mask does not pay: ``one_gpu.choose``'s kernel
        self.head_work: list[int] | None = None  # kept work per head, read on the host (head-sharded runs)

    def without_plan(self, spec) -> "Call":
        """This call run by ``spec``, a strategy without a plan (auto's choice after the host
        read): the same inputs and shapes; a sparse ``spec`` keeps the mask, its demand and the
        kernel block lists, a dense one drops them."""
        assert spec.plan is None, f"{spec.name} has a plan: its payloads were not staged"
        other = Call(self.q, self.k, self.v, self.shapes, self.config, self.group, self.transport,
                     full_mask=self.full_mask if spec.sparse else None)
        if spec.sparse:
            other._demand, other._lists = self._demand, self._lists
        return other

    @property
    def q_hm(self) -> torch.Tensor:
        """q as (B, H, S, D): a view where the kernel reads the caller's token-major q at full
        speed (FA4 with one batch), else one head-major copy per call, made when the first
        kernel runs (making a ``Call`` touches no input: ``captured.py`` relies on it)."""
        if self._q_hm is None:
            q_hm = self.q.permute(0, 2, 1, 3)
            if not reads_token_major(self.kernel, self.q, self.config.block_size):
                q_hm = q_hm.contiguous()
            self._q_hm = q_hm
        return self._q_hm

    @property
    def timer(self) -> PhaseTimer | None:
        """A benchmark's CUDA events per phase (``sp_attention(_timer=)``; None: not timed),
        which the merged output times its merges with too."""
        return self.output.timer

    @timer.setter
    def timer(self, timer: PhaseTimer | None) -> None:
        self.output.timer = timer

    def phase(self, name: str):
        """Time a phase when a benchmark asked for it (``PhaseTimer``); else nothing."""
        return phase_of(self.timer, name)

    def fetch(self, peer: int, out: torch.Tensor):
        """``transport.fetch`` with the transfer timed for benchmarks; returns a handle whose
        ``wait()`` also marks when the payload landed on the compute stream."""
        handle = self.transport.fetch(peer, out)
        if self.timer is None:
            return handle
        key = id(handle)
        self.timer.fetch_issued(key)
        return TimedHandle(handle, self.timer, key)

    @property
    def rank(self) -> int:
        return self.shapes.rank

    @property
    def world(self) -> int:
        return self.shapes.world_size

    @property
    def bh(self) -> int:
        return self.shapes.batch * self.shapes.heads

    @property
    def width(self) -> int:
        """Kernel index-list width: the largest shard in blocks (static per geometry)."""
        return max(self.shapes.num_blocks)

    @property
    def mask(self) -> torch.Tensor | None:
        """This rank's rows: bool [B, H, n_local, N] (None when dense)."""
        if self.rows is not None:
            return self.rows
        if self.full_mask is None:
            return None
        return self.full_mask[:, :, self.shapes.blocks_of(self.rank)]

    @property
    def demand(self) -> torch.Tensor:
        """bool [G, B, H, N]: every rank's remote demand, derived from the whole mask."""
        if self._demand is None:
            assert self.full_mask is not None, "a dense call has no demand"
            sh = self.shapes
            self._demand = remote_demand(self.full_mask, sh.block_owner(self.q.device), self.world,
                                         rows=[sh.blocks_of(p) for p in range(self.world)])
        return self._demand

    def need(self, consumer: int, owner: int) -> torch.Tensor:
        """bool [B·H, n_owner]: the blocks of ``owner`` that ``consumer`` demands."""
        return self.demand[consumer][..., self.shapes.blocks_of(owner)].reshape(self.bh, -1)

    def kept_counts(self) -> dict:
        """0-dim tensors for the host read (``Metadata.stage``): kept block pairs of my rows
        against each origin, and of the previous rank's rows against mine (the consumer of my
        last ring-order round: what the drain rule of ``sparsp`` needs on both ends of a pair)."""
        if self.full_mask is None:
            return {}
        out = {("kept", p): self.mask[..., self.shapes.blocks_of(p)].sum() for p in range(self.world)}
        if self.world > 1:
            c = (self.rank - 1) % self.world
            rows = self.full_mask[..., self.shapes.blocks_of(c), :]
            out[("kept_by", c)] = rows[..., self.shapes.blocks_of(self.rank)].sum()
        return out

    def set_resolved(self, layouts: dict, values: dict) -> None:
        self.layouts = layouts
        self.kept = {key[1]: n for key, n in values.items() if key[0] == "kept"}
        self.kept_by = {key[1]: n for key, n in values.items() if key[0] == "kept_by"}
        self._remember_round()

    def payload_buffers(self, n: int) -> list[torch.Tensor]:
        """``n`` flat buffers that each hold any rank's full shard (static shape for compiled
        kernels), allocated once per geometry and reused (a fence orders the reuse)."""
        bufs = self._geo.buffers
        while len(bufs) < n:
            bufs.append(torch.empty(self.shapes.capacity_rows * 2 * self.q.shape[-1],
                                    dtype=self.q.dtype, device=self.q.device))
        return bufs[:n]

    def full_layout(self, p: int) -> Layout:
        """Every block of rank p's shard (what a dense ring carries); no host sync."""
        lay = self._geo.full.get(p)
        if lay is None:
            sh = self.shapes
            n = sh.num_blocks[p]
            sel = torch.ones(self.bh, n, dtype=torch.bool, device=self.q.device)
            lay = layout(sel, sh.seq_lens[p], sh.block_size,
                         counts=(self.bh * n, self.bh if sh.has_tail(p) else 0))
            self._geo.full[p] = lay
        return lay

    def pack_local(self, lay: Layout, out: torch.Tensor) -> int:
        """Pack this rank's selected K/V blocks into ``out``; returns elements written."""
        with self.phase("pack_side" if self.side_stream.active else "pack"):
            return pack(self.k, self.v, lay, self.shapes.heads, out)

    def rows_for(self, origin: int) -> torch.Tensor:
        """This rank's mask rows against ``origin``'s blocks: bool [B, H, n_local, n_origin]
        (all True when the call is dense)."""
        if not self.masked:
            nq, n = self.shapes.num_blocks[self.rank], self.shapes.num_blocks[origin]
            return torch.ones(self.shapes.batch, self.shapes.heads, nq, n, dtype=torch.bool,
                              device=self.q.device)
        return self.mask[..., self.shapes.blocks_of(origin)]

    def attend(self, payload: torch.Tensor, lay: Layout, origin: int,
               heads: tuple[int, int] | None = None) -> None:
        """Run the kernel of the local queries over ``payload`` (a flat buffer holding blocks
        packed in ``lay`` from rank ``origin``'s shard) and merge the partial result.

        The kernel sees the whole fixed-capacity buffer, so its shapes never change between
        calls of one geometry (no recompilation of the flex kernel).

        ``heads = (h0, h1)``: ``lay`` selects blocks of those heads only (a chunk of a payload,
        paper §7); the kernel runs on query heads [h0, h1) alone and its result merges into
        that head slice of the output, so splitting a payload into chunks does not grow the
        merge work. ``None``: every head."""
        if self.masked and self.kept.get(origin, 1) == 0:
            return  # no local query block reads a block of origin (known from the host copy)
        self.output.fold()
        q = self.q_hm
        with self.phase("compute"):
            if heads is None:
                kv_num, kv_idx = self.lists(origin, lay.block_ids)
            else:
                q = q[:, heads[0]:heads[1]]
                kv_num, kv_idx = self.lists(origin, lay.block_ids, heads)
            buf = KVBuffer.from_payload(payload, rows=lay.num_rows, block_start=lay.block_start,
                                        block_len=lay.block_len, num_aligned=lay.num_aligned,
                                        block_size=lay.block_size, head_dim=self.q.shape[-1])
            o, l = self.kernel(q, buf, kv_num, kv_idx, scale=self.scale)
        self.output.merge(o, l, heads)

    def attend_local(self) -> None:
        """The local queries over this rank's own K/V as given (``LocalKV``: per-head
        sequences, no packing copy), merged like any payload. Once per call: a strategy's
        run calls it where it needs it; after ``attend_local_early`` that call does nothing."""
        r = self.rank
        if self._local_done:
            return
        self._local_done = True
        if self.dense_kernel is not None:  # one rank, a mask that keeps too much: the dense kernel
            with self.phase("compute"):
                self.output.set_final(self.dense_kernel(self.q, self.k, self.v, self.scale).contiguous())
            return
        if self.masked and self.kept.get(r, 1) == 0:
            return
        self.output.fold()
        with self.phase("compute"):
            kv = LocalKV(self.k, self.v, self.shapes.block_size)
            kv_num, kv_idx = self.local_lists()
            o, l = self.kernel(self.q_hm, kv, kv_num, kv_idx, scale=self.scale)
        self.output.merge(o, l)

    def attend_local_early(self) -> None:
        """Queue the local shard's kernel before the call's host read (``sp_attention``, for a
        ``local_first`` strategy): it needs only the mask and the block lists the plan stage
        made, so the device computes while the host waits for the read, checks the headers and
        issues the first round (``side``). The read's copy is queued before it, so the read
        does not wait for the kernel. On CUDA, first marks the stage's end on the compute
        stream: the side stream starts from there."""
        self.side_stream.mark()
        if self.timer is not None:
            self.timer.local_first = True
        self.attend_local()

    def local_first_pays(self) -> bool:
        """``SparspConfig.local_first=None``: whether queueing the local kernel before the host
        read shortens this call, judged before the read from the last call of this geometry.
        It does where the host's work between the read and the first pack (the read, the header
        checks, the local kernel's launch) hides behind the local kernel;
        it does not where the first round's transfer is the longer path, since the pack is then
        issued after the local kernel's launch instead of before it, nor over ``nccl``, whose
        copy kernels need SMs the local kernel holds. Estimated with the fabric figures the
        chunk rule uses (``fabric``): the first round's rows (K and V) over the pair's
        bandwidth against the local kept block pairs over the kernel's rate. The first call of
        a geometry has no figures and runs in order. On the CPU it always says yes: the order
        changes nothing there, and the CPU suite then covers the early path."""
        if self.q.device.type != "cuda":
            return True
        last = self._geo.last_round
        if self.transport.name == "nccl" or last is None:
            return False
        rows, pairs = last
        sh = self.shapes
        return chunks.transfer_hides(self.fabric(), rows=rows, pairs=pairs * sh.block_size ** 2,
                                     head_dim=sh.head_dim, dtype_bytes=self.q.element_size())

    def fabric(self) -> chunks.Fabric:
        """What this call's transfers and kernels cost on this machine (``chunks.fabric``): the
        path its transport reports (``Transport.fabric``), that transport's figure, the rate of
        the call's kernel."""
        return chunks.fabric(self.q.device.type, self.transport.name, self.shapes.head_dim, self.kernel_name,
                             path=self.transport.fabric)

    def _remember_round(self) -> None:
        """After the host read: the first round's payload rows (the largest of the round-1
        layouts; a full shard for strategies without a plan) and the local kept block pairs,
        for the next call's ``local_first_pays``."""
        sh = self.shapes
        rows: dict = {}  # per payload of round 1 ("send", "recv"), its head-group units summed
        for key, lay in self.layouts.items():
            if isinstance(key, tuple) and len(key) > 1 and key[1] == 1:
                rows[key[0]] = rows.get(key[0], 0) + lay.num_rows
        if not rows:  # full shards: the previous rank's
            rows = {"full": sh.batch * sh.heads * sh.seq_lens[(sh.rank - 1) % sh.world_size]}
        pairs = self.kept.get(sh.rank, sh.batch * sh.heads * sh.num_blocks[sh.rank] ** 2)
        self._geo.last_round = (max(rows.values()), pairs)

    def stage_side(self) -> None:
        """Mark the compute stream's present end as where ``side`` starts, for packs and
        transfers a strategy issues after it queued kernels (``sparsp``'s late steps); nothing
        on the CPU or when ``attend_local_early`` marked it already. Call it before the kernels
        the side work must not wait for."""
        self.side_stream.mark()

    def side(self, on: bool = True):
        """Context for issuing packs and transfers (``Call.pack_local``,
        ``send_buffer``/``publish``/``fetch``) beside queued kernels (``strategies/side.py``):
        the first round while the early local kernel runs, or a round's late steps
        (``stage_side``). Waits (``handle.wait()``) stay outside it. Before any mark (or on the
        CPU), or with ``on`` false: no context."""
        return self.side_stream.issue(on)

    def lists(self, origin: int, ids: torch.Tensor,
              heads: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's block lists of the local queries over blocks of ``origin`` held with
        buffer ids ``ids`` [B·H, n_origin] (a layout's ``block_ids``), made once per call;
        with ``heads`` = (h0, h1), those of query heads [h0, h1) only (a chunk). They need
        only the mask and ids known before the host sync, so the plan stage
        (``captured.stage``) makes those of the local shard and of every payload in
        ``consumes``."""
        key = (origin, ids.data_ptr(), tuple(ids.shape), heads)
        got = self._lists.get(key)
        if got is None:
            if heads is None:
                got = kernel_indices(self.rows_for(origin), ids, self.width)
            else:
                h0, h1 = heads
                got = kernel_indices(self.rows_for(origin)[:, h0:h1],
                                     head_slice(ids, self.shapes.batch, heads), self.width)
            self._lists[key] = got
        return got

    def local_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lists`` of this rank's own blocks (``LocalKV``'s ids)."""
        ids = LocalKV.ids_for(self.shapes.num_blocks[self.rank], self.bh, self.q.device)
        return self.lists(self.rank, ids)

    def run(self, spec) -> None:
        """Run strategy ``spec`` (a ``StrategySpec``) on this call, resolved by its host read:
        the transport's windows sized for the worst case, a full shard per peer (a collective
        only when they grow, and then a fence of its own: the windows are made anew); the
        strategy's transfers, kernels and merges, and the last merge written as the output;
        then the host checks the flags of the transfers the device waits for on its own, with
        the timeout, so a dead peer raises in this call (``transport/slots.py``, ``settle``)."""
        sh = self.shapes
        self.transport.reserve(sh.capacity_rows * 2 * sh.head_dim * self.q.element_size())
        with record_function("sparsp.run"):
            try:
                if self.dense_kernel is not None:  # one rank, the dense kernel: no strategy to run
                    self.attend_local()
                else:
                    spec.run(self)
                self.output.finish()  # the last merge, written as the output
            finally:  # the compute stream after the side stream's packs and transfers, also
                self.side_stream.join()  # when the run raised: nothing of the call stays unordered
        self.transport.settle()
