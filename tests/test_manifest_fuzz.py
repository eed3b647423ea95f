"""Damaged prepared-data directories, seeded: each is refused as a user error (one line naming
``data.source``, no other exception) when the data is opened, or reads exactly the tokens of
the undamaged directory. No file outside the directory is opened (every open is recorded) and
none hangs. Most damage has the manifest's checksum recomputed, so that only the checks of
what the manifest says can catch it: shard names out of the directory (``..``, absolute, a
link out) or at a FIFO, a device or a directory, names that are not strings, wrong counts and
types, an index rewritten (its checksum recomputed too), truncated shards, a damaged manifest
or tokenizer copy. The directory is written once by mcpar's own ``prepare``."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import time_limit

from mcpar.data.prepare import prepare
from mcpar.data.prepared_corpus import load_prepared
from mcpar.data.shards import MANIFEST, _checksum, _dumps
from mcpar.data.tokenizer_file import resolve_tokenizer_path
from mcpar.errors import UserError

SEQ = 16
TIMEOUT_S = 5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(seed: int, n_words: int) -> str:
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(WORDS, size=8)) for _ in range(n_words // 8)) + "\n"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The undamaged prepared directory and what it reads: every window of both splits."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("prep")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([_text(0, 400)], trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    (root / "text").mkdir()
    for i in range(3):
        (root / "text" / f"doc{i}.txt").write_text(_text(i + 1, 600))
    out = root / "model"
    prepare([str(root / "text")], str(root / "tokenizer.json"), out, shard_tokens=400,
            progress=False)
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) >= 3
    return out, _read(out)


def _read(d: Path) -> dict:
    train, val, vocab, _, tok_copy = load_prepared(str(d), "bytes", 1 << 16, 0.1)
    out = {"vocab": vocab, "tokenizer": tok_copy.name}
    for name, split in (("train", train), ("val", val)):
        src = split.sources[0]
        lo, hi = split.ranges(SEQ)[0]
        out[name] = src.read_windows(np.arange(lo, hi), SEQ)
        out[name + "_shards"] = src.shard_tokens.tolist()
        src.close()
    return out


# --- recording every open, and a timeout ---------------------------------------------------
@contextlib.contextmanager
def recorded_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    seen: list[str] = []

    def wrap(fn: Callable) -> Callable:
        def opener(*args, **kwargs):  # type: ignore[no-untyped-def]
            if args and isinstance(args[0], str | bytes | os.PathLike):
                seen.append(os.fsdecode(args[0]))
            return fn(*args, **kwargs)
        return opener

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", wrap(builtins.open))
        m.setattr(io, "open", wrap(io.open))
        m.setattr(os, "open", wrap(os.open))
        yield seen



# --- damage ---------------------------------------------------------------------------------
def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _save(d: Path, body: dict, recompute: bool = True) -> None:
    """The manifest written back; its checksum recomputed, so only later checks can catch it."""
    if recompute:
        body = {**body, "checksum": _checksum(body)}
    (d / MANIFEST).write_bytes(_dumps(body))


def _evil(d: Path) -> Path:
    """The sandbox beside the directory: a valid shard of other tokens that an escaping name
    would have training read."""
    return d.parent / "evil"


def _entry(body: dict, rng: random.Random) -> dict:
    return rng.choice(body["shards"])


def names_escape(d: Path, rng: random.Random) -> None:
    body = _manifest(d)
    which = rng.choice(["dotdot", "absolute", "deep", "link", "link_dir"])
    entry = _entry(body, rng)
    evil = _evil(d) / "shard-00000"
    if which == "dotdot":
        entry["name"] = "../evil/shard-00000"
    elif which == "deep":
        entry["name"] = "x/../../evil/shard-00000"
    elif which == "absolute":
        entry["name"] = str(evil)
    elif which == "link":
        for ext in (".bin", ".idx"):
            (d / f"linked{ext}").symlink_to(f"{evil}{ext}")
        entry["name"] = "linked"
    else:
        (d / "up").symlink_to(_evil(d))
        entry["name"] = "up/shard-00000"
    # The escaping shard's own sums, as a crafted manifest would carry.
    entry["index_sha256"] = hashlib.sha256(Path(f"{evil}.idx").read_bytes()).hexdigest()
    entry["tokens"] = Path(f"{evil}.bin").stat().st_size // 2
    entry["documents"] = Path(f"{evil}.idx").stat().st_size // 8
    _save(d, body)


def names_special(d: Path, rng: random.Random) -> None:
    body = _manifest(d)
    entry = _entry(body, rng)
    which = rng.choice(["fifo", "zero", "dir", "null", "int", "none", "list", "empty",
                        "missing"])
    if which == "fifo":
        os.mkfifo(d / "pipe.idx")
        os.mkfifo(d / "pipe.bin")
        entry["name"] = "pipe"
    elif which == "zero":
        shutil.copy(d / f"{entry['name']}.idx", d / "zero.idx")
        (d / "zero.bin").symlink_to("/dev/zero")
        entry["name"] = "zero"
    elif which == "dir":
        (d / "folder.idx").mkdir()
        (d / "folder.bin").mkdir()
        entry["name"] = "folder"
    elif which == "null":
        entry["name"] = "shard\x00"
    elif which == "missing":
        entry["name"] = "shard-09999"
    else:
        entry["name"] = {"int": 7, "none": None, "list": ["shard-00000"], "empty": ""}[which]
    _save(d, body)


def counts(d: Path, rng: random.Random) -> None:
    body = _manifest(d)
    entry = _entry(body, rng)
    which = rng.choice(["tokens", "documents"])
    entry[which] = rng.choice([entry[which] + rng.randint(1, 50), entry[which] - 1, -5,
                               float(entry[which]) + 0.5, str(entry[which]), None, True])
    _save(d, body)


def keys(d: Path, rng: random.Random) -> None:
    body = _manifest(d)
    which = rng.choice(["dtype", "vocab", "shards", "entry", "digest", "tok_sha"])
    if which == "dtype":
        body["dtype"] = rng.choice(["uint8", "int64", "float32", 7, None])
    elif which == "vocab":
        body["vocab_size"] = rng.choice(["280", 0, -1, 2.5, None])
    elif which == "shards":
        body["shards"] = rng.choice([[], {}, None, "shard-00000"])
    elif which == "entry":
        body["shards"][rng.randrange(len(body["shards"]))] = rng.choice([None, 3, "x", []])
    elif which == "digest":
        _entry(body, rng)["index_sha256"] = rng.choice([None, 5, ["a"]])
    else:
        body["tokenizer_sha256"] = rng.choice([None, 3])
    _save(d, body)


def index_rewritten(d: Path, rng: random.Random) -> None:
    """An index with new contents and its checksum recomputed in the manifest."""
    body = _manifest(d)
    entry = _entry(body, rng)
    path = d / f"{entry['name']}.idx"
    starts = np.fromfile(path, dtype="<u8")
    which = rng.choice(["order", "past", "count", "odd"])
    if which == "order" and len(starts) > 1:
        starts = starts[::-1].copy()
    elif which == "past" or (which == "order" and len(starts) <= 1):
        starts = np.append(starts, np.uint64(entry["tokens"] + rng.randint(0, 100)))
        entry["documents"] = len(starts)
    elif which == "count":
        starts = np.append(starts, starts[-1:])
    raw = starts.astype("<u8").tobytes() + (b"\x01" if which == "odd" else b"")
    path.write_bytes(raw)
    entry["index_sha256"] = hashlib.sha256(raw).hexdigest()
    _save(d, body)


def truncated(d: Path, rng: random.Random) -> None:
    body = _manifest(d)
    entry = _entry(body, rng)
    path = d / f"{entry['name']}{rng.choice(['.bin', '.idx'])}"
    with open(path, "r+b") as f:
        f.truncate(rng.randrange(0, path.stat().st_size))


def manifest_damage(d: Path, rng: random.Random) -> None:
    which = rng.choice(["flip", "list", "fifo", "link_out", "not_json", "format",
                        "harmless"])
    raw = (d / MANIFEST).read_bytes()
    if which == "flip":
        at = rng.randrange(len(raw))
        (d / MANIFEST).write_bytes(raw[:at] + bytes([raw[at] ^ 4]) + raw[at + 1:])
    elif which == "list":
        (d / MANIFEST).write_text("[1, 2]")
    elif which == "fifo":
        (d / MANIFEST).unlink()
        os.mkfifo(d / MANIFEST)
    elif which == "link_out":
        (_evil(d) / MANIFEST).write_bytes(raw)
        (d / MANIFEST).unlink()
        (d / MANIFEST).symlink_to(_evil(d) / MANIFEST)
    elif which == "not_json":
        (d / MANIFEST).write_bytes(raw[: rng.randrange(len(raw))])
    elif which == "format":
        body = _manifest(d)
        body["format"] = "mcpar-shards-v0"
        _save(d, body)
    else:
        body = _manifest(d)
        body["sources"] = ["somewhere else"]  # not read by training: the same tokens
        _save(d, body)


def tokenizer_copy(d: Path, rng: random.Random) -> None:
    which = rng.choice(["link_out", "fifo", "dir"])
    (d / "tokenizer.json").unlink()
    if which == "link_out":
        shutil.copy(d.parent / "tokenizer.json", _evil(d) / "tokenizer.json")
        (d / "tokenizer.json").symlink_to(_evil(d) / "tokenizer.json")
    elif which == "fifo":
        os.mkfifo(d / "tokenizer.json")
    else:
        (d / "tokenizer.json").mkdir()


FAMILIES: dict[str, tuple[Callable[[Path, random.Random], None], int]] = {
    "names_escape": (names_escape, 20), "names_special": (names_special, 24),
    "counts": (counts, 18), "keys": (keys, 18), "index_rewritten": (index_rewritten, 16),
    "truncated": (truncated, 12), "manifest": (manifest_damage, 16),
    "tokenizer_copy": (tokenizer_copy, 8),
}
ALWAYS_REFUSED = ("names_escape", "names_special", "counts", "keys", "index_rewritten",
                  "truncated", "tokenizer_copy")


def _case_dir(pristine_dir: Path, base: Path) -> Path:
    d = base / "model"
    shutil.copytree(pristine_dir, d, symlinks=True)
    shutil.copy(pristine_dir.parent / "tokenizer.json", base / "tokenizer.json")
    evil = base / "evil"
    evil.mkdir()
    # Another shard (its tokens reversed): reading it would change what training sees.
    first = sorted(d.glob("shard-*.bin"))[0]
    (evil / "shard-00000.bin").write_bytes(np.fromfile(first, "<u2")[::-1].tobytes())
    shutil.copy(first.with_suffix(".idx"), evil / "shard-00000.idx")
    return d


def _outcome(d: Path, expected: dict) -> str:
    try:
        with time_limit(TIMEOUT_S):
            got = _read(d)
    except UserError as exc:
        assert exc.problems and all(p.startswith("data.source: ") and "\n" not in p
                                    for p in exc.problems), exc.problems
        return "refused"
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert np.array_equal(got[k], v) if isinstance(v, np.ndarray) else got[k] == v, k
    return "same"


def test_damaged_prepared_directories_are_refused_or_read_the_same(
    pristine: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, expected = pristine
    outcomes: Counter[tuple[str, str]] = Counter()
    start = time.monotonic()
    for family, (damage, count) in FAMILIES.items():
        for seed in range(count):
            base = tmp_path / f"{family}-{seed}"
            base.mkdir()
            d = _case_dir(root, base)
            damage(d, random.Random(f"{family}/{seed}"))
            with recorded_opens(monkeypatch) as seen:
                try:
                    outcome = _outcome(d, expected)
                except Exception as exc:  # noqa: BLE001 - named in the failure
                    raise AssertionError(f"{family} seed {seed}: {type(exc).__name__}: "
                                         f"{exc}") from exc
            resolved = {str(Path(p).resolve()) for p in seen}
            out = [p for p in resolved if p.startswith(str(base.resolve()))
                   and not p.startswith(str(d.resolve()) + os.sep)]
            assert not out, f"{family} seed {seed} opened {out}"
            assert not [p for p in resolved if p.startswith("/dev/")], (family, seed)
            outcomes[family, outcome] += 1
    total = sum(outcomes.values())
    print(f"\n{total} damaged prepared directories in {time.monotonic() - start:.1f} s: "
          + ", ".join(f"{f} {o} {n}" for (f, o), n in sorted(outcomes.items())))
    assert total >= 100
    for family in ALWAYS_REFUSED:
        assert outcomes[family, "same"] == 0, family


# --- one finding each ------------------------------------------------------------------------
def _refusal(d: Path) -> str:
    with time_limit(TIMEOUT_S), pytest.raises(UserError) as exc:
        _read(d)
    assert len(exc.value.problems) == 1, exc.value.problems
    return exc.value.problems[0]


def test_a_valid_checksum_does_not_let_shard_names_escape(
    pristine: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _case_dir(pristine[0], tmp_path)
    body = _manifest(d)
    body["shards"][0]["name"] = "../evil/shard-00000"
    _save(d, body)
    with recorded_opens(monkeypatch) as seen:
        line = _refusal(d)
    assert line.startswith("data.source: ") and "'../evil/shard-00000.idx'" in line, line
    assert "outside" in line and MANIFEST in line
    assert not [p for p in seen if "evil" in p]


def test_shard_names_at_a_fifo_or_a_device_are_refused_unread(
    pristine: tuple[Path, dict], tmp_path: Path
) -> None:
    d = _case_dir(pristine[0], tmp_path / "fifo")
    os.mkfifo(d / "pipe.idx")
    body = _manifest(d)
    body["shards"][0]["name"] = "pipe"
    _save(d, body)
    assert "a FIFO, not a regular file" in _refusal(d)
    d = _case_dir(pristine[0], tmp_path / "zero")
    name = _manifest(d)["shards"][0]["name"]
    (d / f"{name}.bin").unlink()
    (d / f"{name}.bin").symlink_to("/dev/zero")
    assert "outside" in _refusal(d)


def test_manifest_types_are_checked_after_its_checksum(
    pristine: tuple[Path, dict], tmp_path: Path
) -> None:
    d = _case_dir(pristine[0], tmp_path)
    body = _manifest(d)
    body["shards"][0]["tokens"] = "400"
    _save(d, body)
    assert "shards[0].tokens is '400', not a whole number" in _refusal(d)


def test_an_index_with_its_checksum_recomputed_is_still_checked(
    pristine: tuple[Path, dict], tmp_path: Path
) -> None:
    d = _case_dir(pristine[0], tmp_path)
    body = _manifest(d)
    entry = body["shards"][0]
    raw = np.array([entry["tokens"] + 5], dtype="<u8").tobytes()
    (d / f"{entry['name']}.idx").write_bytes(raw)
    entry["index_sha256"], entry["documents"] = hashlib.sha256(raw).hexdigest(), 1
    _save(d, body)
    assert "past the shard's tokens" in _refusal(d)


def test_tokenizer_json_of_a_directory_is_kept_inside_it(tmp_path: Path) -> None:
    (tmp_path / "outside.json").write_text("{}")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(UserError, match="data.tokenizer: .*'tokenizer.json': it resolves to"):
        resolve_tokenizer_path(str(tmp_path / "tok"))
    (tmp_path / "tok" / "tokenizer.json").unlink()
    os.mkfifo(tmp_path / "tok" / "tokenizer.json")
    with time_limit(TIMEOUT_S), pytest.raises(UserError, match="a FIFO, not a regular file"):
        resolve_tokenizer_path(str(tmp_path / "tok"))
    os.mkfifo(tmp_path / "pipe.json")
    with time_limit(TIMEOUT_S), pytest.raises(UserError, match="not a regular file"):
        resolve_tokenizer_path(str(tmp_path / "pipe.json"))


def test_train_on_an_escaping_manifest_exits_2_in_one_line(
    pristine: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import TINY, run_cli_in_process, sets

    d = _case_dir(pristine[0], tmp_path)
    names_escape(d, random.Random("names_escape/0"))
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, f"data.source={d}",
                                                     "model.vocab_size=300", "model.seq_len=16"),
                              "--nproc", "1", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "data.source: " in lines[0] and "outside" in lines[0], lines
    assert "Traceback" not in proc.stderr


def test_the_run_tokenizer_of_a_prepared_source_is_its_contained_copy(
    pristine: tuple[Path, dict], tmp_path: Path
) -> None:
    """export and generate take a prepared run's tokenizer from its source directory: a
    tokenizer.json there that links out is refused like the training read refuses it, not
    handed on to be read (the run's full state joined the path unchecked)."""
    from mcpar.config import load_config
    from mcpar.interop.full_state import run_tokenizer

    d = _case_dir(pristine[0], tmp_path)
    job = load_config(None, [f"data.source={d}", "model.vocab_size=300"])
    assert run_tokenizer(job, 300).path == d / "tokenizer.json"
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")  # a copy outside
    with pytest.raises(UserError) as exc:
        run_tokenizer(job, 300)
    assert exc.value.problems[0].startswith("data.source: "), exc.value.problems
    assert "tokenizer.json" in exc.value.problems[0]
