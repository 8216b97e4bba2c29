"""The host's op counts the cost model charges: how many eager PyTorch ops a call issues where.

Each table is keyed by the kind of strategy (``dense``, or a sparse strategy's byte rule:
``cost.model.kind_of``) and gives (constant, per peer, per peer²) on G ranks. Every figure is
counted from the code (``sparsp simulate --count-ops`` recounts them all: a
``TorchDispatchMode`` over one call after a warm-up call, on every rank of a gloo group), exact
at G = 2, 3, 4, 6 unless its comment says otherwise. ``Profile.op_ms`` prices one op;
``cost.timeline`` places them in the call's program order.
"""

from __future__ import annotations

__all__ = ["EARLY_OPS", "FINISH_OPS", "FINISH_UNIT_OPS", "GRAPHED_MASK_CUT_OPS", "GRAPHED_MASK_OPS",
           "GRAPHED_MASK_UNIT_OPS", "HEAD_ORDER_OPS", "LOCAL_FIRST_RUN_OPS", "MASK_CUT_OPS", "MASK_OPS",
           "MASK_UNIT_OPS", "ONE_RANK_GRAPHED_MASK_OPS", "ONE_RANK_LOCAL_FIRST_RUN_OPS", "ONE_RANK_MASK_OPS",
           "ONE_RANK_RUN_OPS", "RUN_OPS", "finish_ops", "issue_ops", "mask_ops", "run_ops"]

# Eager PyTorch ops the mask phase issues on the host before the call's host read is started
# (q's and k's block sums in one summaries kernel launch, the metadata all-gather with its
# cached header; then the plan stage: the means, their layout and the non-finite flags from the
# gathered rows, k's sum from the gathered block sums, the mask selection, the strategy's plan,
# the layouts it prepares, the drain rule's kept pairs of the previous rank's rows, the counts;
# the read's copy queued), which the GPU waits for. Counted with ``check_finite`` on and
# steady-state chunks off, exact at G = 2, 3, 4, 6 as (constant, per peer, per peer²) by kind;
# the same in both orders (``SparspConfig.local_first`` moves what comes after the read). The
# call's profiler ranges (``groups.marker``) issue no op unless a profiler records.
MASK_OPS = {"dense": (50, 0, 0), "sparse": (98, 15, 0), "direct": (107, 119, 0),
            "relay": (135, 63, 4), "all-to-all": (123, 17, 0)}
# The same on CUDA, where the sparse strategies replay the stage from the gathered rows to the
# counts as one CUDA graph per geometry (``strategies/captured.py``, the default): the stage's
# ops become one graph launch, which reads the gathered rows in place; what remains is the
# summaries kernel (replayed from its own graph: one launch) and the all-gather before it and
# the read's start after it. Dense strategies compute no mask and run no graph.
GRAPHED_MASK_OPS = {"dense": (50, 0, 0), "sparse": (5, 0, 0), "direct": (5, 0, 0),
                    "relay": (5, 0, 0), "all-to-all": (5, 0, 0)}
# The same counts for a ``direct`` strategy on a group of one (the one-GPU reference of ``bench
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
# and publish; the all-to-all's first piece in), before the first kernel call (the rest of the
# first round, the all-to-all in and its copies), before the last one (block lists, packs,
# fetches and merges between kernels), and after it (the last merge, the output; the
# all-to-all out). Each as (constant, per peer, per peer²), exact at G = 2, 3, 4, 6 but
# the rings' first fetch and first kernel: 38 and 40 at G = 2 (their one hop lands in the output
# buffer), 39 and 41 from G = 3. No transfer starts before the host issued its fetch, no kernel
# before its launch (``timeline``).
RUN_OPS = {"dense": ((37, 0, 0), (39, 0, 0), (11, 57, 0), (25, 0, 0)),
           "full-shards": ((37, 0, 0), (39, 0, 0), (11, 58, 0), (25, 0, 0)),
           "direct": ((12, 0, 0), (14, 0, 0), (-21, 39, 0), (25, 0, 0)),
           "relay": ((12, 0, 0), (14, 0, 0), (-43, 87, 0), (25, 0, 0)),
           "all-to-all": ((18, 6, 0), (38, 24, 0), (38, 24, 0), (5, 10, 0))}
ONE_RANK_RUN_OPS = {"direct": (0, 2, 2, 2)}  # a group of one: no fetch, one kernel call
# The same for a local-first call, whose local kernel was launched before the read: its first
# fetch (the first round's pack, publish and fetch, issued on the side stream), its first
# remote kernel call, its last, after it. Exact at G = 2, 3, 4, 6 but: the first remote
# kernel's count is the one from G = 3 (at G = 2 it is the last: ``run_ops`` takes that), and
# for the rings the one from G = 4 (72 and 73 at G = 3: its second hop lands in the output
# buffer); the rings' first fetch as in order. The all-to-all never runs local first.
LOCAL_FIRST_RUN_OPS = {"dense": ((37, 0, 0), (72, 0, 0), (9, 57, 0), (25, 0, 0)),
                       "full-shards": ((37, 0, 0), (73, 0, 0), (9, 58, 0), (25, 0, 0)),
                       "direct": ((12, 0, 0), (28, 0, 0), (-23, 39, 0), (25, 0, 0)),
                       "relay": ((12, 0, 0), (76, 0, 0), (-45, 87, 0), (25, 0, 0))}
ONE_RANK_LOCAL_FIRST_RUN_OPS = {"direct": (0, 0, 0, 2)}  # no fetch, no remote kernel: the output's ops
# The all-to-all with its heads reordered by density (``strategies/ulysses.py``, where the
# balanced order is not the contiguous one): before its first fetch, q's, k's, v's and the
# mask's heads in that order (4 ops); after its last kernel, the output's heads put back (1).
# The order's index tensors are made once per order. Counted at G = 3, 4, 6, where the counting
# geometry's heads are reordered (at G = 2 they are not).
HEAD_ORDER_OPS = (4, 1)
# A ``direct`` strategy cuts a payload into head-group units before the sync (``cost/chunks.py``:
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
