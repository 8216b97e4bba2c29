"""``sparsp analyze`` says which placement moves the fewest bytes for the workload it analysed.

``sparsp``'s default placement (periodic) keeps same-place-other-frame blocks local, contiguous
keeps neighbouring blocks local: which moves fewer bytes depends on the masks. Two hand-made
traces, one of each kind, must get opposite answers, in ``analysis.json`` and in the notes.
"""

from __future__ import annotations

import json

import torch

from cli_utils import run_cli
from sparsp.analysis import placement_choice
from sparsp.geometry import VideoGeometry
from sparsp.workloads.traces import save_trace

GEOM = VideoGeometry(frames=4, height=4, width=8, text_tokens=0, block_size=8, heads=2, head_dim=8)
# 16 blocks, 4 per frame; at G = 2 contiguous gives rank 0 frames 0-1, periodic gives each rank
# the same half of every frame.
BLOCKS = torch.arange(GEOM.num_blocks)
PER_FRAME = GEOM.num_blocks // GEOM.frames
MASKS = {
    "neighbours": (BLOCKS[:, None] - BLOCKS[None, :]).abs() <= 1,  # local in the sequence
    "same place": BLOCKS[:, None] % PER_FRAME == BLOCKS[None, :] % PER_FRAME,  # across frames
}


def _analyze(capsys, tmp_path, kind):
    trace = tmp_path / f"{kind}.pt"
    n = GEOM.num_blocks
    save_trace(trace, MASKS[kind].expand(1, GEOM.heads, n, n), GEOM, cdf_threshold=0.9, source=kind)
    out = tmp_path / kind
    code, text, err = run_cli(capsys, ["analyze", "--trace", trace, "--ranks", 2, "--no-plots", "--out", out])
    assert code == 0, err
    doc = json.loads((out / "analysis.json").read_text())
    return {c["strategy"]: c for c in doc["placement_choice"]}, " ".join(text.split())


def test_analyze_names_the_placement_that_moves_the_fewest_bytes(capsys, tmp_path):
    choice, text = _analyze(capsys, tmp_path, "neighbours")
    sparsp = choice["sparsp"]
    assert (sparsp["default"], sparsp["fewest_bytes"]) == ("periodic", "contiguous")
    assert sparsp["bytes_total"]["periodic"] == 7 * sparsp["bytes_total"]["contiguous"]
    assert sparsp["default_over_fewest"] == 7.0
    assert 'placement for sparsp, cdf 0.90: contiguous moves the fewest bytes' in text
    assert 'the default periodic 7.00x as many' in text and 'pass placement="contiguous"' in text
    assert choice["ring"]["fewest_bytes"] == choice["ring"]["default"]  # a tie: the default stays
    assert "ring, ring-sparse, ulysses: the same under every placement" in text

    choice, text = _analyze(capsys, tmp_path, "same place")
    assert (choice["sparsp"]["fewest_bytes"], choice["sparsp"]["bytes_total"]["periodic"]) == ("periodic", 0)
    assert choice["sparsp"]["default_over_fewest"] is None  # nothing to divide by
    assert "placement for sparsp, cdf 0.90: its default, periodic, moves the fewest bytes" in text


def test_placement_choice_needs_two_placements():
    rows = [{"cdf": 0.9, "placement": "contiguous", "strategy": "sparsp", "bytes_total": 5}]
    assert placement_choice(rows) == []
