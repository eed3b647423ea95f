"""``mcpar simulate`` and ``mcpar plan``: the cost model on the command line.

    mcpar simulate --runs FILE.csv --out OUT.csv [--hardware HW.csv]
    mcpar simulate CONFIG [--set K=V ...] [--model PRESET] [--cluster PRESET] [--json]
    mcpar plan [CONFIG] [--set K=V ...] [--model PRESET] --cluster PRESET [--top N]

A CONFIG gives the layout and settings (and the model, unless ``--model`` names a preset); the
cluster preset gives the GPUs (``a100x1024``, ``h100x512``, ... or ``local``, this machine as
measured by ``mcpar.sim.localprofile``; default ``local``). User errors raise ``UserError`` (the
caller prints one line per problem and exits 2).

``--runs``: each bad row (a number missing, unparsable, non-finite or out of range, an unknown
GPU or precision, an impossible layout) is named on stderr as ``<id>.<column>: <fix>`` and left
out; the other rows are predicted and written to ``--out`` (exit 0; the refused rows and a
summary line are on stderr). Exit 2, with nothing written, only when no row is valid.

``plan`` refuses searches it cannot finish in seconds: more than
``MAX_PLAN_GPUS`` GPUs (``--cluster``), ``--top`` above ``MAX_TOP``, a global batch above
``MAX_GLOBAL_BATCH``, or more than ``MAX_PLAN_CORES`` layouts to price (``planner.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

from mcpar.config import JobConfig, load_config
from mcpar.errors import UserError, problem
from mcpar.sim.costmodel import Prediction, simulate
from mcpar.sim.fromconfig import (
    CONFIG_KEYS,
    config_layout,
    config_model,
    unpriced_settings,
    with_preset,
)
from mcpar.sim.hardware import GIB, Accelerator, Cluster, load_accelerators
from mcpar.sim.localprofile import named_cluster
from mcpar.sim.memory import format_memory_rows, memory_header
from mcpar.sim.planner import (
    MAX_PLAN_GPUS,
    MAX_TOP,
    SearchSpace,
    best_or_error,
    format_table,
    plan,
)
from mcpar.sim.runs import predict_runs, read_runs_partial, write_predictions
from mcpar.sim.workload import MODEL_PRESETS, Layout, ModelPreset, ModelShape, model_preset
from mcpar.topology import replica_ranks

PRECISIONS = ("fp16", "bf16", "fp8", "fp32")
# `simulate --runs` with some rows refused and the others predicted and written: exit 0 (each
# refused row is named on stderr, with a summary line); 2 is kept for a file with no valid row.
RUNS_PARTIAL_EXIT = 0
# Sequences per step `plan` accepts: 1000x the largest published runs' (~4k sequences of 4k
# tokens); past it the step's token count leaves what any run trains with.
MAX_GLOBAL_BATCH = 2**22


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallelism.tensor=8 (repeatable)")
    p.add_argument("--model", default=None,
                   help="model preset instead of the config's model: " + ", ".join(MODEL_PRESETS))
    p.add_argument("--cluster", default="local",
                   help="cluster preset: <gpu>x<count> (a100x1024, h100x512, a100-40gbx64, "
                        "h200x256, ...) or 'local' (this machine; the default)")
    p.add_argument("--hardware", default=None, help="hardware CSV (default: the packaged copy "
                                                    "of calibration/hardware.csv)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: the model preset's, else the config's training.dtype")


def add_simulate_arguments(sim: argparse.ArgumentParser) -> None:
    """``simulate``'s arguments (the one-line helps are in ``mcpar.cli``'s command table)."""
    sim.add_argument("config", nargs="?", help="YAML config (omit with --runs)")
    sim.add_argument("--runs", help="CSV with the columns of calibration/published_runs.csv; "
                                    "each bad row is named on stderr by id and column and "
                                    "left out, the others are predicted into --out (exit 2, "
                                    "nothing written, only when no row is valid)")
    sim.add_argument("--out", help="where --runs writes the rows with predictions added")
    sim.add_argument("--json", action="store_true", help="print the prediction as JSON")
    _common(sim)


def add_plan_arguments(pl: argparse.ArgumentParser) -> None:
    pl.add_argument("config", nargs="?", help="YAML config (default: the built-in default)")
    pl.add_argument("--top", type=int, default=10,
                    help=f"how many layouts to print (1..{MAX_TOP})")
    pl.add_argument("--world", type=int, default=None,
                    help="workers of THIS machine: the layout parallelism.auto would train "
                         "(the config's model, priced as `mcpar check` prices it)")
    pl.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default: the preset's or the config's; at most "
                         f"{MAX_GLOBAL_BATCH:,})")
    _common(pl)


# mcpar's plan resolution (config + world size -> the resolved config, every cross-field check),
# handed in by the top-level CLI: the cost model sits below the plan and may not import it.
ConfigResolver = Callable[[JobConfig, int], JobConfig]


def run(args: argparse.Namespace, resolve_config: ConfigResolver | None = None) -> int:
    """Run ``simulate`` or ``plan``. With ``resolve_config`` (``mcpar simulate``), a config's
    own model and layout are resolved as ``mcpar check`` and ``mcpar train`` resolve them, so
    the three accept and refuse the same configs."""
    if args.command == "simulate":
        return _simulate(args, resolve_config)
    return _plan(args)


# --- shared -------------------------------------------------------------------------------------

def _cluster(args: argparse.Namespace) -> Cluster:
    table = load_accelerators(args.hardware)
    return named_cluster(args.cluster, table, key="--cluster")


def _workload(args: argparse.Namespace, cluster: Cluster,
              ) -> tuple[JobConfig, ModelShape, ModelPreset | None, str]:
    cfg = load_config(args.config, args.overrides)
    preset = model_preset(args.model) if args.model else None
    model = with_preset(config_model(cfg), preset)
    if args.precision:
        precision = args.precision
    elif preset is not None and not cluster.accel.is_cpu:
        precision = preset.precision
    else:
        precision = {"float32": "fp32", "bfloat16": "bf16"}[cfg.training.dtype]
    return cfg, model, preset, precision


def _local_world(cfg: JobConfig, cluster: Cluster) -> Cluster:
    """On 'local' the GPU count is the config's worker count."""
    if not cluster.accel.is_cpu:
        return cluster
    par = cfg.parallelism
    return replace(cluster, num_gpus=(par.data or 1) * replica_ranks(par.tensor, par.pipeline,
                                                                      par.context))


# --- simulate -----------------------------------------------------------------------------------

def _simulate(args: argparse.Namespace, resolve_config: ConfigResolver | None = None) -> int:
    if args.runs:
        if args.config:
            raise UserError(problem("simulate", "give either a CONFIG or --runs FILE.csv"))
        if not args.out:
            raise UserError(problem("--out", "--runs needs --out OUT.csv for the predictions"))
        return _simulate_runs(args.runs, args.out, load_accelerators(args.hardware))
    if not args.config:
        raise UserError(problem("simulate", "give a CONFIG (YAML) or --runs FILE.csv"))
    cluster = _cluster(args)
    cfg, model, preset, precision = _workload(args, cluster)
    cluster = _local_world(cfg, cluster)
    if resolve_config is not None and preset is None:
        cfg = resolve_config(cfg, cluster.num_gpus)
    layout = config_layout(cfg, cluster.num_gpus, preset, precision)
    pred = simulate(model, layout, cluster, where="config", names=CONFIG_KEYS)
    notes = unpriced_settings(cfg)
    if args.json:
        print(json.dumps(_as_json(model, layout, cluster, pred, notes), indent=1))
    else:
        print(_describe(model, layout, cluster, pred, notes))
    return 0


def _simulate_runs(runs_path: str, out: str, accelerators: dict[str, Accelerator]) -> int:
    """Predict every good row of a runs file; name each bad row's id and column on stderr.

    The good rows are written to `out` whatever the others hold. Exit status: 0 when every row
    was predicted; 2 when any row was refused (after writing the good ones, so a script notices
    a refused row), and 2 without writing anything when no row is valid."""
    runs, problems = read_runs_partial(runs_path, accelerators)
    runs, preds, unpriced = predict_runs(runs)
    problems += unpriced
    lines = [line for row in problems for line in row]
    if not runs:
        raise UserError([*lines, problem(runs_path, "no row could be predicted; nothing "
                                                    f"written to {out}")])
    write_predictions(runs, preds, out)
    print(f"mcpar simulate: {len(runs)} rows -> {out}")
    if not problems:
        return 0
    for line in lines:
        print(f"mcpar: error: {line}", file=sys.stderr)
    print(f"mcpar: error: {runs_path}: {len(problems)} row(s) refused (listed above) and left "
          f"out of {out}; the other {len(runs)} were predicted", file=sys.stderr)
    return RUNS_PARTIAL_EXIT


def _as_json(model: ModelShape, layout: Layout, cluster: Cluster, pred: Prediction,
             notes: list[str]) -> dict[str, object]:
    return {
        "model": asdict(model), "layout": asdict(layout),
        "cluster": {"gpu": cluster.accel.name, "num_gpus": cluster.num_gpus,
                    "gpus_per_node": cluster.gpus_per_node},
        "step_s": pred.step_s, "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu,
        "comm_fraction": pred.comm_fraction, "bubble_fraction": pred.bubble_fraction,
        "memory_gib": {k: v / GIB for k, v in asdict(pred.memory).items() if k != "params"}
        | {"per_rank": pred.memory.per_rank / GIB, "total": pred.memory.total / GIB,
           "limit": pred.memory_limit / GIB},
        "memory_rows_bytes": dict(pred.memory.rows()), "params_per_rank": pred.memory.params,
        "fits": pred.fits, "breakdown_s": pred.breakdown, "notes": notes,
    }


def _params(model: ModelShape) -> str:
    n = model.num_params()
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _describe(model: ModelShape, lay: Layout, cluster: Cluster, pred: Prediction,
              notes: list[str]) -> str:
    mem = pred.memory
    lines = [
        f"mcpar simulate: {model.name or 'model'} ({_params(model)} parameters) "
        f"on {cluster.num_gpus} x {cluster.accel.name} ({cluster.name or 'cluster'})",
        f"layout:  {lay.describe()}{' sp' if lay.seq_parallel else ''}, micro-batch "
        f"{lay.micro_batch} x {lay.num_microbatches} micro-batches, global batch "
        f"{lay.global_batch}, recompute {lay.recompute}, ZeRO {lay.zero_stage}, "
        f"{lay.precision}, attention {lay.attention_kind}, compression {lay.compression}, "
        f"topology {lay.topology}"
        + (", the hierarchical parameter store" if lay.allocation == "topology_aware" else "")
        + (", int8 weight gathers" if lay.weight_gather == "int8" else ""),
        f"step:    {pred.step_s:.4f} s, {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}",
        f"shares:  exposed communication {pred.comm_fraction:.1%}, pipeline bubble "
        f"{pred.bubble_fraction:.1%}",
        "critical path (s): " + ", ".join(f"{k} {v:.4g}" for k, v in
                                          sorted(pred.breakdown.items(), key=lambda kv: -kv[1])),
        memory_header(mem.params),
    ]
    lines += format_memory_rows(mem.rows())
    lines.append(f"memory per GPU: {mem.per_rank / GIB:.2f} GiB + {mem.reserved / GIB:.2f} "
                 f"reserved by the device = {mem.total / GIB:.2f} GiB of "
                 f"{pred.memory_limit / GIB:.0f} ({'fits' if pred.fits else 'DOES NOT FIT'})")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


# --- plan ---------------------------------------------------------------------------------------

def _plan(args: argparse.Namespace) -> int:
    if not 1 <= args.top <= MAX_TOP:
        raise UserError(problem("--top", f"must be 1..{MAX_TOP} (the planner's bound), got "
                                         f"{args.top}; print fewer layouts"))
    cluster = _cluster(args)
    if cluster.num_gpus > MAX_PLAN_GPUS:
        raise UserError(problem("--cluster", f"{cluster.num_gpus:,} GPUs is more than the "
                                             f"planner searches in seconds ({MAX_PLAN_GPUS:,}); "
                                             "plan a smaller cluster"))
    cfg, model, preset, precision = _workload(args, cluster)
    if cluster.accel.is_cpu:
        cluster = _local_world(cfg, cluster)
    batch_key = "--global-batch"
    if args.global_batch is not None:
        global_batch = args.global_batch
    elif cfg.optimization.global_batch_size is not None:
        global_batch, batch_key = (cfg.optimization.global_batch_size,
                                   "optimization.global_batch_size")
    elif preset is not None:
        global_batch = preset.global_batch
    else:
        opt = cfg.optimization
        global_batch = opt.micro_batch_size * (opt.gradient_accumulation or 1) * (
            cfg.parallelism.data or 1)
        batch_key = "optimization.micro_batch_size"
    if not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise UserError(problem(batch_key, f"must be 1..{MAX_GLOBAL_BATCH:,} sequences, got "
                                           f"{global_batch:,}"))
    where = f"--model {args.model}" if args.model else "model"
    result = plan(model, cluster, global_batch, precision, SearchSpace(), where=where,
                  keep=max(args.top, 10), budget_key=batch_key)
    best_or_error(result, cluster, where)
    print(f"mcpar plan: {model.name or 'model'} ({_params(model)} parameters), "
          f"global batch {global_batch} x {model.seq_len} tokens, {precision}, on "
          f"{cluster.num_gpus} x {cluster.accel.name}: {result.considered} layouts considered "
          f"in {result.seconds:.2f} s")
    print(format_table(result, args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mcpar.sim.cli simulate|plan ...``: the same commands outside ``mcpar``."""
    parser = argparse.ArgumentParser(prog="mcpar")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_arguments(sub.add_parser("simulate"))
    add_plan_arguments(sub.add_parser("plan"))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as err:
        for line in err.problems:
            print(f"mcpar: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
