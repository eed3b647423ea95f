"""The per-family counts of one run's misses, and the before → after table of two runs."""

from __future__ import annotations

import json
from pathlib import Path

COUNTS = ("traceback", "hang", "restarts", "outside_read", "wrong_exit")


def table(results: list[dict]) -> dict[str, dict[str, int]]:
    """Per family: probes run and the counts of each kind of miss."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r["family"], {"probes": 0, **dict.fromkeys(COUNTS, 0)})
        if "rc" not in r and not r.get("hang"):
            continue
        row["probes"] += 1
        for key in COUNTS:
            row[key] += int(r[key]) if key != "restarts" else r[key]
    total = {"probes": 0, **dict.fromkeys(COUNTS, 0)}
    for row in out.values():
        for key in total:
            total[key] += row[key]
    out["all"] = total
    return out


def markdown(before: dict, after: dict) -> str:
    """The per-family table, each count 'before → after' (probes run on each side)."""
    head = ["family", "probes", "tracebacks", "hangs", "restarts", "outside reads",
            "wrong exits"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, b in before["families"].items():
        a = after["families"][family]
        cells = [family, f"{b['probes']} → {a['probes']}",
                 *(f"{b[k]} → {a[k]}" for k in COUNTS)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def combine(before_path: Path, after_path: Path, out: Path) -> str:
    """One JSON of both runs (``out``) and the markdown table of them."""
    before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
    out.write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")
    return markdown(before, after)
