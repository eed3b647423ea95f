"""Damaged Hugging Face directories, seeded: each is refused as a user error (one line per
problem naming ``model.init_from``, no other exception) before any worker would start, or loads
exactly the tensors of the undamaged directory. No file outside the directory is opened (every
open is recorded), and none of them hangs (a FIFO named by the index included).

The directory is a tiny Llama written by mcpar's own export code (a few safetensors shards and
an index). Damage: truncated shards, flipped header bytes, header fields rewritten (dtype,
shape, offsets, header length), tensors saved transposed, reshaped, with an integer dtype or
non-finite values, index entries that point outside the directory (``..``, absolute, a link
out), at a FIFO, a device or a directory, or at the wrong file, and config.json damaged (not an
object, a key missing, a wrong type). The checks run in-process, as ``mcpar train``'s validation
and a worker's load call them; two cases go through the CLI end to end."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import random
import shutil
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import run_cli_in_process, sets, time_limit

from mcpar.config import ModelConfig
from mcpar.errors import UserError
from mcpar.interop import hf_import
from mcpar.interop.hf_export import write_safetensors
from mcpar.interop.hf_names import hf_config, to_hf
from mcpar.models.spec import get_model_spec

INDEX = "model.safetensors.index.json"
TIMEOUT_S = 5


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig, dict]:
    """The undamaged directory, the run's model section for it and the tensors it loads."""
    cfg = ModelConfig(kind="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=48, vocab_size=256, seq_len=16)
    model = get_model_spec(cfg.kind).build(cfg, 0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    root = tmp_path_factory.mktemp("hf") / "model"
    root.mkdir()
    assert write_safetensors(to_hf(cfg, params), root, 20000) >= 3  # sharded, with an index
    (root / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    run = ModelConfig(**{k: v for k, v in hf_import.import_section(root).items()})
    assert run.init_from == f"hf:{root}"
    loaded = hf_import.load_init(run)
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    return root, run, loaded


# --- recording every open, and a timeout ---------------------------------------------------
@contextlib.contextmanager
def recorded_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    import safetensors
    import safetensors.torch

    seen: list[str] = []

    def wrap(fn: Callable, arg: int = 0) -> Callable:
        def opener(*args, **kwargs):  # type: ignore[no-untyped-def]
            target = args[arg] if len(args) > arg else None
            if isinstance(target, str | bytes | os.PathLike):
                seen.append(os.fsdecode(target))
            return fn(*args, **kwargs)
        return opener

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", wrap(builtins.open))
        m.setattr(io, "open", wrap(io.open))
        m.setattr(os, "open", wrap(os.open))
        m.setattr(safetensors, "safe_open", wrap(safetensors.safe_open))
        m.setattr(safetensors.torch, "safe_open", wrap(safetensors.torch.safe_open))
        yield seen



# --- damage ---------------------------------------------------------------------------------
def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(file: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _rewrite(file: Path, fn: Callable[[dict], None]) -> None:
    header, data = _split(file)
    fn(header)
    _join(file, header, data)


def _tensor_names(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _resave(d: Path, rng: random.Random, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """One tensor of one shard replaced by ``change`` of it, the shard re-written whole."""
    from safetensors.torch import load_file, save_file

    file = rng.choice(_shards(d))
    tensors = load_file(str(file))
    name = rng.choice(sorted(tensors))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _index(d: Path) -> dict:
    return json.loads((d / INDEX).read_text())


def _point(d: Path, rng: random.Random, target: str) -> None:
    body = _index(d)
    tensor = rng.choice(sorted(body["weight_map"]))
    body["weight_map"][tensor] = target
    (d / INDEX).write_text(json.dumps(body))


def _outside_copy(d: Path) -> str:
    """A valid shard in the sandbox beside the directory: what an escaping name would read."""
    return str(d.parent / "outside" / "x.safetensors")


def truncate(d: Path, rng: random.Random) -> None:
    file = rng.choice(_shards(d))
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(rng.randrange(0, size))


def flip_header_byte(d: Path, rng: random.Random) -> None:
    file = rng.choice(_shards(d))
    raw = bytearray(file.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    at = rng.randrange(0, 8 + n)
    raw[at] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(raw))


def header_field(d: Path, rng: random.Random) -> None:
    file = rng.choice(_shards(d))
    which = rng.choice(["dtype", "unknown_dtype", "shape", "shape_type", "offsets",
                        "offsets_neg", "offsets_type", "entry", "metadata", "huge_length",
                        "header_list"])
    if which == "huge_length":
        raw = bytearray(file.read_bytes())
        raw[:8] = struct.pack("<Q", rng.choice([2**40, 2**63, len(raw) - 7, len(raw) * 4]))
        file.write_bytes(bytes(raw))
        return
    if which == "header_list":
        _, data = _split(file)
        text = b"[1, 2, 3]"
        file.write_bytes(struct.pack("<Q", len(text)) + text + data)
        return

    def edit(header: dict) -> None:
        entry = header[rng.choice(_tensor_names(header))]
        if which == "dtype":
            entry["dtype"] = rng.choice(["F16", "I32", "F64", "U8", "BOOL"])
        elif which == "unknown_dtype":
            entry["dtype"] = rng.choice(["F128", "float32", "", 4])
        elif which == "shape":
            entry["shape"] = rng.choice([[*entry["shape"], 2], entry["shape"][::-1] + [1],
                                         [entry["shape"][0] * 2], []])
        elif which == "shape_type":
            entry["shape"] = rng.choice([["4", 8], [-1, 4], [1.5], "32", None])
        elif which == "offsets":
            lo, hi = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[lo + 4, hi + 4], [lo, hi + 10**9],
                                                [lo, hi - 4], [hi, lo]])
        elif which == "offsets_neg":
            entry["data_offsets"] = [-8, entry["data_offsets"][1]]
        elif which == "offsets_type":
            entry["data_offsets"] = rng.choice([None, [0], "0,4", [0.0, 4.0]])
        elif which == "entry":
            header[rng.choice(_tensor_names(header))] = rng.choice([None, 3, [1, 2], "x"])
        else:
            header["__metadata__"] = rng.choice([["pt"], {"format": 3}, 7])
    _rewrite(file, edit)


def transposed(d: Path, rng: random.Random) -> None:
    def change(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and t.shape[0] != t.shape[1]:
            return t.t()
        return t.reshape(-1)[:-1] if t.dim() == 1 else t.reshape(-1)  # any tensor: refused
    _resave(d, rng, change)


def reshaped(d: Path, rng: random.Random) -> None:
    _resave(d, rng, lambda t: torch.cat([t.reshape(-1), t.reshape(-1)[:1]]).reshape(-1, 1))


def int_dtype(d: Path, rng: random.Random) -> None:
    _resave(d, rng, lambda t: t.to(rng.choice([torch.int32, torch.int64, torch.bool,
                                               torch.uint8])))


def exact_dtype(d: Path, rng: random.Random) -> None:
    """float64 holds every float32 exactly: the directory loads the same tensors."""
    _resave(d, rng, lambda t: t.double())


def non_finite(d: Path, rng: random.Random) -> None:
    def change(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.reshape(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"),
                                                              float("-inf")])
        return t
    _resave(d, rng, change)


def index_escape(d: Path, rng: random.Random) -> None:
    outside = _outside_copy(d)
    which = rng.choice(["dotdot", "absolute", "link", "dotdot_deep", "link_dir"])
    if which == "dotdot":
        _point(d, rng, "../outside/x.safetensors")
    elif which == "dotdot_deep":
        _point(d, rng, "sub/../../outside/x.safetensors")
    elif which == "absolute":
        _point(d, rng, outside)
    elif which == "link":
        (d / "linked.safetensors").symlink_to(outside)
        _point(d, rng, "linked.safetensors")
    else:
        (d / "up").symlink_to(d.parent / "outside")
        _point(d, rng, "up/x.safetensors")


def index_special(d: Path, rng: random.Random) -> None:
    which = rng.choice(["fifo", "zero", "dir", "missing", "empty", "null_byte", "link_zero"])
    if which == "fifo":
        os.mkfifo(d / "pipe.safetensors")
        _point(d, rng, "pipe.safetensors")
    elif which == "zero":
        _point(d, rng, "/dev/zero")
    elif which == "link_zero":
        (d / "zero.safetensors").symlink_to("/dev/zero")
        _point(d, rng, "zero.safetensors")
    elif which == "dir":
        (d / "folder").mkdir()
        _point(d, rng, "folder")
    elif which == "missing":
        _point(d, rng, "model-00009-of-00009.safetensors")
    elif which == "empty":
        _point(d, rng, "")
    else:
        _point(d, rng, "model\x00.safetensors")


def index_structure(d: Path, rng: random.Random) -> None:
    body = _index(d)
    which = rng.choice(["list", "no_map", "map_list", "value_int", "value_list", "wrong_file",
                        "not_json", "empty_map", "fifo_index"])
    if which == "list":
        body = [body]
    elif which == "no_map":
        del body["weight_map"]
    elif which == "map_list":
        body["weight_map"] = list(body["weight_map"])
    elif which in ("value_int", "value_list"):
        tensor = rng.choice(sorted(body["weight_map"]))
        body["weight_map"][tensor] = 3 if which == "value_int" else ["a"]
    elif which == "wrong_file":
        files = sorted(set(body["weight_map"].values()))
        tensor = rng.choice(sorted(body["weight_map"]))
        body["weight_map"][tensor] = next(f for f in files if f != body["weight_map"][tensor])
    elif which == "empty_map":
        body["weight_map"] = {}
    elif which == "not_json":
        (d / INDEX).write_text(json.dumps(body)[: rng.randrange(1, 40)])
        return
    else:
        (d / INDEX).unlink()
        os.mkfifo(d / INDEX)
        return
    (d / INDEX).write_text(json.dumps(body))


_CONFIG_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "head_dim")


def config_damage(d: Path, rng: random.Random) -> None:
    file = d / "config.json"
    body = json.loads(file.read_text())
    which = rng.choice(["list", "missing", "wrong_type", "architectures", "not_json",
                        "harmless", "link_out", "fifo", "eps_type"])
    if which == "list":
        body = [body]
    elif which == "missing":
        del body[rng.choice(["num_hidden_layers", "hidden_size", "num_attention_heads",
                             "intermediate_size", "vocab_size"])]
    elif which == "wrong_type":
        body[rng.choice(_CONFIG_INTS)] = rng.choice(["32", 32.5, -4, 0, True, [32], {"a": 1}])
    elif which == "eps_type":
        body[rng.choice(["rms_norm_eps", "rope_theta"])] = rng.choice(["1e-5", None, [1]])
    elif which == "architectures":
        body["architectures"] = rng.choice(["LlamaForCausalLM", [], [3], None, {"a": 1}])
    elif which == "harmless":
        body["use_cache"] = False  # not read by mcpar: the same model
        body["transformers_version"] = "0.0"
    elif which == "not_json":
        file.write_text(json.dumps(body)[: rng.randrange(0, 60)])
        return
    elif which == "link_out":
        out = d.parent / "outside" / "config.json"
        out.write_text(json.dumps(body))
        file.unlink()
        file.symlink_to(out)
        return
    else:
        file.unlink()
        os.mkfifo(file)
        return
    file.write_text(json.dumps(body))


FAMILIES: dict[str, tuple[Callable[[Path, random.Random], None], int]] = {
    "truncate": (truncate, 14), "flip_header_byte": (flip_header_byte, 24),
    "header_field": (header_field, 24), "transposed": (transposed, 8),
    "reshaped": (reshaped, 4), "int_dtype": (int_dtype, 4), "exact_dtype": (exact_dtype, 3),
    "non_finite": (non_finite, 8), "index_escape": (index_escape, 10),
    "index_special": (index_special, 12), "index_structure": (index_structure, 14),
    "config": (config_damage, 18),
}


def _case_dir(pristine_dir: Path, base: Path) -> Path:
    d = base / "model"
    shutil.copytree(pristine_dir, d)
    outside = base / "outside"
    outside.mkdir()
    shutil.copy(_shards(d)[0], outside / "x.safetensors")
    return d


def _outcome(d: Path, run: ModelConfig, expected: dict, seen: list[str]) -> str:
    """'refused' (a user error before the workers), or 'same' (the undamaged tensors)."""
    cfg = run.model_copy(update={"init_from": f"hf:{d}"})
    try:
        with time_limit(TIMEOUT_S):
            hf_import.check_init_from(cfg)  # mcpar train's validation, before the workers
    except UserError as exc:
        assert exc.problems and all(p.startswith("model.init_from: ") and "\n" not in p
                                    for p in exc.problems), exc.problems
        return "refused"
    with time_limit(TIMEOUT_S):
        got = hf_import.load_init(cfg)  # what each worker then loads: must not fail now
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), "tensors differ"
    return "same"


def test_damaged_hf_directories_are_refused_or_load_the_same(
    pristine: tuple[Path, ModelConfig, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, run, expected = pristine
    outcomes: Counter[tuple[str, str]] = Counter()
    start = time.monotonic()
    for family, (damage, count) in FAMILIES.items():
        for seed in range(count):
            base = tmp_path / f"{family}-{seed}"
            base.mkdir()
            d = _case_dir(root, base)
            damage(d, random.Random(f"{family}/{seed}"))
            with recorded_opens(monkeypatch) as seen:
                try:
                    outcome = _outcome(d, run, expected, seen)
                except Exception as exc:  # noqa: BLE001 - named in the failure
                    raise AssertionError(f"{family} seed {seed}: {type(exc).__name__}: "
                                         f"{exc}") from exc
            resolved = {str(Path(p).resolve()) for p in seen if p}
            out = [p for p in resolved if not p.startswith(str(d.resolve()) + os.sep)
                   and p.startswith(str(tmp_path.resolve()))]
            assert not out, f"{family} seed {seed} opened {out}"
            assert not [p for p in resolved if p.startswith("/dev/")], (family, seed, resolved)
            outcomes[family, outcome] += 1
    total = sum(outcomes.values())
    print(f"\n{total} damaged directories in {time.monotonic() - start:.1f} s: "
          + ", ".join(f"{f} {o} {n}" for (f, o), n in sorted(outcomes.items())))
    assert total >= 100
    # The families that change what the model would read are refused every time.
    for family in ("truncate", "transposed", "reshaped", "int_dtype", "non_finite",
                   "index_escape", "index_special"):
        assert outcomes[family, "same"] == 0, family
    assert outcomes["exact_dtype", "same"] == FAMILIES["exact_dtype"][1]


# --- one finding each, on the smallest case --------------------------------------------------
def _refusal(d: Path, run: ModelConfig) -> str:
    cfg = run.model_copy(update={"init_from": f"hf:{d}"})
    with time_limit(TIMEOUT_S), pytest.raises(UserError) as exc:
        hf_import.check_init_from(cfg)
    assert len(exc.value.problems) == 1, exc.value.problems
    return exc.value.problems[0]


def _one(pristine: tuple, tmp_path: Path, edit: Callable[[Path], None]) -> str:
    d = _case_dir(pristine[0], tmp_path)
    edit(d)
    return _refusal(d, pristine[1])


def _set_entry(target: str) -> Callable[[Path], None]:
    return lambda d: _point(d, random.Random(0), target)


@pytest.mark.parametrize("target, needle", [
    ("../outside/x.safetensors", "a path through '..', outside"),
    ("ABSOLUTE", "an absolute path, outside"),
    ("/dev/zero", "an absolute path"),
])
def test_weight_map_names_outside_the_directory_are_refused(
    pristine: tuple, tmp_path: Path, target: str, needle: str
) -> None:
    target = _outside_copy(tmp_path / "model") if target == "ABSOLUTE" else target
    line = _one(pristine, tmp_path, _set_entry(target))
    assert line.startswith("model.init_from: ") and INDEX in line and needle in line, line
    assert repr(target) in line


def test_weight_map_fifo_and_link_out_are_refused_without_opening(
    pristine: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fifo(d: Path) -> None:
        os.mkfifo(d / "pipe.safetensors")
        _point(d, random.Random(0), "pipe.safetensors")

    with recorded_opens(monkeypatch) as seen:
        line = _one(pristine, tmp_path / "a", fifo)
    assert "a FIFO, not a regular file" in line, line
    assert not [p for p in seen if p.endswith("pipe.safetensors")]

    def link(d: Path) -> None:
        (d / "y.safetensors").symlink_to(_outside_copy(d))
        _point(d, random.Random(0), "y.safetensors")
    assert "outside" in _one(pristine, tmp_path / "b", link)


def test_transposed_tensor_of_the_same_size_is_refused(pristine: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    def edit(d: Path) -> None:
        for file in _shards(d):
            tensors = load_file(str(file))
            name = "model.layers.0.mlp.up_proj.weight"  # [48, 32]
            if name in tensors:
                tensors[name] = tensors[name].t().contiguous()
                save_file(tensors, str(file))
    line = _one(pristine, tmp_path, edit)
    assert "'model.layers.0.mlp.up_proj.weight' has shape [32, 48]" in line, line
    assert "builds [48, 32]" in line


def test_nan_weights_are_refused_naming_the_tensor(pristine: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    def edit(d: Path) -> None:
        file = _shards(d)[0]
        tensors = load_file(str(file))
        name = sorted(tensors)[0]
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        save_file(tensors, str(file))
    line = _one(pristine, tmp_path, edit)
    assert "holds non-finite values" in line and "tensor '" in line, line


@pytest.mark.parametrize("edit, needle", [
    (lambda b: [b], "holds a list, not a JSON object"),
    (lambda b: {k: v for k, v in b.items() if k != "num_hidden_layers"},
     "no key 'num_hidden_layers'"),
    (lambda b: {**b, "hidden_size": "32"}, "key 'hidden_size' is \"32\""),
])
def test_malformed_config_json_is_one_line_naming_the_key(
    pristine: tuple, tmp_path: Path, edit: Callable, needle: str
) -> None:
    def damage(d: Path) -> None:
        (d / "config.json").write_text(json.dumps(edit(json.loads(
            (d / "config.json").read_text()))))
    line = _one(pristine, tmp_path, damage)
    assert "config.json" in line and needle in line, line


@pytest.mark.parametrize("body, needle", [
    ([1], "holds a list, not a JSON object"),
    ({"metadata": {}}, "key 'weight_map'"),
    ({"weight_map": {"model.norm.weight": 7}}, "names 7: not a file name"),
])
def test_malformed_index_is_one_line_naming_the_key(
    pristine: tuple, tmp_path: Path, body: object, needle: str
) -> None:
    line = _one(pristine, tmp_path, lambda d: (d / INDEX).write_text(json.dumps(body)))
    assert INDEX in line and needle in line, line


def test_header_bounds_are_checked_before_the_library_reads(
    pristine: tuple, tmp_path: Path
) -> None:
    def huge(d: Path) -> None:
        file = _shards(d)[0]
        raw = file.read_bytes()
        file.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    line = _one(pristine, tmp_path, huge)
    assert "header length" in line and _shards(tmp_path / "model")[0].name in line, line


def test_train_and_import_refuse_damaged_directories_end_to_end(
    pristine: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    root, run, _ = pristine
    nan_dir = _case_dir(root, tmp_path / "nan")
    file = _shards(nan_dir)[-1]
    tensors = load_file(str(file))
    tensors = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    save_file(tensors, str(file))
    keys = hf_import.import_section(root)
    model = [f"model.{k}={json.dumps(v) if not isinstance(v, str) else v}"
             for k, v in keys.items() if k != "init_from"]
    proc = run_cli_in_process(
        capsys, "train", *sets(*model, f"model.init_from=hf:{nan_dir}",
                               "training.progress=false"),
        "--nproc", "1", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.init_from: " in lines[0] and "non-finite" in lines[0], lines
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())

    bad_index = _case_dir(root, tmp_path / "index")
    _point(bad_index, random.Random(0), "../outside/x.safetensors")
    proc = run_cli_in_process(capsys, "import", str(bad_index))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "'../outside/x.safetensors'" in lines[0] and "Traceback" not in proc.stderr
