"""Does each term of the cost model earn its place? Drop it, refit, and check held-out runs.

    python -m mcpar.sim.ablation [--restarts 2]

For every term the step is predicted without it: its seconds on the critical path
(``Prediction.breakdown``: attention's s² core, element-wise HBM traffic, recompute, tensor-,
context-, expert-parallel and pipeline point-to-point traffic, per-layer overhead, exposed
data-parallel traffic, the optimizer) or the pipeline bubble are taken out of the step. The six
global parameters are then refitted on the calibration rows for that variant, as they were for
the full model, and both row sets are scored. A term earns its place where dropping it makes
the held-out rows (``holdout_runs.csv``, never fitted on) worse; the calibration rows alone
cannot tell, since refitting absorbs much of any one term there.

Dropping a term's first-order share is an approximation (a term also shapes the pipeline's
schedule), but it asks the question that matters: would the predictions be as good without it?
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mcpar.sim.calibration import (
    StepModel,
    fit,
    model_step_s,
    naive_constant,
    naive_step_s,
    ratios,
    summary,
)
from mcpar.sim.hardware import Efficiency, load_accelerators
from mcpar.sim.runs import Run, packaged_runs, predict_run

# Breakdown categories of the critical path, and what each stands for.
TERMS = {
    "attention": "the attention core (s² scores, flash or unfused)",
    "elementwise": "element-wise HBM traffic (norms, activations, residuals, casts, CE)",
    "recompute": "recomputation of activations (full or selective)",
    "tp_comm": "tensor-parallel collectives",
    "cp_comm": "context-parallel K/V ring, where not hidden",
    "ep_comm": "expert-parallel all-to-alls",
    "p2p_comm": "pipeline point-to-point sends",
    "overhead": "fixed per-layer overhead (launches, syncs)",
    "dp_comm": "exposed data-parallel traffic",
    "zero_comm": "per-micro-batch ZeRO traffic",
    "optimizer": "the optimizer step",
    "bubble": "pipeline fill and drain",
}


def without(term: str) -> StepModel:
    """The model's step with ``term``'s critical-path seconds taken out."""
    def step(run: Run, eff: Efficiency) -> float:
        pred = predict_run(run, eff)
        cut = pred.bubble_s if term == "bubble" else pred.breakdown.get(term, 0.0)
        return max(pred.step_s - cut, 1e-9)

    return step


def touched(runs: Sequence[Run], term: str, share: float = 0.02) -> list[Run]:
    """The rows where ``term`` is at least ``share`` of the full model's step: a median over
    all rows hides a term that matters for a few layouts only (e.g. the MoE rows)."""
    out = []
    for run in runs:
        pred = predict_run(run)
        seconds = pred.bubble_s if term == "bubble" else pred.breakdown.get(term, 0.0)
        if seconds >= share * pred.step_s:
            out.append(run)
    return out


def score(calibration: Sequence[Run], holdout: Sequence[Run], step: StepModel,
          restarts: int, rows_of_term: Sequence[Run] = ()) -> dict[str, object]:
    eff = fit(calibration, restarts=restarts, step=step)
    out: dict[str, object] = {"calibration": summary(ratios(calibration, eff, step)),
                              "holdout": summary(ratios(holdout, eff, step))}
    if rows_of_term:
        out["holdout_rows_it_touches"] = {"rows": len(rows_of_term),
                                          **summary(ratios(rows_of_term, eff, step))}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=2,
                        help="Nelder-Mead restarts per refit (more: slower, steadier)")
    args = parser.parse_args(argv)
    accelerators = load_accelerators(None)
    calibration = [r for r in packaged_runs(accelerators) if r.measured_step_s]
    holdout = [r for r in packaged_runs(accelerators, "holdout_runs.csv") if r.measured_step_s]
    constant = naive_constant(calibration)
    result: dict[str, object] = {
        "rows": {"calibration": len(calibration), "holdout": len(holdout)},
        "full_model": score(calibration, holdout, model_step_s, args.restarts),
        "naive": {name: summary([naive_step_s(r, constant) / r.measured_step_s for r in rows])
                  for name, rows in (("calibration", calibration), ("holdout", holdout))},
        "without": {},
    }
    full = fit(calibration, restarts=args.restarts)
    for term, what in TERMS.items():
        print(f"ablation: without {term}", file=sys.stderr, flush=True)
        rows = touched(holdout, term)
        entry: dict[str, object] = {"what": what}
        if rows:
            # The same rows under the full model, for comparison.
            entry["full_model_on_those_rows"] = summary(ratios(rows, full))
        entry.update(score(calibration, holdout, without(term), args.restarts, rows))
        result["without"][term] = entry
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
