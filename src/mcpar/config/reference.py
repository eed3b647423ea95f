"""Writes the configuration reference (docs/config.md) from the schema itself.

``python -m mcpar.config.reference > docs/config.md``; a test keeps the file equal to this
output, so the reference cannot drift from the code.
"""

from __future__ import annotations

from typing import get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mcpar.config import (
    FRENCH_KEYS,
    FRENCH_VALUES,
    MAX_CONFIG_BYTES,
    MAX_YAML_ALIASES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    JobConfig,
)
from mcpar.registry import RegisteredName


def _type_name(annotation: object, field: FieldInfo | None = None) -> str:
    registry = next((m.registry for m in field.metadata if isinstance(m, RegisteredName)),
                    None) if field else None
    if registry is not None:  # a registered name: the built-in entries
        return " \\| ".join(f"`{name}`" for name in registry.names())
    if annotation is type(None):
        return "None"
    args = get_args(annotation)
    if args and all(isinstance(a, str) for a in args):  # Literal choices
        return " \\| ".join(f"`{a}`" for a in args)
    if args:  # a union such as Literal[...] | None
        return " \\| ".join(_type_name(a) for a in args)
    return getattr(annotation, "__name__", None) or str(annotation)


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if isinstance(value, int) and value >= 10**6 and str(value).rstrip("0") == "1":
        return f"10^{len(str(value)) - 1}"
    if value == 2**63 - 1:
        return "2^63 - 1"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _range(field: FieldInfo) -> str:
    """The numeric bounds of a field, e.g. ``1 ≤ x ≤ 4096`` or ``0 < x < 1``; '' for none."""
    low = high = ""
    for meta in field.metadata:
        for attr, text in (("ge", "≤"), ("gt", "<")):
            if getattr(meta, attr, None) is not None:
                low = f"{_number(getattr(meta, attr))} {text} "
        for attr, text in (("le", "≤"), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                high = f" {text} {_number(getattr(meta, attr))}"
    return f"{low}x{high}" if low or high else ""


def _optional_section(annotation: object) -> type[BaseModel] | None:
    """``Section | None``'s section; None for any other annotation."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if len(args) == 1 and len(get_args(annotation)) == 2 and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, key + ".")
            continue
        section = _optional_section(annotation)
        if section is not None:  # a section that is off unless given (training.elastic)
            rows.append(f"| `{key}` | {section.__name__} \\| None | `None` |  "
                        f"| {field.description} |")
            rows += _rows(section, key + ".")
            continue
        default = "required" if field.is_required() else \
            f"`{field.get_default(call_default_factory=True)}`"
        rows.append(f"| `{key}` | {_type_name(annotation, field)} | {default} | {_range(field)} "
                    f"| {field.description} |")
    return rows


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema by `python -m mcpar.config.reference > docs/config.md`.",
        "Keys are dotted paths into the YAML file; `--set KEY=VALUE` takes the same paths.",
        "Numbers must be finite (no NaN or infinity) and within their range; a file is at most",
        f"{MAX_CONFIG_BYTES >> 20} MiB of UTF-8 YAML with at most {MAX_YAML_ALIASES} alias uses, "
        f"{MAX_YAML_DEPTH} levels of nesting",
        f"and {MAX_YAML_NODES:,} values once aliases are expanded.",
        "",
        "| key | type | default | range | meaning |",
        "|---|---|---|---|---|",
        *_rows(JobConfig, ""),
        "",
        "## The seed's French keys and values",
        "",
        "Accepted as aliases, so the seed's `configuration_mcp.yaml` loads unchanged.",
        "",
        "| section | French key | canonical key |",
        "|---|---|---|",
    ]
    for section, names in FRENCH_KEYS.items():
        for french, canonical in names.items():
            if french != canonical:
                lines.append(f"| `{'.'.join(section) or '(top)'}` | `{french}` | `{canonical}` |")
    lines += ["", "| French value | canonical value |", "|---|---|"]
    lines += [f"| `{fr}` | `{en}` |" for fr, en in FRENCH_VALUES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
