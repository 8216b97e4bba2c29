import pytest
import torch

from sparsp.geometry import PRESETS, VideoGeometry, latent_grid, preset


@pytest.mark.parametrize(
    "name, tokens",
    [("hunyuan-video", 126_720), ("wan2.1-14b", 75_600), ("ltx-video", 18_432), ("ltx-video-161f", 24_192)],
)
def test_design_token_counts(name, tokens):
    assert preset(name).video_tokens == tokens


def test_hunyuan_has_text_and_heads():
    g = preset("hunyuan-video")
    assert (g.frames, g.height, g.width) == (33, 48, 80)
    assert g.text_tokens == 256 and g.num_tokens == 126_976
    assert (g.heads, g.head_dim, g.layers) == (24, 128, 60)


def test_preset_from_video_size():
    g = preset("wan2.1-14b", width=832, height=480, frames=81)
    assert (g.frames, g.height, g.width) == (21, 30, 52)
    assert latent_grid("ltx-video", 1536, 768, 161) == (21, 24, 48)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    g = preset(name)
    assert g.num_blocks * g.block_size >= g.num_tokens > (g.num_blocks - 1) * g.block_size
    assert g.block_lengths().sum().item() == g.num_tokens


def test_block_arithmetic_with_tail():
    g = VideoGeometry(frames=3, height=5, width=7, text_tokens=10, block_size=16)
    assert g.num_tokens == 115 and g.num_blocks == 8 and g.tail_tokens == 3
    assert g.block_lengths().tolist() == [16] * 7 + [3]
    assert g.token_coords()[-1].tolist() == [2, 4, 6]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(frames=0, height=2, width=2), "frames"),
        (dict(frames=1, height=2, width=2, block_size=0), "block_size"),
        (dict(frames=1, height=2, width=2, text_tokens=-1), "text_tokens"),
    ],
)
def test_geometry_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoGeometry(**kwargs)


def test_bad_preset_inputs():
    with pytest.raises(ValueError, match="unknown preset"):
        preset("sora")
    with pytest.raises(ValueError, match="frames"):
        preset("hunyuan-video", frames=128)
    with pytest.raises(ValueError, match="width"):
        preset("hunyuan-video", width=1000)


def test_coords_roundtrip():
    g = VideoGeometry(frames=2, height=3, width=4)
    c = g.token_coords()
    assert torch.equal(c[:, 0] * 12 + c[:, 1] * 4 + c[:, 2], torch.arange(24))
