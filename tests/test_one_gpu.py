"""A group of one: ``sp_attention`` picks the block-sparse or the dense kernel per call's mask
(``strategies/one_gpu.py``), and ``parallelize`` on a group of one runs it.

In this process, a gloo group of one rank; the CPU stands in for a GPU (``one_gpu.DEVICES``)
and the measured rates are set by the test (a CPU's timings are no basis for a decision a
test checks): a sparse kernel cost per kept block pair and a dense time equal to 70 % of every
pair at that cost, so a mask keeping more than 70 % of the pairs takes the dense kernel.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import torch.distributed as dist

from dist_utils import free_port, reference, slice_blocks, structured_inputs

B, S, H, D, BS = 1, 256, 2, 32, 32


@pytest.fixture
def alone(monkeypatch):
    """A gloo group of one in this process, the CPU counted as a one_gpu device, fixed rates."""
    from sparsp.kernels.dense import dense_kernels
    from sparsp.strategies import close_transports, one_gpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    monkeypatch.setattr(one_gpu, "DEVICES", ("cpu",))
    measured = []

    def fixed(call, kept):
        sh = call.shapes
        total = sh.batch * sh.heads * sh.num_blocks[0] ** 2
        measured.append(kept / total)
        name, fn = dense_kernels(call.q.device)[0]
        return one_gpu.Rates(1.0, name, 0.7 * total, fn)

    monkeypatch.setattr(one_gpu, "measure", fixed)
    close_transports()
    try:
        yield measured
    finally:
        close_transports()
        dist.destroy_process_group()


def _exact(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())


def _uniform(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    return 0.05 * q, 0.05 * k, v  # flat scores: every block keeps its share, the mask is full


def test_each_call_takes_the_kernel_its_mask_pays_for(alone, caplog):
    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.plan import gather_metadata
    from sparsp.strategies import one_gpu

    cfg = SparspConfig(cdf_threshold=0.9, block_size=BS)
    sparse_in, dense_in = structured_inputs(3, B, S, H, D), _uniform(4)
    caplog.set_level(logging.INFO, logger="sparsp")
    seen = []
    for call in range(one_gpu.MEASURE_AT + 3):  # before the rates: the sparse kernel, whatever the mask
        for name, (q, k, v) in (("sparse", sparse_in), ("dense", dense_in)):
            out = sp_attention(q, k, v, strategy="sparsp", config=cfg)
            choice = one_gpu.last_choice()
            seen.append((call, name, choice.dense))
            if choice.dense:
                want = _exact(q, k, v)
            else:
                want = reference_sp_attention(q.double(), k.double(), v.double(), lens=[S], config=cfg)
            assert (out.double() - want).abs().max().item() < 1e-4, (call, name)
    mask = gather_metadata(*sparse_in, None, cfg, "sparsp", sparse=True).block_mask(cfg)
    assert mask.float().mean() < 0.7  # the structured inputs are sparse enough to skip blocks
    assert len(alone) == 1  # the rates were measured once per geometry
    # one decision per call's mask once the rates are known: the sparse inputs keep the sparse kernel
    late = [(name, dense) for call, name, dense in seen if call >= one_gpu.MEASURE_AT]
    assert late and all(dense == (name == "dense") for name, dense in late)
    early = [dense for call, name, dense in seen if call == 0]
    assert early and not any(early)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sparsp: one GPU")]
    assert len(lines) == 2, lines  # once per geometry and decision
    assert any("dense kernel sdpa-math" in x for x in lines) and any("sparse kernel torch" in x for x in lines)


@pytest.mark.parametrize("strategy", ["ulysses", "ring-sparse", "ring-relay"])
def test_every_sparse_strategy_on_one_rank_decides_alike(alone, strategy):
    """On one rank every sparse strategy is its local kernel: the same decision per mask, and
    the dense kernel's output where it is taken (a strategy that assembles its own output,
    ``ulysses``, included)."""
    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.strategies import one_gpu

    cfg = SparspConfig(cdf_threshold=0.9, block_size=BS)
    for _ in range(one_gpu.MEASURE_AT):
        for name, (q, k, v) in (("sparse", structured_inputs(3, B, S, H, D)), ("dense", _uniform(4))):
            out = sp_attention(q, k, v, strategy=strategy, config=cfg)
            choice = one_gpu.last_choice()
            want = _exact(q, k, v) if choice.dense else reference_sp_attention(
                q.double(), k.double(), v.double(), lens=[S], config=cfg)
            assert (out.double() - want).abs().max().item() < 1e-4, (name, choice)
    assert one_gpu.last_choice().dense  # the uniform inputs' mask keeps more than it pays for


def test_a_dense_strategy_on_one_rank_takes_the_dense_kernel(alone):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import one_gpu

    q, k, v = structured_inputs(5, B, S, H, D)
    for _ in range(one_gpu.MEASURE_AT + 1):
        out = sp_attention(q, k, v, strategy="ring", config=SparspConfig(block_size=BS))
    assert one_gpu.last_choice().dense and one_gpu.last_choice().kernel == "sdpa-math"
    assert (out.double() - _exact(q, k, v)).abs().max().item() < 1e-4


def test_a_test_mask_runs_as_given(alone):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import one_gpu

    q, k, v = _uniform(6)
    ids, n = slice_blocks([S], BS)
    gm = torch.ones(B, H, n, n, dtype=torch.bool)
    gm[:, :, :, n // 2:] = False
    cfg = SparspConfig(cdf_threshold=0.9, block_size=BS)
    for _ in range(one_gpu.MEASURE_AT + 1):
        out = sp_attention(q, k, v, strategy="sparsp", config=cfg, _global_mask=gm)
    assert (out.double() - reference(q, k, v, ids, gm)).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["wan", "ltx-2", "hunyuan-video"])
def test_parallelize_on_a_group_of_one_runs_sp_attention(alone, kind):
    """A tiny model on a group of one: the same output as the plain model at a dense threshold
    (LTX-2's audio-to-video attention on the model's own processor: one rank holds every video
    key), each attention call deciding on its own mask."""
    pytest.importorskip("diffusers")
    import sparsp
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs, sample_of
    from sparsp.strategies import one_gpu

    model = build_transformer(kind, config=TINY[kind], seed=0, dtype=torch.float32, device="cpu")
    inputs = dummy_inputs(model, (3, 8, 8), text_tokens=8, seed=1)
    with torch.no_grad():
        want = sample_of(model(**inputs, return_dict=False))
    group = dist.new_group([0])
    sparsp.parallelize(model, group=group, config=sparsp.SparspConfig(cdf_threshold=1.0, block_size=8))
    rt = runtime_of(model)
    assert rt.distributed and rt.ranks == 1
    assert not any(type(p).__name__ == "VideoKVProcessor" for p in model.attn_processors.values())
    calls = []
    for m in model.modules():
        if type(m.processor if hasattr(m, "processor") else None).__module__.startswith("sparsp"):
            m.register_forward_hook(lambda *_: calls.append(one_gpu.last_choice()))
    with torch.no_grad():
        for _ in range(one_gpu.MEASURE_AT):
            got = sample_of(model(**inputs, return_dict=False))
    assert (got - want).abs().max().item() < 1e-4
    assert calls and all(c is not None for c in calls)
    assert calls[-1].dense and calls[-1].kept == 1.0  # a dense threshold: the dense kernel once measured
    sparsp.unparallelize(model)


@pytest.mark.gpu
def test_on_a_gpu_the_measured_rates_pick_per_call():
    """On a CUDA GPU, a group of one (NCCL) with the rates really measured: a sparse mask runs
    the block-sparse kernel and matches the reference (its decision agrees with its estimates),
    ``ring`` runs the fastest dense kernel and matches exact attention."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.kernels.dense import dense_kernels
    from sparsp.strategies import close_transports, one_gpu

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        n, h, d, bs = 4096, 8, 64, 128
        cfg = SparspConfig(cdf_threshold=0.9, block_size=bs)
        q, k, v = (t.cuda().to(torch.bfloat16) for t in structured_inputs(7, 1, n, h, d))
        got = {}
        for _ in range(one_gpu.MEASURE_AT + 1):
            for strategy in ("sparsp", "ring"):
                out = sp_attention(q, k, v, strategy=strategy, config=cfg)
                got[strategy] = (out, one_gpu.last_choice())
        names = {x for x, _ in dense_kernels(torch.device("cuda"))}
        out, choice = got["sparsp"]
        assert choice.sparse_ms is not None and choice.kept < 0.5
        assert choice.dense == (choice.sparse_ms >= choice.dense_ms)
        want = _exact(q, k, v) if choice.dense else reference_sp_attention(
            q.double(), k.double(), v.double(), lens=[n], config=dataclasses.replace(cfg, kernel="torch"))  # fp64: the torch kernel
        assert (out.double() - want).abs().max().item() < 3e-2
        out, choice = got["ring"]
        assert choice.dense and choice.kernel in names and choice.kept == 1.0
        assert (out.double() - _exact(q, k, v)).abs().max().item() < 3e-2
    finally:
        close_transports()
        dist.destroy_process_group()
