import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsp.geometry import VideoGeometry, preset
from sparsp.placement import Placement, contiguous, make_placement, periodic

geometries = st.builds(
    VideoGeometry,
    frames=st.integers(1, 6),
    height=st.integers(1, 9),
    width=st.integers(1, 11),
    text_tokens=st.integers(0, 40),
    block_size=st.sampled_from([4, 7, 16, 32]),
)


@settings(max_examples=60, deadline=None)
@given(geom=geometries, ranks=st.integers(1, 8), kind=st.sampled_from(["contiguous", "periodic"]))
def test_placement_properties(geom, ranks, kind):
    if ranks > geom.num_blocks:
        with pytest.raises(ValueError, match="exceed"):
            make_placement(kind, geom, ranks)
        return
    p = make_placement(kind, geom, ranks)
    # every block owned exactly once, balanced to within one block
    assert p.owner.shape == (geom.num_blocks,)
    counts = torch.bincount(p.owner, minlength=ranks)
    assert counts.sum() == geom.num_blocks and counts.max() - counts.min() <= 1
    # permute ∘ unpermute = identity, for several tensor shapes and dims
    x = torch.randn(2, geom.num_tokens, 3)
    assert torch.equal(p.unpermute(p.permute(x, 1), 1), x)
    cos = torch.randn(geom.num_tokens, 5)
    assert torch.equal(p.permute(p.unpermute(cos, 0), 0), cos)
    assert sorted(p.perm.tolist()) == list(range(geom.num_tokens))
    # the placed sequence is rank-major; slices tile it; the short block ends its owner's slice
    ids = torch.arange(geom.num_tokens)
    placed = p.permute(ids, 0)
    block_of = placed // geom.block_size
    assert torch.equal(p.owner[block_of], torch.repeat_interleave(torch.arange(ranks), torch.tensor(p.tokens_per_rank)))
    assert sum(p.tokens_per_rank) == geom.num_tokens
    last = geom.num_blocks - 1
    owner_slice = placed[p.token_slice(int(p.owner[last]))]
    assert owner_slice[-1].item() == geom.num_tokens - 1


def test_contiguous_is_contiguous():
    g = preset("ltx-video")
    p = contiguous(g, 4)
    assert p.owner.tolist() == sorted(p.owner.tolist())
    assert torch.equal(p.perm, torch.arange(g.num_tokens))


def test_periodic_matches_formula_when_frames_divide():
    # 4 frames of 8 blocks, G = 4: P(t, s) = floor(G s / S_frame) for every block
    g = VideoGeometry(frames=4, height=8, width=16, block_size=16)
    p = periodic(g, 4)
    blocks_per_frame = g.frame_tokens // g.block_size
    s = torch.arange(g.num_blocks) % blocks_per_frame * g.block_size
    assert torch.equal(p.owner, (4 * s) // g.frame_tokens)


def test_periodic_gives_same_region_of_every_frame():
    g = preset("hunyuan-video")
    p = periodic(g, 8)
    owners_per_frame = p.owner[: g.video_tokens // g.block_size].reshape(g.frames, -1)
    # hunyuan's frame is 30 blocks = 3.75 per rank: rank r holds one narrow band of spatial
    # columns in every frame (the band edges alternate to balance the counts).
    for r in range(8):
        cols = torch.nonzero(owners_per_frame == r)[:, 1]
        assert cols.max() - cols.min() + 1 <= 5
        assert (owners_per_frame == r).sum(1).min() >= 3  # present in every frame
    assert p.owner[-2:].tolist() == [7, 7]


def test_placement_validation():
    g = VideoGeometry(frames=1, height=4, width=4, block_size=4)
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("random", g, 2)
    with pytest.raises(ValueError, match="ranks"):
        contiguous(g, 0)
    with pytest.raises(ValueError, match="one entry per block"):
        Placement(g, 2, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        contiguous(g, 2).permute(torch.zeros(1, 5))
