"""sparsp.parallelize on tiny random Diffusers transformers (CPU, gloo, 2-3 processes).

Each distributed case builds the same tiny model on every rank (same seed), runs it
unparallelized, then parallelized with every strategy: at cdf_threshold=1.0 it must equal the
unparallelized model (fp32, max abs error <= 1e-4); at cdf 0.9 it must equal the
single-process sparse processor (``emulate_ranks=G``) of the same placement, and differ from
the dense model (the masks are really sparse); ``unparallelize`` must restore the original
processor objects and the original output.
"""

import pytest
import torch

from dist_utils import run_distributed

pytest.importorskip("diffusers")

STRATEGIES = ("ring", "ring-sparse", "ring-relay", "ulysses", "sparsp")
TOL = 1e-4
BLOCK = 8
# kind -> latent (frames, height, width) before patchify; text tokens (valid of them)
SHAPES = {
    "hunyuan-video": ((3, 8, 8), 6, 4),  # 3x4x4 video tokens + 4 valid text tokens
    "wan": ((3, 8, 8), 6, 6),  # 3x4x4 tokens
    "ltx-video": ((3, 4, 4), 6, 5),
    "ltx-2": ((3, 4, 4), 6, 5),
}


def _setup(kind, seed=0, latent=None):
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    shape, text, valid = SHAPES[kind]
    model = build_transformer(kind, config=TINY[kind], seed=seed)
    latent = latent or shape
    batch = 2 if kind == "ltx-2" else 1
    inputs = dummy_inputs(model, latent, text_tokens=text, valid_text=valid, seed=seed + 1, batch=batch)
    if kind == "ltx-2":  # one timestep per video token (B, S), as LTX-2's pipelines pass it
        g = torch.Generator().manual_seed(seed + 2)
        inputs["timestep"] = 1000 * torch.rand(batch, latent[0] * latent[1] * latent[2], generator=g)
    return model, inputs


def _run(model, inputs):
    """All outputs of one forward call (video, and LTX-2's audio) as a tuple."""
    with torch.no_grad():
        out = model(**inputs, return_dict=False)
    return tuple(o for o in out if isinstance(o, torch.Tensor))


def _err(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _processors(model):
    return {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}


def _check_model(rank, world, kind, strategies):
    import sparsp
    from sparsp import SparspConfig

    model, inputs = _setup(kind)
    original = _processors(model)
    ref = _run(model, inputs)
    errors = {}
    for strategy in strategies:
        if strategy == "ulysses" and model.config.num_attention_heads % world:
            continue
        dense = SparspConfig(cdf_threshold=1.0, block_size=BLOCK)
        sparsp.parallelize(model, config=dense, strategy=strategy)
        out = _run(model, inputs)
        sparsp.unparallelize(model)
        errors[(strategy, "dense")] = _err(out, ref)

        sparse = SparspConfig(cdf_threshold=0.9, block_size=BLOCK)
        sparsp.parallelize(model, config=sparse, strategy=strategy)
        out = _run(model, inputs)
        sparsp.unparallelize(model)
        sparsp.parallelize(model, config=sparse, strategy=strategy, emulate_ranks=world)
        sim = _run(model, inputs)
        sparsp.unparallelize(model)
        errors[(strategy, "vs single-process sparse")] = _err(out, sim)
        if strategy != "ring":  # a dense baseline ignores the thresholds
            assert _err(sim, ref) > 1e-3, f"{kind} {strategy}: the cdf 0.9 masks are not sparse at all"
    assert _processors(model) == original, "unparallelize did not restore the original processors"
    assert _err(_run(model, inputs), ref) == 0.0
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"rank {rank}, {kind}: max abs error above {TOL}: {bad}"
    return errors


def _models_worker(rank, world, kinds, strategies):
    return {kind: _check_model(rank, world, kind, strategies) for kind in kinds}


def test_two_ranks_every_model_and_strategy():
    """All four models, every strategy, 2 processes (one spawn: process start-up dominates)."""
    errors = run_distributed(_models_worker, 2, list(SHAPES), STRATEGIES, timeout=300)
    for kind in SHAPES:
        assert len(errors[0][kind]) == 2 * len(STRATEGIES), kind


def _three_ranks_worker(rank, world):
    """3 processes: two models (2 heads, so no ulysses), then bad use that needs a group — a
    sequence the group cannot split raises the same ValueError on every rank before any
    collective (the group stays usable: the next, valid call runs), and ulysses with heads not
    divisible by G raises in parallelize."""
    import sparsp
    from sparsp import SparspConfig

    errors = {kind: _check_model(rank, world, kind, ("ring", "ring-relay", "sparsp"))
              for kind in ("hunyuan-video", "ltx-2")}
    model, inputs = _setup("wan")
    with pytest.raises(ValueError, match="ulysses needs heads divisible by the group size: .* 2 heads, G=3"):
        sparsp.parallelize(model, strategy="ulysses")
    assert not hasattr(model, "_sparsp_runtime")
    sparsp.parallelize(model, config=SparspConfig(block_size=32), strategy="sparsp")  # 48 tokens: 2 blocks
    with pytest.raises(ValueError, match="cannot split .* over 3 ranks"):
        _run(model, inputs)
    sparsp.unparallelize(model)
    sparsp.parallelize(model, config=SparspConfig(block_size=BLOCK), strategy="sparsp")
    _run(model, inputs)
    return errors


def test_three_ranks_and_bad_use_in_a_group():
    run_distributed(_three_ranks_worker, 3, timeout=300)


def _geometries_worker(rank, world):
    """Two video sizes through one parallelized model (LTX-2's two stages), eager; then a
    parallelized Wan compiled (graph breaks around sparsp) with two sizes, equal to eager."""
    import sparsp
    from sparsp import SparspConfig
    from sparsp.integrations.diffusers import runtime_of

    errs = []
    for kind, size2, compile_ in (("ltx-2", (5, 4, 6), False), ("wan", (5, 8, 10), True)):
        model, inputs = _setup(kind)
        _, inputs2 = _setup(kind, latent=size2)
        refs = [_run(model, x) for x in (inputs, inputs2)]
        sparsp.parallelize(model, config=SparspConfig(cdf_threshold=1.0, block_size=BLOCK), strategy="sparsp")
        eager = [_run(model, x) for x in (inputs, inputs2, inputs)]
        errs += [_err(e, r) for e, r in zip(eager, refs + refs[:1])]
        assert len(runtime_of(model).layouts) == 2  # one placement per geometry, reused
        if compile_:
            from torch._dynamo.utils import counters

            model.compile(backend="aot_eager")
            compiled = [_run(model, x) for x in (inputs, inputs2, inputs)]
            assert counters["stats"]["unique_graphs"] > 0  # dynamo did compile the model's code
            errs += [_err(c, e) for c, e in zip(compiled, eager)]
    assert max(errs) <= TOL, errs
    return errs


def test_two_geometries_and_compiled():
    run_distributed(_geometries_worker, 2, timeout=300)


def test_bad_use_raises_value_error_without_a_group():
    import sparsp
    from sparsp import SparspConfig

    with pytest.raises(ValueError, match="does not support Linear; supported: HunyuanVideoTransformer3DModel"):
        sparsp.parallelize(torch.nn.Linear(2, 2))
    model, inputs = _setup("ltx-2")
    original = _processors(model)
    with pytest.raises(ValueError, match="strategy='allgather' is not one of"):
        sparsp.parallelize(model, strategy="allgather")
    with pytest.raises(ValueError, match="placement='random' is not one of auto, contiguous, periodic"):
        sparsp.parallelize(model, placement="random")
    with pytest.raises(ValueError, match="ulysses needs heads divisible .* G=3"):
        sparsp.parallelize(model, strategy="ulysses", emulate_ranks=3)
    with pytest.raises(ValueError, match="emulate_ranks must be a positive int, got 0"):
        sparsp.parallelize(model, emulate_ranks=0)
    with pytest.raises(ValueError, match="config must be a sparsp.SparspConfig"):
        sparsp.parallelize(model, config={"cdf_threshold": 0.9})
    assert _processors(model) == original  # nothing was touched
    sparsp.parallelize(model, config=SparspConfig(block_size=BLOCK), emulate_ranks=2)
    with pytest.raises(ValueError, match="already parallelized"):
        sparsp.parallelize(model)
    with pytest.raises(ValueError, match="video_self_attention_mask is not supported"):
        _run(model, {**inputs, "video_self_attention_mask": torch.ones(2, 48, 48)})
    with pytest.raises(ValueError, match="cannot split .* over 2 ranks"):  # one block of 64
        sparsp.unparallelize(model)
        sparsp.parallelize(model, config=SparspConfig(block_size=64), emulate_ranks=2)
        _run(model, inputs)
    sparsp.unparallelize(model)
    with pytest.raises(ValueError, match="is not parallelized"):
        sparsp.unparallelize(model)
    hunyuan, hin = _setup("hunyuan-video")
    sparsp.parallelize(hunyuan, config=SparspConfig(block_size=BLOCK))
    mask = hin["encoder_attention_mask"].repeat(2, 1)
    mask[1, 0] = 0
    batch2 = {k: (v.repeat(2, *[1] * (v.dim() - 1)) if isinstance(v, torch.Tensor) else v) for k, v in hin.items()}
    with pytest.raises(ValueError, match="same number .* of valid text tokens in every sample, got \\[4, 3\\]"):
        _run(hunyuan, {**batch2, "encoder_attention_mask": mask})


def test_single_process_sparse_reproduces_the_group_masks():
    """emulate_ranks=G computes exactly the masks of G ranks: the split-form mask, per-slice
    blocks; with G=1 and the contiguous placement that is ``block_mask`` of the whole sequence."""
    from sparsp import SparspConfig
    from sparsp.integrations.reference import reference_sp_attention, split_block_mask
    from sparsp.masks import block_mask

    g = torch.Generator().manual_seed(3)
    B, S, H, D = 1, 53, 2, 8
    c = torch.randn(1, 1, H, D, generator=g)
    q = 2 * c + torch.randn(B, S, H, D, generator=g)
    k = 2 * c + torch.randn(B, S, H, D, generator=g) + torch.linspace(-2, 2, S).view(1, S, 1, 1)
    v = torch.randn(B, S, H, D, generator=g)
    cfg = SparspConfig(cdf_threshold=0.8, block_size=8)
    whole = block_mask(q, k, cdf_threshold=0.8, block_q=8, block_k=8)
    assert torch.equal(split_block_mask(q, k, [S], cfg), whole)
    assert torch.equal(split_block_mask(q, k, [24, 29], cfg), whole)  # slices of whole blocks
    out, mask = reference_sp_attention(q, k, v, lens=[24, 29], config=cfg, return_mask=True)
    tok = torch.arange(S) // 8
    allowed = mask[:, :, tok][:, :, :, tok]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / D ** 0.5
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), v.double())
    assert (out.double() - want).abs().max().item() < 1e-5
    assert 0.2 < mask.float().mean().item() < 1.0


def test_trace_records_real_masks_for_analyze(tmp_path):
    """sparsp trace writes a mask trace of the model's own attention that analyze --trace reads;
    its masks are block_mask of the model's rotated q/k (checked on the first layer)."""
    from sparsp.cli import main
    from sparsp.integrations.trace import record_trace

    try:
        from sparsp.workloads.traces import load_trace
    except ImportError:
        from sparsp.workloads import load_trace

    path = tmp_path / "trace.pt"
    assert main(["trace", "--model", "hunyuan-video", "--tiny", "--device", "cpu", "--block-size", "8",
                 "--cdf", "0.85", "--out", str(path)]) == 0
    trace = load_trace(path)
    g = trace.geometry
    assert (g.frames, g.height, g.width, g.text_tokens, g.heads, g.block_size) == (3, 4, 4, 8, 2, 8)
    assert tuple(trace.masks.shape) == (2, 2, 7, 7) and trace.cdf_threshold == 0.85
    assert 0.0 < trace.masks.float().mean().item() < 1.0
    assert main(["analyze", "--trace", str(path), "--ranks", "2", "--out", str(tmp_path / "an"), "--no-plots"]) == 0
    assert (tmp_path / "an" / "analysis.json").exists()

    # The first layer's mask is block_mask of the q/k the original processor computes.
    from sparsp.masks import block_mask

    model, inputs = _setup("wan")
    seen = {}
    attn = model.blocks[0].attn1
    orig = attn.processor

    def spy(a, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = a.norm_q(a.to_q(hidden_states)).unflatten(2, (a.heads, -1))
        k = a.norm_k(a.to_k(hidden_states)).unflatten(2, (a.heads, -1))
        from sparsp.integrations.processors import _rotate_pairs

        seen["q"], seen["k"] = _rotate_pairs(q, *rotary_emb), _rotate_pairs(k, *rotary_emb)
        return orig(a, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    attn.set_processor(spy)
    _run(model, inputs)
    attn.set_processor(orig)
    record_trace(model, inputs, tmp_path / "wan.pt", cdf_threshold=0.8, block_size=BLOCK, dense_attention=True)
    want = block_mask(seen["q"], seen["k"], cdf_threshold=0.8, block_q=BLOCK, block_k=BLOCK)[0]
    assert torch.equal(load_trace(tmp_path / "wan.pt").masks[0], want)
    assert _processors(model)["blocks.0.attn1"] is orig
