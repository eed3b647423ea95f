"""A Hugging Face directory checked before anything of it is trusted, as checkpoints are.

Every file the directory names (config.json, the index, the shards its ``weight_map`` lists)
goes through ``contained_file``: kept inside the directory, a regular file. A config.json or
index that is not a JSON object with the keys and types mcpar reads is refused naming the file
and the key. A safetensors file's header is read here, bounded, before the safetensors library
opens it: a sane header length, a JSON object, known dtypes, shapes of whole numbers, offsets
that tile the data exactly and byte sizes of shape x dtype; the library's own errors are caught
into one line naming the file. Then every tensor's shape is checked against the model the run's
``model`` section builds (a transposed tensor with the same element count is refused, not read
flattened), its dtype is a floating one, and its values are finite. Each refusal is one
``UserError`` line naming the key, the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mcpar.config import ModelConfig
from mcpar.contained import contained_file
from mcpar.errors import UserError, problem

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100_000_000  # the safetensors library's own limit on a header
# safetensors dtypes and their sizes in bytes; the floating ones are weights mcpar reads.
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_FIX = "re-save the model (save_pretrained or mcpar export)"
# config.json fields mcpar reads, and the JSON types they must have (None: may be null).
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
               "head_dim", "num_local_experts", "num_experts_per_tok", "n_embd", "n_layer",
               "n_head", "n_inner", "n_positions")
_NULLABLE = ("num_key_value_heads", "head_dim", "n_inner", "max_position_embeddings")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "layer_norm_epsilon")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_STR_FIELDS = ("hidden_act", "activation_function")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _refuse(key: str, message: str) -> UserError:
    return UserError(problem(key, message))


def read_json_object(path: Path, name: str, key: str) -> dict[str, Any]:
    """The JSON object in ``path/name`` (kept inside ``path``); one line naming it otherwise."""
    file = contained_file(path, name, key, f"the directory {path}", fix=_FIX)
    try:
        body = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise _refuse(key, f"{file}: not readable JSON ({exc}); {_FIX}") from None
    if not isinstance(body, dict):
        raise _refuse(key, f"{file}: holds {_json_type(body)}, not a JSON object; {_FIX}")
    return body


def config_problems(file: Path, hf: dict[str, Any]) -> list[str]:
    """Keys of a config.json with a type mcpar cannot read (the architecture aside)."""
    out = []
    for name, value in hf.items():
        if name in _INT_FIELDS:
            ok = (value is None and name in _NULLABLE) or (
                isinstance(value, int) and not isinstance(value, bool) and value > 0)
            want = "a positive whole number"
        elif name in _FLOAT_FIELDS:
            ok = isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0
            want = "a positive number"
        elif name in _BOOL_FIELDS:
            ok = isinstance(value, bool) or value is None
            want = "true or false"
        elif name in _STR_FIELDS:
            ok = isinstance(value, str)
            want = "a string"
        elif name in ("rope_parameters", "rope_scaling"):
            ok = value is None or isinstance(value, dict)
            want = "an object or null"
        else:
            continue
        if not ok:
            out.append(f"{file}: key '{name}' is {json.dumps(value)[:40]}, not {want}; {_FIX}")
    return out


def index_files(path: Path, key: str) -> dict[str, list[str]]:
    """Each safetensors file of the directory (contained, regular) and the tensors the index
    places in it (empty list: a single ``model.safetensors``, whose header says)."""
    index_there = os.path.lexists(path / INDEX)
    if not index_there:
        if not os.path.lexists(path / SINGLE):
            raise _refuse(key, f"{path}: no {SINGLE} nor {INDEX}; save with "
                          "safe_serialization")
        contained_file(path, SINGLE, key, f"the directory {path}", fix=_FIX)
        return {SINGLE: []}
    index = read_json_object(path, INDEX, key)
    file = path / INDEX
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        what = "an empty object" if weight_map == {} else _json_type(weight_map)
        raise _refuse(key, f"{file}: key 'weight_map' is {what}, not an object of tensor names "
                      f"and their files; {_FIX}")
    out: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        contained_file(path, name, key, f"{file}'s weight_map (tensor {tensor!r})", fix=_FIX)
        out.setdefault(name, []).append(tensor)
    return out


def read_header(file: Path, key: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor: (dtype, shape)}`` of a safetensors file, its header checked for bounds and
    consistency before the library sees it (one line naming the file otherwise)."""
    def bad(why: str) -> UserError:
        return _refuse(key, f"{file}: {why}; the file is damaged or not safetensors ({_FIX})")

    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise bad(f"{size} bytes, shorter than a safetensors header")
            length = int.from_bytes(f.read(8), "little")
            if length < 2 or length > min(_MAX_HEADER, size - 8):
                raise bad(f"its header length {length} does not fit the file's {size} bytes")
            raw = f.read(length)
    except OSError as exc:
        raise _refuse(key, f"{file}: cannot be read ({exc.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data_size = size - 8 - length
    regions = []
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise bad("its __metadata__ is not an object of strings")
            continue
        if not isinstance(entry, dict):
            raise bad(f"tensor {name!r} has no dtype, shape and offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_SIZES:
            raise bad(f"tensor {name!r} has dtype {json.dumps(dtype)[:20]}, not a safetensors "
                      "dtype")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r} has shape {json.dumps(shape)[:40]}, not a list of whole "
                      "numbers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has data_offsets {json.dumps(offsets)[:40]}")
        if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_SIZES[dtype]:
            raise bad(f"tensor {name!r} holds {offsets[1] - offsets[0]} bytes, but shape "
                      f"{shape} of {dtype} needs {math.prod(shape) * _DTYPE_SIZES[dtype]}")
        regions.append((offsets[0], offsets[1], name))
        out[name] = (dtype, tuple(shape))
    end = 0
    for begin, stop, name in sorted(regions):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin} of the data, not {end} "
                      "(overlapping or gapped offsets)")
        end = stop
    if end != data_size:
        raise bad(f"its tensors end at byte {end} of a {data_size}-byte data section "
                  "(truncated?)")
    return out


def headers(path: Path, key: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """``{tensor: (file name, dtype, shape)}`` over the directory's safetensors files."""
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for name, listed in index_files(path, key).items():
        header = read_header(path / name, key)
        for tensor in listed:
            if tensor not in header:
                raise _refuse(key, f"{path / INDEX}: tensor {tensor!r} is placed in {name}, "
                              f"which does not hold it; {_FIX}")
        for tensor, (dtype, shape) in header.items():
            if tensor in out:
                raise _refuse(key, f"{path}: tensor {tensor!r} is in both {out[tensor][0]} and "
                              f"{name}; {_FIX}")
            out[tensor] = (name, dtype, shape)
    return out


def iter_tensors(path: Path, key: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(tensor, file name, fp32 tensor)`` for every tensor, headers checked first and every
    value finite."""
    from safetensors import safe_open

    found = headers(path, key)
    files = sorted({f for f, _, _ in found.values()})
    for name in files:
        file = path / name
        try:
            with safe_open(str(file), framework="pt") as f:
                for tensor in sorted(f.keys()):
                    value = f.get_tensor(tensor).float()
                    if not bool(torch.isfinite(value).all()):
                        raise _refuse(key, f"{file}: tensor {tensor!r} holds non-finite values "
                                      f"(NaN or infinity); {_FIX} from finite weights")
                    yield tensor, name, value
        except UserError:
            raise
        except Exception as exc:  # safetensors raises its own error type
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise _refuse(key, f"{file}: the safetensors library cannot read it ({line}); "
                          f"{_FIX}") from None


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def shape_problems(cfg: ModelConfig, path: Path, key: str,
                   found: dict[str, tuple[str, str, tuple[int, ...]]]) -> list[str]:
    """Tensors of the directory whose shape or dtype is not what the model ``cfg`` builds
    reads, and tensors it needs that are missing; checked on shapes alone (no data read)."""
    from mcpar.interop.hf_names import from_hf, to_hf
    from mcpar.models.spec import get_model_spec

    spec = get_model_spec(cfg.kind)
    with torch.device("meta"):
        model = spec.build(cfg, 0)
    params = dict(model.named_parameters())
    want = {k: tuple(v.shape) for k, v in to_hf(cfg, params).items()}
    names = spec.hf
    meta = {k: _meta(shape) for k, (_, _, shape) in found.items()}
    origin = {id(v): k for k, v in meta.items()}
    renamed = names.tensor_names(meta) if names is not None else meta
    out = []
    for theirs, value in renamed.items():
        file, dtype, shape = found[origin[id(value)]]
        if theirs in want and shape != want[theirs]:
            out.append(problem(key, f"{path / file}: tensor {origin[id(value)]!r} has shape "
                               f"{list(shape)}, but the model section builds "
                               f"{list(want[theirs])}; {_FIX} or set the model section to the "
                               "directory's (`mcpar import DIR`)"))
        elif theirs in want and dtype not in _FLOAT_DTYPES:
            out.append(problem(key, f"{path / file}: tensor {origin[id(value)]!r} is {dtype}, "
                               f"not a floating dtype ({', '.join(_FLOAT_DTYPES)}); {_FIX}"))
    if out:
        return out
    if names is not None and not cfg.tie_embeddings and "lm_head.weight" not in renamed \
            and names.embedding in renamed:
        renamed["lm_head.weight"] = renamed[names.embedding]
    try:
        got = from_hf(cfg, renamed)
    except KeyError as exc:
        return [problem(key, f"{path}: tensor {exc} is missing; {_FIX}")]
    except RuntimeError as exc:  # a layout (e.g. fused experts) whose shapes do not combine
        return [problem(key, f"{path}: its tensors do not combine into the model the section "
                        f"builds ({str(exc).splitlines()[0]}); {_FIX}")]
    for name, param in params.items():
        have = got.get(name)
        if have is None:
            out.append(problem(key, f"{path}: no tensor for mcpar's {name}; {_FIX}"))
        elif tuple(have.shape) != tuple(param.shape):
            out.append(problem(key, f"{path}: mcpar's {name} would have shape "
                               f"{list(have.shape)}, the model builds {list(param.shape)}; "
                               f"{_FIX}"))
    return out
