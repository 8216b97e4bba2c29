"""Print a short table of benchmark result files: ``python -m sparsp.bench.report FILE...``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(paths: list[str]) -> str:
    lines = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        lines.append(f"{Path(path).name}  ({doc['machine']}, {doc['date']})")
        if doc["kind"] == "attention":
            lines.append(f"  {'fabric':7s} {'strategy':12s} {'transport':9s} {'placement':10s} {'cdf':>5s} "
                         f"{'median ms':>10s} {'GiB moved':>10s} {'density':>8s}")
            for r in doc["rows"]:
                lines.append(f"  {r['fabric']:7s} {r['strategy']:12s} {r['transport']:9s} {r.get('placement', ''):10s} "
                             f"{r['cdf']:5.2f} {r['median_ms']:10.2f} {r['bytes_moved'] / 2**30:10.3f} {r['density']:8.3f}")
        elif doc["kind"] == "transport":
            lines.append(f"  {'transport':10s} {'fabric':7s} {'MiB':>8s} {'GB/s':>8s} {'load':>5s} {'slowdown':>9s}")
            for r in doc["rows"]:
                if r["bytes"] < 2**24 and not r["under_load"]:
                    continue  # the short table keeps 16 MiB and up
                slow = "" if r["attention_slowdown"] is None else f"{100 * r['attention_slowdown']:+.1f}%"
                lines.append(f"  {r['transport']:10s} {r['fabric']:7s} {r['bytes'] / 2**20:8.0f} {r['gbps']:8.1f} "
                             f"{'yes' if r['under_load'] else 'no':>5s} {slow:>9s}")
        else:
            lines.append(f"  {len(doc['rows'])} rows")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print("usage: python -m sparsp.bench.report RESULT.json ...", file=sys.stderr)
        return 2
    print(summarize(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
