"""One memory model: ``mcpar check`` (the runtime's estimate) and ``mcpar simulate`` (the cost
model) print the same per-rank memory for the same config, row by row and byte for byte, over six
layouts; the exact parameter counts and mcpar's stage cut are the simulator's too; and one
layout is worked out by hand, so that the two cannot drift together either."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import run_cli_in_process

from mcpar.config import load_config
from mcpar.controllers.compute.stage_cut import partition_layers as runtime_cut
from mcpar.controllers.memory.estimate import estimate_memory, params_per_pipeline_rank
from mcpar.models.spec import get_model_spec
from mcpar.plan import resolve_plan
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.hardware import LocalProfile, cluster_preset
from mcpar.sim.memory import (
    memory_per_gpu,
    posted_receive_bytes,
    rank_params,
    sending_peers,
)
from mcpar.sim.profilestore import save_profile
from mcpar.sim.stages import partition_layers as sim_cut
from mcpar.sim.workload import Layout, ModelShape

SMALL = {"num_layers": 4, "hidden_size": 128, "num_heads": 8, "seq_len": 128, "vocab_size": 256}

# name -> (config, GPUs). Pipeline layouts run several micro-batches under 1F1B; the big
# vocabulary of "pipeline2" makes mcpar's cost-balanced cut uneven (5 blocks | 1 block + head).
LAYOUTS: dict[str, tuple[dict, int]] = {
    "data4": ({"parallelism": {"data": 4}}, 4),
    "tensor2": ({"parallelism": {"tensor": 2, "data": 2}}, 4),
    "pipeline2-1f1b": ({"model": {"num_layers": 6, "vocab_size": 8192},
                        "parallelism": {"pipeline": 2, "data": 2},
                        "optimization": {"micro_batch_size": 4, "gradient_accumulation": 4}}, 4),
    "tensor2-sp-pipeline2": ({"parallelism": {"tensor": 2, "pipeline": 2, "data": 2,
                                              "sequence_parallel": True},
                              "optimization": {"micro_batch_size": 4,
                                               "gradient_accumulation": 4}}, 8),
    "moe-experts2": ({"model": {"kind": "moe", "num_experts": 4, "top_k": 2,
                                "shared_expert": True},
                      "parallelism": {"experts": 2, "data": 2}}, 2),
    "bf16-zero1": ({"model": {"tie_embeddings": True, "dropout": 0.1},
                    "training": {"dtype": "bfloat16"},
                    "controllers": {"memory": {"zero_stage": 1}},
                    "parallelism": {"data": 4}}, 4),
}


def write_config(tmp_path: Path, name: str) -> tuple[Path, int]:
    body, gpus = LAYOUTS[name]
    body = json.loads(json.dumps(body))
    body["model"] = SMALL | body.get("model", {})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path, gpus


def memory_block(stdout: str) -> list[str]:
    """The header and the seven rows both commands print."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per-rank memory"))
    return lines[start:start + 8]


def row_bytes(block: list[str]) -> dict[str, int]:
    out = {}
    for line in block[1:]:
        match = re.match(r"^  (\S.*?)\s{2,}.*?\s([\d,]+) B$", line)
        assert match, line
        out[match[1]] = int(match[2].replace(",", ""))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_check_and_simulate_print_the_same_memory(name: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, gpus = write_config(tmp_path, name)
    check = run_cli_in_process(capsys, "check", str(path))
    assert check.returncode == 0, check.stderr
    sim = run_cli_in_process(capsys, "simulate", str(path), "--cluster", f"a100x{gpus}")
    assert sim.returncode == 0, sim.stderr
    check_block, sim_block = memory_block(check.stdout), memory_block(sim.stdout)
    assert check_block == sim_block
    rows = row_bytes(check_block)
    assert list(rows) == ["parameters", "gradients", "optimizer state", "activations",
                          "communication buffers", "gathered working set", "total"]
    assert rows["total"] == sum(v for k, v in rows.items() if k != "total") > 0
    # The simulator adds only the GPU's own reserve on top.
    reserve = re.search(r"memory per GPU: [\d.]+ GiB \+ ([\d.]+) reserved", sim.stdout)
    assert reserve and float(reserve[1]) == 2.0

    # The functions behind the two commands agree too, in whole bytes.
    cfg = load_config(str(path))
    plan = resolve_plan(cfg, None)
    est = estimate_memory(plan.config, plan.parallel_dims())
    assert est.rows() == list(rows.items()) == plan.memory.estimate.rows()
    pred = simulate(config_model(cfg), config_layout(cfg, gpus), cluster_preset(f"a100x{gpus}"))
    assert pred.memory.rows() == est.rows()
    assert pred.memory.total == pytest.approx(pred.memory.per_rank + 2 * 2**30)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_simulator_counts_every_parameter_and_cuts_stages_as_the_runtime(
        name: str, tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, name)
    plan = resolve_plan(load_config(str(path)), None)
    cfg, dims = plan.config, plan.parallel_dims()
    model, layout = config_model(cfg), config_layout(cfg, dims.world_size)
    assert model.num_params() == get_model_spec(cfg.model.kind).num_params(cfg.model)
    exact = params_per_pipeline_rank(cfg, dims)
    assert [dense + expert for dense, expert in rank_params(model, layout)] == exact
    stages = dims.pp * cfg.parallelism.virtual_stages
    assert sim_cut(cfg.model, stages) == runtime_cut(cfg.model, stages) == list(plan.stage_cut)


def test_the_runtime_cuts_stages_with_the_cost_models_formula() -> None:
    # One formula, one place: the ComputeController's cut is the cost model's function.
    assert runtime_cut is sim_cut


def test_pipeline_memory_by_hand(tmp_path: Path) -> None:
    """fp32, no dropout, flash attention, 1F1B on pp 2 with 4 micro-batches: the first rank holds
    its 5 blocks (the cut leaves the head's rank one) for min(pp, 4) = 2 micro-batches, each
    block 64 bytes per residual element (16 outside tensor parallelism: two norm inputs and the
    attention and MLP inputs; 48 inside: Q, K, V, projection input, two 4h-wide MLP tensors),
    the two LayerNorms' fp32 statistics (8 bytes per token each) and the flash kernel's fp32
    log-sum-exp (per query and head); 4 + 4 + 8 bytes per parameter. The last rank (one block,
    the head, three fp32 logit-sized tensors of the loss) holds less in all, so the first rank's
    figures are the estimate, with the int64 indices its embeddings' backward keeps and the fp32
    gradient its first backward receives beside them; on CPU, the two receives it keeps posted
    ahead from its peer, each of that gradient's size."""
    path, _ = write_config(tmp_path, "pipeline2-1f1b")
    plan = resolve_plan(load_config(str(path)), None)
    assert [b - a for a, b in plan.stage_cut] == [5, 1]
    b, s, h = 4, 128, 128
    x = b * s * h
    heads = plan.config.model.num_heads
    # The embeddings' int64 indices (token ids, one row of position ids) per micro-batch.
    indices = 2 * 8 * (b * s + s)
    received = 4 * x
    activations = 5 * 2 * (64 * x + 2 * 8 * b * s + 4 * b * heads * s) + indices + received
    params = params_per_pipeline_rank(plan.config, plan.parallel_dims())[0]
    assert plan.memory.estimate.rows() == [("parameters", 4 * params), ("gradients", 4 * params),
                                  ("optimizer state", 8 * params),
                                  ("activations", activations),
                                  ("communication buffers", 2 * received),
                                  ("gathered working set", 0),
                                  ("total", 16 * params + activations + 2 * received)]


def test_autocast_keeps_fp32_weights_and_residual_stream() -> None:
    """mcpar's bfloat16 is autocast: 16 bytes of model state per parameter, as in fp32 (no
    16-bit copy), and the norms keep an fp32 residual stream, the matmul inputs bf16."""
    fp32 = load_config(None, [])
    bf16 = load_config(None, ["training.dtype=bfloat16"])
    m32, m16 = (memory_per_gpu(config_model(c), config_layout(c, 1), reserved=0)
                for c in (fp32, bf16))
    assert (m16.weights, m16.gradients, m16.optimizer) == (m32.weights, m32.gradients,
                                                           m32.optimizer)
    b, s, h, v, heads = 16, 128, 128, 256, 8  # micro-batch, seq, hidden, vocab, heads
    tokens = b * s
    x = tokens * h
    loss = 3 * 4 * tokens * v  # fp32 log-probabilities, the gradient arriving and leaving
    extras = 2 * 8 * tokens + 4 * b * heads * s  # LayerNorm statistics, flash log-sum-exp
    indices = 8 * (tokens + s)  # the token and position embeddings' int64 indices

    def head(a: int) -> int:  # the final norm's fp32 input and statistics, the head's input
        return (4 * h + 8) * tokens + a * tokens * h

    assert m32.activations == 4 * (64 * x + extras) + head(4) + loss + indices
    # bf16 adds autocast's 16-bit weight copies (each layer's matrices and the head's).
    split = config_model(bf16).layer_param_split()[0]
    assert m16.activations == 4 * ((2 * 4 + 2 * 2 + 2 * (1 + 2 + 1) + 2 * 2 * 4) * x + extras
                                    + 2 * split) + head(2) + 2 * v * h + loss + indices


def test_default_simulate_on_this_machine_matches_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mcpar simulate CONFIG`` without --cluster (the 'local' profile, a CPU: no reserve)."""
    profile = LocalProfile(
        cores=2, flops_per_thread=80e9, attention_flops_per_thread=25e9,
        mem_bw_per_thread=12e9, mem_bw_total=20e9, op_overhead_s=8e-5, layer_overhead_s=7e-4,
        collectives={"ar": [2.5e-3, 1e-9], "ag": [2e-3, 8e-10], "rs": [3e-3, 1e-9],
                     "p2p": [1.5e-3, 1e-10]},
        notes={"flops_all_cores": 140e9})
    saved = tmp_path / "profile.json"
    save_profile(profile, saved)  # this machine's: used as it is, not measured again
    monkeypatch.setenv("MCPAR_LOCAL_PROFILE", str(saved))
    path, _ = write_config(tmp_path, "tensor2-sp-pipeline2")
    check = run_cli_in_process(capsys, "check", str(path))
    sim = run_cli_in_process(capsys, "simulate", str(path))
    assert sim.returncode == 0, sim.stderr
    assert memory_block(check.stdout) == memory_block(sim.stdout)
    assert "+ 0.00 reserved by the device" in sim.stdout


def test_posted_receives_by_hand() -> None:
    """On CPU a pipeline rank keeps two receives posted per peer that sends to it: one peer at
    the ends of a one-chunk pipeline and of a V (rank 0 holds stages 0 and 2p-1, both beside
    rank 1's), two inside, and two on every rank when interleaved (rank 0's stage p follows
    rank p-1's). Each is a micro-batch's residual stream (fp32 under autocast); none on CUDA."""
    model = ModelShape(layers=8, hidden=64, heads=4, kv_heads=4, ffn=256, ffn_kind="gelu",
                       seq_len=32, vocab=128)
    stream = 2 * 32 * 64 * 4  # micro-batch 2, fp32
    for schedule, vp, peers in (("1f1b", 1, [1, 2, 2, 1]), ("zbv", 2, [1, 2, 2, 1]),
                                ("interleaved_1f1b", 2, [2, 2, 2, 2])):
        lay = Layout(pp=4, vp=vp, schedule=schedule, micro_batch=2, autocast=True,
                     device="cpu")
        assert [sending_peers(lay, r) for r in range(4)] == peers, schedule
        assert [posted_receive_bytes(model, lay, r) for r in range(4)] == [
            2 * n * stream for n in peers]
        assert posted_receive_bytes(model, dataclasses.replace(lay, device="cuda"), 1) == 0
    two = Layout(pp=2, schedule="1f1b", micro_batch=2, autocast=True, device="cpu")
    assert [sending_peers(two, r) for r in range(2)] == [1, 1]
    assert posted_receive_bytes(model, dataclasses.replace(two, pp=1), 0) == 0
