"""A run's checkpoint, of any layout, as the full model's tensors in one process.

Export and ``mcpar generate`` both need the whole model from a checkpoint that tensor, pipeline
and expert parallelism cut into pieces. The pieces are put back by the checkpoint layer's
reader (``checkpoint/saved_state.py``: the training's own sharding code run on a model of
element codes, experts put back in expert order whatever slots the balancer moved them to),
the same reader that resume on another layout uses, so no second description of how each
layer is split exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mcpar.checkpoint.files import find_latest_valid, list_checkpoints, verify_checkpoint
from mcpar.checkpoint.manager import checkpoint_dir, read_meta, saved_layout
from mcpar.checkpoint.saved_state import (
    full_parameters,
    layout_maps,
    model_shards,
    saved_buffers,
)
from mcpar.config import JobConfig, ModelConfig, load_config
from mcpar.errors import UserError, problem
from mcpar.models.spec import get_model_spec


@dataclass
class FullState:
    step: int
    path: Path
    job: JobConfig  # the run's configuration (config.yaml)
    model: ModelConfig  # as the checkpoint saved it
    params: dict[str, torch.Tensor]  # the built model's named_parameters names, full shapes
    buffers: dict[str, torch.Tensor]  # persistent buffers by the built model's names


def run_config(run_dir: Path) -> JobConfig:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(problem(str(run_dir), f"not an mcpar run directory (no {path.name}); "
                                "give the --run-dir of a `mcpar train`"))
    return load_config(path)


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[JobConfig, int, Path]:
    """The run's config and the checkpoint to read: step ``step``, or the newest valid one."""
    job = run_config(run_dir)
    folder = checkpoint_dir(job, run_dir)
    if step is None:
        found = find_latest_valid(folder)
        if found is None:
            listed = len(list_checkpoints(folder))
            raise UserError(problem(str(folder), f"no valid checkpoint ({listed} found, none "
                                    "complete and intact); train with "
                                    "optimization.checkpoint.interval > 0"))
        return job, found[0], found[1]
    path = folder / f"step-{step}"
    reason = verify_checkpoint(path) if path.is_dir() else "it does not exist"
    if reason is not None:
        steps = [s for s, p in list_checkpoints(folder) if verify_checkpoint(p) is None]
        raise UserError(problem("--step", f"{path} is not a valid checkpoint: {reason}; valid "
                                f"steps: {steps or 'none'}"))
    return job, step, path


def load_full_state(run_dir: Path, step: int | None = None) -> FullState:
    """The full model of a run's checkpoint (``step``, or the newest valid one)."""
    from mcpar.checkpoint.files import load_tensors  # the packed reader, only when loading

    job, step, path = find_checkpoint(run_dir, step)
    meta = read_meta(path)
    cfg = ModelConfig.model_validate(meta["config"]["model"])
    layout = saved_layout(meta)
    with warnings.catch_warnings():  # DCP's note that it reads in one process: it is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        shards = model_shards(load_tensors(path, "model/"))
    maps = {c: layout_maps(cfg, layout, c) for c in shards}
    model = get_model_spec(cfg.kind).build(cfg, 0)
    named = list(model.named_parameters())
    full = full_parameters(cfg, shards, maps, named)
    buffers = saved_buffers(shards, maps, named, set(dict(model.named_buffers())))
    return FullState(step, path, job, cfg, full, buffers)


@dataclass(frozen=True)
class RunTokenizer:
    path: Path  # its tokenizer.json
    # The token that ends every document of the run's data (what the model learned to emit at
    # the end of a text); None when the data has none (the bytes tokenizer has no such token).
    eos_token: str | None


def run_tokenizer(job: JobConfig, vocab_size: int) -> RunTokenizer | None:
    """The tokenizer a run used and its end-of-document token: a prepared source's own copy
    and the token its manifest names (``mcpar prepare --eos-token`` included), the configured
    file and the token its data was prepared with, or mcpar's cached BPE (read back through the
    corpus cache); None for the bytes tokenizer (and a ``.bin`` source without one)."""
    from mcpar.data.prepared_corpus import is_prepared_source, parse_blend, tokenizer_copy
    from mcpar.data.shards import read_manifest
    from mcpar.data.tokenizer_file import is_tokenizer_file, load_tokenizer_file

    data = job.data
    if not data.source.endswith(".bin") and is_prepared_source(data.source):
        # A blend's sources share one tokenizer (checked when it is read): the first one's.
        first = Path((parse_blend(data.source) or [(data.source, 1.0)])[0][0]).expanduser()
        manifest = read_manifest(first, "data.source")
        # The copy kept inside the directory (a link out is refused), as training reads it.
        return RunTokenizer(tokenizer_copy(first), manifest.get("eos_token"))
    if data.tokenizer == "bytes":
        return None
    if is_tokenizer_file(data.tokenizer):
        tok = load_tokenizer_file(data.tokenizer)  # the token its text was prepared with
        return RunTokenizer(tok.path, tok.eos_token)
    from mcpar.data.corpus import load_corpus

    corpus = load_corpus(data.source, data.tokenizer, vocab_size, data.val_fraction,
                         token_dtype=data.token_dtype, cache_dir=data.cache_dir)
    if corpus.tokenizer_path is None:
        return None
    from mcpar.data.bpe import END_OF_TEXT  # written after every file of the corpus

    return RunTokenizer(corpus.tokenizer_path, END_OF_TEXT)


def run_tokenizer_path(job: JobConfig, vocab_size: int) -> Path | None:
    """The tokenizer.json a run used (``run_tokenizer``); None for the bytes tokenizer."""
    found = run_tokenizer(job, vocab_size)
    return found.path if found is not None else None
