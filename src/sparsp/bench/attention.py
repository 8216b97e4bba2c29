"""One attention layer per strategy on several GPUs, with its time split and bound.

    torchrun --nproc-per-node 2 -m sparsp.cli bench attention --model hunyuan-video --fabric nvlink
    torchrun --nproc-per-node 2 -m sparsp.cli bench attention --fabric host   # NCCL_P2P_DISABLE=1

Inputs are the synthetic video Q/K of ``sparsp.workloads.synthetic`` (V random) at the model's full
geometry, placed as each strategy runs by default (its registration). Every strategy uses the
same kernel. Per row:

* ``median_ms``: CUDA events around the whole call (mask, plan, transfers, kernels, merge),
  warm-up first, median of ≥ 10 iterations, the slowest rank each iteration. The rows of one
  cdf are timed *interleaved* (``timing``): each timed round runs one iteration of every row
  in turn, starting one row later than the round before (every row follows every other
  alike), so clock and thermal drift over the minutes a run takes reaches every row alike
  (back-to-back timing of one row after another put 10 % between two runs of the same
  configuration at LTX-Video size); ``--sequential`` times row after row;
* the time split of one more call, timed phase by phase with CUDA events on the compute
  stream (``strategies.base.PhaseTimer``), the slowest rank's: ``mask_ms`` (metadata
  all-gather, whole mask, up to the host read's copy), ``pack_ms``, ``compute_ms`` (kernels),
  ``merge_ms`` (LSE merges), ``transfer_ms`` (each fetch from issue to landed, summed; overlaps
  compute), ``exposed_comm_ms`` = call − mask − pack − compute − merge (the compute stream
  waiting). A ``local_first`` strategy queues its local kernel before the host read and packs
  its first round on a side stream while that kernel runs (``strategies.base.Call.side``):
  that pack is in ``pack_ms`` and in ``pack_side_ms``, but not subtracted for ``exposed``;
* ``host_syncs`` and ``collectives`` of one call, counted by ``torch.profiler``
  (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls, and
  event polls that waited — ``groups.to_host`` — counted once per read; ``c10d::`` collective
  ops other than the transports' send/recv);
* the bound: C = the slowest rank's kept-block FLOPs (real tokens) / ``dense_tflops`` (the
  fastest dense kernel measured in this run at this head dim), T = ``bytes_max_rank`` /
  ``link_gbps`` (the best 256 MiB bandwidth any transport reached on the fabric, from this
  machine's ``bench transport`` result or ``--link-gbps``), ``bound_ms`` = max(C, T),
  ``efficiency`` = bound / median.

One-GPU rows over the whole sequence (rank 0, timed in the same rounds as the strategies):
``1gpu-dense`` (the fastest dense kernel: what a user without sparsp runs) and ``1gpu-sparse``
(the strategies' kernel and mask on one GPU).
``--ablation`` adds rows that switch on one thing at a time from ``ring-sparse`` on contiguous
placement over NCCL: periodic placement, direct routing (``ring-relay`` → ``sparsp``), the
copy-engine transport (``ipc`` / ``host``), then, each added to that row, the chunked drain
(the last peer's payload in 4 head groups) and the CUDA-graph plan stage
(``strategies/captured.py``), and to the latter the local kernel queued first
(``SparspConfig.local_first``); all three are off in the other ablation rows, and each row
names what it switches on in ``ablation``. ``cuda_graphs`` says whether a row replayed the
stage, ``local_first`` whether its timed split call queued the local kernel first
(``local_first_config``: the setting; automatic by default), and ``drain_chunks`` in how
many messages its last round's payload came (``sparsp``; else None).
``--config KEY=VALUE`` (repeatable) sets a ``SparspConfig`` field for every row, e.g.
``--config drain_chunks=1 --config local_first=on`` (docs/configuration.md); the row's
``config`` holds what was set. The ablation rows' own settings win over it.

``--density-profile FILE --layer L [L ...]`` measures chosen layers of a real model instead:
each layer's q/k come from synthetic heads calibrated to that layer's per-head densities in the
profile (``sparsp.workloads.calibration``; at ``--step``, or the mean over steps), and every row carries
its ``layer``, how it was asked for (``layer_pick``: ``densest``, ``median``, ``sparsest`` by
the layers' mean density, or None for an index) and the layer's mean density in the profile
(``profile_density``). Without ``--calibration FILE`` the asked layers alone are fitted first
(on the CPU of every rank, rank 0 printing its progress) and the fit is written next to the
results, for a later run's ``--calibration``. Such a run's files go to ``OUT/density-profile/``
(``attention-<model>-<profile>-step<S|mean>-<machine>-<date>.json``, ``"workload":
"density-profile"`` in the file and its rows), apart from the preset's results.

Results: ``bench/results/attention-<model>-<machine>-<date>.json`` (+ PNG: stacked time split
per strategy, the bound marked); a second run with the other ``--fabric`` extends the file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .args import ATTENTION_RESERVED, PROFILE_DIR, check_attention, check_names, check_out, default_out, refuse
from .common import (config_overrides, init_distributed, median, profile_name, time_interleaved,
                     time_ms, wide_console, write_result)
from .measure import count_syncs_and_collectives, dense_call, dense_tflops, kept_flops, link_gbps

COPY_ENGINE = {"nvlink": "ipc", "host": "host"}  # sparsp's own transport on each fabric
SPLIT = ("mask_ms", "pack_ms", "compute_ms", "merge_ms", "exposed_comm_ms")
RESERVED = ATTENTION_RESERVED
PROFILE_WORKLOAD = "density-profile"
"""The ``workload`` of a ``--density-profile`` run's file and rows (a preset's rows have none)."""


@dataclass(frozen=True)
class LayerWorkload:
    """One layer of a density profile as ``--density-profile`` runs it: its calibrated heads
    (``workloads.HeadParams``, with the seed and mix they were fitted on) and what the rows
    report of it."""

    layer: int
    pick: str | None  # the ``LAYER_PICKS`` name it was asked by; None: by its index
    density: float  # the layer's mean density over its heads in the profile (at the step)
    within: float  # share of its heads whose fit is within tolerance
    heads: object  # workloads.HeadParams
    seed: int
    mix: object  # workloads.HeadMix

    def row_fields(self) -> dict:
        return {"workload": PROFILE_WORKLOAD, "layer": self.layer, "layer_pick": self.pick,
                "profile_density": round(self.density, 4), "heads_within": round(self.within, 4)}


def resolve_layers(profile, asked, step: int | None = None) -> list[tuple[int, str | None]]:
    """(layer, name it was asked by or None) of every ``--layer`` value, in the order asked and
    each layer once: an index as given, a ``LAYER_PICKS`` name by the layers' mean densities
    over heads (``DensityProfile.layer_means`` at ``step``, or over every step; ties go to the
    lower index; ``median``: the lower median). ``ValueError`` for an index the profile lacks."""
    means = profile.layer_means(step)
    order = sorted(range(profile.layers), key=lambda i: (means[i], i))
    picks = {"sparsest": order[0], "median": order[(len(order) - 1) // 2],
             "densest": max(range(profile.layers), key=lambda i: (means[i], -i))}
    out: list[tuple[int, str | None]] = []
    for value in asked:
        if isinstance(value, str):
            layer, name = picks[value], value
        elif not 0 <= value < profile.layers:
            raise ValueError(f"--layer {value}: {profile.source} has layers 0 to {profile.layers - 1}")
        else:
            layer, name = value, None
        if layer not in [i for i, _ in out]:
            out.append((layer, name))
    return out


def profile_workloads(args, geom, *, verbose: bool = True, rows: int = 128) -> tuple[list[LayerWorkload], dict]:
    """The ``--layer`` layers of ``--density-profile`` with their calibrated heads (read from
    ``--calibration``, else fitted now with ``rows`` query rows per head and, where
    ``verbose``, written to ``OUT/density-profile/``), and the result file's fields saying
    where they came from. Any fault of the files or the layers is refused in one line."""
    from ..workloads.calibration import CALIBRATION_MIX, Calibration, calibrate_layer, read_calibration
    from ..workloads.density import read_profile

    try:
        profile = read_profile(args.density_profile, expected=geom)
        grid = profile.mean_over_steps() if args.step is None else profile.step(args.step)
        layers = resolve_layers(profile, args.layer, args.step)
        means = profile.layer_means(args.step)
        written = None
        if args.calibration is not None:
            cal = read_calibration(args.calibration, geometry=geom, source=profile.source, step=args.step,
                                   chosen_layers=True)
            have = [ly.layer for ly in cal.layers]
            missing = [i for i, _ in layers if i not in have]
            if missing:
                raise ValueError(f"--calibration {args.calibration}: no fit of layer {', '.join(map(str, missing))} "
                                 f"(it holds {', '.join(map(str, have))})")
        else:
            seed = 0 if args.seed is None else args.seed
            fits = {}
            for n, (i, name) in enumerate(layers, 1):
                t0 = time.perf_counter()
                if verbose:
                    print(f"calibrating layer {i}{f' ({name})' if name else ''} of {geom.name} to "
                          f"{profile.source}, {n}/{len(layers)} ...", flush=True)
                fits[i] = calibrate_layer(geom, grid[i], layer=i, seed=seed, mix=CALIBRATION_MIX,
                                          mass=profile.mass, rows=rows)
                if verbose:
                    print(f"  layer {i}: {100 * fits[i].share_within():.0f} % of heads within tolerance "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
            cal = Calibration(model=geom.name, source=profile.source, step=args.step, mass=profile.mass,
                              seed=seed, rows=rows, mix=CALIBRATION_MIX,
                              layers=tuple(fits[i] for i in sorted(fits)))
            if verbose:
                name = profile_name(geom.name, args.density_profile, args.step)
                written = cal.write(Path(args.out) / PROFILE_DIR / (
                    f"calibration-{name}-layer{'_'.join(str(i) for i in sorted(fits))}.json"))
                print(f"wrote {written} (pass it as --calibration next time)", flush=True)
    except (OSError, ValueError) as e:
        refuse("attention", str(e))
    fits = {ly.layer: ly for ly in cal.layers}
    workloads = [LayerWorkload(layer=i, pick=name, density=means[i], within=fits[i].share_within(),
                               heads=fits[i].params(), seed=cal.seed, mix=cal.mix) for i, name in layers]
    extra = {"workload": PROFILE_WORKLOAD, "density_profile": str(args.density_profile), "source": profile.source,
             "step": args.step, "calibration": str(written or args.calibration),
             "layers": [w.layer for w in workloads]}
    return workloads, extra


def _env_text(row: dict, sep: str, end: str = "", first: str = "") -> str:
    """A row's environment variables as ``NAME=VALUE`` items ('' for a default row; rows
    written before 0.2.0 may carry an ``env``, which is how they are told apart)."""
    env = row.get("env") or {}
    return first + sep.join(f"{n}={v}" for n, v in env.items()) + end if env else ""


def cycling(sets: list, fn):
    """A call of ``fn(*sets[i])`` that takes the next input set each time it is called."""
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(sets)
        return fn(*sets[i])
    return call


def write_rows(rows: list[dict], model: str, args, extra: dict | None) -> Path:
    """Write (or extend) the run's result file: the preset's in ``--out``, or, for a
    ``--density-profile`` run (``extra``: its file fields), one named after the profile and
    step in ``OUT/density-profile/``, where nothing that looks up a preset's results goes."""
    if extra is None:
        return write_result("attention", model, rows, args.out)
    return write_result("attention", profile_name(model, args.density_profile, args.step), rows,
                        Path(args.out) / PROFILE_DIR, extra=extra)


def make_inputs(geom, placement, rank: int, device, dtype, seed: int, workload: LayerWorkload | None = None):
    """This rank's placed slice of synthetic q, k (model RoPE structure) and random v;
    ``workload``: one profile layer's calibrated heads instead of the drawn ones (the q/k of its
    layer index, seed and mix)."""
    from ..workloads.synthetic import token_qk

    tokens = placement.perm[placement.token_slice(rank)]
    if workload is None:
        q, k = token_qk(geom, seed=seed, tokens=tokens, device=device, dtype=torch.float32)
    else:
        q, k = token_qk(geom, seed=workload.seed, tokens=tokens, device=device, dtype=torch.float32,
                        layer=workload.layer, heads=workload.heads, mix=workload.mix)
    g = torch.Generator(device=device).manual_seed(seed + 17 + rank)
    v = torch.randn(q.shape, generator=g, device=device, dtype=torch.float32)
    return tuple(x.to(dtype).contiguous() for x in (q, k, v))


def _max(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _configs(args, world: int, heads: int) -> list[tuple[str, str, str, str | None]]:
    """(strategy, placement, transport, ablation) of every row."""
    from ..strategies import strategy_names, strategy_spec
    from ..strategies.auto import AUTO, PLANNED

    ce = COPY_ENGINE[args.fabric]
    rows = []
    for s in args.strategy:
        if s == AUTO:  # on its planned strategy's placement, over NCCL and the fabric's copy engine
            rows += [(AUTO, strategy_spec(PLANNED).placement, t, None)
                     for t in ("nccl",) + (() if args.no_copy_engine else (ce,))]
            continue
        spec = strategy_spec(s)
        if spec.heads_divisible and heads % world:
            continue
        # a strategy registered ``copy_engine`` also runs over the fabric's copy-engine transport
        transports = ("nccl",) + ((ce,) if spec.copy_engine and not args.no_copy_engine else ())
        rows += [(s, spec.placement, t, None) for t in transports]
    if args.ablation:  # each strategy's registered ``ablation`` rows, in registration order
        rows += [(s, placement, ce if t == "copy-engine" else t, what)
                 for s in strategy_names() for placement, t, what in strategy_spec(s).ablation]
    return rows


def check_strategies(args) -> None:
    """Fill the default ``--strategy`` (every registered one, then auto) and refuse an unknown
    strategy or kernel name in one line, listing the registered ones."""
    from ..kernels import kernel_names
    from ..strategies import strategy_names
    from ..strategies.auto import AUTO

    known = (*strategy_names(), AUTO)
    if args.strategy is None:
        args.strategy = list(known)
    check_names("attention", "--strategy", args.strategy, known)
    check_names("attention", "--kernel", [args.kernel], kernel_names(with_auto=True))


def ablation_config(ablation: str | None) -> dict:
    """``SparspConfig`` fields of an ablation row: chunking and the CUDA-graph plan stage stay
    off until their own steps (each added to the copy-engine row: the drain payload in 4 head
    groups; the plan stage replayed as a graph); rows that are no ablation use the defaults."""
    if ablation is None:
        return {}
    return {"chunks": 1, "drain_chunks": 4 if "chunked drain" in ablation else 1,
            "cuda_graphs": "CUDA graphs" in ablation, "local_first": "local first" in ablation}


def main(args) -> int:
    from dataclasses import replace

    from rich.table import Table

    from .. import SparspConfig, sp_attention
    from ..geometry import preset
    from ..placement import make_placement
    from ..strategies import close_transports, get_transport
    from ..strategies.auto import AUTO
    from ..strategies.base import PhaseTimer

    if args.iters < 10:
        refuse("attention", "--iters must be >= 10 (medians of at least ten timed iterations)")
    if args.out is None:
        args.out = default_out(torch.cuda.is_available())
    check_out("attention", "--out", args.out)
    check_attention(args)
    check_strategies(args)
    overrides = config_overrides(args.config, reserved=RESERVED)
    geom = preset(args.model)
    if not args.text:
        geom = replace(geom, text_tokens=0)
    workloads, extra = [None], None  # None: the preset's synthetic heads, one set of rows
    if args.density_profile is not None:
        # read and fitted before the process group starts: a bad file ends every rank with one
        # line, and no rank waits for a peer while the heads are fitted
        workloads, extra = profile_workloads(args, geom, verbose=os.environ.get("RANK", "0") == "0")
        args.seed = workloads[0].seed  # the seed the heads were fitted with
    elif args.seed is None:
        args.seed = 0
    if not torch.cuda.is_available():
        refuse("attention", "needs CUDA GPUs (run it under torchrun on a GPU machine); this machine has none")
    gbps = args.link_gbps or link_gbps(args.fabric, args.out)
    if gbps is None:
        refuse("attention", f"no 256 MiB transport row for fabric {args.fabric} in {args.out}; run `sparsp bench "
                            "transport` first or pass --link-gbps")
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    rank, world, device = init_distributed()
    console = wide_console() if rank == 0 else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows, dense = [], None
    one_gpu = dist.new_group([0]) if world > 1 else None
    for n, (workload, cdf) in enumerate((w, c) for w in workloads for c in args.cdf):
        if n % len(args.cdf) == 0:
            inputs = {}  # a new layer (or the preset's one): the last layer's inputs go
        timed = []  # (row without its times, the call): timed together below
        for strategy, kind, transport, ablation in _configs(args, world, geom.heads):
            if kind not in inputs:  # every placement's inputs stay: the rows are timed together
                pl = make_placement(kind, geom, world)
                inputs[kind] = (pl, [make_inputs(geom, pl, rank, device, dtype, args.seed + i, workload)
                                     for i in range(args.input_sets)])
            pl, sets = inputs[kind]
            q, k, v = sets[0]
            if dense is None:
                dense = dense_tflops(q, k if world == 1 else torch.cat([k] * world, 1),
                                     v if world == 1 else torch.cat([v] * world, 1), args.kernel)
            cfg = SparspConfig(cdf_threshold=cdf, block_size=geom.block_size, transport=transport,
                               kernel=args.kernel, timeout_s=300.0,
                               **(overrides | ablation_config(ablation)))
            t = get_transport(transport, None, device, cfg.timeout_s, local=cfg.local_transport)
            attend = lambda q, k, v, strategy=strategy, cfg=cfg: sp_attention(  # noqa: E731
                q, k, v, strategy=strategy, config=cfg)
            call = cycling(sets, attend)  # the timed call: the next set each time
            first = lambda: attend(q, k, v)  # noqa: E731  (the bytes and split: the first set)
            for other in sets[1:]:  # every set's first call (eager plan stage, capture) before timing
                attend(*other)
            first()
            t.fence()
            t.reset_counters()
            first()
            t.fence()
            moved = torch.tensor([t.total_received], dtype=torch.long, device=device)
            most = moved.clone()
            dist.all_reduce(moved)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            split, mask_density, flops, chosen = _split(q, k, v, strategy, cfg, t, PhaseTimer, device)
            stem = None if args.torch_profile is None else args.torch_profile / (
                f"{geom.name}-{args.fabric}-{strategy}-{t.name}-{kind}-cdf{cdf}"
                + ("" if workload is None else f"-layer{workload.layer}")
                + (f"-{ablation.replace(' ', '').replace(',', '_')}" if ablation else "")
                + "".join(f"-{key}{value}" for key, value in overrides.items()) + f"-r{rank}")
            syncs, colls = count_syncs_and_collectives(call, stem)
            c_ms = _max(flops, device) / (dense[0] * 1e9)
            t_ms = int(most.item()) / (gbps * 1e6)
            row = {"model": geom.name, "tokens": geom.num_tokens, "heads": geom.heads,
                   "head_dim": geom.head_dim, "ranks": world, "fabric": args.fabric, "cdf": cdf,
                   "strategy": strategy, "transport": t.name, "placement": kind,
                   "kernel": args.kernel, "median_ms": None, "min_ms": None, "iters": None,
                   "timing": "sequential" if args.sequential else "interleaved",
                   "bytes_moved": int(moved.item()),
                   "bytes_max_rank": int(most.item()), "density": mask_density,
                   **{key: round(split.get(key, 0.0), 3) for key in SPLIT},
                   "pack_side_ms": round(split["pack_side_ms"], 3),
                   "transfer_ms": round(split.get("transfer_ms", 0.0), 3),
                   "host_syncs": syncs, "collectives": colls, "link_gbps": round(gbps, 2),
                   "dense_tflops": round(dense[0], 1), "dense_kernel": dense[1],
                   "compute_bound_ms": round(c_ms, 3), "transfer_bound_ms": round(t_ms, 3),
                   "bound_ms": round(max(c_ms, t_ms), 3), "efficiency": None, "ablation": ablation,
                   "cuda_graphs": cfg.cuda_graphs, "local_first_config": cfg.local_first,
                   "local_first": split["local_first"], "drain_chunks": split["drain_chunks"],
                   "auto_choice": chosen if strategy == AUTO else None, "config": overrides or None,
                   "head_order": "density",  # a head-sharded strategy's heads: by density (ulysses)
                   "input_sets": args.input_sets, **({} if workload is None else workload.row_fields())}
            timed.append((row, call))
        if not args.no_1gpu:  # timed with the rows above: the comparison the targets make
            timed += _one_gpu_rows(args, geom, cdf, dtype, device, rank, one_gpu, dense, gbps, workload)
        calls = [call for _, call in timed]
        if args.sequential:
            all_times = [time_ms(c, warmup=args.warmup, iters=args.iters, device=device) for c in calls]
        else:
            all_times = time_interleaved(calls, warmup=args.warmup, iters=args.iters, device=device)
        for (row, _), times in zip(timed, all_times):
            if row is None:  # a one-GPU row: rank 0 reports it
                continue
            med = median(times)
            row.update(median_ms=round(med, 3), min_ms=round(min(times), 3), iters=len(times),
                       efficiency=round(row["bound_ms"] / med, 3))
            rows.append(row)
            if console:
                console.print(("" if workload is None else f"layer {workload.layer:<3d} ")
                              + f"{row['strategy']:12s} {row['placement']:10s} {row['transport']:5s} "
                              + _env_text(row, " ", " ")
                              + f"cdf {cdf}: {med:.2f} ms (bound {row['bound_ms']:.2f}, eff "
                              f"{row['efficiency']:.2f}); split "
                              + ", ".join(f"{key[:-3]} {row[key]:.1f}" for key in SPLIT)
                              + f"; {row['host_syncs']} syncs, {row['collectives']} collectives")
    if rank == 0:
        path = write_rows(rows, geom.name, args, extra)
        table = Table(title=f"{geom.name}, {world} ranks, fabric {args.fabric}"
                      + ("" if extra is None else f", {extra['source']} step {args.step or 'mean'}"))
        layered = extra is not None
        for c in (("layer", "profile density") if layered else ()) + (
                "strategy", "transport", "placement", "ablation", "cdf", "median ms", "bound ms",
                "eff", "mask", "compute", "merge", "exposed", "syncs", "coll", "GiB max"):
            table.add_column(c)
        for r in rows:
            table.add_row(*((f"{r['layer']}" + (f" ({r['layer_pick']})" if r["layer_pick"] else ""),
                             f"{r['profile_density']:.3f}") if layered else ()),
                          r["strategy"], r["transport"], r["placement"],
                          r["ablation"] or _env_text(r, " "),
                          str(r["cdf"]), f"{r['median_ms']:.2f}", f"{r['bound_ms']:.2f}",
                          f"{r['efficiency']:.2f}", f"{r['mask_ms']:.1f}", f"{r['compute_ms']:.1f}",
                          f"{r['merge_ms']:.1f}", f"{r['exposed_comm_ms']:.1f}", str(r["host_syncs"]),
                          str(r["collectives"]), f"{r['bytes_max_rank'] / 2**30:.3f}")
        console.print(table)
        console.print(f"wrote {path}")
        plot(path)
    dist.barrier()
    close_transports()
    dist.destroy_process_group()
    return 0


def _split(q, k, v, strategy, cfg, transport, PhaseTimer, device):
    """One timed call: the slowest rank's phase times, the mask density, this rank's FLOPs."""
    from .. import sp_attention
    from ..plan import gather_metadata
    from ..strategies import strategy_spec

    timer = PhaseTimer()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    sp_attention(q, k, v, strategy=strategy, config=cfg, _timer=timer)
    end.record()
    end.synchronize()
    total = start.elapsed_time(end)
    s = timer.summary()
    split = {f"{key}_ms": s.get(key, 0.0) for key in ("mask", "pack", "compute", "merge", "transfer")}
    # a pack on the side stream (Call.side) overlaps the local kernel: not on the compute
    # stream's path, so not subtracted; the compute stream's wait for it is exposed time
    split["exposed_comm_ms"] = max(0.0, total - sum(split[f"{key}_ms"] for key in
                                                    ("mask", "pack", "compute", "merge")))
    split["pack_side_ms"] = s.get("pack_side", 0.0)
    split["pack_ms"] += split["pack_side_ms"]
    split = {key: _max(value, device) for key, value in split.items()}
    split["local_first"] = timer.local_first  # what this call did (the config may leave it open)
    split["drain_chunks"] = timer.drain_chunks  # sparsp: messages of the last round's payload
    transport.fence()
    from ..strategies import auto

    if strategy == auto.AUTO:
        strategy = auto.last_decision().strategy
    meta = gather_metadata(q, k, v, None, cfg, strategy, sparse=strategy_spec(strategy).sparse)
    sh = meta.shapes
    mask = meta.block_mask(cfg)[:, :, sh.blocks_of(sh.rank)] if strategy_spec(strategy).sparse else None
    d = torch.tensor([0.0 if mask is None else float(mask.sum()), 1.0 if mask is None else mask.numel()],
                     dtype=torch.float64, device=device)
    if mask is None:
        d[0] = d[1]
    dist.all_reduce(d)
    return split, round(float(d[0] / d[1]), 4), kept_flops(mask, sh), strategy


def _one_gpu_rows(args, geom, cdf, dtype, device, rank, group, dense, gbps, workload=None) -> list[tuple]:
    """``1gpu-dense`` and ``1gpu-sparse`` over the whole sequence, on rank 0: (row without its
    times, call) for each, timed with the strategies' rows. Every rank gets the same number of
    entries (the timing is collective); on the other ranks the row is None and the call does
    nothing."""
    from .. import SparspConfig, sp_attention
    from ..placement import make_placement
    from ..plan import gather_metadata
    from ..strategies.registry import strategies_where

    if rank != 0:
        return [(None, lambda: None), (None, lambda: None)]
    pl = make_placement("contiguous", geom, 1)
    q, k, v = make_inputs(geom, pl, 0, device, dtype, args.seed, workload)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    flops = 4.0 * qh.shape[0] * qh.shape[1] * qh.shape[2] * kh.shape[2] * qh.shape[3]
    _, name = dense_tflops(q, k, v, args.kernel)
    dense_row = _one_row(geom, args, cdf, "1gpu-dense", name, flops / (dense[0] * 1e9), 1.0, gbps, dense, workload)
    cfg = SparspConfig(cdf_threshold=cdf, block_size=geom.block_size, transport="nccl",
                       kernel=args.kernel, timeout_s=300.0)
    # the primary strategy on a group of one: the whole sequence, the strategies' kernel and
    # mask, no packing
    primary = strategies_where(primary=True)[0]
    sparse = lambda: sp_attention(q, k, v, group=group, strategy=primary, config=cfg)  # noqa: E731
    sparse()
    meta = gather_metadata(q, k, v, group, cfg, primary, sparse=True)
    whole = meta.block_mask(cfg)
    sparse_row = _one_row(geom, args, cdf, "1gpu-sparse", args.kernel,
                          kept_flops(whole, meta.shapes) / (dense[0] * 1e9),
                          float(whole.float().mean()), gbps, dense, workload)
    return [(dense_row, dense_call(q, k, v, name)), (sparse_row, sparse)]


def _one_row(geom, args, cdf, strategy, kernel, c_ms, density, gbps, dense, workload=None) -> dict:
    """A one-GPU row; ``median_ms``, ``min_ms``, ``iters`` and ``efficiency`` come with its times."""
    return {"model": geom.name, "tokens": geom.num_tokens, "heads": geom.heads, "head_dim": geom.head_dim,
            "ranks": 1, "fabric": args.fabric, "cdf": cdf, "strategy": strategy, "transport": "none",
            "placement": "none", "kernel": kernel, "median_ms": None, "min_ms": None, "iters": None,
            "timing": "sequential" if args.sequential else "interleaved", "bytes_moved": 0, "bytes_max_rank": 0, "density": round(density, 4),
            **{key: 0.0 for key in SPLIT}, "transfer_ms": 0.0, "pack_side_ms": 0.0, "host_syncs": None, "collectives": 0,
            "link_gbps": round(gbps, 2), "dense_tflops": round(dense[0], 1), "dense_kernel": dense[1],
            "compute_bound_ms": round(c_ms, 3), "transfer_bound_ms": 0.0, "bound_ms": round(c_ms, 3),
            "efficiency": None, "ablation": None, **({} if workload is None else workload.row_fields())}


def plot(path: Path) -> Path:
    """Stacked time split per row (like the paper's Figure 13), the bound as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = [r for r in doc["rows"] if "bound_ms" in r]  # rows of earlier versions lack the split
    if not rows:
        return Path(path).with_suffix(".png")
    fabrics = list(dict.fromkeys(r["fabric"] for r in rows))
    fig, axes = plt.subplots(1, len(fabrics), figsize=(max(8, 1.0 * len(rows) / max(1, len(fabrics)) + 4), 5),
                             squeeze=False)
    colors = {"mask_ms": "#8c8c8c", "pack_ms": "#bcbd22", "compute_ms": "#1f77b4", "merge_ms": "#17becf",
              "exposed_comm_ms": "#d62728"}
    for ax, fab in zip(axes[0], fabrics):
        rs = [r for r in rows if r["fabric"] == fab]
        xs = range(len(rs))
        bottom = [0.0] * len(rs)
        for key, color in colors.items():
            vals = [r.get(key, 0.0) or 0.0 for r in rs]
            ax.bar(xs, vals, bottom=bottom, color=color, label=key[:-3])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r["median_ms"] for r in rs], marker="_", s=400, color="k", label="median", zorder=3)
        ax.scatter(xs, [r["bound_ms"] for r in rs], marker="v", color="g", label="bound", zorder=3)
        labels = [(f"layer {r['layer']}\n" if r.get("layer") is not None else "")
                  + f"{r['strategy']}\n{r['transport']}" + (f"\n{r['ablation']}" if r.get("ablation") else "")
                  + _env_text(r, "\n", first="\n") for r in rs]
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=60, ha="right")
        ax.set(ylabel="ms per attention call", title=f"{rows[0]['model']}, {fab}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"attention time split, {doc['machine']}")
    from .common import save_figure

    return save_figure(fig, path)
