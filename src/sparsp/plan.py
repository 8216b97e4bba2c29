"""The per-call communication plan (paper §4.2, §5.2): what every rank learns before any
payload moves, with one collective and one host synchronisation per call.

1. ``gather_metadata``: ONE all-gather of a float32 row per rank — a header (the rank's local
   shape, dtype, block size, strategy and the size of its summaries, bit-cast, cached per
   geometry: ``sparsp.wire``) followed by the rank's summaries (``sparsp.summaries``: for a
   sparse call q's and k's block sums and v's sums for the non-finite check), padded to the
   group's capacity so that the collective's size never depends on other ranks' shapes. From
   the gathered rows every rank derives the WHOLE block mask locally (``Metadata.block_mask``:
   ``masks.select_blocks`` on the concatenated summaries), hence every rank's demand on every
   peer (``sparsp.demand.remote_demand``): no demand exchange. The shapes that cut the
   gathered summaries are those of the last call of this local geometry;
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

A mesh call's sp step gathers nothing: its head step gathered every piece's summaries for all
heads over the (sp × ulysses) sub-mesh, and ``Metadata.given`` carries the slices' shapes and
the mask of the step's heads from there (``strategies/meshed.py``).

Why the host sync is inherent: copy engines take their sizes from the host (a
``cudaMemcpyAsync`` length is a host argument), and the errors above must be raised on the
host. With ``sim_threshold`` set, key smoothing must precede the block similarity, so the key
sum and token count are all-reduced first (two more collectives; similarity is off by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .caches import per_geometry
from .config import SparspConfig
from .groups import HostRead, all_gather_flat, start_host_read, stream_ordered, to_host, wait
from .masks import select_blocks
from .packing import Layout, prepare
from .summaries import (PooledBlocks, block_lengths, fused_sums, gathered_rows, kept_row, kernel_summaries,
                        key_sum, padded_row, torch_summaries)
from .wire import HEADER_SLOTS, check_table, header, summary_size, table_of

_CONSTANTS = per_geometry("plan: block owners")


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


class _GroupState:
    """Per (group, device): the metadata capacity and the last shapes of each local geometry."""

    def __init__(self) -> None:
        self.capacity = 0  # float32 elements of summary data per rank (grows, never shrinks)
        self.shapes: dict[tuple, Shapes] = {}


_STATE = per_geometry("plan: each group's summary capacity and shapes")  # (group id, device) -> _GroupState


def _group_state(group, device) -> _GroupState:
    return _STATE.setdefault((id(group), str(device)), _GroupState())


# --- the metadata all-gather ----------------------------------------------------------------


def gather_metadata(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, config: SparspConfig,
                    strategy: str, *, sparse: bool) -> Metadata:
    """The call's metadata all-gather (the whole mask is ``Metadata.block_mask``'s).

    Every rank sends ``header | summaries`` padded to the group's capacity, so the collective's
    size never depends on other ranks' shapes (a rank's slice may change while a peer's does
    not). The summaries (``sparsp.summaries``) are what the device has after one pass over q
    and k — block sums, token-major as the inputs are — and the means, the layout the mask
    wants and the non-finite flags are made from the gathered rows, in the plan stage a CUDA
    graph replays (``strategies/captured.py``): the host issues as few ops as it can before the
    collective. Where the summing kernel takes the inputs and the summaries fit the capacity,
    it writes them into the send row kept per geometry and the all-gather writes into rows kept
    beside it, which a captured plan stage reads in place. The shapes used to cut the gathered
    summaries are those of the last call of this local geometry; ``Metadata.finish`` checks
    them. Only the first call of a group (or one whose summaries outgrow the capacity, or whose
    shapes were guessed wrong) costs a second collective or host read.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, D = q.shape
    bs = config.block_size
    state = _group_state(group, q.device)
    checked = v if config.check_finite else None
    fused = sparse and config.sim_threshold is None and fused_sums(q, k, v)
    center = _key_mean(q, k, group, config) if sparse and config.sim_threshold is not None else None
    data = None if fused else torch_summaries(q, k, v, bs, sparse=sparse, check=config.check_finite, center=center)
    size = summary_size(B, H, D, -(-S // bs), False, config.check_finite) if fused else data.numel()
    head = header(q, config.block_size, strategy, size)
    local_key = (tuple(q.shape), q.dtype, bs, strategy)
    guess = state.shapes.get(local_key)
    counts = lambda: count_nonfinite(q, k, v, group, config.timeout_s)  # noqa: E731
    while True:
        cap = state.capacity  # group-wide: it changes only from gathered headers
        kept = fused and size <= cap
        if kept:
            mine = kept_row(head, size, cap, bs, q, k, checked, graphs=config.cuda_graphs)
            everyone = gathered_rows(mine, world)
        else:
            if data is None:
                data = kernel_summaries(size, bs, q, k, checked)
            mine = padded_row(head, data, cap)
            everyone = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
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
            check_table(host[:, :HEADER_SLOTS], world, counts)
            guess = Shapes(rank, world, B, H, D, bs, tuple(host[:, 0].tolist()))
            need = int(host[:, HEADER_SLOTS].max())
            if need > cap:
                state.capacity = need
                continue  # the summaries did not fit: gather again at the group's new capacity
        break
    state.shapes[local_key] = guess
    return Metadata(guess, table, rows, cap, counts, config.timeout_s, center,
                    similarity=config.sim_threshold is not None, check=config.check_finite, rows_kept=kept)


def _key_mean(q: torch.Tensor, k: torch.Tensor, group, config: SparspConfig) -> torch.Tensor:
    """The global key mean [B, H, D], for the similarity of smoothed keys, which must precede
    pooling: the key sum and the token count all-reduced (two collectives)."""
    ksum = key_sum(k)
    wait(dist.all_reduce(ksum, group=group, async_op=True), config.timeout_s, "key-mean all-reduce")
    n = torch.tensor([q.shape[1]], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        n = n.cuda()
    wait(dist.all_reduce(n, group=group, async_op=True), config.timeout_s, "token-count all-reduce")
    return ksum / int(n.item())


# --- the plan stage and the host read -------------------------------------------------------


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
    table: torch.Tensor | None  # int64 [G, HEADER_SLOTS + 1] on the device; None: not made yet
    rows: torch.Tensor  # float32 [G, header + capacity]: what each rank sent
    capacity: int
    counts: object = None  # () -> exact NaN/Inf counts [G, 3] (the error path's collective)
    timeout_s: float = 300.0
    center: torch.Tensor | None = None  # the global key mean, when similarity smoothed the keys
    similarity: bool = False  # the summaries are pooled means and similarities (``summarize``)
    check: bool = True  # the rows carry the non-finite check's sums (``check_finite``)
    rows_kept: bool = False  # ``rows`` is the geometry's kept buffer (``summaries.gathered_rows``)
    known: bool = False  # shapes every rank holds, no headers (``Metadata.known``)
    mask: torch.Tensor | None = None  # a known call's whole mask (None: a dense call)

    @classmethod
    def given(cls, shapes: Shapes, mask: torch.Tensor | None, device, timeout_s: float) -> "Metadata":
        """The metadata of a call whose caller gathered the summaries already and holds the
        shapes and the whole mask (a mesh call's sp step: its slices' shapes, read from the
        head step's headers, and the whole mask restricted to its heads): no collective, no
        header in its host read, which carries only its own counts; ``block_mask`` returns
        ``mask``."""
        empty = torch.empty(shapes.world_size, 0, device=device)
        return cls(shapes, empty.long(), empty, 0, timeout_s=timeout_s, check=False, known=True, mask=mask)

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
        # pinned buffer and event are kept per shape (``groups.HostRead``)
        return start_host_read(staged.flat, reuse=True)

    def finish(self, staged: "Staged", read: HostRead | None = None):
        """The host read of ``staged.flat`` (``read``, or one started now), the header checks,
        then layouts and counts.

        Raises ``ValueError`` on every rank for a bad header. Returns ``None`` when the guessed
        shapes or the capacity were wrong (the caller redoes the mask with ``true_shapes``),
        else ``(layouts, values)``."""
        sh = self.shapes
        read = read if read is not None else self.start_read(staged)
        host = read.result(self.timeout_s, "geometry check (metadata all-gather)")
        if not self.known:  # a known call's shapes were checked where they were read
            table = host[:staged.n_head].view(sh.world_size, -1)
            self._host_table = table
            check_table(table[:, :HEADER_SLOTS], sh.world_size, self.counts)
            rows = table.tolist()
            if max(r[HEADER_SLOTS] for r in rows) > self.capacity or tuple(r[0] for r in rows) != sh.seq_lens:
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
        return self.known or all(summary_size(sh.batch, sh.heads, sh.head_dim, n, self.similarity, check=False)
                                 <= self.capacity for n in sh.num_blocks)

    def block_mask(self, config: SparspConfig, cdf: torch.Tensor | None = None) -> torch.Tensor:
        """The whole block mask from the gathered summaries (device ops only): bool [B, H, N, N],
        N = all ranks' blocks in rank order. ``cdf``: the per-head CDF thresholds as a device
        tensor (``masks.threshold_tensor``) in place of ``config``'s, for a captured stage
        that takes them as an input. A known call's: the mask it was made with."""
        if self.known:
            assert self.mask is not None, "a known call without a mask computes none"
            return self.mask
        return _mask(self, self.shapes, config, self.center, cdf)

    def true_shapes(self) -> Shapes:
        """The shapes the gathered headers describe (after ``finish`` read them)."""
        sh = self.shapes
        return Shapes(sh.rank, sh.world_size, sh.batch, sh.heads, sh.head_dim, sh.block_size,
                      tuple(self._host_table[:, 0].tolist()))

    @property
    def needed(self) -> int:
        """The largest summary any rank sent (after ``finish`` read the headers)."""
        return int(self._host_table[:, HEADER_SLOTS].max())


def remask(meta: Metadata, group) -> Metadata | None:
    """After ``finish`` returned None: the same gathered data cut with the true shapes (no
    collective; the mask left for ``Metadata.block_mask``), or None when the summaries did not
    fit: the group's capacity grows (every rank read the same headers) and the caller gathers
    again."""
    if meta.needed > meta.capacity:
        _group_state(group, meta.rows.device).capacity = meta.needed
        return None
    return replace(meta, shapes=meta.true_shapes())


# --- the non-finite counts ------------------------------------------------------------------


def count_nonfinite(q, k, v, group, timeout_s: float) -> torch.Tensor:
    """Exact NaN/Inf counts of every rank's q, k, v: long [G, 3] on the host. A collective: only
    the error path calls it, on every rank at once (every rank read the same flags)."""
    mine = torch.stack([(~torch.isfinite(t)).sum() for t in (q, k, v)]).to(torch.float64)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * 3, dtype=mine.dtype, device=mine.device)
    wait(all_gather_flat(everyone, mine, group), timeout_s, "non-finite count all-gather")
    return everyone.view(world, 3).cpu().long()


# --- the mask ------------------------------------------------------------------------------


def _mask(meta: Metadata, shapes: Shapes, config: SparspConfig, center, cdf=None) -> torch.Tensor:
    """The whole block mask from every rank's summaries (cut with ``shapes``)."""
    B, H, D = shapes.batch, shapes.heads, shapes.head_dim
    off = HEADER_SLOTS + 1
    N = shapes.total_blocks
    if not meta.fits:
        # the summaries did not fit (or the shapes are a wrong guess): finish says so and the
        # call redoes it; any mask of the right size serves until then
        return torch.ones(B, H, N, N, dtype=torch.bool, device=meta.rows.device)
    pqs, pks, sums = [], [], []
    for p, (S, n) in enumerate(zip(shapes.seq_lens, shapes.num_blocks)):
        row = meta.rows[p, off:]
        if meta.similarity:  # pooled means and similarities, head-major (``summarize``)
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
    return select_blocks(pq_all, pk_all, cdf_threshold=config.cdf_tensor(H) if cdf is None else cdf,
                         sim_threshold=config.sim_tensor(H), trusted=cdf is not None)


__all__ = ["Layout", "Metadata", "Shapes", "Staged", "TAIL", "count_nonfinite", "gather_metadata", "remask"]
