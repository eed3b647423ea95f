"""Tests for mcpar.data's corpus, stream and bpe modules: corpus loading, the train/val split,
and layout-independent batches."""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mcpar.data import bpe
from mcpar.data.corpus import TokenCorpus, load_corpus
from mcpar.data.stream import BatchStream
from mcpar.data.text_files import stdlib_files
from mcpar.errors import UserError

EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def joined(parts: list[bytes]) -> bytes:
    return b"\n".join(parts)


def whole(corpus: TokenCorpus) -> np.ndarray:
    return np.concatenate([np.asarray(corpus.train), np.asarray(corpus.val)])


# --- stdlib -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus() -> tuple[TokenCorpus, float]:
    start = time.process_time()
    corpus = load_corpus("stdlib", "bytes", 256, 0.01)
    return corpus, time.process_time() - start


def test_stdlib_files_sorted_filtered_deterministic() -> None:
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert len(set(rel)) == len(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any(EXCLUDED.intersection(r.split("/")) for r in rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert stdlib_files() == files


def test_stdlib_bytes_corpus_matches_files(stdlib_corpus: tuple[TokenCorpus, float]) -> None:
    corpus, seconds = stdlib_corpus
    files = stdlib_files()
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes) + len(files) - 1
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert corpus.vocab_size == 256
    assert len(corpus.train) + len(corpus.val) == total
    assert len(corpus.val) == int(total * 0.01)
    head = joined([p.read_bytes() for p in files[:5]])
    assert corpus.train[: len(head)].tobytes() == head
    assert corpus.train[len(head)] == ord("\n")
    assert corpus.val[-sizes[-1] :].tobytes() == files[-1].read_bytes()
    assert corpus.description.startswith(f"stdlib: {len(files)} files, ")
    assert "bytes tokenizer" in corpus.description
    # CPU seconds of this process: ~2 s is the target; the other test worker and host steal
    # do not count against it.
    assert seconds < 5.0


# --- text, directory, glob and .bin sources ---------------------------------------------------


@pytest.fixture
def text_tree(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_bytes(b"alpha\nbeta")
    (tmp_path / "c.md").write_bytes(b"gamma \xff raw byte")  # invalid UTF-8 stays as-is
    (tmp_path / "sub" / "b.txt").write_bytes(b"delta\n")
    return tmp_path


def test_text_file_source(text_tree: Path) -> None:
    corpus = load_corpus(str(text_tree / "a.txt"), "bytes", 256, 0.1)
    assert whole(corpus).tobytes() == b"alpha\nbeta"
    assert len(corpus.val) == 1 and corpus.val.tobytes() == b"a"
    assert corpus.description.startswith(f"{text_tree / 'a.txt'}: 1 files, ")


def test_directory_source_recursive_sorted(text_tree: Path) -> None:
    corpus = load_corpus(str(text_tree), "bytes", 300, 0.2)
    expected = joined([b"alpha\nbeta", b"gamma \xff raw byte", b"delta\n"])
    assert whole(corpus).tobytes() == expected
    assert len(corpus.val) == int(len(expected) * 0.2)
    assert corpus.vocab_size == 300


def test_glob_source_recursive(text_tree: Path) -> None:
    corpus = load_corpus(str(text_tree / "**" / "*.txt"), "bytes", 256, 0.1)
    assert whole(corpus).tobytes() == joined([b"alpha\nbeta", b"delta\n"])


def test_missing_source_and_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.source") as info:
        load_corpus(str(tmp_path / "nope*.txt"), "bytes", 256, 0.1)
    assert "nope*.txt" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="data.source"):
        load_corpus(str(tmp_path / "empty"), "bytes", 256, 0.1)


@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 70_000)])
def test_bin_round_trip(tmp_path: Path, dtype: str, top: int) -> None:
    ids = np.random.default_rng(0).integers(0, top, size=1000).astype(dtype)
    ids[17] = top
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    corpus = load_corpus(str(path), "bytes", top + 1, 0.05, token_dtype=dtype)
    assert isinstance(corpus.train, np.memmap)
    assert corpus.train.dtype == np.dtype(dtype)
    assert len(corpus.val) == 50
    np.testing.assert_array_equal(whole(corpus), ids)


def test_bin_errors(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 300, 4], dtype=np.uint16).tofile(path)
    with pytest.raises(UserError, match="data.token_dtype"):
        load_corpus(str(path), "bytes", 512, 0.1)
    with pytest.raises(UserError, match="model.vocab_size") as info:
        load_corpus(str(path), "bytes", 256, 0.1, token_dtype="uint16")
    assert "token id 300" in str(info.value) and "at least 301" in str(info.value)
    with pytest.raises(UserError, match="data.source"):
        load_corpus(str(tmp_path / "missing.bin"), "bytes", 512, 0.1, token_dtype="uint16")
    path.write_bytes(b"\x01\x00\x02")  # 3 bytes: not a whole number of uint16 tokens
    with pytest.raises(UserError, match="data.source"):
        load_corpus(str(path), "bytes", 512, 0.1, token_dtype="uint16")


def test_argument_errors(text_tree: Path) -> None:
    src = str(text_tree / "a.txt")
    with pytest.raises(UserError, match="model.vocab_size"):
        load_corpus(src, "bytes", 100, 0.1)
    with pytest.raises(UserError, match="model.vocab_size"):
        load_corpus(src, "bpe", 256, 0.1, cache_dir=text_tree / "cache")
    with pytest.raises(UserError, match="data.val_fraction"):
        load_corpus(src, "bytes", 256, 0.5)
    with pytest.raises(UserError, match="data.val_fraction"):
        load_corpus(src, "bytes", 256, 0.0)
    with pytest.raises(UserError, match="data.tokenizer"):
        load_corpus(src, "words", 256, 0.1)
    with pytest.raises(UserError, match="data.token_dtype"):
        load_corpus(src, "bytes", 256, 0.1, token_dtype="int8")


# --- BatchStream --------------------------------------------------------------------------------


def ramp(n: int) -> np.ndarray:
    # Token j == j, so every window is identifiable from its first input token.
    return np.arange(n, dtype=np.uint32)


def test_windows_and_targets_match_tokens() -> None:
    tokens = (ramp(4001) * 7 % 251).astype(np.uint8)
    stream = BatchStream(tokens, seq_len=16, global_batch=8, seed=3)
    assert stream.num_sequences == 250
    x, y = stream.micro_batch(5, 0, 1, 0, 8)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert tuple(x.shape) == (8, 16) and tuple(y.shape) == (8, 16)
    for row, i in enumerate(stream.global_indices(5)):
        np.testing.assert_array_equal(x[row].numpy(), tokens[i * 16 : i * 16 + 16])
        np.testing.assert_array_equal(y[row].numpy(), tokens[i * 16 + 1 : i * 16 + 17])


def test_order_is_seeded_permutation() -> None:
    stream = BatchStream(ramp(1001), seq_len=10, global_batch=4, seed=7)
    perm = np.random.default_rng([7, 0]).permutation(100)
    np.testing.assert_array_equal(stream.global_indices(0), perm[:4])
    np.testing.assert_array_equal(stream.global_indices(3), perm[12:16])
    np.testing.assert_array_equal(stream.global_indices(3), stream.global_indices(3))
    assert not np.array_equal(stream.global_indices(3), stream.global_indices(4))
    other_seed = BatchStream(ramp(1001), seq_len=10, global_batch=4, seed=8)
    assert not np.array_equal(stream.global_indices(0), other_seed.global_indices(0))


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 1), (2, 4), (4, 1), (4, 2)])
def test_shards_concatenate_to_global_batch(dp: int, mbs: int) -> None:
    g = 8
    stream = BatchStream(ramp(5001), seq_len=12, global_batch=g, seed=11)
    for step in (0, 9, 52):  # 52 crosses into the second epoch (416 sequences)
        full_x, full_y = stream.micro_batch(step, 0, 1, 0, g)
        parts = [
            stream.micro_batch(step, rank, dp, j, mbs)
            for rank in range(dp)
            for j in range(g // (dp * mbs))
        ]
        assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
        np.testing.assert_array_equal(full_x[:, 0].numpy(), stream.global_indices(step) * 12)


def test_global_indices_independent_of_query_order() -> None:
    a = BatchStream(ramp(801), seq_len=8, global_batch=6, seed=2)
    b = BatchStream(ramp(801), seq_len=8, global_batch=6, seed=2)
    b.micro_batch(40, 1, 3, 0, 2)  # touch later epochs first: caches must not leak into results
    b.global_indices(99)
    for step in (0, 16, 17, 33, 99):
        np.testing.assert_array_equal(a.global_indices(step), b.global_indices(step))


def test_epoch_boundaries_and_oversized_batches() -> None:
    seed = 5
    stream = BatchStream(ramp(11), seq_len=2, global_batch=3, seed=seed)  # 5 sequences
    order = np.concatenate([stream.global_indices(k) for k in range(5)])  # 15 = 3 epochs
    for e in range(3):
        epoch = order[5 * e : 5 * e + 5]
        assert sorted(epoch.tolist()) == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(epoch, np.random.default_rng([seed, e]).permutation(5))
    big = BatchStream(ramp(11), seq_len=2, global_batch=7, seed=seed)  # batch > epoch
    np.testing.assert_array_equal(
        np.concatenate([big.global_indices(k) for k in range(3)])[:15], order
    )


def test_state_dict_round_trip_and_mismatch() -> None:
    stream = BatchStream(ramp(1001), seq_len=10, global_batch=4, seed=1)
    for _ in range(3):
        stream.advance()
    state = stream.state_dict()
    assert state == {"step": 3, "seed": 1, "global_batch": 4, "seq_len": 10}
    resumed = BatchStream(ramp(1001), seq_len=10, global_batch=4, seed=1)
    resumed.load_state_dict(state)
    assert resumed.next_step == 3
    np.testing.assert_array_equal(
        resumed.global_indices(resumed.next_step), stream.global_indices(3)
    )
    for kwargs in ({"seed": 2}, {"global_batch": 8}, {"seq_len": 5}):
        args = {"seq_len": 10, "global_batch": 4, "seed": 1} | kwargs
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            BatchStream(ramp(1001), **args).load_state_dict(state)


def test_stream_guards() -> None:
    stream = BatchStream(ramp(1001), seq_len=10, global_batch=6, seed=0)
    with pytest.raises(ValueError, match="divisible"):
        stream.micro_batch(0, 0, 4, 0, 1)
    with pytest.raises(ValueError, match="micro_index"):
        stream.micro_batch(0, 0, 2, 3, 1)
    with pytest.raises(UserError, match="data.source") as info:
        BatchStream(ramp(10), seq_len=10, global_batch=1, seed=0)
    assert "model.seq_len" in str(info.value)
    assert BatchStream(ramp(11), seq_len=10, global_batch=1, seed=0).num_sequences == 1


# --- BPE ----------------------------------------------------------------------------------------


@pytest.fixture
def bpe_text(tmp_path: Path) -> Path:
    words = ["def", "return", "self", "value", "import", "class", "the", "data", "π", "é"]
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=8)) for _ in range(120)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bpe_trains_tokenizes_and_round_trips(
    bpe_text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    trained_on: list[int] = []
    real_train = bpe._train_bpe

    def spy(text: np.ndarray, vocab_size: int) -> object:  # records the training text length
        trained_on.append(len(text))
        return real_train(text, vocab_size)

    monkeypatch.setattr(bpe, "_train_bpe", spy)
    calls: list[int] = []
    corpus = load_corpus(
        str(bpe_text), "bpe", 300, 0.1, cache_dir=tmp_path / "c", barrier=lambda: calls.append(1)
    )
    raw = bpe_text.read_bytes()
    assert calls == [1]
    assert trained_on == [len(raw) - int(len(raw) * 0.1)]
    tokens = whole(corpus)
    assert corpus.train.dtype == np.uint16
    assert tokens.max() < 300 and tokens.max() >= 256  # merges were learned and used
    assert len(tokens) < len(raw) * 0.8
    assert len(corpus.val) == int(len(tokens) * 0.1)
    assert "trained" in corpus.description and f"{len(tokens)} tokens" in corpus.description
    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    # The file's text, then the end-of-text token (a special token: plain decoding skips it).
    assert tok.decode(tokens.tolist(), skip_special_tokens=False) == \
        raw.decode("utf-8") + bpe.END_OF_TEXT
    assert tok.decode(tokens.tolist()) == raw.decode("utf-8")
    sample = "class data: return self.value  # π é"
    assert tok.decode(tok.encode(sample).ids) == sample


def test_bpe_ends_every_file_with_its_end_of_text_token(bpe_text: Path, tmp_path: Path) -> None:
    """Each file of the corpus is followed by the tokenizer's end-of-text token (what a model
    learns to emit where a text ends, and what an export names as eos), not joined to the next
    file; the exported special tokens name it."""
    from tokenizers import Tokenizer

    from mcpar.config import load_config
    from mcpar.interop.full_state import run_tokenizer
    from mcpar.interop.hf_export import special_tokens

    tree = tmp_path / "tree"
    tree.mkdir()
    texts = {"a.txt": bpe_text.read_text(encoding="utf-8"), "b.txt": "class data:\n  return 1\n"}
    for name, text in texts.items():
        (tree / name).write_text(text, encoding="utf-8")
    corpus = load_corpus(str(tree), "bpe", 300, 0.1, cache_dir=tmp_path / "c")
    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    eos = tok.token_to_id(bpe.END_OF_TEXT)
    tokens = whole(corpus).tolist()
    ends = [i for i, t in enumerate(tokens) if t == eos]
    assert len(ends) == 2 and ends[-1] == len(tokens) - 1
    assert [tok.decode(part) for part in (tokens[: ends[0]], tokens[ends[0] + 1 : ends[1]])] == \
        [texts[name] for name in sorted(texts)]
    job = load_config(None, [f"data.source={tree}", "data.tokenizer=bpe", "model.vocab_size=300",
                             f"data.cache_dir={tmp_path / 'c'}"])
    found = run_tokenizer(job, 300)
    assert found is not None and found.eos_token == bpe.END_OF_TEXT
    assert special_tokens(found)["eos"] == (bpe.END_OF_TEXT, eos)


def test_bpe_cache_reuse_ranks_and_invalidation(
    bpe_text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "c"
    first = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=cache)
    npy = first.tokenizer_path.parent / "tokens.npy"
    mtime = npy.stat().st_mtime_ns

    def no_training(*_: object) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(bpe, "_train_bpe", no_training)
    again = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=cache)
    worker = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=cache, is_main=False)
    assert npy.stat().st_mtime_ns == mtime
    assert "cached" in again.description
    np.testing.assert_array_equal(whole(again), whole(first))
    np.testing.assert_array_equal(whole(worker), whole(first))
    with pytest.raises(UserError, match="data.cache_dir"):  # a worker never trains itself
        load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=tmp_path / "other", is_main=False)
    monkeypatch.undo()

    other_vocab = load_corpus(str(bpe_text), "bpe", 280, 0.1, cache_dir=cache)
    assert other_vocab.tokenizer_path != first.tokenizer_path and whole(other_vocab).max() < 280
    with bpe_text.open("a", encoding="utf-8") as f:
        f.write("a brand new line\n")
    changed = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=cache)
    assert changed.tokenizer_path != first.tokenizer_path
    assert "trained" in changed.description
    assert len(list(cache.iterdir())) == 3
    assert not list(cache.glob("*/.*tmp*"))  # atomic writes leave no temporaries behind


def test_bpe_is_deterministic_and_too_small_is_an_error(bpe_text: Path, tmp_path: Path) -> None:
    a = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=tmp_path / "a")
    b = load_corpus(str(bpe_text), "bpe", 300, 0.1, cache_dir=tmp_path / "b")
    np.testing.assert_array_equal(whole(a), whole(b))
    assert a.tokenizer_path.read_bytes() == b.tokenizer_path.read_bytes()
    with pytest.raises(UserError, match="data.source") as info:
        BatchStream(a.val, seq_len=len(a.val), global_batch=1, seed=0)
    assert f"model.seq_len={len(a.val)}" in str(info.value)
