"""Bad input at every public entry point: the error a user sees (README, "Bad input").

Each test here is a row (or several) of the README table that no other test file covers; the
table names the other files' tests for the remaining rows. The rule checked everywhere: a
``ValueError`` that names the argument, the value received and what is allowed, raised before
any payload moves; in a process group, on every rank alike wherever one collective can find
it; on the command line, exit status 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import pytest
import torch

from cli_utils import run_cli
from dist_utils import run_distributed
from sparsp import SparspConfig
from sparsp.geometry import VideoGeometry, latent_grid, preset
from sparsp.masks import block_mask
from sparsp.placement import Placement, contiguous, make_placement, periodic
from sparsp.strategies import comm_bytes
from sparsp.workloads.traces import load_trace, save_trace
from sparsp.workloads import synthetic_masks, token_qk

SMALL = VideoGeometry(frames=2, height=4, width=6, text_tokens=5, block_size=8, heads=2, head_dim=8)

# --- SparspConfig -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(cdf_threshold=math.nan), r"cdf_threshold must be a number in \[0, 1\].*got nan"),
    (dict(cdf_threshold=True), r"cdf_threshold .*got True"),
    (dict(cdf_threshold=()), r"cdf_threshold .*got \(\)"),
    (dict(cdf_threshold=[0.5, 0.9]), r"cdf_threshold .*tuple of them, got \[0.5, 0.9\]"),
    (dict(cdf_threshold=(0.5, 1.2)), r"cdf_threshold .*got \(0.5, 1.2\)"),
    (dict(sim_threshold=2.0), r"sim_threshold .*got 2.0"),
    (dict(block_size=True), "block_size must be a positive int, got True"),
    (dict(block_size=16.0), "block_size must be a positive int, got 16.0"),
    (dict(timeout_s=-1), "timeout_s must be a finite number of seconds > 0, got -1"),
    (dict(timeout_s=math.inf), "timeout_s .*got inf"),
    (dict(timeout_s="60"), "timeout_s .*got '60'"),
    (dict(prefetch=0), "prefetch must be an int >= 1, got 0"),
    (dict(check_finite=1), "check_finite must be True or False, got 1"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be True or False, got 'yes'"),
    (dict(local_first=1), r"local_first must be None \(automatic\), True or False, got 1"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparspConfig(**kwargs)


def test_config_valid_values_still_accepted():
    cfg = SparspConfig(cdf_threshold=1, sim_threshold=(0.0, 1.0), block_size=64, timeout_s=0.5,
                       check_finite=False)
    assert cfg.dense is False and cfg.check_finite is False
    assert SparspConfig().check_finite is True


# --- geometry -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(frames=True, height=2, width=2), "VideoGeometry.frames must be a positive int, got True"),
    (dict(frames=2, height=2.0, width=2), "VideoGeometry.height must be a positive int, got 2.0"),
    (dict(frames=2, height=2, width=2, heads=0), "VideoGeometry.heads must be a positive int, got 0"),
])
def test_geometry_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoGeometry(**kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda: preset(None), "unknown preset None; choose one of hunyuan-video"),
    (lambda: preset("hunyuan-video", width=0), "width must be a positive multiple of 16, got 0"),
    (lambda: preset("hunyuan-video", frames=0), "frames must be 1 \\+ a multiple of 4, got 0"),
    (lambda: preset("hunyuan-video", height=768.0), "height must be an int .*got 768.0"),
    (lambda: preset("wan2.1-14b", block_size=0), "block_size must be a positive int, got 0"),
    (lambda: latent_grid("ltx-video", 1536, 768, 120), "frames must be 1 \\+ a multiple of 8, got 120"),
])
def test_preset_rejects(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- placement ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call, match", [
    (lambda: make_placement("striped", SMALL, 2), "unknown placement 'striped'; choose one of contiguous, periodic"),
    (lambda: periodic(SMALL, 2.0), "ranks must be a positive int, got 2.0"),
    (lambda: contiguous(SMALL, -1), "ranks must be a positive int, got -1"),
    (lambda: periodic(SMALL, 99), f"99 ranks exceed the {SMALL.num_blocks} blocks"),
    (lambda: Placement(SMALL, 2, torch.full((SMALL.num_blocks,), 2)), r"owner entries must lie in \[0, 2\)"),
    (lambda: contiguous(SMALL, 2).unpermute(torch.zeros(3, 2), dim=0), "dim 0 has 3 tokens, the placement expects 53"),
])
def test_placement_rejects(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- masks.block_mask ---------------------------------------------------------------------------


def _qk(S=32, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, S, H, D, generator=g), torch.randn(1, S, H, D, generator=g)


@pytest.mark.parametrize("change, match", [
    (lambda q, k: (q, k[:, :, :1]), "differ in batch, heads or head dim"),
    (lambda q, k: (q.int(), k), "must be floating point, got torch.int32"),
    (lambda q, k: (q, k.to("meta")), "must be on one device, got cpu and meta"),
    (lambda q, k: (q[:, :0], k), "need at least one token"),
    (lambda q, k: (q, k.index_fill(1, torch.tensor([3]), math.inf)), "k has 16 NaN/Inf values"),
    (lambda q, k: (q.index_fill(1, torch.tensor([0]), math.nan), k), "q has 16 NaN/Inf values"),
    (lambda q, k: ([q], k), "q must be a torch.Tensor"),
])
def test_block_mask_rejects(change, match):
    q, k = change(*_qk())
    with pytest.raises(ValueError, match=match):
        block_mask(q, k, cdf_threshold=0.9, block_q=8, block_k=8)


@pytest.mark.parametrize("blocks, match", [(dict(block_q=0), "block_q must be a positive int"),
                                           (dict(block_k=8.0), "block_k must be a positive int .*got 8.0")])
def test_block_mask_rejects_block_sizes(blocks, match):
    q, k = _qk()
    with pytest.raises(ValueError, match=match):
        block_mask(q, k, cdf_threshold=0.9, **blocks)


# --- demand.comm_bytes --------------------------------------------------------------------------


def test_comm_bytes_rejects():
    pl = contiguous(SMALL, 2)
    n = SMALL.num_blocks
    ok = torch.ones(SMALL.heads, n, n, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"masks must be bool \[heads, {n}, {n}\] in original block order, "
                                         rf"got \(1, 2, {n}, {n}\)"):
        comm_bytes(ok[None], pl, "sparsp", head_dim=8)  # forgot to fold the batch into heads
    with pytest.raises(ValueError, match="masks must be bool .*got list"):
        comm_bytes(ok.tolist(), pl, "sparsp", head_dim=8)
    with pytest.raises(ValueError, match="placement must be a sparsp.placement.Placement, got str"):
        comm_bytes(ok, "contiguous", "sparsp", head_dim=8)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        comm_bytes(ok, pl, "ring", head_dim=0)
    with pytest.raises(ValueError, match="dtype_bytes must be a positive int, got 2.0"):
        comm_bytes(ok, pl, "ring", head_dim=8, dtype_bytes=2.0)


# --- workloads ----------------------------------------------------------------------------------


def _trace(tmp_path, geom=SMALL):
    path = tmp_path / "trace.pt"
    n = geom.num_blocks
    masks = torch.rand(1, geom.heads, n, n, generator=torch.Generator().manual_seed(1)) < 0.3
    save_trace(path, masks, geom, cdf_threshold=0.9, source="test")
    return path


def test_load_trace_rejects(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="not a readable trace file"):
        load_trace(tmp_path)  # a directory
    path = _trace(tmp_path)
    with pytest.raises(ValueError, match="expected_geometry must be a VideoGeometry or None, got str"):
        load_trace(path, expected_geometry="hunyuan-video")
    other = SMALL.with_block_size(16)
    with pytest.raises(ValueError, match=f"{path}: trace geometry .* does not match the expected"):
        load_trace(path, expected_geometry=other)


def test_workload_generators_reject():
    with pytest.raises(ValueError, match="batch must be a positive int, got 0"):
        token_qk(SMALL, batch=0, seed=0)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 53\)"):
        token_qk(SMALL, seed=0, tokens=torch.tensor([0, 53]))
    with pytest.raises(ValueError, match=r"cdf_thresholds must be values in \[0, 1\], got \[0.9, 1.1\]"):
        synthetic_masks(SMALL, [0.9, 1.1])
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        synthetic_masks(SMALL, 0.9, layers=0)


# --- sparsp analyze -----------------------------------------------------------------------------


def _analyze(capsys, *args):
    from sparsp.cli import main

    try:
        code = main(["analyze", "--no-plots", *map(str, args)])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--model", "sora"], "argument --model: invalid choice: 'sora'"),
    (["--ranks", "two"], "argument --ranks: invalid int value: 'two'"),
    (["--placement", "striped"], "argument --placement: invalid choice: 'striped'"),
    (["--strategy", "allgather"], "sparsp analyze: error: unknown strategy 'allgather'; choose from"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--cdf", "x"], "argument --cdf: invalid float value: 'x'"),
    (["--ranks", "1"], "sparsp analyze: error: --ranks must be >= 2, got 1"),
    (["--layers", "0"], "sparsp analyze: error: --layers must be >= 1, got 0"),
    (["--cdf", "1.5"], r"sparsp analyze: error: --cdf values must lie in \[0, 1\], got 1.5"),
])
def test_analyze_bad_arguments(capsys, args, match):
    code, err = _analyze(capsys, *args)
    assert code == 2
    assert re.search(match, err), err


def test_analyze_bad_files(capsys, tmp_path):
    trace = _trace(tmp_path)
    code, err = _analyze(capsys, "--trace", tmp_path / "missing.pt", "--out", tmp_path / "o")
    assert code == 2 and "sparsp analyze: error:" in err and "missing.pt" in err
    broken = tmp_path / "broken.pt"
    broken.write_bytes(trace.read_bytes()[:100])
    code, err = _analyze(capsys, "--trace", broken, "--out", tmp_path / "o")
    assert code == 2 and "not a readable trace file (truncated or corrupt?)" in err
    code, err = _analyze(capsys, "--trace", trace, "--ranks", 64, "--out", tmp_path / "o")
    assert code == 2 and f"64 ranks exceed the {SMALL.num_blocks} blocks" in err
    code, err = _analyze(capsys, "--trace", trace, "--out", trace)  # --out names a file
    assert code == 2 and "is a file; give a directory" in err


def test_analyze_writes_bytes_per_strategy(capsys, tmp_path):
    """The good path of the same command: analysis.json holds every (placement, strategy) row,
    with bytes that follow from the byte rules (``sparsp.demand``), recomputed here by hand."""
    import json

    from sparsp.cli import main
    from sparsp.strategies import strategy_names

    G, head_dim, dtype_bytes = 3, SMALL.head_dim, 2  # bf16, the default --dtype
    trace = _trace(tmp_path)
    masks = load_trace(trace).masks[0]  # [heads, nB, nB]
    out = tmp_path / "o"
    assert main(["analyze", "--no-plots", "--trace", str(trace), "--ranks", str(G), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "done in" in printed  # table and paths: rich wraps them
    doc = json.loads((out / "analysis.json").read_text())
    assert (doc["model"], doc["ranks"], doc["dtype"], doc["masks"]) == (SMALL.name, G, "bf16", "trace:test")
    assert (doc["tokens"], doc["blocks"], doc["heads"], doc["head_dim"], doc["layers"]) == (53, 7, 2, 8, 1)
    density = masks.float().mean().item()
    (stats,) = doc["mask_stats"]
    assert stats["cdf"] == 0.9 and stats["density"] == pytest.approx(density)

    all_names = strategy_names()
    names = [s for s in all_names if s != "ulysses"]  # 2 heads at G = 3: ulysses cannot run
    assert doc["skipped"] == [{"strategy": "ulysses", "ranks": G, "reason": "needs heads divisible by G: 2 heads, G=3"}]
    rows = {(r["placement"], r["strategy"]): r for r in doc["results"]}
    assert len(rows) == len(doc["results"]) and set(rows) == {
        (p, s) for p in ("contiguous", "periodic") for s in names}
    lengths = SMALL.block_lengths().tolist()
    ring_total = (G - 1) * sum(lengths) * SMALL.heads * 2 * head_dim * dtype_bytes  # every other shard
    for (pname, strategy), r in rows.items():
        assert r["cdf"] == 0.9 and r["density"] == pytest.approx(density)
        assert len(r["bytes_per_rank"]) == G and all(b > 0 for b in r["bytes_per_rank"]), r
        assert r["bytes_total"] == sum(r["bytes_per_rank"]) and r["bytes_max_rank"] == max(r["bytes_per_rank"])
        assert r["reduction_vs_ring"] == pytest.approx(1 - r["bytes_total"] / ring_total)
    for pname in ("contiguous", "periodic"):
        owner = make_placement(pname, SMALL, G).owner.tolist()
        # direct: rank r receives, per head, each remote block some query block of r keeps
        direct = [sum(2 * lengths[kb] * head_dim * dtype_bytes
                      for h in range(SMALL.heads) for kb in range(SMALL.num_blocks)
                      if owner[kb] != r and any(masks[h, qb, kb] and owner[qb] == r
                                                for qb in range(SMALL.num_blocks)))
                  for r in range(G)]
        b = {s: rows[(pname, s)]["bytes_total"] for s in names}
        assert rows[(pname, "sparsp")]["bytes_per_rank"] == direct
        assert b["ring"] == b["ring-sparse"] == ring_total  # both move full shards
        assert b["sparsp"] <= b["ring-relay"] <= b["ring-sparse"]  # direct ⊆ relay ⊆ full shards
        assert b["sparsp"] < b["ring"]  # 30 % dense masks: some remote block is never read
        assert rows[(pname, "ring")]["reduction_vs_ring"] == 0.0

    sweep = doc["sweep"]
    assert sweep["cdf"] == 0.9
    assert {(v["ranks"], v["placement"], v["strategy"]) for v in sweep["volume"]} == {
        (g, p, s) for g in (2, 4) for p in ("contiguous", "periodic") for s in all_names
        if s != "ulysses" or SMALL.heads % g == 0}  # G <= 7 blocks; ulysses where G divides the heads
    for pname, amp in sweep["amplification"].items():
        assert [a["ranks"] for a in amp] == [2, 4]
        assert amp[0]["relay_over_direct"] == pytest.approx(1.0)  # two ranks: relay is direct
        assert amp[1]["relay_over_direct"] >= 1.0


@pytest.mark.parametrize("args", [["--ranks", "1"], ["--model", "sora"]])
def test_analyze_bad_arguments_exit_2_without_traceback(args):
    run = subprocess.run([sys.executable, "-m", "sparsp.cli", "analyze", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run
    assert "error:" in run.stderr and "Traceback" not in run.stderr + run.stdout


# --- sp_attention -------------------------------------------------------------------------------


def test_sp_attention_needs_a_process_group():
    import torch.distributed as dist

    from sparsp import sp_attention

    if dist.is_available() and dist.is_initialized():
        pytest.skip("this test process already joined a process group")
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="torch.distributed is not initialised: call dist.init_process_group"):
        sp_attention(q, q, q)


def _cfg(**kwargs):
    return SparspConfig(block_size=8, transport="nccl", kernel="torch", timeout_s=30, **kwargs)


def _raises(fn, match) -> str:
    with pytest.raises(ValueError, match=match) as err:
        fn()
    return str(err.value)


def _rejects_worker(rank, world):
    from unittest import mock

    import torch.distributed as dist

    from sparsp import sp_attention
    from sparsp.strategies import request

    q = torch.randn(1, 24, 2, 8)
    cfg = _cfg()
    call = lambda *t, **kw: (lambda: sp_attention(*t, **{"config": cfg, **kw}))  # noqa: E731
    # Checks without communication: every rank raises the same, nothing to wait for.
    _raises(call([q], q, q), "q must be a torch.Tensor, got list")
    _raises(call(q[:, :0].contiguous(), q[:, :0].contiguous(), q[:, :0].contiguous()),
            r"q is empty \(shape \(1, 0, 2, 8\)\)")
    _raises(call(q, q.to("meta"), q), "q, k, v devices differ: cpu, meta, cpu")
    _raises(call(q, q, q, strategy=None), "strategy=None is not one of ring, ring-sparse")
    with mock.patch.object(request.dist, "get_backend", return_value="nccl"):
        _raises(call(q, q, q), "the process group uses NCCL but q is on cpu; move q, k, v to the GPU")
    # Checks of the one shape all-gather: every rank sees every rank's row and raises the same.
    messages = [
        _raises(call(*[q.double() if rank else q] * 3), r"ranks disagree on dtype: \[0, 3\]"),
        _raises(call(*[torch.randn(1 + rank, 24, 2, 8)] * 3), r"ranks disagree on batch: \[1, 2\]"),
        _raises(call(*[torch.randn(1, 24, 2, 8 * (1 + rank))] * 3), r"ranks disagree on head dim: \[8, 16\]"),
        _raises(call(q, q, q, config=_cfg() if rank else SparspConfig(block_size=4, transport="nccl", kernel="torch")),
                r"ranks disagree on block_size: \[4, 8\]"),
        _raises(call(q, q, q, strategy="ring" if rank else "sparsp"), r"ranks disagree on strategy: \['sparsp', 'ring'\]"),
        _raises(call(q, q, q, _global_mask=torch.ones(1, 2, 5, 5, dtype=torch.bool)),
                r"_global_mask has shape \(1, 2, 5, 5\); the inputs need \(1, 2, 6, 6\)"),
    ]
    # The group is still usable: errors came after the collective, on every rank alike.
    out = sp_attention(q, q, q, config=cfg)
    assert out.shape == q.shape and torch.isfinite(out).all()
    gathered = [None] * world
    dist.all_gather_object(gathered, messages)
    assert all(m == messages for m in gathered), "ranks raised different errors"
    return True


def test_sp_attention_rejects_bad_input():
    run_distributed(_rejects_worker, 2, timeout=120)


def _non_finite_worker(rank, world):
    import torch.distributed as dist

    from sparsp import sp_attention
    from sparsp.strategies import strategy_names

    STRATEGIES = strategy_names()

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 24, 2, 8, generator=g) for _ in range(3))
    nan_q = q.clone()
    if rank == 1:
        nan_q[0, 3, 1, :2] = math.nan  # two NaNs on rank 1 only
    inf_k, nan_v = k.clone(), v.clone()
    inf_k[0, 0, 0, 0] = math.inf if rank == 0 else -math.inf
    nan_v[0, 5] = math.nan if rank == 1 else 1.0  # 16 NaNs on rank 1
    messages = []
    for strategy in STRATEGIES:  # the check runs before every strategy's first transfer
        messages.append(_raises(lambda: sp_attention(nan_q, k, v, strategy=strategy, config=_cfg()),
                                r"non-finite inputs \(rank 1: q has 2 NaN/Inf values\)"))
    messages.append(_raises(lambda: sp_attention(q, inf_k, nan_v, config=_cfg()),
                            r"rank 0: k has 1 NaN/Inf value; rank 1: k has 1 NaN/Inf value; "
                            r"rank 1: v has 16 NaN/Inf values"))
    gathered = [None] * world
    dist.all_gather_object(gathered, messages)
    assert all(m == messages for m in gathered), "ranks raised different errors"
    # check_finite=False: no check, and the NaN spreads to every rank's output (why it is on)
    out = sp_attention(q, k, nan_v, strategy="ring", config=_cfg(check_finite=False))
    assert torch.isnan(out).all()
    # a query row with no selected block: zeros, whatever the strategy (README, "Bad input")
    mask = torch.rand(1, 2, 6, 6, generator=torch.Generator().manual_seed(9)) < 0.5
    mask[0, 1, 1] = False  # rank 0's second block, head 1
    mask[0, 0, 3:] = False  # all of rank 1's blocks, head 0
    for strategy in STRATEGIES:
        if strategy == "ring":
            continue  # dense: ignores the mask
        out = sp_attention(q, k, v, strategy=strategy, config=_cfg(), _global_mask=mask)
        if rank == 0:
            assert (out[0, 8:16, 1] == 0).all() and out[0, :8, 1].abs().sum() > 0
        else:
            assert (out[0, :, 0] == 0).all() and out[0, :, 1].abs().sum() > 0
    return True


def test_non_finite_inputs_raise_on_every_rank():
    run_distributed(_non_finite_worker, 2, timeout=120)


def _one_rank_worker(rank, world):
    from sparsp import SparspConfig, sp_attention

    q = torch.randn(1, 24, 2, 8)
    cfg = SparspConfig(block_size=8, transport="nccl", kernel="torch", timeout_s=3.0)
    if rank == 1:  # only this rank's input is bad: it raises before the first collective
        _raises(lambda: sp_attention(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, config=cfg),
                "q is not contiguous")
        time.sleep(cfg.timeout_s + 3)  # stay in the group: the peer must time out, not see us leave
        return "raised ValueError"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="geometry check"):
        sp_attention(q, q, q, config=cfg)
    took = time.monotonic() - t0
    assert took < cfg.timeout_s + 5, f"timeout_s=3 fired after {took:.1f} s"
    return took


def test_bad_input_on_one_rank_times_out_its_peers():
    results = run_distributed(_one_rank_worker, 2, timeout=60)
    assert results[1] == "raised ValueError"


# --- the defined output of an empty row at kernel level: zeros, LSE -inf -------------------------


def test_empty_row_kernel_output_is_zero_with_lse_minus_inf():
    from sparsp.kernels import KVBuffer, get_kernel, update_out_and_lse

    bs, D = 4, 8
    q = torch.randn(1, 2, 8, D)
    k, v = torch.randn(8, D), torch.randn(8, D)
    kv = KVBuffer(k, v, torch.tensor([0, 4]), torch.tensor([4, 4]), bs, 2)
    num = torch.tensor([[[2, 0], [0, 0]]], dtype=torch.int32)  # head 0 block 1, head 1: nothing
    idx = torch.tensor([[[[0, 1], [0, 0]], [[0, 0], [0, 0]]]], dtype=torch.int32)
    out, lse = get_kernel("torch", "cpu")(q, kv, num, idx)
    assert (out[0, 0, 4:] == 0).all() and torch.isneginf(lse[0, 0, 4:]).all()
    assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all()
    assert torch.isfinite(lse[0, 0, :4]).all()
    # merged with another empty part, the row stays (0, -inf), never NaN
    merged, mlse = update_out_and_lse(out, lse, torch.zeros_like(out), torch.full_like(lse, -math.inf))
    assert torch.equal(merged[0, 1], torch.zeros_like(merged[0, 1])) and torch.isneginf(mlse[0, 1]).all()


@pytest.mark.gpu
def test_cuda_tensors_on_a_device_that_is_not_current():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_wrong_device_worker, 2, timeout=120, backend="nccl")


def _wrong_device_worker(rank, world):
    from sparsp import sp_attention

    q = torch.randn(1, 24, 2, 8, device=f"cuda:{1 - rank}")  # the peer's GPU, not ours
    _raises(lambda: sp_attention(q, q, q, config=SparspConfig(block_size=8)),
            rf"q is on cuda:{1 - rank} but the current CUDA device is cuda:{rank}")
    return True


def test_ipc_transport_rejects():
    from sparsp.transport.ipc import IpcTransport

    with pytest.raises(ValueError, match="the ipc transport moves CUDA tensors"):
        IpcTransport(None, device="cpu")


# --- every option of every verb that reads a file: corrupt input, one line, exit 2 ----------------

BAD_KINDS = ("empty", "text", "random", "truncated", "wrong-kind", "other-sparsp-file", "directory")


def _transport_result() -> dict:
    return {"kind": "transport", "machine": "1xTest", "date": "2026-01-01", "rows": [
        {"transport": "nccl", "fabric": "nvlink", "bytes": 1 << b, "ms": 0.01 * (1 + b), "gbps": 10.0,
         "under_load": False, "attention_slowdown": None} for b in range(16, 20)]}


def _bad_file(tmp_path, kind: str, flavour: str, option: str = ""):
    """A file of ``kind`` where a ``flavour`` file (``torch`` or ``json``) is expected;
    ``other-sparsp-file``: a readable file sparsp writes or reads elsewhere (a trace for
    ``--embeds``, forward arguments for ``--trace``, an ``analysis.json`` for the JSON options)."""
    import json
    import random

    path = tmp_path / f"bad-{kind}.{'pt' if flavour == 'torch' else 'json'}"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("these are my notes,\nnot a file sparsp wrote\n")
    elif kind == "random":
        path.write_bytes(bytes([0xa6, 0x00, 0xff]) + random.Random(0).randbytes(509))
    elif kind == "truncated":
        good = _trace(tmp_path) if flavour == "torch" else tmp_path / "good.json"
        if flavour == "json":
            good.write_text(json.dumps(_transport_result()))
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "wrong-kind":  # a JSON result where a torch file goes, a trace where JSON goes
        if flavour == "torch":
            path.write_text(json.dumps(_transport_result()))
        else:
            path.write_bytes(_trace(tmp_path).read_bytes())
    elif kind == "other-sparsp-file":
        if flavour == "json":
            path.write_text(json.dumps({"model": "hunyuan-video", "ranks": 8, "results": []}))
        elif option == "trace --embeds":
            path.write_bytes(_trace(tmp_path).read_bytes())
        else:
            torch.save({"encoder_hidden_states": torch.zeros(1, 8, 16)}, path)
    elif kind == "directory":
        path.mkdir()
    return path


def _cli(capsys, argv):
    return run_cli(capsys, argv)


# option → (flavour of file it takes, how to run it with the file)
FILE_OPTIONS = {
    "analyze --trace": ("torch", lambda c, f, t: _cli(c, ["analyze", "--no-plots", "--trace", f, "--ranks", 2,
                                                         "--out", t / "o"])),
    "trace --embeds": ("torch", lambda c, f, t: _cli(c, ["trace", "--tiny", "--device", "cpu", "--embeds", f,
                                                       "--out", t / "t.pt"])),
    "simulate --fabric": ("json", lambda c, f, t: _cli(c, ["simulate", "--no-plots", "--ranks", 2, "--fabric", f,
                                                         "--out", t / "s"])),
    "simulate --fit-profile": ("json", lambda c, f, t: _cli(c, ["simulate", "--no-plots", "--ranks", 2,
                                                              "--fit-profile", f, "--out", t / "s"])),
    "simulate --validate": ("json", lambda c, f, t: _cli(c, ["simulate", "--no-plots", "--ranks", 2,
                                                           "--validate", f, "--out", t / "s"])),
    "bench report FILES": ("json", lambda c, f, t: _cli(c, ["bench", "report", f])),
    # a real model's per-head densities and the heads fitted to them (``sparsp.density``,
    # ``sparsp.calibration``), read before any process group starts
    "analyze --density-profile": ("json", lambda c, f, t: _cli(c, ["analyze", "--no-plots", "--model", "wan2.1-1.3b",
                                                                 "--density-profile", f, "--out", t / "o"])),
    "analyze --calibration": ("json", lambda c, f, t: _cli(c, ["analyze", "--no-plots", "--model", "wan2.1-1.3b",
                                                             "--density-profile", _profile_csv(t), "--layers", 1,
                                                             "--calibration", f, "--out", t / "o"])),
    "simulate --density-profile": ("json", lambda c, f, t: _cli(c, ["simulate", "--no-plots", "--model", "wan2.1-1.3b",
                                                                  "--density-profile", f, "--out", t / "s"])),
    "simulate --calibration": ("json", lambda c, f, t: _cli(c, ["simulate", "--no-plots", "--model", "wan2.1-1.3b",
                                                              "--density-profile", _profile_csv(t), "--layers", 1,
                                                              "--calibration", f, "--out", t / "s"])),
    "bench e2e --density-profile": ("json", lambda c, f, t: _cli(c, ["bench", "e2e", "--device", "cpu", "--model",
                                                                   "wan2.1-1.3b", "--density-profile", f,
                                                                   "--out", t / "b"])),
    "bench e2e --calibration": ("json", lambda c, f, t: _cli(c, ["bench", "e2e", "--device", "cpu", "--model",
                                                               "wan2.1-1.3b", "--density-profile", _profile_csv(t),
                                                               "--layers", 1, "--calibration", f, "--out", t / "b"])),
    "bench attention --density-profile": ("json", lambda c, f, t: _cli(c, ["bench", "attention", "--model",
                                                                         "wan2.1-1.3b", "--density-profile", f,
                                                                         "--layer", 0, "--out", t / "b"])),
    "calibrate PROFILE": ("json", lambda c, f, t: _cli(c, ["calibrate", f, "--model", "wan2.1-1.3b",
                                                         "--out", t / "cal.json"])),
    "density FILE": ("json", lambda c, f, t: _cli(c, ["density", f])),
    "bench attention --calibration": ("json", lambda c, f, t: _cli(c, ["bench", "attention", "--model", "wan2.1-1.3b",
                                                                     "--density-profile", _profile_csv(t), "--layer",
                                                                     0, "--calibration", f, "--out", t / "b"])),
}


def _profile_csv(tmp_path):
    """A valid density profile of ``wan2.1-1.3b`` (30 layers, 12 heads, 2 steps)."""
    import random

    path = tmp_path / "profile.csv"
    rng = random.Random(0)
    rows = [f"{s},{layer},{h},{rng.uniform(0.02, 0.5):.4f}" for s in (1, 2) for layer in range(30) for h in range(12)]
    path.write_text("Step,Layer,Head,Sparsity\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("option", list(FILE_OPTIONS))
def test_bad_input_files_one_line_naming_the_file(capsys, tmp_path, option, kind):
    """Empty, text, random, truncated, wrong-kind files and directories, for every option
    that reads a file: exit status 2 and one line on stderr naming the file, no traceback."""
    flavour, run = FILE_OPTIONS[option]
    path = _bad_file(tmp_path, kind, flavour, option)
    code, out, err = run(capsys, path, tmp_path)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and ": error: " in err, err
    assert str(path) in err, err
    assert "Traceback" not in out + err and "weights_only" not in err, err
    assert not err.rstrip().endswith(":"), err  # the reason is never empty


@pytest.mark.parametrize("kind", ["empty", "text", "wrong-kind"])
def test_bad_pretrained_directory_one_line(capsys, tmp_path, monkeypatch, kind):
    """``trace --pretrained DIR`` whose transformer config is empty, text or another kind of file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    bad = _bad_file(tmp_path, kind, "json")
    (model / "transformer" / "config.json").write_bytes(bad.read_bytes())
    code, out, err = _cli(capsys, ["trace", "--pretrained", model, "--device", "cpu", "--out", tmp_path / "t.pt"])
    assert code == 2 and err.count("\n") == 1 and f"--pretrained {model}" in err, err
    assert "Traceback" not in out + err


def test_pretrained_file_one_line(capsys, tmp_path):
    path = _trace(tmp_path)
    code, out, err = _cli(capsys, ["trace", "--pretrained", path, "--device", "cpu", "--out", tmp_path / "t.pt"])
    assert code == 2 and f"--pretrained {path}: is a file" in err and err.count("\n") == 1, err


def test_load_trace_says_what_the_file_is(tmp_path):
    """``load_trace`` itself: each defect named, never torch's advice or a bare ``KeyError``."""
    for kind, match in [("empty", "the file is empty"), ("text", "it is text, not a torch.save archive"),
                        ("random", "it is binary data, not a torch.save archive"),
                        ("truncated", r"\(truncated or corrupt\?\): \S"),
                        ("wrong-kind", "it is JSON text, not a torch.save archive"),
                        ("directory", "it is a directory")]:
        path = _bad_file(tmp_path, kind, "torch")
        with pytest.raises(ValueError, match=f"{re.escape(str(path))}: not a readable trace file.*{match}"):
            load_trace(path)
    pickled = tmp_path / "objects.pt"
    torch.save({"format": "sparsp-trace", "obj": _NotPlainData()}, pickled)
    with pytest.raises(ValueError, match="it holds Python objects other than tensors") as err:
        load_trace(pickled)
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


class _NotPlainData:
    """An object ``torch.load(weights_only=True)`` refuses to unpickle."""
