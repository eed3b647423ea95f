"""Red-team probes of issue 36: every file and argument a user hands mcpar, crafted to break it.

Each probe is a real ``mcpar ...`` command line run in a subprocess, in a fresh temporary folder,
with the crafted input beside it. ``--src`` chooses the source tree the command imports (its
``src`` goes first on PYTHONPATH), so the same probes run against the code before the fixes and
after them. For each probe it records the exit code, tracebacks, hangs, restarts, reads outside
the input and wrong exits (``redteam/runner.py`` says what each means); the probes are in
``redteam/*_probes.py``, their list in ``redteam/probes.py``, the fixtures in
``redteam/fixtures.py``, the table in ``redteam/table.py``.

    python bench/redteam_probes.py --src /tmp/rt-before --out before.json
    python bench/redteam_probes.py --out after.json [--only NAME,NAME]
    python bench/redteam_probes.py --combine before.json after.json \
        --out bench/data/redteam_probes.json   # prints the before → after table
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

# bench/ is on sys.path (this script's folder), as for every bench script's siblings.
from redteam.fixtures import FIX, build_fixtures
from redteam.probe import REPO
from redteam.probes import PROBES
from redteam.runner import run_probe
from redteam.table import COUNTS, combine, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=REPO,
                        help="source tree to probe (its src/ goes first on PYTHONPATH)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--only", default=None, help="comma-separated probe names")
    parser.add_argument("--old", action="store_true",
                        help="the tree is the code before the fixes: skip probes not safe there")
    parser.add_argument("--combine", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="write BEFORE and AFTER's JSON as one to --out; print the table")
    args = parser.parse_args(argv)
    if args.combine:
        if args.out is None:
            parser.error("--combine needs --out")
        print(combine(*args.combine, args.out))
        return 0
    src = args.src.resolve()
    chosen = PROBES
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {p.name for p in PROBES})
        if unknown:
            parser.error(f"--only: unknown probes {unknown}")
        chosen = [p for p in PROBES if p.name in names]
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="rt-fixtures-") as tmp:
        fixtures = Path(tmp)
        FIX.update(build_fixtures(fixtures))
        results = []
        for probe in chosen:
            r = run_probe(probe, src, fixtures, args.old)
            print(f"{probe.name}: " + json.dumps({k: r.get(k) for k in
                  ("rc", "seconds", *COUNTS, "skipped", "error")}), file=sys.stderr, flush=True)
            results.append(r)
    git = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    body = {"src": str(src), "commit": git, "probes": len(results),
            "families": table(results), "results": results}
    text = json.dumps(body, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
