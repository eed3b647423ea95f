"""Probes of the files a user points mcpar at: a Hugging Face index or a prepared manifest that
names a file outside its folder (``..``, absolute, ``/dev/zero``, a FIFO, a symlink), damaged
safetensors shards and configs, and weights of the wrong shape or value."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from .fixtures import FIX, copy_hf, copy_prepared, hf_shards, prepared_train
from .probe import REPO, Ctx, sets


def _index_point(d: Path, target: str) -> None:
    index = d / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["weight_map"][sorted(body["weight_map"])[0]] = target
    index.write_text(json.dumps(body))


def _header(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(file: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _hf_train(c: Ctx, d: Path, nproc: int = 1, *extra: str) -> list[str | bytes]:
    if nproc > 1:  # checkpointing on: the launcher restarts a failed job (3 times by default)
        extra = ("optimization.checkpoint.interval=1", *extra)
    return ["train", *sets(*FIX["hf_model"], f"model.init_from=hf:{d}",
                           "training.progress=false", "training.eval_interval=0", *extra),
            "--nproc", str(nproc), "--steps", "2", "--run-dir", str(c.work / "run")]


def _outside_shard(c: Ctx) -> Path:
    """A valid shard in the sandbox: what an escaping name reads."""
    target = c.sandbox / "x.safetensors"
    shutil.copy(hf_shards(c.fixtures / "hf")[0], target)
    return target


def _fifo(c: Ctx) -> Path:
    fifo = c.sandbox / "pipe.safetensors"
    os.mkfifo(fifo)
    c.fifos.append(fifo)
    return fifo


def p_index_dotdot(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    _index_point(d, os.path.relpath(_outside_shard(c), d))
    return _hf_train(c, d)


def p_index_dotdot_import(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    _index_point(d, os.path.relpath(_outside_shard(c), d))
    return ["import", str(d)]


def p_index_absolute(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    _index_point(d, str(_outside_shard(c)))
    return _hf_train(c, d)


def p_index_dev_zero(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    _index_point(d, "/dev/zero")
    return _hf_train(c, d)


def p_index_fifo(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    _index_point(d, str(_fifo(c)))
    return _hf_train(c, d)


def p_index_symlink_out(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    (d / "linked.safetensors").symlink_to(_outside_shard(c))
    _index_point(d, "linked.safetensors")
    return _hf_train(c, d)


def _escaping_manifest(c: Ctx, name: Callable[[Path], str]) -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from mcpar.data.shards import MANIFEST, _checksum, _dumps

    d = copy_prepared(c)
    body = json.loads((d / MANIFEST).read_text())
    entry = body["shards"][0]
    for ext in (".bin", ".idx"):
        shutil.copy(d / f"{entry['name']}{ext}", c.sandbox / f"shard-00000{ext}")
    entry["name"] = name(d)
    body = {**body, "checksum": _checksum(body)}  # rehashed: anyone can
    (d / MANIFEST).write_bytes(_dumps(body))
    return d


def p_manifest_dotdot(c: Ctx) -> list[str | bytes]:
    d = _escaping_manifest(c, lambda d: os.path.relpath(c.sandbox / "shard-00000", d))
    return prepared_train(c, d)


def p_manifest_absolute(c: Ctx) -> list[str | bytes]:
    d = _escaping_manifest(c, lambda d: str(c.sandbox / "shard-00000"))
    return prepared_train(c, d)


def p_bad_header_length(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = copy_hf(c)
    file = hf_shards(d)[0]
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    return _hf_train(c, d, nproc)


def p_bad_header_json(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    file = hf_shards(d)[0]
    _, data = _header(file)
    text = b"[1, 2, 3]"
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return _hf_train(c, d)


def p_bad_offsets(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = copy_hf(c)
    file = hf_shards(d)[0]
    header, data = _header(file)
    entry = header[sorted(k for k in header if k != "__metadata__")[0]]
    lo, hi = entry["data_offsets"]
    entry["data_offsets"] = [lo, hi + 10**9]
    _write_header(file, header, data)
    return _hf_train(c, d, nproc)


def p_short_tensor(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = copy_hf(c)
    file = hf_shards(d)[-1]
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 64)
    return _hf_train(c, d, nproc)


def p_malformed_index(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2')
    return _hf_train(c, d)


def p_config_list(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    (d / "config.json").write_text("[1, 2, 3]")
    return ["import", str(d)]


def p_config_missing_key(c: Ctx) -> list[str | bytes]:
    d = copy_hf(c)
    body = json.loads((d / "config.json").read_text())
    del body["hidden_size"]
    (d / "config.json").write_text(json.dumps(body))
    return ["import", str(d)]


def p_transposed(c: Ctx) -> list[str | bytes]:
    sys.path.insert(0, str(REPO / "src"))
    from safetensors.torch import load_file, save_file

    d = copy_hf(c)
    for file in hf_shards(d):
        tensors = load_file(str(file))
        square = [k for k, v in tensors.items() if v.dim() == 2 and v.shape[0] != v.shape[1]]
        if square:
            name = square[0]
            tensors[name] = tensors[name].t().contiguous()
            save_file(tensors, str(file), metadata={"format": "pt"})
            break
    return _hf_train(c, d)


def p_nan_weights(c: Ctx) -> list[str | bytes]:
    sys.path.insert(0, str(REPO / "src"))
    import torch
    from safetensors.torch import load_file, save_file

    d = copy_hf(c)
    file = hf_shards(d)[-1]
    tensors = {k: torch.full_like(v, float("nan")) for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    return _hf_train(c, d)
