"""What a rank summarises of its q and k, and the metadata row that carries it (paper §4.2).

Every call starts with one all-gather of a float32 row per rank (``sparsp.plan``): the header
(``sparsp.wire``), then this rank's summaries, then zeros up to the group's capacity. The
summaries of a sparse call, similarity off (the default), are q's and k's block sums,
token-major as the inputs are (``block_sums``), and v's partial sums for the non-finite check
(``check_parts``); the means, the key mean and the layout the mask wants are made from the
gathered rows (``PooledBlocks.from_sums``), in the plan stage. With similarity on they are
pooled means and similarities around the all-reduced key mean, and k's sum (``summarize``).
A dense call sends q's, k's and v's sums for the check alone.

One row, made one of three ways, all here:

* on CUDA, one Triton kernel (``summaries_into``) sums q, k and v in one pass, straight into
  the send row kept per geometry and capacity (``kept_row``); the all-gather's output is kept
  beside it (``gathered_rows``), and a captured plan stage reads it in place;
* from a geometry's second call on, a CUDA graph of that launch replays instead
  (``SumsTable``: the kernel reads its inputs at offsets the host writes into a pinned table):
  the host writes three integers and launches a graph, not a Triton launch that binds and
  specialises its arguments in Python on every call;
* elsewhere (the CPU, inputs the kernel does not take, similarity on) with torch ops
  (``torch_summaries``) into a new row (``padded_row``).

Every CUDA caller of ``block_sums`` (``pool_blocks``, ``sparsp.masks.split_mask``, the row)
gets the kernel's bits, so the distributed mask and ``split_mask``'s agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import runs, tl, triton
from .caches import captured_on_second_sight, lru_get, per_geometry

# --- per-geometry constants ---------------------------------------------------------------

_CONSTANTS = per_geometry("summaries: block lengths and zeros")


def block_lengths(S: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens per block of a slice of ``S`` tokens: long [n] and float32 [1, 1, n, 1]
    (the pooling's divisor), on ``device``, made once per (S, block_size, device): a pageable
    host-to-device copy syncs the stream, and the per-call ops count (read-only, shared)."""
    key = ("lengths", S, block_size, str(device))
    got = _CONSTANTS.get(key)
    if got is None:
        n = math.ceil(S / block_size)
        lengths = torch.full((n,), block_size, dtype=torch.long)
        lengths[-1] = S - (n - 1) * block_size
        got = (lengths.to(device), lengths.to(device, torch.float32)[None, None, :, None])
        _CONSTANTS[key] = got
    return got


def cached_zeros(shape, device) -> torch.Tensor:
    """float32 zeros of ``shape`` on ``device``, made once per shape (read-only, shared): the
    ``sim`` of summaries pooled without similarity, the padding of the metadata row."""
    key = ("zeros", tuple(shape), str(device))
    got = _CONSTANTS.get(key)
    if got is None:
        got = _CONSTANTS[key] = torch.zeros(shape, dtype=torch.float32, device=device)
    return got


def check_block(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive int (tokens per block)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per block), got {value!r}")


# --- pooled blocks ------------------------------------------------------------------------


@dataclass(frozen=True)
class PooledBlocks:
    """Block summaries. ``mean``: [B, H, n, D] float32; ``sim``: [B, H, n] float32;
    ``lengths``: LongTensor [n] real tokens per block."""

    mean: torch.Tensor
    sim: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.mean.shape[2]

    def centered(self, center: torch.Tensor) -> "PooledBlocks":
        """Means minus ``center`` [B, H, D] (key smoothing after pooling; ``sim`` unchanged,
        so only for summaries pooled without similarity)."""
        return PooledBlocks(self.mean - center.float()[:, :, None, :], self.sim, self.lengths)

    @staticmethod
    def from_sums(sums: torch.Tensor, S: int, block_size: int) -> "PooledBlocks":
        """Summaries of a slice of ``S`` tokens from its block sums (``block_sums``, float32
        (B, n, H, D)): the means divided by each block's real length, similarity off (zero).
        The same arithmetic as ``pool_blocks`` without similarity, so the same bits."""
        lengths, denom = block_lengths(S, block_size, sums.device)
        mean = sums.permute(0, 2, 1, 3) / denom
        return PooledBlocks(mean, cached_zeros(mean.shape[:-1], mean.device), lengths)

    @staticmethod
    def cat(parts: list["PooledBlocks"]) -> "PooledBlocks":
        """Concatenate summaries along the block dim (rank order = global order)."""
        return PooledBlocks(
            torch.cat([p.mean for p in parts], dim=2),
            torch.cat([p.sim for p in parts], dim=2),
            torch.cat([p.lengths for p in parts]),
        )


def key_sum(k: torch.Tensor) -> torch.Tensor:
    """Sum of k over the sequence, float32 [B, H, D] (all-reduced across ranks in SP)."""
    return k.sum(dim=1, dtype=torch.float32)


def pool_blocks(x: torch.Tensor, block_size: int, center: torch.Tensor | None = None, *,
                similarity: bool = True) -> PooledBlocks:
    """Pool ``x`` (B, S, H, D) into blocks of ``block_size`` tokens; ``center`` (B, H, D) is
    subtracted from every token first (key smoothing). ``similarity=False`` skips the block
    self-similarity (a pass over normalised tokens) and leaves ``sim`` zero."""
    if x.dim() != 4:
        raise ValueError(f"expected (B, S, H, D), got shape {tuple(x.shape)}")
    check_block("block_size", block_size)
    B, S, H, D = x.shape
    if center is None and not similarity:  # the common case
        return PooledBlocks.from_sums(block_sums(x, block_size), S, block_size)
    n = math.ceil(S / block_size)
    pad = n * block_size - S
    lengths, denom = block_lengths(S, block_size, x.device)
    xf = x.float().permute(0, 2, 1, 3)  # (B, H, S, D)
    if center is not None:
        xf = xf - center.float()[:, :, None, :]
    if pad:
        # Zero padding adds nothing to sums; dividing by the real length gives the mean.
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    blocks = xf.reshape(B, H, n, block_size, D)
    mean = blocks.sum(dim=3) / denom
    if similarity:
        unit = torch.nn.functional.normalize(blocks, dim=-1)  # zero rows stay zero
        sim = (unit.sum(dim=3) / denom).square().sum(dim=-1)
    else:
        sim = cached_zeros(mean.shape[:-1], mean.device)
    return PooledBlocks(mean, sim, lengths)


def summarize(q: torch.Tensor, k: torch.Tensor, block_size: int, *, center: torch.Tensor | None = None,
              similarity: bool = False) -> tuple[PooledBlocks, PooledBlocks, torch.Tensor]:
    """One slice's share of the split form: pooled queries, pooled keys and the key sum.

    Keys are pooled raw (``center=None``; centre them after the gather with
    ``PooledBlocks.centered``) or, when the similarity needs smoothed keys, around ``center``.
    """
    pq = pool_blocks(q, block_size, similarity=similarity)
    pk = pool_blocks(k, block_size, center=center, similarity=similarity)
    return pq, pk, key_sum(k)


# --- block sums: the summing kernel ---------------------------------------------------------


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 (B, n, H, D): the sum of each block's tokens of ``x`` (B, S, H, D), straight from
    x's own layout and accumulated in float32, without a float32 copy of x (a full-size
    tensor per call at video sizes); a short last block sums its real tokens. Token-major, as
    x is: what a rank sends in the metadata all-gather, divided by the block lengths only
    after the gather (``PooledBlocks.from_sums``). On CUDA the summing kernel of
    ``summaries_into`` makes them, so every caller gets the same bits."""
    B, S, H, D = x.shape
    if fused_sums(x):
        out = torch.empty(B, math.ceil(S / block_size), H, D, dtype=torch.float32, device=x.device)
        summaries_into(out.view(-1), block_size, x)
        return out
    full = (S // block_size) * block_size
    sums = x[:, :full].reshape(B, S // block_size, block_size, H, D).sum(2, dtype=torch.float32)
    if full < S:
        sums = torch.cat([sums, x[:, full:].sum(1, keepdim=True, dtype=torch.float32)], 1)
    return sums


SUM_FEATURES = 256
"""Features (of a token's H·D) one program of the summing kernel sums; v's check writes one
partial sum per (batch, block, feature chunk)."""


def fused_sums(*xs: torch.Tensor | None) -> bool:
    """Whether ``summaries_into``'s kernel sums these (B, S, H, D) tensors: a Triton kernel runs
    on them (``_triton.runs``: CUDA, the kernels not switched off), and each token's H·D
    features are contiguous (batch and sequence strides are free: q, k, v cut from one fused
    projection qualify)."""
    given = [x for x in xs if x is not None]
    return runs(given[0]) and all(
        x.device == given[0].device and x.stride(3) == 1 and x.stride(2) == x.shape[3] for x in given)


def check_parts(B: int, n: int, features: int) -> int:
    """Values ``summaries_into`` writes for v's non-finite check (one per program)."""
    return B * n * -(-features // SUM_FEATURES)


if triton is not None:
    @triton.jit
    def _sums(a_ptr, b_ptr, c_ptr, out_ptr, tab_ptr, S, n, F, plane, a_b, a_s, b_b, b_s, c_b, c_s,
              BS: tl.constexpr, TOK: tl.constexpr, FCH: tl.constexpr, HAS_B: tl.constexpr,
              HAS_C: tl.constexpr, OFFSETS: tl.constexpr, ALIGN: tl.constexpr):
        # one program (one warp): one block of one batch element, FCH features; a's and b's
        # sums per feature, c's one partial sum. Each step loads a TOK-token tile of every
        # tensor (all in flight at once); each thread holds every row of its columns, so the
        # sum over the tile's rows stays in registers. A tensor's sum is the same sequence of
        # adds whatever else is summed beside it, so a tensor summed alone (``block_sums``)
        # gets the bits it gets in the metadata row.
        # OFFSETS: a, b and c lie at the one pointer passed plus the element offsets in
        # ``tab_ptr`` (int64 [3], whole multiples of ALIGN elements: 16 bytes), read on the
        # device, so that a CUDA graph replays this launch for new tensors (``SumsTable``)
        if OFFSETS:
            a_ptr += tl.multiple_of(tl.load(tab_ptr), ALIGN)
            b_ptr += tl.multiple_of(tl.load(tab_ptr + 1), ALIGN)
            c_ptr += tl.multiple_of(tl.load(tab_ptr + 2), ALIGN)
        row = tl.program_id(0)
        fc = tl.program_id(1)
        bi = (row // n).to(tl.int64)
        f = fc * FCH + tl.arange(0, FCH)
        live_f = f < F
        first = (row % n) * BS
        acc_a = tl.zeros([FCH], dtype=tl.float32)
        acc_b = tl.zeros([FCH], dtype=tl.float32)
        acc_c = tl.zeros([FCH], dtype=tl.float32)
        for t in range(0, BS, TOK):
            within = t + tl.arange(0, TOK)
            s = first + within
            m = ((within < BS) & (s < S))[:, None] & live_f[None, :]
            s = s.to(tl.int64)[:, None]
            xa = tl.load(a_ptr + bi * a_b + s * a_s + f[None, :], mask=m, other=0.0)
            if HAS_B:
                xb = tl.load(b_ptr + bi * b_b + s * b_s + f[None, :], mask=m, other=0.0)
                acc_b += tl.sum(xb.to(tl.float32), 0)
            if HAS_C:
                xc = tl.load(c_ptr + bi * c_b + s * c_s + f[None, :], mask=m, other=0.0)
                acc_c += tl.sum(xc.to(tl.float32), 0)
            acc_a += tl.sum(xa.to(tl.float32), 0)
        at = row.to(tl.int64) * F + f
        tl.store(out_ptr + at, acc_a, mask=live_f)
        if HAS_B:
            tl.store(out_ptr + plane + at, acc_b, mask=live_f)
        if HAS_C:
            tl.store(out_ptr + 2 * plane + row * tl.num_programs(1) + fc, tl.sum(acc_c, 0))


def summaries_into(out: torch.Tensor, block_size: int, a: torch.Tensor, b: torch.Tensor | None = None,
                   c: torch.Tensor | None = None, *, table: "SumsTable | None" = None) -> None:
    """One kernel over (B, S, H, D) tensors of one shape: ``out`` (float32, flat) = a's block
    sums (B, n, H, D), then b's, then ``check_parts`` partial sums of c (the metadata row's
    summaries: q, k and v's non-finite check). A short last block sums its real tokens. CUDA
    (``fused_sums``); on CPU tensors in Triton's interpreter. ``table``: the kernel reads a, b
    and c where ``table``'s device offsets say (``SumsTable``: a CUDA graph of this launch sums
    new tensors of the same shape and strides); a, b, c give only their shapes and strides
    then."""
    B, S, H, D = a.shape
    n, F = math.ceil(S / block_size), H * D
    plane = B * n * F
    need = plane * (1 + (b is not None)) + (check_parts(B, n, F) if c is not None else 0)
    if out.numel() != need or out.dtype != torch.float32:
        raise ValueError(f"summaries_into needs a float32 output of {need} values, got {out.numel()} "
                         f"{out.dtype}")
    if c is not None and b is None:
        raise ValueError("summaries_into: c (the check's tensor) comes with b")
    for x in (b, c):
        if x is not None and x.shape != a.shape:
            raise ValueError(f"summaries_into: shapes differ, {tuple(a.shape)} and {tuple(x.shape)}")
    bb, cc = (b if b is not None else a), (c if c is not None else a)
    tok = min(16, triton.next_power_of_2(block_size))
    pa, pb, pc = (a, bb, cc) if table is None else (table.base,) * 3
    _sums[(B * n, triton.cdiv(F, SUM_FEATURES))](
        pa, pb, pc, out, out if table is None else table.device, S, n, F, plane, a.stride(0), a.stride(1),
        bb.stride(0), bb.stride(1), cc.stride(0), cc.stride(1), BS=block_size, TOK=tok, FCH=SUM_FEATURES,
        HAS_B=b is not None, HAS_C=c is not None, OFFSETS=table is not None,
        ALIGN=max(1, SumsTable.ALIGN_BYTES // a.element_size()), num_warps=1)


class SumsTable:
    """Where ``summaries_into`` finds its inputs when a CUDA graph replays it: element offsets
    of a, b and c from one fixed ``base`` allocation of their dtype, written on the host into
    pinned memory (``set``) and copied to the device by the graph itself (``upload``, captured
    as the graph's first node: a replay reads what the host wrote last). Offsets are whole
    multiples of 16 bytes (``fits``), so the kernel's loads stay vectorised.

    The host may rewrite the table only once the device has run the previous replay's copy:
    the metadata step's caller reads the device back (the call's one host read) before its next
    call, which orders them."""

    ALIGN_BYTES = 16

    def __init__(self, dtype: torch.dtype, device) -> None:
        self.base = torch.empty(self.ALIGN_BYTES, dtype=dtype, device=device)
        self.host = torch.zeros(3, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        self.device = torch.zeros(3, dtype=torch.int64, device=device)
        self._values = self.host.numpy()
        self._origin, self._size = self.base.data_ptr(), self.base.element_size()

    def fits(self, *xs: torch.Tensor) -> bool:
        """Whether every tensor is of the base's dtype and device and 16-byte aligned."""
        return all(x.dtype == self.base.dtype and x.device == self.base.device for x in xs) and \
            self.aligned(*xs)

    @classmethod
    def aligned(cls, *xs: torch.Tensor | None) -> bool:
        """Whether every tensor given starts on the 16-byte grid the kernel's offsets assume."""
        return all(x.data_ptr() % cls.ALIGN_BYTES == 0 for x in xs if x is not None)

    def set(self, a: torch.Tensor, b: torch.Tensor | None = None, c: torch.Tensor | None = None) -> None:
        """Write the offsets of a, b, c (a stands in for a missing one) on the host."""
        o, size = self._origin, self._size
        pa = a.data_ptr()
        self._values[0] = (pa - o) // size
        self._values[1] = ((b.data_ptr() if b is not None else pa) - o) // size
        self._values[2] = ((c.data_ptr() if c is not None else pa) - o) // size

    def upload(self) -> None:
        """Queue the table's copy to the device on the current stream (a graph node when captured)."""
        self.device.copy_(self.host, non_blocking=True)


# --- the send row ---------------------------------------------------------------------------


def torch_summaries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, *, sparse: bool,
                    check: bool, center: torch.Tensor | None = None) -> torch.Tensor:
    """float32: the summaries this rank sends, made with torch ops (the CPU path, and CUDA
    inputs ``fused_sums`` does not take).

    A sparse call, ``center`` None (similarity off): q's and k's block sums (B, n, H, D); with
    ``center`` (the global key mean, similarity on): pooled means and similarities around it
    (``summarize``) and k's sum. With ``check`` (``SparspConfig.check_finite``) one more value,
    v's sum (a dense call: q's, k's and v's; the kernel writes ``check_parts`` partial sums of
    v instead): a NaN or Inf in q, k or v reaches a value sent, and the receiving side flags the
    rank from its row (``wire.table_of``; a sum of finite values overflows only near the float32
    limit, ~3e38, and the exact counts then find none and the check passes)."""
    parts = []
    if sparse and center is None:
        parts = [block_sums(q, block_size).reshape(-1), block_sums(k, block_size).reshape(-1)]
    elif sparse:
        pq, pk, ks = summarize(q, k, block_size, center=center, similarity=True)
        parts = [pq.mean.reshape(-1), pq.sim.reshape(-1), pk.mean.reshape(-1), pk.sim.reshape(-1),
                 ks.reshape(-1)]
    if check:
        parts += [v.sum(dtype=torch.float32).view(1)] if sparse else \
            [torch.stack([t.sum(dtype=torch.float32) for t in (q, k, v)])]
    if not parts:
        return cached_zeros((0,), q.device)
    return torch.cat(parts)


def kernel_summaries(size: int, block_size: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor | None) -> torch.Tensor:
    """The summing kernel's ``size`` values (``wire.summary_size``) in a new tensor: for a row
    that does not fit the group's capacity yet (``padded_row``)."""
    out = torch.empty(size, dtype=torch.float32, device=q.device)
    summaries_into(out, block_size, q, k, v)
    return out


def padded_row(header: torch.Tensor, data: torch.Tensor, cap: int) -> torch.Tensor:
    """A new send row: ``header``, ``data`` cut to ``cap`` values, zeros up to ``cap``. A cut
    row is gathered again once every rank has read the sizes in the headers."""
    body = data if data.numel() <= cap else data[:cap]
    return torch.cat([header, body, cached_zeros((cap - body.numel(),), header.device)])


MAX_SEND_ROWS = MAX_SUM_GRAPHS = 16
"""Send rows kept (one per geometry, capacity and stream; the least recently used goes first:
a row holds a rank's whole summaries, ≈ 12 MB at HunyuanVideo's G = 2 shard), and as many
graphs of the summing kernel (each keeps its row alive)."""

_SEND_ROWS = per_geometry("summaries: kept send rows")
_GATHERED = per_geometry("summaries: kept gathered rows")
_SUM_GRAPHS = per_geometry("summaries: CUDA graphs of the summing kernel")  # key -> _SumsGraph


def kept_row(header: torch.Tensor, size: int, cap: int, block_size: int, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor | None, *, graphs: bool) -> torch.Tensor:
    """The send row kept for this geometry and capacity (``send_row``), its ``size`` summary
    values (``size <= cap``) written in place by the summing kernel: replayed from the
    geometry's CUDA graph where ``graphs`` and the inputs allow (``_graphed``), else launched.
    ``v``: the check's tensor, or None."""
    row = send_row(header, cap)
    body = row[header.numel(): header.numel() + size]
    if not (graphs and q.is_cuda and _graphed(body, block_size, q, k, v)):
        summaries_into(body, block_size, q, k, v)
    return row


def send_row(header: torch.Tensor, cap: int) -> torch.Tensor:
    """The metadata send row of a geometry and capacity on the current stream: ``header``, then
    room for the summaries, then zero padding, made once; ``kept_row`` fills the summaries in
    place each call. Reuse is safe: a call's all-gather reads it before the stream goes on,
    and the next call writes it on the same stream."""
    dev = header.device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None
    key = (header.data_ptr(), cap, stream)  # the header: a cached constant per geometry
    return lru_get(_SEND_ROWS, key, lambda: torch.cat([header, cached_zeros((cap,), dev)]), MAX_SEND_ROWS)


def gathered_rows(row: torch.Tensor, world: int) -> torch.Tensor:
    """The all-gather's output for a kept send row (``kept_row``), made once per row and group
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


def _graphed(body: torch.Tensor, bs: int, q, k, v) -> bool:
    """Write the call's summaries into ``body`` by replaying the geometry's CUDA graph of the
    summing kernel: the host writes three offsets into the pinned table and launches a graph.
    False when not taken — the first call of a key, inputs not 16-byte aligned, a capture that
    failed (logged once) — and the caller launches the kernel itself."""
    stream = torch.cuda.current_stream(q.device).cuda_stream
    key = (body.data_ptr(), body.numel(), bs, tuple(q.shape), q.dtype, q.stride(), k.stride(),
           None if v is None else v.stride(), stream)
    st = captured_on_second_sight(
        _SUM_GRAPHS, key, lambda: _capture(SumsTable(q.dtype, q.device), body, bs, q, k, v), MAX_SUM_GRAPHS,
        what="the summing kernel", otherwise="launches it", ready=lambda: SumsTable.aligned(q, k, v))
    if st is None:
        return False
    st.table.set(q, k, v)
    st.graph.replay()
    return True


def _capture(table: SumsTable, body: torch.Tensor, bs: int, q, k, v) -> _SumsGraph:
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


__all__ = ["MAX_SEND_ROWS", "MAX_SUM_GRAPHS", "PooledBlocks", "SUM_FEATURES", "SumsTable", "block_lengths",
           "block_sums", "cached_zeros", "check_block", "check_parts", "fused_sums", "gathered_rows",
           "kept_row", "kernel_summaries", "key_sum", "padded_row", "pool_blocks", "send_row", "summaries_into",
           "summarize", "torch_summaries"]
