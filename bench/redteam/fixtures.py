"""The probes' inputs: what is built once per suite, and the copies each probe crafts from.

The fixtures (a tiny Hugging Face directory, prepared shards, a tokenizer) are written with this
checkout's own code; trained run directories with the probed code. Full disks are small tmpfs
mounts (root only; a probe that needs one is skipped, with the reason, where mount is refused).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .probe import REPO, TINY, Ctx, Skip, command_env, sets


def corpus_text(n: int) -> str:
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
    tok.train_from_iterator([corpus_text(300)], trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    (root / "corpus.txt").write_text(corpus_text(3000))
    prepare([str(root / "corpus.txt")], str(root / "tokenizer.json"), root / "prepared",
            shard_tokens=2000, progress=False)
    model_keys = [f"model.kind={cfg.kind}", f"model.num_layers={cfg.num_layers}",
                  f"model.hidden_size={cfg.hidden_size}", f"model.num_heads={cfg.num_heads}",
                  f"model.num_kv_heads={cfg.num_kv_heads}",
                  f"model.ffn_hidden_size={cfg.ffn_hidden_size}",
                  f"model.vocab_size={cfg.vocab_size}", f"model.seq_len={cfg.seq_len}"]
    return {"hf_model": model_keys}


# What build_fixtures returned (the --set keys of the Hugging Face model), filled in by the
# command line before any probe runs.
FIX: dict[str, list[str]] = {}


def copy_hf(c: Ctx) -> Path:
    d = c.work / "model"
    shutil.copytree(c.fixtures / "hf", d)
    return d


def hf_shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def copy_prepared(c: Ctx) -> Path:
    d = c.work / "prepared"
    shutil.copytree(c.fixtures / "prepared", d)
    return d


def prepared_train(c: Ctx, d: Path) -> list[str | bytes]:
    return ["train", *sets(*TINY, f"data.source={d}",
                           "model.vocab_size=300", "model.seq_len=16"),
            "--nproc", "1", "--steps", "1", "--run-dir", str(c.work / "run")]


def trained(c: Ctx) -> Path:
    """A 2-step run with a checkpoint, trained by the probed code (once per suite)."""
    run = c.fixtures / f"trained-{c.src.name}"
    if not (run / "done").exists():
        shutil.rmtree(run, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "mcpar.cli", "train",
             *sets(*TINY, "training.steps=2", "optimization.checkpoint.interval=2"),
             "--nproc", "1", "--run-dir", str(run)],
            env=command_env(c.src, {}), capture_output=True, text=True, timeout=300,
            cwd=c.fixtures)
        if done.returncode != 0:
            raise RuntimeError(f"the trained fixture failed: {done.stderr[-2000:]}")
        (run / "done").write_text("")
    return run


def tmpfs(c: Ctx, size: str, fill: bool) -> Path:
    """A tmpfs of ``size`` under the probe's folder (unmounted by the runner), filled to the
    last byte when ``fill``."""
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
