"""The per-call communication plan (paper §4.2, §5.2): what every rank learns before any
payload moves, with one collective and one host synchronisation per call.

1. ``gather_metadata``: ONE all-gather of a float32 vector per rank — a header (the rank's
   local shape, dtype, block size, strategy and the size of its summaries, bit-cast, cached
   per geometry) followed, for sparse strategies, by the query and key block sums
   (``masks.block_sums``, token-major as the inputs are; means, layout and the key sum are
   made after the gather) and v's sums for the non-finite check, padded to the group's
   capacity so that the collective's size never depends on other ranks' shapes. On CUDA one
   kernel writes all of them into the send row, kept per geometry with its header and
   padding (``masks.summaries_into``). From it
   every rank derives the WHOLE block mask locally (``masks.select_blocks`` on the
   concatenated summaries), hence every rank's demand on every peer
   (``sparsp.demand.remote_demand``): no demand exchange. The shapes that cut the gathered
   summaries are those of the last call of this local geometry;
2. ``Metadata.stage`` then ``Metadata.finish``: the one host synchronisation. ``stage``
   queues on the device everything that needs no host value (``strategies/captured.py``
   replays it as a CUDA graph); ``finish`` copies the header table and every
   count the strategy's layouts need (selected and short blocks per payload, kept blocks per
   origin) to the host in one transfer, raises the same ``ValueError`` on every rank when the
   headers disagree (batch, heads, head dim, dtype, block size, strategy) or hold NaN/Inf
   counts — before any payload moves — and returns the packed layouts (``sparsp.packing``),
   whose offsets both ends derive from prefix sums. When the guessed shapes were wrong (the
   geometry changed) or a summary outgrew the capacity, it says so and the call redoes the
   mask (``remask``) or the gather: only the first call of a geometry pays for that.

On NCCL the all-gather is waited for on the stream, not on the host: the host goes on
queueing the mask while the device gathers, and ``finish``'s host read polls an event with the
call's timeout, so a peer that never answers is still a ``TimeoutError`` naming the metadata
all-gather. Exact NaN/Inf counts (for the error message) are gathered only when a flag is set.

Why the host sync is inherent: copy engines take their sizes from the host (a
``cudaMemcpyAsync`` length is a host argument), and the errors above must be raised on the
host. With ``sim_threshold`` set, key smoothing must precede the block similarity, so the key
sum and token count are all-reduced first (two more collectives; similarity is off by default).
"""

from __future__ import annotations

import math
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ._lru import captured_on_second_sight, lru_get
from .config import SparspConfig
from .groups import HostRead, all_gather_flat, start_host_read, stream_ordered, to_host, wait
from .masks import (PooledBlocks, SumsTable, block_lengths, block_sums, cached_zeros, check_parts, fused_sums,
                    key_sum, select_blocks, summarize, summaries_into)
from .packing import Layout, prepare

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_HEADER = ("sequence length", "batch", "heads", "head dim", "dtype", "block_size", "strategy")
_HEADER_SLOTS = len(_HEADER) + 3  # + NaN/Inf counts of q, k, v


_CODES: dict[int, str] = {}
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def strategy_code(name: str) -> int:
    """A stable int per strategy name (the header carries it; crc32 fits in int32)."""
    code = zlib.crc32(name.encode()) & 0x7FFFFFFF
    _CODES[code] = name
    return code


@dataclass(frozen=True)
class Shapes:
    """What every rank holds: ``seq_lens[p]`` tokens, cut into ``num_blocks[p]`` blocks."""

    rank: int
    world_size: int
    batch: int
    heads: int
    head_dim: int
    block_size: int
    seq_lens: tuple[int, ...]

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(math.ceil(s / self.block_size) for s in self.seq_lens)

    @property
    def block_offsets(self) -> tuple[int, ...]:
        """First global block id of each rank."""
        out, acc = [], 0
        for n in self.num_blocks:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def total_blocks(self) -> int:
        return sum(self.num_blocks)

    def has_tail(self, p: int) -> bool:
        return self.seq_lens[p] % self.block_size != 0

    def blocks_of(self, p: int) -> slice:
        off = self.block_offsets[p]
        return slice(off, off + self.num_blocks[p])

    @property
    def capacity_rows(self) -> int:
        """Rows of a payload buffer big enough for any rank's full shard (static for flex)."""
        return self.batch * self.heads * max(self.num_blocks) * self.block_size

    def block_owner(self, device=None) -> torch.Tensor:
        """LongTensor [total_blocks]: the rank holding each global block."""
        key = ("owner", self, str(device))
        t = _CONSTANTS.get(key)
        if t is None:
            t = torch.repeat_interleave(torch.arange(self.world_size),
                                        torch.tensor(self.num_blocks)).to(device)
            _CONSTANTS[key] = t
        return t


def _header(q: torch.Tensor, config: SparspConfig, strategy: str, size: int) -> torch.Tensor:
    """float32 [_HEADER_SLOTS + 1] on q's device: the int32 header (local shape, codes, three
    zero slots for the non-finite flags ``table_of`` fills on the receiving side, and the size
    of the summaries) bit-cast to float32, made once per geometry (a pageable host-to-device
    copy would sync the stream; a cached one costs no op per call)."""
    B, S, H, D = q.shape
    fields = (S, B, H, D, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else 99, config.block_size,
              strategy_code(strategy), 0, 0, 0, size)
    key = ("header", fields, str(q.device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = torch.tensor(fields, dtype=torch.int32).view(torch.float32).to(q.device)
        _CONSTANTS[key] = t
    return t


def count_nonfinite(q, k, v, group, timeout_s: float) -> torch.Tensor:
    """Exact NaN/Inf counts of every rank's q, k, v: long [G, 3] on the host. A collective: only
    the error path calls it, on every rank at once (every rank read the same flags)."""
    mine = torch.stack([(~torch.isfinite(t)).sum() for t in (q, k, v)]).to(torch.float64)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * 3, dtype=mine.dtype, device=mine.device)
    wait(all_gather_flat(everyone, mine, group), timeout_s, "non-finite count all-gather")
    return everyone.view(world, 3).cpu().long()


def _check_table(table: torch.Tensor, world: int, counts=None) -> None:
    """Raise the same ``ValueError`` on every rank for a bad header table [G, _HEADER_SLOTS].
    ``counts()`` gives the exact NaN/Inf counts [G, 3] when a rank flagged any (a collective
    that every rank enters, since every rank reads the same flags)."""
    rows = table.tolist()  # plain Python from here: a few dozen small tensor ops cost more
    for col in range(1, len(_HEADER)):
        values = [r[col] for r in rows]
        if any(x != values[0] for x in values):
            if _HEADER[col] == "strategy":
                values = [_CODES.get(v, v) for v in values]
            raise ValueError(f"ranks disagree on {_HEADER[col]}: {values} (rank order)")
    if any(r[0] < 1 for r in rows):
        raise ValueError(f"every rank needs at least one token; sequence lengths {[r[0] for r in rows]}")
    nonfinite = [r[len(_HEADER):_HEADER_SLOTS] for r in rows]
    if any(any(f) for f in nonfinite):
        if counts is not None:
            nonfinite = counts().tolist()
        found = [f"rank {r}: {name} has {int(n)} NaN/Inf value{'s' if n > 1 else ''}"
                 for r in range(world) for name, n in zip("qkv", nonfinite[r]) if n]
        if found:  # (a float32 overflow of a probe sum with no NaN/Inf value is no error)
            raise ValueError("non-finite inputs (" + "; ".join(found) + "); sp_attention needs finite "
                             "q, k, v (SparspConfig(check_finite=False) skips this check)")


class _GroupState:
    """Per (group, device): the metadata capacity and the last shapes of each local geometry."""

    def __init__(self) -> None:
        self.capacity = 0  # float32 elements of summary data per rank (grows, never shrinks)
        self.shapes: dict[tuple, Shapes] = {}


_STATE: dict[tuple, _GroupState] = {}


def forget_shapes() -> None:
    """Drop the per-group state, the kept send rows, their gathered rows and summing graphs
    (``close_transports`` calls it: a new group may reuse an id)."""
    _STATE.clear()
    _SEND_ROWS.clear()
    _GATHERED.clear()
    _SUM_GRAPHS.clear()


@dataclass
class Staged:
    """``Metadata.stage``'s device result: ``flat`` = the header table then every count, the
    one vector the host reads; ``pending`` = the layouts awaiting their counts (in order)."""

    flat: torch.Tensor
    n_head: int
    pending: dict
    extra: tuple
    tail: bool = False
    # (pinned host buffer, event): a captured stage copies ``flat`` there itself, as the graph's
    # last node (``strategies/captured.py``); the read then only marks that copy's end
    copied: tuple | None = None


TAIL = ("tail",)
"""The key of ``Metadata.stage``'s ``tail`` values in ``finish``'s values."""


@dataclass
class Metadata:
    """What the call's metadata all-gather brought: every rank's header (device) and summary
    data, the shapes they describe (guessed from the last call of this local geometry until
    ``finish`` confirms them); ``block_mask`` makes the whole block mask from them."""

    shapes: Shapes
    table: torch.Tensor | None  # int64 [G, _HEADER_SLOTS + 1] on the device; None: not made yet
    rows: torch.Tensor  # float32 [G, header + capacity]: what each rank sent
    capacity: int
    counts: object = None  # () -> exact NaN/Inf counts [G, 3] (the error path's collective)
    timeout_s: float = 300.0
    center: torch.Tensor | None = None  # the global key mean, when similarity smoothed the keys
    similarity: bool = False  # the summaries are pooled means and similarities (``_summaries``)
    check: bool = True  # the rows carry the non-finite check's sums (``check_finite``)
    rows_kept: bool = False  # ``rows`` is the geometry's kept buffer (``_gathered_rows``)

    def headers(self) -> torch.Tensor:
        """The header table (``table_of`` the rows), made on first use: on the device, so in
        the plan stage a CUDA graph replays."""
        if self.table is None:
            self.table = table_of(self.rows, self.check)
        return self.table

    def with_rows(self, rows: torch.Tensor) -> "Metadata":
        """The same metadata on other gathered rows (a captured stage's static copy)."""
        return replace(self, table=None, rows=rows)

    def stage(self, selections: dict, extra: dict | None = None,
              tail: torch.Tensor | None = None) -> "Staged":
        """The device half of the call's host synchronisation (no host sync, static shapes per
        geometry: what ``strategies/captured.py`` replays as a CUDA graph); ``finish`` reads it.

        ``selections[key] = (selected bool [BH, n_p], p)``: blocks of rank p's shard a payload
        holds → ``layouts[key]``; a stacked [U, BH, n_p] (a payload's head-group units) →
        ``layouts[(*key, i)]`` for i < U, made by one set of kernels. ``extra[key]``: 0-dim integer tensors wanted on the host →
        ``values[key]`` (ints). ``tail``: a 1-D tensor of integer values (exact in float64),
        read with them → ``values[TAIL]`` (a list of ints)."""
        sh = self.shapes
        counts, pending = [], {}
        for key, (sel, p) in selections.items():
            # everything of the layout that needs no count is queued now, before the sync
            # (a payload this rank packs also gets its token rows)
            pend = prepare(sel, sh.seq_lens[p], sh.block_size, heads=sh.heads if p == sh.rank else None)
            parts = {key: pend} if sel.dim() == 2 else {(*key, i): u for i, u in enumerate(pend.unbind())}
            for part_key, part in parts.items():
                pending[part_key] = part
                counts += [part.num_selected, part.num_short]
        extra = extra or {}
        counts += [extra[k].long() for k in extra]
        table = self.headers()
        parts = [table.reshape(-1)] + ([torch.stack(counts)] if counts else [])
        if tail is not None:
            parts.append(tail.round().long())
        return Staged(torch.cat(parts), table.numel(), pending, tuple(extra), tail is not None)

    def start_read(self, staged: "Staged") -> HostRead:
        """Queue the copy of ``staged.flat`` to the host (``finish`` collects it): what the
        stream runs after it (the local shard's kernel) does not delay the read."""
        if staged.copied is not None:  # the replayed stage queued the copy: mark its end
            return HostRead.queued(*staged.copied)
        # once per call, and ``finish`` uses its values up before the next call's read: the
        # pinned buffer and event are kept per shape (``groups.HostRead``; like the gathered
        # rows, made per call again with ``SPARSP_CALL_BUFFERS=0``)
        return start_host_read(staged.flat, reuse=keeps_call_buffers())

    def finish(self, staged: "Staged", read: HostRead | None = None):
        """The host read of ``staged.flat`` (``read``, or one started now), the header checks,
        then layouts and counts.

        Raises ``ValueError`` on every rank for a bad header. Returns ``None`` when the guessed
        shapes or the capacity were wrong (the caller redoes the mask with ``true_shapes``),
        else ``(layouts, values)``."""
        sh = self.shapes
        read = read if read is not None else self.start_read(staged)
        host = read.result(self.timeout_s, "geometry check (metadata all-gather)")
        table = host[:staged.n_head].view(sh.world_size, -1)
        self._host_table = table
        _check_table(table[:, :_HEADER_SLOTS], sh.world_size, self.counts)
        rows = table.tolist()
        if max(r[_HEADER_SLOTS] for r in rows) > self.capacity or tuple(r[0] for r in rows) != sh.seq_lens:
            return None
        rest = host[staged.n_head:].tolist()
        layouts = {}
        for i, (key, pend) in enumerate(staged.pending.items()):
            layouts[key] = pend.finish(rest[2 * i], rest[2 * i + 1])
        n = 2 * len(staged.pending)
        values = dict(zip(staged.extra, rest[n:n + len(staged.extra)]))
        if staged.tail:
            values[TAIL] = rest[n + len(staged.extra):]
        return layouts, values

    @property
    def fits(self) -> bool:
        """Whether every rank's summaries, cut with the guessed shapes, fit the gathered rows
        (host arithmetic, no sync; the check's values after them are not cut: a row longer than
        the capacity makes ``finish`` return None anyway). When they do not, the mask is a
        placeholder and the call will redo it (``finish`` returns None): nothing should be
        computed on it."""
        sh = self.shapes
        return all(_summary_size(sh.batch, sh.heads, sh.head_dim, n, self.similarity, check=False)
                   <= self.capacity for n in sh.num_blocks)

    def block_mask(self, config: SparspConfig) -> torch.Tensor:
        """The whole block mask from the gathered summaries (device ops only): bool [B, H, N, N],
        N = all ranks' blocks in rank order."""
        return _mask(self, self.shapes, config, self.center)

    def true_shapes(self) -> Shapes:
        """The shapes the gathered headers describe (after ``finish`` read them)."""
        sh = self.shapes
        return Shapes(sh.rank, sh.world_size, sh.batch, sh.heads, sh.head_dim, sh.block_size,
                      tuple(self._host_table[:, 0].tolist()))

    @property
    def needed(self) -> int:
        """The largest summary any rank sent (after ``finish`` read the headers)."""
        return int(self._host_table[:, _HEADER_SLOTS].max())


def table_of(rows: torch.Tensor, check: bool = True) -> torch.Tensor:
    """int64 [G, _HEADER_SLOTS + 1]: the headers in the gathered rows (bit-cast back). With
    ``check`` (``SparspConfig.check_finite``), a rank's first non-finite flag is set when its
    summaries hold a NaN or Inf (``_summaries``: then one of its q, k, v does, or a sum
    overflowed); ``_check_table`` then asks for the exact counts."""
    table = rows[:, : _HEADER_SLOTS + 1].contiguous().view(torch.int32).long()
    if check:
        table[:, len(_HEADER)] = torch.isfinite(rows[:, _HEADER_SLOTS + 1:]).all(1).logical_not()
    return table


def _summary_size(B: int, H: int, D: int, n: int, similarity: bool, check: bool, fused: bool = True) -> int:
    """float32 values of a sparse call's summaries for n blocks (``_summaries``); ``fused``: as
    the CUDA kernel writes them (v's check in ``masks.check_parts`` values, not one)."""
    if similarity:
        return 2 * B * H * n * (D + 1) + B * H * D + int(check)
    return 2 * B * n * H * D + (check_parts(B, n, H * D) if fused else 1) * int(check)


def gather_metadata(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, config: SparspConfig,
                    strategy: str, *, sparse: bool) -> Metadata:
    """The call's metadata all-gather (the whole mask is ``Metadata.block_mask``'s).

    Every rank sends ``header | summaries`` padded to the group's capacity, so the collective's
    size never depends on other ranks' shapes (a rank's slice may change while a peer's does
    not). The summaries (``_summaries``) are what the device has after one pass over q and k
    — block sums, token-major as the inputs are — and the means, the layout the mask wants and
    the non-finite flags are made from the gathered rows, in the plan stage a CUDA graph
    replays (``strategies/captured.py``): the host issues as few ops as it can before the
    collective. The shapes used to cut the gathered summaries are those of the last call of
    this local geometry; ``Metadata.finish`` checks them. Only the first call of a group (or
    one whose summaries outgrow the capacity, or whose shapes were guessed wrong) costs a
    second collective or host read.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, D = q.shape
    bs = config.block_size
    state = _STATE.setdefault((id(group), str(q.device)), _GroupState())
    fused = sparse and config.sim_threshold is None and fused_sums(q, k, v)
    data, center = (None, None) if fused else _summaries(q, k, v, group, config, sparse)
    size = _summary_size(B, H, D, -(-S // bs), False, config.check_finite) if fused else data.numel()
    header = _header(q, config, strategy, size)
    local_key = (tuple(q.shape), q.dtype, bs, strategy)
    guess = state.shapes.get(local_key)
    counts = lambda: count_nonfinite(q, k, v, group, config.timeout_s)  # noqa: E731
    checked = v if config.check_finite else None
    while True:
        cap = state.capacity  # group-wide: it changes only from gathered headers
        kept = fused and size <= cap
        if kept:  # the kernel writes the summaries into the kept send row
            mine = _send_row(header, cap)
            body = mine[header.numel(): header.numel() + size]
            if not (config.cuda_graphs and q.is_cuda and _graphed_summaries(body, bs, q, k, checked)):
                summaries_into(body, bs, q, k, checked)
        else:
            if data is None:
                data = torch.empty(size, dtype=torch.float32, device=q.device)
                summaries_into(data, bs, q, k, checked)
            body = data if data.numel() <= cap else data[:cap]
            pad = cached_zeros((cap - body.numel(),), q.device)
            mine = torch.cat([header, body, pad])
        # into rows kept with the kept send row: the same buffer every call, which a captured
        # plan stage reads in place (strategies/captured.py)
        kept = kept and keeps_call_buffers()
        everyone = (_gathered_rows(mine, world) if kept else
                    torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device))
        work = all_gather_flat(everyone, mine, group)
        if stream_ordered(group):
            # NCCL: the stream waits, the host goes on queueing the mask; the call's one host
            # read (``Metadata.finish``, ``to_host``) carries the timeout
            work.wait()
        else:
            wait(work, config.timeout_s, "geometry check (metadata all-gather)")
        rows = everyone.view(world, -1)
        table = None  # made from the rows where needed (in the plan stage, after the first call)
        if guess is None:  # first call of this local geometry: read the headers now
            table = table_of(rows, config.check_finite)
            host = to_host(table, config.timeout_s, "geometry check (metadata all-gather)")
            _check_table(host[:, :_HEADER_SLOTS], world, counts)
            guess = Shapes(rank, world, B, H, D, bs, tuple(host[:, 0].tolist()))
            need = int(host[:, _HEADER_SLOTS].max())
            if need > cap:
                state.capacity = need
                continue  # the summaries did not fit: gather again at the group's new capacity
        break
    state.shapes[local_key] = guess
    return Metadata(guess, table, rows, cap, counts, config.timeout_s, center,
                    similarity=config.sim_threshold is not None, check=config.check_finite, rows_kept=kept)


def keeps_call_buffers() -> bool:
    """Whether a call keeps its host-read buffer, its gathered rows and (captured) the read's
    copy per geometry: unless ``SPARSP_CALL_BUFFERS=0``."""
    return os.environ.get("SPARSP_CALL_BUFFERS", "1") != "0"


_SEND_ROWS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
MAX_SEND_ROWS = MAX_SUM_GRAPHS = 16
"""Send rows kept (one per geometry, capacity and stream; the least recently used goes first:
a row holds a rank's whole summaries, ≈ 12 MB at HunyuanVideo's G = 2 shard), and as many
graphs of the summing kernel (``_graphed_summaries``; each keeps its row alive)."""


def _send_row(header: torch.Tensor, cap: int) -> torch.Tensor:
    """The metadata send row of a geometry and capacity on the current stream: ``header``, then
    room for the summaries, then zero padding, made once; ``summaries_into`` fills the summaries
    in place each call. Reuse is safe: a call's all-gather reads it before the stream goes on
    (``work.wait``), and the next call writes it on the same stream."""
    dev = header.device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None
    key = (header.data_ptr(), cap, stream)  # the header: a cached constant per geometry
    return lru_get(_SEND_ROWS, key, lambda: torch.cat([header, cached_zeros((cap,), dev)]), MAX_SEND_ROWS)


_GATHERED: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _gathered_rows(row: torch.Tensor, world: int) -> torch.Tensor:
    """The all-gather's output for a kept send row (``_send_row``), made once per row and group
    size. Reuse is safe as the row's is: every reader of a call's gathered rows is queued on
    the stream before the next call's all-gather writes them."""
    return lru_get(_GATHERED, (row.data_ptr(), row.numel(), world),
                   lambda: torch.empty(world * row.numel(), dtype=row.dtype, device=row.device), MAX_SEND_ROWS)


@dataclass
class _SumsGraph:
    """One geometry's summing kernel as a CUDA graph: the table's upload, then the launch."""

    graph: torch.cuda.CUDAGraph
    table: SumsTable
    body: torch.Tensor  # the send row's summaries, which the graph writes (kept alive with it)


_SUM_GRAPHS: OrderedDict[tuple, object] = OrderedDict()  # key -> _SumsGraph (``captured_on_second_sight``)


def _graphed_summaries(body: torch.Tensor, bs: int, q, k, v) -> bool:
    """Write the call's summaries into ``body`` by replaying the geometry's CUDA graph of the
    summing kernel (``masks.SumsTable``): the host writes three offsets and launches a graph
    instead of the kernel's Triton launch (≈ 25–50 µs of host per call, on the path at LTX size:
    docs/performance.md). False when not taken — the first call of a key, inputs not 16-byte
    aligned, a capture that failed (logged once), ``SPARSP_SUMS_GRAPH=0`` — and the caller
    launches the kernel itself."""
    if os.environ.get("SPARSP_SUMS_GRAPH", "1") == "0":
        return False
    stream = torch.cuda.current_stream(q.device).cuda_stream
    key = (body.data_ptr(), body.numel(), bs, tuple(q.shape), q.dtype, q.stride(), k.stride(),
           None if v is None else v.stride(), stream)
    st = captured_on_second_sight(
        _SUM_GRAPHS, key, lambda: _capture_sums(SumsTable(q.dtype, q.device), body, bs, q, k, v), MAX_SUM_GRAPHS,
        what="the summing kernel", otherwise="launches it", ready=lambda: SumsTable.aligned(q, k, v))
    if st is None:
        return False
    st.table.set(q, k, v)
    st.graph.replay()
    return True


def _capture_sums(table: SumsTable, body: torch.Tensor, bs: int, q, k, v) -> _SumsGraph:
    table.set(q, k, v)
    current = torch.cuda.current_stream(q.device)
    side = torch.cuda.Stream(q.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):  # warm-up: the kernel's table variant compiles outside the capture
        table.upload()
        summaries_into(body, bs, q, k, v, table=table)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a transport's helper thread may use CUDA while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        table.upload()
        summaries_into(body, bs, q, k, v, table=table)
    return _SumsGraph(graph, table, body)


def _summaries(q, k, v, group, config: SparspConfig, sparse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 data this rank sends, the global key mean when similarity smoothed the keys),
    made with torch ops: the CPU path, and CUDA inputs ``masks.fused_sums`` does not take.

    Sparse calls, similarity off (the default): q's and k's block sums (B, n, H, D) (the key
    sum is the sum of k's, made after the gather: ``_mask``); similarity on: pooled means and
    similarities around the all-reduced key mean (``masks.summarize``; two more collectives),
    and k's sum. With ``config.check_finite`` one more value, v's sum (a dense call: q's, k's
    and v's; the CUDA kernel writes ``masks.check_parts`` partial sums of v instead): a NaN or
    Inf in q, k or v reaches a value sent, and ``table_of`` flags the rank from its row (a sum
    of finite values overflows only near the float32 limit, ~3e38; the exact counts of
    ``count_nonfinite`` then find none and the check passes)."""
    parts, center = [], None
    if sparse and config.sim_threshold is None:
        bs = config.block_size
        parts = [block_sums(q, bs).reshape(-1), block_sums(k, bs).reshape(-1)]
    elif sparse:
        # similarity of smoothed keys needs the global key mean before pooling: one all-reduce
        ksum = key_sum(k)
        wait(dist.all_reduce(ksum, group=group, async_op=True), config.timeout_s, "key-mean all-reduce")
        center = ksum / _global_tokens(q.shape[1], group, config)
        pq, pk, ks = summarize(q, k, config.block_size, center=center, similarity=True)
        parts = [pq.mean.reshape(-1), pq.sim.reshape(-1), pk.mean.reshape(-1), pk.sim.reshape(-1),
                 ks.reshape(-1)]
    if config.check_finite:
        parts += [v.sum(dtype=torch.float32).view(1)] if sparse else \
            [torch.stack([t.sum(dtype=torch.float32) for t in (q, k, v)])]
    if not parts:
        return cached_zeros((0,), q.device), center
    return torch.cat(parts), center


def remask(meta: Metadata, group) -> Metadata | None:
    """After ``finish`` returned None: the same gathered data cut with the true shapes (no
    collective; the mask left for ``Metadata.block_mask``), or None when the summaries did not
    fit: the group's capacity grows (every rank read the same headers) and the caller gathers
    again."""
    if meta.needed > meta.capacity:
        _STATE[(id(group), str(meta.rows.device))].capacity = meta.needed
        return None
    return replace(meta, shapes=meta.true_shapes())


def _global_tokens(S: int, group, config: SparspConfig) -> int:
    n = torch.tensor([S], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        n = n.cuda()
    wait(dist.all_reduce(n, group=group, async_op=True), config.timeout_s, "token-count all-reduce")
    return int(n.item())


def _mask(meta: Metadata, shapes: Shapes, config: SparspConfig, center) -> torch.Tensor:
    """The whole block mask from every rank's summaries (cut with ``shapes``)."""
    B, H, D = shapes.batch, shapes.heads, shapes.head_dim
    off = _HEADER_SLOTS + 1
    N = shapes.total_blocks
    if not meta.fits:
        # the summaries did not fit (or the shapes are a wrong guess): finish says so and the
        # call redoes it; any mask of the right size serves until then
        return torch.ones(B, H, N, N, dtype=torch.bool, device=meta.rows.device)
    pqs, pks, sums = [], [], []
    for p, (S, n) in enumerate(zip(shapes.seq_lens, shapes.num_blocks)):
        row = meta.rows[p, off:]
        if meta.similarity:  # pooled means and similarities, head-major (``_summaries``)
            sizes = [B * H * n * D, B * H * n, B * H * n * D, B * H * n, B * H * D]
            qm, qs, km, ksim, ks = torch.split(row[: sum(sizes)], sizes)
            L = block_lengths(S, shapes.block_size, row.device)[0]
            pqs.append(PooledBlocks(qm.view(B, H, n, D), qs.view(B, H, n), L))
            pks.append(PooledBlocks(km.view(B, H, n, D), ksim.view(B, H, n), L))
            sums.append(ks.view(B, H, D))
        else:  # block sums, token-major: the means and k's sum are made here
            sizes = [B * n * H * D, B * n * H * D]
            qsum, ksum = torch.split(row[: sum(sizes)], sizes)
            pqs.append(PooledBlocks.from_sums(qsum.view(B, n, H, D), S, shapes.block_size))
            pks.append(PooledBlocks.from_sums(ksum.view(B, n, H, D), S, shapes.block_size))
            sums.append(ksum.view(B, n, H, D).sum(1))  # as ``masks.split_mask`` makes it
    pq_all, pk_all = PooledBlocks.cat(pqs), PooledBlocks.cat(pks)
    if center is None and config.sim_threshold is None:
        # pooled keys were not smoothed yet: subtract the global key mean now
        center = torch.stack(sums).sum(0) / sum(shapes.seq_lens)
        pk_all = pk_all.centered(center)
    return select_blocks(pq_all, pk_all, cdf_threshold=config.cdf_tensor(H),
                         sim_threshold=config.sim_tensor(H))


__all__ = ["Layout", "Metadata", "Shapes", "Staged", "TAIL", "forget_shapes", "gather_metadata", "remask",
           "strategy_code", "table_of"]
