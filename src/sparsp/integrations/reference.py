"""Reference attention in one process, with the masks a group of G ranks would use.

``reference_sp_attention(q, k, v, lens=...)`` emulates the ranks: it takes the whole placed sequence in one process
and returns what ``sp_attention`` returns on the G ranks together: attention restricted to the
block mask that the distributed call computes, with every rank's slice (``lens``) cut into
blocks from its own start, keys centred by the global key mean, block summaries pooled per
slice and concatenated (``sparsp.masks``' split form). So a user sees what sparsity alone
does to a model's output, for the placement and block cut of a given group size, before
going parallel — and tests hold the distributed run to it.

The kernel is the same block-sparse kernel layer the strategies use (``sparsp.kernels``): one
call per (query slice, key slice) pair over a ``KVBuffer`` of that key slice, merged by LSE.
"""

from __future__ import annotations

import torch

from ..config import SparspConfig
from ..kernels import KVBuffer, get_kernel, update_out_and_lse
from ..masks import PooledBlocks, key_sum, pool_blocks, select_blocks
from ..strategies.auto import AUTO
from ..strategies.registry import strategies_where, strategy_spec


def split_block_mask(q: torch.Tensor, k: torch.Tensor, lens: list[int], config: SparspConfig) -> torch.Tensor:
    """The global block mask bool [B, H, N, N] for slices of ``lens`` tokens (N: the blocks of
    all slices, each cut from its own start), exactly as the distributed call computes it."""
    bs, H = config.block_size, q.shape[2]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    center = key_sum(k) / k.shape[1]
    pq = PooledBlocks.cat([pool_blocks(q[:, a:b], bs) for a, b in zip(bounds, bounds[1:])])
    pk = PooledBlocks.cat([pool_blocks(k[:, a:b], bs, center) for a, b in zip(bounds, bounds[1:])])
    return select_blocks(pq, pk, cdf_threshold=config.cdf_tensor(H), sim_threshold=config.sim_tensor(H))


def reference_sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lens: list[int],
                           strategy: str | None = None, config: SparspConfig = SparspConfig(),
                           return_mask: bool = False, mask: torch.Tensor | None = None):
    """Attention of the whole placed sequence ``q, k, v`` (B, S, H, D) under the masks of a
    group whose ranks hold ``lens`` tokens each (``sum(lens) == S``); returns (B, S, H, D)
    (and the mask bool [B, H, N, N] when ``return_mask``). ``strategy``: a registered name
    (None: the primary one, ``sp_attention``'s default); a strategy registered as not sparse
    (the dense baseline) and a dense config attend to everything, as it does distributed.
    ``mask``: a mask to attend under instead of the one these inputs give (a schedule's reuse
    step: the mask of the step that solved the plan)."""
    if sum(lens) != q.shape[1] or any(n < 1 for n in lens):
        raise ValueError(f"lens {lens} must be positive and sum to the {q.shape[1]} tokens of q")
    B, S, H, D = q.shape
    bs = config.block_size
    nblocks = [-(-n // bs) for n in lens]
    primary = strategies_where(primary=True)[0]
    strategy = primary if strategy is None else strategy
    if strategy == AUTO:
        raise ValueError(f"strategy={AUTO!r} picks a strategy per call from the group's own demand; "
                         f"the single-process sparse processor needs a fixed one (e.g. {primary!r})")
    if mask is not None:
        if tuple(mask.shape) != (B, H, sum(nblocks), sum(nblocks)):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; these inputs need "
                             f"{(B, H, sum(nblocks), sum(nblocks))}")
    elif not strategy_spec(strategy).sparse or config.dense:
        mask = torch.ones(B, H, sum(nblocks), sum(nblocks), dtype=torch.bool, device=q.device)
    else:
        mask = split_block_mask(q, k, lens, config)
    kernel = get_kernel(config.kernel, q.device)
    scale = D ** -0.5
    starts = [sum(lens[:i]) for i in range(len(lens))]
    bstarts = [sum(nblocks[:i]) for i in range(len(nblocks))]
    buffers = [_dense_buffer(k[:, a:a + n], v[:, a:a + n], bs) for a, n in zip(starts, lens)]
    outs = []
    for r, (a, n) in enumerate(zip(starts, lens)):
        qh = q[:, a:a + n].permute(0, 2, 1, 3).contiguous()  # (B, H, n, D)
        out = lse = None
        rows = mask[:, :, bstarts[r]:bstarts[r] + nblocks[r]]
        for p, (kv, block_id) in enumerate(buffers):
            sel = rows[..., bstarts[p]:bstarts[p] + nblocks[p]]  # [B, H, nq, nk]
            if not sel.any():
                continue
            num, idx = _block_lists(sel, block_id.to(q.device))
            o, l = kernel(qh, kv, num, idx, scale=scale)
            out, lse = update_out_and_lse(out, lse, o, l)
        outs.append(torch.zeros_like(qh, dtype=torch.float32) if out is None else out)
    result = torch.cat(outs, dim=2).permute(0, 2, 1, 3).to(q.dtype).contiguous()
    return (result, mask) if return_mask else result


def _dense_buffer(k: torch.Tensor, v: torch.Tensor, bs: int) -> tuple[KVBuffer, torch.Tensor]:
    """Every block of one slice ``k, v`` (B, n, H, D) as a ``KVBuffer`` in the kernels'
    canonical order (full blocks row-major over (batch·head, block), then the short tail block
    of each batch·head), and the buffer id of every block: long [B·H, n_blocks]."""
    B, n, H, D = k.shape
    full, tail = divmod(n, bs)
    BH = B * H

    def rows(x):  # (B, n, H, D) -> full-block rows, then tail rows
        seg = x.permute(0, 2, 1, 3).reshape(BH, n, D)
        return torch.cat([seg[:, : full * bs].reshape(-1, D), seg[:, full * bs:].reshape(-1, D)])

    nfull = BH * full
    ntail = BH if tail else 0
    start = torch.cat([torch.arange(nfull) * bs, nfull * bs + torch.arange(ntail) * tail]).to(k.device)
    length = torch.cat([torch.full((nfull,), bs), torch.full((ntail,), tail)]).to(k.device)
    ids = torch.arange(nfull).view(BH, full)
    if tail:
        ids = torch.cat([ids, (nfull + torch.arange(BH)).view(BH, 1)], dim=1)
    return KVBuffer(rows(k), rows(v), start, length, bs, nfull), ids


def _block_lists(sel: torch.Tensor, block_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel block lists from a mask over one key slice: (num int32 [B, H, nq], ids int32
    [B, H, nq, nk]) with the kept buffer block ids first (the rest padded with 0)."""
    B, H, nq, nk = sel.shape
    ids = block_id.view(B, H, 1, nk).expand(B, H, nq, nk)
    big = torch.iinfo(torch.int32).max
    keyed = torch.where(sel, ids, torch.full_like(ids, big)).sort(dim=-1).values
    keyed = torch.where(keyed == big, torch.zeros_like(keyed), keyed)
    return sel.sum(-1, dtype=torch.int32), keyed.to(torch.int32).contiguous()
