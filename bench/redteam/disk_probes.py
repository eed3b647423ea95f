"""Probes of full disks: an offload folder, an export target, a prepare output and a profile's
run directory on small tmpfs mounts (root only; skipped, with the reason, where mount is
refused). The refusal's one line must name the option or file that chose the place."""

from __future__ import annotations

from .fixtures import corpus_text, tmpfs, trained
from .probe import TINY, Ctx, sets


def p_full_offload_dir(c: Ctx) -> list[str | bytes]:
    disk = tmpfs(c, "64k", fill=False)
    return ["train", *sets(*TINY, "controllers.memory.offload=nvme",
                           f"controllers.memory.offload_dir={disk}",
                           "controllers.memory.offload_buffer_mb=0.01",
                           "optimization.checkpoint.interval=2"),
            "--nproc", "2", "--steps", "4", "--run-dir", str(c.work / "run")]


def p_full_export(c: Ctx) -> list[str | bytes]:
    run = trained(c)
    disk = tmpfs(c, "256k", fill=True)
    return ["export", str(run), str(disk / "model"), "--format", "hf"]


def p_full_prepare(c: Ctx) -> list[str | bytes]:
    big = c.work / "big.txt"
    big.write_text(corpus_text(20000))
    disk = tmpfs(c, "64k", fill=False)
    return ["prepare", str(big), "--tokenizer", str(c.fixtures / "tokenizer.json"),
            "--out", str(disk / "out"), "--quiet", "--workers", "1", "--shard-tokens", "4000"]


def _profile_on(c: Ctx, nproc: int, size: str) -> list[str | bytes]:
    disk = tmpfs(c, size, fill=False)
    return ["profile", "--steps", "2", *sets(*TINY, "optimization.checkpoint.interval=0"),
            "--nproc", str(nproc), "--run-dir", str(disk / "run")]


def p_full_profile(c: Ctx) -> list[str | bytes]:
    return _profile_on(c, 1, "400k")


def p_full_trace_2_workers(c: Ctx) -> list[str | bytes]:
    return _profile_on(c, 2, "400k")
