"""Chunk plans for remote payloads sent by head group (paper §7; the ``direct`` strategy's rule): pure
arithmetic.

A payload (the blocks one rank sends another in one round) may travel as several messages,
one per *head group* (a chunk), so that the consumer computes on a chunk as soon as it landed.
Chunks pay for themselves only where they shorten the critical path (§7.1): the *drain* (the
last remote payload, whose transfer no later compute hides) and a transfer-bound pair; in the
steady state the link is busy back to back anyway and extra chunks only add launches. This
module decides, per (owner → consumer) pair, from numbers both ends of the pair hold:

1. before the call's host sync, from config + shapes only: how many *units* (near-equal,
   contiguous head groups) the payload's selection is cut into (``unit_count``,
   ``head_groups``); each unit is a selection of its own in the strategy's plan, so its size
   comes back from the one host sync;
2. after it, from the units' sizes (selected blocks and packed rows, equal on both ends: both
   derive the selection from the whole mask): how many chunks (units merged, a divisor of the
   unit count) and in which order they travel (``schedule``).

The cost model (``PairCost``) is an estimate both ends can make alike: transfer ∝ packed bytes
/ the fabric's bandwidth; compute ∝ kept block pairs, which only the consumer knows exactly,
so it is estimated as selected blocks × ``read_fraction`` × the consumer's query blocks (the
fraction of local query blocks that read a demanded remote block: 0.69–0.70 on the synthetic
LTX-Video and 0.33–0.38 on the Wan 2.1 workloads at cdf 0.9 with periodic placement, G = 2, 4,
8). Bandwidth, kernel rate and fixed costs come from the hardware profiles of
``sparsp simulate`` (``fabric``: the measured 2×H200 one of the path the transport reports,
``Transport.fabric``, unless ``env.profile()`` names another, e.g. one ``sparsp simulate
--fit-profile`` wrote). Nothing here reads a tensor, so the plan costs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..caches import per_geometry
from ..env import profile as configured_profile
from .ops import FINISH_UNIT_OPS, MASK_UNIT_OPS
from .profiles import get_profile

__all__ = ["AUTO_DRAIN_UNITS", "AUTO_STEADY_UNITS", "CPU_FABRIC", "Fabric", "PairCost", "Piece",
           "combine", "fabric", "finish_time", "head_groups", "merge", "order", "pair_cost",
           "profile_fabric", "read_fraction", "schedule", "transfer_hides", "unit_count"]

AUTO_DRAIN_UNITS = 4
"""Automatic drain: at most this many head groups (the paper's Fig. 11 splits the last block
finely; HunyuanVideo's 24 heads already gain nothing there, §8.3, so a few chunks suffice)."""
AUTO_STEADY_UNITS = 1
"""Automatic steady state: unchunked. The rounds' transfers run back to back on the link, so
finer chunks do not shorten a transfer-bound pipeline (only its drain does) and add launches
to a compute-bound one (§7.1: "the first remote blocks retain the default chunk
configuration")."""
READ_FRACTION = 0.5
"""Kept block pairs per demanded remote block, as a fraction of the consumer's query blocks
(measured 0.33–0.70 on the synthetic workloads: see the module docstring)."""


@dataclass(frozen=True)
class Fabric:
    """What moving and computing cost on a machine (estimates, equal on every rank)."""

    bytes_per_s: float
    """Payload bandwidth of one (owner → consumer) transfer while every rank exchanges."""
    flops_per_s: float
    """Kernel throughput counted on kept blocks."""
    chunk_s: float
    """Compute-side cost of one more chunk: its kernel launch, block lists and LSE merge."""
    message_s: float
    """Link-side cost of one more message: publish, fetch handshake, copy launch."""
    min_chunk_bytes: int
    """Chunks smaller than this are never chosen automatically."""
    unit_s: float = 0.0
    """Host cost of one more head-group unit, whatever the chunk count chosen after the call's
    host read: the unit's selection and counts before the read and its layout's slicing in the
    read's finish are eager ops issued while the device waits (both payloads of a rank:
    2 × (``ops.MASK_UNIT_OPS`` + ``FINISH_UNIT_OPS``) ops at the profile's
    ``op_ms``)."""


MIN_CHUNK_BYTES = 256 << 10
"""Below this a chunk's transfer (≈ 8 µs at the host fabric's 33.5 GB/s) is no longer worth a
message of its own, whatever the model says."""
CPU_FABRIC = Fabric(2e9, 2e10, 1e-3, 1e-4, 64 << 10)
"""The CPU path (gloo or shared memory, torch reference kernel): tests and laptops."""
_FABRICS = per_geometry("cost: fabrics")  # key -> Fabric


def fabric(device_type: str, transport: str, head_dim: int, kernel: str | None = None, *, path: str) -> Fabric:
    """The ``Fabric`` of a call on this machine: ``CPU_FABRIC`` off CUDA; on CUDA from a hardware
    profile (``cost.profiles``: the one ``env.profile()`` names, else the measured 2×H200
    profile of the transport's fabric ``path``, ``Transport.fabric``: ``h200x2-nvlink`` for
    ``nvlink``, ``h200x2-host`` for ``host``), with the call's ``transport`` figure there
    (``Profile.call_transport``: the profile's default where it has none of that name), at the
    rate of ``kernel`` (the call's resolved kernel: ``KernelFigure.rate``). The profile must be
    the same on every rank."""
    if device_type != "cuda":
        return CPU_FABRIC
    name = configured_profile() or ("h200x2-nvlink" if path == "nvlink" else "h200x2-host")
    key = (name, transport, head_dim, kernel)
    if key not in _FABRICS:
        profile = get_profile(name)
        _FABRICS[key] = profile_fabric(profile, profile.call_transport(transport), head_dim, kernel)
    return _FABRICS[key]


def profile_fabric(profile, transport, head_dim: int, kernel: str | None = None) -> Fabric:
    """A ``Fabric`` from a ``cost.profiles.Profile`` and its figure of ``transport`` (a
    ``TransportFigure``, or a name ``Profile.transport`` resolves: None is the default, a name
    the profile lacks raises): the pair bandwidth is the GPU's link, capped by half its duplex
    limit (every rank sends and receives at once) and, for a host-staged path, by a quarter of
    the host's DMA capacity (two GPUs each write and read it: 134 / 4 = 33.5 GB/s on the
    2×H200 box, its measured exchange rate); the transport's efficiency and latency,
    ``kernel``'s sparse rate at ``head_dim`` (``KernelFigure.rate``) and the per-kernel
    ``launch_ms`` come from the profile as they are."""
    fig = profile.transport(transport)
    caps = [profile.link_gbps]
    if profile.duplex_gbps is not None:
        caps.append(profile.duplex_gbps / 2)
    if not profile.peer_access and profile.host_gbps is not None:
        caps.append(profile.host_gbps / 4)
    return Fabric(min(caps) * fig.efficiency * 1e9, profile.kernel(head_dim).rate(kernel) * 1e12,
                  profile.launch_ms * 1e-3, fig.latency_ms * 1e-3, MIN_CHUNK_BYTES,
                  2 * (MASK_UNIT_OPS + FINISH_UNIT_OPS) * profile.op_ms * 1e-3)


def transfer_hides(fab: Fabric, *, rows: int, pairs: int, head_dim: int, dtype_bytes: int) -> bool:
    """Whether a payload of ``rows`` K rows (and as many V rows) moves in no more time than the
    kernel takes over ``pairs`` kept (query token, key token) pairs: the rule that decides
    ``SparspConfig.local_first=None`` (``Call.local_first_pays``; ``cost.model`` applies
    the same to simulated calls)."""
    transfer_s = rows * 2 * head_dim * dtype_bytes / fab.bytes_per_s
    compute_s = pairs * 4 * head_dim / fab.flops_per_s  # QKᵀ and PV per kept pair
    return transfer_s <= compute_s


@dataclass(frozen=True)
class PairCost:
    """Estimated seconds of one (owner → consumer) pair: per packed K row moved (K and V),
    per selected block computed, per extra chunk (compute side) and message (link side)."""

    row_s: float
    block_s: float
    chunk_s: float
    message_s: float
    block_size: int
    min_chunk_rows: int
    unit_s: float = 0.0  # ``Fabric.unit_s``
    pair_s: float = 0.0
    """Compute of one kept (query block, key block) pair: ``block_s`` without the estimated
    reads per block (``read_fraction``), for a payload whose kept pairs are known."""

    @property
    def ratio(self) -> float:
        """Transfer / compute of one full selected block (independent of the payload size)."""
        return self.row_s * self.block_size / self.block_s


def read_fraction(known: tuple[int, int] | None, *, block_size: int, consumer_blocks: int) -> float:
    """Kept block pairs per selected block over the consumer's query blocks: measured from
    ``known`` = (packed rows, kept block pairs) of the pair's payload when given (rows over the
    block size count the selected blocks, a short one as whole), else ``READ_FRACTION``."""
    if known is None or known[0] <= 0 or known[1] <= 0:
        return READ_FRACTION
    rows, pairs = known
    return pairs / (rows / block_size) / max(consumer_blocks, 1)


def pair_cost(fab: Fabric, *, head_dim: int, dtype_bytes: int, block_size: int,
              consumer_blocks: int, read_fraction: float = READ_FRACTION) -> PairCost:
    """``PairCost`` of a pair whose consumer holds ``consumer_blocks`` query blocks."""
    row_bytes = 2 * head_dim * dtype_bytes  # a K row and its V row
    reads = max(read_fraction * consumer_blocks, 1.0)  # a demanded block is read at least once
    flops = 4 * block_size * block_size * head_dim  # QKᵀ and PV of one (query, key) block pair
    return PairCost(row_bytes / fab.bytes_per_s, reads * flops / fab.flops_per_s, fab.chunk_s,
                    fab.message_s, block_size, max(1, -(-fab.min_chunk_bytes // row_bytes)), fab.unit_s,
                    flops / fab.flops_per_s)


def head_groups(heads: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous head ranges [h0, h1) covering ``heads``; the first ``heads % count``
    get one head more (count is clamped to [1, heads])."""
    count = max(1, min(count, heads))
    size, extra = divmod(heads, count)
    out, h0 = [], 0
    for i in range(count):
        h1 = h0 + size + (i < extra)
        out.append((h0, h1))
        h0 = h1
    return out


def unit_count(requested: int | None, *, drain: bool, heads: int, cost: PairCost,
               max_rows: int, known: tuple[int, int] | None = None) -> int:
    """How many head groups a payload's selection is cut into before the host sync.

    ``requested`` (``SparspConfig.chunks`` / ``drain_chunks``) wins when set (clamped to the
    heads). Automatic: ``AUTO_STEADY_UNITS`` in the steady state; for the drain 1 when the pair
    is not transfer-bound (its transfer no longer than its compute: the payload lands while the
    previous payload, estimated as large, is computed, so chunks only add launches) or when even
    the largest possible payload (``max_rows``, the owner's whole shard) would not give two
    chunks of ``min_chunk_bytes``, or could not save more compute (half of it, with two chunks)
    than one more chunk and message cost plus the units' own host cost before the sync
    (``unit_s`` each: paid whatever the chunk count chosen after it); else ``AUTO_DRAIN_UNITS``.
    Each unit costs a selection in the plan, so this keeps them out wherever chunking cannot win.

    Transfer against compute: with ``known`` = (packed rows, kept block pairs) of this pair's
    payload in an earlier call of the geometry (both ends hold the same two numbers), from
    those; else per selected block (``cost.ratio``), its reads estimated by ``read_fraction``
    (0.5 against 0.33–0.38 measured on Wan 2.1: the estimate called that host-fabric drain
    compute-bound while its transfer outlasted the local kernel by 7 ms).
    """
    if requested is not None:
        return max(1, min(requested, heads))
    if not drain:
        return max(1, min(AUTO_STEADY_UNITS, heads))
    if known is not None and known[1] > 0:
        rows, pairs = known
        most = pairs * cost.pair_s
        bound = rows * cost.row_s > most
    else:
        most = max_rows / cost.block_size * cost.block_s  # compute of the largest payload
        bound = cost.ratio > 1.0
    units = max(1, min(AUTO_DRAIN_UNITS, heads))
    # the units' ops are paid before the sync even when the payload then travels whole
    if not bound or max_rows < 2 * cost.min_chunk_rows or \
            most / 2 <= cost.chunk_s + cost.message_s + (units - 1) * cost.unit_s:
        return 1
    return units


@dataclass(frozen=True)
class Piece:
    """A unit (or merged units) of one payload, as the host sync reported it."""

    heads: tuple[int, int]  # [h0, h1)
    blocks: int  # selected key blocks (all its (batch, head) rows)
    rows: int  # packed K rows (= V rows)

    def transfer_s(self, cost: PairCost) -> float:
        return self.rows * cost.row_s

    def compute_s(self, cost: PairCost) -> float:
        return self.blocks * cost.block_s


def merge(pieces: list[Piece], count: int) -> list[tuple[int, ...]]:
    """Indices of ``pieces`` merged into ``count`` consecutive groups (near-equal sizes)."""
    groups = head_groups(len(pieces), count)
    return [tuple(range(a, b)) for a, b in groups]


def combine(pieces: list[Piece], idx: tuple[int, ...]) -> Piece:
    """The consecutive ``pieces`` at ``idx`` as one chunk: their heads, blocks and rows."""
    return Piece((pieces[idx[0]].heads[0], pieces[idx[-1]].heads[1]),
                 sum(pieces[i].blocks for i in idx), sum(pieces[i].rows for i in idx))


def order(chunks: list[Piece], cost: PairCost) -> list[int]:
    """Overlap-aware order (§7.2): Johnson's rule for a transfer stage followed by a compute
    stage, which minimises the time the last compute ends. Compute-heavier chunks (transfer <
    compute) go first by increasing transfer (compute starts early), the others follow by
    decreasing compute, so in a transfer-bound payload the chunk with the least compute lands
    last and little compute is left after the last landing. Ties keep head order, so both ends
    derive the same sequence."""
    idx = range(len(chunks))
    t = [c.transfer_s(cost) + cost.message_s for c in chunks]
    x = [c.compute_s(cost) + cost.chunk_s for c in chunks]
    first = sorted((i for i in idx if t[i] < x[i]), key=lambda i: (t[i], i))
    last = sorted((i for i in idx if t[i] >= x[i]), key=lambda i: (-x[i], i))
    return first + last


def finish_time(chunks: list[Piece], cost: PairCost, busy: float) -> float:
    """When the consumer's last compute on ``chunks`` (in this order) ends: the transfers run
    back to back from time 0 (``message_s`` each on top), the compute stream is busy until
    ``busy`` and then computes each chunk once it landed (``chunk_s`` each on top)."""
    landed, end = 0.0, busy
    for c in chunks:
        landed += c.transfer_s(cost) + cost.message_s
        end = max(end, landed) + c.compute_s(cost) + cost.chunk_s
    return end


def schedule(pieces: list[Piece], *, count: int | None, cost: PairCost) -> list[tuple[int, ...]]:
    """The chunks of one payload, in sending order: tuples of consecutive ``pieces`` indices.

    ``count`` set: exactly ``count`` groups (``SparspConfig`` override). Automatic: the count
    among the divisors of ``len(pieces)`` whose simulated drain (``finish_time``, with the
    compute stream busy for as long as this payload computes: the previous payload, estimated
    alike) ends first, never chunks below ``min_chunk_rows`` (tiny payloads stay whole); ties
    go to fewer chunks. Groups that select nothing are dropped (they would move and compute
    nothing), so the result is empty when the whole payload is.
    """
    n = len(pieces)
    assert n >= 1 and (count is None or 1 <= count <= n)
    total = combine(pieces, tuple(range(n)))
    if count is None:
        busy = total.compute_s(cost)
        best, best_t = 1, finish_time([total], cost, busy)
        for c in range(2, n + 1):
            if n % c or total.rows < c * cost.min_chunk_rows:
                continue
            chunks = [combine(pieces, g) for g in merge(pieces, c)]
            t = finish_time([chunks[i] for i in order(chunks, cost)], cost, busy)
            if t < best_t:
                best, best_t = c, t
        count = best
    groups = [g for g in merge(pieces, count) if combine(pieces, g).blocks > 0]
    chunks = [combine(pieces, g) for g in groups]
    return [groups[i] for i in order(chunks, cost)]
