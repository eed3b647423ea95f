"""Fit the global efficiency parameters on published runs, and check the fit honestly.

    python -m mcpar.sim.calibration            # accuracy table of the shipped parameters
    python -m mcpar.sim.calibration --fit      # refit; prints the params.py block
    python -m mcpar.sim.calibration --loo      # leave-one-out: refit without each row
    python -m mcpar.sim.calibration --runs FILE.csv [--hardware HW.csv]
    python -m mcpar.sim.calibration --holdout  # the packaged held-out published runs

Every table also gives the naive model's ratio (``naive_ratio``): step = model FLOPs (with
recompute) / (GPUs x peak x one constant), the constant fitted on the calibration rows. The
terms of the real model earn their place where it beats that baseline on runs it was not fitted
on (``--holdout``).

The objective is a maximum a posteriori fit in transformed coordinates (log for efficiencies and
the overhead, logit for the overlap share): sum over rows of (log(pred/measured) / SIGMA_ROW)^2
plus, per parameter, ((x - x_prior) / sigma_prior)^2 with the priors of ``params.py``. SIGMA_ROW
is the error we expect of a good model on one row (3%: published step times are rounded and
the runs' software is not fully described). Minimized by Nelder-Mead (no SciPy needed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace

from mcpar.sim.costmodel import model_flops_per_token
from mcpar.sim.hardware import Efficiency, load_accelerators
from mcpar.sim.params import GPU_EFFICIENCY, PRIOR, PRIOR_SIGMA
from mcpar.sim.runs import Run, packaged_runs, predict_run, read_runs

SIGMA_ROW = 0.03
PARAM_NAMES = tuple(f.name for f in fields(Efficiency))


def _to_x(name: str, value: float) -> float:
    if name == "overlap":
        value = min(max(value, 1e-4), 1 - 1e-4)
        return math.log(value / (1 - value))
    return math.log(value)


def _from_x(name: str, x: float) -> float:
    if name == "overlap":
        return 1 / (1 + math.exp(-x))
    value = math.exp(x)
    return min(value, 1.0) if name != "layer_overhead_s" else value


StepModel = Callable[[Run, Efficiency], float]  # predicted step seconds of a row


def model_step_s(run: Run, eff: Efficiency) -> float:
    return predict_run(run, eff).step_s


def ratios(runs: Sequence[Run], eff: Efficiency, step: StepModel = model_step_s) -> list[float]:
    """predicted / measured step time per row (``step``: the model, or a variant of it)."""
    return [step(r, eff) / r.measured_step_s for r in runs if r.measured_step_s]


def group_weights(runs: Sequence[Run]) -> list[float]:
    """Each source (the ``group`` column) weighs the same in total: rows of one source share
    their software and measurement method, so ten of them are not ten independent checks."""
    sizes: dict[str, int] = {}
    for r in runs:
        sizes[r.row["group"]] = sizes.get(r.row["group"], 0) + 1
    return [len(runs) / (len(sizes) * sizes[r.row["group"]]) for r in runs]


def objective(runs: Sequence[Run], eff: Efficiency, free: Sequence[str],
              step: StepModel = model_step_s) -> float:
    data = sum(w * (math.log(r) / SIGMA_ROW) ** 2
               for w, r in zip(group_weights(runs), ratios(runs, eff, step), strict=True))
    prior = sum(((_to_x(n, getattr(eff, n)) - _to_x(n, getattr(PRIOR, n))) / PRIOR_SIGMA[n]) ** 2
                for n in free)
    return data + prior


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.1,
                iters: int = 600, tol: float = 1e-9) -> list[float]:
    """Minimize `f` from `x0` with the Nelder-Mead simplex method."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)]
                            for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]

        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)]
                                    for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(runs: Sequence[Run], start: Efficiency = PRIOR,
        free: Sequence[str] = PARAM_NAMES, restarts: int = 3,
        step: StepModel = model_step_s) -> Efficiency:
    """The MAP efficiency parameters for `runs` (those not in `free` stay at `start`), for the
    model or a variant of it (``step``)."""

    def make(x: list[float]) -> Efficiency:
        return replace(start, **{n: _from_x(n, v) for n, v in zip(free, x, strict=True)})

    x0 = [_to_x(n, getattr(start, n)) for n in free]
    best = x0
    for _ in range(restarts):  # restarts shake the simplex out of flat valleys
        best = nelder_mead(lambda x: objective(runs, make(x), free, step), best, step=0.15)
    return make(best)


def summary(rs: Sequence[float]) -> dict[str, float]:
    errors = [abs(r - 1) for r in rs]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}


def group_summaries(runs: Sequence[Run], rs: Sequence[float]) -> dict[str, dict[str, float]]:
    """``summary`` of each source (the ``group`` column) on its own: a family of rows the model
    misses together hides inside a median over all rows."""
    groups: dict[str, list[float]] = {}
    for run, r in zip(runs, rs, strict=True):
        groups.setdefault(run.row["group"], []).append(r)
    return {g: summary(v) for g, v in groups.items()}


def leave_one_out(runs: Sequence[Run], restarts: int = 3) -> list[tuple[str, float]]:
    """(row id, predicted/measured) with parameters fitted on every other row."""
    out = []
    for i, run in enumerate(runs):
        rest = [r for j, r in enumerate(runs) if j != i]
        eff = fit(rest, restarts=restarts)
        out.append((run.id, predict_run(run, eff).step_s / run.measured_step_s))
    return out


def params_block(eff: Efficiency) -> str:
    values = ", ".join(f"{k}={v:.4g}" for k, v in asdict(eff).items())
    return f"GPU_EFFICIENCY = Efficiency({values})"


def naive_step_s(run: Run, constant: float = 1.0) -> float:
    """The one-constant baseline: training FLOPs of the step, recompute included (a full
    recompute redoes the forward: 4/3), over GPUs x the precision's peak x ``constant``."""
    m, lay = run.model, run.layout
    recompute = 4 / 3 if lay.recompute == "full" else 1.0
    flops = model_flops_per_token(m) * recompute * lay.global_batch * m.seq_len
    return flops / (run.cluster.num_gpus * run.cluster.accel.peak(lay.precision) * constant)


def naive_constant(calibration: Sequence[Run]) -> float:
    """The baseline's constant: the geometric mean fit on the calibration rows."""
    logs = [math.log(naive_step_s(r) / r.measured_step_s) for r in calibration
            if r.measured_step_s]
    return math.exp(statistics.mean(logs))


def accuracy_table(runs: Sequence[Run], eff: Efficiency,
                   naive: float | None = None) -> list[dict[str, object]]:
    """Per row: measured and predicted step, their ratio, memory and where the time goes;
    with ``naive`` (the baseline's constant), the baseline's ratio too."""
    rows = []
    for run in runs:
        pred = predict_run(run, eff)
        rows.append({
            "id": run.id, "measured_step_s": run.measured_step_s,
            "predicted_step_s": round(pred.step_s, 3),
            "ratio": round(pred.step_s / run.measured_step_s, 4) if run.measured_step_s else None,
            "memory_gib": round(pred.memory.total / 2**30, 1), "fits": pred.fits,
            "comm_fraction": round(pred.comm_fraction, 3),
            "bubble_fraction": round(pred.bubble_fraction, 3),
        })
        if naive is not None and run.measured_step_s:
            rows[-1]["naive_ratio"] = round(naive_step_s(run, naive) / run.measured_step_s, 4)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="runs CSV (default: the packaged published_runs.csv)")
    parser.add_argument("--hardware", help="hardware CSV (default: the packaged copy)")
    parser.add_argument("--holdout", action="store_true",
                        help="the packaged held-out published runs (never fitted on)")
    parser.add_argument("--fit", action="store_true", help="refit the global parameters")
    parser.add_argument("--loo", action="store_true", help="leave-one-out cross-validation")
    args = parser.parse_args(argv)
    accelerators = load_accelerators(args.hardware)
    if args.holdout and (args.runs or args.fit or args.loo):
        parser.error("--holdout checks the shipped parameters; it takes no --runs/--fit/--loo")
    calibration = [r for r in packaged_runs(accelerators) if r.measured_step_s]
    if args.holdout:
        runs = packaged_runs(accelerators, "holdout_runs.csv")
    else:
        runs = read_runs(args.runs, accelerators) if args.runs else calibration
    runs = [r for r in runs if r.measured_step_s]
    eff = fit(runs) if args.fit else GPU_EFFICIENCY
    table = accuracy_table(runs, eff, naive_constant(calibration))
    naive = summary([row["naive_ratio"] for row in table])  # type: ignore[misc]
    result: dict[str, object] = {
        "parameters": asdict(eff), "rows": table,
        **summary([row["ratio"] for row in table]),  # type: ignore[misc]
        "groups": group_summaries(runs, [row["ratio"] for row in table]),  # type: ignore[misc]
        "naive_median_abs_error": naive["median_abs_error"],
        "naive_worst_abs_error": naive["worst_abs_error"],
    }
    if args.loo:
        loo = leave_one_out(runs)
        result["leave_one_out"] = [{"id": i, "ratio": round(r, 4)} for i, r in loo]
        result["leave_one_out_summary"] = summary([r for _, r in loo])
        result["leave_one_out_groups"] = group_summaries(runs, [r for _, r in loo])
    print(json.dumps(result, indent=1))
    if args.fit:
        print(params_block(eff), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
