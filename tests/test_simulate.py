"""``sparsp simulate``: the timeline on hand-computable cases, contention, calibration,
validation, the CLI end to end and its errors."""

import json
import os
import statistics
from dataclasses import replace

import pytest
import torch

from sparsp.cli import main
from sparsp.geometry import VideoGeometry
from sparsp.placement import make_placement
from sparsp.cost import (PROFILES, KernelFigure, Profile, TransportFigure, Work, build_work, get_profile, pair_flops,
                         timeline)
from sparsp.cost.flows import capacities, exchange_gbps, fair_rates, route
from sparsp.cost.timeline import bottleneck
from sparsp.simulate.calibrate import calibrate, fit_transport
from sparsp.simulate.job import geometry, MaskCache, simulate_one, validate
from sparsp.strategies.registry import strategy_names, strategy_spec

TFLOPS = 100.0  # kernel rate of the hand-made profiles: 1e11 FLOPs per ms


def _profile(**kw) -> Profile:
    """A profile with no fixed costs, no latency and free packing: only what a test sets."""
    base = dict(name="test", gpus=8, peer_access=True, link_gbps=10.0, hbm_gbps=1e12,
                transports=(TransportFigure(name="ipc", efficiency=1.0, latency_ms=0.0),),
                kernels=(KernelFigure(head_dim=128, sparse_tflops=TFLOPS, dense_tflops=TFLOPS),),
                launch_ms=0.0, call_ms=0.0, sync_ms=0.0)
    base.update(kw)
    return Profile(**base)


def _uniform(schedule: str, G: int, compute_ms: float, transfer_bytes: int, strategy: str = "x") -> Work:
    """Every rank: ``compute_ms`` per step, ``transfer_bytes`` per round."""
    flops = compute_ms * TFLOPS * 1e9
    steps = 1 if schedule == "all-to-all" else G
    back = tuple((transfer_bytes,) * (G - 1) for _ in range(G)) if schedule == "all-to-all" else ()
    return Work(strategy, schedule, G, tuple((flops,) * steps for _ in range(G)),
                tuple((1,) * steps for _ in range(G)), tuple((transfer_bytes,) * (G - 1) for _ in range(G)), back)


# --- the timeline, by hand ------------------------------------------------------------------------


@pytest.mark.parametrize("G", [2, 3, 4, 8])
@pytest.mark.parametrize("compute_ms, transfer_ms", [(2.0, 5.0), (5.0, 2.0), (3.0, 3.0)])
@pytest.mark.parametrize("schedule", ["relay-ring", "direct"])
def test_overlapped_ring_is_max_per_hop_plus_drain(G, compute_ms, transfer_ms, schedule):
    # p2p, every link 10 GB/s, no shared path: each round moves at full link rate; the local
    # step overlaps hop 1, hop k overlaps step k−1, the last step is the drain.
    prof = _profile()
    work = _uniform(schedule, G, compute_ms, int(transfer_ms * 10e6))
    tl = timeline(work, prof, head_dim=128)
    want = compute_ms + (G - 1) * max(compute_ms, transfer_ms)
    assert tl.latency_ms == pytest.approx(want, rel=1e-9)
    assert tl.finish == pytest.approx([want] * G, rel=1e-9)
    r = tl.critical_rank
    assert tl.busy(r, "compute") == pytest.approx(G * compute_ms)
    assert tl.busy(r, "transfer") == pytest.approx((G - 1) * transfer_ms)  # rounds never overlap here


def test_fixed_cost_latency_and_pack_add_up():
    prof = _profile(call_ms=1.0, sync_ms=0.25, hbm_gbps=100.0,
                    transports=(TransportFigure(name="ipc", efficiency=1.0, latency_ms=0.5),))
    work = _uniform("relay-ring", 2, 1.0, 100_000_000)  # 10 ms on the link, 1 ms to pack
    tl = timeline(work, prof, head_dim=128)
    fixed = 1.0 + 0.25  # call_ms + one collective (the metadata all-gather, on the device path)
    assert tl.latency_ms == pytest.approx(fixed + 0.5 + 1.0 + 10.0 + 1.0)


def test_transfer_runs_at_the_loaded_share_while_a_kernel_runs():
    # 40 MB at 10 GB/s: 4 ms alone; at the loaded share 0.5 while either end computes
    prof = _profile(transports=(TransportFigure(name="ipc", efficiency=1.0, latency_ms=0.0, loaded_efficiency=0.5),))
    work = _uniform("direct", 2, 2.0, 40_000_000)
    tl = timeline(work, prof, head_dim=128)
    xfer = tl.of(0, "transfer")[0]
    # 2 ms at half rate (1 ms of bytes), the other 3 ms at full rate once the local step ended
    assert xfer.end == pytest.approx(5.0)
    assert tl.latency_ms == pytest.approx(5.0 + 2.0)
    # a transfer that outlasts no kernel is not slowed; no loaded figure = the figure alone
    alone = timeline(work, _profile(), head_dim=128)
    assert alone.of(0, "transfer")[0].end == pytest.approx(4.0)
    assert TransportFigure(name="x", efficiency=0.7).under_load == 0.7
    with pytest.raises(ValueError, match="loaded_efficiency must lie in"):
        TransportFigure(name="x", loaded_efficiency=1.5)


def test_no_kernel_starts_before_the_host_issued_it():
    # after the sync (t = 0 here) the host issues 10 ops, launches kernel 0 (0.2 ms), issues up
    # to op 110 and launches kernel 1 (1.3 ms), then 20 more ops (1.5 ms); steps of 1 ms
    prof = _profile(op_ms=0.01, launch_ms=0.1)
    work = replace(_uniform("direct", 2, 1.0, 0), run_ops=((10, 110, 20),) * 2)
    tl = timeline(work, prof, head_dim=128)
    steps = sorted(tl.of(0, "compute"), key=lambda t: t.round)
    assert [(t.start, t.end) for t in steps] == [pytest.approx((0.2, 1.2)), pytest.approx((1.3, 2.3))]
    assert tl.latency_ms == pytest.approx(2.3)
    label, savings = bottleneck(work, prof, tl, head_dim=128)
    assert savings["fixed"] == pytest.approx(0.3)  # the host's issue is a fixed cost
    # ulysses: G² = 4 launches in its one step, the last at 1.6 + 0.4 ms; its share of the step
    # (0.1 of 0.4 ms) still runs after it
    work = replace(_uniform("all-to-all", 2, 0.4, 0), launches=((4,),) * 2, run_ops=((100, 160, 10),) * 2)
    tl = timeline(work, prof, head_dim=128)
    step = tl.of(0, "compute")[0]
    assert (step.start, step.end) == (pytest.approx(1.1), pytest.approx(2.1))
    # the host's last op ends the call at the earliest: 10 more ops after a free kernel
    work = replace(_uniform("direct", 2, 0.0, 0), run_ops=((0, 0, 1000),) * 2)
    assert timeline(work, prof, head_dim=128).latency_ms == pytest.approx(10.0 + 0.2)


def _orders(**counts) -> tuple[Work, Work]:
    """A 2-rank direct (sparsp) call of 2 ms steps and 10 MB rounds (1 ms at 10 GB/s), in order
    and local first, with the host's counts by hand: 100 ops before the read, 10 in its finish,
    13 in the run before the first fetch; in order 15 before the (local) first kernel, 19 before
    the last, 26 after; local first 2 before the local kernel and none after it before the
    read's wait, 17 before the remote kernel, 26 after."""
    base = replace(_uniform("direct", 2, 2.0, 10_000_000, strategy="sparsp"), host_ops=(100, 100),
                   finish_ops=(10, 10), issue_ops=(13, 13), **counts)
    return (replace(base, run_ops=((15, 19, 26),) * 2),
            replace(base, local_first=True, run_ops=((17, 17, 26),) * 2, early_ops=((2, 0),) * 2))


def test_local_first_overlaps_the_read_and_the_run_ops_with_the_local_kernel():
    # ops 10 µs, launches 0.1 ms; the device's mask path (the all-gather) takes 1.5 ms, the
    # host's 100 ops before the read 1 ms: the read lands at 1.5 ms in both orders
    prof = _profile(op_ms=0.01, launch_ms=0.1, sync_ms=1.5)
    in_order, local_first = _orders()
    a, b = timeline(in_order, prof, head_dim=128), timeline(local_first, prof, head_dim=128)
    steps_a = sorted(a.of(0, "compute"), key=lambda t: t.round)
    steps_b = sorted(b.of(0, "compute"), key=lambda t: t.round)
    # in order: after the read the host finishes it (0.1), issues 15 ops (0.15) and launches the
    # local kernel (0.1): it runs 1.85 → 3.85; the transfer, issued after 13 of those ops, runs
    # 1.73 → 2.73, hidden; the remote step follows, 3.85 → 5.85
    assert [(t.start, t.end) for t in steps_a] == [pytest.approx((1.85, 3.85)), pytest.approx((3.85, 5.85))]
    assert (a.of(0, "transfer")[0].start, a.of(0, "transfer")[0].end) == (pytest.approx(1.73), pytest.approx(2.73))
    assert a.latency_ms == pytest.approx(5.85)
    # local first: launched after 102 ops and a launch (1.12 ms), the local kernel starts when
    # the mask path is done (1.5); the host's wait ends then, the finish and 13 run ops issue the
    # first round at 1.73 (landing at 2.73, beside the local kernel); the remote kernel is
    # launched at 1.5 + 0.1 + 0.17 + 0.1 = 1.87 and starts when the local step ends
    assert [(t.start, t.end) for t in steps_b] == [pytest.approx((1.5, 3.5)), pytest.approx((3.5, 5.5))]
    xfer = b.of(0, "transfer")[0]
    assert (xfer.start, xfer.end) == (pytest.approx(1.73), pytest.approx(2.73))
    # smaller by the host time in order between the read and the local launch, which local
    # first spends beside the local kernel: finish + 15 ops + a launch
    assert a.latency_ms - b.latency_ms == pytest.approx(0.1 + 0.15 + 0.1)
    # free host ops and launches: the same schedule; with launches only, a launch apart
    free = _profile(op_ms=0.0, launch_ms=0.0, sync_ms=1.5)
    assert timeline(in_order, free, head_dim=128).latency_ms == pytest.approx(5.5)
    assert timeline(local_first, free, head_dim=128).latency_ms == pytest.approx(5.5)
    launches = _profile(op_ms=0.0, launch_ms=0.1, sync_ms=1.5)
    assert (timeline(in_order, launches, head_dim=128).latency_ms
            - timeline(local_first, launches, head_dim=128).latency_ms) == pytest.approx(0.1)


def test_the_fence_and_finish_after_the_read_run_beside_a_local_first_kernel():
    # call_ms 1 ms of which call_after_ms 0.4 after the read's start (the transport's fence, the
    # read's finish); host-bound mask phase (no device path), free ops and launches
    in_order, local_first = _orders()
    prof = _profile(call_ms=1.0, call_after_ms=0.4, op_ms=0.0)
    none_after = _profile(call_ms=1.0, call_after_ms=0.0, op_ms=0.0)
    a, b = timeline(in_order, prof, head_dim=128), timeline(local_first, prof, head_dim=128)
    # in order the whole call_ms precedes the run: the same call as with nothing after the read
    assert a.latency_ms == pytest.approx(timeline(in_order, none_after, head_dim=128).latency_ms)
    # local first the local kernel is launched before the fence: it starts 0.4 ms earlier ...
    first = lambda t: min(c.start for c in t.of(0, "compute"))  # noqa: E731
    assert first(b) == pytest.approx(0.6)
    assert first(timeline(local_first, none_after, head_dim=128)) == pytest.approx(1.0)
    # ... and the first round, issued after the fence and the finish, as late as in order
    assert b.of(0, "transfer")[0].start == pytest.approx(a.of(0, "transfer")[0].start)
    # a call_ms below call_after_ms puts all of it after the read
    assert _profile(call_ms=0.2, call_after_ms=0.4).call_after == 0.2


def test_local_first_pack_runs_beside_the_local_kernel():
    # a pack of 1 ms (10 MB at 10 GB/s of device copies): on the side stream it is the first
    # round's lead time, not the compute stream's; the local step starts as before
    prof = _profile(op_ms=0.01, launch_ms=0.1, sync_ms=1.5, hbm_gbps=10.0)
    _, local_first = _orders()
    tl = timeline(local_first, prof, head_dim=128)
    steps = sorted(tl.of(0, "compute"), key=lambda t: t.round)
    assert steps[0].start == pytest.approx(1.5)
    assert tl.of(0, "transfer")[0].end == pytest.approx(1.73 + 1.0 + 1.0)
    assert steps[1].start == pytest.approx(3.73) and tl.latency_ms == pytest.approx(5.73)
    # a host slower than the device: the post-read ops outlast the local kernel, and the remote
    # step waits for its launch (1000 ops before it: 1.5 + 0.1 + 10 + 0.1 = 11.7 ms)
    slow = replace(local_first, run_ops=((1000, 1000, 0),) * 2)
    steps = sorted(timeline(slow, _profile(op_ms=0.01, launch_ms=0.1, sync_ms=1.5), head_dim=128).of(0, "compute"),
                   key=lambda t: t.round)
    assert steps[0].start == pytest.approx(1.5) and steps[1].start == pytest.approx(11.7)


def test_work_knows_its_order():
    """``local_first`` True applies to the strategies registered ``local_first``; ``ulysses``
    runs in order; the counts follow the order. Automatic (None, the config's default) without
    a profile: in order (no figures to decide from); ``Work.local_first`` is always a bool."""
    from sparsp import SparspConfig
    from sparsp.cost.model import CHECK_FINITE, LOCAL_FIRST, SIMILARITY
    from sparsp.cost.balance import balanced_heads
    from sparsp.cost.ops import EARLY_OPS, HEAD_ORDER_OPS, issue_ops, run_ops

    default = SparspConfig()  # the cost model's assumptions are the config's defaults
    assert LOCAL_FIRST is default.local_first is None  # automatic
    assert SIMILARITY == (default.sim_threshold is not None) and CHECK_FINITE == default.check_finite
    pl = make_placement("periodic", GEOM, 2)
    masks = torch.rand(GEOM.heads, GEOM.num_blocks, GEOM.num_blocks, generator=torch.Generator().manual_seed(3)) < 0.4
    for s in strategy_names():
        w = build_work(masks, pl, strategy_spec(s), head_dim=GEOM.head_dim, local_first=True)
        off = build_work(masks, pl, strategy_spec(s), head_dim=GEOM.head_dim, local_first=False)
        auto = build_work(masks, pl, strategy_spec(s), head_dim=GEOM.head_dim)
        assert w.local_first is (strategy_spec(s).local_first and s != "ulysses") and off.local_first is False, s
        assert auto.local_first is False and auto == off, s
        assert (w.host_ops, w.finish_ops) == (off.host_ops, off.finish_ops), s  # the same before the run
        rule = strategy_spec(s).byte_rule if strategy_spec(s).sparse else "dense"
        # ulysses reorders its heads where these random masks unbalance them (``HEAD_ORDER_OPS``)
        moved = s == "ulysses" and balanced_heads(torch.einsum("hqk->h", masks.long()).tolist(), 2) != tuple(
            range(GEOM.heads))
        before, after = HEAD_ORDER_OPS if moved else (0, 0)
        first, last, tail = run_ops(rule, 2)
        assert off.run_ops == ((first + before, last + before, tail + after),) * 2, s
        assert off.issue_ops == (issue_ops(rule, 2) + before,) * 2, s
        assert not off.early_ops, s
        if w.local_first:
            assert w.run_ops == (run_ops(rule, 2, True),) * 2 and w.early_ops == (EARLY_OPS,) * 2, s
            assert w.issue_ops == (issue_ops(rule, 2, True),) * 2, s
    with pytest.raises(ValueError, match="local_first must be None"):
        build_work(masks, pl, strategy_spec("sparsp"), head_dim=GEOM.head_dim, local_first="yes")


def test_automatic_local_first_follows_the_code_rule():
    """``SparspConfig.local_first=None``: the rule of ``Call.local_first_pays`` on the simulated
    profile — in order over ``nccl``; else local first where the first round's rows (K and V)
    move over ``chunks.profile_fabric``'s pair bandwidth in no more time than the local kept
    pairs take at its kernel rate. LTX-Video, G = 2: on the host-staged 2×H200 fabric the round
    is transfer-bound (in order), over NVLink's ``ipc`` it lands early (local first)."""
    from sparsp.cost import chunks
    from sparsp.cost.figures import Blocks, measure
    from sparsp.cost.model import local_first_pays, resolve_local_first

    geom = geometry("ltx-video")
    masks = MaskCache().get(geom, 0.9)
    pl = make_placement("periodic", geom, 2)
    d = measure(masks, Blocks.of(pl))
    host, nvlink = PROFILES["h200x2-host"], PROFILES["h200x2-nvlink"]
    kw = dict(head_dim=geom.head_dim, dtype_bytes=2)
    sparsp, ulysses = strategy_spec("sparsp"), strategy_spec("ulysses")

    def margin(profile, transport, r=0):  # compute − transfer (s) of rank r, by hand
        fab = chunks.profile_fabric(profile, transport, geom.head_dim)
        rows = max(d.direct[1 - r][r], d.direct[r][1 - r])
        return 4 * geom.head_dim * d.pairs[r][r] / fab.flops_per_s - rows * 2 * geom.head_dim * 2 / fab.bytes_per_s

    assert margin(host, "host") < 0 < margin(nvlink, "ipc")
    assert local_first_pays(sparsp, d, host, "host", **kw) == (False, False)
    assert local_first_pays(sparsp, d, nvlink, "ipc", **kw) == (True, True)
    assert local_first_pays(sparsp, d, nvlink, None, **kw) == (True, True)  # the profile's default: ipc
    assert local_first_pays(sparsp, d, nvlink, "nccl", **kw) == (False, False)  # never over nccl
    assert local_first_pays(ulysses, d, nvlink, "ipc", **kw) == (False, False)  # not registered
    for setting, want in ((None, True), (True, True), (False, False)):
        assert resolve_local_first(setting, sparsp, d, nvlink, "ipc", **kw) is want
    assert resolve_local_first(None, sparsp, d, host, "host", **kw) is False
    assert resolve_local_first(True, sparsp, d, host, "nccl", **kw) is True  # forced on
    assert resolve_local_first(None, sparsp, d, None, "ipc", **kw) is False  # no profile: in order
    # the same through the work the sweep and the validation simulate
    for prof, transport, want in ((host, "host", False), (nvlink, "ipc", True), (nvlink, "nccl", False)):
        for s in ("ring", "ring-sparse", "ring-relay", "sparsp"):
            spl = make_placement(strategy_spec(s).placement, geom, 2)
            w = build_work(masks, spl, strategy_spec(s), head_dim=geom.head_dim, profile=prof, transport=transport)
            assert w.local_first is want, (s, prof.name, transport)
            row = simulate_one(masks, geom, s, 2, prof, transport=transport)
            assert row["local_first"] is want, (s, prof.name, transport)
    # a kernel slow enough (its local step outlasting the round) flips the host fabric's call
    slow = replace(host, kernels=tuple(replace(k, sparse_tflops=k.sparse_tflops / 100) for k in host.kernels))
    assert local_first_pays(sparsp, d, slow, "host", **kw) == (True, True)


def test_all_to_all_does_not_overlap():
    prof = _profile(call_ms=1.0, sync_ms=0.0)
    G, compute_ms, nbytes = 4, 7.0, 20_000_000  # 2 ms per round
    tl = timeline(_uniform("all-to-all", G, compute_ms, nbytes), prof, head_dim=128)
    assert tl.latency_ms == pytest.approx(1.0 + (G - 1) * 2.0 + compute_ms + (G - 1) * 2.0)


def test_prefetch_issues_rounds_ahead():
    # With transfers twice as long as compute, a second round in flight from another owner
    # overlaps on the receiver's link only if the link has room: here rx is the limit, so
    # prefetch 2 gives the same time, and a faster receive link makes it pay.
    G, c, t = 4, 1.0, 2.0
    work = _uniform("direct", G, c, int(t * 10e6))
    one = timeline(work, _profile(), head_dim=128, prefetch=1).latency_ms
    two = timeline(work, _profile(), head_dim=128, prefetch=2).latency_ms
    assert one == pytest.approx(c + (G - 1) * t) and two == pytest.approx(one)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        timeline(work, _profile(), head_dim=128, prefetch=0)


# --- contention -----------------------------------------------------------------------------------


def test_host_staged_pairs_share_host_memory():
    # Host path: each GPU 10 GB/s each way; host memory 20 GB/s of DMA traffic = 10 GB/s of
    # staged payload (written once, read once). One payload alone: 10 GB/s. Two pairs: 5 each.
    prof = _profile(peer_access=False, host_gbps=20.0, sockets=1)
    caps = capacities(prof, 4)
    alone = fair_rates({0: route(prof, 0, 1, caps)}, caps)
    both = fair_rates({0: route(prof, 0, 1, caps), 1: route(prof, 2, 3, caps)}, caps)
    assert alone[0] == pytest.approx(10.0)
    assert both[0] == pytest.approx(5.0) and both[1] == pytest.approx(5.0)
    # the same in a timeline: a 2-rank exchange of 100 MB takes 20 ms, not 10
    tl = timeline(_uniform("relay-ring", 2, 0.0, 100_000_000), prof, head_dim=128)
    assert tl.latency_ms == pytest.approx(20.0)
    # peer access: no host path, full rate for both pairs
    p2p = _profile(peer_access=True, host_gbps=20.0)
    assert timeline(_uniform("relay-ring", 2, 0.0, 100_000_000), p2p, head_dim=128).latency_ms == pytest.approx(10.0)


def test_switch_uplink_and_socket_link_are_shared():
    prof = _profile(gpus_per_switch=2, switch_uplink_gbps=10.0, sockets=2, inter_socket_gbps=6.0)
    caps = capacities(prof, 8)
    same_switch = fair_rates({0: route(prof, 0, 1, caps)}, caps)
    assert same_switch[0] == pytest.approx(10.0)  # stays inside the switch
    two_up = fair_rates({0: route(prof, 0, 2, caps), 1: route(prof, 1, 3, caps)}, caps)
    assert two_up == pytest.approx({0: 5.0, 1: 5.0})  # both leave switch 0 through one uplink
    cross = fair_rates({0: route(prof, 0, 4, caps), 1: route(prof, 2, 6, caps)}, caps)
    assert cross == pytest.approx({0: 3.0, 1: 3.0})  # socket 0 → 1 link shared
    # max-min: a flow limited elsewhere leaves the rest of a shared resource to the other
    mixed = fair_rates({0: route(prof, 0, 4, caps), 1: route(prof, 2, 6, caps), 2: route(prof, 3, 1, caps)},
                       caps)
    assert mixed[0] == pytest.approx(3.0) and mixed[2] == pytest.approx(7.0)


def test_transport_efficiency_scales_rate():
    prof = _profile(transports=(TransportFigure(name="ipc", latency_ms=0.0),
                                TransportFigure(name="nccl", efficiency=0.5, latency_ms=0.0)))
    work = _uniform("relay-ring", 2, 0.0, 100_000_000)
    assert timeline(work, prof, transport="nccl", head_dim=128).latency_ms == pytest.approx(20.0)
    with pytest.raises(ValueError, match="has no transport 'tcp'"):
        timeline(work, prof, transport="tcp", head_dim=128)


def test_bottleneck_labels():
    prof = _profile(call_ms=5.0)
    assert bottleneck(w := _uniform("relay-ring", 4, 10.0, 10_000_000), prof,
                      timeline(w, prof, head_dim=128), head_dim=128)[0] == "compute"
    prof = _profile(call_ms=0.5)
    assert bottleneck(w := _uniform("relay-ring", 4, 1.0, 100_000_000), prof,
                      timeline(w, prof, head_dim=128), head_dim=128)[0] == "transfer"
    prof = _profile(call_ms=100.0)
    label, savings = bottleneck(w := _uniform("relay-ring", 4, 1.0, 1_000_000), prof,
                                timeline(w, prof, head_dim=128), head_dim=128)
    assert label == "fixed" and savings["fixed"] == pytest.approx(100.0)


# --- work from masks ------------------------------------------------------------------------------

GEOM = VideoGeometry(frames=4, height=4, width=16, text_tokens=10, block_size=16, heads=4, head_dim=8)


@pytest.mark.parametrize("G", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["contiguous", "periodic"])
def test_work_bytes_and_flops_match_demand(G, kind):
    g = torch.Generator().manual_seed(G)
    n = GEOM.num_blocks
    masks = torch.rand(GEOM.heads, n, n, generator=g) < 0.3
    pl = make_placement(kind, GEOM, G)
    L = GEOM.block_lengths().double()
    kept = 4 * GEOM.head_dim * float((masks.double() * L[:, None] * L[None, :]).sum())
    for s in strategy_names():
        w = build_work(masks, pl, strategy_spec(s), head_dim=GEOM.head_dim, dtype_bytes=2)
        want = strategy_spec(s).comm_bytes(masks, pl, head_dim=GEOM.head_dim, dtype_bytes=2)["per_rank"]
        assert w.bytes_per_rank == want, s
        total = sum(sum(row) for row in w.flops)
        dense = 4 * GEOM.head_dim * GEOM.heads * GEOM.num_tokens ** 2
        assert total == pytest.approx(dense if not strategy_spec(s).sparse else kept), s
    assert float(pair_flops(masks, pl, GEOM.head_dim).sum()) == pytest.approx(kept)


# --- calibration ----------------------------------------------------------------------------------


def _transport_file(tmp_path, fabric="host", fits=(("host", 0.2, 30.0), ("nccl", 0.5, 15.0)),
                    loaded=(("host", 0.4, 24.0), ("nccl", 0.6, 9.0)), machine="2xH200"):
    """Rows of exact ``latency + bytes / GB/s`` per transport: single exchanges alone (``fits``),
    pipelined ones (never fitted) and exchanges under an attention kernel (``loaded``)."""
    rows = []
    for name, latency, gbps in fits:
        for e in range(16, 30):
            b = 1 << e
            ms = latency + b / (gbps * 1e6)
            rows.append({"transport": name, "fabric": fabric, "bytes": b, "gbps": b / ms / 1e6,
                         "under_load": False, "median_ms": ms, "inflight": 1})
            rows.append({"transport": name, "fabric": fabric, "bytes": b, "gbps": 1.0, "under_load": False,
                         "median_ms": ms / 3, "inflight": 3})  # pipelined: not a single message
    for name, latency, gbps in loaded:
        for e in range(16, 30):
            b = 1 << e
            ms = latency + b / (gbps * 1e6)
            rows.append({"transport": name, "fabric": fabric, "bytes": b, "gbps": b / ms / 1e6, "under_load": True,
                         "median_ms": ms, "attention_slowdown": 0.01 * (e % 3 - 1)})
    path = tmp_path / "transport.json"
    path.write_text(json.dumps({"kind": "transport", "machine": machine, "rows": rows}))
    return path


def _kernel_file(tmp_path):
    rows = [{"kernel": "flex", "head_dim": 128, "density": d, "ms": 1.0, "tflops_kept": 300.0, "vs_cudnn": 0.6,
             "vs_best_dense": 0.5} for d in (0.15, 0.3)]
    rows.append({"kernel": "cudnn", "head_dim": 128, "density": 1.0, "ms": 1.0, "tflops_kept": 500.0,
                 "vs_cudnn": 1.0, "vs_best_dense": 1.0})
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps({"kind": "kernel", "machine": "1xH200", "rows": rows}))
    return path


def test_fit_transport_recovers_latency_and_bandwidth():
    pts = [(float(1 << e), 0.3 + (1 << e) / 25e6) for e in range(16, 30)]
    latency, gbps = fit_transport(pts)
    assert latency == pytest.approx(0.3, rel=1e-6) and gbps == pytest.approx(25.0, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 message sizes"):
        fit_transport(pts[:1])


def test_calibrate_from_transport_and_kernel_results(tmp_path):
    base = PROFILES["h200x2-host"]
    prof, report = calibrate(base, [_transport_file(tmp_path), _kernel_file(tmp_path)])
    assert prof.name == "h200x2-host-calibrated"
    assert report["transports"]["host"]["gbps"] == pytest.approx(30.0, rel=1e-3)
    assert prof.transport("host").latency_ms == pytest.approx(0.2, rel=1e-3)
    assert prof.transport("nccl").efficiency == pytest.approx(0.5, rel=1e-3)
    # under load: each transport's own loaded rows, as a share of the fastest alone; the
    # latency stays the gated single exchange's
    assert prof.transport("host").loaded_efficiency == pytest.approx(24.0 / 30.0, rel=1e-3)
    assert prof.transport("nccl").loaded_efficiency == pytest.approx(9.0 / 30.0, rel=1e-3)
    assert prof.transport("nccl").latency_ms == pytest.approx(0.5, rel=1e-3)
    assert report["transports"]["nccl"]["under_load"]["gbps"] == pytest.approx(9.0, rel=1e-3)
    assert report["transports"]["nccl"]["under_load"]["latency_ms"] == pytest.approx(0.6, rel=1e-3)
    assert exchange_gbps(prof) == pytest.approx(30.0, rel=1e-3)  # the modelled 2-GPU exchange
    assert prof.duplex_gbps / prof.link_gbps == pytest.approx(base.duplex_gbps / base.link_gbps)
    assert prof.kernel(128).sparse_tflops == pytest.approx(300.0)
    assert prof.kernel(128).dense_tflops == pytest.approx(500.0)
    assert prof.kernel(64) == base.kernel(64)  # not measured: kept
    # rows of the other fabric only: a clear error
    with pytest.raises(ValueError, match="no transport rows for fabric 'nvlink'"):
        calibrate(PROFILES["h200x2-nvlink"], [_transport_file(tmp_path)])
    # the calibrated profile round-trips through JSON (simulate writes it; --fabric reads it)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert get_profile(str(path)) == prof


# --- validation -----------------------------------------------------------------------------------


def _attention_file(tmp_path, rows):
    path = tmp_path / "attention-ltx-video-test.json"
    path.write_text(json.dumps({"kind": "attention", "machine": "2xH200", "rows": rows}))
    return path


ROW = {"model": "ltx-video", "tokens": 18432, "ranks": 2, "cdf": 0.9, "placement": "periodic", "kernel": "auto",
       "median_ms": 10.0}


def test_validation_rows_from_an_attention_file(tmp_path):
    rows = [dict(ROW, fabric="host", strategy="sparsp", transport="host", compute_ms=4.0),
            dict(ROW, fabric="nvlink", strategy="ring-sparse", transport="ipc", placement="contiguous",
                 median_ms=8.0),
            dict(ROW, fabric="host", strategy="sparsp", transport="nccl", ranks=4),  # a 4-GPU row
            dict(ROW, fabric="nvlink", strategy="sparsp", transport="ipc", local_first=True),  # a newer row
            dict(ROW, fabric="nvlink", strategy="ulysses", transport="nccl", local_first=True),  # in order all the same
            dict(ROW, fabric="nvlink", strategy="ulysses", transport="nccl", head_order="density"),  # a newer row
            dict(ROW, fabric="nvlink", strategy="sparsp", transport="tcp"),  # no such transport
            dict(ROW, fabric="nvlink", strategy="sparsp", transport="ipc", local_first="yes")]  # not a bool
    cache = MaskCache()
    out, notes = validate([_attention_file(tmp_path, rows)], cache=cache)
    assert len(out) == 6 and len(notes) == 2
    assert any("no transport 'tcp'" in n for n in notes)
    assert any("local_first must be true or false, got 'yes'" in n for n in notes)
    geom = geometry("ltx-video")
    for v, row in zip(out, rows):
        assert {"model", "ranks", "fabric", "strategy", "predicted_ms", "measured_ms"} <= set(v)
        G = row["ranks"]
        # rows of more GPUs than the 2×H200 profile holds: the same box widened to G GPUs
        profile = PROFILES[f"h200x2-{row['fabric']}"].widened(G)
        assert profile.gpus >= G and (G > 2) == (profile is not PROFILES[f"h200x2-{row['fabric']}"])
        # each row in its own order: rows without the field ran in order; ulysses rows without
        # ``head_order`` ran contiguous head groups
        lf = row.get("local_first", False)
        heads = tuple(range(geom.heads)) if row["strategy"] == "ulysses" and "head_order" not in row else None
        want = simulate_one(cache.get(geom, 0.9), geom, row["strategy"], G, profile, placement=row["placement"],
                            transport=row["transport"], local_first=lf, head_order=heads)["predicted_ms"]
        assert v["predicted_ms"] == want and v["measured_ms"] == row["median_ms"] and v["ranks"] == G
        assert v["local_first"] == (lf and row["strategy"] != "ulysses")
        assert v["error"] == pytest.approx(want / row["median_ms"] - 1, abs=1e-4)
    assert out[0]["measured_compute_ms"] == 4.0
    # the newer row in order: LTX-Video on NVLink waits for its host, which local first overlaps
    in_order = simulate_one(cache.get(geom, 0.9), geom, "sparsp", 2, PROFILES["h200x2-nvlink"], placement="periodic",
                            transport="ipc", local_first=False)
    assert out[3]["predicted_ms"] < in_order["predicted_ms"] and not in_order["local_first"]
    with pytest.raises(ValueError, match="expected a sparsp bench result of kind attention"):
        validate([_transport_file(tmp_path)], cache=cache)


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_end_to_end(tmp_path, capsys):
    attn = _attention_file(tmp_path, [dict(ROW, fabric="host", strategy="ring", transport="nccl",
                                           placement="contiguous")])
    out = tmp_path / "out"
    transport = _transport_file(tmp_path, machine="8xRTXPRO6000BlackwellServerEdition")
    rc = main(["simulate", "--model", "ltx-video", "--ranks", "2", "4", "--fabric", "pcie5-8gpu-nop2p",
               "--fit-profile", str(transport), "--validate", str(attn), "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "pcie5-8gpu-nop2p-calibrated" in printed and "validation" in printed
    assert f"fitting pcie5-8gpu-nop2p to {transport} (transport, 8xRTXPRO6000BlackwellServerEdition)" in printed
    doc = json.loads((out / "simulate.json").read_text())
    assert {(r["strategy"], r["ranks"]) for r in doc["results"]} == {(s, G) for s in strategy_names() for G in (2, 4)}
    assert doc["local_first"] is None  # the config's default: automatic
    prof = get_profile(str(out / "profile-pcie5-8gpu-nop2p-calibrated.json"))
    geom, masks = geometry("ltx-video"), MaskCache().get(geometry("ltx-video"), 0.9)
    for r in doc["results"]:  # each row in the order the code's rule gives it on that profile
        pl = make_placement(strategy_spec(r["strategy"]).placement, geom, r["ranks"])
        w = build_work(masks, pl, strategy_spec(r["strategy"]), head_dim=geom.head_dim, profile=prof)
        assert r["local_first"] is w.local_first, r["strategy"]
        assert r["bottleneck"] in ("compute", "transfer", "fixed")
        assert r["predicted_ms"] == pytest.approx(max(r["finish_ms"]))
        assert r["rounds"] and r["speedup_vs_ring"] > 0
    assert [v["strategy"] for v in doc["validation"]] == ["ring"]
    assert (out / "latency_vs_ranks.png").stat().st_size > 0 and (out / "speedup_vs_ranks.png").exists()
    assert prof.transport("host").latency_ms == pytest.approx(0.2, rel=1e-3)


def test_cli_no_local_first_simulates_in_order(tmp_path):
    out = tmp_path / "out"
    argv = ["simulate", "--model", "ltx-video", "--ranks", "2", "--fabric", "h200x2-nvlink", "--no-plots"]
    assert main([*argv, "--out", str(out / "a")]) == 0
    assert main([*argv, "--no-local-first", "--out", str(out / "b")]) == 0
    first = {r["strategy"]: r for r in json.loads((out / "a" / "simulate.json").read_text())["results"]}
    doc = json.loads((out / "b" / "simulate.json").read_text())
    assert doc["local_first"] is False and not any(r["local_first"] for r in doc["results"])
    for r in doc["results"]:  # LTX-Video on NVLink waits for its host: in order is slower
        if strategy_spec(r["strategy"]).local_first:
            assert r["predicted_ms"] > first[r["strategy"]]["predicted_ms"], r["strategy"]
        else:
            assert r["predicted_ms"] == first[r["strategy"]]["predicted_ms"], r["strategy"]


@pytest.mark.parametrize("argv, message", [
    (["--fabric", "dgx"], "unknown fabric profile 'dgx'"),
    (["--ranks", "16"], "--ranks 16 exceeds the 8 GPUs of profile pcie4-8gpu-nop2p"),
    (["--ranks", "1"], "--ranks must be ints >= 2, got 1"),
    (["--cdf", "1.5"], "--cdf values must lie in [0, 1], got 1.5"),
    (["--transport", "tcp"], "profile pcie4-8gpu-nop2p has no transport 'tcp'"),
    (["--prefetch", "0"], "--prefetch must be an int >= 1, got 0"),
    (["--fit-profile", "/nonexistent/transport.json"], "--fit-profile /nonexistent/transport.json: no such file"),
    (["--fabric", "h200x2-nvlink", "--ranks", "4"], "exceeds the 2 GPUs of profile h200x2-nvlink"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path):
    rc = main(["simulate", "--model", "ltx-video", "--no-plots", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("sparsp simulate: error: ") and message in err, err


def test_cli_argparse_errors_and_files(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--model", "sora"])
    assert e.value.code == 2 and "invalid choice: 'sora'" in capsys.readouterr().err
    afile = tmp_path / "file"
    afile.write_text("x")
    assert main(["simulate", "--model", "ltx-video", "--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{\"kind\": \"attention\"")
    assert main(["simulate", "--model", "ltx-video", "--ranks", "2", "--validate", str(bad),
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--validate {bad}: not a sparsp bench result (JSON): invalid or truncated JSON" in capsys.readouterr().err


# --- profiles -------------------------------------------------------------------------------------


def test_profiles_validate_their_fields():
    for prof in PROFILES.values():
        assert prof.kernel(128).sparse_tflops < prof.kernel(128).dense_tflops
    ok = PROFILES["pcie4-8gpu-nop2p"]
    for change, message in [
        (dict(link_gbps=0), "Profile.link_gbps must be a finite number > 0, got 0"),
        (dict(host_gbps=float("nan")), "Profile.host_gbps must be a finite number > 0 or None"),
        (dict(sockets=3), "Profile.sockets=3 must divide gpus=8"),
        (dict(gpus=0), "Profile.gpus must be a positive int, got 0"),
        (dict(peer_access=1), "Profile.peer_access must be True or False"),
        (dict(transports=()), "Profile.transports must be a non-empty tuple"),
        (dict(call_ms=-1.0), "Profile.call_ms must be a finite number >= 0"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            replace(ok, **change)
    with pytest.raises(ValueError, match=r"efficiency must lie in \(0, 1\], got 1.5"):
        TransportFigure(name="x", efficiency=1.5)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        KernelFigure(head_dim=0, sparse_tflops=1.0, dense_tflops=1.0)


# --- fixed costs, validation filters and discovery, measured demand ---------------------------------


def test_fixed_cost_charges_mask_ops_and_merge_traffic():
    from sparsp.cost.ops import MASK_OPS, mask_ops

    assert mask_ops("dense", 2) == MASK_OPS["dense"][0]
    # recounted with ``sparsp simulate --count-ops`` (docs/simulate.md): eager, and with
    # the plan stage a CUDA graph (the default on GPUs)
    assert mask_ops("direct", 4, graphed=False) == 107 + 119 * 3
    assert mask_ops("relay", 3, graphed=False) == 135 + 63 * 2 + 4 * 4
    assert mask_ops("direct", 4) == 5 and mask_ops("dense", 4) == mask_ops("dense", 4, graphed=False)
    prof = _profile(op_ms=0.01, hbm_gbps=1.0)
    work = replace(_uniform("relay-ring", 2, 0.0, 0), host_ops=(300, 300))
    assert timeline(work, prof, head_dim=128).latency_ms == pytest.approx(3.0)  # 300 ops x 10 µs
    # the device side of the mask phase overlaps the host's issue: the longer one counts
    work = replace(work, mask_bytes=(5_000_000, 5_000_000))  # 5 ms at 1 GB/s
    assert timeline(work, prof, head_dim=128).latency_ms == pytest.approx(5.0)
    merged = replace(_uniform("relay-ring", 2, 0.0, 0), merge_bytes=((1_000_000, 2_000_000),) * 2)
    assert timeline(merged, prof, head_dim=128).latency_ms == pytest.approx(3.0)


def test_work_merge_traffic_follows_the_kernel_calls():
    from sparsp.cost.model import (FINAL_BYTES, FINAL_SECOND_BYTES, MERGE_BYTES, MERGE_FIRST_BYTES,
                                   MERGE_SECOND_BYTES)

    # the first partial is kept (no copy); each later one is folded into the fp32 accumulator
    # before the next kernel (from two kernel outputs, then from the accumulator); the last one
    # is merged straight into the output in the input dtype
    assert (MERGE_FIRST_BYTES, MERGE_SECOND_BYTES, MERGE_BYTES) == (0, 8, 10)
    assert (FINAL_SECOND_BYTES, FINAL_BYTES) == (6, 8)
    pl = make_placement("contiguous", GEOM, 3)
    masks = torch.ones(GEOM.heads, GEOM.num_blocks, GEOM.num_blocks, dtype=torch.bool)
    w = build_work(masks, pl, strategy_spec("sparsp"), head_dim=GEOM.head_dim)
    elems = GEOM.heads * pl.tokens_per_rank[0] * GEOM.head_dim
    assert w.merge_bytes[0] == (0, elems * 8, elems * 8)  # the second folded, the third final
    pl2 = make_placement("contiguous", GEOM, 2)
    w = build_work(masks, pl2, strategy_spec("sparsp"), head_dim=GEOM.head_dim)
    assert w.merge_bytes[0] == (0, GEOM.heads * pl2.tokens_per_rank[0] * GEOM.head_dim * 6)
    local = masks & (pl.owner[:, None] == pl.owner[None, :])  # no remote block: one partial
    w = build_work(local, pl, strategy_spec("sparsp"), head_dim=GEOM.head_dim)
    assert w.merge_bytes[0] == (0, 0, 0)


def test_measure_in_call_order_equals_the_placement_order():
    """The call's placed order (``Blocks.of_call``, what ``strategy="auto"`` measures) gives the
    demand of the original order (``Blocks.of``, what ``simulate`` measures)."""
    from sparsp.cost import Blocks, measure

    geom = VideoGeometry(frames=4, height=4, width=16, text_tokens=0, block_size=16, heads=4, head_dim=8)
    g = torch.Generator().manual_seed(1)
    masks = torch.rand(geom.heads, geom.num_blocks, geom.num_blocks, generator=g) < 0.3
    for kind in ("contiguous", "periodic"):
        pl = make_placement(kind, geom, 4)
        order = pl.block_order
        placed = masks[:, order][:, :, order]
        a = measure(masks, Blocks.of(pl), relay=True)
        b = measure(placed, Blocks.of_call(tuple(pl.tokens_per_rank), geom.block_size), relay=True)
        assert a == b, kind


def test_validation_skips_ablation_1gpu_and_unknown_rows_and_summarises(tmp_path):
    from sparsp.simulate.job import validation_summary

    rows = [dict(ROW, fabric="host", strategy="sparsp", transport="host", median_ms=5.0),
            dict(ROW, fabric="host", strategy="sparsp", transport="host", ablation="+periodic"),
            dict(ROW, fabric="host", strategy="sparsp", transport="host", env={"SPARSP_FA4_PREPARED": "0"}),
            dict(ROW, fabric="host", strategy="1gpu-dense", transport="none", ranks=1),
            dict(ROW, fabric="nvlink", strategy="zigzag", transport="nccl")]
    out, notes = validate([_attention_file(tmp_path, rows)], cache=MaskCache())
    assert [v["strategy"] for v in out] == ["sparsp"]
    assert any("ablation step" in n for n in notes) and any("1 rank(s), not a multi-GPU row" in n for n in notes)
    assert any("a variant run with {'SPARSP_FA4_PREPARED': '0'}" in n for n in notes)
    assert any("'zigzag' is not a registered strategy" in n for n in notes)
    assert {"model", "fabric", "strategy", "predicted_ms", "measured_ms", "error", "commit"} <= set(out[0])
    s = validation_summary([{"fabric": "host", "error": 0.1}, {"fabric": "host", "error": -0.2},
                            {"fabric": "nvlink", "error": 0.0},
                            {"fabric": "nvlink", "error": 0.3, "ranks": 4}])
    # the top level counts the 2-GPU rows (the profiles' own machine); other G apart
    assert s["rows"] == 3 and s["within"] == 2 and s["host"] == {"rows": 2, "within": 1, "median_error": -0.05}
    assert s["ranks_4"] == {"rows": 1, "within": 0, "median_error": 0.3,
                            "nvlink": {"rows": 1, "within": 0, "median_error": 0.3}}


def test_discovery_takes_the_newest_file_per_model_and_machine(tmp_path):
    from sparsp.simulate.calibrate import discover_calibration
    from sparsp.simulate.job import discover_attention

    for name in ("attention-ltx-video-2xH200-2026-11-30.json", "attention-ltx-video-2xH200-2026-12-01.json",
                 "attention-hunyuan-video-2xH200-2026-11-30.json", "transport-all-2xH200-2026-11-30.json",
                 "transport-all-2xH200-2026-12-02.json", "kernel-all-2xH200-2026-11-30.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in discover_attention(tmp_path)] == [
        "attention-hunyuan-video-2xH200-2026-11-30.json", "attention-ltx-video-2xH200-2026-12-01.json"]
    assert [p.name for p in discover_calibration(tmp_path)] == [
        "transport-all-2xH200-2026-12-02.json", "kernel-all-2xH200-2026-11-30.json"]


def test_calibration_takes_sync_cost_from_nccl(tmp_path):
    prof, report = calibrate(PROFILES["h200x2-host"], [_transport_file(tmp_path)])
    assert prof.sync_ms == pytest.approx(0.5, rel=1e-3) and report["sync_ms"] == pytest.approx(0.5, rel=1e-3)


# --- recount for the current per-call code (FA4 kernel, float32 mask, one collective) ---------


def test_mask_phase_collective_is_device_time_beside_the_host_ops():
    # the metadata all-gather: sync_ms + its bytes at the two-GPU exchange rate, on the device
    # path, overlapping the host's issue of the mask ops; the longer one counts
    prof = _profile(op_ms=0.01, sync_ms=1.0)  # 10 GB/s links, the ipc figure at efficiency 1
    work = replace(_uniform("relay-ring", 2, 0.0, 0), host_ops=(300, 300), gather_bytes=(2_000_000,) * 2)
    assert timeline(work, prof, head_dim=128).latency_ms == pytest.approx(3.0)  # host: 300 x 10 µs
    work = replace(work, gather_bytes=(50_000_000,) * 2)
    assert timeline(work, prof, head_dim=128).latency_ms == pytest.approx(1.0 + 5.0)


def test_gather_bytes_are_the_rows_the_code_sends():
    """``model.gather_bytes``: G−1 rows of what a rank sends in the metadata all-gather — the
    cached header and the summaries (q's and k's block sums and v's partial sums for the check,
    as the CUDA kernel writes them, ``summaries.summaries_into``; a dense call its q, k, v sums) —
    padded to the largest rank's, in float32."""
    from sparsp import SparspConfig
    from sparsp.wire import header
    from sparsp.summaries import check_parts, summaries_into, torch_summaries
    from sparsp.cost import Blocks, gather_bytes, measure

    G = 3
    pl = make_placement("contiguous", GEOM, G)
    masks = torch.rand(GEOM.heads, GEOM.num_blocks, GEOM.num_blocks, generator=torch.Generator().manual_seed(1)) < 0.5
    d = measure(masks, Blocks.of(pl))
    cfg = SparspConfig(block_size=GEOM.block_size)
    S = max(pl.tokens_per_rank)  # the largest rank's summaries set the padded row
    q = k = v = torch.randn(1, S, GEOM.heads, GEOM.head_dim)
    n, F = -(-S // GEOM.block_size), GEOM.heads * GEOM.head_dim
    data = torch_summaries(q, k, v, cfg.block_size, sparse=False, check=cfg.check_finite)
    row = header(q, cfg.block_size, "ring", data.numel()).numel() + data.numel()
    assert gather_bytes(d, head_dim=GEOM.head_dim, sparse=False) == ((G - 1) * 4 * row,) * G
    fused = torch.empty(2 * n * F + check_parts(1, n, F))
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel takes exactly that many values
        summaries_into(fused, GEOM.block_size, q, k, v)
    assert gather_bytes(d, head_dim=GEOM.head_dim, sparse=True) == ((G - 1) * 4 * (11 + fused.numel()),) * G
    # the torch form (CPU) sends the same block sums and one value for the check
    assert torch_summaries(q, k, v, cfg.block_size, sparse=True, check=cfg.check_finite).numel() == 2 * n * F + 1


def test_sparsp_drain_units_charge_mask_ops():
    from sparsp.cost.figures import Blocks, measure
    from sparsp.cost.model import drain_units
    from sparsp.cost.ops import FINISH_UNIT_OPS, GRAPHED_MASK_CUT_OPS, GRAPHED_MASK_UNIT_OPS, finish_ops, mask_ops

    geom = geometry("ltx-video")
    masks = MaskCache().get(geom, 0.9)
    pl = make_placement("periodic", geom, 2)
    plain = build_work(masks, pl, strategy_spec("sparsp"), head_dim=geom.head_dim)
    assert plain.host_ops == (mask_ops("direct", 2),) * 2 and plain.finish_ops == (finish_ops("direct", 2),) * 2
    # the host-staged 2×H200 box at LTX-Video size is transfer-bound, but the drain computes
    # for less than three more units cost the host before the sync: no units
    d = measure(masks, Blocks.of(pl))
    assert drain_units(d, PROFILES["h200x2-host"], "host", head_dim=geom.head_dim, dtype_bytes=2) == ((1, 1),) * 2
    # with host ops free (op_ms 0) the same pairs are cut: both drain payloads of every rank in 4
    # head groups (cost/chunks.py); with the stage a CUDA graph, no op more before the
    # read, and 3 × 2.5 per payload in the read's finish (each unit's layout sliced)
    host = replace(PROFILES["h200x2-host"], op_ms=0.0)
    assert drain_units(d, host, "host", head_dim=geom.head_dim, dtype_bytes=2) == ((4, 4), (4, 4))
    cut = build_work(masks, pl, strategy_spec("sparsp"), head_dim=geom.head_dim, profile=host, transport="host")
    assert (GRAPHED_MASK_CUT_OPS, GRAPHED_MASK_UNIT_OPS) == (0, 0)
    assert cut.host_ops == plain.host_ops
    assert cut.finish_ops == (finish_ops("direct", 2) + round(2 * 3 * FINISH_UNIT_OPS),) * 2
    # NVLink: the payload lands while the local shard computes, no units
    nv = build_work(masks, pl, strategy_spec("sparsp"), head_dim=geom.head_dim, profile=PROFILES["h200x2-nvlink"],
                    transport="ipc")
    assert nv.host_ops == plain.host_ops
    # the other strategies never cut
    relay = build_work(masks, make_placement("periodic", geom, 2), strategy_spec("ring-relay"), head_dim=geom.head_dim,
                       profile=host, transport="host")
    assert relay.host_ops == (mask_ops("relay", 2),) * 2 and relay.finish_ops == (finish_ops("relay", 2),) * 2


def test_host_ops_follow_the_code():
    """``MASK_OPS``, ``GRAPHED_MASK_OPS``, ``FINISH_OPS``, ``EARLY_OPS``, the unit ops, ``RUN_OPS``
    and ``LOCAL_FIRST_RUN_OPS`` are the op counts of the current code (``opcount``, G = 2, in
    order and local first; the group of one too): a change to what the host issues before the
    read, after it, or to the order, makes this fail until they are recounted."""
    from sparsp.cost import ops as model
    from sparsp.simulate.opcount import count, early_ops, eager_ops, finish_ops, graphed_ops, issue_ops, run_ops

    cases = [(s, lf) for s in ("ring", "ring-sparse", "sparsp", "ring-relay") for lf in (False, True)]
    jobs = [(s, 1, lf) for s, lf in cases] + [("sparsp", 4, False), ("sparsp", 4, True),
                                              ("ulysses", 1, False), ("ulysses", 1, True)]
    got = dict(zip(jobs, count(2, jobs)))
    kinds = {"ring": ("dense", "dense"), "ring-sparse": ("sparse", "full-shards"), "sparsp": ("direct", "direct"),
             "ring-relay": ("relay", "relay"), "ulysses": ("all-to-all", "all-to-all")}
    for (s, u, lf), g in got.items():
        kind, rule = kinds[s]
        early = lf and s != "ulysses"  # ulysses runs in order whatever the config says
        cut = round(2 * (model.MASK_CUT_OPS + (u - 1) * model.MASK_UNIT_OPS)) if u > 1 else 0
        graphed_cut = round(2 * (model.GRAPHED_MASK_CUT_OPS + (u - 1) * model.GRAPHED_MASK_UNIT_OPS)) if u > 1 else 0
        where = (s, u, lf)
        assert eager_ops(kind, g) == model.mask_ops(kind, 2, graphed=False) + cut, where
        assert graphed_ops(kind, g) == model.mask_ops(kind, 2) + graphed_cut, where
        assert finish_ops(g) == model.finish_ops(kind, 2) + round(2 * (u - 1) * model.FINISH_UNIT_OPS), where
        assert early_ops(g) == (model.EARLY_OPS if early else None), where
        if u == 1:
            assert run_ops(g) == model.run_ops(rule, 2, early), where
            assert issue_ops(g) == model.issue_ops(rule, 2, early), where
    assert len(got[("ulysses", 1, True)]["kernels"]) == 1  # whole-block slices: one kernel call
    # at G = 4 the counting geometry's heads are reordered by density (ulysses' balanced order)
    (g4,) = count(4, [("ulysses", 1, False)])
    before, after = model.HEAD_ORDER_OPS
    first, last, tail = model.run_ops("all-to-all", 4)
    assert run_ops(g4) == (first + before, last + before, tail + after)
    assert issue_ops(g4) == model.issue_ops("all-to-all", 4) + before
    assert eager_ops("all-to-all", g4) == model.mask_ops("all-to-all", 4, graphed=False)
    one = dict(zip((False, True), count(1, [("sparsp", 1, False), ("sparsp", 1, True)])))
    for lf, g in one.items():  # a group of one: the local kernel is the call's only one
        assert (eager_ops("direct", g), graphed_ops("direct", g)) == (model.mask_ops("direct", 1, graphed=False),
                                                                      model.mask_ops("direct", 1)), lf
        assert finish_ops(g) == model.finish_ops("direct", 1) and run_ops(g) == model.run_ops("direct", 1, lf), lf
        assert issue_ops(g) == model.issue_ops("direct", 1, lf) == 0, lf
        assert early_ops(g) == (model.EARLY_OPS if lf else None), lf


def _fa4_kernel_file(tmp_path):
    def row(kernel, hd, layout, density, tflops, shape="s"):
        return {"shape": shape, "kernel": kernel, "head_dim": hd, "layout": layout, "density": density,
                "tflops_kept": tflops, "vs_cudnn": tflops / 500.0, "vs_best_dense": tflops / 600.0}

    rows = [row("fa4", 128, "local", 0.2, 600.0), row("fa4", 128, "packed", 0.2, 560.0),
            row("fa4", 128, "packed", 0.6, 580.0),
            row("fa4", 128, "dense", 1.0, 660.0),  # dense layout: not what the strategies run
            row("fa4", 128, "local", 1.0, 650.0),  # not sparse
            row("flex", 128, "local", 0.2, 400.0), row("cudnn", 128, "dense", 1.0, 500.0),
            row("flex", 64, "local", 0.6, 350.0), row("flex", 64, "packed", 0.6, 330.0)]  # no fa4 at d64
    path = tmp_path / "kernel-fa4.json"
    path.write_text(json.dumps({"kind": "kernel", "machine": "1xH200", "rows": rows}))
    return path


def test_calibrate_takes_fa4_rows_of_the_strategies_layouts(tmp_path):
    prof, report = calibrate(PROFILES["h200x2-nvlink"], [_fa4_kernel_file(tmp_path)])
    assert prof.kernel(128).sparse_tflops == pytest.approx(580.0)  # median of 600, 560, 580
    assert report["kernels"]["128"]["sparse_kernel"] == "fa4" and report["kernels"]["128"]["sparse_rows"] == 3
    assert prof.kernel(64).sparse_tflops == pytest.approx(340.0)  # no fa4 rows: flex's
    assert report["kernels"]["64"]["sparse_kernel"] == "flex"
    assert prof.kernel(128).dense_tflops == pytest.approx(500.0)  # cuDNN


def _shape_kernel_file(tmp_path):
    """Two d128 shapes (24 heads over 1000 keys, 40 over 2000) on their own (cdf) and random
    masks, fa4 and flex, local and packed, with each shape's dense rows."""
    def row(shape, heads, keys, kernel, layout, mask, density, tflops):
        return {"shape": shape, "heads": heads, "head_dim": 128, "q_rows": keys // 2, "k_rows": keys,
                "block_size": 128, "kernel": kernel, "layout": layout, "mask": mask, "density": density,
                "tflops_kept": tflops, "vs_cudnn": tflops / 500.0}

    rows = []
    for shape, heads, keys, scale in (("a", 24, 1000, 1.0), ("b", 40, 2000, 0.5)):
        rows += [row(shape, heads, keys, "fa4", "local", "cdf 0.9", 0.2, 600 * scale),
                 row(shape, heads, keys, "fa4", "local", "cdf 0.95", 0.4, 640 * scale),
                 row(shape, heads, keys, "fa4", "packed", "cdf 0.9", 0.2, 500 * scale),
                 row(shape, heads, keys, "fa4", "packed", "random 0.3", 0.3, 100 * scale),  # not its masks
                 row(shape, heads, keys, "fa4", "dense", "dense", 1.0, 800 * scale),
                 row(shape, heads, keys, "flex", "local", "cdf 0.9", 0.2, 50 * scale),  # not the kernel auto runs
                 row(shape, heads, keys, "cudnn", "dense", "dense", 1.0, 500 * scale)]
    path = tmp_path / "kernel-shapes.json"
    path.write_text(json.dumps({"kind": "kernel", "machine": "1xH200", "rows": rows}))
    return path


def test_kernel_rate_takes_the_rows_of_the_matching_shape(tmp_path):
    from sparsp.cost import KernelPoint

    prof, report = calibrate(PROFILES["h200x2-nvlink"], [_shape_kernel_file(tmp_path)])
    # the per-head-dim fallback: the median of every sparse fa4 row in the strategies' layouts
    assert prof.kernel(128).sparse_tflops == pytest.approx(statistics.median(
        [600, 640, 500, 100, 300, 320, 250, 50]))
    # points: fa4 on the benchmark's own masks and fa4's dense row, per shape; no random, no flex
    assert {(p.shape, p.layout, p.density, p.tflops) for p in prof.kernel_points if p.heads == 24} == {
        ("a", "local", 0.2, 600.0), ("a", "local", 0.4, 640.0), ("a", "packed", 0.2, 500.0),
        ("a", "dense", 1.0, 800.0)}
    assert report["kernels"]["128"]["shapes"]["b"]["packed"] == [[0.2, 250.0]]
    rate = prof.kernel_rate
    # the matching shape's own rows, per layout; linear in density, held below the first point
    assert rate(128, heads=24, tokens=1000, layout="local", density=0.2) == pytest.approx(600.0)
    assert rate(128, heads=24, tokens=1000, layout="local", density=0.3) == pytest.approx(620.0)
    assert rate(128, heads=24, tokens=1000, layout="local", density=0.1) == pytest.approx(600.0)
    assert rate(128, heads=40, tokens=2000, layout="local", density=0.2) == pytest.approx(300.0)
    assert rate(128, heads=24, tokens=1000, layout="packed", density=0.2) == pytest.approx(500.0)
    # towards the dense row at a full mask (the dense ring)
    assert rate(128, heads=24, tokens=1000, layout="packed", density=0.6) == pytest.approx(500 + 300 * 0.5)
    assert rate(128, heads=24, tokens=1000, layout="local", density=1.0) == pytest.approx(800.0)
    # another shape, no density, or a head dim without points: the per-head-dim figure
    for kw in (dict(heads=24, tokens=999, density=0.2), dict(heads=24, tokens=1000), dict(heads=0, tokens=0)):
        assert rate(128, **kw) == prof.kernel(128).sparse_tflops
    assert rate(64, heads=24, tokens=1000, density=0.2) == prof.kernel(64).sparse_tflops
    # the profile round-trips through JSON with its points
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert get_profile(str(path)) == prof
    with pytest.raises(ValueError, match="KernelPoint.layout"):
        KernelPoint(shape="a", heads=1, head_dim=1, tokens=1, layout="odd", density=0.5, tflops=1.0)


def test_steps_run_at_their_layout_and_the_ranks_density():
    """A rank's step 0 (its own shard) runs at the ``local`` rate, received payloads at the
    ``packed`` rate, both at the rank's density over the whole sequence; ulysses packs all."""
    from sparsp.cost import KernelPoint

    pl = make_placement("contiguous", GEOM, 2)
    masks = torch.rand(GEOM.heads, GEOM.num_blocks, GEOM.num_blocks, generator=torch.Generator().manual_seed(0)) < 0.5
    w = build_work(masks, pl, strategy_spec("sparsp"), head_dim=GEOM.head_dim)
    kept = pair_flops(masks, pl, GEOM.head_dim).sum(dim=1)
    full = pair_flops(masks, pl, GEOM.head_dim, dense=True).sum(dim=1)
    assert w.density == pytest.approx((kept / full).tolist())
    assert (w.heads, w.tokens) == (GEOM.heads, GEOM.num_tokens)
    assert [w.layout(i) for i in range(2)] == ["local", "packed"]
    assert build_work(masks, pl, strategy_spec("ring"), head_dim=GEOM.head_dim).density == (1.0, 1.0)
    assert build_work(masks, pl, strategy_spec("ulysses"), head_dim=GEOM.head_dim).layout(0) == "packed"

    def point(layout, tflops):
        return KernelPoint(shape="g", heads=GEOM.heads, head_dim=GEOM.head_dim, tokens=GEOM.num_tokens,
                           layout=layout, density=0.5, tflops=tflops)

    prof = _profile(kernels=(KernelFigure(head_dim=GEOM.head_dim, sparse_tflops=TFLOPS, dense_tflops=TFLOPS),),
                    kernel_points=(point("local", 2 * TFLOPS), point("packed", TFLOPS / 2)))
    tl = timeline(w, prof, head_dim=GEOM.head_dim)
    steps = sorted(tl.of(0, "compute"), key=lambda t: t.round)
    assert [t.end - t.start for t in steps] == pytest.approx(
        [w.flops[0][0] / (2 * TFLOPS * 1e9), w.flops[0][1] / (TFLOPS / 2 * 1e9)])


@pytest.mark.parametrize("whole", [True, False])
def test_ulysses_counts_its_copies(whole):
    """Whole-block slices (every placement's): the own head slices in (4 bytes per element),
    the result's own tokens and received pieces (4 each), one kernel call; slices ending in
    short blocks (a caller's own slices: here rank 0's moved 3 tokens off a block boundary): the
    stacked copies, G² kernel calls and their eager merges (``ULYSSES_*``)."""
    from dataclasses import replace as swap

    from sparsp.cost.figures import Blocks, measure
    from sparsp.cost.model import (ULYSSES_FIRST_BYTES, ULYSSES_INPUT_BYTES, ULYSSES_MERGE_BYTES,
                                   ULYSSES_PIECE_BYTES, ULYSSES_RESULT_BYTES, ULYSSES_WHOLE_COPY_BYTES)
    from sparsp.cost import work

    assert (ULYSSES_INPUT_BYTES, ULYSSES_PIECE_BYTES, ULYSSES_WHOLE_COPY_BYTES) == (40, 12, 4)
    G = 2
    pl = make_placement("contiguous", GEOM, G)
    masks = torch.ones(GEOM.heads, GEOM.num_blocks, GEOM.num_blocks, dtype=torch.bool)
    d = measure(masks, Blocks.of(pl))
    assert all(t % GEOM.block_size == 0 for t in d.tokens[:-1])  # placements cut at blocks
    if not whole:
        d = swap(d, tokens=(d.tokens[0] - 3, d.tokens[1] + 3))
    tokens = d.tokens
    w = work(strategy_spec("ulysses"), d, head_dim=GEOM.head_dim)
    hp = GEOM.heads // G
    if whole:
        copies = 4 * GEOM.head_dim * (3 * tokens[0] * hp + tokens[0] * GEOM.heads)
        assert w.merge_bytes[0] == (copies,) and w.launches[0] == (1,)
        return
    mine = hp * sum(tokens) * GEOM.head_dim  # my heads, every token
    inputs = GEOM.heads * tokens[0] * GEOM.head_dim  # one of my q, k, v
    merges = ULYSSES_FIRST_BYTES + (G - 1) * ULYSSES_MERGE_BYTES + ULYSSES_RESULT_BYTES + 4 * (G - 1) / G
    assert w.merge_bytes[0] == (round(mine * merges + inputs * (40 + 12 * (G - 1) / G)),)
    assert w.launches[0] == (G * G,)


def test_discovery_prefers_the_kernel_file_covering_more_head_dims(tmp_path):
    from sparsp.simulate.calibrate import discover_calibration

    def kernel_file(name, dims):
        rows = [{"kernel": "fa4", "head_dim": d, "layout": "local", "density": 0.5, "tflops_kept": 1.0}
                for d in dims]
        (tmp_path / name).write_text(json.dumps({"kind": "kernel", "rows": rows}))

    (tmp_path / "transport-all-2xH200-2026-11-30.json").write_text("{}")
    kernel_file("kernel-all-1xH200-2026-11-30.json", (64, 128))
    kernel_file("kernel-all-2xH200-2026-11-30.json", (64,))
    kernel_file("kernel-all-4xH200-2026-11-29.json", (32, 64, 128))  # older
    assert [p.name for p in discover_calibration(tmp_path)] == [
        "transport-all-2xH200-2026-11-30.json", "kernel-all-1xH200-2026-11-30.json"]


@pytest.mark.parametrize("kind, ranks", [("contiguous", 2), ("periodic", 3), ("periodic", 4)])
def test_demand_figures_equal_a_brute_force_count(kind, ranks):
    """``demand_figures`` (what ``strategy="auto"`` reads) against loops over every block pair,
    in the call's placed order with a short tail block."""
    from sparsp.cost import Blocks, demand_figures

    g = torch.Generator().manual_seed(ranks)
    seq = tuple(16 * 3 + (5 if r == ranks - 1 else 0) for r in range(ranks))  # last rank: a short block
    blocks = Blocks.of_call(seq, 16)
    nB, heads, batch = len(blocks.lengths), 3, 2
    masks = torch.rand(batch * heads, nB, nB, generator=g) < 0.4
    got = demand_figures(masks, blocks, batch=batch).tolist()
    owner, L = blocks.owner.tolist(), blocks.lengths.tolist()
    pairs = [[0] * ranks for _ in range(ranks)]
    direct = [[0] * ranks for _ in range(ranks)]
    head = [0] * heads
    for bh in range(batch * heads):
        for i in range(nB):
            for j in range(nB):
                if masks[bh, i, j]:
                    pairs[owner[i]][owner[j]] += L[i] * L[j]
                    head[bh % heads] += L[i] * L[j]
        for r in range(ranks):
            for j in range(nB):
                if owner[j] != r and any(masks[bh, i, j] for i in range(nB) if owner[i] == r):
                    direct[r][owner[j]] += L[j]
    want = [x for row in pairs for x in row] + [x for row in direct for x in row] + head
    assert got == want


def test_cost_package_sits_below_the_strategies():
    """``sparsp.cost`` imports no strategy, simulate, plan, transport, kernel, integration, bench or
    CLI module (function-level imports included): a strategy reaches it only as its registered
    facts."""
    import ast
    import pathlib

    import sparsp.cost

    above = ("strategies", "simulate", "plan", "transport", "kernels", "integrations", "bench", "cli")
    for path in pathlib.Path(sparsp.cost.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names] if node.level else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.replace("sparsp.", "", 1).split(".")
                assert parts[0] not in above, f"{path.name} imports {name}"


def test_cost_model_takes_a_strategys_facts():
    """``cost.work`` takes a strategy's registered facts; any object with the four facts is
    simulated by its byte rule, registered or not."""
    from types import SimpleNamespace

    from sparsp import cost
    from sparsp.cost.figures import Blocks, measure

    geom = geometry("ltx-video")
    pl = make_placement("periodic", geom, 2)
    d = measure(MaskCache().get(geom, 0.9), Blocks.of(pl))
    registered = cost.work(strategy_spec("sparsp"), d, head_dim=geom.head_dim)
    facts = SimpleNamespace(name="unregistered-direct", sparse=True, byte_rule="direct", local_first=False)
    w = cost.work(facts, d, head_dim=geom.head_dim)
    assert w.schedule == registered.schedule == "direct" and w.recv == registered.recv
