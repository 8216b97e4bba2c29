"""What every strategy shares: input validation, the per-call context, kernel + merge.

Strategies own communication (through a ``Transport``) and call the kernel through
``Call.attend``; the merge is the single ``update_out_and_lse`` (STYLE.md §3–4), so a
comparison between strategies measures only how K/V moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import SparspConfig
from ..kernels import KVBuffer, get_kernel
from ..kernels.merge import update_out_and_lse
from ..plan import Layout, Shapes, kernel_indices, layout, pack

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def validate(q, k, v, group, strategy: str, config: SparspConfig, strategies) -> None:
    """Every check that needs no communication; raises ``ValueError`` naming the argument."""
    if not isinstance(strategy, str) or strategy not in strategies:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(strategies)}")
    if not isinstance(config, SparspConfig):
        raise ValueError(f"config must be a sparsp.SparspConfig, got {type(config).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, S_local, H, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, _FLOATS))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             f"call .contiguous() on it first")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape "
                         f"(self-attention over the same local tokens)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call dist.init_process_group first "
                         "(torchrun), or pass group=")
    backend = dist.get_backend(group)
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"the process group uses NCCL but q is on {q.device}; move q, k, v to the GPU")
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}")
    G = dist.get_world_size(group)
    if strategy == "ulysses" and q.shape[2] % G:
        raise ValueError(f"ulysses needs heads divisible by the group size: H={q.shape[2]}, G={G}")
    if isinstance(config.cdf_threshold, tuple) and len(config.cdf_threshold) != q.shape[2]:
        raise ValueError(f"config.cdf_threshold has {len(config.cdf_threshold)} values for {q.shape[2]} heads")
    if isinstance(config.sim_threshold, tuple) and len(config.sim_threshold) != q.shape[2]:
        raise ValueError(f"config.sim_threshold has {len(config.sim_threshold)} values for {q.shape[2]} heads")


@dataclass
class Call:
    """One attention call on one rank: inputs in kernel layout, accumulators, helpers."""

    q: torch.Tensor  # (B, S, H, D) as given
    k: torch.Tensor
    v: torch.Tensor
    shapes: Shapes
    config: SparspConfig
    group: object
    transport: object
    mask: torch.Tensor | None = None  # bool [B, H, n_local, total_blocks], None for dense
    global_mask: torch.Tensor | None = None  # tests: a given mask [B, H, N, N] instead of CDF
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kernel = get_kernel(self.config.kernel, self.q.device)
        self.q_hm = self.q.permute(0, 2, 1, 3).contiguous()  # (B, H, S, D), once per call
        self.out = None
        self.lse = None
        self.scale = self.q.shape[-1] ** -0.5
        self.final: torch.Tensor | None = None  # a strategy that assembles its own output

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

    def payload_buffer(self) -> torch.Tensor:
        """A flat buffer that holds any rank's full shard (static shape for compiled kernels)."""
        return torch.empty(self.shapes.capacity_rows * 2 * self.q.shape[-1], dtype=self.q.dtype,
                           device=self.q.device)

    def full_layout(self, p: int) -> Layout:
        """Every block of rank p's shard (what a dense ring carries)."""
        n = self.shapes.num_blocks[p]
        sel = torch.ones(self.bh, n, dtype=torch.bool, device=self.q.device)
        return layout(sel, self.shapes.seq_lens[p], self.shapes.block_size)

    def layout_of(self, selected: torch.Tensor, p: int) -> Layout:
        """Layout of ``selected`` (bool [B, H, n_p]) blocks of rank p's shard."""
        return layout(selected.reshape(self.bh, -1), self.shapes.seq_lens[p], self.shapes.block_size)

    def pack_local(self, lay: Layout, out: torch.Tensor) -> int:
        """Pack this rank's selected K/V blocks into ``out``; returns elements written."""
        return pack(self.k, self.v, lay, self.shapes.heads, out)

    def rows_for(self, origin: int) -> torch.Tensor:
        """This rank's mask rows against ``origin``'s blocks: bool [B, H, n_local, n_origin]
        (all True when the call is dense)."""
        n = self.shapes.num_blocks[origin]
        if self.mask is None:
            B, H, S, _ = self.q_hm.shape
            nq = self.shapes.num_blocks[self.rank]
            return torch.ones(B, H, nq, n, dtype=torch.bool, device=self.q.device)
        return self.mask[..., self.shapes.blocks_of(origin)]

    def attend(self, payload: torch.Tensor, lay: Layout, origin: int) -> None:
        """Run the kernel of the local queries over ``payload`` (a flat buffer holding blocks
        packed in ``lay`` from rank ``origin``'s shard) and merge the partial result.

        The kernel sees the whole fixed-capacity buffer, so its shapes never change between
        calls of one geometry (no recompilation of the flex kernel)."""
        rows = self.rows_for(origin)
        if not rows.any():
            return
        kv_num, kv_idx = kernel_indices(rows, lay, self.width)
        buf: KVBuffer = lay.buffer(payload, self.q.shape[-1])
        o, l = self.kernel(self.q_hm, buf, kv_num, kv_idx, scale=self.scale)
        self.out, self.lse = update_out_and_lse(self.out, self.lse, o, l)

    def result(self) -> torch.Tensor:
        """The merged output in the caller's layout and dtype, (B, S, H, D)."""
        if self.final is not None:
            return self.final
        if self.out is None:  # no block selected at all (cannot happen: ≥ 1 block per row)
            return torch.zeros_like(self.q)
        return self.out.permute(0, 2, 1, 3).to(self.q.dtype).contiguous()


def flush(transport) -> None:
    """Issue queued publishes now (only transports that batch sends with fetches queue any)."""
    f = getattr(transport, "flush", None)
    if f is not None:
        f()
