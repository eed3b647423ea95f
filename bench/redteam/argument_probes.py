"""Probes of what a user types and the folders mcpar keeps: option values out of range (NaN,
overflowing seeds, invalid UTF-8, a tiny offload buffer), earlier prepare outputs and JSONL
records, profile and cache paths, and worker counts (zero, negative, 1000, torchrun's env)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .fixtures import copy_prepared, prepared_train, trained
from .probe import TINY, Ctx, command_env, sets


def p_offload_tiny_buffer(c: Ctx) -> list[str | bytes]:
    return ["train", *sets(*TINY, "controllers.memory.offload=nvme",
                           f"controllers.memory.offload_dir={c.work / 'off'}",
                           "controllers.memory.offload_buffer_mb=1e-9"),
            "--nproc", "1", "--steps", "5", "--run-dir", str(c.work / "run")]


def p_generate_nan_temperature(c: Ctx) -> list[str | bytes]:
    return ["generate", str(trained(c)), "--prompt", "hi", "--max-new-tokens", "4",
            "--temperature", "nan", "--device", "cpu"]


def p_generate_seed_overflow(c: Ctx) -> list[str | bytes]:
    return ["generate", str(trained(c)), "--prompt", "hi", "--max-new-tokens", "4",
            "--seed", str(2**70), "--device", "cpu"]


def p_generate_invalid_utf8(c: Ctx) -> list[str | bytes]:
    return ["generate", str(trained(c)), "--prompt", b"a\xffb", "--max-new-tokens", "4",
            "--device", "cpu"]


def p_export_nan_shard(c: Ctx) -> list[str | bytes]:
    return ["export", str(trained(c)), str(c.work / "out"), "--format", "hf",
            "--max-shard-mb", "nan"]


def _prepare_args(c: Ctx, src: Path, out: Path) -> list[str | bytes]:
    return ["prepare", str(src), "--tokenizer", str(c.fixtures / "tokenizer.json"),
            "--out", str(out), "--quiet", "--workers", "1", "--shard-tokens", "2000"]


def p_prepare_stray_shard(c: Ctx) -> list[str | bytes]:
    out = copy_prepared(c)
    (out / "shard-abc.bin").write_bytes(b"x")
    return _prepare_args(c, c.fixtures / "corpus.txt", out)


def p_prepare_crafted_record(c: Ctx) -> list[str | bytes]:
    """An earlier output whose shard record (checksums intact) names a shard outside: prepare
    (the probed code, in set-up) must rebuild it, so training on the output reads inside only."""
    out = copy_prepared(c)
    record = sorted(out.glob("shard-*.json"))[0]
    body = json.loads(record.read_text())
    for ext in (".bin", ".idx"):
        shutil.copy(out / f"{record.stem}{ext}", c.sandbox / f"shard{ext}")
    body["name"] = os.path.relpath(c.sandbox / "shard", out)
    record.write_text(json.dumps(body))
    again = subprocess.run([sys.executable, "-m", "mcpar.cli",
                            *_prepare_args(c, c.fixtures / "corpus.txt", out)],
                           env=command_env(c.src, {}), capture_output=True, text=True,
                           timeout=120, cwd=c.work)
    if again.returncode != 0:
        raise RuntimeError(f"prepare over the crafted output failed: {again.stderr[-800:]}")
    return prepared_train(c, out)


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
                            str(c.work / "run0")], env=command_env(c.src, {}),
                           capture_output=True, timeout=120, cwd=c.work)
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
