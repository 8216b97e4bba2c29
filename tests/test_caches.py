"""Per-geometry state has one owner (``sparsp.caches``): ``close_transports`` empties every
registered cache with one call, whichever module keeps it."""

from dist_utils import run_distributed, structured_inputs


def test_forget_all_empties_per_geometry_caches_and_runs_forget_steps():
    from sparsp import caches

    kept = caches.per_geometry("tests: a cache")
    forgotten = []
    caches.on_forget("tests: a forget step", lambda: forgotten.append(1), size=lambda: 1 - len(forgotten))
    kept["key"] = "value"
    assert caches.sizes()["tests: a cache"] == 1 and caches.sizes()["tests: a forget step"] == 1
    caches.forget_all()
    caches.forget_all()  # safe twice
    assert not kept and forgotten == [1, 1]
    assert {"tests: a cache", "tests: a forget step"} <= set(caches.registered())


def _worker(rank, world):
    from sparsp import SparspConfig, caches, sp_attention
    from sparsp.strategies import auto, close_transports

    B, H, D, bs, S = 1, 4, 16, 16, 96
    q, k, v = structured_inputs(3, B, S, H, D)
    x = [t[:, rank * S // world:(rank + 1) * S // world].contiguous() for t in (q, k, v)]
    for strategy in ("sparsp", "ring", "auto"):
        sp_attention(*x, strategy=strategy,
                     config=SparspConfig(cdf_threshold=0.9, block_size=bs, transport="nccl", kernel="torch"))
    before = {name: n for name, n in caches.sizes().items() if n}
    decided = auto.last_decision() is not None
    close_transports()
    after = {name: n for name, n in caches.sizes().items() if n}
    return before, decided, after, auto.last_decision(), caches.registered()


def test_close_transports_empties_every_registered_cache():
    for before, decided, after, last, registered in run_distributed(_worker, 2, timeout=180):
        # the call filled the caches of the modules it went through
        for name in ("plan: each group's summary capacity and shapes", "plan: block owners", "wire: metadata headers",
                     "summaries: block lengths and zeros", "strategies: full layouts and payload buffers",
                     "cost: a call's blocks in placed order"):
            assert before.get(name), (name, before)
        assert decided
        assert not after, f"left after close_transports: {after}"
        assert last is None  # auto's forget step ran
        for name in ("summaries: kept send rows", "summaries: CUDA graphs of the summing kernel",
                     "captured: plan stages", "auto: predictions and decisions", "masks: per-head thresholds"):
            assert name in registered, name
