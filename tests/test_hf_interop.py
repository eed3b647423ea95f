"""Hugging Face interop against ``transformers`` (a reference written elsewhere), offline.

Export: a tensor 2 x pipeline 2 run of each family (Llama, its MoE form, GPT), exported, gives
``AutoModelForCausalLM``'s logits on 4 sequences within 1e-4 (fp32). Import: small random
Hugging Face Llama and Mixtral models, built here from their config classes, start an mcpar run
whose first training loss is ``transformers``' loss on the same batch within 1e-4, and
``mcpar import`` reads seq_len. The same checkpoints as a run on a tokenizer file: the export
names its end-of-text token (tokenizer, config.json, generation_config.json), ``generate`` stops
there, and every file has the umask's mode. And the refusals (exit 2, naming the key or path).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import REPO, TINY, launch_in_process, sets

from mcpar.cli import main
from mcpar.config import ModelConfig, load_config, to_yaml
from mcpar.data.corpus import load_corpus
from mcpar.data.stream import BatchStream
from mcpar.interop.full_state import load_full_state
from mcpar.interop.hf_import import read_tensors, section_problems, section_yaml
from mcpar.interop.hf_names import export_problems, from_hf
from mcpar.metrics import read_metrics
from mcpar.models.spec import get_model_spec

transformers = pytest.importorskip("transformers")

LAYOUT = ["parallelism.tensor=2", "parallelism.pipeline=2", "optimization.micro_batch_size=2",
          "optimization.global_batch_size=4", "training.dtype=float32"]
SEQ = 16
TOL = 1e-4
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``mcpar ARGS`` in this process (no workers), its output captured here: usable from a
    module fixture, where capsys is not."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _hf_model(family: str, path: Path) -> Path:
    """A small random Hugging Face model, saved as save_pretrained writes it. Large weights
    (initializer_range) keep the logits far from uniform, so any mismapped tensor shows."""
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=SEQ,
            activation_function="gelu", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            initializer_range=0.3))
    else:
        common = dict(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3)
        model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
                 if family == "llama" else
                 transformers.MixtralForCausalLM(transformers.MixtralConfig(
                     **common, num_local_experts=4, num_experts_per_tok=2)))
    model.save_pretrained(path)
    return path


def _logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def family_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Path]:
    """A random Hugging Face model of the family, imported (``mcpar import`` and
    ``model.init_from``) into a 2-step tensor 2 x pipeline 2 run, whose checkpoint is exported;
    the MoE model sharded into a few files with an index, so that form loads too."""
    root = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(request.param, root / "hf-in")
    printed = _cli("import", str(hf))
    assert printed.returncode == 0, printed.stderr
    section = yaml.safe_load(printed.stdout)["model"]
    assert section["init_from"] == f"hf:{hf}"
    config = root / "job.yaml"
    # A Llama's section has seq_len 64 (max_position_embeddings); the run trains on SEQ windows.
    config.write_text(yaml.safe_dump({"model": {**section, "seq_len": SEQ}}))
    assert launch_in_process(
        "train", str(config), *sets(*TINY[4:], *LAYOUT, "training.steps=2",
                                    "optimization.checkpoint.interval=2"),
        "--nproc", "4", "--run-dir", str(root / "run")) == 0
    shard = ["--max-shard-mb", "0.05"] if request.param == "mixtral" else []
    done = _cli("export", str(root / "run"), "--format", "hf", str(root / "hf-out"), *shard)
    assert done.returncode == 0, done.stderr
    return {"family": Path(request.param), "hf_in": hf, "run": root / "run",
            "hf_out": root / "hf-out"}


def test_import_first_loss_is_transformers_loss(family_run: dict[str, Path]) -> None:
    first = read_metrics(family_run["run"])[0]["loss"]
    job = load_config(family_run["run"] / "config.yaml")
    corpus = load_corpus(job.data.source, job.data.tokenizer, 256, job.data.val_fraction)
    inputs, targets = BatchStream(corpus.train, SEQ, 4, job.training.seed).micro_batch(
        0, 0, 1, 0, 4)
    # transformers' logits, scored as its own loss does (the next token, averaged): its
    # labels= form needs one position more than GPT-2's position table holds.
    logits = _logits(family_run["hf_in"], inputs)
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(first - reference) <= TOL, (first, reference)
    assert abs(reference - math.log(256)) > 0.1  # far from a uniform guess


def test_export_gives_transformers_logits(family_run: dict[str, Path]) -> None:
    state = load_full_state(family_run["run"])
    cfg = state.model
    ours = get_model_spec(cfg.kind).build(cfg, 0)
    ours.load_state_dict({**state.params, **state.buffers}, strict=False)
    tokens = torch.randint(0, cfg.vocab_size, (4, SEQ),
                           generator=torch.Generator().manual_seed(7))
    theirs = _logits(family_run["hf_out"], tokens)
    with torch.no_grad():
        assert (ours.eval()(tokens) - theirs).abs().max().item() <= TOL
    config = json.loads((family_run["hf_out"] / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[family_run["family"].name]]
    # Written after two steps of training: not the weights the run was initialised from.
    assert (_logits(family_run["hf_in"], tokens) - theirs).abs().max().item() > 1e-3
    if cfg.kind == "llama_moe":
        index = json.loads((family_run["hf_out"] / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1


def test_export_of_a_run_without_checkpoint_exits_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None)))
    proc = _cli("export", str(run), "--format", "hf", str(tmp_path / "out"))
    assert proc.returncode == 2 and "no valid checkpoint" in proc.stderr
    assert str(run / "checkpoints") in proc.stderr
    proc = _cli("export", str(tmp_path), "--format", "hf", str(tmp_path / "out"))
    assert proc.returncode == 2 and "not an mcpar run directory" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_export_of_a_missing_step_exits_2(family_run: dict[str, Path], tmp_path: Path) -> None:
    proc = _cli("export", str(family_run["run"]), "--step", "99", "--format", "hf",
                str(tmp_path / "out"))
    assert proc.returncode == 2 and "--step" in proc.stderr and "valid steps: [2]" in proc.stderr


def test_import_of_another_architecture_exits_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    proc = _cli("import", str(tmp_path))
    assert proc.returncode == 2
    assert str(tmp_path / "config.json") in proc.stderr and "BertForMaskedLM" in proc.stderr
    with contextlib.chdir(REPO):  # the same directory as a run's model.init_from
        proc = _cli("train", *sets(*TINY, "model.kind=llama", f"model.init_from=hf:{tmp_path}"),
                    "--nproc", "1", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "model.init_from" in proc.stderr
    assert "BertForMaskedLM" in proc.stderr


def test_models_without_a_counterpart_are_refused() -> None:
    """GPT's MoE form has no Hugging Face architecture; the MoE settings Mixtral does not
    compute are named by key."""
    assert "model.kind" in export_problems(ModelConfig(kind="moe", num_experts=4), {})[0]
    moe = ModelConfig(kind="llama_moe", num_experts=4, top_k=2, capacity_factor=1.0,
                      shared_expert=True)
    text = "\n".join(export_problems(moe, {"blocks.0.mlp.router.expert_bias":
                                           torch.tensor([0.0, 0.1, 0.0, 0.0])}))
    for key in ("model.capacity_factor", "model.shared_expert", "model.router_bias_update_rate"):
        assert key in text


def test_mixtral_read_from_either_expert_layout(tmp_path: Path) -> None:
    """A saved Mixtral holds one tensor per expert; a loaded one (transformers 5) holds the
    experts fused: both give mcpar the same parameters."""
    path = _hf_model("mixtral", tmp_path / "mx")
    cfg = ModelConfig(**{k: v for k, v in yaml.safe_load(section_yaml(path))["model"].items()
                         if k != "init_from"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    live = {k: v.detach() for k, v in loaded.state_dict().items()}
    a, b = from_hf(cfg, read_tensors(path)), from_hf(cfg, live)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


EOS = 3  # the word tokenizer's end-of-text id: not 0, so a default id cannot pass for it
WORDS = ["<unk>", "def", "return", "<|endoftext|>", *(f"w{i}" for i in range(252))]


def _word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json of 256 ids (the test models' vocabulary) whose end-of-text
    token is <|endoftext|>, with no begin or padding token of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenized_export(family_run: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[str, Path]:
    """The family run's checkpoint as a run on a tokenizer file (a copy of the run whose
    config.yaml names one: the export reads the tokenizer, not the data), exported under umask
    022; the MoE model sharded, so the shards' modes show too."""
    root = tmp_path_factory.mktemp(f"tok-{family_run['family'].name}")
    tokenizer = _word_tokenizer(root / "tokenizer.json")
    run = root / "run"
    shutil.copytree(family_run["run"], run)
    job = yaml.safe_load((run / "config.yaml").read_text())
    job["data"]["tokenizer"] = str(tokenizer)
    (run / "config.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    shard = ["--max-shard-mb", "0.05"] if family_run["family"].name == "mixtral" else []
    old = os.umask(0o022)
    try:
        done = _cli("export", str(run), "--format", "hf", str(root / "hf"), *shard)
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    assert "end-of-text '<|endoftext|>' (id 3)" in done.stdout
    return {"hf": root / "hf", "tokenizer": tokenizer}


def test_export_files_get_the_umask_mode(tokenized_export: dict[str, Path]) -> None:
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tokenized_export["hf"].iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= modes.keys()
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes


def test_export_carries_the_run_end_of_text_token(tokenized_export: dict[str, Path]) -> None:
    out = tokenized_export["hf"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # The tokenizer has no begin or padding token: both are its end-of-text token.
    for name in ("eos", "bos", "pad"):
        assert (getattr(tok, f"{name}_token"), getattr(tok, f"{name}_token_id")) == \
            ("<|endoftext|>", EOS), name
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for written in (config, generation):
        assert {k: written[f"{k}_token_id"] for k in ("bos", "eos", "pad")} == \
            dict.fromkeys(("bos", "eos", "pad"), EOS)
    assert generation["max_length"] == SEQ


def test_generate_stops_at_the_end_of_text_token(tokenized_export: dict[str, Path]) -> None:
    """transformers' generate, with nothing but the export, stops by itself once the model's
    argmax is the end-of-text token: a head bias on a loaded copy makes it so from the fourth
    new token on (min_new_tokens holds the first three, through the same eos id)."""
    out = tokenized_export["hf"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == tok.eos_token_id == EOS
    assert model.generation_config.max_length == SEQ
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[EOS] = 1e4
    model.set_output_embeddings(biased)
    enc = tok("def return w7 w9", return_tensors="pt")
    prompt, budget = enc["input_ids"], 50
    assert prompt.shape == (1, 4) and EOS not in prompt
    with torch.no_grad():
        ids = model.generate(input_ids=prompt, attention_mask=enc["attention_mask"],
                             max_new_tokens=budget, min_new_tokens=3, do_sample=False)[0]
    new = ids[prompt.shape[1]:].tolist()
    assert new[-1] == EOS and len(new) == 4 < budget, new
    assert EOS not in new[:-1]


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_import_sets_seq_len_from_the_position_count(family: str, tmp_path: Path) -> None:
    """``mcpar import`` reads seq_len from max_position_embeddings (GPT-2: n_positions); a
    Llama run may train on other windows (rotary: no table), a GPT-2 one may not."""
    path = _hf_model(family, tmp_path / family)
    section = yaml.safe_load(section_yaml(path))["model"]
    assert section["seq_len"] == (SEQ if family == "gpt2" else 64)
    hf = json.loads((path / "config.json").read_text())
    other = ModelConfig(**{k: v for k, v in section.items() if k != "init_from"}
                        | {"seq_len": 32})
    refused = section_problems(other, hf)
    if family == "gpt2":  # its position table has n_positions rows
        assert len(refused) == 1 and "model.seq_len" in refused[0], refused
    else:
        assert refused == [], refused


def test_export_of_a_bytes_run_names_no_end_of_text(family_run: dict[str, Path]) -> None:
    """The bytes tokenizer has no end-of-text token: the ids are null, not the architecture's
    defaults (Llama's 2 is a byte here), and no tokenizer is written."""
    out = family_run["hf_out"]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": None, "eos_token_id": None, "max_length": SEQ}
    assert not (out / "tokenizer.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.generation_config.eos_token_id is None
