"""The cost model's work: what each rank does per round (``Work``).

``measure`` reduces block masks (a layer's, in a placement's original order, or one call's,
in its placed order: ``Blocks``) to exact integers per pair of ranks and per head, with one
host transfer (``Demand``); ``work`` turns a ``Demand`` into per-rank, per-round work — kept-block
FLOPs per compute step, merge traffic, bytes per round, the mask phase's ops and bytes — with
the exact rules of ``sparsp.demand`` (the bytes of every strategy sum to ``demand.comm_bytes``
per rank); ``build_work`` is both for a placement. ``sparsp simulate`` and
``strategy="auto"`` (``strategies/auto.py``) share them; ``simulate.timeline`` schedules the
work on a machine profile.

Which schedule a strategy follows comes from its registration (``sparsp.strategies.registry``:
``byte_rule``, ``sparse``), so a newly registered strategy with a known byte rule is simulated
without changes here.

Every rank first pays a fixed phase: ``call_ms`` plus the mask phase up to the start of the
call's one host read, the longer of the host issuing its counted ops and the device's path
(the metadata all-gather, the input passes, the mask selection). Where the rest of the host's
counted ops fall depends on the call's order (``Work.local_first``): in order, the host waits
for the read, finishes it (``FINISH_OPS``) and issues the run's ops, which no kernel may outrun
(``RUN_OPS``); local first (a strategy registered ``local_first`` whose
``SparspConfig.local_first`` is True, or None — the default, automatic — where
``local_first_pays`` says so, the rule of ``Call.local_first_pays``), the host launches the
local kernel before it waits for the read (``EARLY_OPS``), then finishes the read and issues
the run while that kernel runs (``LOCAL_FIRST_RUN_OPS``). The constants below are counted from
the code of the strategies and ``sparsp.plan`` (docs/simulate.md says how; ``opcount``
recounts the ops); nothing here is fitted to ``bench attention`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from .. import demand
from ..config import SparspConfig
from ..plan import _HEADER_SLOTS, _summary_size
from ..placement import Placement
from ..strategies.registry import strategy_names, strategy_spec
from .profiles import Profile

_DEFAULTS = {f.name: f.default for f in fields(SparspConfig)}
# ``SparspConfig.local_first``'s default: what a call does unless its config says otherwise
# (None: automatic, ``local_first_pays``; True: always local first; False: always in order)
LOCAL_FIRST: bool | None = _DEFAULTS["local_first"]
# ... and the defaults that size the metadata all-gather (``gather_bytes``): the block
# similarity off (``sim_threshold`` None), the non-finite check on
SIMILARITY: bool = _DEFAULTS["sim_threshold"] is not None
CHECK_FINITE: bool = _DEFAULTS["check_finite"]

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
# at HBM rate (``scripts/probe_call_kernels.py``); not modelled.
_MASK_BYTES_PER_SCORE = 19
# Full reads of the inputs before the call's host sync (``plan.gather_metadata``): a sparse call
# sums q and k per block (``masks.block_sums``) and v for the non-finite flag; a dense one sums
# q, k and v for the flag. Three passes over a (B, S, H, D) input either way (a sparse call's
# key sum is the sum of k's block sums, no pass of its own).
INPUT_PASSES = 3
# Eager PyTorch ops the mask phase issues on the host before the call's host read is started
# (q's and k's block sums, k's and v's sums, the metadata all-gather with its cached header;
# then the plan stage: the means, their layout and the non-finite flags from the gathered rows,
# the mask selection, the strategy's plan, the layouts it prepares, the counts; the read's copy
# queued), which the GPU waits for: counted with ``python -m sparsp.simulate.opcount`` (a
# ``TorchDispatchMode`` over one call after a warm-up call, on every rank of a gloo group,
# ``check_finite`` on, steady-state chunks off) at G = 2, 3, 4, 6, exact for all four as
# (constant, per peer, per peer²) by the strategy's kind; the same in both orders
# (``SparspConfig.local_first`` moves what comes after the read). Recounted at cec0721 (the
# leaner all-gather: 248 → 239 for ``sparsp`` at G = 2), and again for the drain rule's kept
# pairs of the previous rank's rows (``Call.kept_counts``: + 3). Recounted for the summaries'
# one kernel (``masks.summaries_into``: counted as the CUDA path issues it, one launch where the
# torch form issued 12 ops; k's sum made in the stage from the gathered block sums: + 1 per rank),
# and again for the call's profiler ranges, which issue no op unless a profiler records
# (``groups.marker``: 2 ops per range; the metadata step's and the plan stage's before the read),
# and for the gathered rows kept per geometry (``plan._gathered_rows``: no ``empty`` per call).
MASK_OPS = {"dense": (50, 0, 0), "sparse": (98, 15, 0), "direct": (107, 119, 0),
            "relay": (135, 63, 4)}
# The same on CUDA, where the sparse strategies replay the stage from the gathered rows to the
# counts as one CUDA graph per geometry (``strategies/captured.py``, the default): the stage's
# ops become one graph launch; what remains is the block
# sums and the all-gather before it and the read's start after it (``opcount``'s
# ``GRAPHED_MASK_OPS``: 49 → 24 at cec0721, which moved the means and the flags into the
# stage; 24 → 12 with the summaries' one kernel, 12 → 7 without the profiler ranges, 7 → 5 with
# the gathered rows kept per geometry, which the graph reads in place: no ``empty``, no copy).
# (The summing kernel, replayed from its own graph on CUDA (``plan._graphed_summaries``), stays
# one launch.) Dense strategies compute no mask and run no graph.
GRAPHED_MASK_OPS = {"dense": (50, 0, 0), "sparse": (5, 0, 0), "direct": (5, 0, 0),
                    "relay": (5, 0, 0)}
# The same counts for ``sparsp`` on a group of one (the one-GPU reference of ``bench
# attention``'s ``1gpu-sparse`` row: a plan without peers): 94 eager, 5 graphed.
ONE_RANK_MASK_OPS, ONE_RANK_GRAPHED_MASK_OPS = {"direct": 94}, {"direct": 5}
# Ops after the host read, before the strategy's run, in both orders (``Metadata.finish``: the
# header checks and the layouts from the read's counts, and the end of its profiler range): the
# device waits for them before the run's first kernel (in order, the local one; local first, the
# first remote one). Counted as ``MASK_OPS``, exact at G = 2, 3, 4, 6 (G = 1: 4, the formula's).
FINISH_OPS = {"dense": (4, 0, 0), "sparse": (4, 0, 0), "direct": (4, 5, 0), "relay": (5, 4, 0)}
# Local first: ops after the read's start before the local kernel's launch (q's head-major
# view, the local K/V wrapper), and after that launch before the host waits for the read (none:
# the first partial is kept as the kernel returns it, no merge op). Every kind, every G.
EARLY_OPS = (2, 0)
# Eager PyTorch ops the host issues in the run (after ``FINISH_OPS``), in program order
# (``opcount``: every op but the kernel's own, which on a GPU is one FA4 launch,
# ``Profile.launch_ms``), in order: before the first fetch is issued (the first round's pack
# and publish; ulysses' first piece of its all-to-all in), before the first kernel call (the
# rest of the first round, ulysses' all-to-all in and its copies), before the last one (block
# lists, packs, fetches and merges between kernels), and after it (the last merge, the output;
# ulysses' all-to-all out). Each as (constant, per peer, per peer²), exact at G = 2, 3, 4, 6 but
# the rings' first fetch and first kernel: 38 and 40 at G = 2 (their one hop lands in the output
# buffer), 39 and 41 from G = 3. No transfer starts before the host issued its fetch, no kernel
# before its launch (``timeline``).
RUN_OPS = {"dense": ((37, 0, 0), (39, 0, 0), (11, 57, 0), (25, 0, 0)),
           "full-shards": ((37, 0, 0), (39, 0, 0), (11, 58, 0), (25, 0, 0)),
           "direct": ((12, 0, 0), (14, 0, 0), (-21, 39, 0), (25, 0, 0)),
           "relay": ((12, 0, 0), (14, 0, 0), (-43, 87, 0), (25, 0, 0)),
           "all-to-all": ((18, 6, 0), (38, 24, 0), (38, 24, 0), (5, 10, 0))}
ONE_RANK_RUN_OPS = {"direct": (0, 2, 2, 2)}  # ``sparsp`` on a group of one: no fetch, one kernel call
# The same for a local-first call, whose local kernel was launched before the read: its first
# fetch (the first round's pack, publish and fetch, issued on the side stream), its first
# remote kernel call, its last, after it. Exact at G = 2, 3, 4, 6 but: the first remote
# kernel's count is the one from G = 3 (at G = 2 it is the last: ``run_ops`` takes that), and
# for the rings the one from G = 4 (72 and 73 at G = 3: its second hop lands in the output
# buffer); the rings' first fetch as in order. ``ulysses`` never runs local first.
LOCAL_FIRST_RUN_OPS = {"dense": ((37, 0, 0), (72, 0, 0), (9, 57, 0), (25, 0, 0)),
                       "full-shards": ((37, 0, 0), (73, 0, 0), (9, 58, 0), (25, 0, 0)),
                       "direct": ((12, 0, 0), (28, 0, 0), (-23, 39, 0), (25, 0, 0)),
                       "relay": ((12, 0, 0), (76, 0, 0), (-45, 87, 0), (25, 0, 0))}
ONE_RANK_LOCAL_FIRST_RUN_OPS = {"direct": (0, 0, 0, 2)}  # no fetch, no remote kernel: the output's ops
# ``sparsp`` cuts a payload into head-group units before the sync (``strategies/chunks.py``:
# automatically only the drain of a transfer-bound pair, into 4 units): the units' selections
# are stacked and laid out by one set of kernels (``packing.prepare`` on [U, B·H, n]), and a
# received payload's block lists are made per unit in the stage instead of once whole. Same
# count, G = 2, 3, 4, 6 (the same at each), a rank's two drain payloads (sent, received) cut
# into u = 2, 4, 12 units: before the read 58, 118, 358 ops more than unchunked =
# 28 + 30·(u − 1), i.e. per payload 14 once it is cut (the stacking, the units' views) and 15
# per unit more (a received unit's block lists); graphed, all of it is inside the graph: none
# more. The finish slices each unit's layout from the read: 5, 15, 55 ops more = 2.5 per
# payload and unit, in both cases. The chunk rule (``chunks.unit_count``) charges the eager
# count, before the read and in the finish, until the chunked drain is measured with graphs.
MASK_CUT_OPS, MASK_UNIT_OPS = 14, 15
GRAPHED_MASK_CUT_OPS, GRAPHED_MASK_UNIT_OPS = 0, 0
FINISH_UNIT_OPS = 2.5
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


def schedule_of(strategy: str) -> str:
    """``relay-ring``, ``direct`` or ``all-to-all``: how ``strategy`` issues its rounds."""
    rule = strategy_spec(strategy).byte_rule
    if not isinstance(rule, str) or rule not in SCHEDULES:
        raise ValueError(f"strategy {strategy!r} has byte rule {rule!r}; simulate models "
                         f"{', '.join(SCHEDULES)}")
    return SCHEDULES[rule]


@dataclass(frozen=True)
class Work:
    """What one attention call asks of each rank, independent of the hardware.

    ``flops[r][i]``: FLOPs of rank r's compute step i (ring-like and ``sparsp``: step 0 is the
    local shard, step k the shard of round k; ``ulysses``: one step). ``launches[r][i]``: kernel
    calls in that step. ``recv[r][k-1]``: bytes rank r receives in round k (phase 1 for
    ``ulysses``), ``back[r][k-1]``: bytes of ``ulysses``'s output all-to-all (empty otherwise).
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
    partial result (``ulysses``: and its copies, ``ULYSSES_INPUT_BYTES``)."""
    gather_bytes: tuple[int, ...] = ()
    """Per rank: bytes it receives in the metadata all-gather (header + padded summaries)."""
    heads: int = 0
    """Heads per batch element, and ``tokens`` the whole sequence: the shape ``bench kernel``
    rows are keyed by (``Profile.kernel_rate``); 0 = unknown."""
    tokens: int = 0
    density: tuple[float, ...] = ()
    """Per rank: the kept share of its queries' (query, key) pairs over the whole sequence
    (``ulysses``: of its heads' queries), the density ``bench kernel`` rows are measured at."""
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

    def layout(self, step: int) -> str:
        """The kernel's K/V layout in compute step ``step``: the own shard as given (``local``,
        step 0 of the ring-like and ``sparsp`` schedules) or a packed buffer (``packed``: every
        received payload; ``ulysses`` packs every key slice)."""
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


# --- demand: what a mask asks of each rank, in exact integers ----------------------------------


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
    return demand.rank_figures(masks, blocks.bounds(masks.device), L, masks.shape[0] // batch, blocks.rows)


def demand_figures(masks: torch.Tensor, blocks: Blocks, *, batch: int = 1, relay: bool = False) -> torch.Tensor:
    """float64 [2G² + heads (+ G(G−1) with ``relay``)] on the masks' device: the exact sums
    ``demand_of`` reads (device ops only, no host sync: a captured plan stage may hold them)."""
    masks = masks.bool()
    G, BH = blocks.ranks, masks.shape[0]
    if BH % batch:
        raise ValueError(f"{BH} mask rows do not split into a batch of {batch}")
    device = masks.device
    L, _, onehot, remote = blocks.constants(device)
    if blocks.rows is not None and not relay and demand.rank_figures_ok(masks):
        return _column_figures(masks, blocks, batch)
    pairs = _pair_tokens(masks, blocks)
    if blocks.rows is None:  # analysis order: the one demand function (boolean row selection)
        need = demand.remote_demand(masks, blocks.owner.to(device), G)
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


def mask_bytes(d: Demand, *, head_dim: int, dtype_bytes: int, sparse: bool = True) -> tuple[int, ...]:
    """Device bytes of each rank's mask phase (plan.py): ``INPUT_PASSES`` reads of its q, k, v
    and, for a sparse call, the selection of the whole mask (``_MASK_BYTES_PER_SCORE``)."""
    BH = d.batch * d.heads
    scores = BH * d.blocks * d.blocks * _MASK_BYTES_PER_SCORE if sparse else 0
    return tuple(INPUT_PASSES * t * BH * head_dim * dtype_bytes + scores for t in d.tokens)


def gather_bytes(d: Demand, *, head_dim: int, sparse: bool) -> tuple[int, ...]:
    """Bytes each rank receives in the metadata all-gather: G−1 rows of float32, each a header
    (11 slots: ``plan._HEADER_SLOTS`` + the summaries' size) and the summaries padded to the
    largest rank's (``plan._summary_size`` with the config's defaults, similarity off and
    ``check_finite`` on: q's and k's block sums 2·B·n·H·D, k's sum B·H·D and v's sum 1 for a
    sparse call — the means and similarities are no longer sent since cec0721 —; a dense call
    sends its q, k and v sums for the check, 3). A dense call in a group whose capacity a
    sparse call grew pads to it; not charged."""
    B, H = d.batch, d.heads
    n = max(-(-t // d.block_size) for t in d.tokens) if d.block_size else -(-d.blocks // d.ranks)
    body = _summary_size(B, H, head_dim, n, SIMILARITY, CHECK_FINITE) if sparse else 3 * int(CHECK_FINITE)
    return tuple((d.ranks - 1) * 4 * (_HEADER_SLOTS + 1 + body) for _ in d.tokens)


def pair_flops(masks: torch.Tensor, placement: Placement, head_dim: int, dense: bool = False) -> torch.Tensor:
    """Float64 [G, G]: kept-block FLOPs of rank r's queries against origin p's keys, all heads
    (4 · q_len · k_len · head_dim per kept (head, q block, k block): QKᵀ and PV)."""
    if dense:
        masks = torch.ones_like(masks, dtype=torch.bool)
    return 4.0 * head_dim * _pair_tokens(masks.bool(), Blocks.of(placement))


def build_work(masks: torch.Tensor, placement: Placement, strategy: str, *, head_dim: int,
               dtype_bytes: int = 2, profile: Profile | None = None, transport: str | None = None,
               local_first: bool | None = LOCAL_FIRST) -> Work:
    """Per-rank, per-round work of ``strategy`` for masks bool [heads, nB, nB] (original order);
    ``profile``/``transport``/``local_first``: see ``work``."""
    if strategy not in strategy_names():
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(strategy_names())}")
    schedule_of(strategy)  # a byte rule the model does not know: ValueError before any work
    d = measure(masks, Blocks.of(placement), relay=strategy_spec(strategy).byte_rule == "relay")
    return work(strategy, d, head_dim=head_dim, dtype_bytes=dtype_bytes, profile=profile, transport=transport,
                local_first=local_first)


def work(strategy: str, d: Demand, *, head_dim: int, dtype_bytes: int = 2, profile: Profile | None = None,
         transport: str | None = None, graphed: bool = True, local_first: bool | None = LOCAL_FIRST) -> Work:
    """Per-rank, per-round work of ``strategy`` for a measured ``Demand``.

    Hardware-independent but for two decisions the code makes from the machine's figures
    (``chunks.fabric``; here those of ``profile``, ``chunks.profile_fabric``, with the call's
    ``transport`` on it, None = the profile's default): into how many head-group units
    ``sparsp`` cuts its drain payloads before the host sync (``chunk_ops``), which costs host
    ops, and, with ``local_first`` None, whether the call runs local first
    (``resolve_local_first``). Without ``profile`` no units are charged and an automatic call
    runs in order (as the code's first call of a geometry, which has no figures yet).
    ``graphed``: the plan stage is a CUDA graph (``SparspConfig.cuda_graphs`` on a GPU, the
    default); False counts it eagerly. ``local_first``: the call's ``SparspConfig.local_first``
    (default, the config's: None, automatic); only a strategy registered ``local_first`` runs
    local first (``Work.local_first``, always a bool)."""
    spec = strategy_spec(strategy)
    schedule = schedule_of(strategy)
    early = resolve_local_first(local_first, strategy, d, profile, transport, head_dim=head_dim,
                                dtype_bytes=dtype_bytes)
    G, BH = d.ranks, d.batch * d.heads
    tokens = d.tokens
    kv = 2 * head_dim * dtype_bytes  # K+V bytes per token and head
    masking = mask_bytes(d, head_dim=head_dim, dtype_bytes=dtype_bytes, sparse=spec.sparse)
    gathered = gather_bytes(d, head_dim=head_dim, sparse=spec.sparse)
    kind = spec.byte_rule if spec.sparse else "dense"
    ops = (mask_ops(kind, G, graphed),) * G
    finishing = (finish_ops(kind, G),) * G
    if schedule == "direct" and profile is not None:
        extra = chunk_ops(d, profile, transport, head_dim=head_dim, dtype_bytes=dtype_bytes, graphed=graphed)
        ops = tuple(n + x for n, (x, _) in zip(ops, extra))
        finishing = tuple(n + x for n, (_, x) in zip(finishing, extra))
    host = dict(host_ops=ops, finish_ops=finishing, run_ops=(run_ops(kind, G, early),) * G, local_first=early,
                early_ops=(EARLY_OPS,) * G if early else (), issue_ops=(issue_ops(kind, G, early),) * G)
    if schedule == "all-to-all":
        split = demand.head_split(d.heads, G)
        first = [sum(split[:r]) for r in range(G)]
        row = head_dim * dtype_bytes * d.batch
        flops = tuple((4.0 * head_dim * sum(d.head_pairs[first[r]:first[r] + split[r]]),) for r in range(G))
        recv = tuple(tuple(3 * tokens[(r - k) % G] * split[r] * row for k in range(1, G)) for r in range(G))
        back = tuple(tuple(tokens[r] * split[(r - k) % G] * row for k in range(1, G)) for r in range(G))
        whole = bool(d.block_size) and all(t % d.block_size == 0 for t in tokens[:-1])
        if whole:  # one kernel over the whole sequence (``ULYSSES_WHOLE_COPY_BYTES``)
            c = ULYSSES_WHOLE_COPY_BYTES * d.batch * head_dim
            merge = tuple((round(c * (3 * tokens[r] * split[r]  # own head slices in
                                      + (3 * (sum(tokens) - tokens[r]) * split[r] if d.batch > 1 else 0)
                                      + tokens[r] * d.heads)),)  # the result: own and received
                          for r in range(G))
            launches = tuple((1,) for _ in range(G))
        else:
            # one eager merge chain per query slice over G key slices, on this rank's heads for
            # every token; then the output's copies and casts (``ULYSSES_*``)
            per = ULYSSES_FIRST_BYTES + (G - 1) * ULYSSES_MERGE_BYTES + ULYSSES_RESULT_BYTES + 4 * (G - 1) / G
            merge = tuple((round(d.batch * split[r] * sum(tokens) * head_dim * per
                                 + BH * tokens[r] * head_dim * (ULYSSES_INPUT_BYTES + ULYSSES_PIECE_BYTES * (G - 1) / G)),)
                          for r in range(G))
            launches = tuple((G * G,) for _ in range(G))
        density = tuple(sum(d.head_pairs[first[r]:first[r] + split[r]]) / max(1, d.batch * split[r] * sum(tokens) ** 2)
                        for r in range(G))
        return Work(strategy, schedule, G, flops, launches, recv, back, masking,
                    merge_bytes=merge, gather_bytes=gathered, heads=d.heads, tokens=sum(tokens),
                    density=density, **host)
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
            raise ValueError(f"{strategy}: the demand was measured without relay=True")
        recv = tuple(tuple(x * kv for x in d.relay[r]) for r in range(G))
    density = tuple(1.0 if dense else sum(d.pairs[r]) / max(1, BH * tokens[r] * sum(tokens)) for r in range(G))
    return Work(strategy, schedule, G, flops, launches, recv, (), masking, merge_bytes=merge,
                gather_bytes=gathered, heads=d.heads, tokens=sum(tokens), density=density, **host)


def resolve_local_first(setting: bool | None, strategy: str, d: Demand, profile: Profile | None,
                        transport: str | None, *, head_dim: int, dtype_bytes: int = 2) -> bool:
    """Whether a call of ``strategy`` with ``SparspConfig.local_first`` = ``setting`` runs local
    first (``sp_attention``): never for a strategy not registered ``local_first``; True: always;
    False: never; None (automatic): where ``local_first_pays`` says so on every rank (the code
    decides per rank, the model simulates one order per call: a call whose ranks disagree is
    simulated in order); without ``profile``, in order."""
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"local_first must be None (automatic), True or False, got {setting!r}")
    if not strategy_spec(strategy).local_first or setting is False:
        return False
    if setting:
        return True
    if profile is None:
        return False
    return all(local_first_pays(strategy, d, profile, transport, head_dim=head_dim, dtype_bytes=dtype_bytes))


def local_first_pays(strategy: str, d: Demand, profile: Profile, transport: str | None, *,
                     head_dim: int, dtype_bytes: int = 2) -> tuple[bool, ...]:
    """Per rank: ``Call.local_first_pays`` (``SparspConfig.local_first=None``) on this demand,
    as a steady call of the geometry sees it (its last call's figures are this call's).

    Never over ``nccl`` (``transport``: the call's transport name, None = the profile's
    default). Else yes where the first round's payload rows (K and V) take no longer over the
    pair's bandwidth than the local kept pairs take to compute, with the fabric figures the
    code uses (``chunks.profile_fabric`` of ``profile``: ``chunks.fabric`` reads the same from
    the built-in profile of the transport's kind or ``$SPARSP_PROFILE``). The rows are, as in
    ``Call._remember_round``, the larger of the round-1 payloads the rank sends and receives
    (for a plan: ``sparsp``, ``ring-relay``; a payload cut into head-group units counts whole,
    its units summed); without one (``ring``, ``ring-sparse``, a group of one) the previous
    rank's whole shard. The local pairs are
    counted in tokens (the code counts kept blocks × block size²: a short tail block counts
    whole there)."""
    from ..strategies import chunks

    spec = strategy_spec(strategy)
    G, BH = d.ranks, d.batch * d.heads
    if not spec.local_first:
        return (False,) * G
    name = transport if transport is not None else profile.transport(None).name
    if name == "nccl":
        return (False,) * G
    fab = chunks.profile_fabric(profile, name, head_dim)
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
        out.append(chunks.transfer_hides(fab, rows=rows, pairs=local, head_dim=head_dim,
                                         dtype_bytes=dtype_bytes))
    return tuple(out)


def drain_units(d: Demand, profile: Profile, transport: str | None, *, head_dim: int,
                dtype_bytes: int) -> tuple[tuple[int, int], ...]:
    """Per rank: into how many head-group units ``sparsp`` cuts its two drain payloads (round
    G−1: the one it sends, the one it receives) before the host sync, by its own rule
    (``strategies/chunks.unit_count``, automatic chunking) on the fabric of ``profile``, with
    the pair's packed rows and kept block pairs known as the code knows them from a geometry's
    first call (here the call's own: ``direct`` and ``pairs`` over the block size²).
    One unit each when the demand does not know its block size."""
    from ..strategies import chunks

    G, bs = d.ranks, d.block_size
    if G < 2 or not bs:
        return ((1, 1),) * G
    fab = chunks.profile_fabric(profile, profile.transport(transport).name, head_dim)

    def units(owner: int, consumer: int) -> int:
        n = -(-d.tokens[consumer] // bs)
        known = (d.direct[consumer][owner], round(d.pairs[consumer][owner] / bs ** 2))
        cost = chunks.pair_cost(fab, head_dim=head_dim, dtype_bytes=dtype_bytes, block_size=bs, consumer_blocks=n,
                                read_fraction=chunks.read_fraction(known, block_size=bs, consumer_blocks=n))
        return chunks.unit_count(None, drain=True, heads=d.heads, cost=cost,
                                 max_rows=d.batch * d.heads * d.tokens[owner], known=known)

    k = G - 1
    return tuple((units(r, (r + k) % G), units((r - k) % G, r)) for r in range(G))


def chunk_ops(d: Demand, profile: Profile, transport: str | None, *, head_dim: int,
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


def _poly(abc: tuple[int, int, int], ranks: int) -> int:
    a, b, c = abc
    return a + b * (ranks - 1) + c * (ranks - 1) ** 2


def mask_ops(kind: str, ranks: int, graphed: bool = True) -> int:
    """Host ops of the mask phase up to the host read's start (``MASK_OPS``;
    ``GRAPHED_MASK_OPS`` when the stage is a CUDA graph, the default on GPUs) for a strategy of
    ``kind`` (``dense``, or the byte rule of a sparse strategy) on ``ranks`` ranks."""
    one, table = (ONE_RANK_GRAPHED_MASK_OPS, GRAPHED_MASK_OPS) if graphed else (ONE_RANK_MASK_OPS, MASK_OPS)
    if ranks == 1 and kind in one:
        return one[kind]
    return _poly(table.get(kind, table["sparse"]), ranks)


def finish_ops(kind: str, ranks: int) -> int:
    """Host ops after the read, before the run (``FINISH_OPS``), for a strategy of ``kind``."""
    return _poly(FINISH_OPS.get(kind, FINISH_OPS["sparse"]), ranks)


def _run_table(kind: str, ranks: int, local_first: bool) -> tuple[int, int, int, int]:
    """(before the first fetch, the first kernel call, the last, after it) on ``ranks`` ranks."""
    one, table = ((ONE_RANK_LOCAL_FIRST_RUN_OPS, LOCAL_FIRST_RUN_OPS) if local_first
                  else (ONE_RANK_RUN_OPS, RUN_OPS))
    if ranks == 1 and kind in one:
        return one[kind]
    fetch, first, last, tail = (_poly(abc, ranks) for abc in table[kind])
    if local_first and ranks <= 2:  # the one remote kernel is the last; the table's first is from G = 3
        first = last
    return fetch, first, max(first, last), tail


def run_ops(kind: str, ranks: int, local_first: bool = False) -> tuple[int, int, int]:
    """Host ops of the run (``RUN_OPS``; ``LOCAL_FIRST_RUN_OPS`` for a local-first call, of its
    remote kernel calls) for a strategy of ``kind`` (``dense``, or a sparse strategy's byte
    rule) on ``ranks`` ranks: (before the first kernel call, before the last, after the last)."""
    return _run_table(kind, ranks, local_first)[1:]


def issue_ops(kind: str, ranks: int, local_first: bool = False) -> int:
    """Host ops of the run before its first fetch is issued (``RUN_OPS``,
    ``LOCAL_FIRST_RUN_OPS``): the first round's transfer waits for them."""
    return _run_table(kind, ranks, local_first)[0]


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
