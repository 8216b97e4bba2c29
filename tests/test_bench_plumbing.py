"""The benchmark plumbing that needs no GPU: which rows ``bench attention`` runs, the link
bandwidth its bound reads from ``bench transport`` files, the kept FLOPs of a mask, its plot, and
the result files every benchmark writes (``bench.common.write_result``).

Expected values are computed here from first principles (token by token, file by file), not
read back from the functions under test.
"""

from __future__ import annotations

import datetime
import json
import types
from argparse import Namespace

import pytest
import torch

from sparsp.bench import args as bench_args
from sparsp.bench import attention, attention_rows, common, measure
from sparsp.plan import Shapes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Where each strategy runs by default (its registration, README "Strategies").
PLACEMENT = {"ring": "contiguous", "ring-sparse": "contiguous", "ring-relay": "periodic",
             "ulysses": "contiguous", "sparsp": "periodic"}


# --------------------------------------------------------------------------- _configs


def _args(strategies, fabric="nvlink", *, no_copy_engine=False, ablation=False) -> Namespace:
    return Namespace(strategy=list(strategies), fabric=fabric, no_copy_engine=no_copy_engine,
                     ablation=ablation)


@pytest.mark.parametrize("fabric, copy_engine", [("nvlink", "ipc"), ("host", "host")])
def test_configs_one_row_per_strategy_and_a_copy_engine_row_for_sparsp(fabric, copy_engine):
    names = ["ring", "ring-sparse", "ring-relay", "ulysses", "sparsp"]
    rows = attention._configs(_args(names, fabric), world=2, heads=4)
    want = [(s, PLACEMENT[s], "nccl", None) for s in names]
    want.append(("sparsp", "periodic", copy_engine, None))  # right after sparsp's nccl row
    assert rows == want
    # the order of --strategy is the order of the rows
    rows = attention._configs(_args(["sparsp", "ring"], fabric), world=2, heads=4)
    assert rows == [("sparsp", "periodic", "nccl", None), ("sparsp", "periodic", copy_engine, None),
                    ("ring", "contiguous", "nccl", None)]


def test_configs_without_the_copy_engine_row():
    rows = attention._configs(_args(["ring", "sparsp"], no_copy_engine=True), world=2, heads=4)
    assert rows == [("ring", "contiguous", "nccl", None), ("sparsp", "periodic", "nccl", None)]


@pytest.mark.parametrize("world, heads, ulysses", [(2, 4, True), (2, 3, False), (4, 6, False), (3, 6, True)])
def test_configs_drop_ulysses_when_heads_do_not_divide(world, heads, ulysses):
    rows = attention._configs(_args(["ring", "ulysses"], no_copy_engine=True), world=world, heads=heads)
    assert [r[0] for r in rows] == (["ring", "ulysses"] if ulysses else ["ring"])


@pytest.mark.parametrize("fabric, copy_engine", [("nvlink", "ipc"), ("host", "host")])
def test_configs_ablation_rows_switch_on_one_thing_at_a_time(fabric, copy_engine):
    args = _args(["ring"], fabric, no_copy_engine=True, ablation=True)
    rows = attention._configs(args, world=2, heads=3)  # heads filter the strategies, not the ablation
    assert rows[0] == ("ring", "contiguous", "nccl", None)
    ablation = rows[1:]
    assert [r[:3] for r in ablation] == [
        ("ring-sparse", "contiguous", "nccl"),  # baseline
        ("ring-sparse", "periodic", "nccl"),  # + periodic placement
        ("ring-relay", "periodic", "nccl"),  # + relay routing
        ("sparsp", "periodic", "nccl"),  # + direct routing
        ("sparsp", "periodic", copy_engine),  # + the fabric's copy-engine transport
        ("sparsp", "periodic", copy_engine),  # + the chunked drain
        ("sparsp", "periodic", copy_engine),  # + the CUDA-graph plan stage (instead)
        ("sparsp", "periodic", copy_engine),  # + the local kernel first, added to the graphs
    ]
    # chunking, graphs and local-first are off until their own steps
    configs = [attention.ablation_config(r[3]) for r in ablation]
    assert all(c["chunks"] == 1 for c in configs)
    assert [c["drain_chunks"] for c in configs] == [1, 1, 1, 1, 1, 4, 1, 1]
    assert [c["cuda_graphs"] for c in configs] == [False] * 6 + [True, True]
    assert [c["local_first"] for c in configs] == [False] * 7 + [True]
    assert attention.ablation_config(None) == {}
    labels = [r[3] for r in ablation]
    assert labels[0] == "baseline" and all(isinstance(x, str) and x for x in labels)
    assert len(set(labels)) == len(labels)


def test_config_option_typed_from_the_field(capsys):
    """``--config KEY=VALUE`` (repeatable): typed from the ``SparspConfig`` field, checked by
    ``SparspConfig`` itself; an unknown key or a bad value is a one-line error; the fields the
    benchmark sets itself are refused by name."""
    import argparse

    assert bench_args.config_arg("drain_chunks=1") == ("drain_chunks", 1)
    assert bench_args.config_arg("drain-chunks=auto") == ("drain_chunks", None)
    assert bench_args.config_arg("local_first=on") == ("local_first", True)
    assert bench_args.config_arg("local_first=none") == ("local_first", None)
    assert bench_args.config_arg("cuda_graphs=off") == ("cuda_graphs", False)
    assert bench_args.config_arg("cdf_threshold=0.5,0.75") == ("cdf_threshold", (0.5, 0.75))
    assert bench_args.config_arg("sim_threshold=0.3") == ("sim_threshold", 0.3)
    assert bench_args.config_arg("local_transport=host") == ("local_transport", "host")
    assert bench_args.config_arg("timeout_s=30") == ("timeout_s", 30)
    for bad, message in (("prefetch", "expected KEY=VALUE"),
                         ("nope=1", "unknown SparspConfig field 'nope'"),
                         ("prefetch=0", "prefetch='0': prefetch must be an int >= 1"),
                         ("chunks=many", "chunks='many': expected int | None"),
                         ("cuda_graphs=maybe", "cuda_graphs='maybe': expected bool"),
                         ("local_transport=peers", "local_transport must be None or one of")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            bench_args.config_arg(bad)
    p = argparse.ArgumentParser()
    bench_args.add_attention(p)
    args = p.parse_args(["--config", "drain_chunks=1", "--config", "local_first=off",
                         "--config", "drain_chunks=4"])
    assert common.config_overrides(args.config, reserved=attention.RESERVED) == {
        "drain_chunks": 4, "local_first": False}  # the last of a key wins
    assert p.parse_args([]).config == []
    with pytest.raises(SystemExit, match="set by --cdf"):
        common.config_overrides([("cdf_threshold", 0.5)], reserved=attention.RESERVED)
    with pytest.raises(SystemExit):
        p.parse_args(["--config", "nope=1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("unknown SparspConfig field 'nope'; fields: " + ", ".join(
        f.name for f in __import__("dataclasses").fields(__import__("sparsp").SparspConfig))), err
    for gone in ("--env-variant", "--chunks", "--drain-chunks", "--no-cuda-graphs", "--local-first"):
        with pytest.raises(SystemExit):
            p.parse_args([gone, "1"])


def test_input_sets_cycle_the_timed_calls():
    """``--input-sets N``: each timed call takes the next of N input sets (as a denoising loop
    gives every call a new mask); N must be a whole number >= 1."""
    import argparse

    seen = []
    call = attention.cycling([(1, 2), (3, 4), (5, 6)], lambda a, b: seen.append(a + b) or a)
    assert [call() for _ in range(7)] == [1, 3, 5, 1, 3, 5, 1] and seen == [3, 7, 11, 3, 7, 11, 3]
    p = argparse.ArgumentParser()
    bench_args.add_attention(p)
    assert p.parse_args([]).input_sets == 1 and p.parse_args(["--input-sets", "4"]).input_sets == 4
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            p.parse_args(["--input-sets", bad])


# --------------------------------------------------------------------------- link_gbps


def _row(fabric, nbytes, gbps, under_load=None, transport="nccl"):
    r = {"transport": transport, "fabric": fabric, "bytes": nbytes, "gbps": gbps}
    if under_load is not None:
        r["under_load"] = under_load
    return r


def test_link_gbps_best_256_mib_row_per_fabric(tmp_path):
    mib = 1 << 20
    (tmp_path / "transport-all-2xH200-2025-01-01.json").write_text(json.dumps({"rows": [
        _row("nvlink", 256 * mib, 300.0, transport="ipc"),
        _row("nvlink", 256 * mib, 390.0, under_load=True),  # under attention load: not the link
        _row("nvlink", 512 * mib, 410.0),  # another size
        _row("host", 256 * mib, 30.0, under_load=False, transport="host"),
        _row("host", 64 * mib, 45.0),
    ]}))
    (tmp_path / "transport-all-2xH200-2025-01-02.json").write_text(json.dumps({"rows": [
        _row("nvlink", 256 * mib, 320.5),
        _row("host", 256 * mib, 25.0),
        _row("host", 256 * mib, 60.0, under_load=True),
    ]}))
    (tmp_path / "transport-all-empty.json").write_text(json.dumps({"kind": "transport"}))  # no rows
    # not a transport-all-* file: a single transport's run, and another benchmark's result
    (tmp_path / "transport-ipc-2025-01-03.json").write_text(json.dumps({"rows": [_row("nvlink", 256 * mib, 999.0)]}))
    (tmp_path / "attention-x.json").write_text(json.dumps({"rows": [_row("host", 256 * mib, 999.0)]}))

    assert measure.link_gbps("nvlink", tmp_path) == pytest.approx(320.5)
    assert measure.link_gbps("host", tmp_path) == pytest.approx(30.0)
    assert measure.link_gbps("pcie", tmp_path) is None  # no row of that fabric


def test_link_gbps_none_without_files_or_qualifying_rows(tmp_path):
    assert measure.link_gbps("nvlink", tmp_path) is None
    assert measure.link_gbps("nvlink", tmp_path / "missing") is None
    (tmp_path / "transport-all-a.json").write_text(json.dumps({"rows": [
        _row("nvlink", 256 << 20, 300.0, under_load=True), _row("nvlink", 128 << 20, 200.0)]}))
    assert measure.link_gbps("nvlink", tmp_path) is None


# --------------------------------------------------------------------------- kept_flops


def _brute_flops(mask, shapes: Shapes) -> float:
    """Token by token: 4·D FLOPs for every (query token of this rank, key token) a kept block
    pair covers, per batch and head; ``mask`` None keeps every pair."""
    block_of, offset = [], 0  # global block id of every token, each rank's slice cut from its start
    for p, n_tokens in enumerate(shapes.seq_lens):
        block_of.append([offset + t // shapes.block_size for t in range(n_tokens)])
        offset += -(-n_tokens // shapes.block_size)
    keys = [b for rank_blocks in block_of for b in rank_blocks]
    first = min(block_of[shapes.rank])
    total = 0.0
    for b in range(shapes.batch):
        for h in range(shapes.heads):
            for qb in block_of[shapes.rank]:
                for kb in keys:
                    if mask is None or mask[b, h, qb - first, kb]:
                        total += 4 * shapes.head_dim
    return total


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_kept_flops_counts_real_tokens_of_kept_pairs(rank):
    # 7 = 4 + 3 and 6 = 4 + 2: short tail blocks in the middle of the sequence; 8 divides evenly
    shapes = Shapes(rank=rank, world_size=3, batch=2, heads=3, head_dim=4, block_size=4, seq_lens=(7, 6, 8))
    n_local, n_total = 2, 6
    g = torch.Generator().manual_seed(rank)
    mask = torch.rand(shapes.batch, shapes.heads, n_local, n_total, generator=g) < 0.5
    want = _brute_flops(mask, shapes)
    assert 0 < want < _brute_flops(None, shapes)
    assert measure.kept_flops(mask, shapes) == pytest.approx(want)
    assert measure.kept_flops(None, shapes) == pytest.approx(_brute_flops(None, shapes))
    full = torch.ones(shapes.batch, shapes.heads, n_local, n_total, dtype=torch.bool)
    assert measure.kept_flops(full, shapes) == pytest.approx(_brute_flops(None, shapes))


def test_kept_flops_of_a_single_tail_pair():
    # rank 1 holds 6 tokens: blocks of 4 and 2; keep only (its tail block, rank 0's tail block of 3)
    shapes = Shapes(rank=1, world_size=2, batch=1, heads=1, head_dim=8, block_size=4, seq_lens=(7, 6))
    mask = torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    mask[0, 0, 1, 1] = True
    assert measure.kept_flops(mask, shapes) == pytest.approx(4 * 8 * 2 * 3)


# --------------------------------------------------------------------------- plot


def _attention_row(strategy, transport, fabric, median_ms, ablation=None):
    return {"model": "tiny", "fabric": fabric, "strategy": strategy, "transport": transport,
            "ablation": ablation, "median_ms": median_ms, "bound_ms": median_ms / 2,
            "mask_ms": 0.1, "pack_ms": 0.2, "compute_ms": median_ms / 3, "merge_ms": 0.05,
            "exposed_comm_ms": 0.3}


def _capture_figures(monkeypatch) -> list:
    from matplotlib.figure import Figure

    saved, real = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_plot_writes_a_png_of_the_rows_with_a_bound(tmp_path, monkeypatch):
    rows = [_attention_row("ring", "nccl", "nvlink", 3.0),
            _attention_row("sparsp", "ipc", "nvlink", 1.5, ablation="+periodic"),
            # an earlier version's row: no bound, no time split, and a fabric of its own
            {"model": "tiny", "fabric": "pcie", "strategy": "ring", "transport": "nccl", "median_ms": 9.0},
            _attention_row("sparsp", "host", "host", 2.0)]
    path = tmp_path / "attention-tiny-cpu-2025-01-01.json"
    path.write_text(json.dumps({"kind": "attention", "machine": "cpu", "rows": rows}))
    saved = _capture_figures(monkeypatch)

    out = attention_rows.plot(path)
    assert out == tmp_path / "attention-tiny-cpu-2025-01-01.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    (fig,) = saved
    assert [ax.get_title() for ax in fig.axes] == ["tiny, nvlink", "tiny, host"]  # no pcie panel
    labels = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
    assert labels == [["ring\nnccl", "sparsp\nipc\n+periodic"], ["sparsp\nhost"]]
    # five stacked phases per row
    assert [len(ax.patches) for ax in fig.axes] == [5 * 2, 5 * 1]


def test_plot_without_rows_with_a_bound_writes_nothing(tmp_path):
    path = tmp_path / "attention-old.json"
    path.write_text(json.dumps({"machine": "cpu", "rows": [
        {"model": "tiny", "fabric": "nvlink", "strategy": "ring", "transport": "nccl", "median_ms": 1.0}]}))
    out = attention_rows.plot(path)
    assert out == tmp_path / "attention-old.png" and not out.exists()


# --------------------------------------------------------------------------- write_result


class _Date(datetime.date):
    @classmethod
    def today(cls):
        return cls(2025, 3, 4)


@pytest.fixture
def fixed_day(monkeypatch):
    monkeypatch.setattr(common, "datetime", types.SimpleNamespace(date=_Date))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_write_result_names_the_file_and_extends_it_for_the_other_fabric(tmp_path, monkeypatch, fixed_day):
    out_dir = tmp_path / "results"  # made on demand
    nvlink_rows = [{"strategy": "ring", "fabric": "nvlink", "median_ms": 2.0},
                   {"strategy": "sparsp", "fabric": "nvlink", "median_ms": 1.0}]
    host_rows = [{"strategy": "sparsp", "fabric": "host", "median_ms": 4.0}]

    monkeypatch.setattr("sys.argv", ["sparsp", "bench", "attention", "--fabric", "nvlink"])
    path = common.write_result("attention", "hunyuan-video", nvlink_rows, out_dir)
    assert path == out_dir / "attention-hunyuan-video-cpu-2025-03-04.json"
    first = "sparsp bench attention --fabric nvlink"
    assert json.loads(path.read_text()) == {"kind": "attention", "machine": "cpu", "date": "2025-03-04",
                                            "command": first, "rows": nvlink_rows}

    monkeypatch.setattr("sys.argv", ["sparsp", "bench", "attention", "--fabric", "host", "--note", "a b"])
    again = common.write_result("attention", "hunyuan-video", host_rows, out_dir, extra={"versions": {"torch": "x"}})
    assert again == path
    doc = json.loads(path.read_text())
    second = "sparsp bench attention --fabric host --note 'a b'"
    assert doc["rows"] == nvlink_rows + host_rows  # appended, first run's rows first
    assert doc["command"] == first and doc["commands"] == [first, second]
    assert doc["versions"] == {"torch": "x"} and doc["kind"] == "attention"

    # another model or kind is another file; merge=False starts the file over
    other = common.write_result("kernel", "all", host_rows, out_dir)
    assert other == out_dir / "kernel-all-cpu-2025-03-04.json"
    common.write_result("attention", "hunyuan-video", host_rows, out_dir, merge=False)
    doc = json.loads(path.read_text())
    assert doc["rows"] == host_rows and "commands" not in doc and doc["command"] == second


def test_result_path_names_the_gpus(tmp_path, monkeypatch, fixed_day):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200 NVL")
    assert common.result_path("e2e", "wan", tmp_path) == tmp_path / "e2e-wan-2xH200NVL-2025-03-04.json"


def test_time_interleaved_runs_the_rows_round_robin(monkeypatch):
    order = []
    monkeypatch.setattr(common, "time_ms", lambda fn, *, warmup, iters, device: [fn()] * iters)
    fns = [lambda i=i: order.append(i) or float(10 + i) for i in range(3)]
    times = common.time_interleaved(fns, warmup=2, iters=4, device=torch.device("cpu"))
    assert times == [[10.0] * 4, [11.0] * 4, [12.0] * 4]
    # warm-up rounds in order, then timed rounds each starting one row later: every row
    # follows every other alike
    assert order == [0, 1, 2] * 2 + [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]


def test_sync_count_records_the_second_of_two_calls(tmp_path):
    # the profiler's warm-up call is discarded (the first Triton launch after a profiler
    # starts costs milliseconds), so what the first call alone does is not counted
    from torch.profiler import record_function

    from sparsp.bench.measure import count_syncs_and_collectives

    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            with record_function("sparsp.host_read"):  # a host sync, in the warm-up call only
                pass

    assert count_syncs_and_collectives(fn) == (0, 0) and len(calls) == 2
    calls.clear()

    def twice():
        calls.append(1)
        with record_function("sparsp.host_read"):
            pass

    assert count_syncs_and_collectives(twice) == (1, 0) and len(calls) == 2
    # the trace written holds the recorded call only
    import gzip
    import json

    calls.clear()

    def named():
        calls.append(1)
        with record_function(f"call{len(calls)}"):
            pass

    count_syncs_and_collectives(named, tmp_path / "row")
    events = json.load(gzip.open(tmp_path / "row.json.gz"))["traceEvents"]
    names = {e.get("name") for e in events}
    assert "call2" in names and "call1" not in names and (tmp_path / "row.txt").is_file()


# --------------------------------------------------------------------------- renamed flags


def test_torch_profile_is_the_profilers_flag_and_the_old_spelling_is_refused(capsys):
    """``--torch-profile DIR``: the torch profiler's tables and traces; ``--profile`` (its former
    name; "profile" means a machine or density profile elsewhere) is refused in one line naming
    the new spelling, exit status 2, with or without a value."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser()
    bench_args.add_attention(p)
    args = p.parse_args(["--torch-profile", "traces"])
    assert args.torch_profile == Path("traces") and not hasattr(args, "profile")
    assert p.parse_args([]).torch_profile is None
    for argv in (["--profile", "traces"], ["--profile=traces"], ["--profile"]):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == "sparsp bench attention: error: --profile is now --torch-profile DIR\n"
    assert "--profile " not in p.format_help() and "--torch-profile DIR" in p.format_help()


# --------------------------------------------------------------------------- where results go


def test_a_cpu_run_writes_under_results_never_into_the_tracked_results(tmp_path, monkeypatch):
    """``sparsp bench kernel --device cpu`` (an example of its own ``--help``) without ``--out``:
    the file goes to ``results/bench``; ``bench/results``, which ``sparsp simulate`` reads as a
    GPU's measurements, is not made."""
    from sparsp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "kernel", "--device", "cpu", "--shape", "96x160x2x16", "--block-size", "32",
                 "--density", "0.5", "--cdf", "--warmup", "0", "--iters", "10", "--layout", "local"]) == 0
    (path,) = tmp_path.rglob("*.json")
    assert path.parent == tmp_path / "results" / "bench" and path.name.startswith("kernel-all-cpu-")
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("cuda", [False, True])
def test_default_out_by_device(cuda):
    from pathlib import Path

    assert bench_args.default_out(cuda) == Path("bench/results" if cuda else "results/bench")


# --------------------------------------------------------------------------- the row


# The fields of a strategy's row in bench attention's result file, in their order (what
# ``sparsp simulate --validate`` and ``sparsp bench report`` read); a one-GPU row has all but
# the call's settings; a profile layer's row ends with the layer's fields.
STRATEGY_ROW = ["model", "tokens", "heads", "head_dim", "ranks", "fabric", "cdf", "strategy", "transport",
                "placement", "kernel", "median_ms", "min_ms", "iters", "timing", "bytes_moved", "bytes_max_rank",
                "density", "mask_ms", "pack_ms", "compute_ms", "merge_ms", "exposed_comm_ms", "pack_side_ms",
                "transfer_ms", "host_syncs", "collectives", "link_gbps", "dense_tflops", "dense_kernel",
                "compute_bound_ms", "transfer_bound_ms", "bound_ms", "efficiency", "ablation", "cuda_graphs",
                "local_first_config", "local_first", "drain_chunks", "auto_choice", "config", "head_order",
                "input_sets", "thresholds", "call", "plan_median_ms", "plan_mask_ms", "reuse_ratio", "mesh"]
CALL_SETTINGS = ["cuda_graphs", "local_first_config", "local_first", "drain_chunks", "auto_choice", "config",
                 "head_order", "input_sets", "call", "plan_median_ms", "plan_mask_ms", "reuse_ratio", "mesh"]
LAYER_FIELDS = ["workload", "layer", "layer_pick", "profile_density", "heads_within"]


def test_an_attention_row_is_a_frozen_dataclass_written_with_the_files_fields():
    import dataclasses

    from sparsp.bench.attention_rows import AttentionRow
    from sparsp.bench.profile_layers import LayerWorkload

    row = AttentionRow(model="ltx-video", tokens=18432, heads=32, head_dim=64, ranks=2, fabric="nvlink", cdf=0.9,
                       strategy="sparsp", transport="ipc", placement="periodic", kernel="auto", timing="interleaved",
                       density=0.25, link_gbps=380.0, dense_tflops=600.0, dense_kernel="fa4", compute_bound_ms=1.0,
                       transfer_bound_ms=2.0, bound_ms=2.0, head_order="density", input_sets=1)
    assert list(row.as_json()) == STRATEGY_ROW
    assert row.as_json()["median_ms"] is None and row.as_json()["input_sets"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.median_ms = 1.0
    timed = row.timed([4.0, 2.0, 3.0])  # a new row: median, minimum, count and the bound's efficiency
    assert (timed.median_ms, timed.min_ms, timed.iters, timed.efficiency) == (3.0, 2.0, 3, 2.0 / 3.0)
    assert row.median_ms is None
    one = dataclasses.replace(row, strategy="1gpu-dense", ranks=1)
    assert list(one.as_json()) == [k for k in STRATEGY_ROW if k not in CALL_SETTINGS]
    layer = LayerWorkload(layer=7, pick="densest", density=0.51234, within=0.875, heads=None, seed=0, mix=None)
    fields = dataclasses.replace(row, workload=layer).as_json()
    assert list(fields) == STRATEGY_ROW + LAYER_FIELDS
    assert {k: fields[k] for k in LAYER_FIELDS} == {"workload": "density-profile", "layer": 7, "layer_pick": "densest",
                                                     "profile_density": 0.5123, "heads_within": 0.875}
    assert "layer 7   sparsp" in dataclasses.replace(timed, workload=layer).line()
