"""NVMe offload keeps a rank's resident memory bounded by its buffers, not by the model.

What it measures
    One worker process per mode trains the same GPT (bf16, data 1, default about 0.6B
    parameters) for a few steps through ``Trainer.train_step``:

    * ``none``: no offload (fp32 parameters under bf16 autocast, AdamW state in memory);
    * ``nvme``: ``controllers.memory.offload: nvme`` (bf16 parameters and gradients in memory;
      fp32 master weights and both moments, 12 B per parameter, in a file under the run
      directory, streamed through two buffers of ``offload_buffer_mb``).

    Each worker reports its peak resident set from ``/proc/self/status`` (VmHWM, read after its
    last step, so the model's construction is in it) and the parent takes the same figure from
    the kernel when it reaps the worker (``os.wait4``'s ``ru_maxrss``: the whole life of the
    process). The step time is the mean of the steps after the first (the first creates the
    state). The offloaded optimizer's own timings say where its time goes: reads and writes (the
    I/O thread), the update on the host, and the update waiting for a read.

Checks (the issue's): the offloaded state is at least 4x the buffer budget, and the ``nvme``
worker's peak resident set is below half of the offloaded state's size.

Caveat: the file lives on this machine's disk, through the page cache (which is not the
process's resident memory); on a machine whose RAM holds the whole file, reads may come from
the cache, not the device, and the read rate is the cache's.

How to run
    python bench/offload_nvme.py [--steps 3] [--set KEY=VALUE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model.kind=gpt", "model.num_layers=12", "model.hidden_size=2048", "model.num_heads=16",
         "model.seq_len=64", "optimization.micro_batch_size=1",
         "controllers.memory.offload_buffer_mb=32",
         "optimization.global_batch_size=1", "parallelism.data=1", "training.dtype=bfloat16",
         "training.device=cpu", "training.progress=false", "training.eval_interval=0",
         "optimization.warmup_steps=1"]
MODES = {"none": [], "nvme": ["controllers.memory.offload=nvme"]}


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One mode's training, in this process; prints its figures as JSON."""
    from mcpar.config import load_config
    from mcpar.plan import resolve_plan
    from mcpar.trainer import Trainer

    cfg = load_config(None, [*MODEL, f"training.steps={args.steps}", *MODES[args.worker],
                             *args.overrides])
    trainer = Trainer(resolve_plan(cfg, 1), Path(args.run_dir), None)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
    opt = trainer.optimizer
    engine = getattr(opt, "engine", None)
    out = {"mode": args.worker, "step_times_s": times,
           "params": sum(p.numel() for p in trainer.pm.params),
           "peak_rss_bytes_vmhwm": vm_hwm_bytes(),
           "ru_maxrss_self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if engine is not None:
        out.update(offload_state_bytes=sum(g.numel for g in engine.groups) * engine.fields * 4,
                   buffer_budget_bytes=engine.budget_bytes,
                   buffer_bytes=engine.buffer_bytes(), groups=len(engine.groups),
                   offload_times=engine.times.to_json())
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown (the trainer's threads and files go with the process)


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--run-dir", str(root / mode),
           "--steps", str(args.steps)] + [x for o in args.overrides for x in ("--set", o)]
    (root / mode).mkdir(parents=True)
    errors = root / f"{mode}.stderr"
    with errors.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        stdout = proc.stdout.read()
        # Reaped here, not by Popen: the kernel's account of this child alone.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"offload_nvme: the {mode} worker failed:\n"
                         f"{errors.read_text()[-3000:]}")
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["ru_maxrss_reaped_bytes"] = usage.ru_maxrss * 1024
    later = result["step_times_s"][1:] or result["step_times_s"]
    result["mean_step_s"] = sum(later) / len(later)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=sorted(MODES))
    parser.add_argument("--run-dir")
    parser.add_argument("--root", type=Path, default=None,
                        help="where the runs (and the state file) go; default a temp dir")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = Path(tempfile.mkdtemp(prefix="offload_nvme_", dir=args.root))
    disk = shutil.disk_usage(root)
    mem_available = next(int(x.split()[1]) * 1024 for x in
                         Path("/proc/meminfo").read_text().splitlines()
                         if x.startswith("MemAvailable:"))
    try:
        runs = {mode: run_mode(mode, args, root) for mode in ("nvme", "none")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nvme, none = runs["nvme"], runs["none"]
    state, budget = nvme["offload_state_bytes"], nvme["buffer_budget_bytes"]
    peak = max(nvme["peak_rss_bytes_vmhwm"], nvme["ru_maxrss_reaped_bytes"])
    times = nvme["offload_times"]
    steps = times["steps"]
    report = {
        "model": MODEL, "overrides": args.overrides, "steps": args.steps,
        "machine": {"cpus": os.cpu_count(), "disk_free_bytes": disk.free,
                    "mem_available_bytes": mem_available},
        "params": nvme["params"],
        "offload_state_bytes": state, "buffer_budget_bytes": budget,
        "state_over_budget": state / budget,
        "nvme_peak_rss_bytes": peak, "none_peak_rss_bytes": max(
            none["peak_rss_bytes_vmhwm"], none["ru_maxrss_reaped_bytes"]),
        "peak_rss_over_state": peak / state,
        "checks": {"state_at_least_4x_budget": state >= 4 * budget,
                   "peak_rss_below_half_state": peak < state / 2},
        "mean_step_s": {"none": none["mean_step_s"], "nvme": nvme["mean_step_s"]},
        "step_time_ratio_nvme_over_none": nvme["mean_step_s"] / none["mean_step_s"],
        "offload_per_step_s": {k: times[k] / steps for k in
                               ("read_s", "update_s", "write_s", "wait_s")},
        "offload_init_s": times["init_s"],
        "offload_gb_per_s": {"read": times["bytes_read"] / max(times["read_s"], 1e-9) / 1e9,
                             "write": times["bytes_written"] / max(times["write_s"], 1e-9) / 1e9},
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
