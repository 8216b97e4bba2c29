"""How the benchmark verbs fail: what they need is checked before any work or process group (one
line, exit status 2), and a row that cannot run says the real reason."""

from __future__ import annotations

import sys

import pytest
import torch

from cli_utils import run_cli

pytest.importorskip("diffusers")

VERB_ARGS = {  # each verb as it would run on this CPU, but for its --out
    "attention": ["--model", "ltx-video"],
    "e2e": ["--tiny", "--device", "cpu"],
    "kernel": ["--device", "cpu", "--shape", "96x160x2x16", "--block-size", "32"],
    "transport": [],
}


@pytest.mark.parametrize("verb", list(VERB_ARGS))
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_bad_out_is_refused_before_any_work(capsys, tmp_path, verb, where):
    import torch.distributed as dist

    file = tmp_path / "taken"
    file.write_text("x")
    out = file if where == "a file" else file / "results"
    code, printed, err = run_cli(capsys, ["bench", verb, *VERB_ARGS[verb], "--out", out])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    want = f"--out {out} is a file; give a directory" if where == "a file" else f"--out {out}: {file} is a file"
    assert err.startswith(f"sparsp bench {verb}: error: {want}"), err
    assert printed == "" and not dist.is_initialized()


def test_e2e_without_diffusers_names_the_extra_before_the_group_starts(capsys, tmp_path, monkeypatch):
    """Every e2e row builds a Diffusers model: without Diffusers the run ends at once with one
    line naming the extra (under torchrun it hung: one rank raised building the model while its
    peer waited in a collective)."""
    import torch.distributed as dist

    monkeypatch.setitem(sys.modules, "diffusers", None)  # ``import diffusers`` raises ImportError
    code, printed, err = run_cli(capsys, ["bench", "e2e", "--tiny", "--device", "cpu", "--out", tmp_path / "o"])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("sparsp bench e2e: error: needs Diffusers") and 'pip install -e ".[diffusers]"' in err
    assert not dist.is_initialized() and not (tmp_path / "o").exists()


def test_diffusers_rows_say_why_they_cannot_run_before_trying():
    """``diffusers-ring`` / ``diffusers-ulysses``: a model without Diffusers' context-parallel plan
    (HunyuanVideo; the row read ``ZeroDivisionError: integer modulo by zero``), or no
    accelerator to put each rank on; the sparsp rows are never refused here."""
    import diffusers

    from sparsp.bench.e2e import diffusers_refusal

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for name in ("diffusers-ring", "diffusers-ulysses"):
        assert diffusers_refusal(name, "hunyuan-video", cuda) == (
            f"Diffusers {diffusers.__version__} has no context-parallel plan for HunyuanVideoTransformer3DModel")
        assert diffusers_refusal(name, "hunyuan-video", cpu) == diffusers_refusal(name, "hunyuan-video", cuda)
        for kind in ("wan", "ltx-video", "ltx-2"):
            assert diffusers_refusal(name, kind, cuda) is None
            assert "needs an accelerator" in diffusers_refusal(name, kind, cpu)
    assert diffusers_refusal("sparsp", "hunyuan-video", cpu) is None
    assert diffusers_refusal("1gpu-dense", "hunyuan-video", cpu) is None
