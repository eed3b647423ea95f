"""The ``mcpar`` command line: ``train``, ``profile``, ``check``, ``prepare``, ``export``,
``import``, ``generate``, ``checkpoint verify`` and the cost model's ``simulate`` and ``plan``.

This module only parses: each command's work is in its own module (``mcpar.commands``,
``mcpar.data.prepare``, ``mcpar.sim.cli``, ``mcpar.profiler.command``), imported when that
command runs, so ``mcpar --help`` and a typo answer at once, without importing torch.
User errors (bad config, bad path, impossible layout) print one line per problem and exit with
code 2, without a traceback. Outside torchrun/SLURM, ``train`` validates everything in this process
first, then starts the workers itself; under torchrun or SLURM each process is a worker already.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable

from mcpar.errors import UserError
from mcpar.launch.local import LaunchFailed

ArgumentAdder = Callable[[argparse.ArgumentParser], None]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallelism.data=2 (repeatable)")
    p.add_argument("--nproc", type=int, default=None,
                   help="number of worker processes to start on this machine")


def _train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    _common(train)
    train.add_argument("--steps", type=int, default=None, help="override training.steps")
    train.add_argument("--run-dir", default=None, help="run directory (default runs/<time>)")
    _oversubscribe(train)
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir from its newest valid checkpoint "
                       "(from step 0 if it has none)")
    train.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="stop after STEP, saving a checkpoint, without changing the schedule")


def _oversubscribe(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oversubscribe", action="store_true",
                   help="start --nproc workers even beyond 4 per CPU core or the free memory "
                   "(refused otherwise)")


def _profile_arguments(p: argparse.ArgumentParser) -> None:
    from mcpar.profiler.command import add_arguments

    add_arguments(p)
    _common(p)
    _oversubscribe(p)


def _check_arguments(check: argparse.ArgumentParser) -> None:
    check.add_argument("config", help="YAML config")
    _common(check)


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("run_dir", help="run directory of a `mcpar train`")
    export.add_argument("out", help="output directory (new or empty)")
    export.add_argument("--format", choices=["hf"], required=True)
    export.add_argument("--step", type=int, default=None, help="default: the newest valid")
    export.add_argument("--max-shard-mb", type=float, default=2048.0,
                        help="safetensors file size above which weights are sharded")


def _import_arguments(imp: argparse.ArgumentParser) -> None:
    imp.add_argument("hf_dir", help="Hugging Face model directory (config.json, safetensors)")


def _generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("run_dir", help="run directory of a `mcpar train`")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0: the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, default=None, help="default: the newest valid")
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


MAX_NEW_TOKENS = 1 << 20  # generate re-runs the whole forward per token: more is never meant
_SEED_LIMIT = 1 << 64  # torch's generator seeds


def _bad(key: str, message: str) -> UserError:
    from mcpar.errors import problem

    return UserError(problem(key, message))


def check_arguments(args: argparse.Namespace) -> None:
    """Every number bounded and finite, every text encodable, before any work starts: a bad
    value is a user error naming its argument (exit 2), never a traceback or a silent wait."""
    nproc = getattr(args, "nproc", None)
    if nproc is not None and nproc < 1:
        raise _bad("--nproc", f"must be at least 1, got {nproc}")
    if args.command == "export":
        mb = args.max_shard_mb
        if not (math.isfinite(mb) and mb * (1 << 20) >= 1):
            raise _bad("--max-shard-mb", f"{mb}: give a finite size above 0 (MB), e.g. 2048")
    if args.command != "generate":
        return
    t = args.temperature
    if not (math.isfinite(t) and t >= 0):
        raise _bad("--temperature", f"{t}: give a finite value, 0 (greedy) or more")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise _bad("--max-new-tokens", f"{args.max_new_tokens}: give 1 to {MAX_NEW_TOKENS}")
    if args.top_k < 0:
        raise _bad("--top-k", f"{args.top_k}: give 1 or more (0: the whole vocabulary)")
    if not 0 <= args.seed < _SEED_LIMIT:
        raise _bad("--seed", f"{args.seed}: give 0 to {_SEED_LIMIT - 1}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("--prompt", "is not valid UTF-8 text; give the prompt in a UTF-8 "
                   "locale or fix its bytes") from None


def _lazy(module: str, function: str) -> ArgumentAdder:
    """An adder living in ``module``, imported only when its command is the one being run."""
    def add(p: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(module), function)(p)
    return add


# Every command: its one-line help and what adds its arguments. Only the named command's
# arguments are added (the others' modules may import torch); the list is in `mcpar --help`.
COMMANDS: dict[str, tuple[str, ArgumentAdder]] = {
    "train": ("train a model (the built-in default without CONFIG)", _train_arguments),
    "profile": ("train a few steps and write <run_dir>/profile/ (report.html, report.md, "
                "plots, traces)", _profile_arguments),
    "check": ("validate a config and print the resolved plan", _check_arguments),
    "export": ("write a run's checkpoint as a Hugging Face model", _export_arguments),
    "import": ("print the model section for a Hugging Face directory", _import_arguments),
    "generate": ("sample text from a run's newest checkpoint", _generate_arguments),
    "simulate": ("predict step time and memory of a config or of published runs (cost model)",
                 _lazy("mcpar.sim.cli", "add_simulate_arguments")),
    "plan": ("search layouts under the memory limit, fastest first",
             _lazy("mcpar.sim.cli", "add_plan_arguments")),
    "prepare": ("tokenize text into token shards with an index",
                _lazy("mcpar.data.prepare", "add_arguments")),
    "checkpoint": ("verify a checkpoint: the hash of its state, whatever its layout",
                   _lazy("mcpar.commands.checkpoint", "add_arguments")),
}


def _parser(command: str | None) -> argparse.ArgumentParser:
    """mcpar's parser, with the arguments of ``command`` (the others are listed by name)."""
    parser = argparse.ArgumentParser(
        prog="mcpar", description="Multi-Controller Parallel pre-training of transformers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_line, add_arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line)
        if name == command:
            add_arguments(p)
    return parser


def _run(args: argparse.Namespace) -> int:
    """Hand the parsed command to the module that does its work."""
    if args.command in ("train", "profile"):
        from mcpar.commands.train import cmd_train

        if args.command == "profile":
            from mcpar.profiler.command import as_train_args

            args = as_train_args(args)
        return cmd_train(args)
    if args.command == "check":
        from mcpar.commands.check import cmd_check

        return cmd_check(args)
    if args.command == "checkpoint":
        from mcpar.commands.checkpoint import cmd_checkpoint

        return cmd_checkpoint(args)
    if args.command == "prepare":
        from mcpar.data import prepare

        return prepare.run(args)
    if args.command in ("export", "import", "generate"):
        from mcpar.commands.interop import cmd_interop

        return cmd_interop(args)
    if args.command == "plan" and args.world is not None:
        from mcpar.commands.check import cmd_plan_world

        return cmd_plan_world(args)
    from mcpar.plan import resolve_plan
    from mcpar.sim.cli import run as run_sim_command

    # `simulate` and `plan`: a config's layout is resolved by the plan, as for check and train.
    return run_sim_command(args, lambda cfg, world: resolve_plan(cfg, world).config)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)
    args = _parser(command if command in COMMANDS else None).parse_args(words)
    try:
        check_arguments(args)
        return _run(args)
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
        from mcpar.path_checks import storage_error_line

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
