"""YAML and ``--set`` overrides into a validated JobConfig, and every problem as one line naming
its dotted key path (the CLI turns the resulting ``UserError`` into exit code 2)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mcpar.config.aliases import FRENCH_KEYS, FRENCH_VALUES
from mcpar.config.schema import JobConfig
from mcpar.config.yaml_safe import (
    MAX_CONFIG_BYTES,
    MAX_YAML_DEPTH,
    YAMLBoundExceeded,
    bounded_yaml,
    load_yaml,
)
from mcpar.config.yaml_safe import clip_text as _clip
from mcpar.errors import UserError, problem


def _section_model(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model of the section at `path`, or None if `path` is a leaf/unknown."""
    model: type[BaseModel] = JobConfig
    for key in path:
        field = model.model_fields.get(key)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _canonicalize(raw: Any, path: tuple[str, ...] = ()) -> Any:
    """Rename French keys and translate French enum values, recursively."""
    if not isinstance(raw, dict):
        if isinstance(raw, str) and raw in FRENCH_VALUES:
            return FRENCH_VALUES[raw]
        return raw
    aliases = FRENCH_KEYS.get(path, {})
    out: dict[Any, Any] = {}
    for key, value in raw.items():
        canonical = aliases.get(key, key) if isinstance(key, str) else key
        out[canonical] = _canonicalize(value, (*path, str(canonical)))
    return out


def _valid_keys(path: tuple[str, ...]) -> list[str]:
    model = _section_model(path)
    keys = list(model.model_fields) if model else []
    return keys + list(FRENCH_KEYS.get(path, {}))


def _short_repr(value: Any) -> str:
    """A short repr of a rejected value; never fails (Python refuses to print integers of more
    than 4300 digits, and an input can be a large structure)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        text = repr(value)
    except ValueError:
        return "a value too large to show"
    return _clip(text)


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(_clip(str(p), 40) for p in error["loc"])
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent, name = loc[:-1], loc[-1]
        close = difflib.get_close_matches(name, _valid_keys(parent), n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join((*parent, close[0]))}'?" if close else ""
        valid = ", ".join(_section_model(parent).model_fields) if _section_model(parent) else ""
        return problem(key, f"unknown key{hint} (valid keys here: {valid})")
    if error["type"] == "model_type":
        return problem(key, f"expected a mapping of keys, got {_short_repr(error['input'])}")
    if error["type"] == "value_error":  # a validator's own message (a registered name)
        return problem(key, _clip(error["msg"].removeprefix("Value error, "), 300))
    return problem(key, f"{_clip(error['msg'], 300)} (got {_short_repr(error['input'])})")


def parse_config(raw: dict[str, Any] | None) -> JobConfig:
    """Validate a raw mapping (canonical or French keys) into a JobConfig, or raise UserError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(problem("<config>", "the top level must be a mapping of sections"))
    try:
        cfg = JobConfig.model_validate(_canonicalize(raw))
    except ValidationError as err:
        raise UserError([_describe(e) for e in err.errors()]) from None
    problems = _cross_field_problems(cfg)
    if problems:
        raise UserError(problems)
    return cfg


def _cross_field_problems(cfg: JobConfig) -> list[str]:
    """Numeric limits that involve two fields of one section (layout rules that need the world
    size are in mcpar.plan)."""
    opt = cfg.optimization
    out = cfg.model.problems()
    if opt.optimizer == "adamw" and opt.lr * opt.weight_decay >= 1.0:
        out.append(problem(
            "optimization.weight_decay",
            f"lr x weight_decay = {opt.lr:g} x {opt.weight_decay:g} = "
            f"{opt.lr * opt.weight_decay:g}, must be below 1: AdamW multiplies the weights by "
            "1 - lr x weight_decay each step, so they would be zeroed or flip sign and grow until "
            "the loss is NaN; typical weight_decay is 0.01 to 0.1",
        ))
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set KEY=VALUE`` overrides (values parsed as YAML scalars) to a raw mapping."""
    raw = _canonicalize(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(
                problem(_clip(item), "an override must look like KEY=VALUE, e.g. model.seq_len=64")
            )
        parts = tuple(key.strip().split("."))
        if len(parts) > MAX_YAML_DEPTH:
            raise UserError(problem(_clip(key), f"a key path of more than {MAX_YAML_DEPTH} parts; "
                                    "config keys are a few levels deep"))
        # Accept French key paths in overrides too, by canonicalizing part by part.
        canon: list[str] = []
        for part in parts:
            canon.append(FRENCH_KEYS.get(tuple(canon), {}).get(part, part))
        if len(text) > MAX_CONFIG_BYTES:
            raise UserError(problem(_clip(".".join(canon)), f"the value is longer than "
                                    f"{MAX_CONFIG_BYTES >> 20} MiB"))
        try:
            value = bounded_yaml(text)
        except YAMLBoundExceeded as err:
            raise UserError(
                problem(_clip(".".join(canon)), f"--set value refused: {err.message}")
            ) from None
        except (yaml.YAMLError, ValueError):
            value = text  # not YAML: the text itself, which validation then judges
        node = raw
        for i, part in enumerate(canon[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = _clip(".".join(canon[: i + 1]))
                raise UserError(problem(where, "is a value, not a section"))
            node = child
        node[canon[-1]] = value
    return raw


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """The JobConfig from a YAML file (or the built-in default when `path` is None) + overrides."""
    raw = load_yaml(path) if path is not None else default_raw_config()
    return parse_config(apply_overrides(raw, overrides or []))


def default_raw_config() -> dict[str, Any]:
    """The built-in default job: the schema's defaults (a small GPT on the stdlib corpus).

    Sized so that `mcpar train` finishes in a few minutes on a 2-core CPU machine with
    ``DEFAULT_NPROC`` data-parallel workers and reaches a validation loss well below 2.5 nats per
    byte. The data degree is left to the number of workers.
    """
    return {}


# Workers `mcpar train` starts for the built-in default when --nproc is not given.
DEFAULT_NPROC = 2


def to_yaml(cfg: JobConfig) -> str:
    """The fully resolved configuration with canonical keys (the run directory's config.yaml)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
