"""``bench transport``'s exchange logic on the CPU, with a recording transport and stand-in CUDA
events: a pipelined exchange queues all its messages before it waits for the first, and every
fetch is waited for and released once (the GPU runs are on the device machine)."""

from __future__ import annotations

import pytest
import torch

from sparsp.bench import transport as bt


class _Event:
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        _Event.clock += 1.0
        self.t = _Event.clock

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_Event") -> float:
        return other.t - self.t


class _Recorder:
    """A transport that logs the protocol calls and copies published bytes to the fetcher."""

    def __init__(self) -> None:
        self.log, self.sent = [], []

    def fence(self):
        self.log.append("fence")

    def send_buffer(self, peer, n, dtype):
        self.log.append("send_buffer")
        return torch.empty(n, dtype=dtype)

    def publish(self, peer, buf):
        self.log.append("publish")
        self.sent.append(buf.clone())

    def fetch(self, peer, out):
        self.log.append("fetch")
        out.copy_(self.sent.pop(0))
        log = self.log

        class Handle:
            def wait(self):
                log.append("wait")

        return Handle()

    def release(self, peer):
        self.log.append("release")


@pytest.mark.parametrize("inflight", [1, 3])
def test_exchange_queues_every_message_before_waiting(monkeypatch, inflight):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    t = _Recorder()
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    gates = []
    ex = bt._Exchange(t, 1, src, dst, lambda: gates.append(len(t.log)), inflight=inflight)
    start, end = ex(16)
    assert torch.equal(dst[:16], src[:16])
    # fence, one pack before the gate, then per message publish + fetch (later packs timed)
    assert t.log[:2] == ["fence", "send_buffer"] and gates == [2]
    queued = t.log[2:2 + 3 * inflight - 1]
    assert queued.count("publish") == inflight and queued.count("fetch") == inflight
    assert "wait" not in queued
    assert t.log[-2 * inflight:] == ["wait", "release"] * inflight
    assert start.elapsed_time(end) > 0


def test_pipeline_must_fit_the_window(capsys):
    from sparsp.bench.args import add_transport

    parser = __import__("argparse").ArgumentParser()
    add_transport(parser)
    args = parser.parse_args(["--pipeline", "4", "--window", "3"])
    with pytest.raises(SystemExit) as e:
        bt.main(args)
    assert e.value.code == 2 and "--pipeline must be between 0 and the window (3)" in capsys.readouterr().err


def test_on_a_cpu_one_line_before_anything_starts(capsys, monkeypatch, tmp_path):
    """Without CUDA the verb says so in one line (it printed a 26-line ``AttributeError`` from
    the process group's start), and starts nothing: no process group, no output folder."""
    import torch.distributed as dist

    from cli_utils import run_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(capsys, ["bench", "transport", "--out", tmp_path / "out"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("sparsp bench transport: error: needs CUDA GPUs"), err
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("order", [bt.EXCHANGE_FIRST, bt.ATTENTION_FIRST])
def test_under_load_orders_the_attention_and_the_first_exchange(monkeypatch, order):
    """``--load-order``: exchange first puts the first exchange in flight before the attention
    is queued (a ring step), attention first queues the attention before any exchange (a call
    that launches its local kernel first); every exchange is waited for and released."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(bt, "_time_attention", lambda attn, stream, iters, device, error=None: [50.0])
    t = _Recorder()
    src = torch.arange(64, dtype=torch.uint8)
    ex = bt._Exchange(t, 1, src, torch.zeros(64, dtype=torch.uint8), lambda: None)
    args = type("A", (), {"warmup": 0, "iters": 1})()
    row = bt._under_load(ex, 16, 10.0, lambda: t.log.append("attention"), None, 50.0, args,
                         torch.device("cpu"), "rec", "host", order)
    first_publish, attention = t.log.index("publish"), t.log.index("attention")
    assert (first_publish < attention) == (order == bt.EXCHANGE_FIRST)
    assert t.log.count("publish") == t.log.count("wait") == t.log.count("release") == 5  # 50 / 10 ms
    assert row["load_order"] == order and row["under_load"] and row["exchanges_per_attention"] == 5


def test_removed_transport_options_are_gone():
    """The host transport's extra H2D streams and ramped first chunk went with their code."""
    from sparsp.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "transport"]).chunk_bytes == 16 << 20
    for gone in (["--h2d-streams", "2"], ["--first-chunk-bytes", "64KiB"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "transport", *gone])
