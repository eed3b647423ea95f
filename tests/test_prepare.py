"""``mcpar prepare`` and training from prepared shards: Hugging Face tokenizer files, identical
bytes on a rerun, resuming, blends, layout independence, flat memory, and the user errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY, run_cli_in_process, run_mcpar, sets

from mcpar.data.corpus import load_corpus
from mcpar.data.prepare import prepare
from mcpar.data.shards import PreparedSplit, shard_name, write_manifest, write_shard
from mcpar.data.stream import BatchStream
from mcpar.errors import UserError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(seed: int, n_words: int) -> str:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=8)) for _ in range(n_words // 8)]
    return "\n".join(lines) + "\n"


def _make_tokenizer(path: Path, eos: str | None = "<|endoftext|>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos] if eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_text(0, 2000)], trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(_text(i + 1, 3000))
    docs = [{"text": _text(10 + i, 40), "id": i} for i in range(50)]
    (root / "more.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return root


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_prepare_is_deterministic_resumable_and_indexed(
    tmp_path: Path, tokenizer: Path, corpus: Path
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    first = prepare([str(corpus)], str(tokenizer), one, workers=1, shard_tokens=1500,
                    progress=False)
    assert len(first["shards"]) >= 4 and first["dtype"] == "uint16"
    prepare([str(corpus)], str(tokenizer), two, workers=2, shard_tokens=1500, progress=False)
    assert _files(one) == _files(two)  # byte-identical, whatever the number of workers

    # Every document ends with the end-of-document id; the JSON lines decode to their text.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    assert first["eos_id"] == eos
    last = first["shards"][-1]["name"]
    ids = np.fromfile(one / f"{last}.bin", dtype="<u2")
    starts = np.fromfile(one / f"{last}.idx", dtype="<u8")
    assert ids[-1] == eos and all(ids[s - 1] == eos for s in starts[1:])
    text = tok.decode(ids[starts[-1]:-1].tolist())
    assert text == _text(10 + 49, 40)

    # Resuming: a deleted shard and a truncated one are redone, nothing else.
    (one / f"{shard_name(1)}.bin").unlink()
    again = prepare([str(corpus)], str(tokenizer), one, workers=1, shard_tokens=1500,
                    progress=False)
    assert again["built"] == 1
    with open(one / f"{shard_name(2)}.bin", "r+b") as f:
        f.truncate(10)
    assert prepare([str(corpus)], str(tokenizer), one, shard_tokens=1500,
                   progress=False)["built"] == 1
    assert prepare([str(corpus)], str(tokenizer), one, shard_tokens=1500,
                   progress=False)["built"] == 0
    assert _files(one) == _files(two)


def _synthetic(directory: Path, values: tuple[int, int], tokens_per_shard: int,
               shards: int, seed: int = 0) -> Path:
    """A prepared directory written directly (no tokenizing): ids drawn from ``values``."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(shards):
        ids = rng.integers(*values, size=tokens_per_shard, dtype=np.uint16)
        records.append(write_shard(directory, shard_name(i), ids,
                                   np.arange(0, tokens_per_shard, 1000, dtype=np.uint64), "x"))
    shards_meta = [{k: v for k, v in r.items() if k != "unit"} for r in records]
    write_manifest(directory, {
        "sources": [], "files": [], "tokenizer_sha256": "synthetic", "vocab_size": 256,
        "eos_id": 0, "eos_token": "<eos>", "dtype": "uint16", "shard_tokens": tokens_per_shard,
        "shards": shards_meta, "total_tokens": tokens_per_shard * shards,
        "total_documents": sum(r["documents"] for r in records)})
    return directory


def test_blend_proportions_and_layout_independence(tmp_path: Path) -> None:
    a = _synthetic(tmp_path / "a", (0, 100), 20_000, 3)
    b = _synthetic(tmp_path / "b", (100, 200), 20_000, 2, seed=1)
    data = load_corpus(f"0.7 {a} 0.3 {b}", "bytes", 256, 0.05)
    assert isinstance(data.train, PreparedSplit)
    seq, gbs = 16, 8
    stream = BatchStream(data.train, seq, gbs, seed=3)
    for start in (0, 123_457, 10**7):  # any 1000 consecutive sequences
        src, _ = data.train.locate(np.arange(start, start + 1000), seq, seed=3)
        assert abs(np.mean(src == 0) - 0.7) <= 0.01
    # What is read is what was located: source a's ids are < 100, b's >= 100.
    batches = [stream.micro_batch(k, 0, 1, 0, gbs)[0] for k in range(125)]
    from_a = np.mean([bool((row < 100).all()) for x in batches for row in x.numpy()])
    assert abs(from_a - 0.7) <= 0.01
    # Step k is the same at data 1 x micro-batch 8 and at data 2 x micro-batch 2.
    for k in (0, 7):
        whole = stream.micro_batch(k, 0, 1, 0, gbs)
        parts = [stream.micro_batch(k, r, 2, m, 2) for r in range(2) for m in range(2)]
        for i in range(2):
            assert np.array_equal(whole[i].numpy(), np.concatenate([p[i].numpy() for p in parts]))
    # One epoch of a single source visits every training window exactly once.
    single = load_corpus(str(a), "bytes", 256, 0.05).train
    n = single.num_sequences(seq)
    _, windows = single.locate(np.arange(n), seq, seed=3)
    assert sorted(windows.tolist()) == list(range(n))
    val = load_corpus(str(a), "bytes", 256, 0.05).val
    _, val_windows = val.locate(np.arange(val.num_sequences(seq)), seq, seed=3)
    assert val_windows.min() == n  # validation: the trailing windows, disjoint from training


_PEAK = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from mcpar.data.prepared_corpus import load_prepared
    train = load_prepared(sys.argv[1], "bytes", 256, 0.01)[0]
    for k in range(200):
        train.windows(np.arange(k * 16, k * 16 + 16), 256, 1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def test_resident_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    peaks = []
    for mb in (20, 80):
        directory = _synthetic(tmp_path / f"c{mb}", (0, 256), 2_500_000, mb // 5)
        proc = subprocess.run([sys.executable, "-c", _PEAK, str(directory)], cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=True)
        peaks.append(int(proc.stdout.strip()) * 1024)
    # 4x the corpus; the reader's peak may not move by more than noise (2 MB).
    assert peaks[1] - peaks[0] < 2 << 20, peaks


def test_tokenizer_file_in_training_and_its_errors(
    tmp_path: Path, tokenizer: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = load_corpus(str(corpus / "doc0.txt"), str(tokenizer), 300, 0.1, cache_dir=tmp_path)
    assert data.vocab_size == 300 and data.tokenizer_path is not None
    with pytest.raises(UserError, match="model.vocab_size: .*at least 300"):
        load_corpus(str(corpus / "doc0.txt"), str(tokenizer.parent), 256, 0.1,
                    cache_dir=tmp_path)
    with pytest.raises(UserError, match="data.tokenizer: no tokenizer file"):
        load_corpus(str(corpus), str(tmp_path / "nope.json"), 300, 0.1, cache_dir=tmp_path)
    with pytest.raises(UserError, match=r"data.tokenizer: .*cannot be read \(File name too long"):
        load_corpus(str(corpus), str(tmp_path / ("x" * 300)), 300, 0.1, cache_dir=tmp_path)
    no_eos = _make_tokenizer(tmp_path / "plain.json", eos=None)
    with pytest.raises(UserError, match="data.tokenizer: .*no end-of-document.*--eos-token"):
        load_corpus(str(corpus), str(no_eos), 300, 0.1, cache_dir=tmp_path)
    out = tmp_path / "with-eos"
    got = prepare([str(corpus / "doc1.txt")], str(no_eos), out, eos_token="Ġ",
                  progress=False)
    assert got["eos_token"] == "Ġ"

    proc = run_cli_in_process(capsys, "prepare", str(corpus), "--tokenizer",
                              str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "--tokenizer: no tokenizer file" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli_in_process(capsys, "prepare", str(tmp_path / "absent*.txt"), "--tokenizer",
                              str(tokenizer), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "SOURCES: no file matches" in proc.stderr
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    proc = run_cli_in_process(capsys, "prepare", str(tmp_path / "bad.jsonl"), "--tokenizer",
                              str(tokenizer), "--out", str(tmp_path / "o2"), "--quiet")
    assert proc.returncode == 2 and 'no "text" string' in proc.stderr
    # An unreadable tokenizer file (not JSON; not UTF-8) is refused by prepare and by train,
    # each naming its key and the file.
    broken, binary = tmp_path / "broken" / "tokenizer.json", tmp_path / "binary.json"
    broken.parent.mkdir()
    broken.write_text('{"model": ')
    binary.write_bytes(b"\xff\xfe\x00tokenizer")
    # (the broken file is named through its directory, as a save_pretrained output is)
    for spec, bad, needle in ((broken.parent, broken, "not a valid Hugging Face tokenizer.json"),
                              (binary, binary, "cannot read")):
        proc = run_cli_in_process(capsys, "prepare", str(corpus), "--tokenizer", str(spec),
                                  "--out", str(tmp_path / "o3"))
        assert proc.returncode == 2 and "--tokenizer: " in proc.stderr, proc.stderr
        assert needle in proc.stderr and str(bad) in proc.stderr
        train = sets(*TINY, f"data.source={corpus}", f"data.tokenizer={spec}")
        proc = run_cli_in_process(capsys, "train", *train, "--nproc", "1", "--steps", "1",
                                  "--run-dir", str(tmp_path / "run-bad-tok"))
        assert proc.returncode == 2 and "data.tokenizer: " in proc.stderr, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_damaged_shard_directories_are_refused(
    tmp_path: Path, tokenizer: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "prep"
    prepare([str(corpus)], str(tokenizer), out, shard_tokens=3000, progress=False)
    args = ["train", *sets(*TINY, f"data.source={out}", "model.vocab_size=300"),
            "--nproc", "1", "--steps", "1", "--run-dir", str(tmp_path / "run")]

    def refused(needle: str) -> None:
        proc = run_cli_in_process(capsys, *args)
        assert proc.returncode == 2, proc.stderr
        assert "data.source: " in proc.stderr and needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr

    index = out / f"{shard_name(0)}.idx"
    saved = index.read_bytes()
    index.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    refused(f"the index '{index}' fails its checksum")
    index.unlink()
    refused("cannot read shard")
    refused(str(index))
    index.write_bytes(saved)
    manifest = out / "manifest.json"
    body = manifest.read_text()
    manifest.write_text(body.replace('"total_documents": ', '"total_documents": 1'))
    refused("manifest.json' fails its checksum")
    manifest.unlink()
    refused("no manifest.json")
    prepare([str(corpus)], str(tokenizer), out, shard_tokens=3000, progress=False)  # repaired
    other = _make_tokenizer(tmp_path / "other.json", eos="</s>")
    with pytest.raises(UserError, match="data.tokenizer: .*not the tokenizer"):
        load_corpus(str(out), str(other), 300, 0.1)


def test_mcpar_train_reads_a_blend_of_prepared_directories(
    tmp_path: Path, tokenizer: Path, corpus: Path
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    prepare([str(corpus / "doc0.txt"), str(corpus / "doc1.txt")], str(tokenizer), one,
            shard_tokens=2000, progress=False)
    prepare([str(corpus / "more.jsonl")], str(tokenizer), two, progress=False)
    run = tmp_path / "run"
    proc = run_mcpar("train", *sets(*TINY, f"data.source=0.7 {one} 0.3 {two}",
                                   "model.vocab_size=300", "model.seq_len=16"),
                     "--nproc", "1", "--steps", "4", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(np.isfinite(x["loss"]) for x in lines)
    assert lines[0]["loss"] == pytest.approx(np.log(300), abs=0.5)


def test_overlapping_sources_are_read_once_and_said_so(
        tokenizer: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    once = prepare([str(corpus / "*.txt")], str(tokenizer), tmp_path / "once", progress=False)
    capsys.readouterr()
    # The glob and the directory name doc0-2.txt twice, and doc1.txt a third time.
    twice = prepare([str(corpus / "*.txt"), str(corpus / "doc1.txt"), str(corpus / "doc*")],
                    str(tokenizer), tmp_path / "twice", progress=False)
    assert "4 file(s) named by more than one SOURCE are read once" in capsys.readouterr().out
    assert [f["path"] for f in twice["files"]] == [f["path"] for f in once["files"]]
    assert twice["total_tokens"] == once["total_tokens"]


def test_prepare_refuses_a_built_in_tokenizer_without_suggesting_it(
        corpus: Path, tmp_path: Path) -> None:
    for name in ("bytes", "bpe"):
        with pytest.raises(UserError, match="built into mcpar train") as err:
            prepare([str(corpus)], name, tmp_path / name, progress=False)
        assert "give a Hugging Face tokenizer.json" in str(err.value)
    with pytest.raises(UserError) as err:
        prepare([str(corpus)], str(tmp_path / "missing.json"), tmp_path / "x", progress=False)
    assert "'bytes'" not in str(err.value) and "--tokenizer" in str(err.value)


@pytest.mark.parametrize("craft", ["name_out", "tokens", "documents", "extra_key", "not_object"])
def test_a_crafted_record_of_an_earlier_output_is_rebuilt_not_trusted(
    tmp_path: Path, tokenizer: Path, corpus: Path, craft: str
) -> None:
    """A rerun reuses a shard only by what its files hold: a record whose checksums still
    match but whose name points outside, or whose counts lie, went into the new manifest as it
    was (checksummed anew, so training trusted it). Now the shard is rebuilt."""
    out = tmp_path / "out"
    first = prepare([str(corpus)], str(tokenizer), out, shard_tokens=1500, progress=False)
    record = out / f"{shard_name(0)}.json"
    body = json.loads(record.read_text())
    if craft == "name_out":
        body["name"] = "../elsewhere/shard"
    elif craft in ("tokens", "documents"):
        body[craft] += 7
    elif craft == "extra_key":
        body["path"] = "/etc/passwd"
    else:
        body = [body]
    record.write_text(json.dumps(body))
    again = prepare([str(corpus)], str(tokenizer), out, shard_tokens=1500, progress=False)
    assert again["built"] == 1
    assert again["shards"] == first["shards"]
    assert json.loads(record.read_text())["name"] == shard_name(0)
