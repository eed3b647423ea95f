"""Config safety: hostile or broken files and values are refused as user errors (exit 2, one
line per problem naming the file or the key), quickly and in bounded memory, never a traceback.

YAML bounds (alias bombs, deep nesting, big files, bad encodings), finite and runnable numbers in
every numeric field, and a seeded fuzz of generated bad configs through ``mcpar check``.
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from annotated_types import Ge, Gt, Le
from conftest import REPO, run_cli_in_process, time_limit
from pydantic import BaseModel

import mcpar.commands.check  # noqa: F401  (imported once here, not inside the timed calls)
from mcpar.config import (
    FRENCH_KEYS,
    MAX_CONFIG_BYTES,
    MAX_YAML_ALIASES,
    MAX_YAML_DEPTH,
    JobConfig,
    load_config,
    load_yaml,
)
from mcpar.config.yaml_safe import clip_text as _clip
from mcpar.errors import UserError

# Nine levels of nine mapping aliases: 9**9 (387 million) values once expanded, in 700 bytes.
# Walking the mappings (to translate the seed's French keys) used to expand them until memory
# ran out.
BILLION_LAUGHS = "l0: &l0 {a: lol, b: lol, c: lol, d: lol, e: lol, f: lol, g: lol, h: lol, " \
    "i: lol}\n" + "".join(
        f"l{i}: &l{i} {{" + ", ".join(f"{k}: *l{i - 1}" for k in "abcdefghi") + "}\n"
        for i in range(1, 9)
    )
# The same with sequences.
LIST_LAUGHS = "lol: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9)
)
# Two aliases per level, 45 levels: 2**45 values from 90 alias uses (under the alias bound).
DOUBLING_CHAIN = "d0: &d0 [a, b]\n" + "".join(
    f"d{i}: &d{i} [*d{i - 1}, *d{i - 1}]\n" for i in range(1, 45)
)


def deadline(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Fail (rather than hang) when the block runs past `seconds`: a regression that expands an
    alias bomb is interrupted by SIGALRM in the Python loop doing it (conftest's time_limit,
    whose exception no ``except OSError`` or ``except Exception`` of the code can swallow)."""
    return time_limit(seconds)


def refused(capsys: pytest.CaptureFixture[str], path: Path, *extra: str,
            seconds: float = 1.0) -> str:
    """``mcpar check path`` in this process: exit 2 within `seconds` of this process's CPU
    time (the other test worker and host steal do not count; an expanding bomb does), under
    64 MiB of Python allocations, every error line naming the file; the error text."""
    tracemalloc.start()
    start = time.process_time()
    try:
        with deadline(max(10.0, 5 * seconds)):
            proc = run_cli_in_process(capsys, "check", str(path), *extra)
        elapsed = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("mcpar: error: ") for line in lines), proc.stderr
    return proc.stderr


def write(tmp_path: Path, text: str | bytes, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# --- YAML bounds ----------------------------------------------------------------------------

def test_alias_bomb_exits_2_in_a_subprocess_under_a_2_gib_address_space(tmp_path: Path) -> None:
    path = write(tmp_path, BILLION_LAUGHS, "bomb.yaml")
    assert len(BILLION_LAUGHS) < 1024, len(BILLION_LAUGHS)

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run(
        [sys.executable, "-m", "mcpar.cli", "check", str(path)], capture_output=True, text=True,
        timeout=60, cwd=REPO, preexec_fn=limit_memory,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"{path}:" in proc.stderr and "alias" in proc.stderr


@pytest.mark.parametrize("text", [BILLION_LAUGHS, LIST_LAUGHS, DOUBLING_CHAIN],
                         ids=["laughs", "list-laughs", "doubling"])
def test_alias_bomb_is_refused_within_a_second(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    err = refused(capsys, write(tmp_path, text))
    assert "once aliases are expanded" in err and f"{tmp_path / 'job.yaml'}:" in err


def test_too_many_aliases_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "x: &x 1\nmodel:\n  junk: [" + ", ".join(["*x"] * (MAX_YAML_ALIASES + 1)) + "]\n"
    assert f"more than {MAX_YAML_ALIASES} alias uses" in refused(capsys, write(tmp_path, text))


def test_a_few_aliases_still_work(tmp_path: Path) -> None:
    text = "model:\n  num_layers: &n 3\noptimization:\n  warmup_steps: *n\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.model.num_layers == cfg.optimization.warmup_steps == 3


def test_an_alias_to_its_own_node_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "contains it" in refused(capsys, write(tmp_path, "model: &m {a: *m}\n"))


@pytest.mark.parametrize("style", ["flow", "block"])
def test_deep_nesting_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], style: str
) -> None:
    depth = 5000 if style == "flow" else 200
    if style == "flow":
        text = "model: " + "[" * depth + "]" * depth + "\n"
    else:
        text = "".join(" " * i + f"k{i}:\n" for i in range(depth)) + " " * depth + "v\n"
    err = refused(capsys, write(tmp_path, text))
    assert f"nested more than {MAX_YAML_DEPTH} levels" in err


def test_nesting_through_aliases_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [[[[*a{i - 1}]]]]\n" for i in range(1, 12))
    assert "levels deep once aliases are expanded" in refused(capsys, write(tmp_path, text))


def test_a_big_file_is_refused_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "# comment\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert "larger than 1 MiB" in refused(capsys, path)
    sparse = tmp_path / "sparse.yaml"
    with sparse.open("wb") as f:
        f.truncate(8 << 30)  # 8 GiB of holes: only the first MiB may be read
    assert "larger than 1 MiB" in refused(capsys, sparse)


def test_non_utf8_and_bad_syntax_name_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, b"model:\n  kind: gpt\n  junk: \xff\xfe\n")
    assert f"{path}:3: not UTF-8" in refused(capsys, path)
    path = write(tmp_path, "model:\n  kind: [gpt\n")
    assert f"{path}:3: not valid YAML" in refused(capsys, path)
    path = write(tmp_path, "model:\n\tkind: gpt\n")
    assert f"{path}:2: not valid YAML" in refused(capsys, path)
    path = write(tmp_path, "model: !!python/object:os.system {}\n")
    assert f"{path}:1: not valid YAML" in refused(capsys, path)


@pytest.mark.parametrize("number", ["9" * 5000, "0x" + "f" * 5000, "-" + "9" * 5000])
def test_integers_of_thousands_of_digits_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], number: str
) -> None:
    err = refused(capsys, write(tmp_path, f"model:\n  num_layers: {number}\n"))
    assert "Traceback" not in err and len(err) < 1000


def test_set_values_have_the_same_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "{}\n")
    bomb = "[" + LIST_LAUGHS.replace("\n", ", ").rstrip(", ") + "]"
    flow = "{" + BILLION_LAUGHS.replace("\n", ", ").rstrip(", ") + "}"
    assert "model.num_layers: --set value refused" in refused(
        capsys, path, "--set", f"model.num_layers={flow}")
    assert "refused" in refused(capsys, path, "--set", f"model.num_layers={bomb}")
    deep = "[" * 2000 + "]" * 2000
    assert "nested more than" in refused(capsys, path, "--set", f"model.num_layers={deep}")
    long_key = ".".join(["a"] * 5000)
    assert "key path of more than" in refused(capsys, path, "--set", f"{long_key}=1")


@pytest.mark.parametrize("text", [
    BILLION_LAUGHS, DOUBLING_CHAIN, "a: &a [*a]\n", "a: " + "[" * 5000 + "]" * 5000,
    "x: &x 1\ny: [" + ", ".join(["*x"] * 101) + "]\n",
], ids=["laughs", "doubling", "recursive", "deep", "aliases"])
def test_the_pure_python_loader_has_the_same_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """Without libyaml the loader counts aliases and nesting itself while composing."""
    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    start = time.process_time()
    with deadline(10.0), pytest.raises(UserError, match="refused"):
        load_yaml(write(tmp_path, text))
    assert time.process_time() - start < 2.0


def test_load_yaml_raises_user_errors_only(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="once aliases are expanded"):
        load_yaml(write(tmp_path, BILLION_LAUGHS))


# --- numbers ----------------------------------------------------------------------------------

def _leaves(model: type[BaseModel] = JobConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, field info) of every leaf field of the schema."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _numeric_kind(field: Any) -> type | None:
    kinds = {a for a in (field.annotation, *get_args(field.annotation)) if a in (int, float)}
    return kinds.pop() if kinds else None


def _bounds(field: Any) -> tuple[float | None, float | None, bool]:
    low = high = None
    strict_low = False
    for meta in field.metadata:
        if isinstance(meta, Ge):
            low = meta.ge
        if isinstance(meta, Gt):
            low, strict_low = meta.gt, True
        if isinstance(meta, Le):
            high = meta.le
    return low, high, strict_low


NUMERIC = [(key, field) for key, field in _leaves() if _numeric_kind(field) is not None]
FLOATS = [key for key, field in NUMERIC if _numeric_kind(field) is float]


def test_every_numeric_field_has_both_bounds() -> None:
    assert len(NUMERIC) > 40 and len(FLOATS) > 10
    unbounded = [key for key, field in NUMERIC
                 if None in _bounds(field)[:2] and not any(
                     hasattr(m, "lt") for m in field.metadata)]
    assert not unbounded, f"no lower or upper bound: {unbounded}"


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e999", "nan"])
def test_nan_and_inf_are_refused_in_every_float_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str
) -> None:
    err = refused(capsys, write(tmp_path, "{}\n"), "--set", f"{key}={value}")
    assert f"mcpar: error: {key}: " in err, err


@pytest.mark.parametrize("key,field", NUMERIC, ids=[key for key, _ in NUMERIC])
def test_values_past_each_bound_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, field: Any
) -> None:
    low, high, _ = _bounds(field)
    kind = _numeric_kind(field)
    too_big = [high * 2 + 1, 10**30, 2**64] if high is not None else []
    too_small = [low - 1, -(10**30)] if low is not None else []
    for value in too_big + too_small:
        value = kind(value)
        err = refused(capsys, write(tmp_path, "{}\n"), "--set", f"{key}={value}")
        assert f"mcpar: error: {key}: " in err, err


def test_bounds_still_allow_the_largest_real_models(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-3 175B on the seed's 1024 devices, and Llama 3 405B's width and vocabulary."""
    seed = str(REPO / "configs" / "seed_mcp.yaml")
    gpt3 = ["model.num_layers=96", "model.hidden_size=12288", "model.num_heads=96",
            "model.seq_len=2048", "model.vocab_size=51200"]
    llama = ["model.num_layers=128", "model.hidden_size=16384", "model.num_heads=128",
             "model.seq_len=8192", "model.vocab_size=128256", "model.ffn_hidden_size=53248"]
    for settings in (gpt3, llama):
        args = [item for s in settings for item in ("--set", s)]
        proc = run_cli_in_process(capsys, "check", seed, *args)
        assert proc.returncode == 0, proc.stderr


def test_a_weight_decay_that_would_train_to_nan_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr x weight_decay >= 1 under AdamW zeroes or flips the weights every step: weight_decay
    1e6 used to train to exit 0 with loss NaN; lr 1e300 overflowed the update (a traceback)."""
    path = write(tmp_path, "{}\n")
    err = refused(capsys, path, "--set", "optimization.weight_decay=1e6")
    assert "optimization.weight_decay: lr x weight_decay" in err
    assert "optimization.lr: " in refused(capsys, path, "--set", "optimization.lr=1e300")
    assert load_config(path, ["optimization.weight_decay=100"]).optimization.weight_decay == 100
    cfg = load_config(path, ["optimization.optimizer=onebit_adam",
                             "optimization.weight_decay=1e6"])
    assert cfg.optimization.weight_decay == 1e6  # added to the gradient there, not decoupled


def test_seed_and_timeout_fit_what_uses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import datetime

    import torch

    path = write(tmp_path, "{}\n")
    cfg = load_config(path, [f"training.seed={2**63 - 1}", "training.collective_timeout_s=2592000"])
    torch.Generator().manual_seed(cfg.training.seed)
    datetime.timedelta(seconds=cfg.training.collective_timeout_s)
    assert "training.seed: " in refused(capsys, path, "--set", f"training.seed={2**64}")
    err = refused(capsys, path, "--set", "training.collective_timeout_s=1e14")
    assert "training.collective_timeout_s: " in err


# --- fuzz -------------------------------------------------------------------------------------

LEAF_KEYS = [key for key, _ in _leaves()]
SECTIONS = sorted({key.rsplit(".", 1)[0] for key in LEAF_KEYS if "." in key})
TOP_NAMES = set(JobConfig.model_fields) | set(FRENCH_KEYS[()])
JUNK_CHARS = "[]{}:-&*!|>'\"#%@`,?. \n\n\t~=abcxyz019"


def _bad_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(16)
    if choice == 0:
        return rng.choice([math.nan, math.inf, -math.inf])
    if choice == 1:
        return rng.choice([-1, 1]) * 10 ** rng.randrange(0, 400)
    if choice == 2:
        return rng.choice([2**31, 2**63, 2**64, -(2**63) - 1, 0, -1])
    if choice == 3:
        return rng.choice([1e300, -1e300, 1e-300, 5e-324, 0.0, -0.0, 0.5, 1.5])
    if choice == 4:
        return rng.choice(["gpt", "moe", "renforcement", "none", "nvme", "fp32", "GPT", ""])
    if choice == 5:
        return "".join(rng.choice(JUNK_CHARS) for _ in range(rng.randrange(1, 30)))
    if choice == 6:
        return rng.choice([True, False, None])
    if choice == 7 and depth < 4:
        return [_bad_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if choice == 8 and depth < 4:
        return {rng.choice(LEAF_KEYS).rsplit(".", 1)[-1]: _bad_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if choice == 9:
        return rng.randrange(-5, 5000)
    if choice == 10:
        return rng.uniform(-10, 10)
    if choice == 11:
        return "x" * rng.randrange(1000, 5000)
    return rng.choice([1, 2, 4, 8, 16, 64, 128, 1024, 0.1, 0.9, 3e-3])


def _bad_config(rng: random.Random) -> dict[Any, Any]:
    raw: dict[Any, Any] = {}
    for _ in range(rng.randrange(1, 8)):
        roll = rng.random()
        if roll < 0.7:
            path = rng.choice(LEAF_KEYS).split(".")
        elif roll < 0.85:
            path = [*rng.choice(SECTIONS).split("."), rng.choice(["junk", "kind2", "Lr", "1"])]
        elif roll < 0.95:
            path = rng.choice(SECTIONS).split(".")  # a section given a value
        else:
            path = [rng.choice(["junk", "parallelisation", "modele", "optimisation"])]
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[path[-1]] = _bad_value(rng)
    return raw


def _junk_text(rng: random.Random) -> str | bytes:
    roll = rng.random()
    if roll < 0.4:
        return "".join(rng.choice(JUNK_CHARS) for _ in range(rng.randrange(1, 200)))
    if roll < 0.6:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    text = yaml.safe_dump(_bad_config(rng))
    cut = rng.randrange(len(text) + 1)
    junk = "".join(rng.choice(JUNK_CHARS) for _ in range(rng.randrange(1, 20)))
    return text[:cut] + junk + text[cut:]


def _names_the_file_or_a_key(line: str, path: Path, raw: Any) -> bool:
    text = line.removeprefix("mcpar: error: ")
    if text.startswith(str(path)) or text.startswith("<config>: "):
        return True
    names = set(TOP_NAMES)
    if isinstance(raw, dict):
        names |= {_clip(str(k), 40) for k in raw}
    return any(text.startswith(f"{name}:") or text.startswith(f"{name}.") for name in names)


def test_fuzz_of_bad_configs_never_raises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 generated configs (wrong types, huge/negative/NaN/inf numbers, wrong enums, random
    nesting, YAML junk) through ``mcpar check`` in this process: exit 0 or 2, never an
    exception, and each error line names the file or a key."""
    rng = random.Random(20261201)
    path = tmp_path / "fuzz.yaml"
    codes = {0: 0, 2: 0}
    start = time.process_time()
    for case in range(300):
        raw: Any = None
        if case % 3 == 2:
            content = _junk_text(rng)
        else:
            raw = _bad_config(rng)
            content = yaml.safe_dump(raw, sort_keys=False)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        if raw is None:  # the top-level keys as the check read them (or as written)
            raw = {}
            for loader in (getattr(yaml, "CSafeLoader", yaml.SafeLoader), yaml.BaseLoader):
                with contextlib.suppress(Exception):
                    raw.update(yaml.load(path.read_text(), Loader=loader))
        with deadline(10.0):
            proc = run_cli_in_process(capsys, "check", str(path))
        assert proc.returncode in (0, 2), (case, content, proc.stderr)
        codes[proc.returncode] += 1
        for line in proc.stderr.splitlines():
            assert _names_the_file_or_a_key(line, path, raw), (case, content, line)
    assert codes[2] > 200, codes
    assert time.process_time() - start < 30


def test_fuzz_of_bad_set_overrides_never_raises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 generated ``--set KEY=VALUE`` (schema keys, unknown and overlong keys, junk YAML
    values, huge numbers) on a valid file: exit 0 or 2, never an exception, each error line
    naming the key, the override or the file."""
    rng = random.Random(1201)
    path = write(tmp_path, "model:\n  num_layers: 2\n")
    values = ["9" * 5000, "0x" + "f" * 3000, ".nan", "-.inf", "1e999", "[1, [2, [3]]]", "{a: 1}",
              "&a [*a]", "!!binary aGk=", "!!timestamp 2001-12-14", "'unterminated", "null", "~",
              "", ":", "- - -", "*x", "%YAML 1.1"]
    for case in range(200):
        key = rng.choice(LEAF_KEYS) if rng.random() < 0.8 else rng.choice(
            ["junk", "model", "model.kind.deeper", "", ".", "a..b", "modele.junk", "x" * 300])
        if rng.random() < 0.5:
            value = rng.choice(values)
        elif rng.random() < 0.5:
            value = "".join(rng.choice(JUNK_CHARS) for _ in range(rng.randrange(1, 40)))
        else:
            value = str(_bad_value(rng))
        item = f"{key}={value}" if rng.random() < 0.95 else key
        with deadline(10.0):
            proc = run_cli_in_process(capsys, "check", str(path), "--set", item)
        assert proc.returncode in (0, 2), (case, item[:200], proc.stderr)
        names = TOP_NAMES | {_clip(key.split(".")[0], 40), _clip(item, 80)[:40]}
        for line in proc.stderr.splitlines():
            text = line.removeprefix("mcpar: error: ")
            assert text.startswith(str(path)) or any(
                text.startswith(name) for name in names), (case, item[:200], line)
