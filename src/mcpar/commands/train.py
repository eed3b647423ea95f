"""``mcpar train`` (and ``mcpar profile``, a train with the profiler on): validate everything in
this process first (config, layout, devices, paths, data), take the run directory, then train
here (one process), start the workers (``launch_local``) or, under torchrun/SLURM, be one worker.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from mcpar.auto_layout import AUTO_LAYOUT_FILE, config_node_link, resolve_job
from mcpar.capabilities import unsupported_settings
from mcpar.checkpoint.load_from import resolve_load_from
from mcpar.checkpoint.manager import (
    RecoveryLog,
    checkpoint_dir,
    find_latest_valid,
    layout_of,
    list_checkpoints,
    read_meta,
    resume_problems,
)
from mcpar.commands.calibration import calibrate_before_plan, remeasure_after_drift
from mcpar.commands.config_args import load_args
from mcpar.config import DEFAULT_NPROC, JobConfig, to_yaml
from mcpar.data.corpus import load_corpus
from mcpar.data.stream import BatchStream
from mcpar.device import available_devices, select_device
from mcpar.errors import UserError, problem
from mcpar.faults import FaultInjector
from mcpar.launch.env import DistEnv, detect_env, join_process_group
from mcpar.launch.local import WORKER_MODULE, WorkerFailure, launch_local
from mcpar.launch.run_dir import RunDirLock, check_not_a_run, check_resume_config, repair_logs
from mcpar.metrics import write_json_atomic
from mcpar.path_checks import path_problems
from mcpar.plan import JobPlan, collective_timeout_s
from mcpar.sim.hardware import NodeLink
from mcpar.topology import replica_ranks


def _requested_world(cfg: JobConfig, nproc: int | None, builtin_default: bool) -> int:
    par = cfg.parallelism
    if nproc is not None:
        if nproc < 1:
            raise UserError(problem("--nproc", f"must be at least 1, got {nproc}"))
        return nproc
    per_replica = replica_ranks(par.tensor, par.pipeline, par.context)
    if par.data is None and builtin_default:
        return DEFAULT_NPROC * per_replica
    return (par.data or 1) * per_replica


def _check_data(plan: JobPlan) -> None:
    """Load the corpus once before any worker starts: bad paths, token ids beyond the vocabulary
    or a corpus too small for the sequence length are user errors (exit 2), not a worker crash;
    a BPE tokenizer is trained here once and the workers read it from the cache."""
    cfg = plan.config
    corpus = load_corpus(
        cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.val_fraction,
        token_dtype=cfg.data.token_dtype, cache_dir=cfg.data.cache_dir,
    )
    # Building the streams runs their checks (e.g. a split too small for model.seq_len).
    for tokens in (corpus.train, corpus.val):
        BatchStream(tokens, cfg.model.seq_len, plan.global_batch_size, cfg.training.seed)


def _check_paths(plan: JobPlan, run_dir: Path) -> None:
    """Every path the job reads or writes is usable by this user, before any worker starts."""
    problems = path_problems(plan.config, run_dir)
    if problems:
        raise UserError(problems)


def new_run_dir(requested: str | None, env: DistEnv | None) -> Path:
    if requested:
        return Path(requested)
    if env is not None and env.launcher in ("torchrun", "slurm"):
        # Every rank must agree on the directory without talking: use the job's own id.
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "job")
        return Path("runs") / f"{env.launcher}-{job_id}"
    # Claimed by creating it: two runs started in the same second get two directories (checked
    # with exists() they could pick the same one, and the second would stop at its lock).
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while True:
        path = Path("runs") / (f"{stamp}-{suffix}" if suffix else stamp)
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            suffix += 1
        except OSError as err:
            raise UserError(problem(
                "--run-dir", f"cannot create {path}: {err.strerror}; give a writable --run-dir"
            )) from None


def _prepare_run_dir(run_dir: Path, plan: JobPlan, resume: bool = False) -> RunDirLock:
    """Take ``run_dir`` for this job and write its resolved config.yaml.

    The returned lock is held until it is released or this process ends (the kernel drops it
    when the owner dies). It is taken first: checked without it, two runs could both find the
    directory free. Every refusal is a UserError raised before anything but the lock file is
    written: an existing run is never overwritten by a plain run, nor by a resume that would
    change its model or data order.
    """
    cfg = plan.config
    ckpt_dir = checkpoint_dir(cfg, run_dir)
    lock = RunDirLock(run_dir).acquire()
    try:
        if resume:
            check_resume_config(run_dir, cfg)
        else:
            check_not_a_run(run_dir)
        if not resume and list_checkpoints(ckpt_dir):
            raise UserError(problem(
                "optimization.checkpoint.dir", f"{ckpt_dir} already holds checkpoints; pass "
                "--resume to continue from them, or choose another directory"
            ))
        found = find_latest_valid(ckpt_dir) if resume else None
        if found is not None:
            # Refuse before any worker starts: a mismatch is a user error (exit 2), not a crash.
            problems = resume_problems(read_meta(found[1]), cfg, layout_of(plan))
            if problems:
                raise UserError(problems)
        if resume:
            repair_logs(run_dir)  # a torn last line of a killed run's logs
        config_path = run_dir / "config.yaml"  # the resolved config
        # Written aside and renamed: a reader (a second train, a resume) never sees it half
        # written, and a failed write leaves the run's earlier config in place.
        partial = config_path.with_name(config_path.name + ".tmp")
        try:
            partial.write_text(to_yaml(cfg))
            os.replace(partial, config_path)
        except OSError as err:  # e.g. a full disk: name the file (a write error carries none)
            partial.unlink(missing_ok=True)
            raise OSError(err.errno, err.strerror, str(config_path)) from None
    except BaseException:
        lock.release()
        raise
    return lock


def _check_local_devices(cfg: JobConfig, world_size: int, explicit_nproc: bool) -> None:
    """A local launch must fit this machine (under torchrun/SLURM the launcher decided)."""
    info = select_device(cfg.training.device)
    par = cfg.parallelism
    per_replica = replica_ranks(par.tensor, par.pipeline, par.context)
    needed = par.data * per_replica if par.data else world_size
    data = par.data or world_size // per_replica
    have = available_devices(info)
    unit = "GPUs" if info.type == "cuda" else "CPU cores"
    # On CPU, an explicit --nproc may oversubscribe cores (tests, debugging); GPUs cannot be shared.
    if needed > have and (info.type == "cuda" or not explicit_nproc):
        raise UserError(problem(
            "parallelism",
            f"the layout needs {needed} devices (tensor {par.tensor} x pipeline {par.pipeline} x "
            f"data {data}) but this machine has {have} {unit}; run it on a cluster with "
            "torchrun or SLURM, or choose smaller degrees"
            + ("" if info.type == "cuda" else " (or pass --nproc to oversubscribe the CPU)"),
        ))


OVERSUBSCRIBE_FACTOR = 4  # CPU workers per core an explicit --nproc may start
WORKER_BASE_BYTES = 400 << 20  # a worker's interpreter, torch and gloo before any tensor


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_worker_count(plan: JobPlan, workers: int) -> None:
    """Refuse an explicit --nproc this machine cannot hold: more CPU workers than
    OVERSUBSCRIBE_FACTOR per core, or workers whose estimated memory exceeds what is free."""
    if workers <= 1:
        return
    cores = os.cpu_count() or 1
    force = "; pass --oversubscribe to start them anyway"
    if select_device(plan.config.training.device).type == "cpu" and \
            workers > OVERSUBSCRIBE_FACTOR * cores:
        raise UserError(problem(
            "--nproc", f"{workers} workers on {cores} CPU cores (more than "
            f"{OVERSUBSCRIBE_FACTOR} per core) would crawl; give at most "
            f"{OVERSUBSCRIBE_FACTOR * cores}" + force))
    free = _available_memory()
    per_worker = plan.memory.estimate.total_bytes + WORKER_BASE_BYTES
    if free is not None and workers * per_worker > free:
        raise UserError(problem(
            "--nproc", f"{workers} workers need about {workers * per_worker / 2**30:.1f} GiB "
            f"({per_worker / 2**30:.2f} GiB each, estimated) but {free / 2**30:.1f} GiB is "
            f"free; give at most {max(1, free // per_worker)}" + force))


def worker_nodes(cfg: JobConfig, env: DistEnv) -> NodeLink | None:
    """The nodes a torchrun/SLURM worker's layout is priced over: where ``parallelism.auto``
    plans a CPU job whose ranks span several nodes (``cluster.ranks_per_node``, else the
    launcher's ranks per node) and the ``cluster`` keys do not give the link, the workers join
    their process group now and measure it (``node_link_probe``); else None (one node, or the
    keys, which the planner reads itself)."""
    per_node = cfg.cluster.ranks_per_node or env.local_world_size
    info = select_device(cfg.training.device)
    if (not cfg.parallelism.auto or info.type != "cpu" or per_node >= env.world_size
            or env.world_size % per_node or config_node_link(cfg, env.world_size) is not None):
        return None
    from mcpar.comm.node_link_probe import measure_node_link

    join_process_group(env, info.backend, collective_timeout_s(cfg))
    nodes = measure_node_link(per_node)
    if env.rank == 0:
        print(f"mcpar: {env.world_size // per_node} {nodes.describe()}", flush=True)
    return nodes


def validate_for_training(cfg: JobConfig, world_size: int,
                          nodes: NodeLink | None = None) -> JobPlan:
    select_device(cfg.training.device)
    plan = resolve_job(cfg, world_size, nodes)
    problems = unsupported_settings(cfg)
    if problems:
        raise UserError(problems)
    if cfg.model.init_from:  # the workers load it: a bad one is refused before they start
        from mcpar.interop.hf_import import check_init_from

        check_init_from(cfg.model)
    return plan


def _torchrun_resumes(plan: JobPlan, run_dir: Path) -> bool:
    """Whether a torchrun worker resumes the newest checkpoint. A restart (--max-restarts)
    does, as our own launcher's restarts do. Under ``training.elastic`` so does every worker
    of a run directory that already holds checkpoints: the workers of a node that came back
    are a first start to their agent (restart count 0) while the survivors' are not, and the
    whole world must take one path (the same decision from the same directory)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return True
    return plan.config.training.elastic is not None and bool(
        list_checkpoints(checkpoint_dir(plan.config, run_dir)))


def cmd_train(args: argparse.Namespace) -> int:
    from mcpar.trainer import Trainer, run_worker  # imported late: `check` need not pay for it

    # Resolved once, to one valid step folder that config.yaml then names for every worker.
    cfg = resolve_load_from(load_args(args))
    env = detect_env()
    if env is not None and env.launcher != "mcpar" and args.nproc is not None:
        raise UserError(problem(
            "--nproc", f"this process is one worker of a {env.launcher} job (RANK/WORLD_SIZE "
            "set), whose launcher decides the workers; drop --nproc, or unset the launcher's "
            "variables to start workers here"))
    if env is not None:
        # Launched by torchrun/SLURM (or our own launcher): this process is one worker.
        plan = validate_for_training(cfg, env.world_size, worker_nodes(cfg, env))
        run_dir = new_run_dir(args.run_dir, env)
        _check_paths(plan, run_dir)
        resume = args.resume or _torchrun_resumes(plan, run_dir)
        # Rank 0 owns the run directory for the job's life (run_worker ends the process).
        lock = _prepare_run_dir(run_dir, plan, resume) if env.rank == 0 else None
        if plan.elastic is not None and env.rank == 0:
            print(f"mcpar: {plan.elastic.report_line()}", flush=True)
        if (plan.config.training.elastic is not None and env.rank == 0
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
            print("mcpar: warning: training.elastic: torchrun's agents share their rendezvous "
                  "store with the workers, so a node that comes back cannot join (rank 0's "
                  "agent never writes a later round's store address); start them with "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the job to grow back", flush=True)
        run_worker(plan.config, run_dir, env, resume=resume, stop_after=args.stop_after,
                   plan=plan)
        if lock is not None:
            lock.release()
        return 0
    world_size = _requested_world(cfg, args.nproc, builtin_default=args.config is None)
    _check_local_devices(cfg, world_size, explicit_nproc=args.nproc is not None)
    # Here, not in torchrun's workers: one process measures the machine, not every rank at once.
    calibrate_before_plan(cfg)
    plan = validate_for_training(cfg, world_size)
    if args.nproc is not None and not getattr(args, "oversubscribe", False):
        _check_worker_count(plan, world_size)
    _check_paths(plan, Path(args.run_dir) if args.run_dir else Path("runs"))
    _check_data(plan)
    run_dir = new_run_dir(args.run_dir, None)
    lock = _prepare_run_dir(run_dir, plan, args.resume)  # held while this process trains/launches
    if plan.auto is not None:
        # The planner's whole ranking, from the process that made the choice (workers resolve
        # the run's config.yaml, where every key is set: their plan.json holds the choice).
        write_json_atomic(run_dir / AUTO_LAYOUT_FILE, plan.auto.to_json())
        print("mcpar: " + "\n".join(plan.auto.report_lines()[:2]), flush=True)
    if world_size == 1:
        trainer = Trainer(plan, run_dir, None, resume=args.resume, stop_after=args.stop_after,
                          faults=FaultInjector.from_env())
        trainer.train()
        remeasure_after_drift(cfg, run_dir)
        lock.release()
        return 0
    if plan.elastic is not None:
        print(f"mcpar: {plan.elastic.report_line()}", flush=True)
    print(f"mcpar: starting {world_size} workers; run dir {run_dir}", flush=True)
    argv = ["-m", WORKER_MODULE, str(run_dir)] + (["--resume"] if args.resume else [])
    if args.stop_after is not None:
        argv += ["--stop-after", str(args.stop_after)]
    log = RecoveryLog(run_dir)
    restarts = cfg.optimization.checkpoint.restarts

    def on_restart(attempt: int, failure: WorkerFailure) -> None:
        repair_logs(run_dir)  # a worker killed mid-line leaves a torn last line
        log.log("restart", echo=True, attempt=f"{attempt}/{restarts}",
                cause=failure.describe(), action="resuming from the newest valid checkpoint")

    # Checkpointing workers get time to finish a save when the launcher is stopped by SIGTERM.
    grace = 30.0 if cfg.optimization.checkpoint.interval > 0 else 3.0
    launch_local(world_size, argv, max_restarts=restarts, on_restart=on_restart,
                 stop_grace_s=grace)
    remeasure_after_drift(cfg, run_dir)
    lock.release()
    return 0
