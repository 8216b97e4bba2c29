"""Soak: many consecutive ``sp_attention`` calls on CPU, 2 ranks, strategy
``sparsp``, over the ``host`` (shared memory) and ``nccl`` (gloo) transports.

Every call has new inputs and a new mask: a fresh seed, a CDF threshold that cycles, a
geometry that cycles through a few per-rank lengths (tail blocks included), and every seventh
call a random block mask with empty rows. After a warm-up (transports built, slots grown to
the largest geometry) each rank must stay flat until the last call:

- resident memory (VmRSS) grows by less than ``RSS_BOUND_MIB``;
- open file descriptors other than sockets (/proc/self/fd) grow by at most ``FD_SLACK``,
  mapped sparsp segments (/proc/self/maps) are exactly as many as after the warm-up, sockets no more
  (gloo and the TCP store close setup connections on their own schedule), and nothing of this
  test is in /dev/shm;
- every ``check_every``-th call equals the float64 single-process reference within 1e-5.

``test_soak_short`` runs in CI (``SHORT_CALLS`` calls). ``test_soak_long`` is marked ``slow``
and runs only with ``--soak-calls N`` (``tests/conftest.py``): ``make soak`` runs it with
``pytest --soak-calls 5000 -m slow``.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from dist_utils import run_distributed
from test_strategies import _inputs, reference, slice_blocks, split_mask

SHORT_CALLS = 200
RSS_BOUND_MIB = 64.0
B, H, D, BS = 1, 2, 16, 16
GEOMETRIES = ([64, 48], [48, 61], [80, 80], [33, 64], [96, 40])  # tokens per rank, in turn
CDFS = (0.6, 0.75, 0.9, 0.97)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _mapped_segments() -> int:
    """sparsp shared-memory segments this process has mapped (names unlinked or not)."""
    with open("/proc/self/maps") as f:
        return len({line.split(None, 5)[-1] for line in f if "/sparsp-" in line})


FD_SLACK = 2


def _open_fds() -> tuple[int, int]:
    """(sockets, everything else) this process has open."""
    kinds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            kinds.append(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"))
        except OSError:  # the descriptor listdir itself used, closed by now
            kinds.append(False)
    return sum(kinds), len(kinds) - sum(kinds)


def _sample(tag: str) -> dict:
    gc.collect()
    sockets, fds = _open_fds()
    return {"rss_kib": _rss_kib(), "fds": fds, "sockets": sockets, "mapped": _mapped_segments(),
            "named": sum(tag in n for n in os.listdir("/dev/shm"))}


def _call_inputs(call: int, rank: int):
    """Call ``call``'s global inputs, mask choice and this rank's slices (same on every rank)."""
    lens = GEOMETRIES[call % len(GEOMETRIES)]
    q, k, v = _inputs(1000 + call, B, sum(lens), H, D)
    _, n = slice_blocks(lens, BS)
    given = None
    if call % 7 == 3:  # a random mask with empty rows instead of the CDF one
        g = torch.Generator().manual_seed(call)
        given = torch.rand(B, H, n, n, generator=g) < 0.3
        given[:, :, call % n] = False
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    return lens, (q, k, v), given, sl


def _soak_worker(rank: int, world: int, transport: str, calls: int, check_every: int,
                 tag: str) -> dict:
    from sparsp import SparspConfig, sp_attention

    configs = [SparspConfig(cdf_threshold=c, block_size=BS, transport=transport, kernel="torch",
                            timeout_s=60.0) for c in CDFS]
    warmup = min(50, calls // 4)
    checked, worst, before = 0, 0.0, None
    t0 = time.monotonic()
    for call in range(calls):
        if call == warmup:
            before = _sample(tag)
            t_warm = time.monotonic()
        lens, (q, k, v), given, sl = _call_inputs(call, rank)
        cdf = CDFS[call % len(CDFS)]
        out = sp_attention(*(x[:, sl].contiguous() for x in (q, k, v)), strategy="sparsp",
                           config=configs[call % len(CDFS)], _global_mask=given)
        if call % check_every == 0 or call == calls - 1:
            tok_block, _ = slice_blocks(lens, BS)
            mask = given if given is not None else split_mask(q, k, lens, BS, cdf, None)
            err = (out.double() - reference(q, k, v, tok_block, mask)[:, sl]).abs().max().item()
            assert err <= 1e-5, f"rank {rank}, call {call}: max abs error {err}"
            checked, worst = checked + 1, max(worst, err)
        if rank == 0 and calls >= 1000 and (call + 1) % 1000 == 0:
            s = _sample(tag)
            print(f"soak {transport}: {call + 1}/{calls} calls, RSS {s['rss_kib'] / 1024:.1f} MiB, "
                  f"fds {s['fds']}, mapped segments {s['mapped']}", flush=True)
    after = _sample(tag)
    elapsed = time.monotonic() - t0
    stats = {"rank": rank, "transport": transport, "calls": calls, "warmup": warmup,
             "checked": checked, "worst_err": worst, "before": before, "after": after,
             "seconds": elapsed, "calls_per_s": (calls - warmup) / (time.monotonic() - t_warm)}
    print(f"soak {transport} rank {rank}: {calls} calls in {elapsed:.1f} s, {checked} checked "
          f"(worst {worst:.1e}); RSS {before['rss_kib'] / 1024:.1f} -> "
          f"{after['rss_kib'] / 1024:.1f} MiB, fds {before['fds']} -> {after['fds']}, sockets "
          f"{before['sockets']} -> {after['sockets']}, mapped "
          f"segments {before['mapped']} -> {after['mapped']}, named {before['named']} -> "
          f"{after['named']}", flush=True)
    growth = (after["rss_kib"] - before["rss_kib"]) / 1024
    assert growth < RSS_BOUND_MIB, f"rank {rank}: RSS grew {growth:.1f} MiB after the warm-up"
    # A leak per call would add hundreds of descriptors; gloo and torch's threads open and close
    # a pipe or eventfd on their own schedule (seen once in CI: 21 -> 22 while sockets 6 -> 4).
    assert after["fds"] <= before["fds"] + FD_SLACK, f"rank {rank}: open fds {before['fds']} -> {after['fds']}"
    # gloo/TCPStore close setup connections now and then, on their own schedule: fewer is fine
    assert after["sockets"] <= before["sockets"], f"rank {rank}: sockets grew"
    assert after["mapped"] == before["mapped"], f"rank {rank}: mapped segments changed"
    assert after["named"] == before["named"] == 0, f"rank {rank}: named segments in /dev/shm"
    return stats


def _soak(transport: str, calls: int, tmp_path, monkeypatch) -> list[dict]:
    tag = f"soak.{transport}.{os.getpid()}.{time.time_ns() % 10**9}"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("SPARSP_SHM_TAG", tag)
    monkeypatch.setenv("TMPDIR", str(tmp))
    check_every = max(5, calls // 100)
    timeout = 120 + calls * 0.2  # generous: 2 ranks on 2 busy cores
    stats = run_distributed(_soak_worker, 2, transport, calls, check_every, tag, timeout=timeout)
    assert [n for n in os.listdir("/dev/shm") if tag in n] == [] and os.listdir(tmp) == []
    for s in stats:
        b, a = s["before"], s["after"]
        print(f"[soak {transport}] rank {s['rank']}: {s['calls']} calls ({s['warmup']} warm-up) "
              f"in {s['seconds']:.1f} s, {s['calls_per_s']:.0f} calls/s; {s['checked']} checked, "
              f"worst error {s['worst_err']:.1e}; RSS {b['rss_kib'] / 1024:.1f} -> "
              f"{a['rss_kib'] / 1024:.1f} MiB; fds {b['fds']} -> {a['fds']}; mapped segments "
              f"{b['mapped']} -> {a['mapped']}; in /dev/shm {b['named']} -> {a['named']}")
        assert s["calls"] == calls and s["checked"] >= min(calls, 20)
        if transport == "host":  # its own segment and its peer's stay mapped, no more
            assert s["after"]["mapped"] == 2, s
    return stats


@pytest.mark.parametrize("transport", ["host", "nccl"])
def test_soak_short(transport, tmp_path, monkeypatch):
    _soak(transport, SHORT_CALLS, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["host", "nccl"])
def test_soak_long(transport, tmp_path, monkeypatch, request):
    calls = request.config.getoption("--soak-calls")
    if calls is None:
        pytest.skip("runs with --soak-calls N (make soak)")
    _soak(transport, calls, tmp_path, monkeypatch)
