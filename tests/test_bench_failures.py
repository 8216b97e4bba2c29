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


# --- a failure on one rank ends every rank alike -------------------------------------------------

E2E = ["bench", "e2e", "--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "1", "--warmup", "0",
       "--no-plot", "--strategy", "1gpu-dense", "sparsp"]
E2E_ROW_STAGES = ["building the model", "parallelizing the model", "setting up the steps",
                  "choosing the dense attention backend", "the warm-up steps", "the timed steps",
                  "the step's figures"]
# (where, failing rank): each stage of a row, on the rank that works in the one-GPU row (0) and
# on the one that waits (1); writing the results (rank 0 writes, rank 1 waits); and the hang
# the stages end: rank 0's model fails to build while its peer goes on
E2E_CASES = [(stage, i % 2) for i, stage in enumerate(E2E_ROW_STAGES)] + [
    ("writing the results", 0), ("writing the results", 1), ("build_transformer", 0)]
ATTENTION = ["bench", "attention", "--model", "ltx-video", "--kernel", "torch", "--link-gbps", "100",
             "--strategy", "sparsp", "--no-copy-engine", "--warmup", "1", "--iters", "10"]
ATTENTION_CASES = [(stage, i % 2) for i, stage in enumerate([
    "setting up sparsp over nccl", "sparsp's timed split", "sparsp's mask", "profiling sparsp over nccl",
    "the one-GPU rows", "the warm-up calls", "the timed calls", "writing the results"])]


class _HostEvent:
    """``torch.cuda.Event`` on the host clock (the phase timer's events, on this CPU)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        import time

        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _attention_on_cpu(rank):
    """``bench attention`` on this CPU: a small geometry for the preset, no dense GPU kernel to
    measure (a stand-in rate and SDPA), the phase timer's events on the host clock, and its
    CUDA check passed (a test's stand-ins only)."""
    import dataclasses

    import torch.nn.functional as F

    from sparsp import geometry
    from sparsp.bench import attention

    small = dataclasses.replace(geometry.preset("wan2.1-1.3b", width=128, height=128, frames=5), heads=2,
                                block_size=16)
    real_preset, real_check, real_available = geometry.preset, attention.check, torch.cuda.is_available
    geometry.preset = lambda name, **k: small if name == "ltx-video" else real_preset(name, **k)
    attention.dense_tflops = lambda q, k, v, kernel: (1e-3, "sdpa")
    attention.dense_call = lambda q, k, v, name: lambda: F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)))

    def check(args):
        torch.cuda.is_available = lambda: True
        try:
            return real_check(args)
        finally:
            torch.cuda.is_available = real_available

    attention.check = check
    torch.cuda.Event = _HostEvent


def _inject(rank, world, tmp, argv, cases):
    """``sparsp ARGV`` once per case, each in a process group of its own, a ``RuntimeError``
    raised on the failing rank at the end of the named stage's work (``the timed steps`` /
    ``calls``: after a timed call; ``build_transformer``: the e2e model's build itself); per
    case, this rank's (exit status, its ``sparsp bench`` stderr lines, its e2e rows' errors)."""
    import contextlib
    import datetime
    import io

    import torch.distributed as dist

    from sparsp.bench import attention, common, e2e
    from sparsp.cli import main
    from sparsp.integrations import models

    if argv[1] == "attention":
        _attention_on_cpu(rank)
    real_stage, real_call, real_build, real_row = common.stage, common.call_ms, models.build_transformer, e2e._strategy_row
    dist.destroy_process_group()  # the harness's group: each run starts its own
    results = []
    for i, (where, bad) in enumerate(cases):
        def injected(what, where=where, bad=bad):
            if rank == bad and what == where:
                raise RuntimeError(f"injected on rank {rank}")

        @contextlib.contextmanager
        def stage(what):
            with real_stage(what):
                yield
                injected(what)  # after the stage's work, whatever collectives it made

        def call_ms(fn, device):
            ms = real_call(fn, device)
            injected("the timed steps" if argv[1] == "e2e" else "the timed calls")
            return ms

        def build_transformer(*a, where=where, **k):
            if rank == 0 and where == "build_transformer":
                raise ModuleNotFoundError("No module named 'diffusers'")
            return real_build(*a, **k)

        rows = []
        common.stage = e2e.stage = attention.stage = stage
        common.call_ms, models.build_transformer = call_ms, build_transformer
        e2e._strategy_row = lambda *a, **k: rows.append(real_row(*a, **k)) or rows[-1]
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store{i}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main([*argv, "--out", f"{tmp}/run{i}"])
        lines = [line for line in err.getvalue().splitlines() if line.startswith("sparsp bench")]
        results.append((code, lines, [(r["strategy"], r.get("error")) for r in rows]))
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def _outcomes(tmp_path, argv, cases):
    """Each case's outcome, after checking that both ranks had the same one."""
    from dist_utils import run_distributed

    per_rank = run_distributed(_inject, 2, tmp_path, argv, cases, timeout=600)
    for case, (rank0, rank1) in zip(cases, zip(*per_rank)):
        assert rank0 == rank1, (case, rank0, rank1)
    return per_rank[0]


def test_a_failure_on_one_rank_ends_every_e2e_rank_alike(tmp_path):
    """A failure injected on one rank at each stage of ``bench e2e`` (2 gloo processes): no rank
    waits in a collective for a peer that stopped (it hung: one rank in an all-reduce, the
    other in an all-gather). A row's stage: every rank records the same error for that row,
    naming the stage and the rank, and the run goes on; writing the results: every rank ends
    with the same one line, exit status 1."""
    for (where, bad), (code, lines, rows) in zip(E2E_CASES, _outcomes(tmp_path, E2E, E2E_CASES)):
        if where == "writing the results":
            assert code == 1 and lines == [f"sparsp bench e2e: error: writing the results failed on rank {bad}: "
                                           f"RuntimeError: injected on rank {bad}"], (where, lines)
            continue
        assert code == 0 and lines == [], (where, code, lines)
        if where == "build_transformer":
            want = "building the model failed on rank 0: ModuleNotFoundError: No module named 'diffusers'"
        else:
            want = f"{where} failed on rank {bad}: RuntimeError: injected on rank {bad}"
        dense_only = where == "choosing the dense attention backend"
        assert rows == [("1gpu-dense", want), ("sparsp", None if dense_only else want)], (where, rows)


def test_a_failure_on_one_rank_ends_every_attention_rank_alike(tmp_path):
    """The same for ``bench attention`` (its GPU-only pieces stood in for on this CPU): any
    stage's failure on one rank ends every rank with the same one line, exit status 1."""
    for (where, bad), (code, lines, _) in zip(ATTENTION_CASES, _outcomes(tmp_path, ATTENTION, ATTENTION_CASES)):
        assert code == 1 and lines == [f"sparsp bench attention: error: {where} failed on rank {bad}: "
                                       f"RuntimeError: injected on rank {bad}"], (where, code, lines)
