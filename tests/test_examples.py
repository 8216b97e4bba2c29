"""The example recipes (examples/wan.py, ltx_video.py, ltx2.py, hunyuan_video.py) end to end.

Each family's tiny random pipeline (``examples/_tiny.py``: every component built in code from a
small config, nothing downloaded) is built once per module, saved with ``save_pretrained`` and
run through its recipe as a user would: ``python -m torch.distributed.run --nproc-per-node 2``
on CPU (gloo) with ``--pretrained DIR``. The mp4 must read back (PyAV, the recipes' writer)
with the requested frame count and size (LTX-2's with its audio stream); two runs also
compare with the dense model (``EXTRA``). Bad input, ``--help``, ``--tiny`` and the
one-process mode run in this process (no torchrun).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
av = pytest.importorskip("av")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from _tiny import SIZES, build_pipeline  # noqa: E402

SCRIPTS = {"wan": "wan.py", "ltx-video": "ltx_video.py", "ltx-2": "ltx2.py", "hunyuan-video": "hunyuan_video.py"}
COMMON = ["--device", "cpu", "--dtype", "float32", "--steps", "2", "--block-size", "8", "--max-sequence-length", "16"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """kind -> a directory holding that family's tiny pipeline (built and saved once)."""
    root = tmp_path_factory.mktemp("pipelines")
    saved = {}

    def get(kind):
        if kind not in saved:
            saved[kind] = root / kind
            build_pipeline(kind).save_pretrained(saved[kind])
        return saved[kind]

    return get


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, args: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _read_mp4(path: Path):
    """(frames, height, width, stream types) of an mp4."""
    with av.open(str(path)) as box:
        frames = [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
        kinds = sorted(s.type for s in box.streams)
    return len(frames), frames[0].shape[0], frames[0].shape[1], kinds


def _quality(out: str) -> tuple[float, float]:
    m = re.search(r"PSNR (\S+) dB, SSIM (\S+)", out)
    assert m, out[-3000:]
    return float(m.group(1)), float(m.group(2))


# Two of the runs also compare with the dense model: Wan at --cdf 1.0 with --cfg 2 (each rank one
# guidance branch of every step), where sparsp's attention keeps every block and so must reproduce
# the unparallelized model (PSNR >= 60 dB over the float frames, before the mp4's 8-bit
# rounding), and LTX-Video at the default threshold, whose numbers only have to be finite
# (random weights make no meaningful picture to judge).
EXTRA = {"wan": ["--cdf", "1.0", "--compare-dense", "--cfg", "2"], "ltx-video": ["--compare-dense"]}


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_recipe_two_ranks_writes_the_video(kind, pretrained, tmp_path):
    height, width, frames = SIZES[kind]
    video = tmp_path / "out.mp4"
    extra = EXTRA.get(kind, [])
    out = _torchrun(SCRIPTS[kind], ["--pretrained", str(pretrained(kind)), "--height", str(height), "--width",
                                    str(width), "--frames", str(frames), "--out", str(video), *COMMON, *extra])
    assert re.search(r"2 ranks (\(.*\) )?on cpu", out) and re.search(r"sparsp: 2 steps, [\d.]+ ms/step", out), \
        out[-3000:]
    if "--cfg" in extra:
        assert "2 ranks (cfg 2 x ulysses 1 x sp 1) on cpu" in out, out[-3000:]
    n, h, w, streams = _read_mp4(video)
    assert (n, h, w) == (frames, height, width)
    assert streams == (["audio", "video"] if kind == "ltx-2" else ["video"])
    if "--compare-dense" in extra:
        psnr, ssim = _quality(out)
        if "1.0" in extra:
            assert psnr >= 60.0 and ssim > 0.999, (psnr, ssim)
        else:
            assert math.isfinite(psnr) and 0.0 < ssim <= 1.0, (psnr, ssim)


# --- in this process: one-process mode, --tiny, --help, bad input ------------------------------


def _recipe(script: str):
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def _run(script: str, argv: list[str]) -> int:
    from _recipe import run

    return run(_recipe(script), argv)


def test_one_process_tiny_with_emulated_ranks(tmp_path, capsys):
    video = tmp_path / "tiny.mp4"
    assert _run("ltx_video.py", ["--tiny", "--device", "cpu", "--steps", "3", "--emulate-ranks", "2",
                                 "--dense-steps", "1", "--replan-every", "2", "--out", str(video)]) == 0
    out = capsys.readouterr().out
    assert "1 process as 2 ranks" in out and "schedule dense=1,replan=2" in out
    height, width, frames = SIZES["ltx-video"]
    assert _read_mp4(video)[:3] == (frames, height, width)


@pytest.mark.parametrize("script", list(SCRIPTS.values()))
def test_help_explains_every_option(script, capsys):
    with pytest.raises(SystemExit) as e:
        _run(script, ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ("--pretrained", "--prompt", "--height", "--width", "--frames", "--steps", "--seed", "--out",
                   "--strategy", "--cdf", "--compare-dense", "--device", "--dtype", "--tiny", "--dense-steps",
                   "--replan-every", "--thresholds", "--cfg", "--ulysses"):
        assert option in text, option


def test_bad_input_is_one_line(pretrained, tmp_path, capsys):
    from sparsp.thresholds import write_thresholds

    wan = str(pretrained("wan"))
    other = tmp_path / "other.json"
    write_thresholds(other, layers=40, heads=40, cdf=[0.9])
    cases = [
        (["--pretrained", wan, "--dense-steps", "-1"], "--dense-steps must be an int >= 0, got -1"),
        (["--pretrained", wan, "--replan-every", "0"], r"--replan-every must be an int >= 1 \(1 = plan every step\)"),
        (["--pretrained", wan, "--thresholds", str(tmp_path / "none.json")], "--thresholds .*none.json"),
        (["--pretrained", wan, "--thresholds", str(other), "--height", "48", "--width", "64", "--frames", "9",
          "--block-size", "8"], "--thresholds .*other.json: the table is for 40 layers x 40 heads"),
        (["--pretrained", str(tmp_path / "missing")], "wan.py: error: --pretrained .*missing: no such directory"),
        (["--pretrained", str(tmp_path)], "no model_index.json"),
        (["--pretrained", wan], "holds a WanPipeline, not a LTXPipeline", "ltx_video.py"),
        (["--pretrained", wan, "--frames", "10"], r"--frames 10: Wan needs frames = 4k \+ 1 .*try 9"),
        (["--pretrained", wan, "--height", "50"], "--height 50 is not a multiple of 16"),
        (["--pretrained", wan, "--cdf", "1.5"], r"--cdf must be in \[0, 1\]"),
        (["--pretrained", wan, "--out", "x.avi"], "give a FILE.mp4"),
        (["--pretrained", wan, "--strategy", "allgather"], "strategy='allgather' is not one of"),
        (["--pretrained", wan, "--cfg", "3"], "--cfg must be 1 or 2"),
        (["--pretrained", wan, "--ulysses", "2"], "--cfg 1 --ulysses 2 split the ranks of torchrun; one process"),
        (["--pretrained", wan, "--emulate-ranks", "64", "--height", "48", "--width", "64", "--frames", "9",
          "--block-size", "8"], "36 video tokens = 5 blocks of 8, fewer than the 64 ranks"),
    ]
    for case in cases:
        argv, pattern = case[0], case[1]
        script = case[2] if len(case) > 2 else "wan.py"
        out = [] if "--out" in argv else ["--out", str(tmp_path / "v.mp4")]
        code = _run(script, [*argv, "--device", "cpu", *out])
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, err)
        # one line of error after the loading bars, if any, and no traceback
        assert "Traceback" not in err and re.search(pattern, err.splitlines()[-1]), (argv, err)


# --- quality figures through --tiny: what --compare-dense measures is sparsity alone -------------


@pytest.mark.parametrize("script", list(SCRIPTS.values()))
def test_tiny_dense_runs_agree_and_cdf_one_matches_dense(script, tmp_path, capsys):
    """The tiny pipelines' modules are built in training mode; the recipe puts every component
    in eval, so two dense runs of one seed are identical (a dropout left on made them differ by
    30 dB) and sparsp at cdf 1.0 (every block kept) reproduces the dense model."""
    from _recipe import build_parser, check_args, generate, load_pipeline, psnr
    import torch

    recipe = _recipe(script)
    tiny = ["--tiny", "--device", "cpu", "--steps", "2"]
    args = build_parser(recipe).parse_args([*tiny, "--out", str(tmp_path / "v.mp4")])
    check_args(args, recipe)
    pipe = load_pipeline(args, recipe, torch.device("cpu"), torch.float32)
    first, second = (generate(args, recipe, pipe, decode=True, label="dense", show=False)[0] for _ in range(2))
    assert psnr(first, second) == math.inf
    assert _run(script, [*tiny, "--emulate-ranks", "2", "--cdf", "1.0", "--compare-dense",
                         "--out", str(tmp_path / "v.mp4")]) == 0
    db, ssim = _quality(capsys.readouterr().out)
    assert db >= 100.0 and ssim > 0.9999, (db, ssim)


# --- checked before loading the pipeline; Ctrl-C --------------------------------------------------


def _not_loaded(*args, **kwargs):
    raise AssertionError("the pipeline was loaded before the check")


@pytest.mark.parametrize("case", ["out under a file", "out a directory", "auto in one process", "no diffusers",
                                  "no av"])
def test_recipe_checks_before_loading(case, tmp_path, capsys, monkeypatch):
    """What used to fail after loading (auto: a 75-line traceback at the first forward) or after
    generating (a bad --out), or with a ModuleNotFoundError: one line, exit 2, nothing loaded."""
    import _recipe

    monkeypatch.setattr(_recipe, "load_pipeline", _not_loaded)
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir.mp4").mkdir()
    argv, match = {
        "out under a file": (["--out", str(tmp_path / "file" / "v.mp4")], "is a file, not a directory"),
        "out a directory": (["--out", str(tmp_path / "dir.mp4")], "is a directory; give a FILE.mp4"),
        "auto in one process": (["--strategy", "auto", "--emulate-ranks", "2"],
                                r"strategy='auto' picks .* one process .* \(run the recipe under torchrun\)"),
        "no diffusers": ([], r'the recipe needs diffusers, which is not installed: pip install -e "\.\[examples\]"'),
        "no av": ([], r'the recipe needs av, which is not installed: pip install -e "\.\[examples\]"'),
    }[case]
    if case.startswith("no "):
        monkeypatch.setitem(sys.modules, case[3:], None)  # the import fails as if not installed
    out = [] if "--out" in argv else ["--out", str(tmp_path / "v.mp4")]
    code = _run("wan.py", ["--tiny", "--device", "cpu", *argv, *out])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert re.fullmatch(f"wan.py: error: .*{match}.*\n", err), err


def test_recipe_interrupted_leaves_no_partial_mp4(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the mp4 is being written: one line, exit 130, no file (whole or none)."""
    class Interrupting:
        @staticmethod
        def from_ndarray(*args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(av, "VideoFrame", Interrupting)  # the container is open: a partial file exists
    video = tmp_path / "v.mp4"
    assert _run("ltx_video.py", ["--tiny", "--device", "cpu", "--steps", "1", "--out", str(video)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "ltx_video.py: interrupted"
    assert list(tmp_path.iterdir()) == []
