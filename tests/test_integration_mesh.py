"""``sparsp.parallelize`` on a device mesh and CFG parallel (CPU, gloo; 4 and 8 processes).

One 4-rank process group runs every case of ``_worker`` and one 8-rank group those of
``_halves_worker``; the tests read their results. The four tiny models at ulysses 2 × sp 2
equal ``parallelize(emulate_ranks=2)`` at cdf 0.9 and the unparallelized model at cdf 1.0
(fp32, within ``TOL``); ulysses 4 on a tiny Wan of 4 heads; bf16 on Wan within ``BF16_TOL``;
``mesh="auto"``; a bad mesh refused before any communication. CFG parallel on the four tiny
pipelines (cfg 2 × ulysses 2, 2 steps) equals the sequential pipeline (``emulate_ranks=1``,
the same masks), each rank computing one half of each step's branches; a one-branch step runs
whole with one warning; a bare transformer splits an even batch and refuses an odd one; a
placeholder left unfilled is a ``RuntimeError``; ``unparallelize(pipe)`` restores the class
and the processors. Eight ranks: Wan's pipeline at cfg 2 × ulysses 2 × sp 2 (all four under
``pytest -m slow``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import count_collectives, run_distributed

pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

TOL = 1e-5
BF16_TOL = 6e-2  # a bf16 model's output (O(1)) against its emulated run: the attention's sums in another order
BLOCK = 8
KINDS = ("wan", "ltx-video", "ltx-2", "hunyuan-video")
# the forwards of one step of each tiny pipeline, sequentially (branch, batch) — those with CFG on
STEP = {"wan": [("cond", 1), ("uncond", 1)], "wan2.2": [("cond", 1), ("uncond", 1)], "ltx-video": [("cond_uncond", 2)],
        "ltx-2": [("cond_uncond", 2), ("uncond_stg", 1), ("uncond_modality", 1)],
        "hunyuan-video": [("cond", 1), ("uncond", 1)]}


def _config(cdf=0.9):
    from sparsp import SparspConfig

    return SparspConfig(cdf_threshold=cdf, block_size=BLOCK)


def _processors(model):
    return {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}


def _models():
    """The four models at ulysses 2 × sp 2: (error against emulate_ranks=2 at 0.9, error against
    the unparallelized model at 1.0, error of the emulated run against it: the masks are sparse)."""
    import sparsp
    from test_integration_diffusers import _err, _run, _setup

    mesh, out = sparsp.make_mesh(ulysses=2), {}
    for kind in KINDS:
        model, inputs = _setup(kind)
        ref, runs = _run(model, inputs), {}
        for name, kw in (("mesh", dict(mesh=mesh)), ("emulated", dict(emulate_ranks=2)),
                         ("dense", dict(mesh=mesh, config=_config(1.0)))):
            sparsp.parallelize(model, **{"config": _config(), **kw})
            runs[name] = _run(model, inputs)
            sparsp.unparallelize(model)
        out[kind] = (_err(runs["mesh"], runs["emulated"]), _err(runs["dense"], ref), _err(runs["emulated"], ref))
    return out


def _four_heads():
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    model = build_transformer("wan", config={**TINY["wan"], "num_attention_heads": 4})
    return model, dummy_inputs(model, (3, 8, 8), text_tokens=6, seed=1)


def _ulysses_4_and_bf16():
    """Ulysses 4 × sp 1 on a Wan of 4 heads (against emulate_ranks=1 and the model), and Wan in
    bf16 at ulysses 2 × sp 2 against emulate_ranks=2 in bf16."""
    import sparsp
    from test_integration_diffusers import _err, _run

    model, inputs = _four_heads()
    ref, got = _run(model, inputs), {}
    for name, kw in (("mesh", dict(mesh=sparsp.make_mesh(ulysses=4))), ("emulated", dict(emulate_ranks=1)),
                     ("dense", dict(mesh=sparsp.make_mesh(ulysses=4), config=_config(1.0)))):
        sparsp.parallelize(model, **{"config": _config(), **kw})
        got[name] = _run(model, inputs)
        sparsp.unparallelize(model)
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    model = build_transformer("wan", config=TINY["wan"], dtype=torch.bfloat16)
    inputs = dummy_inputs(model, (3, 8, 8), text_tokens=6, seed=1)
    bf16 = {}
    for name, kw in (("mesh", dict(mesh=sparsp.make_mesh(ulysses=2))), ("emulated", dict(emulate_ranks=2))):
        sparsp.parallelize(model, config=_config(), **kw)
        bf16[name] = _run(model, inputs)
        sparsp.unparallelize(model)
    return {"ulysses 4": _err(got["mesh"], got["emulated"]), "ulysses 4 dense": _err(got["dense"], ref),
            "bf16": _err(bf16["mesh"], bf16["emulated"]), "bf16 dtype": str(bf16["mesh"][0].dtype)}


def _auto(rank):
    """mesh='auto' for a tiny geometry: the mesh best_mesh prices fastest, logged, and its run
    equal to emulate_ranks=<its sp>."""
    import sparsp
    from sparsp.cost.mesh_step import best_mesh
    from sparsp.geometry import VideoGeometry
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.strategies.auto import profile_for
    from sparsp.strategies.registry import strategy_spec
    from test_integration_diffusers import _err, _run, _setup

    geom = VideoGeometry(frames=3, height=4, width=4, block_size=BLOCK, heads=2, head_dim=12, layers=2, name="tiny")
    want, _ = best_mesh(geom, 4, profile_for("ipc", 4), strategy=strategy_spec("sparsp"), branches=1,
                        baseline=strategy_spec("ring"))
    lines = _Lines()
    model, inputs = _setup("wan")
    sparsp.parallelize(model, mesh="auto", geometry=geom, config=_config())
    rt = runtime_of(model)
    got = (rt.where.cfg, rt.where.ulysses, rt.where.sp)
    out = _run(model, inputs)
    sparsp.unparallelize(model)
    sparsp.parallelize(model, config=_config(), emulate_ranks=got[2])
    err = _err(out, _run(model, inputs))
    sparsp.unparallelize(model)
    lines.stop()
    return {"want": (want.mesh.cfg, want.mesh.ulysses, want.mesh.sp), "got": got, "err": err,
            "logged": [m for m in lines.messages if "mesh='auto'" in m]}


class _Lines(logging.Handler):
    """The ``sparsp`` logger's messages at INFO and above, while attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages, self.warnings = [], []
        self.logger = logging.getLogger("sparsp")
        self.level_was = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record):
        (self.warnings if record.levelno >= logging.WARNING else self.messages).append(record.getMessage())

    def stop(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_was)


def _refusals():
    """Each bad mesh's one-line message, the collectives parallelize issued before it, and
    whether the model was left untouched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import sparsp
    from test_integration_diffusers import _run, _setup

    model, inputs = _setup("wan")
    original = _processors(model)
    four, two = sparsp.make_mesh(ulysses=4), sparsp.make_mesh(ulysses=2)
    user, halves = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses")), sparsp.make_mesh(cfg=2)
    cfg4 = sparsp.make_mesh(cfg=4)
    cases = [lambda: sparsp.parallelize(model, mesh=four),
             lambda: sparsp.parallelize(model, mesh=two, group=dist.group.WORLD),
             lambda: sparsp.parallelize(model, mesh=two, emulate_ranks=2),
             lambda: sparsp.parallelize(model, mesh=user),
             lambda: sparsp.parallelize(model, dims={"sp": "sp"}),
             lambda: sparsp.parallelize(model, mesh="auto"),
             lambda: sparsp.parallelize(model, mesh=two, geometry="wan2.1-14b"),
             lambda: sparsp.parallelize(model, mesh=two, strategy="ulysses"),
             lambda: sparsp.parallelize(model, mesh=cfg4)]
    got = []
    counted = count_collectives()
    for case in cases:
        before = counted["n"]
        try:
            case()
            got.append(("no error", 0, False))
        except ValueError as e:
            got.append((str(e), counted["n"] - before, _processors(model) == original
                        and not hasattr(model, "_sparsp_runtime")))
    counted["undo"]()
    # a bare transformer with cfg 2: an odd batch is one line before any collective
    sparsp.parallelize(model, mesh=halves, config=_config())
    counted = count_collectives()
    try:
        _run(model, inputs)
        got.append(("no error", 0, True))
    except ValueError as e:
        got.append((str(e), counted["n"], True))
    counted["undo"]()
    sparsp.unparallelize(model)
    return got


def _bare_batch(rank):
    """A bare transformer with cfg 2 × ulysses 2 and a batch of 2 (each half one sample)
    against the emulated model, and the collectives of a pair left unfilled."""
    import sparsp
    from sparsp.integrations import cfg
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.integrations.plans import Pair
    from test_integration_diffusers import _err, _run, _setup

    model, inputs = _setup("ltx-2")  # its inputs have a batch of 2, one timestep per token
    mesh = sparsp.make_mesh(cfg=2, ulysses=2)
    sparsp.parallelize(model, mesh=mesh, config=_config())
    got = _run(model, inputs)
    sparsp.unparallelize(model)
    sparsp.parallelize(model, config=_config(), emulate_ranks=1)
    want = _run(model, inputs)
    sparsp.unparallelize(model)
    # the pipeline's rule pairs cond with uncond, but a second cond comes: never a placeholder's NaN
    wan, wan_in = _setup("wan")
    sparsp.parallelize(wan, mesh=mesh, config=_config())
    halves = runtime_of(wan).halves
    messages = []
    halves.start(cfg.Run("WanPipeline", {"cond": Pair("cond", "uncond")}))
    with torch.no_grad(), wan.cache_context("cond"):
        first = wan(**wan_in, return_dict=False)[0]
    try:
        with torch.no_grad(), wan.cache_context("cond"):
            wan(**wan_in)
    except RuntimeError as e:
        messages.append(str(e))
    halves.start(cfg.Run("WanPipeline", {"cond": Pair("cond", "uncond")}))
    with torch.no_grad(), wan.cache_context("cond"):
        wan(**wan_in)
    messages.append(halves.end(failed=False))
    sparsp.unparallelize(wan)
    return {"err": _err(got, want), "messages": messages, "nan": bool(first.isnan().any())}


def _pipeline(kind):
    """A tiny pipeline of ``kind``; ``wan2.2``: Wan's with a second expert (its own weights) for
    the low-noise steps, as Wan 2.2 has (``boundary_ratio``: the first of 2 steps on the first
    expert, the second on the other)."""
    from _recipe import in_eval
    from _tiny import WIDER, build_pipeline
    from diffusers import WanPipeline

    from sparsp.integrations.models import TINY, build_transformer

    pipe = build_pipeline("wan" if kind == "wan2.2" else kind)
    if kind == "wan2.2":
        second = build_transformer("wan", config={**TINY["wan"], **WIDER["wan"]}, seed=1)
        pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                           scheduler=pipe.scheduler, transformer=pipe.transformer, transformer_2=second,
                           boundary_ratio=0.9)
    pipe.set_progress_bar_config(disable=True)
    return in_eval(pipe)


def _spy(models) -> list:
    """(model, step, branch, batch) of layer 0's attention of every forward the ``models``
    compute (model: its index in ``models``)."""
    from sparsp.integrations.diffusers import runtime_of

    seen = []
    for i, model in enumerate(models):
        rt = runtime_of(model)
        attention = rt._attention

        def spy(q, k, v, lay, layer=None, rt=rt, attention=attention, i=i):
            if layer == 0:
                seen.append((i, rt.step, rt.branch, q.shape[0]))
            return attention(q, k, v, lay, layer)

        rt._attention = spy
    return seen


def _pipelines(rank, kinds, mesh_sizes, emulate):
    """Each tiny pipeline, 2 steps with CFG on, on a mesh (``mesh_sizes``: make_mesh's) against
    the same pipeline emulated in one process (``emulate`` ranks: the same masks): the error,
    the (step, branch, batch) of the forwards this rank computed (layer 0's attention), and
    whether unparallelize gave the class and processors back."""
    import sparsp
    from _tiny import SIZES
    from test_diffusers_schedule import _hunyuan_prompts

    mesh, out = sparsp.make_mesh(**mesh_sizes), {}
    for kind in kinds:
        pipe = _pipeline(kind)
        models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
        cls, original = type(pipe), [_processors(m) for m in models]
        height, width, frames = SIZES["wan" if kind == "wan2.2" else kind]

        def call(**kw):
            args = dict(height=height, width=width, num_frames=frames, output_type="latent", num_inference_steps=2,
                        generator=torch.Generator().manual_seed(0))
            args.update(_hunyuan_prompts(pipe) if kind == "hunyuan-video" else dict(prompt="a cat",
                                                                                       max_sequence_length=16))
            with torch.no_grad():
                return pipe(**{**args, **kw}).frames

        sparsp.parallelize(pipe, config=_config(), emulate_ranks=emulate)
        want = call()
        sparsp.unparallelize(pipe)
        sparsp.parallelize(pipe, mesh=mesh, config=_config())
        wrapped = type(pipe) is not cls
        seen = _spy(models)
        got = call()
        res = {"err": (got - want).abs().max().item(), "seen": list(seen)}
        if kind == "wan":  # one branch (guidance 1): whole on both halves, one warning for the run
            lines = _Lines()
            one = call(guidance_scale=1.0)
            lines.stop()
            sparsp.unparallelize(pipe)
            sparsp.parallelize(pipe, config=_config(), emulate_ranks=emulate)
            res["one branch"] = ((one - call(guidance_scale=1.0)).abs().max().item(), lines.warnings)
        sparsp.unparallelize(pipe)
        res["restored"] = wrapped and type(pipe) is cls and [_processors(m) for m in models] == original
        out[kind] = res
    return out


def _worker(rank, world):
    from sparsp import close_transports

    results = {"models": _models(), "others": _ulysses_4_and_bf16(), "auto": _auto(rank),
               "refusals": _refusals(), "bare": _bare_batch(rank),
               "pipelines": _pipelines(rank, (*KINDS, "wan2.2"), dict(cfg=2, ulysses=2), 1)}
    close_transports()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 4, timeout=600)


def test_four_models_at_ulysses_2_sp_2_equal_the_emulated_and_the_dense_model(ranks):
    for rank, res in enumerate(ranks):
        for kind, (mesh, dense, sparse) in res["models"].items():
            assert mesh <= TOL and dense <= TOL, (rank, kind, mesh, dense)
            assert sparse > 1e-3, f"{kind}: the cdf 0.9 masks are not sparse"


def test_ulysses_4_and_bf16(ranks):
    for rank, res in enumerate(ranks):
        got = res["others"]
        assert got["ulysses 4"] <= TOL and got["ulysses 4 dense"] <= TOL, (rank, got)
        assert got["bf16 dtype"] == "torch.bfloat16" and got["bf16"] <= BF16_TOL, (rank, got)


def test_mesh_auto_picks_the_best_mesh_and_logs_it(ranks):
    for rank, res in enumerate(ranks):
        got = res["auto"]
        assert got["got"] == got["want"], got
        assert got["err"] <= TOL, got
        assert len(got["logged"]) == 1 and f"ulysses {got['want'][1]} x sp {got['want'][2]}" in got["logged"][0], got


def test_a_bad_mesh_is_one_line_before_any_communication(ranks):
    starts = ["WanTransformer3DModel has 2 heads, which do not divide over ulysses=4",
              "pass group= or mesh=, not both",
              "emulate_ranks runs in one process: pass neither group= nor mesh= with it",
              "the mesh dimension 'ring' (size 2) is not mapped",
              "dims= names the dimensions of a mesh: pass mesh= with it",
              "mesh='auto' picks the mesh from the token count: pass geometry=",
              "geometry= is what mesh='auto' picks a mesh for",
              "ulysses needs heads divisible by the group size: WanTransformer3DModel has 2 heads (1 per Ulysses "
              "rank), G=2",
              "cfg=4 (the mesh dimension 'cfg'): CFG parallel spreads a step's branches over 2 halves",
              "sparsp: WanTransformer3DModel on a mesh with cfg=2 splits the batch of a forward over the two halves; "
              "this forward's batch is 1"]
    got = ranks[0]["refusals"]
    assert len(got) == len(starts)
    for (message, issued, untouched), start in zip(got, starts):
        assert message.startswith(start), (message, start)
        assert "\n" not in message and issued == 0 and untouched, (message, issued, untouched)


def test_a_bare_transformer_splits_an_even_batch_and_a_pair_is_never_left_unfilled(ranks):
    for rank, res in enumerate(ranks):
        got = res["bare"]
        assert got["err"] <= TOL, (rank, got["err"])
        assert got["nan"] == (rank >= 2), "half 1 returned the placeholder of cond, NaN until the exchange"
        waiting, ended = got["messages"]
        assert waiting.startswith("sparsp: WanPipeline: its 'cond' forward waits for its 'uncond' forward, but a "
                                  "'cond' forward came"), waiting
        assert ended.startswith("sparsp: WanPipeline: its 'cond' forward waits for its 'uncond' forward, but the "
                                "pipeline's call returned without it"), ended


def _check_pipelines(results, halves_of):
    for rank, res in enumerate(results):
        half = halves_of(rank)
        for kind, got in res["pipelines"].items():
            assert got["err"] <= TOL, (rank, kind, got["err"])
            assert got["restored"], (rank, kind)
            mine = []  # one half of each step's branches: a batch split in two, a pair's forwards one each
            for step in range(2):
                pairs = [b for b, n in STEP[kind] if n == 1]
                mine += [(step, b, n // 2) for b, n in STEP[kind] if n == 2]
                mine += [(step, b, 1) for b in pairs[half::2]]
            assert sorted(x[1:] for x in got["seen"]) == sorted(mine), (rank, kind, got["seen"])
            assert {x[0] for x in got["seen"]} == ({0, 1} if kind == "wan2.2" else {0}), got["seen"]  # both experts
        if "wan" in res["pipelines"]:
            err, warnings = res["pipelines"]["wan"]["one branch"]
            assert err <= TOL and len(warnings) == 1 and "the 'cond' forward has one branch" in warnings[0], warnings


def test_cfg_parallel_pipelines_equal_the_sequential_pipeline(ranks):
    """cfg 2 × ulysses 2 on 4 ranks: ranks 0-1 are half 0, ranks 2-3 half 1."""
    _check_pipelines(ranks, lambda rank: rank // 2)


def test_the_pipelines_rules_read_their_calls():
    """``plans.PIPELINES`` on each pipeline's own defaults, and on the arguments that change its
    step: which forwards pair (and how), and the branches a step makes (``mesh="auto"``)."""
    import inspect

    import diffusers

    from sparsp.integrations.plans import PIPELINES

    def rule(name, **given):
        args = {n: p.default for n, p in inspect.signature(getattr(diffusers, name).__call__).parameters.items()}
        args.update(given)
        r = PIPELINES[name]
        return [(p.first, p.second, p.ahead is not None) for p in r.pairs(args)], r.branches(args)

    assert rule("WanPipeline") == ([("cond", "uncond", False)], 2)
    assert rule("WanPipeline", guidance_scale=1.0) == ([], 1)
    assert rule("LTXPipeline") == ([], 2) and rule("LTXPipeline", guidance_scale=1.0) == ([], 1)
    assert rule("LTX2Pipeline") == ([("uncond_stg", "uncond_modality", True)], 4)
    assert rule("LTX2Pipeline", stg_scale=0.0, audio_stg_scale=0.0) == ([], 3)
    assert rule("HunyuanVideoPipeline") == ([], 1)
    assert rule("HunyuanVideoPipeline", true_cfg_scale=2.0, negative_prompt="blur") == ([("cond", "uncond", False)], 2)
    assert PIPELINES["WanPipeline"].transformers == ("transformer", "transformer_2")


def _halves_worker(rank, world, kinds):
    from sparsp import close_transports

    out = {"pipelines": _pipelines(rank, kinds, dict(cfg=2, ulysses=2), 2)}
    close_transports()
    return out


def test_cfg_2_ulysses_2_sp_2_on_eight_ranks():
    """Wan's pipeline at cfg 2 × ulysses 2 × sp 2 against emulate_ranks=2 (the same masks)."""
    _check_pipelines(run_distributed(_halves_worker, 8, ("wan",), timeout=600), lambda rank: rank // 4)


@pytest.mark.slow
def test_every_pipeline_on_eight_ranks(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("eight processes, four pipelines: pytest -m slow tests/test_integration_mesh.py")
    _check_pipelines(run_distributed(_halves_worker, 8, KINDS, timeout=900), lambda rank: rank // 4)
