"""``mcpar generate RUN_DIR --prompt TEXT``: sample text from a run's newest checkpoint.

A sanity check of what a run learned, not a serving path: the checkpoint (any layout) is read
whole into one process (interop/full_state.py), the model is built from its spec, and tokens are
drawn one at a time with temperature and top-k, the full forward re-run for each token (no
key/value cache) over at most ``model.seq_len`` tokens of context. Text goes through the run's
tokenizer (bytes, its BPE or its tokenizer.json). The device follows ``training.device``'s rule
(device.py): ``auto`` takes CUDA when present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mcpar.device import select_device
from mcpar.errors import UserError, problem
from mcpar.interop.full_state import load_full_state, run_tokenizer_path
from mcpar.models.spec import get_model_spec


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 100
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 50  # None: the whole vocabulary
    seed: int = 0


def _codec(tokenizer: Path | None) -> tuple[Callable[[str], list[int]],
                                             Callable[[list[int]], str]]:
    if tokenizer is None:  # the bytes tokenizer: ids are the UTF-8 bytes
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(ids))


def sample_next(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """One token id from the last position's logits [vocab]."""
    logits = logits.float().cpu()
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


def generate(run_dir: Path, prompt: str, sampling: Sampling, device: str = "auto",
             step: int | None = None) -> tuple[str, int]:
    """The prompt followed by the sampled text, and the checkpoint step it came from."""
    if sampling.temperature < 0:
        raise UserError(problem("--temperature", f"{sampling.temperature} is negative; give 0 "
                                "(greedy) or more"))
    if sampling.top_k is not None and sampling.top_k < 1:
        raise UserError(problem("--top-k", f"{sampling.top_k}: give 1 or more"))
    state = load_full_state(run_dir, step)
    cfg = state.model
    encode, decode = _codec(run_tokenizer_path(state.job, cfg.vocab_size))
    ids = encode(prompt)
    if not ids:
        raise UserError(problem("--prompt", "is empty; give some text to continue"))
    if max(ids) >= cfg.vocab_size:
        raise UserError(problem("--prompt", f"token id {max(ids)} is outside the model's "
                                f"vocabulary of {cfg.vocab_size}"))
    info = select_device(device)
    where = info.torch_device(0)
    model = get_model_spec(cfg.kind).build(cfg, 0)
    missing, _ = model.load_state_dict({**state.params, **state.buffers}, strict=False)
    names = set(dict(model.named_parameters()))
    assert not [m for m in missing if m in names], missing  # every parameter came back
    model = model.to(where).eval()
    gen = torch.Generator().manual_seed(sampling.seed)
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(sampling.max_new_tokens):
            context = torch.tensor([tokens[-cfg.seq_len:]], device=where)
            tokens.append(sample_next(model(context)[0, -1], sampling, gen))
    return prompt + decode(tokens[len(ids):]), state.step
