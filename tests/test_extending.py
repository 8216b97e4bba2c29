"""docs/extending.md's strategy example, run as the document shows it: the code block is executed
unchanged as the module ``sparsp.strategies.local_only`` (its relative imports resolve there), on
one process and on two gloo ranks."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
NAME = "local-only"


def _example() -> str:
    """The python block of the "A strategy" section (the one that registers a strategy)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    found = [b for b in blocks if "register_strategy" in b]
    assert len(found) == 1, f"expected one strategy example in {DOC.name}, found {len(found)}"
    return found[0]


def _load() -> types.ModuleType:
    """Execute the example as ``sparsp.strategies.local_only`` (once per process)."""
    import sparsp.strategies  # noqa: F401  (the package its relative imports name)

    name = "sparsp.strategies.local_only"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__package__ = "sparsp.strategies"
    module.__file__ = str(DOC)
    sys.modules[name] = module
    exec(compile(_example(), f"{DOC.name} (strategy example)", "exec"), module.__dict__)  # noqa: S102
    return module


@pytest.fixture(autouse=True, scope="module")
def _unregistered_after():
    """The example's registration stays in this module: the other tests list every strategy."""
    yield
    from sparsp.strategies import registry

    registry._REGISTRY.pop(NAME, None)
    sys.modules.pop("sparsp.strategies.local_only", None)


def test_the_example_registers_with_the_documented_keywords_only():
    from sparsp.placement import make_placement
    from sparsp.geometry import VideoGeometry
    from sparsp.strategies import comm_bytes, strategy_names, strategy_spec

    _load()
    assert NAME in strategy_names()
    spec = strategy_spec(NAME)
    assert spec.sparse and spec.placement == "contiguous" and not spec.local_first
    # every keyword past the documented ones keeps its default
    assert not (spec.baseline or spec.primary or spec.copy_engine) and spec.ablation == () and spec.color is None
    geom = VideoGeometry(frames=2, height=4, width=8, text_tokens=0, block_size=16, heads=2, head_dim=8)
    pl = make_placement("contiguous", geom, 2)
    masks = torch.ones(geom.heads, geom.num_blocks, geom.num_blocks, dtype=torch.bool)
    got = comm_bytes(masks, pl, NAME, head_dim=geom.head_dim)
    assert got["total"] == 0 and list(got["per_rank"]) == [0, 0]


def test_the_example_is_simulated_by_nothing_but_its_registration():
    """The tools that list strategies pick it up from the registry: the analysis accounts it, the
    benchmark plots give it a colour of its own."""
    from sparsp.analysis import AnalyzeConfig
    from sparsp.bench.report import colors, summary_names

    _load()
    assert NAME in AnalyzeConfig(model="ltx-video", ranks=2).strategies
    names = summary_names()
    assert NAME in names
    palette = colors(names)
    assert palette[NAME] not in {palette[n] for n in names if n != NAME}


def _rank(rank: int, world: int) -> list:
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import close_transports

    _load()
    torch.manual_seed(0)
    B, S, H, D, bs = 1, 32, 2, 8, 16
    q, k, v = (torch.randn(B, world * S, H, D) for _ in range(3))
    mine = slice(rank * S, (rank + 1) * S)
    n = world * S // bs
    owner = torch.arange(n) // (S // bs)
    local = (owner[:, None] == owner[None, :]).expand(B, H, n, n).contiguous()  # own blocks only
    cfg = SparspConfig(block_size=bs, transport="nccl")
    try:
        # every own block kept: the output is attention over the rank's own keys, which a mask
        # of its own blocks gives through a built-in strategy too
        out = sp_attention(q[:, mine], k[:, mine], v[:, mine], strategy=NAME, config=cfg, _global_mask=local)
        ref = sp_attention(q[:, mine], k[:, mine], v[:, mine], strategy="sparsp", config=cfg, _global_mask=local)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, mine].transpose(1, 2), k[:, mine].transpose(1, 2), v[:, mine].transpose(1, 2)).transpose(1, 2)
    finally:
        close_transports()
    return [float((out - ref).abs().max()), float((out - want).abs().max())]


def test_the_example_runs_on_two_ranks():
    """Own shard only: with every own block kept, the output is attention over the rank's own
    keys."""
    for errors in run_distributed(_rank, 2, timeout=180.0):
        assert max(errors) < 1e-4, errors
