"""The cost model's work: what each rank does per round (``Work``).

``work`` turns a measured ``Demand`` (``cost.figures``) into per-rank, per-round work —
kept-block FLOPs per compute step, merge traffic, bytes per round, the mask phase's ops and
bytes — with the exact rules of ``sparsp.demand`` (the bytes of every strategy sum to
``demand.comm_bytes`` per rank); ``build_work`` measures a placement's masks and does the same.
``sparsp simulate`` and ``strategy="auto"`` share them; ``cost.timeline`` schedules the work on
a machine profile.

The strategy arrives as its registered facts (a ``StrategyFacts``: any object with ``name``,
``sparse``, ``byte_rule`` and ``local_first``, such as ``strategies.registry.StrategySpec``):
the schedule follows from the byte rule (``SCHEDULES``), so a newly registered strategy with a
known byte rule is simulated without changes here, and this package needs no strategy module.

Every rank first pays a fixed phase: ``call_ms`` plus the mask phase up to the start of the
call's one host read, the longer of the host issuing its counted ops and the device's path
(the metadata all-gather, the input passes, the mask selection). Where the rest of the host's
counted ops fall depends on the call's order (``Work.local_first``): in order, the host waits
for the read, finishes it (``FINISH_OPS``) and issues the run's ops, which no kernel may outrun
(``RUN_OPS``); local first (a strategy registered ``local_first`` whose
``SparspConfig.local_first`` is True, or None — the default, automatic — where
``local_first_pays`` says so, the rule of ``Call.local_first_pays``), the host launches the
local kernel before it waits for the read (``EARLY_OPS``), then finishes the read and issues
the run while that kernel runs (``LOCAL_FIRST_RUN_OPS``). The op counts (``cost.ops``) and the byte
constants below are counted from the code of the strategies and ``sparsp.plan``
(docs/simulate.md says how); nothing here is fitted to ``bench attention`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..demand import head_split
from ..placement import Placement
from ..wire import HEADER_SLOTS, summary_size
from .balance import balanced_heads, contiguous_heads
from .chunks import pair_cost, profile_fabric, read_fraction, transfer_hides, unit_count
from .figures import Blocks, Demand, measure
from .ops import (EARLY_OPS, FINISH_UNIT_OPS, GRAPHED_MASK_CUT_OPS, GRAPHED_MASK_UNIT_OPS, HEAD_ORDER_OPS,
                  MASK_CUT_OPS, MASK_UNIT_OPS, finish_ops, issue_ops, mask_ops, run_ops)
from .machine import Profile, TransportFigure


class StrategyFacts(Protocol):
    """What the cost model needs to know of a strategy: the facts it registered with
    (``strategies.registry.register_strategy``; a ``StrategySpec`` is one)."""

    name: str
    sparse: bool
    """Reads the block mask (False: dense compute on every block)."""
    byte_rule: object
    """A ``demand.BYTE_RULES`` name: which schedule it follows (``SCHEDULES``)."""
    local_first: bool
    """May compute its local shard before its host read (``SparspConfig.local_first``)."""


# ``SparspConfig``'s defaults that the model assumes (the cost model sits below the config;
# tests/test_simulate.py checks that these equal the config's):
# ``local_first`` None: automatic (``local_first_pays``; True: always local first; False:
# always in order) ...
LOCAL_FIRST: bool | None = None
# ... and the ones that size the metadata all-gather (``gather_bytes``): the block similarity
# off (``sim_threshold`` None), the non-finite check on
SIMILARITY: bool = False
CHECK_FINITE: bool = True

# Collectives on every call's device path (plan.py): ONE, the metadata all-gather (header +
# block sums, from which every rank derives the whole mask and every demand). On NCCL
# the stream waits for it while the host goes on issuing the mask (``groups.stream_ordered``),
# so its latency (``Profile.sync_ms``) and its bytes are device time of the mask phase, not
# host time. The transport's fence is no collective: NCCL waits for the previous call's sends,
# the slot transports meet at a shared-memory barrier.
SYNCS_PER_CALL = 1
# Device-memory traffic per (batch·head, q block, k block) score to select the whole mask,
# counted op by op from ``masks.select_blocks`` on CUDA (float32): scores written by the matmul
# (4) and scaled in place (8), then ``cdf_select``'s one kernel — softmax and selection per row
# in registers — reads them (4) and writes the bool mask (1) = 17; plus the demand
# (``remote_demand`` reads the mask once, 1) and the kept counts of ``Call.kept_counts`` (≤ 1):
# 19 bytes. (The sorted path it replaced, still the CPU one and that of rows wider than
# ``cdf_select.MAX_COLS``, moved 88.) The kernel's bisection is not bandwidth-bound: at
# HunyuanVideo's 24 × 992² scores it takes 0.25 ms on an H200 against 0.03 ms for its bytes
# at HBM rate; not modelled.
_MASK_BYTES_PER_SCORE = 19
# Full reads of the inputs before the call's host sync (``plan.gather_metadata``): a sparse call
# sums q and k per block (``masks.block_sums``) and v for the non-finite flag; a dense one sums
# q, k and v for the flag. Three passes over a (B, S, H, D) input either way (a sparse call's
# key sum is the sum of k's block sums, no pass of its own).
INPUT_PASSES = 3
# Merge traffic per output element (``Call.merge``, ``kernels.merge``, Triton kernels that read
# each partial once and write once): the first partial is kept as the kernel returned it (0);
# a later one is folded into an fp32 accumulator before the next kernel's launch —
# the second partial reads two kernel outputs (2 + 2 + 4 = 8), every further one the fp32
# accumulator (4 + 2 + 4 = 10) — and the last one is merged straight into the output in the
# input dtype, token-major (``merge_final``: 2 + 2 + 2 = 6 from two kernel outputs, 4 + 2 + 2 = 8
# from the accumulator); a single partial (FA4's token-major output) needs no copy at all.
MERGE_FIRST_BYTES, MERGE_SECOND_BYTES, MERGE_BYTES = 0, 8, 10
FINAL_SECOND_BYTES, FINAL_BYTES = 6, 8
# ``ulysses`` merges eagerly (``update_out_and_lse`` per query slice over the G key slices):
# the first partial converted and cloned (2 + 4 + 4 + 4 = 14), every further one converted
# (6), both sides weighted (8 + 8) and added (12) = 34; per element of its output once: the
# slice copied into the fp32 output (8), cast to the input dtype (6), the pieces for the peers
# made contiguous (4 · (G−1)/G) and the received pieces concatenated (4).
ULYSSES_FIRST_BYTES, ULYSSES_MERGE_BYTES, ULYSSES_RESULT_BYTES = 14, 34, 18
# ... and its copies on the way in, per element of one of the rank's inputs (B·S_r·H·D; bf16
# traffic, read + write): Q, K, V stacked (12), the peers' head slices made contiguous
# (12·(G−1)/G; the copy into the send buffer is the message's pack, charged with it), q of its
# heads concatenated over the slices (4), each slice's K and V made contiguous (8) and packed
# into a KVBuffer (8), each query slice made head-major (4), the fp32 output zeroed (4).
ULYSSES_INPUT_BYTES, ULYSSES_PIECE_BYTES = 40, 12
# With whole-block slices (``strategies/ulysses.py``: every slice but the last a whole number of
# blocks) none of that: the received Q, K, V land in place in full-sequence tensors (batch 1;
# else through a temporary, 4 bytes per received element), this rank's own head slices are
# copied in (4 bytes per element), one kernel call gives the output, whose own tokens are copied
# into the result and whose received pieces land there through a temporary (4 bytes each).
ULYSSES_WHOLE_COPY_BYTES = 4
SCHEDULES = {"full-shards": "relay-ring", "relay": "relay-ring", "direct": "direct", "all-to-all": "all-to-all"}


def schedule_of(spec: StrategyFacts) -> str:
    """``relay-ring``, ``direct`` or ``all-to-all``: how the strategy issues its rounds."""
    rule = spec.byte_rule
    if not isinstance(rule, str) or rule not in SCHEDULES:
        raise ValueError(f"strategy {spec.name!r} has byte rule {rule!r}; simulate models "
                         f"{', '.join(SCHEDULES)}")
    return SCHEDULES[rule]


def kind_of(spec: StrategyFacts) -> str:
    """The kind the op tables are keyed by: ``dense``, or a sparse strategy's byte rule."""
    return spec.byte_rule if spec.sparse else "dense"


@dataclass(frozen=True)
class Work:
    """What one attention call asks of each rank, independent of the hardware.

    ``flops[r][i]``: FLOPs of rank r's compute step i (schedules ``relay-ring`` and ``direct``:
    step 0 is the local shard, step k the shard of round k; ``all-to-all``: one step). ``launches[r][i]``: kernel
    calls in that step. ``recv[r][k-1]``: bytes rank r receives in round k (phase 1 for
    ``all-to-all``), ``back[r][k-1]``: bytes of the output all-to-all (empty otherwise).
    ``mask_bytes[r]``: device bytes of r's mask phase (input passes, the mask selection).
    """

    strategy: str
    schedule: str
    ranks: int
    flops: tuple[tuple[float, ...], ...]
    launches: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    back: tuple[tuple[int, ...], ...] = ()
    mask_bytes: tuple[int, ...] = ()
    host_ops: tuple[int, ...] = ()
    """Per rank: eager ops issued before the call's host read is started (``MASK_OPS``,
    ``MASK_UNIT_OPS``): the device's mask path waits for them."""
    merge_bytes: tuple[tuple[int, ...], ...] = ()
    """Per rank and compute step: device traffic beside the kernel — merging that step's
    partial result (``all-to-all``: and its copies, ``ULYSSES_INPUT_BYTES``)."""
    gather_bytes: tuple[int, ...] = ()
    """Per rank: bytes it receives in the metadata all-gather (header + padded summaries)."""
    heads: int = 0
    """Heads per batch element, and ``tokens`` the whole sequence: the shape ``bench kernel``
    rows are keyed by (``Profile.kernel_rate``); 0 = unknown."""
    tokens: int = 0
    density: tuple[float, ...] = ()
    """Per rank: the kept share of its queries' (query, key) pairs over the whole sequence
    (``all-to-all``: of its heads' queries), the density ``bench kernel`` rows are measured at."""
    run_ops: tuple[tuple[int, int, int], ...] = ()
    """Per rank: eager ops the run issues before its first kernel call, before its last, and
    after it (``RUN_OPS``; local first, of the remote kernel calls: ``LOCAL_FIRST_RUN_OPS``);
    () = no host issue modelled."""
    finish_ops: tuple[int, ...] = ()
    """Per rank: eager ops after the host read, before the run (``FINISH_OPS``,
    ``FINISH_UNIT_OPS``); () = none."""
    local_first: bool = False
    """The call launches the local kernel (step 0) before it waits for its host read and issues
    the first round on a side stream while that kernel runs (a strategy registered
    ``local_first`` whose ``SparspConfig.local_first`` is True, or None where
    ``local_first_pays``: ``resolve_local_first``); False: in order, the local kernel after the
    read and the run's first ops."""
    early_ops: tuple[tuple[int, int], ...] = ()
    """Per rank, local first: ops after the read's start before the local kernel's launch, and
    after that launch before the host waits for the read (``EARLY_OPS``); () = none."""
    issue_ops: tuple[int, ...] = ()
    """Per rank: ops the run issues before its first fetch (``RUN_OPS``,
    ``LOCAL_FIRST_RUN_OPS``): the first round's transfer (and its pack) waits for them; () =
    none."""
    mask_phase: bool = True
    """The call runs its mask phase (the metadata all-gather, the mask and the plan stage, the
    host read and its finish); False: it reuses a kept plan and runs only what follows
    (``reused``)."""

    def reused(self) -> "Work":
        """The same call reusing its kept plan (a schedule's reuse step, ``SparspConfig.
        replan_every``): no mask phase — no metadata collective, no mask, no host read, none of
        their ops (the drain units' included: the plan keeps its chunking) — and the same run:
        the kept plan's bytes, kernels and merges in the same order."""
        return replace(self, mask_phase=False, mask_bytes=(), gather_bytes=(), host_ops=(), finish_ops=())

    def layout(self, step: int) -> str:
        """The kernel's K/V layout in compute step ``step``: the own shard as given (``local``,
        step 0 of the ``relay-ring`` and ``direct`` schedules) or a packed buffer (``packed``:
        every received payload; the all-to-all packs every key slice)."""
        return "local" if step == 0 and self.schedule != "all-to-all" else "packed"

    def sender(self, r: int, k: int) -> int:
        """Who sends rank r its round-k payload: the ring neighbour, or the owner (r−k)."""
        G = self.ranks
        return (r - 1) % G if self.schedule == "relay-ring" else (r - k) % G

    def origin(self, r: int, k: int) -> int:
        """Whose K/V rank r computes at step k (r itself at step 0)."""
        return (r - k) % self.ranks

    @property
    def bytes_per_rank(self) -> list[int]:
        return [sum(self.recv[r]) + (sum(self.back[r]) if self.back else 0) for r in range(self.ranks)]


def mask_bytes(d: Demand, *, head_dim: int, dtype_bytes: int, sparse: bool = True) -> tuple[int, ...]:
    """Device bytes of each rank's mask phase (plan.py): ``INPUT_PASSES`` reads of its q, k, v
    and, for a sparse call, the selection of the whole mask (``_MASK_BYTES_PER_SCORE``)."""
    return tuple(phase_bytes(t, batch=d.batch, heads=d.heads, blocks=d.blocks, head_dim=head_dim,
                             dtype_bytes=dtype_bytes, sparse=sparse) for t in d.tokens)


def phase_bytes(tokens: int, *, batch: int, heads: int, blocks: int, head_dim: int, dtype_bytes: int,
                sparse: bool = True) -> int:
    """``mask_bytes`` of one rank holding ``tokens`` tokens of ``heads`` heads, whose mask
    phase selects the whole mask of ``blocks`` × ``blocks`` blocks of every head."""
    BH = batch * heads
    scores = BH * blocks * blocks * _MASK_BYTES_PER_SCORE if sparse else 0
    return INPUT_PASSES * tokens * BH * head_dim * dtype_bytes + scores


def gather_bytes(d: Demand, *, head_dim: int, sparse: bool) -> tuple[int, ...]:
    """Bytes each rank receives in the metadata all-gather: G−1 rows of float32, each a header
    (11 slots: ``wire.HEADER_SLOTS`` + the summaries' size) and the summaries padded to the
    largest rank's (``wire.summary_size`` with the config's defaults, similarity off and
    ``check_finite`` on: q's and k's block sums 2·B·n·H·D, k's sum B·H·D and v's sum 1 for a
    sparse call, whose means each rank derives from the gathered sums; a dense call sends its
    q, k and v sums for the check, 3). A dense call in a group whose capacity a
    sparse call grew pads to it; not charged."""
    n = max(-(-t // d.block_size) for t in d.tokens) if d.block_size else -(-d.blocks // d.ranks)
    row = gather_row_bytes(batch=d.batch, heads=d.heads, blocks=n, head_dim=head_dim, sparse=sparse)
    return tuple((d.ranks - 1) * row for _ in d.tokens)


def gather_row_bytes(*, batch: int, heads: int, blocks: int, head_dim: int, sparse: bool) -> int:
    """One rank's row of the metadata all-gather (``gather_bytes``): a header and the summaries
    of ``blocks`` blocks of ``heads`` heads, float32."""
    body = summary_size(batch, heads, head_dim, blocks, SIMILARITY, CHECK_FINITE) if sparse else 3 * int(CHECK_FINITE)
    return 4 * (HEADER_SLOTS + 1 + body)


def build_work(masks: torch.Tensor, placement: Placement, spec: StrategyFacts, *, head_dim: int,
               dtype_bytes: int = 2, profile: Profile | None = None, transport: str | None = None,
               local_first: bool | None = LOCAL_FIRST, head_order: tuple[int, ...] | None = None) -> Work:
    """Per-rank, per-round work of the strategy ``spec`` for masks bool [heads, nB, nB]
    (original order); ``profile``/``transport``/``local_first``/``head_order``: see ``work``."""
    schedule_of(spec)  # a byte rule the model does not know: ValueError before any work
    d = measure(masks, Blocks.of(placement), relay=spec.byte_rule == "relay")
    return work(spec, d, head_dim=head_dim, dtype_bytes=dtype_bytes, profile=profile, transport=transport,
                local_first=local_first, head_order=head_order)


def work(spec: StrategyFacts, d: Demand, *, head_dim: int, dtype_bytes: int = 2, profile: Profile | None = None,
         transport: str | None = None, graphed: bool = True, local_first: bool | None = LOCAL_FIRST,
         head_order: tuple[int, ...] | None = None) -> Work:
    """Per-rank, per-round work of the strategy ``spec`` for a measured ``Demand``.

    Hardware-independent but for two decisions the code makes from the machine's figures
    (``chunks.fabric``; here those of ``profile``, ``chunks.profile_fabric``, with the call's
    ``transport`` on it, None = the profile's default; a name the profile lacks raises,
    ``Profile.transport``): into how many head-group units a ``direct`` strategy cuts its drain
    payloads before the host sync (``chunk_ops``), which costs host ops, and, with
    ``local_first`` None, whether the call runs local first (``resolve_local_first``). Without
    ``profile`` no units are charged and an automatic call runs in order (as the code's first
    call of a geometry, which has no figures yet). ``graphed``: the plan stage is a CUDA graph
    (``SparspConfig.cuda_graphs`` on a GPU, the default); False counts it eagerly.
    ``local_first``: the call's ``SparspConfig.local_first`` (default, the config's: None,
    automatic); only a strategy registered ``local_first`` runs local first
    (``Work.local_first``, always a bool). ``head_order``: the ``all-to-all`` schedule's heads
    in rank order (rank r computes ``head_order[first_r : first_r + H_r]``;
    ``cost.balance.balanced_heads``); None: what ``ulysses`` runs, heads given to ranks by
    their kept pairs (``balanced_heads`` of ``d.head_pairs``; contiguous groups where the heads
    do not divide). It moves only the compute: every rank still receives H/G heads of every
    token."""
    schedule = schedule_of(spec)
    figure = profile.transport(transport) if profile is not None else None  # resolved once for the call
    early = resolve_local_first(local_first, spec, d, profile, figure, head_dim=head_dim, dtype_bytes=dtype_bytes)
    host = _host_ops(spec, d, schedule, profile, figure, early, head_dim=head_dim, dtype_bytes=dtype_bytes,
                     graphed=graphed)
    shared = dict(mask_bytes=mask_bytes(d, head_dim=head_dim, dtype_bytes=dtype_bytes, sparse=spec.sparse),
                  gather_bytes=gather_bytes(d, head_dim=head_dim, sparse=spec.sparse), heads=d.heads,
                  tokens=sum(d.tokens))
    if schedule == "all-to-all":
        return _all_to_all(spec, d, host, shared, head_dim=head_dim, dtype_bytes=dtype_bytes, head_order=head_order)
    return _rounds(spec, d, schedule, host, shared, head_dim=head_dim, dtype_bytes=dtype_bytes)


def _host_ops(spec: StrategyFacts, d: Demand, schedule: str, profile: Profile | None, figure, early: bool, *,
              head_dim: int, dtype_bytes: int, graphed: bool) -> dict:
    """``Work``'s host fields per rank: the ops before the host read and in its finish (with a
    ``direct`` strategy's drain units, ``chunk_ops``, where a profile decides them), the run's
    ops in the call's order (``early``: local first; the ``all-to-all`` schedule's run ops
    whether or not it reads the mask), ``figure``: the transport's."""
    G = d.ranks
    kind = kind_of(spec)
    ops = (mask_ops(kind, G, graphed),) * G
    finishing = (finish_ops(kind, G),) * G
    if schedule == "direct" and profile is not None:
        extra = chunk_ops(d, profile, figure, head_dim=head_dim, dtype_bytes=dtype_bytes, graphed=graphed)
        ops = tuple(n + x for n, (x, _) in zip(ops, extra))
        finishing = tuple(n + x for n, (_, x) in zip(finishing, extra))
    run = "all-to-all" if schedule == "all-to-all" else kind  # its run is the same code dense or sparse
    return dict(host_ops=ops, finish_ops=finishing, run_ops=(run_ops(run, G, early),) * G, local_first=early,
                early_ops=(EARLY_OPS,) * G if early else (), issue_ops=(issue_ops(run, G, early),) * G)


def _head_order(d: Demand, head_order: tuple[int, ...] | None) -> tuple[int, ...]:
    """The ``all-to-all`` schedule's heads in rank order: ``head_order`` as given, else as
    ``ulysses`` runs (heads given to ranks by their kept pairs where they divide over the ranks,
    contiguous groups otherwise)."""
    if head_order is not None:
        order = tuple(head_order)
    elif d.heads % d.ranks == 0:
        order = balanced_heads(d.head_pairs, d.ranks)
    else:
        order = contiguous_heads(d.heads)
    if sorted(order) != list(range(d.heads)):
        raise ValueError(f"head_order {order} is not a permutation of {d.heads} heads")
    return order


def _all_to_all_merges(d: Demand, split: list[int], head_dim: int) -> tuple[tuple, tuple]:
    """(merge bytes, kernel launches) per rank of the ``all-to-all`` schedule: with whole-block
    slices one kernel over the whole sequence (``ULYSSES_WHOLE_COPY_BYTES``), else one eager
    merge chain per query slice over the G key slices, on this rank's heads for every token,
    then the output's copies and casts (``ULYSSES_*``)."""
    G, tokens, BH = d.ranks, d.tokens, d.batch * d.heads
    if d.block_size and all(t % d.block_size == 0 for t in tokens[:-1]):
        c = ULYSSES_WHOLE_COPY_BYTES * d.batch * head_dim
        merge = tuple((round(c * (3 * tokens[r] * split[r]  # own head slices in
                                  + (3 * (sum(tokens) - tokens[r]) * split[r] if d.batch > 1 else 0)
                                  + tokens[r] * d.heads)),)  # the result: own and received
                      for r in range(G))
        return merge, tuple((1,) for _ in range(G))
    per = ULYSSES_FIRST_BYTES + (G - 1) * ULYSSES_MERGE_BYTES + ULYSSES_RESULT_BYTES + 4 * (G - 1) / G
    merge = tuple((round(d.batch * split[r] * sum(tokens) * head_dim * per
                         + BH * tokens[r] * head_dim * (ULYSSES_INPUT_BYTES + ULYSSES_PIECE_BYTES * (G - 1) / G)),)
                  for r in range(G))
    return merge, tuple((G * G,) for _ in range(G))


def _all_to_all(spec: StrategyFacts, d: Demand, host: dict, shared: dict, *, head_dim: int, dtype_bytes: int,
                head_order: tuple[int, ...] | None) -> Work:
    """``work`` of the ``all-to-all`` schedule: every rank receives Q, K, V of its H/G heads for
    every token (phase 1) and sends each rank its tokens' output back; it computes the kept
    pairs of the heads ``_head_order`` gives it, in one step."""
    G, tokens = d.ranks, d.tokens
    split = head_split(d.heads, G)
    first = [sum(split[:r]) for r in range(G)]
    order = _head_order(d, head_order)
    mine = [sum(d.head_pairs[h] for h in order[first[r]:first[r] + split[r]]) for r in range(G)]
    row = head_dim * dtype_bytes * d.batch
    flops = tuple((4.0 * head_dim * mine[r],) for r in range(G))
    recv = tuple(tuple(3 * tokens[(r - k) % G] * split[r] * row for k in range(1, G)) for r in range(G))
    back = tuple(tuple(tokens[r] * split[(r - k) % G] * row for k in range(1, G)) for r in range(G))
    merge, launches = _all_to_all_merges(d, split, head_dim)
    density = tuple(mine[r] / max(1, d.batch * split[r] * sum(tokens) ** 2) for r in range(G))
    if order != contiguous_heads(d.heads):  # the heads reordered before the run, back after it
        before, after = HEAD_ORDER_OPS
        host = dict(host, run_ops=tuple((a + before, b + before, c + after) for a, b, c in host["run_ops"]),
                    issue_ops=tuple(i + before for i in host["issue_ops"]))
    return Work(spec.name, "all-to-all", G, flops, launches, recv, back, merge_bytes=merge, density=density,
                **shared, **host)


def _rounds(spec: StrategyFacts, d: Demand, schedule: str, host: dict, shared: dict, *, head_dim: int,
            dtype_bytes: int) -> Work:
    """``work`` of the ``relay-ring`` and ``direct`` schedules: step 0 computes the local shard,
    step k the shard of origin r−k, received in round k; what a round carries follows from the
    byte rule (a full shard, exactly the demanded blocks, or a relay hop's)."""
    G, BH, tokens = d.ranks, d.batch * d.heads, d.tokens
    kv = 2 * head_dim * dtype_bytes  # K+V bytes per token and head
    dense = not spec.sparse
    flops = tuple(tuple(4.0 * head_dim * (BH * tokens[r] * tokens[(r - k) % G] if dense
                                          else d.pairs[r][(r - k) % G]) for k in range(G))
                  for r in range(G))
    launches = tuple(tuple(1 if (dense or f > 0) else 0 for f in row) for row in flops)
    merge = tuple(_merge_steps(launches[r], BH * tokens[r] * head_dim) for r in range(G))
    if spec.byte_rule == "full-shards":
        recv = tuple(tuple(tokens[(r - k) % G] * BH * kv for k in range(1, G)) for r in range(G))
    elif spec.byte_rule == "direct":
        recv = tuple(tuple(d.direct[r][(r - k) % G] * kv for k in range(1, G)) for r in range(G))
    else:  # ring-relay: hop k into r carries origin r−k's blocks any of r, r+1, …, r−k−1 needs
        if d.relay is None:
            raise ValueError(f"{spec.name}: the demand was measured without relay=True")
        recv = tuple(tuple(x * kv for x in d.relay[r]) for r in range(G))
    density = tuple(1.0 if dense else sum(d.pairs[r]) / max(1, BH * tokens[r] * sum(tokens)) for r in range(G))
    return Work(spec.name, schedule, G, flops, launches, recv, (), merge_bytes=merge, density=density,
                **shared, **host)


def resolve_local_first(setting: bool | None, spec: StrategyFacts, d: Demand, profile: Profile | None,
                        transport: TransportFigure | str | None, *, head_dim: int, dtype_bytes: int = 2) -> bool:
    """Whether a call of ``strategy`` with ``SparspConfig.local_first`` = ``setting`` runs local
    first (``sp_attention``): never for a strategy not registered ``local_first``; True: always;
    False: never; None (automatic): where ``local_first_pays`` says so on every rank (the code
    decides per rank, the model simulates one order per call: a call whose ranks disagree is
    simulated in order); without ``profile``, in order. ``transport``: its figure in
    ``profile`` or a name (``Profile.transport``)."""
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"local_first must be None (automatic), True or False, got {setting!r}")
    if not spec.local_first or setting is False:
        return False
    if setting:
        return True
    if profile is None:
        return False
    return all(local_first_pays(spec, d, profile, transport, head_dim=head_dim, dtype_bytes=dtype_bytes))


def local_first_pays(spec: StrategyFacts, d: Demand, profile: Profile, transport: TransportFigure | str | None, *,
                     head_dim: int, dtype_bytes: int = 2) -> tuple[bool, ...]:
    """Per rank: ``Call.local_first_pays`` (``SparspConfig.local_first=None``) on this demand,
    as a steady call of the geometry sees it (its last call's figures are this call's).

    Never over ``nccl`` (``transport``: the call's transport, its figure in ``profile`` or a
    name, ``Profile.transport``: None = the profile's default). Else yes where the first
    round's payload rows (K and V) take no longer over the
    pair's bandwidth than the local kept pairs take to compute, with the fabric figures the
    code uses (``chunks.profile_fabric`` of ``profile``: ``chunks.fabric`` reads the same from
    the built-in profile of the transport's kind or the profile ``env.profile()`` names). The
    rows are, as in ``Call._remember_round``, the larger of the round-1 payloads the rank sends
    and receives (byte rules ``direct`` and ``relay``; a payload cut into head-group units
    counts whole, its units summed); without one (``full-shards``, a group of one) the previous
    rank's whole shard. The local pairs are counted in tokens (the code counts kept blocks × block size²: a short tail block counts
    whole there)."""
    strategy = spec.name
    G, BH = d.ranks, d.batch * d.heads
    if not spec.local_first:
        return (False,) * G
    figure = profile.transport(transport)
    if figure.name == "nccl":
        return (False,) * G
    fab = profile_fabric(profile, figure, head_dim)
    rule = spec.byte_rule
    out = []
    for r in range(G):
        nxt, prv = (r + 1) % G, (r - 1) % G
        if G == 1 or rule == "full-shards":
            rows = BH * d.tokens[prv]
        elif rule == "direct":
            rows = max(d.direct[nxt][r], d.direct[r][prv])
        elif rule == "relay":
            if d.relay is None:
                raise ValueError(f"{strategy}: the demand was measured without relay=True")
            rows = max(d.relay[nxt][0], d.relay[r][0])
        else:
            raise ValueError(f"{strategy}: no local-first rule for byte rule {rule!r}")
        local = BH * d.tokens[r] ** 2 if not spec.sparse else d.pairs[r][r]
        out.append(transfer_hides(fab, rows=rows, pairs=local, head_dim=head_dim,
                                         dtype_bytes=dtype_bytes))
    return tuple(out)


def drain_units(d: Demand, profile: Profile, transport: TransportFigure | str | None, *, head_dim: int,
                dtype_bytes: int) -> tuple[tuple[int, int], ...]:
    """Per rank: into how many head-group units a ``direct`` strategy cuts its two drain payloads (round
    G−1: the one it sends, the one it receives) before the host sync, by its own rule
    (``chunks.unit_count``, automatic chunking) on the fabric of ``profile``, with
    the pair's packed rows and kept block pairs known as the code knows them from a geometry's
    first call (here the call's own: ``direct`` and ``pairs`` over the block size²).
    ``transport``: its figure in ``profile`` or a name (``Profile.transport``). One unit each
    when the demand does not know its block size."""
    G, bs = d.ranks, d.block_size
    if G < 2 or not bs:
        return ((1, 1),) * G
    fab = profile_fabric(profile, transport, head_dim)

    def units(owner: int, consumer: int) -> int:
        n = -(-d.tokens[consumer] // bs)
        known = (d.direct[consumer][owner], round(d.pairs[consumer][owner] / bs ** 2))
        cost = pair_cost(fab, head_dim=head_dim, dtype_bytes=dtype_bytes, block_size=bs, consumer_blocks=n,
                         read_fraction=read_fraction(known, block_size=bs, consumer_blocks=n))
        return unit_count(None, drain=True, heads=d.heads, cost=cost,
                                 max_rows=d.batch * d.heads * d.tokens[owner], known=known)

    k = G - 1
    return tuple((units(r, (r + k) % G), units((r - k) % G, r)) for r in range(G))


def chunk_ops(d: Demand, profile: Profile, transport: TransportFigure | str | None, *, head_dim: int,
              dtype_bytes: int, graphed: bool = True) -> tuple[tuple[int, int], ...]:
    """Per rank: the ops its drain units add before the host read (``MASK_CUT_OPS``,
    ``MASK_UNIT_OPS``; their ``GRAPHED_`` counts when the stage is a CUDA graph) and in the
    read's finish (``FINISH_UNIT_OPS``)."""
    cut, unit = (GRAPHED_MASK_CUT_OPS, GRAPHED_MASK_UNIT_OPS) if graphed else (MASK_CUT_OPS, MASK_UNIT_OPS)

    def ops(u: int, cut: float, unit: float) -> float:
        return 0.0 if u <= 1 else cut + unit * (u - 1)

    return tuple((round(ops(a, cut, unit) + ops(b, cut, unit)),
                  round(ops(a, 0.0, FINISH_UNIT_OPS) + ops(b, 0.0, FINISH_UNIT_OPS)))
                 for a, b in drain_units(d, profile, transport, head_dim=head_dim, dtype_bytes=dtype_bytes))


def _merge_steps(launches: tuple[int, ...], elements: int) -> tuple[int, ...]:
    """Merge traffic of each compute step of one rank whose output has ``elements`` values
    (``MERGE_*``, ``FINAL_*``: the first partial kept, each later one folded into the
    accumulator before the next kernel, the last one merged into the output after the last)."""
    total = sum(n > 0 for n in launches)
    out, k = [], 0
    for n in launches:
        k += n > 0
        if n == 0 or k == 1:
            out.append(0)
        elif k == total:
            out.append(elements * (FINAL_SECOND_BYTES if k == 2 else FINAL_BYTES))
        else:
            out.append(elements * (MERGE_SECOND_BYTES if k == 2 else MERGE_BYTES))
    return tuple(out)


# --- contention: routes and max-min fair rates ---------------------------------------------------
