"""Hugging Face ``tokenizer.json`` files: loading, vocabulary size, end-of-document token.

``data.tokenizer`` may name such a file, or a directory holding one (what ``save_pretrained``
writes). The ``tokenizers`` package reads it; nothing is downloaded. Documents are separated by
one end-of-document id: ``mcpar prepare --eos-token`` when given, else the tokenizer's own token
from ``EOS_CANDIDATES`` (first match), else the tokenizer is refused with that hint.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcpar.contained import contained_file
from mcpar.errors import UserError, problem

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Names of end-of-document tokens in common vocabularies, most specific first: GPT-2/NeoX,
# Llama 3 (its "<|eot_id|>" ends a chat turn, not a document), Llama 2/Mistral/T5, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BUILTIN_TOKENIZERS = ("bytes", "bpe")


def is_tokenizer_file(spec: str) -> bool:
    """True when ``data.tokenizer`` names a file rather than a built-in tokenizer."""
    return spec not in BUILTIN_TOKENIZERS


def resolve_tokenizer_path(spec: str, key: str = "data.tokenizer") -> Path:
    """The ``tokenizer.json`` that ``spec`` names (the file, or the one inside a directory)."""
    try:
        return _tokenizer_path(spec, key)
    except OSError as err:  # a name too long, a folder without permission: name the key
        raise UserError(problem(key, f"'{spec}' cannot be read ({err.strerror}); give a "
                                "Hugging Face tokenizer.json or a directory holding one")) from None


def _tokenizer_path(spec: str, key: str) -> Path:
    path = Path(os.path.expanduser(spec))
    if path.is_dir() and os.path.lexists(path / "tokenizer.json"):
        # A directory's tokenizer.json is kept inside it, a regular file (contained.py).
        return contained_file(path, "tokenizer.json", key, f"'{spec}'",
                              fix="put the tokenizer.json itself in the directory")
    if path.is_dir():
        path = path / "tokenizer.json"
    if os.path.exists(path) and not path.is_file():
        msg = (f"'{path}' is not a regular file (a FIFO, a device or a directory); give a "
               "Hugging Face tokenizer.json")
        raise UserError(problem(key, msg))
    if not path.is_file():
        builtins = "'bytes', 'bpe', " if key == "data.tokenizer" else ""
        msg = (f"no tokenizer file at '{spec}'; give {builtins}a Hugging Face "
               "tokenizer.json or a directory holding one")
        raise UserError(problem(key, msg))
    return path


@dataclass(frozen=True)
class TokenizerFile:
    """A loaded tokenizer file with what data preparation and training need from it."""

    path: Path
    sha256: str  # of the file's bytes: identifies the tokenizer in shard manifests
    vocab_size: int  # ids are < vocab_size, added/special tokens included
    eos_id: int
    eos_token: str

    def load(self) -> Tokenizer:
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.path.read_text(encoding="utf-8"))


def load_tokenizer_file(
    spec: str, eos_token: str | None = None, key: str = "data.tokenizer",
    eos_hint: str = "name one of its tokens with --eos-token",
) -> TokenizerFile:
    """Read and check ``spec``; errors name ``key`` (the file) or ``--eos-token``."""
    from tokenizers import Tokenizer

    path = resolve_tokenizer_path(spec, key)
    try:
        raw = path.read_bytes()
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(problem(key, f"cannot read '{path}': {exc}")) from exc
    except Exception as exc:  # the tokenizers package raises its own exception type
        msg = f"'{path}' is not a valid Hugging Face tokenizer.json: {exc}"
        raise UserError(problem(key, msg)) from exc
    vocab = tok.get_vocab(with_added_tokens=True)
    # The largest id, not the vocabulary's length: added tokens may leave gaps.
    vocab_size = max(vocab.values(), default=-1) + 1
    if eos_token is not None:
        if eos_token not in vocab:
            msg = f"'{eos_token}' is not a token of '{path}'; name one of its tokens"
            raise UserError(problem("--eos-token", msg))
        name = eos_token
    else:
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        found = [c for c in EOS_CANDIDATES if c in special or c in vocab]
        if not found:
            msg = (f"'{path}' has no end-of-document token (looked for "
                   f"{', '.join(EOS_CANDIDATES)}); {eos_hint}")
            raise UserError(problem(key, msg))
        name = found[0]
    digest = hashlib.sha256(raw).hexdigest()
    return TokenizerFile(path, digest, vocab_size, vocab[name], name)


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
