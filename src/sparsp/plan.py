"""The per-call communication plan (paper §4.2, §5.2).

Once per attention call, before any payload moves:

1. ``exchange_shapes``: one all-gather of a small int vector — every rank's sequence length,
   and a check that batch, heads, head dim, dtype, block size and strategy agree everywhere;
2. ``local_mask``: one all-reduce of the key sum (key smoothing), one all-gather of the pooled
   key summaries, then this rank's rows of the block mask — the mask the kernel will use;
3. ``exchange_demand``: demand masks per peer, exchanged in one batched p2p operation; what a
   peer demands from me is what I provide to it;
4. ``Layout``: pack/unpack offsets derived *identically on both ends* from prefix sums over
   (batch·head, block) — no offsets or lengths ever cross the wire.

Blocks: each rank's slice is cut into ``block_size`` tokens from its own start; only a slice's
last block may be short (``sparsp.placement`` guarantees that layout for placed sequences).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import SparspConfig
from .kernels import KVBuffer, canonical_block_ids
from .masks import PooledBlocks, key_sum, pool_blocks, select_blocks

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_STRATEGY_CODES = {"ring": 1, "ring-sparse": 2, "ring-relay": 3, "ulysses": 4, "sparsp": 5}


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for an async collective, turning a silent or dead peer into a ``TimeoutError``."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {e}") from e
    if ok is False:
        raise TimeoutError(f"{what}: no answer from a peer within {timeout_s} s")


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


def exchange_shapes(q: torch.Tensor, group, config: SparspConfig, strategy: str, *,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> Shapes:
    """One all-gather: every rank's length, and equal geometry everywhere (else ValueError).

    With ``config.check_finite`` the same all-gather carries each rank's count of NaN/Inf
    values in q (and k, v when given), so a bad input on ONE rank makes EVERY rank raise the
    same ``ValueError`` here, before any payload moves, instead of one rank raising while its
    peers wait in the next collective until their timeout.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, D = q.shape
    mine = torch.tensor(
        [S, B, H, D, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else 99, config.block_size,
         _STRATEGY_CODES[strategy]],
        dtype=torch.long, device=q.device,
    )
    inputs = {"q": q, "k": k, "v": v}
    # Counted on the device: no host sync here; the .cpu() of the gathered table is the one.
    bad = [(~torch.isfinite(t)).sum().reshape(1) if config.check_finite and t is not None
           else torch.zeros(1, dtype=torch.long, device=q.device) for t in inputs.values()]
    mine = torch.cat([mine, *bad])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    wait(dist.all_gather(everyone, mine, group=group, async_op=True), config.timeout_s, "geometry check")
    table = torch.stack(everyone).cpu()
    names = ("sequence length", "batch", "heads", "head dim", "dtype", "block_size", "strategy")
    for col in range(1, len(names)):
        if (table[:, col] != table[0, col]).any():
            raise ValueError(f"ranks disagree on {names[col]}: {table[:, col].tolist()} (rank order)")
    if (table[:, 0] < 1).any():
        raise ValueError(f"every rank needs at least one token; sequence lengths {table[:, 0].tolist()}")
    nonfinite = table[:, len(names):]
    if nonfinite.any():
        found = [f"rank {r}: {name} has {int(n)} NaN/Inf value{'s' if n > 1 else ''}"
                 for r in range(world) for name, n in zip(inputs, nonfinite[r].tolist()) if n]
        raise ValueError("non-finite inputs (" + "; ".join(found) + "); sp_attention needs finite q, k, v "
                         "(SparspConfig(check_finite=False) skips this check)")
    return Shapes(rank, world, B, H, D, config.block_size, tuple(table[:, 0].tolist()))


def local_mask(q: torch.Tensor, k: torch.Tensor, shapes: Shapes, group, config: SparspConfig) -> torch.Tensor:
    """This rank's rows of the global block mask: bool [B, H, n_local, total_blocks]."""
    bs = shapes.block_size
    ksum = key_sum(k)
    wait(dist.all_reduce(ksum, group=group, async_op=True), config.timeout_s, "key-mean all-reduce")
    center = ksum / sum(shapes.seq_lens)
    pk_local = pool_blocks(k, bs, center=center)
    pk = gather_pooled(pk_local, shapes, group, config.timeout_s)
    pq = pool_blocks(q, bs)
    H = shapes.heads
    return select_blocks(pq, pk, cdf_threshold=config.cdf_tensor(H), sim_threshold=config.sim_tensor(H))


def gather_pooled(pk: PooledBlocks, shapes: Shapes, group, timeout_s: float) -> PooledBlocks:
    """All-gather pooled key summaries (means and similarities, padded to the longest rank)."""
    B, H, n, D = pk.mean.shape
    n_max = max(shapes.num_blocks)
    packed = torch.zeros(B, H, n_max, D + 1, dtype=torch.float32, device=pk.mean.device)
    packed[:, :, :n, :D] = pk.mean
    packed[:, :, :n, D] = pk.sim
    parts = [torch.empty_like(packed) for _ in range(shapes.world_size)]
    wait(dist.all_gather(parts, packed, group=group, async_op=True), timeout_s, "pooled-key all-gather")
    means, sims, lens = [], [], []
    for p, part in enumerate(parts):
        np_ = shapes.num_blocks[p]
        means.append(part[:, :, :np_, :D])
        sims.append(part[:, :, :np_, D])
        L = torch.full((np_,), shapes.block_size, dtype=torch.long)
        if shapes.has_tail(p):
            L[-1] = shapes.seq_lens[p] - (np_ - 1) * shapes.block_size
        lens.append(L)
    return PooledBlocks(torch.cat(means, 2), torch.cat(sims, 2), torch.cat(lens).to(pk.mean.device))


def exchange_demand(need: dict[int, torch.Tensor], shapes: Shapes, group, timeout_s: float) -> dict[int, torch.Tensor]:
    """Send ``need[p]`` (bool [B, H, n_p]) to every peer p; return ``provide[p]``
    (bool [B, H, n_local]): the blocks peer p wants from me. One batched p2p operation."""
    r, G = shapes.rank, shapes.world_size
    device = next(iter(need.values())).device if need else torch.device("cpu")
    ops, provide = [], {}
    gr = (lambda p: dist.get_global_rank(group, p)) if group is not None else (lambda p: p)
    for p in range(G):
        if p == r:
            continue
        send = need[p].to(torch.uint8).contiguous()
        recv = torch.empty(shapes.batch, shapes.heads, shapes.num_blocks[r], dtype=torch.uint8, device=device)
        provide[p] = recv
        ops += [dist.P2POp(dist.isend, send, gr(p), group), dist.P2POp(dist.irecv, recv, gr(p), group)]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            wait(w, timeout_s, f"rank {r}: demand-mask exchange")
    return {p: m.bool() for p, m in provide.items()}


# --- packing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The canonical packed order of some selected blocks of one rank's shard.

    Buffer block ids: every full selected block in row-major (batch·head, block) order, then
    the short tail blocks (row-major over batch·head), so the full blocks sit at multiples of
    ``block_size`` — the flex kernel addresses them directly (``KVBuffer``'s invariant).
    """

    block_ids: torch.Tensor  # [BH, n] buffer id of each selected block, −1 elsewhere
    block_start: torch.Tensor  # [nb]
    block_len: torch.Tensor  # [nb]
    num_aligned: int
    num_rows: int
    selected: torch.Tensor  # [BH, n] bool
    seq_len: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.block_start.numel()

    def token_rows(self, heads: int, source: "Layout | None" = None) -> torch.Tensor:
        """Source row of every packed row, in packed order.

        Without ``source``: rows of the owner's (B, S, H, ·) tensor flattened to (B·S·H, ·).
        With ``source``: rows of a payload packed in ``source``'s layout — a relay forwarding a
        subset of what it received (``source.selected`` must cover ``self.selected``).
        """
        bs, S = self.block_size, self.seq_len
        bh, j = torch.nonzero(self.selected, as_tuple=True)
        order = torch.argsort(self.block_ids[bh, j])
        bh, j = bh[order], j[order]
        lens = self.block_len
        within = torch.arange(self.num_rows, device=lens.device) - torch.repeat_interleave(self.block_start, lens)
        if source is not None:
            src_ids = source.block_ids[bh, j]
            assert (src_ids >= 0).all(), "forwarding a block the relay never received"
            return torch.repeat_interleave(source.block_start[src_ids], lens) + within
        s = torch.repeat_interleave(j * bs, lens) + within
        b = torch.repeat_interleave(bh // heads, lens)
        h = torch.repeat_interleave(bh % heads, lens)
        return (b * S + s) * heads + h

    def buffer(self, flat: torch.Tensor, head_dim: int) -> KVBuffer:
        """View a flat payload buffer (K rows, then V rows) as the kernel's ``KVBuffer``.

        The payload occupies ``[0, 2·rows·D)``: K rows then V rows. ``k`` and ``v`` are both
        viewed at the buffer's full capacity (rows past the payload are never addressed), so
        the kernel's shapes are the same on every call of a geometry and both views are
        contiguous, as the flex kernel needs.
        """
        D = head_dim
        cap = flat.numel() // (2 * D)
        k = flat[: cap * D].view(cap, D)
        v = flat[self.num_rows * D: (self.num_rows + cap) * D].view(cap, D)
        return KVBuffer(k, v, self.block_start, self.block_len, self.block_size, self.num_aligned)


def layout(selected: torch.Tensor, seq_len: int, block_size: int) -> Layout:
    """Derive the packed layout of ``selected`` (bool [BH, n]) — the same on both ends."""
    n = selected.shape[1]
    tail = seq_len % block_size != 0
    ids = canonical_block_ids(selected, tail)
    tail_len = seq_len - (n - 1) * block_size
    n_sel = int(selected.sum())
    n_short = int(selected[:, -1].sum()) if tail else 0
    n_full = n_sel - n_short
    device = selected.device
    pos = torch.arange(n_sel, device=device)
    starts = torch.where(pos < n_full, pos * block_size, n_full * block_size + (pos - n_full) * tail_len)
    lens = torch.where(pos < n_full, torch.full_like(pos, block_size), torch.full_like(pos, tail_len))
    rows = n_full * block_size + n_short * tail_len
    return Layout(ids, starts, lens, n_full, rows, selected, seq_len, block_size)


def pack(k: torch.Tensor, v: torch.Tensor, lay: Layout, heads: int, out: torch.Tensor,
         source: Layout | None = None) -> int:
    """Gather the selected blocks into the flat ``out``: K rows, then V rows, in packed order.

    ``k, v`` are the owner's (B, S, H, D) tensors, or with ``source`` the [rows, D] halves of a
    payload packed in that layout (a relay forwarding a subset). Returns the elements written
    (``2 · rows · D``).
    """
    D = k.shape[-1]
    rows = lay.token_rows(heads, source).to(k.device)
    n = lay.num_rows * D
    torch.index_select(k.reshape(-1, D), 0, rows, out=out[:n].view(-1, D))
    torch.index_select(v.reshape(-1, D), 0, rows, out=out[n: 2 * n].view(-1, D))
    return 2 * n


def halves(flat: torch.Tensor, lay: Layout, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V row blocks [rows, D] of a payload packed in ``lay``."""
    n = lay.num_rows * head_dim
    return flat[:n].view(-1, head_dim), flat[n: 2 * n].view(-1, head_dim)


def kernel_indices(mask: torch.Tensor, lay: Layout, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block lists for the kernel: ``mask`` bool [B, H, nQ, n] over one rank's blocks, ``lay``
    the layout those blocks arrived in → (kv_num_blocks int32 [B, H, nQ], kv_indices int32
    [B, H, nQ, width]); ``width`` is fixed per geometry so compiled kernels see static shapes."""
    B, H, nQ, n = mask.shape
    ids = lay.block_ids.view(B, H, 1, n).to(mask.device)
    assert not (mask & (ids < 0)).any(), "a kept block is missing from the payload"
    big = torch.iinfo(torch.int32).max
    keyed = torch.where(mask, ids, torch.full_like(ids, big))
    idx = keyed.sort(dim=-1).values[..., : min(width, n)]
    idx = torch.where(idx == big, torch.zeros_like(idx), idx).to(torch.int32)
    if idx.shape[-1] < width:
        idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]))
    return mask.sum(-1, dtype=torch.int32), idx.contiguous()
