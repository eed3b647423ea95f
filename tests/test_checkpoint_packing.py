"""Packed checkpoint tensors: every logical key reads back bit for bit through DCP's files, and
an index naming anything but a dtype is refused rather than looked up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mcpar.checkpoint import packing
from mcpar.checkpoint.manager import SafeFileSystemReader, load_tensors


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model/pp0-tp0/0.w": torch.randn(3, 5, generator=g),
            "model/pp0-tp0/0.b": torch.randn(5, generator=g).half(),
            "optim/pp0-tp0/0.w/step": torch.tensor(7.0),
            "optim/pp0-tp0/0.w/exp_avg": torch.randn(3, 5, generator=g),
            "rng/rank0/cpu": torch.get_rng_state(),
            "rank0/onebit/error": torch.randn(0, generator=g)}  # empty tensors too


def test_packed_save_reads_back_every_key_bitwise(tmp_path: Path) -> None:
    state = _state()
    packed = packing.pack(state)
    # Six keys in four groups: five packs (model holds two dtypes) and four indexes.
    assert len(packed) == 9
    dcp.save(packed, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    saved = packing.PackedCheckpoint(tmp_path, SafeFileSystemReader)
    assert saved.keys() == set(state)
    got = saved.read(state)
    for key, want in state.items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    assert set(load_tensors(tmp_path, "optim/")) == {"optim/pp0-tp0/0.w/step",
                                                     "optim/pp0-tp0/0.w/exp_avg"}


def test_an_index_naming_something_else_than_a_dtype_is_refused(tmp_path: Path) -> None:
    entries, _ = packing.plan({"model/c/w": torch.zeros(2)})
    index = [{"key": "model/c/w", "pack": entries["model/c/w"].pack, "dtype": "load",
              "shape": [2], "offset": 0}]
    packed = {entries["model/c/w"].pack: torch.zeros(2),
              "model/c/__packed__/index": torch.frombuffer(
                  bytearray(json.dumps(index).encode()), dtype=torch.uint8)}
    dcp.save(packed, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises(ValueError, match="unknown dtype 'load'"):
        packing.PackedCheckpoint(tmp_path, SafeFileSystemReader)
