"""The denoising schedule through ``sparsp.parallelize`` (integrations/steps.py, context.py).

The step and branch each attention call passes on, counted from the four tiny pipelines' cache
contexts (``examples/_tiny.py``, 3 steps, CFG on); the single-process path under a schedule
against the reference taken step by step; a scheduled model on 2 gloo ranks against the same
model emulated in one process; ``new_run``, ``unparallelize`` and the thresholds table's check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed

pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

BLOCK = 8
SCHEDULE = {"dense_steps": 1, "replan_every": 2}  # steps: dense, plan, reuse, plan, reuse
TOL = 1e-4


def _spy(model) -> list:
    """(step, branch, layer) of every attention call of a parallelized ``model``, as it runs."""
    from sparsp.integrations.diffusers import runtime_of

    rt, seen = runtime_of(model), []
    attention = rt._attention

    def spy(q, k, v, lay, layer=None):
        seen.append((rt.step, rt.branch, layer))
        return attention(q, k, v, lay, layer)

    rt._attention = spy
    return seen


# --- the four pipelines ---------------------------------------------------------------------

BRANCHES = {"wan": ["cond", "uncond"], "ltx-video": ["cond_uncond"],
            "ltx-2": ["cond_uncond", "uncond_stg", "uncond_modality"], "hunyuan-video": ["cond", "uncond"]}


def _hunyuan_prompts(pipe) -> dict:
    """HunyuanVideo's true CFG (``true_cfg_scale`` > 1 and a negative prompt) with a negative
    prompt of fewer valid text tokens: the uncond forwards are another geometry."""
    embeds, pooled, mask = pipe.encode_prompt(prompt="a cat", max_sequence_length=16)
    short = mask.clone()
    short[:, -5:] = 0
    return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, prompt_attention_mask=mask,
                negative_prompt_embeds=embeds, negative_pooled_prompt_embeds=pooled,
                negative_prompt_attention_mask=short, true_cfg_scale=2.0)


@pytest.mark.parametrize("kind", list(BRANCHES))
def test_pipelines_count_steps_and_branches(kind):
    """Each step's forwards under the pipeline's cache contexts: Wan's cond and uncond with its
    step index, LTX-Video's batched cond_uncond, LTX-2's three passes, HunyuanVideo's cond and
    (true CFG) uncond of another text length; the pipeline's end starts the next call at 0."""
    import sparsp
    from _recipe import in_eval
    from _tiny import SIZES, build_pipeline

    from sparsp.integrations.diffusers import runtime_of

    pipe = in_eval(build_pipeline(kind))
    sparsp.parallelize(pipe.transformer, config=sparsp.SparspConfig(block_size=BLOCK, **SCHEDULE), emulate_ranks=2)
    seen = _spy(pipe.transformer)
    height, width, frames = SIZES[kind]
    call = dict(height=height, width=width, num_frames=frames, output_type="latent",
                generator=torch.Generator().manual_seed(0))
    call.update(_hunyuan_prompts(pipe) if kind == "hunyuan-video" else dict(prompt="a cat", max_sequence_length=16))
    with torch.no_grad():
        pipe(**call, num_inference_steps=3)
        first = list(seen)
        pipe(**call, num_inference_steps=1)
    assert first == [(s, b, layer) for s in range(3) for b in BRANCHES[kind] for layer in (0, 1)]
    assert seen[len(first):] == [(0, b, layer) for b in BRANCHES[kind] for layer in (0, 1)]
    assert len(runtime_of(pipe.transformer).layouts) == (2 if kind == "hunyuan-video" else 1)


def test_step_counter_starts_runs_over():
    """Where the context gives an index it is the step, and a run starts over where it goes
    back; otherwise forwards count per branch and geometry, and a rising timestep starts a new
    run; a geometry first seen mid-run starts at 0 without resetting the others; a forward
    without a context counts per geometry under branch None."""
    from diffusers.hooks.hooks import CacheContext

    from sparsp.integrations.steps import StepCounter

    c = StepCounter()
    wan = [c.advance(CacheContext(b, step_index=i), "g") for i in (3, 4) for b in ("cond", "uncond")]
    assert wan == [(3, "cond"), (3, "uncond"), (4, "cond"), (4, "uncond")]
    c.advance(CacheContext("cond", step_index=0), "g")
    assert c.last_index == 0  # went back: a new run
    c = StepCounter()
    ltx = [c.advance(CacheContext("cond_uncond"), g, lambda t=t: t) for t, g in
           ((900.0, "a"), (700.0, "a"), (500.0, "b"), (300.0, "a"), (950.0, "a"), (800.0, "a"))]
    assert [s for s, _ in ltx] == [0, 1, 0, 2, 0, 1]
    c = StepCounter()
    assert [c.advance(None, g) for g in ("a", "a", "b", "a")] == [(0, None), (1, None), (0, None), (2, None)]


# --- the single-process path ------------------------------------------------------------------


def _setup(kind="wan", seed=0):
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    model = build_transformer(kind, config=TINY[kind], seed=seed)
    latent = (3, 8, 8) if kind == "wan" else (3, 4, 4)
    return model, dummy_inputs(model, latent, text_tokens=6, seed=seed + 1)


def _steps(model, inputs, steps: int, branches=("cond", "uncond")) -> list:
    """Outputs of ``steps`` denoising steps of ``branches`` each, as a pipeline makes them: one
    forward per branch under ``cache_context(branch, step_index=s)``, the latent moved a little
    from step to step, each branch its own text."""
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(inputs["hidden_states"].shape, generator=g)
    texts = {b: inputs["encoder_hidden_states"] + i * torch.randn(inputs["encoder_hidden_states"].shape, generator=g)
             for i, b in enumerate(branches)}
    outs = []
    for s in range(steps):
        x = {**inputs, "hidden_states": inputs["hidden_states"] + 0.05 * s * noise,
             "timestep": torch.full_like(inputs["timestep"], 900.0 - 150 * s)}
        for b in branches:
            with torch.no_grad(), model.cache_context(b, step_index=s):
                outs.append(model(**{**x, "encoder_hidden_states": texts[b]}, return_dict=False)[0])
    return outs


def test_single_process_path_follows_the_schedule():
    """emulate_ranks under a schedule: every call equals the reference taken step by step
    (dense steps every block, plan steps their own mask, reuse steps the mask of the last plan
    step of the same layer and branch), and a reuse step's own mask would have differed."""
    import sparsp
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.integrations.reference import reference_sp_attention, split_block_mask

    model, inputs = _setup()
    cfg = sparsp.SparspConfig(cdf_threshold=0.8, block_size=BLOCK, **SCHEDULE)
    sparsp.parallelize(model, config=cfg, emulate_ranks=2)
    rt, calls = runtime_of(model), []
    attention = rt._attention

    def record(q, k, v, lay, layer=None):
        out = attention(q, k, v, lay, layer)
        calls.append((rt.step, rt.branch, layer, q, k, v, list(lay.lens), out))
        return out

    rt._attention = record
    _steps(model, inputs, 5)
    kept, moved = {}, 0
    for step, branch, layer, q, k, v, lens, out in calls:
        kind = cfg.step_kind(step)
        if kind == "dense":
            want = reference_sp_attention(q, k, v, lens=lens, config=sparsp.SparspConfig(cdf_threshold=1.0,
                                                                                          block_size=BLOCK))
        elif kind == "plan":
            want, kept[(layer, branch)] = reference_sp_attention(q, k, v, lens=lens, config=cfg, return_mask=True)
        else:
            want = reference_sp_attention(q, k, v, lens=lens, config=cfg, mask=kept[(layer, branch)])
            moved += not torch.equal(split_block_mask(q, k, lens, cfg), kept[(layer, branch)])
        assert torch.equal(out, want), (step, branch, layer)
    assert [c[:3] for c in calls[:4]] == [(0, "cond", 0), (0, "cond", 1), (0, "uncond", 0), (0, "uncond", 1)]
    assert len(calls) == 5 * 2 * 2 and moved > 0
    assert len(rt.reference.masks) == 4  # one per (layer, branch)
    sparsp.unparallelize(model)
    assert not rt.reference.masks


def test_new_run_and_unparallelize():
    """Forwards without a context count steps per geometry until ``sparsp.new_run(model)``;
    ``unparallelize`` removes the context hook; ``new_run`` of a model not parallelized is one
    ValueError."""
    import sparsp
    from diffusers.hooks.hooks import HookRegistry

    from sparsp.integrations import context

    model, inputs = _setup()
    sparsp.parallelize(model, config=sparsp.SparspConfig(block_size=BLOCK, **SCHEDULE), emulate_ranks=2)
    seen = _spy(model)
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        sparsp.new_run(model)
        model(**inputs)
    assert [s for s, _, _ in seen] == [0, 0, 1, 1, 2, 2, 0, 0] and {b for _, b, _ in seen} == {None}
    assert HookRegistry.check_if_exists_or_initialize(model).get_hook(context.NAME) is not None
    sparsp.unparallelize(model)
    assert HookRegistry.check_if_exists_or_initialize(model).get_hook(context.NAME) is None
    with pytest.raises(ValueError, match="WanTransformer3DModel is not parallelized by sparsp"):
        sparsp.new_run(model)


def test_thresholds_table_is_checked_against_the_model(tmp_path):
    """A table of another model (its layers) is refused by ``parallelize`` before anything is
    attached, naming the file; the model's own table gives each layer its thresholds, also in
    the single-process path (layer 0 dense, layer 1 sparse)."""
    import sparsp
    from sparsp.thresholds import write_thresholds

    model, inputs = _setup()
    wrong, right = tmp_path / "wrong.json", tmp_path / "right.json"
    write_thresholds(wrong, layers=3, heads=2, cdf=[0.9])
    write_thresholds(right, layers=2, heads=2, cdf=[1.0, [0.3, 0.5]])
    with pytest.raises(ValueError, match=f"--thresholds {wrong}: the table is for 3 layers x 2 heads; "
                                         "WanTransformer3DModel .2 self-attention layers. has 2 layers x 2 heads"):
        sparsp.parallelize(model, config=sparsp.SparspConfig.from_thresholds(wrong, block_size=BLOCK))
    assert not hasattr(model, "_sparsp_runtime")
    sparsp.parallelize(model, config=sparsp.SparspConfig.from_thresholds(right, block_size=BLOCK), emulate_ranks=2)
    from sparsp.integrations.diffusers import runtime_of

    masks = []
    runtime_of(model).on_mask = masks.append
    with torch.no_grad():
        model(**inputs)
    assert bool(masks[0].all()) and not bool(masks[1].all())


# --- two gloo ranks -----------------------------------------------------------------------------


def _ranks_worker(rank, world, strategies):
    import sparsp
    from sparsp.strategies import schedule

    model, inputs = _setup()
    cfg = sparsp.SparspConfig(cdf_threshold=0.8, block_size=BLOCK, transport="nccl", kernel="torch", **SCHEDULE)
    errors, kept = {}, {}
    for strategy in strategies:
        sparsp.parallelize(model, config=cfg, strategy=strategy)
        ranks = _steps(model, inputs, 5)
        kept[strategy] = schedule.kept()[0]
        sparsp.unparallelize(model)
        kept[strategy] = (kept[strategy], schedule.kept()[0])
        sparsp.parallelize(model, config=cfg, strategy=strategy, emulate_ranks=world)
        emulated = _steps(model, inputs, 5)
        sparsp.unparallelize(model)
        errors[strategy] = max((a - b).abs().max().item() for a, b in zip(ranks, emulated))
    sparsp.close_transports()
    return errors, kept


def test_two_ranks_follow_the_schedule_of_the_emulated_run():
    """A scheduled model on 2 gloo ranks (dense, plan, reuse steps of two branches) equals the
    same model emulated in one process under the same schedule; ``unparallelize`` frees the
    plans it kept (one per layer and branch)."""
    for rank, (errors, kept) in enumerate(run_distributed(_ranks_worker, 2, ("sparsp", "ulysses"), timeout=300)):
        assert max(errors.values()) <= TOL, (rank, errors)
        assert kept == {"sparsp": (4, 0), "ulysses": (4, 0)}, (rank, kept)
