"""Transport bandwidth versus message size, alone and under attention load (run under torchrun).

    torchrun --nproc-per-node 2 -m sparsp.cli bench transport --fabric nvlink   # nccl, ipc
    torchrun --nproc-per-node 2 -m sparsp.cli bench transport --fabric host     # nccl w/o P2P, host

NCCL reads ``NCCL_P2P_DISABLE`` once per process, so the two fabrics are two runs; ``--fabric
host`` sets it before the process group exists, and the second run extends the first one's
result file. Every rank sends ``bytes`` to the other and receives as many from it at the same
time (both GPUs exchanging); one exchange is fence → send_buffer + pack (untimed) → gate →
publish, fetch, wait, release (timed with CUDA events on the current stream), the slowest rank
per iteration, median of ``--iters`` after ``--warmup``; that median is taken ``--repeats``
times and the row reports their median (``gbps``) and all of them (``gbps_repeats``).
gbps = payload bytes per direction / s / 1e9.

The gate (``--gate-ms``, as NVIDIA's nvbandwidth does with a blocking kernel) is a short spin
kernel queued before the start event: the host queues publish and fetch while it runs, so the
timing measures the transfer on the GPU rather than how fast Python issues it. After the gate a
4-byte NCCL all-reduce on the same stream lines the two GPUs up (``--no-align`` drops it): the
ranks' hosts reach the gate tens of microseconds apart, and without it the slower rank's lag is
counted as transfer time (ipc at 4 MiB: 110 µs per exchange unaligned, 73 µs aligned, on the
2×H200 box). ``--gate-ms 0`` measures with the issue latency included.

Pipelined rows (``--pipeline N``, default the window of 3 slots; ``inflight`` = N): N exchanges
are queued before the first is waited for, as a chunked payload stream is, so each message's
fixed cost (flag handshake, copy launch) overlaps the previous message's bytes; the row's
time is the pipeline's divided by N. Single exchanges (``inflight`` = 1) pay that fixed cost
in full; both are reported.

Under load, an attention kernel (``scaled_dot_product_attention``, bf16, DESIGN's 32k tokens
× 24×128 heads) runs on a second stream of the same GPU while back-to-back exchanges fill its
duration; ``attention_slowdown`` = median attention time during transfers / alone − 1 (DESIGN
"Contention": NCCL without P2P turned 21.1 ms into 33.0 ms; copy engines stayed within 5 %).
Two orders (``--load-order``, row field ``load_order``): ``exchange first`` puts the first
exchange in flight before the attention starts (as a ring step that packs and sends before it
computes); ``attention first`` queues the attention first and issues the exchanges behind it
(as a call that launches its local kernel before the first transfer): an exchange whose copies
are kernels (NCCL) then waits for SMs the attention holds, copy engines need none.

Result: ``bench/results/transport-all-<machine>-<date>.json`` with rows
``{"transport", "fabric", "bytes", "gbps", "under_load", "attention_slowdown", ...}`` and a PNG
of GB/s versus size per transport.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .args import check_out, default_out, refuse
from .common import (failure_text, first_error, init_distributed, median, over_ranks, result_path, save_figure,
                     shutdown, stage, wide_console, write_result)

EXCHANGE_FIRST, ATTENTION_FIRST = "exchange first", "attention first"
LOAD_ORDERS = {"exchange-first": (EXCHANGE_FIRST,), "attention-first": (ATTENTION_FIRST,),
               "both": (EXCHANGE_FIRST, ATTENTION_FIRST)}
DEFAULT_TRANSPORTS = {"nvlink": ("nccl", "ipc"), "host": ("nccl", "host")}


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= factor
    return sizes + [hi]


def _fabric(name: str, peer_access: bool) -> str:
    if name == "ipc":
        return "nvlink"
    if name == "host":
        return "host"
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0") not in ("0", "")
    return "nvlink" if peer_access and not p2p_off else "host"


class _Exchange:
    """Timed 2-way exchanges of ``n`` bytes with ``peer`` through ``t``: ``inflight`` of them
    queued before the first is waited for (1: a single exchange)."""

    def __init__(self, t, peer: int, src: torch.Tensor, dst: torch.Tensor, gate,
                 inflight: int = 1) -> None:
        self.t, self.peer, self.src, self.dst, self.gate = t, peer, src, dst, gate
        self.inflight = inflight

    def _packed(self, n: int) -> torch.Tensor:
        buf = self.t.send_buffer(self.peer, n, torch.uint8)
        if buf.device != self.src.device:  # nccl's send_buffer may not know our device
            buf = torch.empty(n, dtype=torch.uint8, device=self.src.device)
        buf.copy_(self.src[:n])  # the pack: a strategy's work whatever the transport
        return buf

    def start(self, n: int):
        """Fence, pack (untimed), then publish and fetch: the transfer is in flight."""
        t = self.t
        t.fence()
        buf = self._packed(n)
        self.gate()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        handles = []
        for i in range(self.inflight):  # later packs are timed: a pipeline packs as it goes
            t.publish(self.peer, buf if i == 0 else self._packed(n))
            handles.append(t.fetch(self.peer, self.dst[:n]))  # nccl issues both here
        return start, handles

    def finish(self, pending) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, handles = pending
        for handle in handles:
            handle.wait()
            self.t.release(self.peer)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return start, end

    def __call__(self, n: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return self.finish(self.start(n))


def _aligned(gate, device):
    """``gate``, then a 4-byte all-reduce on the current stream: both GPUs start together."""
    one = torch.ones(1, device=device)

    def run() -> None:
        gate()
        dist.all_reduce(one)

    return run


def _gate(ms: float, device):
    """A function queueing a spin kernel of about ``ms`` on the current stream (calibrated)."""
    if ms <= 0:
        return lambda: None
    cycles = 1_000_000
    for _ in range(3):  # the first launches include warm-up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        per_ms = cycles / max(a.elapsed_time(b), 1e-3)
    n = int(per_ms * ms)
    return lambda: torch.cuda._sleep(n)


def _attention(args, device):
    g = torch.Generator(device=device).manual_seed(1)
    shape = (1, args.attn_heads, args.attn_tokens, args.attn_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v)


def _time_attention(attn, stream, iters: int, device, error: str | None = None) -> list[float]:
    """``iters`` times of the attention on ``stream``, each the slowest rank's; ``error``: this
    rank's failure since the last collective, agreed on with the times (``over_ranks``)."""
    times = []
    try:
        for _ in range(iters if error is None else 0):
            a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a0.record(stream)
                attn()
                a1.record(stream)
            a1.synchronize()
            times.append(a0.elapsed_time(a1))
    except Exception as e:  # every rank raises it, from the flag of the maximum below
        error = failure_text(e)
    return over_ranks(times + [0.0] * (iters - len(times)), device, error=error, what="timing the attention")


def check(args) -> int:
    """Refuse (one line, exit status 2) what cannot run, before anything starts: the options,
    ``--out``, a machine without CUDA, a group of other than 2 processes. The pipeline depth."""
    if args.iters < 10:
        refuse("transport", "--iters must be >= 10 (medians of at least ten timed iterations)")
    if args.repeats < 1 or args.gate_ms < 0:
        refuse("transport", "--repeats must be >= 1 and --gate-ms >= 0")
    pipeline = args.window if args.pipeline is None else args.pipeline
    if pipeline < 0 or pipeline > args.window:
        refuse("transport", f"--pipeline must be between 0 and the window ({args.window}): each exchange in "
                            "flight holds a slot until the peer releases it")
    if args.out is None:
        args.out = default_out(torch.cuda.is_available())
    check_out("transport", "--out", args.out)
    if not torch.cuda.is_available():
        refuse("transport", "needs CUDA GPUs: it measures transfers between two GPUs (torchrun --nproc-per-node 2 "
                            "on a GPU machine); this machine has none")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, read before the group starts
    if world != 2:
        refuse("transport", f"run with 2 ranks (torchrun --nproc-per-node 2), not {world}")
    return pipeline


@dataclass
class _Setup:
    """What every transport's runs share: the peer, the message sizes, this rank's bytes to
    send, the peer's bytes it must receive, the receive buffer, the gate before each timed
    exchange, and the attention load (None with ``--no-load``) with its time alone."""

    peer: int
    sizes: list[int]
    src: torch.Tensor
    expect: torch.Tensor
    dst: torch.Tensor
    gate: object
    attn: object = None
    attn_stream: object = None
    attn_alone: float | None = None


def main(args) -> int:
    pipeline = check(args)
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    rank, _, device = init_distributed("nccl")
    console = wide_console() if rank == 0 else None
    try:
        with stage("allocating the buffers"):
            setup = _setup(args, rank, device)
        if not args.no_load:
            with stage("the attention load"):
                setup.attn, setup.attn_stream = _attention(args, device), torch.cuda.Stream(device)
            _time_attention(setup.attn, setup.attn_stream, max(args.warmup, 25), device)  # ~0.5 s: clocks settle
            setup.attn_alone = median(_time_attention(setup.attn, setup.attn_stream, args.iters, device))
            if console:
                console.print(f"attention alone: {setup.attn_alone:.2f} ms")
        with stage("calibrating the gate"):
            gate = _gate(args.gate_ms, device)
        setup.gate = gate if args.no_align else _aligned(gate, device)
        rows = []
        for name in args.transports or DEFAULT_TRANSPORTS[args.fabric]:
            rows += _transport_rows(name, args, setup, pipeline, device, console)
        with stage("writing the results"):
            if rank == 0:
                _write(rows, args, console)
    finally:
        shutdown()
    return 0


def _setup(args, rank: int, device) -> _Setup:
    sizes = _sizes(args.min_bytes, args.max_bytes, args.factor)
    top, peer = sizes[-1], 1 - rank
    gen = torch.Generator(device=device)
    src = torch.randint(0, 256, (top,), dtype=torch.uint8, device=device, generator=gen.manual_seed(100 + rank))
    expect = torch.randint(0, 256, (top,), dtype=torch.uint8, device=device, generator=gen.manual_seed(100 + peer))
    return _Setup(peer, sizes, src, expect, torch.empty(top, dtype=torch.uint8, device=device), None)


def _transport_rows(name: str, args, setup: _Setup, pipeline: int, device, console) -> list[dict]:
    """Every row of transport ``name``: each size alone, pipelined and under load. A transport
    that cannot be made here (ipc without peer access) is skipped on every rank, saying why."""
    from ..transport import make_transport

    options = {} if name == "nccl" else {"window": args.window, "chunk_bytes": args.chunk_bytes}
    t, error = None, None
    try:
        t = make_transport(name, None, device=device, timeout_s=args.timeout, **options)
    except Exception as e:  # agreed below: every rank skips it
        error = failure_text(e)
    error = first_error(error)
    if error is not None:
        if t is not None:
            t.close()
        if console:
            console.print(f"[yellow]skipping {name}: {error}[/yellow]")
        return []
    rows = []
    try:
        with stage(f"{name}: reserving its buffers"):
            t.reserve(setup.sizes[-1])
        peer_access = torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(
            device.index, (device.index + 1) % 2)
        fabric = _fabric(name, peer_access)
        exchange = _Exchange(t, setup.peer, setup.src, setup.dst, setup.gate)
        piped = _Exchange(t, setup.peer, setup.src, setup.dst, setup.gate, inflight=pipeline) if pipeline > 1 else None
        for n in setup.sizes:
            row = _timed(exchange, n, setup.expect, args, device, name, fabric, t)
            piped_row = None if piped is None else _timed(piped, n, setup.expect, args, device, name, fabric, t)
            loaded = [] if setup.attn is None else [
                _under_load(exchange, n, row["median_ms"], setup.attn, setup.attn_stream, setup.attn_alone, args,
                            device, name, fabric, order) for order in LOAD_ORDERS[args.load_order]]
            rows += [r for r in (row, piped_row, *loaded) if r is not None]
            if console:
                console.print(f"{name:5s} {fabric:6s} {_fmt(n):>9s}: {row['gbps']:7.2f} GB/s"
                              + (f", {pipeline} in flight {piped_row['gbps']:7.2f}" if piped_row else "")
                              + "".join(f", under load ({r['load_order']}) {r['gbps']:7.2f} GB/s, attention "
                                        f"{100 * r['attention_slowdown']:+.1f} %" for r in loaded))
    finally:
        t.close()
    return rows


def _timed(exchange: _Exchange, n: int, expect, args, device, name: str, fabric: str, t) -> dict:
    """The row of ``exchange`` at ``n`` bytes: per-message time, the slowest rank's, median of
    ``--iters``, taken ``--repeats`` times (bytes checked on the first warm-up)."""
    what = f"{name} at {_fmt(n)} ({exchange.inflight} in flight)"
    with stage(f"{what}: warm-up"):
        wrong = None
        for i in range(args.warmup):  # every warm-up exchange on every rank: each pairs with the peer's
            _, end = exchange(n)
            end.synchronize()
            if i == 0 and not torch.equal(exchange.dst[:n], expect[:n]):
                wrong = f"received wrong bytes at size {n}"
        if wrong:
            raise RuntimeError(wrong)
    repeats = []
    for _ in range(args.repeats):
        times, error = [], None
        try:
            for _ in range(args.iters):
                start, end = exchange(n)
                end.synchronize()
                times.append(start.elapsed_time(end) / exchange.inflight)
        except Exception as e:  # every rank raises it, from the flag of the maximum below
            error = failure_text(e)
        times += [0.0] * (args.iters - len(times))
        repeats.append(median(over_ranks(times, device, error=error, what=what)))
    ms = median(repeats)
    return {"transport": name, "fabric": fabric, "bytes": n, "gbps": n / ms / 1e6,
            "under_load": False, "attention_slowdown": None, "median_ms": ms,
            "iters": args.iters, "gbps_repeats": [n / r / 1e6 for r in repeats],
            "gate_ms": args.gate_ms, "aligned": not args.no_align,
            "inflight": exchange.inflight, "mechanism": t.describe()}


def _under_load(exchange, n, alone_ms, attn, attn_stream, attn_alone, args, device, name,
                fabric, order: str = EXCHANGE_FIRST) -> dict:
    """Attention on a second stream while exchanges run back to back for its duration.

    Each iteration times the attention twice, alone and under load, so both see the same GPU
    state (clocks, caches): a baseline taken once at the start was ~10 % slower than later
    runs on the H200s. ``order`` ``EXCHANGE_FIRST``: the first exchange is put in flight
    *before* the attention starts, so the two compete from the first microsecond (as in a ring
    step); ``ATTENTION_FIRST``: the attention is queued first and every exchange is issued
    behind it, so an exchange's time counts from its issue, waiting for SMs included.
    """
    # same count on both ranks (alone_ms and attn_alone are max-reduced): fences must pair up
    reps = max(1, min(100, math.ceil(attn_alone / max(alone_ms, 1e-3))))
    # no gate here: gaps between the exchanges would leave the attention alone part of the time
    exchange = _Exchange(exchange.t, exchange.peer, exchange.src, exchange.dst, lambda: None)
    alone, loaded, xfer_times, error = [], [], [], None
    for it in range(args.warmup + args.iters):
        # agreed with each attention time alone: a failure of the iteration before (the peer's
        # exchanges then fail on the transport's timeout) ends every rank here
        alone_it = _time_attention(attn, attn_stream, 1, device, error)[0]
        try:
            a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first = exchange.start(n) if order == EXCHANGE_FIRST else None
            with torch.cuda.stream(attn_stream):
                a0.record(attn_stream)
                attn()
                a1.record(attn_stream)
            if first is None:  # the attention holds the GPU already: every exchange comes behind it
                first = exchange.start(n)
            events = [exchange.finish(first)] + [exchange(n) for _ in range(reps - 1)]
            torch.cuda.synchronize(device)
        except Exception as e:
            error = failure_text(e)
            continue
        if it >= args.warmup:
            alone.append(alone_it)
            loaded.append(a0.elapsed_time(a1))
            xfer_times.extend(s.elapsed_time(e) for s, e in events)
    what = f"{name} at {_fmt(n)} under load"
    if error is not None:  # the last iteration failed: as many figures as the peer's, flagged
        xfer_times = [0.0] * (reps * args.iters)
    ms = median(over_ranks(xfer_times, device, error=error, what=what))
    attn_ms = median(over_ranks(loaded, device))
    attn_alone_now = median(alone)  # already the slowest rank's (max-reduced per iteration)
    return {"transport": name, "fabric": fabric, "bytes": n, "gbps": n / ms / 1e6,
            "under_load": True, "load_order": order, "attention_slowdown": attn_ms / attn_alone_now - 1.0,
            "median_ms": ms, "iters": len(xfer_times), "attention_ms": attn_ms,
            "attention_alone_ms": attn_alone_now, "exchanges_per_attention": reps}


def load_order(row: dict) -> str:
    """An under-load row's order; rows written before the field existed ran exchange first."""
    return row.get("load_order", EXCHANGE_FIRST)


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _write(rows: list[dict], args, console) -> dict:
    from rich.table import Table

    path = result_path("transport", "all", args.out)
    if path.exists():  # a rerun of the same transport and fabric replaces its rows
        old = json.loads(path.read_text())
        mine = {(r["transport"], r["fabric"]) for r in rows}
        old["rows"] = [r for r in old["rows"] if (r["transport"], r["fabric"]) not in mine]
        path.write_text(json.dumps(old, indent=1))
    one = lambda r: not r["under_load"] and r.get("inflight", 1) == 1  # noqa: E731
    path = write_result("transport", "all", rows, args.out)
    doc = json.loads(path.read_text())
    table = Table(title=f"transport bandwidth, {doc['machine']} (GB/s per direction, 2 ranks "
                        "exchanging)")
    for col in ("transport", "fabric", "size", "GB/s", "repeats", "GB/s pipelined",
                "GB/s under load", "attention", "GB/s behind attention"):
        table.add_column(col, justify="left" if col in ("transport", "fabric") else "right")
    alone = {(r["transport"], r["fabric"], r["bytes"]): r for r in doc["rows"] if one(r)}
    loaded = {(r["transport"], r["fabric"], r["bytes"], load_order(r)): r for r in doc["rows"]
              if r["under_load"]}
    piped = {(r["transport"], r["fabric"], r["bytes"]): r for r in doc["rows"]
             if not r["under_load"] and r.get("inflight", 1) > 1}
    for key, r in alone.items():
        lr, br, pr = loaded.get((*key, EXCHANGE_FIRST)), loaded.get((*key, ATTENTION_FIRST)), piped.get(key)
        reps = r.get("gbps_repeats") or [r["gbps"]]
        table.add_row(r["transport"], r["fabric"], _fmt(r["bytes"]), f"{r['gbps']:.2f}",
                      f"{min(reps):.1f}–{max(reps):.1f}",
                      f"{pr['gbps']:.2f} ({pr['inflight']})" if pr else "",
                      f"{lr['gbps']:.2f}" if lr else "",
                      f"{100 * lr['attention_slowdown']:+.1f} %" if lr else "",
                      f"{br['gbps']:.2f}" if br else "")
    console.print(table)
    console.print(f"wrote {path}")
    if not args.no_plot:
        console.print(f"wrote {plot(path)}")
    return doc


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    fig, ax = plt.subplots(figsize=(8, 4.8))
    series = dict.fromkeys((r["transport"], r["fabric"]) for r in doc["rows"])
    for i, (name, fabric) in enumerate(series):
        color = f"C{i}"
        kinds = ((lambda r: not r["under_load"] and r.get("inflight", 1) == 1, "-o", ""),
                 (lambda r: not r["under_load"] and r.get("inflight", 1) > 1, ":s", " pipelined"),
                 (lambda r: r["under_load"] and load_order(r) == EXCHANGE_FIRST, "--x", " under attention"),
                 (lambda r: r["under_load"] and load_order(r) == ATTENTION_FIRST, "-.+",
                  " issued behind attention"))
        for keep, style, label in kinds:
            rs = sorted((r for r in doc["rows"] if (r["transport"], r["fabric"]) == (name, fabric)
                         and keep(r)), key=lambda r: r["bytes"])
            if rs:
                ax.plot([r["bytes"] for r in rs], [r["gbps"] for r in rs], style, color=color,
                        ms=4, label=f"{name} ({fabric}){label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # 64 KiB messages and 512 MiB ones differ by orders of magnitude
    ax.set(xlabel="message bytes per direction", ylabel="GB/s per direction",
           title=f"transport bandwidth, 2 ranks exchanging, {doc['machine']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)

