"""Mixture-of-Experts: the layer's mechanisms in one process, loss parity of expert parallelism
(alone and with data, tensor and pipeline parallelism, and across expert migrations) with the
single-process run, router health under auxiliary-loss-free balancing, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_loss_parity, run_cli_in_process, run_mcpar, sets, train_metrics

from mcpar.config import ModelConfig
from mcpar.metrics import read_metrics
from mcpar.models.moe import Experts, MoELayer, build_moe
from mcpar.models.spec import get_model_spec
from mcpar.parallel.expert import apply_expert_parallel
from mcpar.parallel.stage import whole_model
from mcpar.parallel.tensor import apply_tensor_parallel


def _layer(**kw: object) -> MoELayer:
    cfg = ModelConfig(kind="moe", hidden_size=16, num_heads=2, num_experts=4, top_k=2, **kw)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_experts_run_each_row_through_its_own_expert() -> None:
    experts = _layer().experts
    assert isinstance(experts, Experts)
    tokens = torch.randn(10, 16)
    token_index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 3])
    expert_index = torch.tensor([3, 0, 0, 2, 1, 3, 3, 0, 2, 1, 1, 0])
    out = experts(tokens, token_index, expert_index)
    for i, (t, e) in enumerate(zip(token_index.tolist(), expert_index.tolist(), strict=True)):
        expected = F.gelu(tokens[t] @ experts.fc.weight[e]) @ experts.proj.weight[e]
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)


def test_router_bias_selects_but_never_weights() -> None:
    layer = _layer(router_score="sigmoid")
    x = torch.randn(32, 16)
    _, _, scores = layer.router(x)
    layer.router.expert_bias[2] = 100.0  # expert 2 is chosen by every token ...
    weights, chosen, _ = layer.router(x)
    assert (chosen == 2).any(dim=1).all()
    # ... but weighted by its unbiased score, renormalized over the token's top-k.
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(1, keepdim=True))


def test_capacity_drops_late_tokens_and_counts_them() -> None:
    layer = _layer(capacity_factor=0.5)
    layer.router.expert_bias[1] = 100.0  # every token wants expert 1 first
    x = torch.randn(2, 8, 16)
    out = layer(x)
    # capacity = ceil(0.5 x 16 tokens x 2 / 4) = 4: tokens 4.. of expert 1 are dropped.
    assert layer.step_dropped >= 12
    assert int(layer.step_counts.sum()) == 16 * 2
    dropless = _layer()
    dropless.load_state_dict(layer.state_dict())
    full = dropless(x)
    # The first tokens kept both experts: same output as dropless there; later ones differ.
    torch.testing.assert_close(out.view(16, 16)[:4], full.view(16, 16)[:4])
    assert not torch.allclose(out.view(16, 16)[8:], full.view(16, 16)[8:])


def test_aux_loss_gradient_is_that_of_adding_it_to_the_loss() -> None:
    layer = _layer(aux_loss_coef=0.1)
    layer.aux_grad_scale = 0.5
    x = torch.randn(3, 8, 16)
    layer(x).sum().backward()
    injected = layer.router.gate.weight.grad.clone()

    layer.zero_grad()
    layer.aux_loss_coef = 0.0
    out = layer(x)
    _, experts, scores = layer.router(x.reshape(-1, 16))
    aux = 0.1 * layer._aux_loss(scores, experts, batch=3)
    (out.sum() + 0.5 * aux).backward()
    torch.testing.assert_close(injected, layer.router.gate.weight.grad)
    assert float(aux.detach()) > 0.0


def test_parameter_counts_match_the_model_whole_and_sharded() -> None:
    cfg = ModelConfig(kind="moe", num_layers=2, hidden_size=32, num_heads=4, seq_len=16,
                      num_experts=4, top_k=2, shared_expert=True)
    spec = get_model_spec("moe")
    model = build_moe(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params(cfg)
    assert spec.stage_num_params(cfg, 2, True, True, 1, 1) == spec.num_params(cfg)
    # One rank of tensor 2 x experts 2 (the shards are built without a process group).
    # The stage shares the model's modules: sharding it shards the model in place.
    stage = whole_model(model, spec.pieces)
    apply_tensor_parallel(stage, spec.tensor_parallel, None,  # type: ignore[arg-type]
                          0, 2, sequence_parallel=False)
    apply_expert_parallel(stage, spec.expert_parallel, None, 0, 2, 0, 2)  # type: ignore[arg-type]
    assert model.blocks[0].mlp.experts.fc.weight.shape == (2, 32, 64)
    assert sum(p.numel() for p in model.parameters()) == spec.stage_num_params(
        cfg, 2, True, True, 2, 2)
    assert spec.flops_per_token(cfg) > get_model_spec("gpt").flops_per_token(cfg)


# --- parity with the single-process run ---------------------------------------------------------
STEPS = 20
MODEL = [
    "model.kind=moe", "model.num_experts=4", "model.top_k=2", "model.shared_expert=true",
    "model.aux_loss_coef=0.01", "model.num_layers=2", "model.hidden_size=32",
    "model.num_heads=4", "model.seq_len=32", "training.progress=false",
    "training.eval_interval=0", "training.eval_batches=1", "optimization.warmup_steps=5",
    f"training.steps={STEPS}", "optimization.global_batch_size=8",
]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "experts2": (2, ["parallelism.experts=2", "optimization.micro_batch_size=4"]),
    "experts4": (4, ["parallelism.experts=4", "optimization.micro_batch_size=2"]),
    "experts2_tensor2": (4, ["parallelism.experts=2", "parallelism.tensor=2",
                             "optimization.micro_batch_size=4"]),
    "experts2_pipeline2": (4, ["parallelism.experts=2", "parallelism.pipeline=2",
                               "optimization.micro_batch_size=2"]),
    # Data 4 = 2 expert groups of 2: expert weights reduced over their replicas; the greedy
    # balancer migrates experts every 2 steps, which must not change the losses.
    "experts2_data4_migrating": (4, ["parallelism.experts=2", "optimization.micro_batch_size=2",
                                     "controllers.compute.scheduler=greedy",
                                     "controllers.compute.balance_interval=2"]),
}


def _train(run_dir: Path, nproc: int, settings: list[str]) -> list[dict]:
    return train_metrics(run_dir, nproc, [*MODEL, *settings])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("moe_ref") / "run", 1,
                  ["optimization.micro_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_loss_parity(reference: list[dict], name: str, tmp_path: Path) -> None:
    nproc, settings = LAYOUTS[name]
    records = _train(tmp_path / name, nproc, settings)
    assert len(records) == STEPS
    assert_loss_parity(reference, records, name)
    for ref, rec in zip(reference, records, strict=True):
        # Routing is the same function of the same tokens: the same counts per expert.
        assert ([layer["tokens_per_expert"] for layer in rec["moe"]["layers"]]
                == [layer["tokens_per_expert"] for layer in ref["moe"]["layers"]])
    # Tokens cross the expert axis by all-to-all, counted by the CommunicationController.
    assert all(rec["comm_bytes_by_axis"].get("ep", 0) > 0 for rec in records)
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["layout"]["experts"] == int(settings[0].split("=")[1])
    if name.endswith("migrating"):
        assert records[-1]["moe"]["migrations_total"] > 0
        assert all(rec["comm_bytes_by_axis"].get("edp", 0) > 0 for rec in records)
        assert (tmp_path / name / "load_balance.jsonl").read_text().strip()


@pytest.mark.slow
def test_aux_loss_free_balancing_keeps_every_expert_under_twice_the_mean(
        tmp_path: Path) -> None:
    """200 steps on the default corpus with the bias balancing on (its default) and no
    auxiliary loss: no expert of any layer gets more than 2x the mean load, at the last step
    and over the last 10 steps. (With the balancing off, router_bias_update_rate 0, the same
    run ends with an expert at 3.7x the mean.)"""
    settings = ["model.kind=moe", "model.num_experts=8", "model.top_k=2", "model.num_layers=2",
                "model.hidden_size=64", "model.num_heads=4", "model.seq_len=64",
                "training.steps=200", "training.progress=false",
                "optimization.micro_batch_size=8", "training.eval_interval=0",
                "training.eval_batches=1"]
    proc = run_mcpar("train", *sets(*settings), "--nproc", "1", "--run-dir",
                     str(tmp_path / "run"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 200
    assert records[-1]["moe"]["max_expert_load_ratio"] <= 2.0
    window = np.array([[layer["tokens_per_expert"] for layer in r["moe"]["layers"]]
                       for r in records[-10:]]).sum(axis=0)
    assert (window / window.mean(axis=1, keepdims=True)).max() <= 2.0


# --- refusals -----------------------------------------------------------------------------------
CHECK_ERRORS = {
    "experts_do_not_divide": (["model.kind=moe", "model.num_experts=6", "parallelism.data=4",
                               "parallelism.experts=4"], "model.num_experts: 6 experts are not "
                              "divisible by parallelism.experts 4"),
    "expert_axis_does_not_divide_data": (["model.kind=moe", "model.num_experts=6",
                                          "parallelism.data=4", "parallelism.experts=3"],
                                         "parallelism.experts: expert degree 3 does not divide "
                                         "the data degree 4"),
    "top_k_too_large": (["model.kind=moe", "model.num_experts=4", "model.top_k=5"],
                        "model.top_k: top_k 5 is larger than num_experts 4"),
    "sequence_parallel": (["model.kind=moe", "model.num_experts=4", "parallelism.tensor=2",
                           "parallelism.sequence_parallel=true"],
                          "parallelism.sequence_parallel: is not supported with model.kind"),
}
TRAIN_ERRORS = {
    "experts_without_moe": (["parallelism.experts=2"],
                            "parallelism.experts: 2 needs a model with experts"),
    "balancer_without_expert_ranks": (["model.kind=moe", "model.num_experts=4",
                                       "controllers.compute.scheduler=greedy"],
                                      "controllers.compute.scheduler: 'greedy' balances"),
    "compression_with_experts": (["model.kind=moe", "model.num_experts=4",
                                  "parallelism.experts=2",
                                  "controllers.communication.compression=1bit"],
                                 "controllers.communication.compression: gradient compression "
                                 "is not supported with parallelism.experts > 1"),
}


@pytest.mark.parametrize("name", list(CHECK_ERRORS))
def test_check_refuses_impossible_expert_layouts(name: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    settings, message = CHECK_ERRORS[name]
    config = tmp_path / "moe.yaml"
    config.write_text("{}\n")
    proc = run_cli_in_process(capsys, "check", str(config), *sets(*settings))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", list(TRAIN_ERRORS))
def test_train_refuses_expert_settings_it_cannot_honour(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings, message = TRAIN_ERRORS[name]
    proc = run_cli_in_process(capsys, "train", *sets(*settings), "--nproc", "2", "--run-dir",
                              str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_example_config_checks_and_would_train(capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "check", "configs/moe.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "experts 2 within the data axis" in proc.stdout
    assert "8 experts top-2" in proc.stdout
    assert "not trainable" not in proc.stdout
