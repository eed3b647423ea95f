"""``optimization.checkpoint.load_from``: start a run from another run's checkpoint.

The launcher resolves the key once, before any worker starts, to one concrete, valid
``step-N`` folder, and writes that folder into the run's resolved config: every worker and every
restart then reads the same checkpoint, even if the other run saves a newer one meanwhile. A
path that is not a run directory or a checkpoint folder, a run with no valid checkpoint, a
damaged checkpoint and a checkpoint this config cannot continue (another model, data or seed)
are refused with the key named, before anything is written.
"""

from __future__ import annotations

from pathlib import Path

from mcpar.checkpoint.files import find_latest_valid, list_checkpoints, verify_checkpoint
from mcpar.checkpoint.manager import checkpoint_dir, read_meta, resume_problems
from mcpar.checkpoint.reshard_restore import reshard_problems
from mcpar.config import JobConfig, load_config
from mcpar.errors import UserError, problem

KEY = "optimization.checkpoint.load_from"


def resolve_load_from(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``load_from`` set to the absolute step folder it names (unchanged when the
    key is unset); a UserError naming the key when it cannot be loaded by this run."""
    given = cfg.optimization.checkpoint.load_from
    if not given:
        return cfg
    try:
        return _resolved(cfg, Path(given).expanduser().resolve())
    except OSError as err:  # a name too long, a folder without permission: name the key
        raise UserError(problem(KEY, f"{given} cannot be read ({err.strerror}); give the "
                                "--run-dir of a `mcpar train` or one of its checkpoints/step-N "
                                "folders")) from None


def _resolved(cfg: JobConfig, path: Path) -> JobConfig:
    if (path / "manifest.json").exists() or path.name.startswith("step-"):
        reason = verify_checkpoint(path) if path.is_dir() else "it does not exist"
        if reason is not None:
            raise UserError(problem(KEY, f"{path} is not a valid checkpoint: {reason}"))
        step_dir = path
    elif (path / "config.yaml").is_file():
        try:
            other = load_config(path / "config.yaml")
        except UserError as err:
            raise UserError(problem(KEY, f"{path}/config.yaml cannot be read: "
                                    f"{err.problems[0]}")) from None
        folder = checkpoint_dir(other, path)
        found = find_latest_valid(folder)
        if found is None:
            raise UserError(problem(KEY, f"{folder} holds no valid checkpoint "
                                    f"({len(list_checkpoints(folder))} found, none complete "
                                    "and intact); give a run that saved one"))
        step_dir = found[1]
    else:
        raise UserError(problem(KEY, f"{path} is neither a run directory (config.yaml) nor a "
                                "checkpoint folder (manifest.json); give the --run-dir of a "
                                "`mcpar train` or one of its checkpoints/step-N folders"))
    # The layout may differ: the restore reshards, experts included; what no reshard can
    # follow is refused here, before any worker starts.
    meta = read_meta(step_dir)
    problems = resume_problems(meta, cfg, {}) + reshard_problems(meta)
    if problems:
        raise UserError([f"{KEY} {step_dir}: {line}" for line in problems])
    checkpoint = cfg.optimization.checkpoint.model_copy(update={"load_from": str(step_dir)})
    optimization = cfg.optimization.model_copy(update={"checkpoint": checkpoint})
    return cfg.model_copy(update={"optimization": optimization})
