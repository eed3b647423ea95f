"""The one prepared device check: what mcpar does on one NVIDIA GPU, in under 8 minutes, as one
JSON (``gpu_check.json``) and its log (``gpu_check.log``) in ``--out``.

Measured (each section runs on its own; a failure is recorded in its place, the rest still run):

- ``parity``: fp32 loss, CUDA against CPU, over 5 steps, for the dense GPT, Llama and the MoE
  model (max |delta loss|);
- ``grouped_experts``: the MoE experts' grouped matmul against the Python loop on the device
  (forward and gradients in fp32 where the kernel takes fp32, bf16 otherwise) and both timed
  in bf16 (forward + backward), with the kernel ``auto`` picks and why;
- ``onebit``: 1-bit compression (scale, signs, error feedback), packing and unpacking timed on
  the device;
- ``throughput``: a ~1B-parameter GPT at sequence 2048 in bf16, eager then compiled: tokens/s,
  MFU against the datasheet's dense bf16 peak (989 TFLOP/s for H100/H200), the first step's
  compile time, and the peak memory measured against the MemoryController's estimate (the
  one ``mcpar check`` prints);
- ``device_profile``: the rates ``parallelism.auto`` plans a CUDA job on
  (``mcpar.sim.deviceprofile``: GEMM in bf16 and fp32, causal attention, element-wise
  bandwidth, launch costs), each over what the hardware table's row at the efficiencies
  fitted on published runs assumes;
- ``multi_rank``: data, tensor, pipeline and expert parallelism at 2 ranks on the one device
  (gloo carrying CUDA tensors, ``MCPAR_DIST_BACKEND=gloo``: NCCL refuses two ranks on one GPU).

How to run it on the device machine (no network; its own Python 3.12 and PyTorch; no pydantic):

1. On a machine with the network, from the repository root, fetch the wheels of what the
   checked code imports beyond torch (pydantic and its dependencies, PyYAML, NumPy; tqdm and
   tokenizers are not imported: progress bars are off, the corpus is read as bytes) into
   ``shared/wheels`` (the device run copies ``shared/``)::

       pip download pydantic pydantic-core typing-extensions annotated-types typing-inspection \\
           pyyaml numpy --python-version 3.12 --platform manylinux2014_x86_64 \\
           --only-binary=:all: -d shared/wheels

2. On the device machine, from the repository root (the script names the modules still missing
   and exits 2 before measuring anything if a wheel was forgotten; where NumPy is installed
   already, leave it out)::

       pip install --no-index --find-links shared/wheels --target /tmp/wheels pydantic pyyaml
       PYTHONPATH=src:/tmp/wheels python bench/gpu_check.py --out "$OUT"

``--dry-run`` runs every section at CI size on the CPU (tests/test_gpu_check.py), the
"device" then being the CPU, so that the script cannot rot; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16 FLOP/s
# Modules mcpar's training path imports that a bare PyTorch install may lack.
NEEDED = ("numpy", "pydantic", "yaml")
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_len=64",
        "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
        "optimization.warmup_steps=2", "optimization.micro_batch_size=4"]
KINDS = {"gpt": [], "llama": ["model.kind=llama"],
         "moe": ["model.kind=moe", "model.num_experts=4", "model.top_k=2"]}


class Log:
    """Prints and keeps every line for ``gpu_check.log``."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def train_in_process(run_dir: Path, settings: list[str], log: Log) -> tuple[list[dict], dict]:
    """One single-process ``mcpar train`` here; its metrics records and summary."""
    from mcpar.cli import main
    from mcpar.metrics import read_metrics

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["train", *_sets(settings), "--nproc", "1", "--run-dir", str(run_dir)])
    for line in out.getvalue().splitlines():
        if line.startswith("mcpar:"):
            log(f"  {line}")
    if code != 0:
        raise RuntimeError(f"mcpar train exited {code}: {out.getvalue()[-1500:]}")
    return read_metrics(run_dir), json.loads((run_dir / "summary.json").read_text())


def train_ranks(run_dir: Path, settings: list[str], world: int, backend: str,
                timeout: float) -> list[dict]:
    """``world`` ranks of ``mcpar train`` on this machine's one device, started as torchrun
    would start them (so the launcher's one-rank-per-GPU check does not apply)."""
    from mcpar.metrics import read_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   MCPAR_DIST_BACKEND=backend, MCPAR_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mcpar.cli", "train", *_sets(settings), "--run-dir",
             str(run_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    if any(p.returncode for p in procs):
        raise RuntimeError(f"exit {[p.returncode for p in procs]}: {outputs[0][-1500:]}")
    return read_metrics(run_dir)


def check_parity(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    steps = 2 if ctx["dry_run"] else 5
    results = {}
    for kind, extra in KINDS.items():
        settings = [*TINY, *extra, f"training.steps={steps}", "training.dtype=float32"]
        losses = {}
        # Dry run: the "device" is the CPU too, so one run stands for both sides.
        for device in ("cpu",) * (not ctx["dry_run"]) + (ctx["device"],):
            records, _ = train_in_process(ctx["tmp"] / f"parity-{kind}-{device}-{len(losses)}",
                                          [*settings, f"training.device={device}"], log)
            losses[len(losses)] = [r["loss"] for r in records]
        cpu, dev = losses[0], losses[len(losses) - 1]
        delta = max(abs(a - b) for a, b in zip(cpu, dev, strict=True))
        results[kind] = {"cpu": cpu, ctx["device"]: dev, "max_abs_delta": delta}
        log(f"parity {kind}: max |delta loss| {delta:.2e} over {steps} steps")
    return results


def _time(fn: Callable[[], Any], sync: Callable[[], None], repeat: int) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def check_grouped_experts(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    import torch

    from mcpar.device import grouped_mm_unavailable
    from mcpar.models.moe import describe_expert_kernel, grouped_expert_mlps, loop_expert_mlps

    dev, sync = ctx["torch_device"], ctx["sync"]
    experts, hidden, ffn, rows = (4, 32, 64, 64) if ctx["dry_run"] else (8, 1024, 4096, 16384)
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=experts)
    result: dict[str, Any] = {"shape": {"experts": experts, "hidden": hidden, "ffn": ffn,
                                        "rows": rows}, "counts": counts.tolist()}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        why = grouped_mm_unavailable(dev.type, dtype)
        entry: dict[str, Any] = {"auto_kernel": describe_expert_kernel(dev.type, dtype),
                                 "unavailable": why}
        x = torch.randn(rows, hidden, generator=gen).to(dev, dtype).requires_grad_(True)
        fc = (torch.randn(experts, hidden, ffn, generator=gen) * 0.05).to(dev, dtype)
        proj = (torch.randn(experts, ffn, hidden, generator=gen) * 0.05).to(dev, dtype)
        fc.requires_grad_(True)
        proj.requires_grad_(True)
        device_counts = counts.to(dev)

        def run(kind: str, x: torch.Tensor = x, fc: torch.Tensor = fc, proj: torch.Tensor = proj,
                device_counts: torch.Tensor = device_counts) -> list[torch.Tensor]:
            for t in (x, fc, proj):
                t.grad = None
            if kind == "grouped":
                out = grouped_expert_mlps(x, device_counts, fc, proj)
            else:
                out = loop_expert_mlps(x, counts.tolist(), fc, proj)
            out.float().square().mean().backward()
            return [out.detach(), x.grad, fc.grad, proj.grad]  # type: ignore[list-item]

        try:
            grouped = run("grouped")
        except (RuntimeError, NotImplementedError) as e:
            entry["grouped_error"] = str(e).splitlines()[0][:300]
            result[name] = entry
            log(f"grouped experts {name}: the grouped kernel fails here: {entry['grouped_error']}")
            continue
        loop = run("loop")
        entry["max_abs_diff"] = {k: float((g.float() - r.float()).abs().max())
                                 for k, g, r in zip(("out", "d_rows", "d_fc", "d_proj"),
                                                    grouped, loop, strict=True)}
        if dtype == torch.float32:  # the bar tests/test_grouped_experts.py sets on CPU
            entry["equal_within_1e-5"] = max(entry["max_abs_diff"].values()) <= 1e-5
        repeat = 2 if ctx["dry_run"] else 10
        entry["grouped_s"] = _time(lambda: run("grouped"), sync, repeat)
        entry["loop_s"] = _time(lambda: run("loop"), sync, repeat)
        entry["speedup"] = entry["loop_s"] / entry["grouped_s"]
        log(f"grouped experts {name}: diff {entry['max_abs_diff']}, fwd+bwd grouped "
            f"{entry['grouped_s'] * 1e3:.2f} ms, loop {entry['loop_s'] * 1e3:.2f} ms "
            f"({entry['speedup']:.2f}x); auto: {entry['auto_kernel']}")
        result[name] = entry
    return result


def check_onebit(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    import torch

    from mcpar.comm.compression import _compress_with_feedback, pack_signs, unpack_signs

    dev, sync = ctx["torch_device"], ctx["sync"]
    numel = (1 << 16) if ctx["dry_run"] else (1 << 26)
    z = torch.randn(numel, device=dev)
    error = torch.empty_like(z)
    packed = pack_signs(z)
    repeat = 2 if ctx["dry_run"] else 20
    result = {"numel": numel,
              "compress_s": _time(lambda: _compress_with_feedback(z, error), sync, repeat),
              "pack_s": _time(lambda: pack_signs(z), sync, repeat),
              "unpack_s": _time(lambda: unpack_signs(packed, numel), sync, repeat)}
    signs = unpack_signs(packed, numel)
    result["roundtrip_exact"] = bool(torch.equal(signs, torch.where(z.signbit(), -1.0, 1.0)))
    result["compress_gb_per_s"] = numel * 4 / result["compress_s"] / 1e9
    log(f"1-bit on {numel} floats: compress {result['compress_s'] * 1e3:.2f} ms, pack "
        f"{result['pack_s'] * 1e3:.2f} ms, unpack {result['unpack_s'] * 1e3:.2f} ms, "
        f"round trip exact {result['roundtrip_exact']}")
    return result


def check_device_profile(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    from dataclasses import asdict

    from mcpar.sim.deviceprofile import measure_device, table_row
    from mcpar.sim.params import GPU_EFFICIENCY

    small = ({"gemm": 128, "attention": (1, 2, 64, 16), "stream": 1 << 16} if ctx["dry_run"]
             else None)
    precision = "fp32" if ctx["dry_run"] else "bf16"
    profile = measure_device(ctx["torch_device"], precision, small,
                             seconds=0.02 if ctx["dry_run"] else 0.3, collectives=False)
    accel = table_row(torch_device_name(ctx))[0]
    assumed = {"gemm": accel.peak(precision) * GPU_EFFICIENCY.gemm,
               "attention": accel.peak(precision) * GPU_EFFICIENCY.attention
               * accel.attention_share,
               "stream": accel.hbm_bw * GPU_EFFICIENCY.memory}
    got = {"gemm": profile.flops_per_thread, "attention": profile.attention_flops_per_thread,
           "stream": profile.mem_bw_total}
    result = {"profile": asdict(profile), "table_row": accel.name,
              "measured_over_fitted": {k: got[k] / assumed[k] for k in got}}
    log(f"device profile ({precision}): GEMM {got['gemm'] / 1e12:.1f} TFLOP/s, attention "
        f"{got['attention'] / 1e12:.1f}, stream {got['stream'] / 1e9:.0f} GB/s; over the "
        f"{accel.name} row's fitted figures: "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["measured_over_fitted"].items()))
    return result


def torch_device_name(ctx: dict[str, Any]) -> str:
    import torch

    return torch.cuda.get_device_name(0) if ctx["device"] == "cuda" else "cpu"


def check_throughput(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    if ctx["dry_run"]:
        model = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                 "model.seq_len=128", "optimization.micro_batch_size=2"]
        steps, modes = 3, [False]  # compile at CI size: tests/test_compile.py
    else:  # ~1.0B parameters: 18 x 12 x 2048^2 in the blocks, plus embeddings and head
        model = ["model.num_layers=18", "model.hidden_size=2048", "model.num_heads=16",
                 "model.seq_len=2048", "optimization.micro_batch_size=4"]
        steps, modes = 12, [False, True]
    result: dict[str, Any] = {}
    for compiled in modes:
        name = "compiled" if compiled else "eager"
        settings = [*model, "training.progress=false", "training.eval_interval=0",
                    "training.eval_batches=1", "training.dtype=bfloat16",
                    f"training.device={ctx['device']}", f"training.steps={steps}",
                    f"training.compile={str(compiled).lower()}", "optimization.warmup_steps=2"]
        records, summary = train_in_process(ctx["tmp"] / f"throughput-{name}", settings, log)
        timed = records[2:] or records[-1:]  # past the first steps (compile, allocator warm-up)
        tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
        flops = summary["flops_per_token"]
        memory = summary.get("memory") or {}
        result[name] = {
            "num_params": summary["num_params"], "tokens_per_s": tokens_per_s,
            "step_time_s": [r["step_time_s"] for r in records],
            "compile_s": sum(r.get("compile_s", 0.0) for r in records),
            "mfu_vs_989_tflops": flops * tokens_per_s / DATASHEET_BF16,
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
            "memory_estimate_total": (memory.get("estimate") or {}).get("total"),
            "memory_measured_total": (memory.get("measured") or {}).get("total"),
            "losses": [r["loss"] for r in records]}
        entry = result[name]
        est, got = entry["memory_estimate_total"], entry["memory_measured_total"]
        if est and got:
            entry["measured_over_estimate"] = got / est
        log(f"throughput {name}: {entry['num_params'] / 1e9:.2f}B params, {tokens_per_s:.0f} "
            f"tokens/s, MFU {entry['mfu_vs_989_tflops']:.3f} (989 TFLOP/s), compile "
            f"{entry['compile_s']:.1f} s, peak {entry['peak_mem_bytes'] / 2**30:.2f} GiB, "
            f"measured/estimate {entry.get('measured_over_estimate')}")
    return result


def check_multi_rank(ctx: dict[str, Any], log: Log) -> dict[str, Any]:
    layouts = {"data2": ["parallelism.data=2"]}
    if not ctx["dry_run"]:
        layouts |= {"tensor2": ["parallelism.tensor=2", "parallelism.data=1"],
                    "pipeline2": ["parallelism.pipeline=2", "parallelism.data=1"],
                    "experts2": ["parallelism.data=2", "parallelism.experts=2", *KINDS["moe"]],
                    "zero3": ["parallelism.data=2", "controllers.memory.zero_stage=3"]}
    result: dict[str, Any] = {}
    for name, extra in layouts.items():
        settings = [*TINY, *extra, "training.steps=3", f"training.device={ctx['device']}"]
        try:
            records = train_ranks(ctx["tmp"] / f"ranks-{name}", settings, 2, "gloo", 240)
            result[name] = {"ok": True, "losses": [r["loss"] for r in records]}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            result[name] = {"ok": False, "error": str(e)[-800:]}
        log(f"multi-rank {name} (2 ranks, gloo, one {ctx['device']}): "
            f"{'ok' if result[name]['ok'] else 'FAILED ' + result[name]['error'][-300:]}")
    return result


SECTIONS: dict[str, Callable[[dict[str, Any], Log], dict[str, Any]]] = {
    "grouped_experts": check_grouped_experts, "onebit": check_onebit,
    "device_profile": check_device_profile, "parity": check_parity,
    "multi_rank": check_multi_rank, "throughput": check_throughput,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and log")
    parser.add_argument("--dry-run", action="store_true", help="CI size, on the CPU")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="these sections")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "gpu_check.log")
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        log(f"error: missing Python modules {missing}: carry their wheels and put them on "
            "PYTHONPATH as this script's docstring says (step 1 and 2)")
        return 2
    import torch

    from mcpar.device import synchronize

    if not args.dry_run and not torch.cuda.is_available():
        log("error: no CUDA device is visible; --dry-run runs the check on the CPU")
        return 2
    device = "cpu" if args.dry_run else "cuda"
    torch_device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "torch": torch.__version__, "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log(f"gpu_check: torch {report['torch']} on {report['device']} (dry run {args.dry_run})")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        ctx = {"dry_run": args.dry_run, "device": device, "torch_device": torch_device,
               "sync": lambda: synchronize(torch_device), "tmp": Path(tmp)}
        for name, check in SECTIONS.items():
            if args.only and name not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                report[name] = check(ctx, log)
            except Exception as e:  # one section's failure is its result; the rest still run
                report[name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
                log(f"{name}: FAILED {report[name]['error'][-500:]}")
            report.setdefault("seconds", {})[name] = time.perf_counter() - t0
            (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    report["total_s"] = time.perf_counter() - start
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    log(f"gpu_check: done in {report['total_s']:.0f} s -> {args.out / 'gpu_check.json'}")
    failed = [n for n in SECTIONS if isinstance(report.get(n), dict) and "error" in report[n]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
