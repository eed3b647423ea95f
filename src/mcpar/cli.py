"""The ``mcpar`` command line: ``train``, ``check`` and ``prepare`` (plus the sim's commands, and
``export``, ``import`` and ``generate``, whose work is in mcpar.interop and mcpar.generate).

User errors (bad config, bad path, impossible layout) print one line per problem and exit with
code 2, without a traceback. Outside torchrun/SLURM, ``train`` validates everything in this process
first, then starts the workers itself; under torchrun or SLURM each process is a worker already.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from mcpar.capabilities import unsupported_settings
from mcpar.checkpoint.manager import (
    RecoveryLog,
    checkpoint_dir,
    find_latest_valid,
    layout_of,
    list_checkpoints,
    read_meta,
    resume_problems,
)
from mcpar.config import DEFAULT_NPROC, JobConfig, load_config, to_yaml
from mcpar.controllers.memory.estimate import (
    format_bytes,
    params_per_pipeline_rank,
)
from mcpar.data import prepare
from mcpar.data.corpus import load_corpus
from mcpar.data.stream import BatchStream
from mcpar.device import available_devices, select_device
from mcpar.errors import UserError, problem
from mcpar.faults import FaultInjector
from mcpar.launch.env import DistEnv, detect_env
from mcpar.launch.local import WORKER_MODULE, LaunchFailed, WorkerFailure, launch_local
from mcpar.launch.run_dir import RunDirLock, check_not_a_run, check_resume_config, repair_logs
from mcpar.models.spec import get_model_spec
from mcpar.path_checks import path_problems, storage_error_line
from mcpar.plan import JobPlan, resolve_plan
from mcpar.profiler import command as profile_command
from mcpar.sim.cli import add_subcommands as add_sim_subcommands
from mcpar.sim.cli import run as run_sim_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcpar", description="Multi-Controller Parallel pre-training of transformers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set parallelism.data=2 (repeatable)")
        p.add_argument("--nproc", type=int, default=None,
                       help="number of worker processes to start on this machine")

    train = sub.add_parser("train", help="train a model (the built-in default without CONFIG)")
    train.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    common(train)
    train.add_argument("--steps", type=int, default=None, help="override training.steps")
    train.add_argument("--run-dir", default=None, help="run directory (default runs/<time>)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir from its newest valid checkpoint "
                       "(from step 0 if it has none)")
    train.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="stop after STEP, saving a checkpoint, without changing the schedule")

    common(profile_command.add_subcommand(sub))  # `profile`: a profiled run (mcpar.profiler)
    check = sub.add_parser("check", help="validate a config and print the resolved plan")
    check.add_argument("config", help="YAML config")
    common(check)
    _add_interop_subcommands(sub)  # `export`, `import`, `generate`
    add_sim_subcommands(sub)  # `simulate` and `plan`: the cost model (mcpar.sim)
    prepare.add_subcommand(sub)  # `prepare`: text to token shards (mcpar.data.prepare)
    return parser


def _add_interop_subcommands(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model")
    export.add_argument("run_dir", help="run directory of a `mcpar train`")
    export.add_argument("out", help="output directory (new or empty)")
    export.add_argument("--format", choices=["hf"], required=True)
    export.add_argument("--step", type=int, default=None, help="default: the newest valid")
    export.add_argument("--max-shard-mb", type=float, default=2048.0,
                        help="safetensors file size above which weights are sharded")
    imp = sub.add_parser("import", help="print the model section for a Hugging Face directory")
    imp.add_argument("hf_dir", help="Hugging Face model directory (config.json, safetensors)")
    gen = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    gen.add_argument("run_dir", help="run directory of a `mcpar train`")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0: the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, default=None, help="default: the newest valid")
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def cmd_interop(args: argparse.Namespace) -> int:
    """``export``, ``import`` and ``generate``: parse here, work in mcpar.interop / generate."""
    if args.command == "export":
        from mcpar.interop.hf_export import export_hf

        print(export_hf(Path(args.run_dir), Path(args.out), args.step,
                        int(args.max_shard_mb * (1 << 20))))
    elif args.command == "import":
        from mcpar.interop.hf_import import section_yaml

        print(section_yaml(Path(args.hf_dir)), end="")
    else:
        from mcpar.generate import Sampling, generate

        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k or None, args.seed)
        text, step = generate(Path(args.run_dir), args.prompt, sampling, args.device, args.step)
        print(f"mcpar generate: step {step} of {args.run_dir}", file=sys.stderr)
        print(text)
    return 0


def _load(args: argparse.Namespace) -> JobConfig:
    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"training.steps={args.steps}")
    return load_config(args.config, overrides)


def _requested_world(cfg: JobConfig, nproc: int | None, builtin_default: bool) -> int:
    par = cfg.parallelism
    if nproc is not None:
        if nproc < 1:
            raise UserError(problem("--nproc", f"must be at least 1, got {nproc}"))
        return nproc
    if par.data is None and builtin_default:
        return DEFAULT_NPROC * par.tensor * par.pipeline
    return (par.data or 1) * par.tensor * par.pipeline


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


def _new_run_dir(requested: str | None, env: DistEnv | None) -> Path:
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
        try:
            config_path.write_text(to_yaml(cfg))
        except OSError as err:  # e.g. a full disk: name the file (a write error carries none)
            raise OSError(err.errno, err.strerror, str(config_path)) from None
    except BaseException:
        lock.release()
        raise
    return lock


def _check_local_devices(cfg: JobConfig, world_size: int, explicit_nproc: bool) -> None:
    """A local launch must fit this machine (under torchrun/SLURM the launcher decided)."""
    info = select_device(cfg.training.device)
    par = cfg.parallelism
    needed = par.data * par.tensor * par.pipeline if par.data else world_size
    data = par.data or world_size // (par.tensor * par.pipeline)
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


def _validate_for_training(cfg: JobConfig, world_size: int) -> JobPlan:
    select_device(cfg.training.device)
    plan = resolve_plan(cfg, world_size)
    problems = unsupported_settings(cfg)
    if problems:
        raise UserError(problems)
    if cfg.model.init_from:  # the workers load it: a bad one is refused before they start
        from mcpar.interop.hf_import import check_init_from

        check_init_from(cfg.model)
    return plan


def cmd_train(args: argparse.Namespace) -> int:
    from mcpar.trainer import Trainer, run_worker  # imported late: `check` need not pay for it

    cfg = _load(args)
    env = detect_env()
    if env is not None:
        # Launched by torchrun/SLURM (or our own launcher): this process is one worker.
        plan = _validate_for_training(cfg, env.world_size)
        run_dir = _new_run_dir(args.run_dir, env)
        _check_paths(plan, run_dir)
        # A torchrun restart (--max-restarts) resumes like our own launcher's restarts do.
        resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        # Rank 0 owns the run directory for the job's life (run_worker ends the process).
        lock = _prepare_run_dir(run_dir, plan, resume) if env.rank == 0 else None
        run_worker(plan.config, run_dir, env, resume=resume, stop_after=args.stop_after)
        if lock is not None:
            lock.release()
        return 0
    world_size = _requested_world(cfg, args.nproc, builtin_default=args.config is None)
    _check_local_devices(cfg, world_size, explicit_nproc=args.nproc is not None)
    plan = _validate_for_training(cfg, world_size)
    _check_paths(plan, Path(args.run_dir) if args.run_dir else Path("runs"))
    _check_data(plan)
    run_dir = _new_run_dir(args.run_dir, None)
    lock = _prepare_run_dir(run_dir, plan, args.resume)  # held while this process trains/launches
    if world_size == 1:
        trainer = Trainer(plan, run_dir, None, resume=args.resume, stop_after=args.stop_after,
                          faults=FaultInjector.from_env())
        trainer.train()
        lock.release()
        return 0
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
    lock.release()
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    plan = resolve_plan(_load(args), args.nproc)
    cfg = plan.config
    m, compute, memory, exchange = cfg.model, plan.compute, plan.memory, plan.communication
    spec = get_model_spec(m.kind)
    est = memory.estimate
    lines = [
        f"mcpar check: {args.config} is valid",
        f"layout:  {plan.parallel_dims().describe()}",
        f"mesh:    pp {plan.pp} x dp {plan.dp} x tp {plan.tp} "
        "(tensor innermost within a node, pipeline outermost)",
        f"batch:   {plan.global_batch_size} sequences per step = micro-batch "
        f"{plan.micro_batch_size} x accumulation {plan.num_microbatches} x data {plan.dp}; "
        f"{plan.global_batch_size * m.seq_len} tokens",
        f"model:   {m.kind}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads"
        + (f" ({m.kv_heads} key/value)" if m.family.grouped_query_attention else "") + ", "
        f"ffn {m.ffn_size}, seq {m.seq_len}, vocab {m.vocab_size}"
        + (f", {m.num_experts} experts top-{m.top_k}" if m.is_moe else "")
        + f": {est.num_params:,} parameters, "
        f"{spec.flops_per_token(m) / 1e6:.1f} MFLOPs per training token",
        f"controllers: compute scheduler={compute.balance.scheduler} "
        f"batch_splitting={compute.batch_splitting}; memory allocation="
        f"{'topology_aware' if memory.store.node_cache else 'default'} "
        f"offload={memory.offload.target} zero_stage={memory.zero_stage} recompute="
        + "+".join(f"{memory.recompute.count(mode)}x{mode}"
                   for mode in dict.fromkeys(memory.recompute)) + "; "
        f"communication codec={exchange.codec} topology={exchange.topology} "
        f"weight_gather={memory.store.weight_codec}",
        f"gradient exchange: {exchange.strategy}, {exchange.topology}, codec {exchange.codec}",
        f"pipeline: {len(plan.stage_cut)} stages of blocks "
        + " | ".join(f"{a}-{b - 1}" for a, b in plan.stage_cut)
        + f" (schedule {plan.schedule})" if plan.pp > 1 else "pipeline: none",
        "parameters per rank by pipeline position: "
        + ", ".join(f"{n:,} ({format_bytes(4 * n)})"
                    for n in params_per_pipeline_rank(cfg, plan.parallel_dims()))
        + f" (single process: {est.num_params:,})",
    ]
    lines += est.report_lines()
    if memory.budget is not None:  # the MemoryController's placement to the budget
        lines += memory.budget.report_lines()
    lines += memory.holdings.report_lines()
    pending = unsupported_settings(cfg)
    if pending:
        lines.append("not trainable with this version yet (mcpar train will refuse):")
        lines += [f"  {p}" for p in pending]
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "profile":
            return cmd_train(profile_command.as_train_args(args))
        if args.command == "prepare":
            return prepare.run(args)
        if args.command in ("export", "import", "generate"):
            return cmd_interop(args)
        if args.command in ("simulate", "plan"):
            # A config's layout is resolved by the plan, as for check and train.
            return run_sim_command(args, lambda cfg, world: resolve_plan(cfg, world).config)
        return cmd_check(args)
    except UserError as err:
        for line in err.problems:
            print(f"mcpar: error: {line}", file=sys.stderr)
        return 2
    except LaunchFailed as err:
        if err.failure.user_errors:
            # A user error only a worker could see (e.g. its node's layout): exit 2, as if
            # found here; the job was not restarted for it.
            for line in err.failure.user_errors:
                print(f"mcpar: error: {line}", file=sys.stderr)
            return 2
        print(f"mcpar: training failed: {err.failure.describe()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mcpar: interrupted", file=sys.stderr)
        return 130
    except OSError as err:
        # A full disk, a quota or a read-only place under the launcher's own writes (the run
        # directory's files, the recovery log, a single-process run's metrics): the user's to
        # fix, so one line naming the file, not a traceback. Other OS errors are faults.
        line = storage_error_line(err, getattr(args, "run_dir", None) or "runs/")
        if line is None:
            raise
        print(f"mcpar: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
