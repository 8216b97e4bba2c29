"""The chunked pipeline of the ``sparsp`` strategy (paper §7): the scheduler and the strategy.

What must hold: chunked output equals the unchunked strategy and the single-process
reference; every kept (query block, key block) pair is computed exactly once, and nothing
else; the bytes moved do not change; sender and consumer agree on every message (any
mismatch hangs or garbles, so equal outputs on several transports and counts show it); the
scheduler orders the chunk with the least compute last, keeps tiny or compute-bound payloads
whole and honours the configured counts; bad counts raise ``ValueError``.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import random_slice_case, reference, run_distributed, slice_blocks
from sparsp import SparspConfig
from sparsp import env
from sparsp.cost import chunks
from sparsp.cost.chunks import Fabric, Piece

# -- the scheduler ---------------------------------------------------------------------------


def _cost(bytes_per_s=1e9, flops_per_s=1e12, chunk_s=0.0, min_chunk_bytes=1, consumer_blocks=8,
          message_s=0.0):
    fab = Fabric(bytes_per_s, flops_per_s, chunk_s, message_s, min_chunk_bytes)
    return chunks.pair_cost(fab, head_dim=64, dtype_bytes=2, block_size=64,
                            consumer_blocks=consumer_blocks)


TRANSFER_BOUND = _cost(bytes_per_s=1e6)  # ratio ≫ 1
COMPUTE_BOUND = _cost(bytes_per_s=1e15)  # ratio ≪ 1


def _pieces(blocks, heads_per_piece=2, rows_per_block=64):
    out, h = [], 0
    for b in blocks:
        out.append(Piece((h, h + heads_per_piece), b, b * rows_per_block))
        h += heads_per_piece
    return out


@pytest.mark.parametrize("heads, count", [(8, 4), (7, 3), (5, 2), (3, 5), (1, 1), (40, 4)])
def test_head_groups_cover_heads(heads, count):
    groups = chunks.head_groups(heads, count)
    assert len(groups) == min(count, heads)
    assert groups[0][0] == 0 and groups[-1][1] == heads
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    sizes = [h1 - h0 for h0, h1 in groups]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_ratio_follows_the_fabric():
    assert TRANSFER_BOUND.ratio > 100 and COMPUTE_BOUND.ratio < 0.01
    # transfer/compute of a block does not depend on the payload, only on fabric and shapes
    assert _cost(consumer_blocks=16).ratio == pytest.approx(_cost(consumer_blocks=8).ratio / 2)


def test_order_puts_least_compute_last_when_transfer_bound():
    pieces = _pieces([5, 1, 9, 3])
    order = chunks.order(pieces, TRANSFER_BOUND)
    assert [pieces[i].blocks for i in order] == [9, 5, 3, 1]
    # ties keep head order, so both ends derive the same sequence
    assert chunks.order(_pieces([2, 2, 2]), TRANSFER_BOUND) == [0, 1, 2]


def test_order_starts_with_least_transfer_when_compute_bound():
    pieces = _pieces([5, 1, 9, 3])
    order = chunks.order(pieces, COMPUTE_BOUND)
    assert [pieces[i].blocks for i in order] == [1, 3, 5, 9]  # Johnson's rule, first set


def test_least_compute_last_beats_head_order():
    pieces = _pieces([1, 6, 6, 6])  # the sparsest chunk first in head order
    cost = TRANSFER_BOUND
    busy = sum(p.compute_s(cost) for p in pieces)
    ordered = [pieces[i] for i in chunks.order(pieces, cost)]
    assert ordered[-1].blocks == 1
    assert chunks.finish_time(ordered, cost, busy) < chunks.finish_time(pieces, cost, busy)


def test_schedule_forced_count_is_honoured_and_ordered():
    pieces = _pieces([4, 1, 7, 2, 5])
    groups = chunks.schedule(pieces, count=5, cost=TRANSFER_BOUND)
    assert sorted(groups) == [(0,), (1,), (2,), (3,), (4,)]
    assert [pieces[g[0]].blocks for g in groups] == [7, 5, 4, 2, 1]
    # fewer groups than pieces: consecutive merges (near-equal), every piece exactly once
    groups = chunks.schedule(pieces, count=2, cost=TRANSFER_BOUND)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert sorted(groups) == [(0, 1, 2), (3, 4)]


def test_schedule_drops_empty_groups():
    pieces = _pieces([3, 0, 0, 2])
    groups = chunks.schedule(pieces, count=4, cost=TRANSFER_BOUND)
    assert sorted(groups) == [(0,), (3,)]
    assert chunks.schedule(_pieces([0, 0]), count=2, cost=TRANSFER_BOUND) == []
    assert chunks.schedule(_pieces([0, 0]), count=None, cost=TRANSFER_BOUND) == []


def test_schedule_auto_chunks_a_transfer_bound_payload():
    pieces = _pieces([8, 8, 8, 8])
    groups = chunks.schedule(pieces, count=None, cost=TRANSFER_BOUND)
    assert len(groups) == 4


def test_schedule_auto_keeps_compute_bound_payload_whole():
    groups = chunks.schedule(_pieces([8, 8, 8, 8]), count=None, cost=COMPUTE_BOUND)
    assert groups == [(0, 1, 2, 3)]


def test_schedule_auto_keeps_tiny_payload_whole():
    # a chunk's bytes must reach min_chunk_bytes: 4 pieces of 64 rows · 256 B = 16 KiB each
    tiny = _cost(bytes_per_s=1e6, min_chunk_bytes=1 << 20)
    assert chunks.schedule(_pieces([1, 1, 1, 1]), count=None, cost=tiny) == [(0, 1, 2, 3)]
    # and launches that cost more than the overlap wins keep it whole too
    costly = _cost(bytes_per_s=1e6, chunk_s=10.0)
    assert chunks.schedule(_pieces([1, 1, 1, 1]), count=None, cost=costly) == [(0, 1, 2, 3)]


def test_schedule_auto_weighs_overlap_against_launches():
    # transfer = 2 × compute, launches 0.2 × compute per chunk (finish_time, compute X = 32):
    # 1 chunk ends at 3.2 X, 2 chunks at 2.7 X, 4 chunks at 2.8 X: two chunks win
    pieces = _pieces([8] * 4)  # 64 rows per block
    cost = chunks.PairCost(row_s=2 / 64, block_s=1.0, chunk_s=0.2 * 32, message_s=0.0,
                           block_size=64, min_chunk_rows=1)
    busy = 32.0
    times = {c: chunks.finish_time([chunks.combine(pieces, g) for g in chunks.merge(pieces, c)],
                                   cost, busy) for c in (1, 2, 4)}
    assert times == pytest.approx({1: 3.2 * 32, 2: 2.7 * 32, 4: 2.8 * 32})
    assert chunks.schedule(pieces, count=None, cost=cost) in ([(0, 1), (2, 3)], [(2, 3), (0, 1)])
    # cheaper launches: the finest split wins; no overlap to gain (transfer = compute): whole
    cheap = chunks.PairCost(2 / 64, 1.0, 0.01, 0.0, 64, 1)
    assert len(chunks.schedule(pieces, count=None, cost=cheap)) == 4
    even = chunks.PairCost(1 / 64, 1.0, 0.01, 0.0, 64, 1)
    assert chunks.schedule(pieces, count=None, cost=even) == [(0, 1, 2, 3)]


def test_unit_count_rules():
    big = 1 << 30
    # a configured count is honoured (clamped to the heads), drain or not, whatever the cost
    assert chunks.unit_count(3, drain=True, heads=8, cost=COMPUTE_BOUND, max_rows=1) == 3
    assert chunks.unit_count(6, drain=False, heads=4, cost=COMPUTE_BOUND, max_rows=1) == 4
    assert chunks.unit_count(1, drain=True, heads=8, cost=TRANSFER_BOUND, max_rows=big) == 1
    # automatic: steady state unchunked; drain chunked only where transfer-bound and not tiny
    assert chunks.unit_count(None, drain=False, heads=8, cost=TRANSFER_BOUND, max_rows=big) == 1
    assert chunks.unit_count(None, drain=True, heads=8, cost=TRANSFER_BOUND,
                             max_rows=big) == chunks.AUTO_DRAIN_UNITS
    assert chunks.unit_count(None, drain=True, heads=3, cost=TRANSFER_BOUND, max_rows=big) == 3
    assert chunks.unit_count(None, drain=True, heads=8, cost=COMPUTE_BOUND, max_rows=big) == 1
    tiny = _cost(bytes_per_s=1e6, min_chunk_bytes=1 << 20)
    assert chunks.unit_count(None, drain=True, heads=8, cost=tiny, max_rows=100) == 1
    # the largest payload computes for less than one more chunk costs: not worth a selection
    costly = _cost(bytes_per_s=1e6, chunk_s=1.0)
    assert chunks.unit_count(None, drain=True, heads=8, cost=costly, max_rows=64 * 100) == 1
    assert chunks.unit_count(None, drain=True, heads=8, cost=costly, max_rows=big) == 4


def test_drain_rule_reads_the_known_figures_of_an_earlier_call():
    """With (packed rows, kept block pairs) of the pair's drain payload from the geometry's
    first call, transfer against compute comes from those, not from the read-fraction estimate:
    the Wan 2.1 host-fabric drain (read fraction 0.35, not 0.5) was called compute-bound by the
    estimate while its transfer outlasted the kernel."""
    from dataclasses import replace

    fab = chunks.fabric("cuda", "host", 128, "fa4", path="host")
    cost = chunks.pair_cost(fab, head_dim=128, dtype_bytes=2, block_size=128, consumer_blocks=296)
    assert cost.pair_s == pytest.approx(4 * 128 ** 2 * 128 / fab.flops_per_s)
    assert cost.ratio < 1.0  # the estimate: compute-bound, one unit
    max_rows = 40 * 37_800
    assert chunks.unit_count(None, drain=True, heads=40, cost=cost, max_rows=max_rows) == 1
    rows = 1_270_000  # 652 MB of K and V: 19 ms at 33.5 GB/s
    pairs = int(13e-3 / cost.pair_s)  # 13 ms of kernel at FA4's rate
    assert rows * cost.row_s > pairs * cost.pair_s
    assert chunks.unit_count(None, drain=True, heads=40, cost=cost, max_rows=max_rows,
                             known=(rows, pairs)) == chunks.AUTO_DRAIN_UNITS
    # the same payload computing for longer than it moves: whole
    assert chunks.unit_count(None, drain=True, heads=40, cost=cost, max_rows=max_rows,
                             known=(rows, 3 * pairs)) == 1
    # known but not worth it: the payload computes for less than the units' host cost
    dear = replace(cost, unit_s=pairs * cost.pair_s)
    assert chunks.unit_count(None, drain=True, heads=40, cost=dear, max_rows=max_rows,
                             known=(rows, pairs)) == 1
    # nothing known (no kept pair): the estimate
    assert chunks.unit_count(None, drain=True, heads=40, cost=cost, max_rows=max_rows,
                             known=(rows, 0)) == 1
    # after the sync the schedule must see the same: with the measured reads per block the four
    # units travel as chunks; with the estimate they would be merged back into one message
    pieces = [chunks.Piece((10 * i, 10 * i + 10), rows // 4 // 128, rows // 4) for i in range(4)]
    fraction = chunks.read_fraction((rows, pairs), block_size=128, consumer_blocks=296)
    assert fraction == pytest.approx(pairs / (rows / 128) / 296)
    measured = chunks.pair_cost(fab, head_dim=128, dtype_bytes=2, block_size=128, consumer_blocks=296,
                                read_fraction=fraction)
    assert len(chunks.schedule(pieces, count=None, cost=measured)) > 1
    assert len(chunks.schedule(pieces, count=None, cost=cost)) == 1
    assert chunks.read_fraction(None, block_size=128, consumer_blocks=296) == chunks.READ_FRACTION


def test_fabric_runs_at_the_calls_kernel_rate(monkeypatch):
    monkeypatch.delenv(env.PROFILE, raising=False)
    from sparsp.cost.profiles import get_profile

    fig = get_profile("h200x2-host").kernel(128)
    assert chunks.fabric("cuda", "host", 128, "fa4", path="host").flops_per_s == pytest.approx(fig.fa4_tflops * 1e12)
    assert chunks.fabric("cuda", "host", 128, "flex", path="host").flops_per_s == pytest.approx(fig.sparse_tflops * 1e12)
    assert chunks.fabric("cuda", "host", 128, path="host").flops_per_s == pytest.approx(fig.sparse_tflops * 1e12)


def test_units_pay_their_host_cost_before_the_sync():
    big = 64 * 100_000
    base = _cost(bytes_per_s=1e6)  # transfer-bound: the drain is worth cutting
    assert chunks.unit_count(None, drain=True, heads=8, cost=base, max_rows=big) == chunks.AUTO_DRAIN_UNITS
    most = big / base.block_size * base.block_s
    from dataclasses import replace

    # three more units cost more than the most a cut could save: stay whole
    dear = replace(base, unit_s=most / 2 / (chunks.AUTO_DRAIN_UNITS - 1) * 1.01)
    assert chunks.unit_count(None, drain=True, heads=8, cost=dear, max_rows=big) == 1
    cheap = replace(base, unit_s=most / 2 / (chunks.AUTO_DRAIN_UNITS - 1) * 0.5)
    assert chunks.unit_count(None, drain=True, heads=8, cost=cheap, max_rows=big) == chunks.AUTO_DRAIN_UNITS
    # a requested count is honoured whatever the units cost
    assert chunks.unit_count(3, drain=True, heads=8, cost=dear, max_rows=big) == 3


def test_fabric_from_the_measured_profiles(monkeypatch):
    monkeypatch.delenv(env.PROFILE, raising=False)
    host, ipc = chunks.fabric("cuda", "host", 128, path="host"), chunks.fabric("cuda", "ipc", 128, path="nvlink")
    assert host.bytes_per_s == pytest.approx(33.5e9)  # DESIGN: the 2-rank exchange ceiling
    assert ipc.bytes_per_s == pytest.approx(367e9)
    # NCCL plans with the profile of the fabric its transport reports (``Transport.fabric``)
    assert chunks.fabric("cuda", "nccl", 128, path="nvlink").bytes_per_s == pytest.approx(170e9)
    assert chunks.fabric("cuda", "nccl", 128, path="host").bytes_per_s == pytest.approx(33.5e9 * 21.5 / 34.3)
    # a transport the profile does not describe: the profile's default figure, never an error
    assert chunks.fabric("cuda", "peers", 128, path="host") == host
    assert host.flops_per_s == pytest.approx(409e12) and host.message_s == pytest.approx(0.27e-3)
    assert chunks.fabric("cpu", "nccl", 128, path="host") == chunks.CPU_FABRIC
    # an 8-GPU PCIe 4 box without peer access: slower link, slower kernel
    monkeypatch.setenv(env.PROFILE, "pcie4-8gpu-nop2p")
    pcie = chunks.fabric("cuda", "host", 128, path="host")
    assert pcie.bytes_per_s < host.bytes_per_s and pcie.flops_per_s < host.flops_per_s


def test_every_transport_reports_its_window_and_fabric(monkeypatch):
    """``Transport.window`` and ``Transport.fabric`` are declared on the protocol with honest
    defaults; ``nccl`` resolves its fabric from the peer access of this process's GPU."""
    from sparsp.transport import Transport, nccl
    from sparsp.transport.host import HostTransport
    from sparsp.transport.ipc import IpcTransport
    from sparsp.transport.peers import PeerTransport

    assert (Transport.window, Transport.fabric) == (None, "host")
    assert (nccl.P2PTransport.window, PeerTransport.window) == (None, None)  # no slots to wait for
    assert (IpcTransport.fabric, HostTransport.fabric) == ("nvlink", "host")
    assert nccl.peer_fabric(torch.device("cpu")) == "host"  # gloo
    access = {(0, 1): True, (0, 2): False}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access[(a, b)])
    assert nccl.peer_fabric(torch.device("cuda", 0)) == "host"  # one GPU it sees is out of reach
    access[(0, 2)] = True
    assert nccl.peer_fabric(torch.device("cuda", 0)) == "nvlink"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert nccl.peer_fabric(torch.device("cuda", 0)) == "nvlink"  # alone: the fewer-chunks side


def test_an_unknown_transport_name_raises_in_the_cost_model():
    """One rule: a transport name the profile does not describe raises ``ValueError`` naming the
    ones it has, in the chunk rules and the model alike; a running call maps its transport
    first (``Profile.call_transport``: the profile's default)."""
    from sparsp.cost import Blocks, get_profile, measure, work
    from sparsp.cost.model import drain_units, local_first_pays
    from sparsp.strategies import strategy_spec

    profile = get_profile("h200x2-host")
    message = "profile h200x2-host has no transport 'ipc'; it has host, nccl"
    with pytest.raises(ValueError, match=message):
        chunks.profile_fabric(profile, "ipc", 128)
    d = measure(torch.ones(4, 8, 8, dtype=torch.bool), Blocks.of_call((256, 256), 64), batch=1)
    for strategy in ("sparsp", "ring"):
        with pytest.raises(ValueError, match=message):
            work(strategy_spec(strategy), d, head_dim=128, profile=profile, transport="ipc")
    with pytest.raises(ValueError, match=message):
        local_first_pays(strategy_spec("sparsp"), d, profile, "ipc", head_dim=128)
    with pytest.raises(ValueError, match=message):
        drain_units(d, profile, "ipc", head_dim=128, dtype_bytes=2)
    assert profile.call_transport("ipc") is profile.transport(None) is profile.transports[0]
    assert profile.call_transport("nccl") is profile.transport("nccl")
    assert work(strategy_spec("ring"), d, head_dim=128).strategy == "ring"  # no profile: no figure needed


def test_message_latency_keeps_small_payloads_whole():
    # transfer-bound, but each message costs as much as the whole payload's transfer
    pieces = _pieces([2, 2, 2, 2])
    slow = _cost(bytes_per_s=1e6)
    total = sum(p.transfer_s(slow) for p in pieces)
    assert len(chunks.schedule(pieces, count=None, cost=slow)) == 4
    late = _cost(bytes_per_s=1e6, message_s=total)
    assert chunks.schedule(pieces, count=None, cost=late) == [(0, 1, 2, 3)]


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["chunks", "drain_chunks"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_bad_chunk_counts_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SparspConfig(**{field: value})


def test_good_chunk_counts():
    cfg = SparspConfig(chunks=3, drain_chunks=1)
    assert (cfg.chunks, cfg.drain_chunks) == (3, 1)
    assert SparspConfig().chunks is None and SparspConfig().drain_chunks is None


# -- the strategy, several processes (gloo / shared memory) ----------------------------------


_SEEN: dict = {}  # per process: what the instrumented kernel computed in the current call


def _instrument() -> None:
    """Count every (query block, key block) pair the kernel computes, per (batch, head), by
    mapping the kernel's block ids back to the origin's blocks (through the layout)."""
    from sparsp.kernels import KVBuffer, register_kernel, torch_ref
    from sparsp.strategies import call as call_module

    def kernel(q, kv, kv_num_blocks, kv_indices, *, scale=None):
        ctx = _SEEN["ctx"]
        cov, off, h0 = _SEEN["cov"], ctx["offset"], ctx["heads"][0]
        B, h, nq = kv_num_blocks.shape
        if isinstance(kv, KVBuffer):
            ids = ctx["ids"]  # [B·h, n]: buffer id of each block of the origin, -1 if absent
            back = {}
            for row in range(ids.shape[0]):
                for kb in range(ids.shape[1]):
                    if ids[row, kb] >= 0:
                        back[(row, int(ids[row, kb]))] = kb
        for b in range(B):
            for hh in range(h):
                for qb in range(nq):
                    for j in range(int(kv_num_blocks[b, hh, qb])):
                        i = int(kv_indices[b, hh, qb, j])
                        kb = back[(b * h + hh, i)] if isinstance(kv, KVBuffer) else i
                        cov[b, h0 + hh, qb, off + kb] += 1
        _SEEN["launches"].append((ctx["origin"], ctx["heads"]))
        return torch_ref.block_sparse_attention(q, kv, kv_num_blocks, kv_indices, scale=scale)

    register_kernel("torch", devices=("cpu", "cuda"))(kernel)
    attend, attend_local = call_module.Call.attend, call_module.Call.attend_local

    def attend_wrapped(self, payload, lay, origin, heads=None):
        span = heads or (0, self.shapes.heads)
        ids = lay.block_ids if heads is None else \
            call_module.head_slice(lay.block_ids, self.shapes.batch, heads)
        _SEEN["ctx"] = dict(origin=origin, heads=span, ids=ids,
                            offset=self.shapes.block_offsets[origin])
        return attend(self, payload, lay, origin, heads)

    def attend_local_wrapped(self):
        _SEEN["ctx"] = dict(origin=self.rank, heads=(0, self.shapes.heads), ids=None,
                            offset=self.shapes.block_offsets[self.rank])
        return attend_local(self)

    call_module.Call.attend, call_module.Call.attend_local = attend_wrapped, attend_local_wrapped


def _chunk_worker(rank, world, lens, H, transports, seed):
    import torch.distributed as dist

    from sparsp import sp_attention
    from sparsp.masks import split_mask
    from sparsp.strategies import get_transport

    B, D, bs = 2, 8, 16
    _instrument()
    S = sum(lens)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(1, 1, H, D, generator=g)
    q = c * 2 + torch.randn(B, S, H, D, generator=g)
    k = c * 2 + torch.randn(B, S, H, D, generator=g) + torch.linspace(-2, 2, S).view(1, S, 1, 1)
    v = torch.randn(B, S, H, D, generator=g)
    tok_block, N = slice_blocks(lens, bs)
    gm = torch.rand(B, H, N, N, generator=g) < 0.4
    gm[0, 0, 0] = False  # an empty row: its output is zeros
    gm[:, H - 1] = False  # a head that reads nothing at all: its chunks are empty
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    ql, kl, vl = (x[:, sl].contiguous() for x in (q, k, v))
    first = sum(math.ceil(L / bs) for L in lens[:rank])
    mine = slice(first, first + math.ceil(lens[rank] / bs))
    counts = [(1, 1), (2, 3), (3, 2), (None, H), (H + 2, 4), (2, None)]
    report = {}
    for transport in transports:
        t = get_transport(transport, None, torch.device("cpu"), 60)
        for use_global in (True, False):
            mask_arg = gm if use_global else None
            base_out, base_bytes = None, None
            for steady, drain in counts:
                cfg = SparspConfig(cdf_threshold=0.8, block_size=bs, transport=transport,
                                   kernel="torch", chunks=steady, drain_chunks=drain)
                cov = torch.zeros(B, H, mine.stop - mine.start, N, dtype=torch.long)
                _SEEN.update(cov=cov, launches=[])
                t.reset_counters()
                out = sp_attention(ql, kl, vl, strategy="sparsp", config=cfg,
                                   _global_mask=mask_arg)
                got_bytes = dict(t.bytes_received)
                mask = gm if use_global else split_mask(q, k, lens, bs, cdf_threshold=0.8,
                                                        sim_threshold=None)
                want = reference(q, k, v, tok_block, mask)[:, sl]
                err = (out.double() - want).abs().max().item()
                assert err <= 1e-5, f"rank {rank} {transport} {steady, drain}: error {err}"
                # every kept pair of my rows computed exactly once, nothing else
                rows = mask[:, :, mine].long()
                assert torch.equal(cov, rows), (f"rank {rank} {transport} {steady, drain}: "
                                                f"{int(cov.sum())} pairs computed, "
                                                f"{int(rows.sum())} kept")
                # the configured counts: one launch per non-empty head group of each payload
                for kr in range(1, world):
                    src = (rank - kr) % world
                    asked = drain if kr == world - 1 else steady
                    launches = [h for o, h in _SEEN["launches"] if o == src]
                    if asked is None:
                        continue
                    groups = chunks.head_groups(H, asked)
                    src_blocks = slice(sum(math.ceil(L / bs) for L in lens[:src]),
                                       sum(math.ceil(L / bs) for L in lens[:src + 1]))
                    live = [(h0, h1) for h0, h1 in groups
                            if mask[:, h0:h1, mine][..., src_blocks].any()]
                    if len(groups) == 1:
                        live = [(0, H)] if live else []
                    assert sorted(launches) == sorted(live), \
                        (rank, transport, steady, drain, src, launches, live)
                if base_out is None:
                    base_out, base_bytes = out, got_bytes
                else:
                    assert torch.allclose(out, base_out, rtol=0, atol=1e-6), \
                        f"rank {rank} {transport} {steady, drain}: differs from unchunked"
                    assert got_bytes == base_bytes, \
                        (rank, transport, steady, drain, got_bytes, base_bytes)
                report[(transport, use_global, steady, drain)] = err
        t.fence()
    dist.barrier()
    return report


CHUNK_CASES = [
    # world, per-rank tokens (uneven; the last slices end in a short tail block), heads
    (2, [48, 45], 5),
    (3, [32, 37, 41], 5),  # a short block in the middle of the sequence too
    (4, [32, 16, 48, 37], 4),
]


@pytest.mark.parametrize("world, lens, H", CHUNK_CASES)
def test_chunked_equals_unchunked_andreference(world, lens, H):
    # "host" (shared-memory slots, a window of 3) with up to H + 2 chunks per payload also
    # shows that more chunks than slots to one peer do not deadlock
    run_distributed(_chunk_worker, world, lens, H, ("nccl", "host"), 5, timeout=400)


def _auto_worker(rank, world, lens, H, seed, mode):
    """Automatic counts on a fabric made transfer-bound: the pairs' plans differ (by payload
    size and consumer), and sender and consumer must still agree on every message. ``mode``:
    ``finest`` (free launches: one chunk per unit), ``whole`` (the units merge back into one
    payload), ``pairs`` (two chunks of merged units)."""
    import torch.distributed as dist

    from sparsp import sp_attention
    from sparsp.strategies import get_transport
    from sparsp.strategies import sparsp as strategy

    chunks.CPU_FABRIC = Fabric(1e3, 1e12, 0.0, 0.0, 1)
    if mode != "finest":  # the scheduler's pick, as if launches cost more: merged units
        schedule, n_groups = chunks.schedule, 1 if mode == "whole" else 2

        def merged(pieces, *, count, cost):
            return schedule(pieces, count=min(n_groups, len(pieces)), cost=cost)

        chunks.schedule = merged
    planned = []
    payload_chunks = strategy.payload_chunks

    def recorded(call, name, k):
        out = payload_chunks(call, name, k)
        planned.append((name, k, [c.heads for c in out]))
        return out

    strategy.payload_chunks = recorded
    bs = 16
    shard, gm, want = random_slice_case(rank, lens, H, 8, bs, seed, density=0.5)
    cfg = SparspConfig(block_size=bs, transport="nccl", kernel="torch")
    out = sp_attention(*shard, strategy="sparsp", config=cfg, _global_mask=gm)
    err = (out.double() - want).abs().max().item()
    get_transport("nccl", None, torch.device("cpu"), 60).fence()
    dist.barrier()
    assert err <= 1e-5, f"rank {rank} ({mode}): error {err}"
    drain = [heads for name, k, heads in planned if k == world - 1]
    assert len(drain) == 2, planned  # one send, one receive
    expect = {"finest": lambda h: len(h) > 1, "whole": lambda h: h == [None],
              "pairs": lambda h: len(h) == 2 and None not in h}[mode]
    assert all(expect(h) for h in drain), (mode, planned)
    steady = [heads for name, k, heads in planned if k < world - 1]
    assert all(h == [None] for h in steady), planned  # the steady rounds were not chunked
    return err


@pytest.mark.parametrize("mode", ["finest", "whole", "pairs"])
def test_automatic_chunks_agree_between_ends(mode):
    run_distributed(_auto_worker, 3, [48, 32, 45], 6, 9, mode, timeout=300)


def _order_worker(rank, world, lens, H, drain, local_first):
    """The events of one call in the order the host issued them: each ``send_buffer`` and the
    step it serves, the local kernel and every chunk kernel."""
    import torch.distributed as dist

    from sparsp import sp_attention
    from sparsp.strategies import call as call_module, get_transport

    t = get_transport("host", None, torch.device("cpu"), 60)
    events: list = []
    send_buffer, attend, attend_local = t.send_buffer, call_module.Call.attend, call_module.Call.attend_local

    def sent(peer, numel, dtype):
        events.append(("send", numel))
        return send_buffer(peer, numel, dtype)

    def local(self):
        if not self._local_done:
            events.append(("local",))
        return attend_local(self)

    def chunk(self, payload, lay, origin, heads=None):
        events.append(("chunk", heads))
        return attend(self, payload, lay, origin, heads=heads)

    t.send_buffer = sent
    call_module.Call.attend, call_module.Call.attend_local = chunk, local
    try:
        bs = 16
        shard, gm, want = random_slice_case(rank, lens, H, 8, bs, 3)  # every head reads every block
        cfg = SparspConfig(block_size=bs, transport="host", kernel="torch", drain_chunks=drain,
                           local_first=local_first)
        out = sp_attention(*shard, strategy="sparsp", config=cfg, _global_mask=gm)
        err = (out.double() - want).abs().max().item()
    finally:
        t.send_buffer = send_buffer
        call_module.Call.attend, call_module.Call.attend_local = attend, attend_local
        t.fence()
        dist.barrier()
    assert err <= 1e-5, f"rank {rank}: error {err}"
    return t.window, events


@pytest.mark.parametrize("local_first", [False, True])
def test_a_round_with_more_chunks_than_slots_issues_its_late_steps_after_the_local_kernel(local_first):
    # Two ranks over the host transport (3 slots per peer), the drain cut into 5 head groups:
    # the first 3 steps are issued, then (unless it was queued first) the local kernel, which
    # must not wait for the host's wait on a slot, and each later step after the kernel of a
    # landed chunk.
    H, drain = 5, 5
    for window, events in run_distributed(_order_worker, 2, [48, 40], H, drain, local_first, timeout=300):
        kinds = [e[0] for e in events]
        assert kinds.count("send") == drain and kinds.count("chunk") == drain, events
        assert kinds.index("local") == (0 if local_first else window), events
        kinds.remove("local")
        assert kinds[:window] == ["send"] * window, events
        after = kinds[window:]
        for i in range(drain - window):  # a chunk's kernel, then the next step
            assert after[2 * i:2 * i + 2] == ["chunk", "send"], events
        assert after[2 * (drain - window):] == ["chunk"] * window, events
        assert sorted(e[1] for e in events if e[0] == "chunk") == chunks.head_groups(H, drain), events


def _late_fault_worker(rank, world, timeout_s):
    """Rank 1 never hands back the slots it copied out of (its ``release`` is dropped): rank 0's
    first late step waits in ``send_buffer`` for a slot of a window that stays full."""
    import time

    from sparsp import sp_attention
    from sparsp.strategies import close_transports, get_transport

    t = get_transport("host", None, torch.device("cpu"), timeout_s)
    if rank == 1:
        t.release = lambda peer: None
    bs = 16
    shard, gm, _ = random_slice_case(rank, [48, 40], 5, 8, bs, 4)
    cfg = SparspConfig(block_size=bs, transport="host", kernel="torch", drain_chunks=5,
                       local_first=False, timeout_s=timeout_s)
    start = time.monotonic()
    try:
        sp_attention(*shard, strategy="sparsp", config=cfg, _global_mask=gm)
        error = None
    except (TimeoutError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        close_transports()
    return error, time.monotonic() - start


def test_a_late_step_whose_slot_is_never_released_times_out_naming_the_peer():
    timeout_s = 2.0
    (err0, took0), (err1, took1) = run_distributed(_late_fault_worker, 2, timeout_s, timeout=120)
    assert err0 is not None and "send_buffer to peer 1" in err0 and "not released" in err0, err0
    assert took0 < timeout_s + 10, took0  # within the timeout (and CPU slack), not a hang
    # rank 1 waits for rank 0's late chunk, which rank 0 never publishes: it times out too
    assert err1 is not None and "peer 0" in err1, err1
