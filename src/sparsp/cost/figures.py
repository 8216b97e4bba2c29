"""Demand figures: what a call's block masks ask of each rank, as exact integers.

``Blocks`` says where the blocks of a mask live (a placement's original order, or one call's
placed order, where each rank's slice is cut into blocks from its start); ``measure`` reduces
masks bool [batch·heads, nB, nB] to a ``Demand`` (kept token pairs per pair of ranks and per
head, the K/V tokens each rank asks of each peer, optionally a relay ring's per-hop demand)
with one host transfer. ``demand_figures`` is the device half of it (no host sync: the plan
stage computes it inside its CUDA graph for ``strategy="auto"``), ``demand_of`` the host half.
The bytes and FLOPs of every strategy follow from these integers (``cost.model.work``).

A call's own figures: ``call_figures`` on its whole mask (placed order, ``call_blocks``) is
what its plan stage reads with the counts, for ``auto``'s choice (``demand_of``) and for the
kept work per head a head-sharded strategy balances its ranks by (``head_pairs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..caches import per_geometry
from ..demand import rank_figures, rank_figures_ok, remote_demand
from ..placement import Placement

__all__ = ["Blocks", "Demand", "call_blocks", "call_figures", "demand_figures", "demand_of", "full_demand",
           "head_pairs", "measure", "pair_flops"]


@dataclass(frozen=True)
class Blocks:
    """Where the blocks of a mask live: the rank and real token count of every block, in the
    mask's own order — a placement's original order (``of``) or a call's placed order, where
    each rank's slice is cut into blocks from its start (``of_call``)."""

    owner: torch.Tensor  # long [nB]
    lengths: torch.Tensor  # long [nB]
    ranks: int
    tokens: tuple[int, ...]  # tokens per rank
    block_size: int  # the longest block
    short: torch.Tensor  # long: blocks shorter than the longest (tail blocks), few
    rows: tuple[slice, ...] | None = None  # each rank's blocks as a slice (placed order: no host sync)
    _consts: dict = field(default_factory=dict, compare=False, repr=False)

    def constants(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lengths, lengths × owner one-hot [nB, G], owner one-hot [nB, G], the lengths of the
        blocks remote to each rank [G, nB]) on ``device``, float64 but the first; made once per
        ``Blocks`` and device (``strategy="auto"`` keeps one ``Blocks`` per geometry, so a
        captured plan stage only reads them)."""
        key = str(device)
        got = self._consts.get(key)
        if got is None:
            L = self.lengths.to(device)
            onehot = (self.owner.to(device)[:, None]
                      == torch.arange(self.ranks, device=device)[None, :]).double()
            got = self._consts[key] = (L, L.double()[:, None] * onehot, onehot,
                                       (1.0 - onehot.T) * L.double()[None, :])
        return got

    def bounds(self, device) -> torch.Tensor:
        """int32 [G, 2]: each rank's first and past-last block (``rows``, placed order), on
        ``device``; made once per ``Blocks`` and device (read by a captured plan stage)."""
        key = ("bounds", str(device))
        got = self._consts.get(key)
        if got is None:
            assert self.rows is not None, "bounds need the placed order's rank slices"
            got = self._consts[key] = torch.tensor([[r.start, r.stop] for r in self.rows],
                                                   dtype=torch.int32, device=device)
        return got

    @staticmethod
    def of(placement: Placement) -> "Blocks":
        L = placement.geometry.block_lengths()
        short = torch.nonzero(L != L.max()).flatten()
        return Blocks(placement.owner, L, placement.ranks, tuple(placement.tokens_per_rank),
                      int(L.max()), short)

    @staticmethod
    def of_call(seq_lens: tuple[int, ...], block_size: int, device=None) -> "Blocks":
        """Rank p's ``seq_lens[p]`` tokens cut into blocks of ``block_size`` from its start."""
        lengths, owner, rows, short, start = [], [], [], [], 0
        for p, n_tok in enumerate(seq_lens):
            n = -(-n_tok // block_size)
            lens = [block_size] * n
            lens[-1] = n_tok - (n - 1) * block_size
            if lens[-1] != block_size:
                short.append(start + n - 1)
            lengths += lens
            owner += [p] * n
            rows.append(slice(start, start + n))
            start += n
        return Blocks(torch.tensor(owner, device=device), torch.tensor(lengths, device=device),
                      len(seq_lens), tuple(seq_lens), block_size, torch.tensor(short, dtype=torch.long, device=device),
                      tuple(rows))


@dataclass(frozen=True)
class Demand:
    """What one call's masks ask of each rank, as exact host integers (tokens, not bytes).

    ``pairs[r][p]``: kept (query token, key token) pairs of r's queries against p's keys, over
    every head; ``direct[r][p]``: K/V tokens·heads rank r demands of peer p (``D[r,·,p]``, §4.1);
    ``head_pairs[h]``: kept pairs of head h over the whole sequence, summed over the batch;
    ``relay[r][k-1]``: tokens·heads hop k into r carries in a relay ring (only when measured).
    """

    ranks: int
    batch: int
    heads: int  # per batch element
    blocks: int
    tokens: tuple[int, ...]
    pairs: tuple[tuple[int, ...], ...]
    direct: tuple[tuple[int, ...], ...]
    head_pairs: tuple[int, ...]
    relay: tuple[tuple[int, ...], ...] | None = None
    block_size: int = 0  # the longest block (0: unknown, the blocks split evenly over the ranks)

    def rounded(self, digits: int = 2) -> "Demand":
        """Every figure to ``digits`` significant digits (a cache key for ``strategy="auto"``,
        whose choice must not hinge on a few blocks)."""
        def r(x: int) -> int:  # round half to even at the digit kept, as a decimal rounding does
            return round(x, digits - len(str(abs(x)))) if x else 0

        def rows(t):
            return None if t is None else tuple(tuple(r(x) for x in row) for row in t)

        return replace(self, pairs=rows(self.pairs), direct=rows(self.direct),
                       head_pairs=tuple(r(x) for x in self.head_pairs), relay=rows(self.relay))


def full_demand(d: Demand) -> Demand:
    """The demand of a full mask on ``d``'s ranks, tokens and heads: every (query, key) pair
    kept, every remote token demanded (a dense step's, through the strategy's dense path)."""
    G, BH, t = d.ranks, d.batch * d.heads, d.tokens
    pairs = tuple(tuple(BH * t[r] * t[p] for p in range(G)) for r in range(G))
    direct = tuple(tuple(0 if p == r else BH * t[p] for p in range(G)) for r in range(G))
    relay = None if d.relay is None else tuple(tuple(BH * t[(r - k) % G] for k in range(1, G)) for r in range(G))
    return replace(d, pairs=pairs, direct=direct, head_pairs=(d.batch * sum(t) ** 2,) * d.heads, relay=relay)


def _pair_tokens(masks: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Float64 [G, G] (exact integers): kept (query token, key token) pairs, all heads:
    Σ_h (L·onehot)ᵀ M_h (L·onehot)."""
    _, lo, _, _ = blocks.constants(masks.device)
    return lo.T @ masks.sum(dim=0).double() @ lo


def measure(masks: torch.Tensor, blocks: Blocks, *, batch: int = 1, relay: bool = False) -> Demand:
    """The ``Demand`` of masks bool [batch·heads, nB, nB] (batch-major) on any device, with one
    host transfer; ``relay`` adds the relay ring's per-hop demand (G² more reductions)."""
    figures = demand_figures(masks, blocks, batch=batch, relay=relay)
    return demand_of([round(x) for x in figures.cpu().tolist()], blocks, masks.shape[0], masks.shape[-1],
                     batch=batch, relay=relay)


def demand_of(host: list[int], blocks: Blocks, rows: int, nB: int, *, batch: int = 1,
              relay: bool = False) -> Demand:
    """The ``Demand`` from ``demand_figures``' values on the host (integers)."""
    G = blocks.ranks
    pairs_h, direct_h = host[: G * G], host[G * G: 2 * G * G]
    heads_h = host[2 * G * G: 2 * G * G + rows // batch]
    relay_h = host[2 * G * G + rows // batch:]
    grid = lambda xs, w: tuple(tuple(xs[i * w:(i + 1) * w]) for i in range(G))  # noqa: E731
    return Demand(G, batch, rows // batch, nB, tuple(blocks.tokens), grid(pairs_h, G), grid(direct_h, G),
                  tuple(heads_h), grid(relay_h, G - 1) if relay else None, blocks.block_size)


def _column_figures(masks: torch.Tensor, blocks: Blocks, batch: int) -> torch.Tensor:
    """``demand_figures`` (without ``relay``) from one pass over the mask
    (``demand.rank_figures``: one kernel into one zeroed output; the torch form makes four
    passes and a dozen small ops), the same exact sums."""
    L = blocks.constants(masks.device)[0]
    return rank_figures(masks, blocks.bounds(masks.device), L, masks.shape[0] // batch, blocks.rows)


def demand_figures(masks: torch.Tensor, blocks: Blocks, *, batch: int = 1, relay: bool = False) -> torch.Tensor:
    """float64 [2G² + heads (+ G(G−1) with ``relay``)] on the masks' device: the exact sums
    ``demand_of`` reads (device ops only, no host sync: a captured plan stage may hold them)."""
    masks = masks.bool()
    G, BH = blocks.ranks, masks.shape[0]
    if BH % batch:
        raise ValueError(f"{BH} mask rows do not split into a batch of {batch}")
    device = masks.device
    L, _, onehot, remote = blocks.constants(device)
    if blocks.rows is not None and not relay and rank_figures_ok(masks):
        return _column_figures(masks, blocks, batch)
    pairs = _pair_tokens(masks, blocks)
    if blocks.rows is None:  # analysis order: the one demand function (boolean row selection)
        need = remote_demand(masks, blocks.owner.to(device), G)
    else:  # a call's placed order: each rank's rows are a slice; its own blocks drop out below
        need = torch.stack([masks[:, rows, :].any(dim=-2) for rows in blocks.rows])
    direct = (need.sum(dim=1).double() * remote) @ onehot  # [r, p] token-heads, remote blocks only
    # kept pairs per head without a [BH, nB, nB] integer temporary: every block has the
    # longest length but the few short ones, corrected column by column
    full = blocks.block_size
    inner = masks.sum(dim=-1) * full  # [BH, nB]: Σ_k M·L_k if every key block were full
    if blocks.short.numel():
        idx = blocks.short.to(device)
        inner = inner + (masks[..., idx].long() * (L[idx] - full)).sum(dim=-1)
    head_pairs = (inner * L).sum(dim=-1).view(batch, BH // batch).sum(dim=0).double()
    parts = [pairs.flatten(), direct.flatten(), head_pairs]
    if relay:
        owner = blocks.owner.to(device)
        hops = torch.zeros(G, max(G - 1, 1), dtype=torch.float64, device=device)
        for p in range(G):
            mine = (owner == p)[None, :]
            downstream = torch.zeros_like(need[0])
            for k in range(G - 1, 0, -1):  # from the far end of the ring back to p+1
                r = (p + k) % G
                downstream |= need[r] & mine
                hops[r, k - 1] = (downstream.long() * L).sum()
        parts.append(hops[:, : G - 1].flatten())
    return torch.cat(parts)


_CALL_BLOCKS = per_geometry("cost: a call's blocks in placed order")  # (seq_lens, block_size, device) -> Blocks


def call_blocks(shapes, device) -> Blocks:
    """``Blocks.of_call`` of a call's ``shapes`` (``plan.Shapes``: ``seq_lens``, ``block_size``)
    on ``device``, made once per geometry: its device constants are read by a captured plan
    stage, and a host-to-device copy per call would sync."""
    key = (shapes.seq_lens, shapes.block_size, str(device))
    blocks = _CALL_BLOCKS.get(key)
    if blocks is None:
        blocks = _CALL_BLOCKS[key] = Blocks.of_call(shapes.seq_lens, shapes.block_size, device)
    return blocks


def call_figures(mask: torch.Tensor, shapes) -> torch.Tensor:
    """``demand_figures`` of a call's whole mask bool [B, H, N, N] (``shapes``: ``plan.Shapes``),
    on the mask's device (device ops only: the call copies them to the host with its counts,
    in its one host read)."""
    B, H, N = shapes.batch, shapes.heads, shapes.total_blocks
    return demand_figures(mask.reshape(B * H, N, N), call_blocks(shapes, mask.device), batch=B)


def head_pairs(host: list[int], shapes) -> list[int]:
    """Kept token pairs per head, from ``call_figures`` read on the host (what a head-sharded
    strategy balances its ranks by, ``ulysses``)."""
    G = shapes.world_size
    return host[2 * G * G: 2 * G * G + shapes.heads]


def pair_flops(masks: torch.Tensor, placement: Placement, head_dim: int, dense: bool = False) -> torch.Tensor:
    """Float64 [G, G]: kept-block FLOPs of rank r's queries against origin p's keys, all heads
    (4 · q_len · k_len · head_dim per kept (head, q block, k block): QKᵀ and PV)."""
    if dense:
        masks = torch.ones_like(masks, dtype=torch.bool)
    return 4.0 * head_dim * _pair_tokens(masks.bool(), Blocks.of(placement))
