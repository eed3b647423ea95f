"""Red-team probes of issue 36: every file and argument a user hands mcpar, crafted to break it.

Each probe is a real ``mcpar ...`` command line run in a subprocess, in a fresh temporary folder,
with the crafted input beside it. ``--src`` chooses the source tree the command imports (its
``src`` goes first on PYTHONPATH), so the same probes run against the code before the fixes and
after them. For each probe it records the exit code and:

* ``traceback``: stderr holds a Python traceback;
* ``hang``: the command ran past its timeout (killed, with its whole process group);
* ``restarts``: worker restart lines the launcher printed (a user error must never restart);
* ``outside_read``: a file of the sandbox folder beside the input (which nothing may read) had its
  access time moved, or a FIFO that must stay unopened was opened for reading;
* ``wrong_exit``: the probe expects exit 2 with one line (a refusal; for full disks the line
  must name the option that chose the place) or exit 0 (the input is fine after all), and the
  command did otherwise. torch's notice of every profiled run (TORCH_NOTICE) is not counted as
  a line.

The fixtures (a tiny Hugging Face directory, prepared shards, a tokenizer) are written with this
checkout's own code; trained run directories with the probed code. Full disks are small tmpfs
mounts (root only; the probes are skipped, with the reason, where mount is refused).

    python bench/redteam_probes.py --src /tmp/rt-before --out before.json
    python bench/redteam_probes.py --out after.json [--only NAME,NAME]
    python bench/redteam_probes.py --combine before.json after.json \
        --out bench/data/redteam_probes.json   # prints the before → after table
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
        "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
        "optimization.warmup_steps=5"]
OLD_ATIME = 1_000_000_000  # 2001: any read on a relatime mount moves it
RESTART = re.compile(r"restart.*\d+/\d+", re.IGNORECASE)
# torch's own notice on every profiled run (a block allocated before tracing started is freed
# while tracing): printed by successful runs too, so it is no line of the error.
TORCH_NOTICE = re.compile(r"^(\[rank\d+\]:)?\[W\d{4} [^\]]*CPUAllocator\.cpp:\d+\] Memory block of "
                          r"unknown size was allocated before the profiling started")


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@dataclass
class Ctx:
    """One probe's folder: ``work`` (the cwd), ``sandbox`` (must stay unread), FIFOs to watch."""
    work: Path
    sandbox: Path
    fixtures: Path
    src: Path
    fifos: list[Path] = field(default_factory=list)
    mounts: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Probe:
    name: str
    family: str
    expect: int  # 2: refused in one line; 0: runs
    setup: Callable[[Ctx], list[str | bytes]]
    timeout: float = 60.0
    old_code: bool = True  # False: not run on the code before the fixes (say why in skip_old)
    skip_old: str = ""
    needs_mount: bool = False
    needle: str = ""  # what the one line of a refusal must name (the key or option, the file)


# --- fixtures (this checkout's code) ------------------------------------------------------------
def _text(n: int) -> str:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return "".join(" ".join(words[(i + j) % len(words)] for j in range(8)) + "\n"
                   for i in range(n))


def build_fixtures(root: Path) -> dict[str, list[str]]:
    """A sharded Hugging Face llama (with index), a tokenizer, a prepared directory."""
    sys.path.insert(0, str(REPO / "src"))
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from mcpar.config import ModelConfig
    from mcpar.data.prepare import prepare
    from mcpar.interop.hf_export import write_safetensors
    from mcpar.interop.hf_names import hf_config, to_hf
    from mcpar.models.spec import get_model_spec

    torch.manual_seed(0)
    cfg = ModelConfig(kind="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=48, vocab_size=256, seq_len=16)
    model = get_model_spec(cfg.kind).build(cfg, 0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    hf = root / "hf"
    hf.mkdir()
    write_safetensors(to_hf(cfg, params), hf, 20000)
    (hf / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([_text(300)], trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    (root / "corpus.txt").write_text(_text(3000))
    prepare([str(root / "corpus.txt")], str(root / "tokenizer.json"), root / "prepared",
            shard_tokens=2000, progress=False)
    model_keys = [f"model.kind={cfg.kind}", f"model.num_layers={cfg.num_layers}",
                  f"model.hidden_size={cfg.hidden_size}", f"model.num_heads={cfg.num_heads}",
                  f"model.num_kv_heads={cfg.num_kv_heads}",
                  f"model.ffn_hidden_size={cfg.ffn_hidden_size}",
                  f"model.vocab_size={cfg.vocab_size}", f"model.seq_len={cfg.seq_len}"]
    return {"hf_model": model_keys}


FIX: dict[str, list[str]] = {}


def _hf(c: Ctx) -> Path:
    d = c.work / "model"
    shutil.copytree(c.fixtures / "hf", d)
    return d


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


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
    shutil.copy(_shards(c.fixtures / "hf")[0], target)
    return target


def _fifo(c: Ctx) -> Path:
    fifo = c.sandbox / "pipe.safetensors"
    os.mkfifo(fifo)
    c.fifos.append(fifo)
    return fifo


# --- probes ------------------------------------------------------------------------------------
def p_index_dotdot(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    _index_point(d, os.path.relpath(_outside_shard(c), d))
    return _hf_train(c, d)


def p_index_dotdot_import(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    _index_point(d, os.path.relpath(_outside_shard(c), d))
    return ["import", str(d)]


def p_index_absolute(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    _index_point(d, str(_outside_shard(c)))
    return _hf_train(c, d)


def p_index_dev_zero(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    _index_point(d, "/dev/zero")
    return _hf_train(c, d)


def p_index_fifo(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    _index_point(d, str(_fifo(c)))
    return _hf_train(c, d)


def p_index_symlink_out(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    (d / "linked.safetensors").symlink_to(_outside_shard(c))
    _index_point(d, "linked.safetensors")
    return _hf_train(c, d)


def _prepared(c: Ctx) -> Path:
    d = c.work / "prepared"
    shutil.copytree(c.fixtures / "prepared", d)
    return d


def _escaping_manifest(c: Ctx, name: Callable[[Path], str]) -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from mcpar.data.shards import MANIFEST, _checksum, _dumps

    d = _prepared(c)
    body = json.loads((d / MANIFEST).read_text())
    entry = body["shards"][0]
    for ext in (".bin", ".idx"):
        shutil.copy(d / f"{entry['name']}{ext}", c.sandbox / f"shard-00000{ext}")
    entry["name"] = name(d)
    body = {**body, "checksum": _checksum(body)}  # rehashed: anyone can
    (d / MANIFEST).write_bytes(_dumps(body))
    return d


def _prepared_train(c: Ctx, d: Path) -> list[str | bytes]:
    return ["train", *sets(*TINY, f"data.source={d}",
                           "model.vocab_size=300", "model.seq_len=16"),
            "--nproc", "1", "--steps", "1", "--run-dir", str(c.work / "run")]


def p_manifest_dotdot(c: Ctx) -> list[str | bytes]:
    d = _escaping_manifest(c, lambda d: os.path.relpath(c.sandbox / "shard-00000", d))
    return _prepared_train(c, d)


def p_manifest_absolute(c: Ctx) -> list[str | bytes]:
    d = _escaping_manifest(c, lambda d: str(c.sandbox / "shard-00000"))
    return _prepared_train(c, d)


def p_bad_header_length(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = _hf(c)
    file = _shards(d)[0]
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    return _hf_train(c, d, nproc)


def p_bad_header_json(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    file = _shards(d)[0]
    _, data = _header(file)
    text = b"[1, 2, 3]"
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return _hf_train(c, d)


def p_bad_offsets(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = _hf(c)
    file = _shards(d)[0]
    header, data = _header(file)
    entry = header[sorted(k for k in header if k != "__metadata__")[0]]
    lo, hi = entry["data_offsets"]
    entry["data_offsets"] = [lo, hi + 10**9]
    _write_header(file, header, data)
    return _hf_train(c, d, nproc)


def p_short_tensor(c: Ctx, nproc: int = 1) -> list[str | bytes]:
    d = _hf(c)
    file = _shards(d)[-1]
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 64)
    return _hf_train(c, d, nproc)


def p_malformed_index(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2')
    return _hf_train(c, d)


def p_config_list(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    (d / "config.json").write_text("[1, 2, 3]")
    return ["import", str(d)]


def p_config_missing_key(c: Ctx) -> list[str | bytes]:
    d = _hf(c)
    body = json.loads((d / "config.json").read_text())
    del body["hidden_size"]
    (d / "config.json").write_text(json.dumps(body))
    return ["import", str(d)]


def p_transposed(c: Ctx) -> list[str | bytes]:
    sys.path.insert(0, str(REPO / "src"))
    from safetensors.torch import load_file, save_file

    d = _hf(c)
    for file in _shards(d):
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

    d = _hf(c)
    file = _shards(d)[-1]
    tensors = {k: torch.full_like(v, float("nan")) for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    return _hf_train(c, d)


def p_offload_tiny_buffer(c: Ctx) -> list[str | bytes]:
    return ["train", *sets(*TINY, "controllers.memory.offload=nvme",
                           f"controllers.memory.offload_dir={c.work / 'off'}",
                           "controllers.memory.offload_buffer_mb=1e-9"),
            "--nproc", "1", "--steps", "5", "--run-dir", str(c.work / "run")]


def _trained(c: Ctx) -> Path:
    """A 2-step run with a checkpoint, trained by the probed code (once per suite)."""
    run = c.fixtures / f"trained-{c.src.name}"
    if not (run / "done").exists():
        shutil.rmtree(run, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "mcpar.cli", "train",
             *sets(*TINY, "training.steps=2", "optimization.checkpoint.interval=2"),
             "--nproc", "1", "--run-dir", str(run)],
            env=_env(c.src, {}), capture_output=True, text=True, timeout=300, cwd=c.fixtures)
        if done.returncode != 0:
            raise RuntimeError(f"the trained fixture failed: {done.stderr[-2000:]}")
        (run / "done").write_text("")
    return run


def p_generate_nan_temperature(c: Ctx) -> list[str | bytes]:
    return ["generate", str(_trained(c)), "--prompt", "hi", "--max-new-tokens", "4",
            "--temperature", "nan", "--device", "cpu"]


def p_generate_seed_overflow(c: Ctx) -> list[str | bytes]:
    return ["generate", str(_trained(c)), "--prompt", "hi", "--max-new-tokens", "4",
            "--seed", str(2**70), "--device", "cpu"]


def p_generate_invalid_utf8(c: Ctx) -> list[str | bytes]:
    return ["generate", str(_trained(c)), "--prompt", b"a\xffb", "--max-new-tokens", "4",
            "--device", "cpu"]


def p_export_nan_shard(c: Ctx) -> list[str | bytes]:
    return ["export", str(_trained(c)), str(c.work / "out"), "--format", "hf",
            "--max-shard-mb", "nan"]


def _prepare_args(c: Ctx, src: Path, out: Path) -> list[str | bytes]:
    return ["prepare", str(src), "--tokenizer", str(c.fixtures / "tokenizer.json"),
            "--out", str(out), "--quiet", "--workers", "1", "--shard-tokens", "2000"]


def p_prepare_stray_shard(c: Ctx) -> list[str | bytes]:
    out = _prepared(c)
    (out / "shard-abc.bin").write_bytes(b"x")
    return _prepare_args(c, c.fixtures / "corpus.txt", out)


def p_prepare_crafted_record(c: Ctx) -> list[str | bytes]:
    """An earlier output whose shard record (checksums intact) names a shard outside: prepare
    (the probed code, in set-up) must rebuild it, so training on the output reads inside only."""
    out = _prepared(c)
    record = sorted(out.glob("shard-*.json"))[0]
    body = json.loads(record.read_text())
    for ext in (".bin", ".idx"):
        shutil.copy(out / f"{record.stem}{ext}", c.sandbox / f"shard{ext}")
    body["name"] = os.path.relpath(c.sandbox / "shard", out)
    record.write_text(json.dumps(body))
    again = subprocess.run([sys.executable, "-m", "mcpar.cli",
                            *_prepare_args(c, c.fixtures / "corpus.txt", out)],
                           env=_env(c.src, {}), capture_output=True, text=True, timeout=120,
                           cwd=c.work)
    if again.returncode != 0:
        raise RuntimeError(f"prepare over the crafted output failed: {again.stderr[-800:]}")
    return _prepared_train(c, out)


def p_jsonl_lone_surrogate(c: Ctx) -> list[str | bytes]:
    src = c.work / "docs.jsonl"
    src.write_text('{"text": "a lone \\ud800 surrogate"}\n{"text": "plain text"}\n')
    return _prepare_args(c, src, c.work / "out")


def p_profile_is_file(c: Ctx) -> list[str | bytes]:
    (c.work / "run").mkdir()
    (c.work / "run" / "profile").write_text("not a folder")
    return ["profile", "--steps", "2", *sets(*TINY), "--nproc", "1",
            "--run-dir", str(c.work / "run")]


def p_local_profile_missing_folder(c: Ctx) -> list[str | bytes]:
    c.env["MCPAR_LOCAL_PROFILE"] = str(c.work / "missing" / "deeper" / "profile.json")
    c.env["MCPAR_PEAK_CACHE"] = str(c.work / "missing2" / "peak.json")
    return ["profile", "--steps", "2", *sets(*TINY), "--nproc", "1",
            "--run-dir", str(c.work / "run")]


def p_bpe_cache_truncated(c: Ctx) -> list[str | bytes]:
    cache = c.work / "cache"
    args = ["train", *sets(*TINY, f"data.source={c.fixtures / 'corpus.txt'}",
                           "data.tokenizer=bpe", "model.vocab_size=300",
                           f"data.cache_dir={cache}"),
            "--nproc", "1", "--steps", "1"]
    first = subprocess.run([sys.executable, "-m", "mcpar.cli", *args, "--run-dir",
                            str(c.work / "run0")], env=_env(c.src, {}), capture_output=True,
                           timeout=120, cwd=c.work)
    if first.returncode != 0:
        raise RuntimeError(f"the first BPE run failed: {first.stderr[-1500:]!r}")
    for cached in cache.rglob("tokens.npy"):
        cached.write_bytes(cached.read_bytes()[:-50])
    return [*args, "--run-dir", str(c.work / "run")]


def _check_cfg(c: Ctx) -> Path:
    cfg = c.work / "c.yaml"
    cfg.write_text("training:\n  steps: 1\n")
    return cfg


def p_check_nproc_zero(c: Ctx) -> list[str | bytes]:
    return ["check", str(_check_cfg(c)), "--nproc", "0"]


def p_check_nproc_negative(c: Ctx) -> list[str | bytes]:
    return ["check", str(_check_cfg(c)), "--nproc", "-4"]


def p_train_nproc_1000(c: Ctx) -> list[str | bytes]:
    return ["train", *sets(*TINY), "--nproc", "1000", "--run-dir", str(c.work / "run")]


def p_torchrun_env(c: Ctx) -> list[str | bytes]:
    c.env.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29917",
                  "TORCHELASTIC_RUN_ID": "x"})
    return ["train", *sets(*TINY), "--nproc", "2", "--steps", "2",
            "--run-dir", str(c.work / "run")]


@contextlib.contextmanager
def _no_mount() -> Iterator[None]:
    yield


def _tmpfs(c: Ctx, size: str, fill: bool) -> Path:
    where = c.work / f"disk{len(c.mounts)}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise Skip(f"mount -t tmpfs was refused ({done.stderr.strip()[:80]}): needs root")
    c.mounts.append(where)
    if fill:
        with contextlib.suppress(OSError), open(where / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    return where


class Skip(Exception):
    pass


def p_full_offload_dir(c: Ctx) -> list[str | bytes]:
    disk = _tmpfs(c, "64k", fill=False)
    return ["train", *sets(*TINY, "controllers.memory.offload=nvme",
                           f"controllers.memory.offload_dir={disk}",
                           "controllers.memory.offload_buffer_mb=0.01",
                           "optimization.checkpoint.interval=2"),
            "--nproc", "2", "--steps", "4", "--run-dir", str(c.work / "run")]


def p_full_export(c: Ctx) -> list[str | bytes]:
    trained = _trained(c)
    disk = _tmpfs(c, "256k", fill=True)
    return ["export", str(trained), str(disk / "model"), "--format", "hf"]


def p_full_prepare(c: Ctx) -> list[str | bytes]:
    big = c.work / "big.txt"
    big.write_text(_text(20000))
    disk = _tmpfs(c, "64k", fill=False)
    return ["prepare", str(big), "--tokenizer", str(c.fixtures / "tokenizer.json"),
            "--out", str(disk / "out"), "--quiet", "--workers", "1", "--shard-tokens", "4000"]


def _profile_on(c: Ctx, nproc: int, size: str) -> list[str | bytes]:
    disk = _tmpfs(c, size, fill=False)
    return ["profile", "--steps", "2", *sets(*TINY, "optimization.checkpoint.interval=0"),
            "--nproc", str(nproc), "--run-dir", str(disk / "run")]


def p_full_profile(c: Ctx) -> list[str | bytes]:
    return _profile_on(c, 1, "400k")


def p_full_trace_2_workers(c: Ctx) -> list[str | bytes]:
    return _profile_on(c, 2, "400k")


PROBES: list[Probe] = [
    Probe("index_dotdot", "hf index outside", 2, p_index_dotdot),
    Probe("index_dotdot_import", "hf index outside", 2, p_index_dotdot_import),
    Probe("index_absolute", "hf index outside", 2, p_index_absolute),
    Probe("index_dev_zero", "hf index outside", 2, p_index_dev_zero),
    Probe("index_fifo", "hf index outside", 2, p_index_fifo),
    Probe("index_symlink_out", "hf index outside", 2, p_index_symlink_out),
    Probe("manifest_dotdot", "manifest shard outside", 2, p_manifest_dotdot),
    Probe("manifest_absolute", "manifest shard outside", 2, p_manifest_absolute),
    Probe("hf_header_length", "damaged hf (parent)", 2, p_bad_header_length),
    Probe("hf_header_list", "damaged hf (parent)", 2, p_bad_header_json),
    Probe("hf_offsets", "damaged hf (parent)", 2, p_bad_offsets),
    Probe("hf_short_tensor", "damaged hf (parent)", 2, p_short_tensor),
    Probe("hf_malformed_index", "damaged hf (parent)", 2, p_malformed_index),
    Probe("hf_config_list", "damaged hf (parent)", 2, p_config_list),
    Probe("hf_config_missing_key", "damaged hf (parent)", 2, p_config_missing_key),
    Probe("workers_header_length", "damaged hf (workers)", 2,
          lambda c: p_bad_header_length(c, 2), timeout=150),
    Probe("workers_offsets", "damaged hf (workers)", 2, lambda c: p_bad_offsets(c, 2),
          timeout=150),
    Probe("workers_short_tensor", "damaged hf (workers)", 2, lambda c: p_short_tensor(c, 2),
          timeout=150),
    Probe("hf_transposed", "shapes and values", 2, p_transposed),
    Probe("init_from_nan", "shapes and values", 2, p_nan_weights),
    Probe("offload_buffer_1e-9", "shapes and values", 2, p_offload_tiny_buffer),
    Probe("generate_nan_temperature", "bad arguments", 2, p_generate_nan_temperature),
    Probe("generate_seed_overflow", "bad arguments", 2, p_generate_seed_overflow),
    Probe("generate_invalid_utf8", "bad arguments", 2, p_generate_invalid_utf8),
    Probe("export_nan_shard_mb", "bad arguments", 2, p_export_nan_shard),
    Probe("prepare_stray_shard", "prepare inputs", 2, p_prepare_stray_shard),
    Probe("prepare_crafted_record", "prepare inputs", 0, p_prepare_crafted_record),
    Probe("jsonl_lone_surrogate", "prepare inputs", 0, p_jsonl_lone_surrogate),
    Probe("profile_is_file", "profile and caches", 2, p_profile_is_file),
    Probe("local_profile_missing_folder", "profile and caches", 0,
          p_local_profile_missing_folder, timeout=120),
    Probe("bpe_cache_truncated", "profile and caches", 0, p_bpe_cache_truncated, timeout=120),
    Probe("check_nproc_0", "worker counts", 2, p_check_nproc_zero),
    Probe("check_nproc_-4", "worker counts", 2, p_check_nproc_negative),
    Probe("train_nproc_1000", "worker counts", 2, p_train_nproc_1000, timeout=30,
          old_code=False, skip_old="not run on old code, would start 1000 workers"),
    Probe("torchrun_env_nproc", "worker counts", 2, p_torchrun_env, timeout=45),
    Probe("full_offload_dir", "full disks", 2, p_full_offload_dir, timeout=150,
          needs_mount=True, needle="controllers.memory.offload_dir"),
    Probe("full_export", "full disks", 2, p_full_export, needs_mount=True,
          needle="disk0/model"),
    Probe("full_prepare", "full disks", 2, p_full_prepare, needs_mount=True, needle="--out"),
    Probe("full_profile", "full disks", 2, p_full_profile, timeout=90, needs_mount=True,
          needle="trace_rank0.json"),
    Probe("full_trace_2_workers", "full disks", 2, p_full_trace_2_workers, timeout=150,
          needs_mount=True, needle="trace_rank"),
]


# --- running -----------------------------------------------------------------------------------
def _env(src: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), env.get("PYTHONPATH", "")]).strip(
        os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _age_sandbox(sandbox: Path) -> None:
    for p in sandbox.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.utime(p, (OLD_ATIME, OLD_ATIME))


def _read_in_sandbox(sandbox: Path) -> list[str]:
    return sorted(str(p.relative_to(sandbox)) for p in sandbox.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.stat().st_atime != OLD_ATIME)


def _watch_fifos(fifos: list[Path], stop: threading.Event, opened: list[str],
                 held: list[int]) -> None:
    """A FIFO opened for reading lets a non-blocking writer open it: note that, and keep the
    writer open, so a reader that hangs on it keeps hanging."""
    while not stop.is_set():
        for fifo in fifos:
            if str(fifo) in opened:
                continue
            try:
                held.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                opened.append(str(fifo))
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
        stop.wait(0.05)


def run_probe(probe: Probe, src: Path, fixtures: Path, old: bool) -> dict:
    record: dict = {"name": probe.name, "family": probe.family, "expect": probe.expect}
    if old and not probe.old_code:
        return {**record, "skipped": probe.skip_old}
    with tempfile.TemporaryDirectory(prefix=f"rt-{probe.name}-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        sandbox = Path(tmp) / "outside"
        sandbox.mkdir()
        c = Ctx(work, sandbox, fixtures, src)
        try:
            try:
                args = probe.setup(c)
            except Skip as why:
                return {**record, "skipped": str(why)}
            _age_sandbox(sandbox)
            stop, opened, held = threading.Event(), [], []
            watcher = threading.Thread(target=_watch_fifos, args=(c.fifos, stop, opened, held),
                                       daemon=True)
            watcher.start()
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "mcpar.cli", *args], cwd=work,
                                    env=_env(src, c.env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            hang = False
            try:
                out, err = proc.communicate(timeout=probe.timeout)
            except subprocess.TimeoutExpired:
                hang = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
            stop.set()
            watcher.join()
            for fd in held:
                os.close(fd)
            seconds = time.monotonic() - start
            stdout = out.decode(errors="replace")
            stderr = err.decode(errors="replace")
            lines = [ln for ln in stderr.splitlines()
                     if ln.strip() and not TORCH_NOTICE.match(ln)]
            reads = _read_in_sandbox(sandbox) + [f"FIFO {Path(f).name} opened" for f in opened]
            restarts = sum(1 for ln in (stdout + "\n" + stderr).splitlines()
                           if RESTART.search(ln))
            ok = (not hang and proc.returncode == probe.expect
                  and (probe.expect != 2 or (len(lines) == 1 and probe.needle in lines[0])))
            return {**record, "rc": None if hang else proc.returncode, "seconds": round(seconds, 1),
                    "traceback": "Traceback" in stderr, "hang": hang, "restarts": restarts,
                    "outside_read": bool(reads), "outside_files": reads,
                    "wrong_exit": not ok, "stderr_lines": len(lines),
                    "stderr_tail": "\n".join(lines[-3:])[-600:]}
        except Exception as exc:  # a probe whose set-up broke: recorded, the rest still run
            return {**record, "error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            for mount in reversed(c.mounts):
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)


COUNTS = ("traceback", "hang", "restarts", "outside_read", "wrong_exit")


def table(results: list[dict]) -> dict[str, dict[str, int]]:
    """Per family: probes run and the counts of each kind of miss."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r["family"], {"probes": 0, **dict.fromkeys(COUNTS, 0)})
        if "rc" not in r and not r.get("hang"):
            continue
        row["probes"] += 1
        for key in COUNTS:
            row[key] += int(r[key]) if key != "restarts" else r[key]
    total = {"probes": 0, **dict.fromkeys(COUNTS, 0)}
    for row in out.values():
        for key in total:
            total[key] += row[key]
    out["all"] = total
    return out


def markdown(before: dict, after: dict) -> str:
    """The per-family table, each count 'before → after' (probes run on each side)."""
    head = ["family", "probes", "tracebacks", "hangs", "restarts", "outside reads",
            "wrong exits"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, b in before["families"].items():
        a = after["families"][family]
        cells = [family, f"{b['probes']} → {a['probes']}",
                 *(f"{b[k]} → {a[k]}" for k in COUNTS)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def combine(before_path: Path, after_path: Path, out: Path) -> str:
    """One JSON of both runs (``out``) and the markdown table of them."""
    before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
    out.write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")
    return markdown(before, after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=REPO,
                        help="source tree to probe (its src/ goes first on PYTHONPATH)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--only", default=None, help="comma-separated probe names")
    parser.add_argument("--old", action="store_true",
                        help="the tree is the code before the fixes: skip probes not safe there")
    parser.add_argument("--combine", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="write BEFORE and AFTER's JSON as one to --out; print the table")
    args = parser.parse_args(argv)
    if args.combine:
        if args.out is None:
            parser.error("--combine needs --out")
        print(combine(*args.combine, args.out))
        return 0
    src = args.src.resolve()
    chosen = PROBES
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {p.name for p in PROBES})
        if unknown:
            parser.error(f"--only: unknown probes {unknown}")
        chosen = [p for p in PROBES if p.name in names]
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="rt-fixtures-") as tmp:
        fixtures = Path(tmp)
        FIX.update(build_fixtures(fixtures))
        results = []
        for probe in chosen:
            r = run_probe(probe, src, fixtures, args.old)
            print(f"{probe.name}: " + json.dumps({k: r.get(k) for k in
                  ("rc", "seconds", *COUNTS, "skipped", "error")}), file=sys.stderr, flush=True)
            results.append(r)
    git = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    body = {"src": str(src), "commit": git, "probes": len(results),
            "families": table(results), "results": results}
    text = json.dumps(body, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
