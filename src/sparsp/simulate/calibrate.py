"""``sparsp simulate --fit-profile``: a machine profile fitted to ``bench transport`` and ``bench
kernel`` results of its own kind of machine — never to ``bench attention`` rows
(docs/simulate.md "--fit-profile").

* Machines: a result file records the machine it ran on (``machine``: ``2xH200``, ``1xH100…``,
  ``cpu``); a file of another GPU than the profile describes (its description's ``N×GPU``) is
  refused, naming the file: a CPU kernel file fitted into an H200 profile once predicted
  ``sparsp`` at 59.2 ms instead of 38.9 ms. Discovery takes only files of the profile's GPU.
* Transports: per transport, ``ms = latency + bytes / bandwidth`` on the single-exchange rows
  not under load (``fit_transport``); the capacities scaled so the modelled two-GPU exchange
  equals the fastest transport's fit; every transport's share of it as ``efficiency``. The
  same fit on its ``under_load`` rows (exchanges while an attention kernel runs on both GPUs)
  gives its ``loaded_efficiency``, the share while a compute step runs at either end.
* Kernels: per head dim, the median rate of the strategies' block-sparse kernel
  (``KernelFigure``, the fallback); per shape, layout and density the rows on the benchmark's
  own masks and the dense row (``KernelPoint``), which ``Profile.kernel_rate`` interpolates.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

from ..cost.profiles import KernelFigure, KernelPoint, Profile, TransportFigure
from ..cost.flows import exchange_gbps

SPARSE_KERNELS = ("fa4", "flex")
"""The block-sparse kernels ``kernel="auto"`` runs, in its order of preference (``fa4`` on sm90
GPUs with the ``sparsp[fa4]`` extra, else ``flex``): calibration takes the first one a
``bench kernel`` file has rows of, per head dim."""
STRATEGY_LAYOUTS = ("local", "packed")
"""``bench kernel`` layouts the strategies run: the local shard as given (``LocalKV``) and a
received payload (``KVBuffer``); rows without a ``layout`` (older files) count as both."""
OWN_MASKS = "cdf"
"""``bench kernel``'s ``mask`` label of its rows on ``workloads.synthetic_masks`` (``cdf 0.9``):
the masks ``simulate`` runs. Its random per-head masks (``random 0.25``) are another structure
(more, shorter runs of kept blocks per row: 5–10 % slower at the same density) and feed only
the per-head-dim median."""


def read_result(path: Path, kinds: tuple[str, ...], option: str | None = None) -> dict:
    """A ``sparsp bench`` result file of one of ``kinds``; one-line ValueError naming ``option``
    (the flag that gave it) and the file: empty, not UTF-8, not JSON, or another kind of file."""
    from ..inputs import read_json

    where = f"{option} {path}" if option else str(path)
    doc = read_json(path, option, what="sparsp bench result (JSON)")
    if not isinstance(doc, dict) or doc.get("kind") not in kinds or not isinstance(doc.get("rows"), list) \
            or not all(isinstance(r, dict) for r in doc["rows"]):
        got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where}: expected a sparsp bench result of kind {' or '.join(kinds)} "
                         f"(a JSON object with kind and rows), got {'kind ' if isinstance(doc, dict) else ''}{got!r}")
    return doc


def _gpu(name: str) -> str:
    """A GPU name as compared: no spaces, lower case (``RTX PRO 6000`` = ``RTXPRO6000``)."""
    return name.replace(" ", "").lower()


def machine_of(path: Path, doc: dict | None = None) -> str | None:
    """The machine a ``sparsp bench`` result ran on: its ``machine`` field, else the machine part
    of its name (``<kind>-<subject>-<machine>-<date>.json``); None when neither says."""
    if doc is not None and isinstance(doc.get("machine"), str) and doc["machine"]:
        return doc["machine"]
    parts = Path(path).stem.split("-")
    return parts[-4] if len(parts) >= 6 and re.fullmatch(r"\d{4}", parts[-3]) else None


def profile_gpu(profile: Profile) -> str | None:
    """The GPU a profile describes, as its description names it after ``N×`` (``2×H200, NV18
    NVLink…`` → ``H200``; every built-in profile, and every profile fitted from one, has it);
    None when the description names none."""
    m = re.match(r"\s*\d+\s*[×x]\s*(.+?)(?=,|:|\s+(?:on|with|without|over|via)\s|$)", profile.description)
    return m.group(1).strip() if m else None


def same_gpu(machine: str, gpu: str) -> bool:
    """Whether ``machine`` (``2xH200``, ``1xH10080GBHBM3``, ``cpu``, as ``sparsp bench`` writes
    it) has the GPU ``gpu``: its name starts with it (spaces and case aside), and what follows is
    no further model digit (``H200`` is not ``H20``; ``H100 80GB`` is ``H100``)."""
    name, want = _gpu(re.sub(r"^\d+x", "", machine)), _gpu(gpu)
    return name.startswith(want) and not re.match(r"\d(?!\d*gb)", name[len(want):])


def check_machine(profile: Profile, path: Path, doc: dict, option: str | None = None) -> None:
    """``ValueError`` naming ``path`` when it ran on another machine than the GPU ``profile``
    describes (nothing to check when either is unknown)."""
    gpu, machine = profile_gpu(profile), machine_of(path, doc)
    if gpu is not None and machine is not None and not same_gpu(machine, gpu):
        where = f"{option} {path}" if option else str(path)
        raise ValueError(f"{where}: measured on {machine}, but profile {profile.name} describes {gpu} GPUs; "
                         f"fit a profile to results of its own machine")


def describe_inputs(profile: Profile, paths) -> list[str]:
    """One line per result file a fit reads: its path, kind and machine (what ``--fit-profile``
    prints before it fits), each file checked first (``read_result``, ``check_machine``)."""
    lines = []
    for p in paths:
        doc = read_result(p, ("transport", "kernel"), "--fit-profile")
        check_machine(profile, p, doc, "--fit-profile")
        lines.append(f"fitting {profile.name} to {p} ({doc['kind']}, {machine_of(p, doc) or 'machine not recorded'})")
    return lines


def fit_transport(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``ms = latency + bytes / bandwidth`` to (bytes, ms) points → (latency_ms, GB/s).

    Weighted least squares with weight 1/ms per squared residual: between an absolute fit
    (large messages decide everything, the latency comes out unreliable) and a relative one
    (the many small sizes pull the bandwidth off: 485 instead of 370 GB/s for ``ipc``)."""
    if len(points) < 2:
        raise ValueError(f"a transport fit needs at least 2 message sizes, got {len(points)}")
    a11 = a12 = a22 = b1 = b2 = 0.0  # normal equations of Σ (α + γ·bytes − ms)² / ms
    for nbytes, ms in points:
        w = 1.0 / ms
        a11, a12, a22 = a11 + w, a12 + w * nbytes, a22 + w * nbytes * nbytes
        b1, b2 = b1 + w * ms, b2 + w * nbytes * ms
    det = a11 * a22 - a12 * a12
    alpha, gamma = ((a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0 or gamma <= 0:  # no latency term fits: bandwidth only
        alpha, gamma = 0.0, b2 / a22
    return alpha, 1e-6 / gamma


def transport_points(rows: list[dict], fabric: str, *, loaded: bool) -> dict[str, list[tuple[float, float]]]:
    """(bytes, ms) per transport of ``bench transport`` rows on ``fabric``: the single
    exchanges (``inflight`` 1) alone, or those ``under_load`` with the exchange in flight first
    (the order the model's loaded rate stands for; rows issued behind the attention are not
    fitted)."""
    out: dict[str, list] = {}
    for r in rows:
        if (r.get("fabric") == fabric and bool(r.get("under_load")) == loaded and r.get("median_ms")
                and r.get("inflight", 1) == 1  # the fit is per single message
                and r.get("load_order", "exchange first") == "exchange first"):
            out.setdefault(r["transport"], []).append((float(r["bytes"]), float(r["median_ms"])))
    return out


def calibrate(profile: Profile, paths) -> tuple[Profile, dict]:
    """Fit ``profile`` to ``bench transport`` rows (latency and bandwidth per transport, on the
    profile's kind of fabric, alone and under load) and ``bench kernel`` rows (TFLOP/s per head
    dim, and per shape, layout and density). Bandwidth capacities are scaled together so the
    modelled two-GPU exchange reproduces the fastest measured transport; the others get their
    measured share as efficiency, and every transport its share under load."""
    report: dict = {"files": [str(p) for p in paths], "transports": {}, "kernels": {}}
    transport_rows, kernel_rows = [], []
    for p in paths:
        doc = read_result(p, ("transport", "kernel"))
        check_machine(profile, p, doc)
        (transport_rows if doc["kind"] == "transport" else kernel_rows).extend(doc["rows"])
    fits, loaded = {}, {}
    for name, pts in transport_points(transport_rows, profile.bench_fabric, loaded=False).items():
        latency, gbps = fit_transport(sorted(pts))
        worst = max(abs(latency + b / (gbps * 1e6) - ms) / ms for b, ms in pts)
        fits[name] = (latency, gbps)
        report["transports"][name] = {"latency_ms": round(latency, 4), "gbps": round(gbps, 2),
                                      "sizes": len(pts), "max_rel_error": round(worst, 3)}
    if transport_rows and not fits:
        raise ValueError(f"no transport rows for fabric {profile.bench_fabric!r} (profile {profile.name}) "
                         f"in {', '.join(map(str, paths))}")
    for name, pts in transport_points(transport_rows, profile.bench_fabric, loaded=True).items():
        if name in fits and len(pts) >= 2:
            loaded[name] = fit_transport(sorted(pts))
            slow = [float(r["attention_slowdown"]) for r in transport_rows if r.get("under_load")
                    and r.get("transport") == name and r.get("fabric") == profile.bench_fabric
                    and r.get("load_order", "exchange first") == "exchange first"
                    and r.get("attention_slowdown") is not None]
            # The loaded rows run back to back without the gate, so their intercept holds the
            # host's issue of each exchange (and the slot transports' host-polled waits): only
            # the bandwidth is taken; the attention's slowdown is reported, not modelled
            # (−2 … +5 % on the committed file, of either sign at one size).
            report["transports"][name]["under_load"] = {
                "latency_ms": round(loaded[name][0], 4), "gbps": round(loaded[name][1], 2), "sizes": len(pts),
                "attention_slowdown_median": round(statistics.median(slow), 4) if slow else None}
    if fits:
        ref = max(fits, key=lambda n: fits[n][1])
        factor = fits[ref][1] / exchange_gbps(profile)
        profile = profile.scaled(factor)
        report["bandwidth_scale"] = round(factor, 4)

        def figure(name: str, old: TransportFigure | None = None) -> TransportFigure:
            latency, gbps = fits[name]
            under = loaded.get(name)
            return TransportFigure(name=name, efficiency=min(1.0, gbps / fits[ref][1]), latency_ms=latency,
                                   loaded_efficiency=None if under is None else min(1.0, under[1] / fits[ref][1]))

        known = {t.name for t in profile.transports}
        figures = [figure(t.name) if t.name in fits else t for t in profile.transports]
        figures += [figure(n) for n in fits if n not in known]
        profile = replace(profile, transports=tuple(figures))
        if "nccl" in fits:  # the call's small collectives (metadata all-gather, fence) ride on NCCL
            profile = replace(profile, sync_ms=fits["nccl"][0])
            report["sync_ms"] = round(fits["nccl"][0], 4)
    if kernel_rows:
        profile, report["kernels"] = calibrate_kernels(profile, kernel_rows)
    name = profile.name if profile.name.endswith("-calibrated") else f"{profile.name}-calibrated"
    return replace(profile, name=name, sources=profile.sources + tuple(report["files"])), report


def _sparse(row: dict, kernel: str) -> bool:
    """A row of ``kernel`` below density 1 in a layout the strategies run."""
    return (row.get("kernel") == kernel and bool(row.get("tflops_kept")) and float(row.get("density", 1.0)) < 1.0
            and row.get("layout", "local") in STRATEGY_LAYOUTS)


def kernel_points(rows: list[dict], kernel: str) -> list[KernelPoint]:
    """``kernel``'s rows that carry their shape (``heads``, ``head_dim``, ``k_rows``): its sparse
    rows on the benchmark's own masks (``OWN_MASKS``) per layout and density, and its dense row
    (density 1) of each shape that has sparse ones."""
    def point(r: dict, layout: str, density: float) -> KernelPoint:
        return KernelPoint(shape=str(r.get("shape", "")), heads=int(r["heads"]), head_dim=int(r["head_dim"]),
                           tokens=int(r["k_rows"]), layout=layout, density=density,
                           tflops=float(r["tflops_kept"]))

    shaped = [r for r in rows if r.get("kernel") == kernel and r.get("tflops_kept")
              and all(isinstance(r.get(key), int) and r[key] > 0 for key in ("heads", "head_dim", "k_rows"))]
    sparse = [point(r, r["layout"], float(r["density"])) for r in shaped
              if _sparse(r, kernel) and "layout" in r and str(r.get("mask", "")).startswith(OWN_MASKS)]
    keys = {(p.heads, p.head_dim, p.tokens) for p in sparse}
    dense = [point(r, "dense", 1.0) for r in shaped if r.get("layout") == "dense"
             and (int(r["heads"]), int(r["head_dim"]), int(r["k_rows"])) in keys]
    return sparse + dense


def calibrate_kernels(profile: Profile, rows: list[dict]) -> tuple[Profile, dict]:
    """Per head dim: the strategies' kernel (the first of ``SPARSE_KERNELS`` with rows there)
    → median kept-block TFLOP/s over its sparse rows (density < 1) in the strategies' layouts
    (``STRATEGY_LAYOUTS``), and its ``kernel_points`` per shape; the dense reference → cuDNN
    (``tflops_kept / vs_cudnn``) where given. Head dims without rows keep the profile's figures."""
    figures = {k.head_dim: k for k in profile.kernels}
    points = list(profile.kernel_points)
    report = {}
    for hd in sorted({int(r["head_dim"]) for r in rows if "head_dim" in r}):
        mine = [r for r in rows if int(r.get("head_dim", -1)) == hd]
        sparse, used = [], None
        for kernel in SPARSE_KERNELS:
            sparse = [float(r["tflops_kept"]) for r in mine if _sparse(r, kernel)]
            if sparse:
                used = kernel
                break
        dense = [float(r["tflops_kept"]) / float(r["vs_cudnn"]) for r in mine
                 if r.get("tflops_kept") and r.get("vs_cudnn")]
        old = profile.kernel(hd)
        fig = KernelFigure(head_dim=hd, sparse_tflops=statistics.median(sparse) if sparse else old.sparse_tflops,
                           dense_tflops=statistics.median(dense) if dense else old.dense_tflops)
        figures[hd] = fig
        mine_points = kernel_points(mine, used) if used else []
        points = [p for p in points if p.head_dim != hd] + mine_points
        shapes: dict = {}  # shape → layout → [density, TFLOP/s] as fitted
        for p in mine_points:
            shapes.setdefault(p.shape or f"{p.heads}x{p.head_dim}/{p.tokens}", {}).setdefault(
                p.layout, []).append([round(p.density, 4), round(p.tflops, 1)])
        report[str(hd)] = {"sparse_kernel": used, "sparse_tflops": round(fig.sparse_tflops, 1),
                           "dense_tflops": round(fig.dense_tflops, 1), "sparse_rows": len(sparse),
                           "dense_rows": len(dense), "shapes": shapes}
    return replace(profile, kernels=tuple(figures[h] for h in sorted(figures)), kernel_points=tuple(points)), report


# --- discovery ---------------------------------------------------------------------------------


def newest(kind: str, root: Path = Path("bench/results"), *, per_subject: bool = False,
           gpu: str | None = None) -> list[Path]:
    """The newest ``<kind>-<subject>-<machine>-<date>.json`` under ``root`` (ISO dates sort as
    text): one per (subject, machine) with ``per_subject``, else one per machine; with ``gpu``,
    only machines of that GPU (``same_gpu``)."""
    found: dict[tuple, Path] = {}
    for path in sorted(Path(root).glob(f"{kind}-*.json")):
        machine = machine_of(path)
        if machine is None or (gpu is not None and not same_gpu(machine, gpu)):
            continue
        parts = path.stem.split("-")
        date = "-".join(parts[-3:])
        key = ("-".join(parts[1:-4]), machine) if per_subject else (machine,)
        if key not in found or date >= "-".join(found[key].stem.split("-")[-3:]):
            found[key] = path
    return sorted(found.values())


def discover_calibration(root: Path = Path("bench/results"), profile: Profile | None = None) -> list[Path]:
    """The newest ``bench transport`` result under ``root``, and the ``bench kernel`` result of
    the newest date that covers the most head dims (a one-GPU run over every preset shape
    rather than a run of one shape), ties to the later name; with ``profile``, of machines
    of its GPU only (``profile_gpu``)."""
    gpu = None if profile is None else profile_gpu(profile)
    transports = newest("transport", root, gpu=gpu)[-1:]
    kernels = newest("kernel", root, gpu=gpu)
    if kernels:
        date = max("-".join(p.stem.split("-")[-3:]) for p in kernels)
        kernels = [max((p for p in kernels if p.stem.endswith(date)), key=lambda p: (_head_dims(p), p.name))]
    paths = transports + kernels
    if not paths:
        of = "" if gpu is None else f" of {gpu} GPUs (profile {profile.name})"
        raise ValueError(f"--fit-profile found no transport-*.json{of} under {root}; name the files")
    return paths


def _head_dims(path: Path) -> int:
    """How many head dims a ``bench kernel`` file has rows of (0 if unreadable)."""
    try:
        rows = json.loads(Path(path).read_text()).get("rows", [])
        return len({r.get("head_dim") for r in rows if isinstance(r, dict)})
    except (OSError, ValueError, AttributeError):
        return 0


__all__ = ["OWN_MASKS", "SPARSE_KERNELS", "STRATEGY_LAYOUTS", "calibrate", "calibrate_kernels", "check_machine",
           "describe_inputs", "discover_calibration", "fit_transport", "kernel_points", "machine_of", "newest",
           "profile_gpu", "read_result", "same_gpu", "transport_points"]
