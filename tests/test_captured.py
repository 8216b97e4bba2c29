"""The captured plan stage (``strategies/captured.py``) on the CPU, with the CUDA graph emulated.

A CUDA graph replays the same kernels into the same output memory: the Python objects made
at capture (the call's mask and demand, the pending layouts, the counts vector) are reused and
only their tensors' values change. ``_EmulatedGraph`` does exactly that on the CPU — it reruns
the stage on the capture's arguments and copies every output tensor into the captured one in
place — so these tests check the logic around the graph (first call eager, capture on the
second, replay after, one stage per geometry, the fallback when capture fails) and that the
stage reads nothing but the gathered rows: a stage that read q, k or v would replay the
capture's inputs and give the wrong output here, as on a GPU. The GPU test of the real graph
is ``test_strategies_gpu.py::test_captured_stage_equals_eager``.
"""

import dataclasses

import pytest
import torch

from dist_utils import run_distributed, structured_inputs


def _tensors(call, staged) -> list[torch.Tensor]:
    """Every tensor a replay must refresh: the call's mask, demand and kernel block lists, the
    counts vector and every pending layout's tensors (in a fixed order)."""
    # the lists in the order the stage made them (their keys hold the ids' addresses)
    out = [call.full_mask, staged.flat] + [t for pair in call._lists.values() for t in pair]
    if call._demand is not None:
        out.append(call._demand)
    for pend in staged.pending.values():
        out += [t for t in (pend.ids, pend.starts, pend.lens, pend.rows, pend.num_selected,
                            pend.num_short, pend.selected) if t is not None]
    return out


class _EmulatedGraph:
    def __init__(self, rerun, outputs):
        self.rerun, self.outputs, self.replays = rerun, outputs, 0

    def replay(self) -> None:
        self.replays += 1
        for mine, fresh in zip(self.outputs, _tensors(*self.rerun())):
            mine.copy_(fresh)


def _emulated_capture(q, k, v, meta, group, spec, config, transport, auto):
    from sparsp.strategies import captured

    rows = meta.rows if meta.rows_kept else meta.rows.clone()  # as captured._capture
    cdf = captured.threshold_tensor(config.cdf_threshold, meta.shapes.heads, q.device).clone()
    args = (q, k, v, meta, rows, group, spec, config, transport, auto, cdf)
    call, staged = captured._stage(*args)
    graph = _EmulatedGraph(lambda: captured._stage(*args), _tensors(call, staged))
    return captured._Stage(graph, rows, cdf, call.full_mask, call._demand, call._lists, staged)


def _emulate(monkeypatch_graphs: bool):
    """Let CPU calls take the captured path, with the graph emulated (or capture failing)."""
    from sparsp.strategies import captured

    def eligible(q, spec, config, computed):
        return config.cuda_graphs and computed and spec is not None and spec.sparse and config.sim_threshold is None

    def failing(*args, **kw):
        raise RuntimeError("operation not permitted when stream is capturing (emulated)")

    captured.eligible = eligible
    captured._capture = _emulated_capture if monkeypatch_graphs else failing


def _fuse_summaries():
    """The metadata step as on CUDA (one summing launch into the kept send row, the all-gather
    into rows kept per geometry, which a captured stage reads in place), with the summaries made
    by torch ops (``opcount``'s stand-in)."""
    from sparsp import plan, summaries
    from sparsp.simulate.opcount import _summaries_like_cuda

    plan.fused_sums = lambda *xs: True
    summaries.summaries_into = _summaries_like_cuda


def _worker(rank, world, lens, strategies, capture_works, fused=False):
    from sparsp import SparspConfig, sp_attention, summaries
    from sparsp.strategies import captured, close_transports

    _emulate(capture_works)
    if fused:
        _fuse_summaries()
    B, H, D, bs = 1, 4, 16, 16
    a = sum(lens[:rank])
    done = []
    for strategy, extra in strategies:
        graphed = SparspConfig(cdf_threshold=0.9, block_size=bs, transport="nccl", kernel="torch", **extra)
        eager = dataclasses.replace(graphed, cuda_graphs=False)
        kept = 0
        for step in range(4):  # eager, capture + replay, replay, replay: new inputs each call
            q, k, v = structured_inputs(10 + step, B, sum(lens), H, D)
            x = [t[:, a:a + lens[rank]].contiguous() for t in (q, k, v)]
            got = sp_attention(*x, strategy=strategy, config=graphed)
            want = sp_attention(*x, strategy=strategy, config=eager)
            assert torch.equal(got, want), f"{strategy} {extra} call {step}"
            if fused:  # the gathered rows are one buffer per geometry, call after call
                kept = kept if step else len(summaries._GATHERED)
                assert len(summaries._GATHERED) == kept, f"{strategy} call {step}: {len(summaries._GATHERED)} buffers"
        done.append(strategy)
    stages = [s for s in captured._STAGES.values() if isinstance(s, captured._Stage)]
    replays = sorted(s.graph.replays for s in stages)
    close_transports()
    return done, len(stages), replays


@pytest.mark.parametrize("lens, fused", [([64, 64], False), ([70, 45], False), ([70, 45], True)])
def test_replayed_stage_gives_the_eager_output(lens, fused):
    # fused: the stage reads the gathered rows in place (summaries.gathered_rows), not a copy
    strategies = [("sparsp", {}), ("sparsp", {"drain_chunks": 2}), ("ring-relay", {}),
                  ("ring-sparse", {}), ("ulysses", {}), ("auto", {})]
    results = run_distributed(_worker, 2, lens, strategies, True, fused, timeout=240)
    for done, stages, replays in results:
        assert done == [s for s, _ in strategies]
        # one stage per (strategy, config); captured on the 2nd call, replayed on calls 2-4
        assert stages == len(strategies) and replays == [3] * len(strategies), (stages, replays)


def test_failed_capture_stays_eager():
    results = run_distributed(_worker, 2, [64, 48], [("sparsp", {}), ("auto", {})], False, timeout=120)
    assert all(stages == 0 for _, stages, _ in results)


def _lru_worker(rank, world):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import captured, close_transports

    _emulate(True)
    captured.MAX_STAGES = 3
    q, k, v = structured_inputs(5, 1, 96, 4, 16)
    x = [t[:, 48 * rank:48 * (rank + 1)].contiguous() for t in (q, k, v)]
    for drain in (1, 2, 3, 4, 5):  # a new config, so a new stage, every time
        cfg = SparspConfig(drain_chunks=drain, block_size=16, transport="nccl", kernel="torch")
        for _ in range(2):
            sp_attention(*x, strategy="sparsp", config=cfg)
    kept = len(captured._STAGES)
    close_transports()
    return kept


def test_stages_are_bounded():
    """A caller sweeping configs does not accumulate graphs: the least recently used go."""
    assert run_distributed(_lru_worker, 2, timeout=120) == [3, 3]


def _thresholds_worker(rank, world, path):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import captured, close_transports

    _emulate(True)
    graphed = SparspConfig(thresholds=path, block_size=16, transport="nccl", kernel="torch")
    eager = dataclasses.replace(graphed, cuda_graphs=False)
    for step in range(3):  # eager, capture + replay, replay; the two layers alternate
        for layer in (0, 1):
            q, k, v = structured_inputs(20 + step, 1, 96, 4, 16)
            x = [t[:, 48 * rank:48 * (rank + 1)].contiguous() for t in (q, k, v)]
            got = sp_attention(*x, strategy="sparsp", config=graphed, layer=layer)
            assert torch.equal(got, sp_attention(*x, strategy="sparsp", config=eager, layer=layer)), (step, layer)
    stages = [s for s in captured._STAGES.values() if isinstance(s, captured._Stage)]
    close_transports()
    return len(stages)


def test_layers_with_thresholds_of_their_own_share_one_stage(tmp_path):
    """The CDF thresholds are the stage's input, not its key: two layers of one geometry with
    different per-head thresholds replay one graph, each with its own values."""
    from sparsp.thresholds import write_thresholds

    path = tmp_path / "t.json"
    write_thresholds(path, layers=2, heads=4, cdf=[[0.5, 0.7, 0.9, 0.95], [0.99, 0.6, 0.8, 0.3]])
    assert run_distributed(_thresholds_worker, 2, str(path), timeout=120) == [1, 1]
