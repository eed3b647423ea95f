"""Writes the configuration reference (docs/config.md) from the schema itself.

``python -m mcpar.config_docs > docs/config.md``; a test keeps the file equal to this output, so
the reference cannot drift from the code.
"""

from __future__ import annotations

from typing import get_args

from pydantic import BaseModel

from mcpar.config import FRENCH_KEYS, FRENCH_VALUES, JobConfig


def _type_name(annotation: object) -> str:
    if annotation is type(None):
        return "None"
    args = get_args(annotation)
    if args and all(isinstance(a, str) for a in args):  # Literal choices
        return " \\| ".join(f"`{a}`" for a in args)
    if args:  # a union such as Literal[...] | None
        return " \\| ".join(_type_name(a) for a in args)
    return getattr(annotation, "__name__", None) or str(annotation)


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(f"| `{key}` | {_type_name(annotation)} | `{default}` | {field.description} |")
    return rows


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema by `python -m mcpar.config_docs > docs/config.md`.",
        "Keys are dotted paths into the YAML file; `--set KEY=VALUE` takes the same paths.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
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
