"""``sp_attention``: one entry point, five strategies (DESIGN.md "Baselines").

Data path per call: validate → exchange shapes (one tiny all-gather) → masks (all-reduce of
the key sum, all-gather of pooled keys) → demand → plan → transport → kernel → LSE merge.
"""

from __future__ import annotations

import logging

import torch

from ..config import SparspConfig
from ..plan import exchange_shapes, local_mask
from ..transport import transport_factory
from . import ring, ring_relay, sparsp, ulysses
from .base import Call, validate

log = logging.getLogger("sparsp")

STRATEGIES = {
    "ring": ring.run,
    "ring-sparse": ring.run,
    "ring-relay": ring_relay.run,
    "ulysses": ulysses.run,
    "sparsp": sparsp.run,
}
_DENSE = {"ring"}  # ignores thresholds: the dense baseline
_MASK_SELF = {"ulysses"}  # computes its mask after its own exchange

_transports: dict = {}


def get_transport(name: str, group, device: torch.device, timeout_s: float):
    """The transport for (group, name, device), made once and reused across calls."""
    key = (id(group), name, str(device))
    t = _transports.get(key)
    if t is None:
        try:
            from ..transport.select import make_transport
        except ImportError:  # only the torch.distributed transport is built in
            make_transport = None
        if make_transport is not None:
            t = make_transport(name, group, device=device, timeout_s=timeout_s)
        else:
            t = transport_factory("nccl" if name == "auto" else name)(group, timeout_s=timeout_s, device=device)
        _transports[key] = t
    return t


def close_transports() -> None:
    """Release every cached transport (shared memory, IPC handles); safe to call twice."""
    while _transports:
        _, t = _transports.popitem()
        t.close()


def sp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    strategy: str = "sparsp",
    config: SparspConfig = SparspConfig(),
    _global_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence-parallel block-sparse attention over ``group``.

    ``q, k, v``: this rank's contiguous slice (B, S_local, H, D) of the (already placed)
    sequence; the slices concatenated in rank order form the global sequence, and each slice
    is cut into ``config.block_size`` blocks from its start. Returns this rank's output slice,
    same shape and dtype as ``q``: attention over the global sequence restricted to the block
    mask ``sparsp.masks.block_mask`` computes on the concatenated q and k (exactly so when
    every slice but the last is a whole number of blocks). ``strategy="ring"`` is the dense
    baseline and ignores the thresholds. ``_global_mask`` (bool [B, H, N, N], N = global
    blocks) replaces the CDF mask — for tests.
    """
    validate(q, k, v, group, strategy, config, STRATEGIES)
    shapes = exchange_shapes(q, group, config, strategy, k=k, v=v)
    if _global_mask is not None and _global_mask.shape[-1] != shapes.total_blocks:
        raise ValueError(f"_global_mask has {_global_mask.shape[-1]} blocks, the inputs {shapes.total_blocks}")
    transport = get_transport(config.transport, group, q.device, config.timeout_s)
    reserve = getattr(transport, "reserve", None)
    if reserve is not None:  # slot windows sized for the worst case: a full shard per peer
        reserve(shapes.capacity_rows * 2 * shapes.head_dim * q.element_size())
    transport.fence()
    mask = None
    if strategy not in _DENSE and strategy not in _MASK_SELF:
        if _global_mask is not None:
            mask = _global_mask[:, :, shapes.blocks_of(shapes.rank)].to(q.device)
        elif config.dense:
            mask = torch.ones(shapes.batch, shapes.heads, shapes.num_blocks[shapes.rank], shapes.total_blocks,
                              dtype=torch.bool, device=q.device)
        else:
            mask = local_mask(q, k, shapes, group, config)
    call = Call(q, k, v, shapes, config, group, transport, mask=mask,
                global_mask=None if _global_mask is None else _global_mask.to(q.device))
    with torch.no_grad():
        STRATEGIES[strategy](call)
    return call.result()


__all__ = ["STRATEGIES", "sp_attention", "close_transports", "get_transport"]
