"""Rows of the published-runs table: reading them, simulating them, writing predictions.

Input rows have exactly the columns of ``calibration/published_runs.csv`` (``RUN_COLUMNS``); the
output is the same rows, in order, with ``PREDICTION_COLUMNS`` appended. Every problem of a row
is reported with the row's id and the column at fault.

``predicted_tflops_per_gpu`` uses the formula the row names in ``tflops_formula``:
F1 = 96 B s l h^2 (1 + s/6h + V/16lh) (counts the recomputed forward) and
F2 = 72 B s l h^2 (1 + s/6h + V/12lh) (model FLOPs). For another formula the row's own measured
TFLOP/s is scaled by measured / predicted step time, which is the same formula by construction.
``predicted_mfu`` is always model FLOPs (``costmodel.model_flops_per_token``) over the peak of the
row's precision.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from mcpar.errors import UserError, problem
from mcpar.sim.costmodel import Prediction, check, simulate
from mcpar.sim.hardware import GIB, Accelerator, Cluster, Efficiency, find_accelerator, make_cluster
from mcpar.sim.workload import CROSS_ENTROPY, Layout, ModelShape

RUN_COLUMNS = (
    "id", "group", "grade", "gpu", "num_gpus", "gpus_per_node", "inter_node_gbps_per_gpu",
    "layers", "hidden", "heads", "kv_heads", "ffn", "ffn_kind", "vocab", "seq_len", "experts",
    "top_k", "tp", "pp", "vp", "cp", "dp", "ep", "zero_stage", "seq_parallel", "global_batch",
    "micro_batch", "recompute", "precision", "measured_step_s", "measured_tflops_per_gpu",
    "tflops_formula", "source",
)
# Columns a table may add after ``source``, each with the value a row without it means: what the
# run's software did where stacks differ in a way the model prices (docs/cost_model.md).
OPTIONAL_COLUMNS = {
    "tp_comm_overlap": "false",  # tensor-parallel collectives pipelined with their GEMMs
    # The attention kernel: auto (see Layout), unfused, or a flash-style kernel: flash
    # (FlashAttention-2 or as fast), flash1 (FlashAttention-1), flash_triton (its Triton port).
    "attention": "auto",
    # Data-parallel collectives overlapped with the backward and forward (false: exchanged
    # after the last backward, as DeepSpeed's pipeline engine does).
    "dp_overlap": "true",
    # The cross-entropy's kernel: fused, or megatron (Megatron's unfused vocab-parallel one).
    "cross_entropy": "fused",
    # How ZeRO-1 gradients are reduced: reduce_scatter, or all_reduce (whole, as DeepSpeed's
    # BF16 optimizer has them reduced).
    "grad_reduce": "reduce_scatter",
}
# The flash kernel each flash ``attention`` value names (``workload.FLASH_KERNELS``).
FLASH_ATTENTION_NAMES = {"flash": "fa2", "flash1": "fa1", "flash_triton": "triton"}
PREDICTION_COLUMNS = (
    "predicted_step_s", "predicted_tflops_per_gpu", "predicted_mfu",
    "predicted_memory_gb_per_gpu", "predicted_comm_fraction", "predicted_bubble_fraction",
)
INT_COLUMNS = ("num_gpus", "gpus_per_node", "layers", "hidden", "heads", "kv_heads", "ffn",
               "vocab", "seq_len", "experts", "top_k", "tp", "pp", "vp", "cp", "dp", "ep",
               "zero_stage", "global_batch", "micro_batch")


@dataclass
class Run:
    """One row, parsed."""

    row: dict[str, str]
    model: ModelShape
    layout: Layout
    cluster: Cluster
    measured_step_s: float | None
    measured_tflops: float | None

    @property
    def id(self) -> str:
        return self.row["id"]


# Spellings other tables use for the same thing.
PRECISION_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", "amp_bf16": "bf16",
                   "fp16": "fp16", "float16": "fp16", "fp16-mixed": "fp16", "amp_fp16": "fp16",
                   "fp8": "fp8", "fp8-hybrid": "fp8", "fp8-e4m3": "fp8", "fp32": "fp32",
                   "float32": "fp32", "tf32": "fp32"}
RECOMPUTE_NAMES = {"none": "none", "no": "none", "": "none", "selective": "selective",
                   "full": "full", "uniform": "full", "block": "full", "selective_op": "none"}
# Recompute names that rerun every second matrix product (``Layout.alternate_mm_recompute``):
# torchtitan's op-level selective checkpointing, which keeps the attention core's output.
ALTERNATE_MM_RECOMPUTE = ("selective_op",)


def _parse_bool(text: str) -> bool | None:
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        text.strip().lower())


# Integer columns that may be 0 (0 means: the default, or a dense model); the others must be >= 1.
ZERO_ALLOWED = ("kv_heads", "experts", "top_k", "vp", "cp", "ep", "zero_stage")
# The largest value an integer column may hold: far above any real run, low enough that the
# model's arithmetic stays finite in floating point.
MAX_INT = 10**12
# Pipeline stages (pp x vp) a row may have: the model prices every stage (10^6 took 8 s); real
# runs use at most a few hundred.
MAX_STAGES = 2**16


def _parse_int(text: str | None, col: str, rid: str, problems: list[str]) -> int:
    least = 0 if col in ZERO_ALLOWED else 1
    fix = f"give a whole number from {least} to {MAX_INT:.0e}"
    try:
        value = float((text or "").strip())
    except ValueError:
        problems.append(problem(f"{rid}.{col}", f"expected an integer, got {text!r}; {fix}"))
        return least
    if not math.isfinite(value) or value != int(value) or not least <= value <= MAX_INT:
        problems.append(problem(f"{rid}.{col}", f"got {text!r}; {fix}"))
        return least
    return int(value)


def _parse_float(text: str | None, col: str, rid: str, problems: list[str],
                 optional: bool, zero_ok: bool = False) -> float | None:
    text = (text or "").strip()
    if not text and optional:
        return None
    fix = ("give a finite number" + (" >= 0" if zero_ok else " > 0")
           + (" or leave it empty" if optional else ""))
    try:
        value = float(text)
    except ValueError:
        problems.append(problem(f"{rid}.{col}", f"expected a number, got {text!r}; {fix}"))
        return None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        problems.append(problem(f"{rid}.{col}", f"got {text!r}; {fix}"))
        return None
    return value


def parse_run(row: dict[str, str], accelerators: dict[str, Accelerator]) -> Run:
    """A Run from a CSV row, or a UserError listing every problem as ``<id>.<column>: ...`` (the
    row's numbers, names and layout: a Run that parses is one ``predict_run`` can price)."""
    rid = (row.get("id") or "").strip() or "<row without id>"
    if None in row or any(v is None for v in row.values()):
        extra: list[str] = row.get(None) or []  # type: ignore[call-overload, assignment]
        fields = sum(v is not None for k, v in row.items() if k is not None) + len(extra)
        raise UserError(problem(rid, f"{fields} fields where the header has {len(RUN_COLUMNS)}; "
                                     "give one value per column (quote values with commas)"))
    problems: list[str] = []
    ints = {col: _parse_int(row.get(col), col, rid, problems) for col in INT_COLUMNS}
    multi_node = ints["num_gpus"] > ints["gpus_per_node"]
    inter = _parse_float(row.get("inter_node_gbps_per_gpu"), "inter_node_gbps_per_gpu", rid,
                         problems, optional=False, zero_ok=not multi_node)
    step = _parse_float(row.get("measured_step_s"), "measured_step_s", rid, problems, True)
    tflops = _parse_float(row.get("measured_tflops_per_gpu"), "measured_tflops_per_gpu", rid,
                          problems, True)
    sp = _parse_bool(row.get("seq_parallel", ""))
    if sp is None:
        problems.append(problem(f"{rid}.seq_parallel",
                                f"expected true or false, got {row.get('seq_parallel')!r}"))
    accel = None
    try:
        accel = find_accelerator(row.get("gpu", ""), accelerators, f"{rid}.gpu")
    except UserError as err:
        problems += err.problems
    precision = PRECISION_NAMES.get(row.get("precision", "").strip().lower())
    if precision is None:
        problems.append(problem(f"{rid}.precision", f"unknown precision {row.get('precision')!r};"
                                                    " use bf16, fp16, fp8 or fp32"))
    elif accel is not None:
        try:
            accel.peak(precision, f"{rid}.precision")
        except UserError as err:
            problems += err.problems
    recompute = RECOMPUTE_NAMES.get(row.get("recompute", "").strip().lower())
    if recompute is None:
        problems.append(problem(f"{rid}.recompute", f"unknown recompute {row.get('recompute')!r};"
                                                    " use none, selective, selective_op or full"))
    tp_overlap = _parse_bool(row.get("tp_comm_overlap") or OPTIONAL_COLUMNS["tp_comm_overlap"])
    if tp_overlap is None:
        problems.append(problem(f"{rid}.tp_comm_overlap",
                                f"expected true or false, got {row.get('tp_comm_overlap')!r}"))
    elif tp_overlap and not (sp and ints["tp"] > 1):
        problems.append(problem(f"{rid}.tp_comm_overlap", "overlapping tensor-parallel "
                                "collectives needs tp > 1 and seq_parallel; set it false"))
    dp_overlap = _parse_bool(row.get("dp_overlap") or OPTIONAL_COLUMNS["dp_overlap"])
    if dp_overlap is None:
        problems.append(problem(f"{rid}.dp_overlap",
                                f"expected true or false, got {row.get('dp_overlap')!r}"))
    cross_entropy = (row.get("cross_entropy") or OPTIONAL_COLUMNS["cross_entropy"]).strip()
    if cross_entropy not in CROSS_ENTROPY:
        problems.append(problem(f"{rid}.cross_entropy", f"unknown cross-entropy kernel "
                                                        f"{cross_entropy!r}; use fused or "
                                                        "megatron"))
    grad_reduce = (row.get("grad_reduce") or OPTIONAL_COLUMNS["grad_reduce"]).strip()
    if grad_reduce not in ("reduce_scatter", "all_reduce"):
        problems.append(problem(f"{rid}.grad_reduce", f"unknown gradient reduction "
                                                      f"{grad_reduce!r}; use reduce_scatter or "
                                                      "all_reduce"))
    elif grad_reduce == "all_reduce" and ints["zero_stage"] != 1:
        problems.append(problem(f"{rid}.grad_reduce", "all_reduce beside sharded optimizer "
                                                      "state describes ZeRO-1; give zero_stage "
                                                      "1 or reduce_scatter"))
    attention = (row.get("attention") or OPTIONAL_COLUMNS["attention"]).strip().lower()
    if attention not in ("auto", "unfused", *FLASH_ATTENTION_NAMES):
        problems.append(problem(f"{rid}.attention", f"unknown attention kernel {attention!r}; "
                                                    "use auto, flash, flash1, flash_triton or "
                                                    "unfused"))
    if ints["pp"] * max(1, ints["vp"]) > MAX_STAGES:
        problems.append(problem(f"{rid}.pp", f"pp {ints['pp']} x vp {max(1, ints['vp'])} is "
                                             f"more than {MAX_STAGES} pipeline stages; give "
                                             "the run's real degrees"))
    if problems:
        raise UserError(problems)
    assert accel is not None and inter is not None
    assert precision is not None and recompute is not None
    dp = ints["dp"]
    placed = ints["tp"] * ints["pp"] * ints["cp"]
    if placed * dp != ints["num_gpus"] and placed * dp * ints["ep"] == ints["num_gpus"]:
        # Some tables count the expert degree beside dp rather than inside it.
        dp *= ints["ep"]
    model = ModelShape(
        layers=ints["layers"], hidden=ints["hidden"], heads=ints["heads"],
        kv_heads=ints["kv_heads"] if ints["kv_heads"] > 0 else ints["heads"], ffn=ints["ffn"],
        ffn_kind=row["ffn_kind"].strip().lower(),
        vocab=ints["vocab"], seq_len=ints["seq_len"], experts=ints["experts"],
        top_k=ints["top_k"], name=rid,
    )
    layout = Layout(
        tp=ints["tp"], pp=ints["pp"], vp=max(1, ints["vp"]), cp=max(1, ints["cp"]), dp=dp,
        ep=max(1, ints["ep"]), zero_stage=ints["zero_stage"], seq_parallel=bool(sp),
        global_batch=ints["global_batch"], micro_batch=ints["micro_batch"],
        recompute=recompute, precision=precision, tp_comm_overlap=bool(tp_overlap),
        alternate_mm_recompute=row.get("recompute", "").strip().lower() in ALTERNATE_MM_RECOMPUTE,
        attention="flash" if attention in FLASH_ATTENTION_NAMES else attention,
        flash_kernel=FLASH_ATTENTION_NAMES.get(attention, "fa2"), dp_overlap=bool(dp_overlap),
        cross_entropy=cross_entropy, grad_all_reduce=grad_reduce == "all_reduce",
    )
    cluster = make_cluster(accel, ints["num_gpus"], ints["gpus_per_node"], inter, name=rid)
    check(model, layout, cluster, rid)  # an impossible model or layout, named by column
    return Run(row, model, layout, cluster, step, tflops)


def parse_runs_text(text: str, where: str, accelerators: dict[str, Accelerator],
                    ) -> tuple[list[Run], list[list[str]]]:
    """The rows of a runs CSV that parse, and the problem lines of each one that does not (every
    column at fault, named ``<id>.<column>``). A wrong header is a UserError: no row can be
    read against it."""
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    if header[:len(RUN_COLUMNS)] == RUN_COLUMNS and set(header[len(RUN_COLUMNS):]) <= set(
            OPTIONAL_COLUMNS) and len(set(header)) == len(header):
        header = RUN_COLUMNS  # the optional columns, after the required ones
    if header != RUN_COLUMNS:
        missing = [c for c in RUN_COLUMNS if c not in header]
        extra = [c for c in header if c not in RUN_COLUMNS and c not in OPTIONAL_COLUMNS]
        detail = []
        if missing:
            detail.append(f"missing {missing}")
        if extra:
            detail.append(f"unexpected {extra}")
        if not detail:
            detail.append("columns out of order")
        raise UserError(problem(where, "the columns must be exactly those of "
                                       "published_runs.csv: " + "; ".join(detail)))
    runs: list[Run] = []
    problems: list[list[str]] = []
    for row in reader:
        try:
            runs.append(parse_run(row, accelerators))
        except UserError as err:
            problems.append(err.problems)
    if not runs and not problems:
        raise UserError(problem(where, "no rows"))
    return runs, problems


def read_runs_text(text: str, where: str, accelerators: dict[str, Accelerator]) -> list[Run]:
    """Every row, or a UserError listing the problems of every bad row."""
    runs, problems = parse_runs_text(text, where, accelerators)
    if problems:
        raise UserError([line for row in problems for line in row])
    return runs


def _read_text(path: str | Path) -> tuple[str, str]:
    p = Path(path)
    if not p.is_file():
        raise UserError(problem(str(p), "runs file not found; give a CSV with the columns of "
                                        "calibration/published_runs.csv"))
    try:
        return p.read_text(), str(p)
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(problem(str(p), f"cannot read it as UTF-8 text ({err}); give a CSV "
                                        "with the columns of published_runs.csv")) from None


def read_runs(path: str | Path, accelerators: dict[str, Accelerator]) -> list[Run]:
    text, where = _read_text(path)
    return read_runs_text(text, where, accelerators)


def read_runs_partial(path: str | Path, accelerators: dict[str, Accelerator],
                      ) -> tuple[list[Run], list[list[str]]]:
    """The good rows of a runs file, and the problem lines of each bad one."""
    text, where = _read_text(path)
    return parse_runs_text(text, where, accelerators)


def predict_runs(runs: list[Run]) -> tuple[list[Run], list[Prediction], list[list[str]]]:
    """Predictions of the rows the model can price, and the problem lines of each row it cannot
    (a prediction that is not a finite positive step time, e.g. numbers too large for floating
    point)."""
    kept: list[Run] = []
    preds: list[Prediction] = []
    problems: list[list[str]] = []
    for run in runs:
        try:
            pred = predict_run(run)
            values = (pred.step_s, pred.mfu, pred.memory.total, pred.comm_fraction,
                      pred.bubble_fraction, predicted_tflops(run, pred))
        except UserError as err:
            problems.append(err.problems)
            continue
        except (ArithmeticError, ValueError) as err:
            problems.append([problem(run.id, f"cannot be priced ({err}); check its numbers")])
            continue
        if not all(math.isfinite(v) for v in values) or pred.step_s <= 0:
            problems.append([problem(run.id, "the predicted step time or memory is not a "
                                             "finite positive number; check the row's sizes and "
                                             "degrees")])
            continue
        kept.append(run)
        preds.append(pred)
    return kept, preds, problems


def packaged_runs(accelerators: dict[str, Accelerator],
                  name: str = "published_runs.csv") -> list[Run]:
    """Rows shipped with the package: the calibration rows (``published_runs.csv``), or the
    held-out published runs the model is checked on and never fitted to
    (``holdout_runs.csv``, sources in docs/cost_model.md)."""
    from importlib import resources

    text = resources.files("mcpar.sim").joinpath(f"data/{name}").read_text()
    return read_runs_text(text, name, accelerators)


def formula_flops(run: Run) -> float | None:
    """FLOPs per step under the row's named formula (None if the name is not F1/F2)."""
    m, b = run.model, run.layout.global_batch
    name = run.row["tflops_formula"].strip().upper()
    s, h, layers, v = m.seq_len, m.hidden, m.layers, m.vocab
    if name.startswith("F1"):
        return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    if name.startswith("F2"):
        return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    return None


def predict_run(run: Run, eff: Efficiency | None = None) -> Prediction:
    return simulate(run.model, run.layout, run.cluster, eff, where=run.id)


def predicted_tflops(run: Run, pred: Prediction) -> float:
    flops = formula_flops(run)
    if flops is not None:
        return flops / (pred.step_s * run.layout.num_gpus) / 1e12
    if run.measured_tflops is not None and run.measured_step_s:
        return run.measured_tflops * run.measured_step_s / pred.step_s
    return pred.model_flops / (pred.step_s * run.layout.num_gpus) / 1e12


def prediction_columns(run: Run, pred: Prediction) -> dict[str, str]:
    return {
        "predicted_step_s": f"{pred.step_s:.4f}",
        "predicted_tflops_per_gpu": f"{predicted_tflops(run, pred):.2f}",
        "predicted_mfu": f"{pred.mfu:.4f}",
        "predicted_memory_gb_per_gpu": f"{pred.memory.total / GIB:.2f}",
        "predicted_comm_fraction": f"{pred.comm_fraction:.4f}",
        "predicted_bubble_fraction": f"{pred.bubble_fraction:.4f}",
    }


def write_predictions(runs: list[Run], preds: list[Prediction], out: str | Path) -> None:
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as fh:
            optional = [c for c in OPTIONAL_COLUMNS if any(c in run.row for run in runs)]
            writer = csv.DictWriter(fh, fieldnames=[*RUN_COLUMNS, *optional,
                                                    *PREDICTION_COLUMNS], lineterminator="\n")
            writer.writeheader()
            for run, pred in zip(runs, preds, strict=True):
                writer.writerow({**run.row, **prediction_columns(run, pred)})
    except OSError as err:
        raise UserError(problem(str(path), f"cannot write: {err.strerror}")) from None
