"""Re-price a ranking run's measurements with the cost model as it is now.

What it does
    Reads a JSON written by ``auto_ranking.py`` (its measured steps and the local profile it
    priced them on), prices each of its layouts again with the current code on that profile
    (``parallelism.auto`` with every searched key fixed, as the run did), and prints Spearman's
    rho and the median |error| against the run's measurements, the layouts' rows beside the
    run's own predictions. Seconds, not a half-hour run: it says what a change to the cost model
    does to a run already measured, and the next run says whether that holds.

    ``--set FIELD=JSON`` replaces one field of the saved profile first (``mask_rate_per_thread``,
    ``collectives.rs``, ``notes.crowded_exchange_s``...): for a change to what the profile
    measures, the new measurement taken on this machine is put in the old profile. The profile
    must be this machine's (its key is checked as a run's is).
    A run over emulated nodes (``--nodes``) is priced over the link its workers measured at
    start (each layout's first round), read from its ranking's line.

How to run
    python bench/auto_ranking_reprice.py [bench/data/auto_ranking.json] [--set FIELD=JSON ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from auto_ranking import BASE, LAYOUTS, MODEL, WORKERS, _value, spearman
from bench_workers import emit_result

from mcpar.sim.hardware import LocalProfile, NodeLink
from mcpar.sim.profilestore import PROFILE_ENV, STAMP_FIELDS, save_profile


def _profile_with(doc: dict[str, object], changes: list[str]) -> tuple[LocalProfile, dict]:
    fields = {k: v for k, v in doc.items() if k not in STAMP_FIELDS}
    for change in changes:
        key, _, text = change.partition("=")
        head, _, leaf = key.partition(".")
        if head not in fields or (leaf and not isinstance(fields[head], dict)):
            raise SystemExit(f"--set {change}: the profile has no field {key}")
        value = json.loads(text)
        if leaf:
            fields[head] = {**fields[head], leaf: value}  # type: ignore[dict-item]
        else:
            fields[head] = value
    return LocalProfile(**fields), doc["machine"]  # type: ignore[arg-type,return-value]


def run_nodes(run: dict, row: dict) -> NodeLink | None:
    """The nodes and link a layout of a run over emulated nodes (``--nodes``) was priced on:
    what its workers measured at start in the run's first round (the row's prediction is that
    round's), read from its ranking's line; None for one node."""
    if int(run.get("nodes") or 1) == 1:
        return None
    said = row["ranked_on"][0]
    found = re.search(r"nodes of (\d+) rank\(s\) joined by a ([\d,.]+) Mbit/s link, "
                      r"([\d,.]+) us", said)
    if found is None:
        raise SystemExit(f"the run's ranking does not say its link: {said!r}")
    per_node, mbit, us = found.groups()
    return NodeLink(int(per_node), float(us.replace(",", "")) * 1e-6,
                    float(mbit.replace(",", "")) * 1e6 / 8, "the run's measurement")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", default=Path("bench/data/auto_ranking.json"))
    parser.add_argument("--set", dest="changes", action="append", default=[],
                        metavar="FIELD=JSON", help="replace a field of the run's profile")
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    profile, machine = _profile_with(run["profile"], args.changes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        save_profile(profile, path, machine=machine)
        os.environ[PROFILE_ENV] = str(path)
        # Imported once the profile is in place: the planner reads it where it prices.
        from mcpar.auto_layout import choose_layout
        from mcpar.config import load_config

        rows = []
        for row in run["layouts"]:
            keys = {**BASE, **LAYOUTS[row["layout"]]}
            cfg = load_config(None, MODEL + [f"{k}={_value(v)}" for k, v in keys.items()])
            predicted = choose_layout(cfg, WORKERS, run_nodes(run, row)).chosen.step_s
            measured = row["measured_step_s"]
            rows.append({"layout": row["layout"], "run_predicted_s": row["predicted_step_s"],
                         "predicted_s": round(predicted, 4), "measured_s": measured,
                         "error": round(measured / predicted - 1, 3)})
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    emit_result({
        "run": str(args.run), "profile_changes": args.changes, "layouts": rows,
        "run_spearman_rho": run["spearman_rho"],
        "spearman_rho": round(spearman(predicted, measured), 3),
        "median_abs_step_error": round(statistics.median(abs(r["error"]) for r in rows), 3),
    }, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
