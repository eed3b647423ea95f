"""Extension points, proven from outside: a gradient codec, a pipeline schedule and a memory
option registered from this file alone (no edit under ``src/``), each accepted by ``mcpar
check`` with its own rules enforced, trained at 2 ranks, priced by the cost model and ranked by
the planner through its registry entry.

- ``topk_ef``: top-k sparsification with error feedback (Stich et al. 2018, Lin et al.'s Deep
  Gradient Compression): each rank adds its error to the bucket, keeps the k largest entries,
  all-gathers their values and indices, and averages the sparse sum; what was not sent is the
  next step's error. Its rules: data-parallel only, flat topology, no ZeRO.
- ``lifo_gpipe``: GPipe whose backwards run last-in first-out (the freshest activations first);
  it prices itself with no formula of its own (the registry's replay of its actions), and its
  rule asks for at least as many micro-batches as stages.
- ``mlp_only``: a recompute policy that rebuilds each block's MLP in the backward pass (its
  inner tensors are not kept; attention's are); its rule refuses MoE models, whose MLP is the
  routed expert layer.

Every consumer meets these names for the first time: a consumer that switched on names would
refuse them, or run its default instead, and the hooks' counters and the measured bytes below
would not move.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli_in_process, spawn_workers, train_in_turn

from mcpar.comm.communicator import CommHandle
from mcpar.config import load_config
from mcpar.controllers.communication.codecs import ExchangeContext, RuntimeCodec
from mcpar.controllers.communication.exchanges import AllReduceExchange, GradExchange
from mcpar.controllers.communication.grad_sync import GradBucket
from mcpar.errors import UserError
from mcpar.launch.env import find_free_port
from mcpar.plan import resolve_plan
from mcpar.registry.codec import CODECS, ExchangeFacts, Wire, WireCost
from mcpar.registry.recompute import (
    RECOMPUTE_POLICIES,
    LayerActivations,
    LayerWork,
    RecomputeFacts,
    RecomputePolicy,
)
from mcpar.registry.schedule import SCHEDULES, Action, PipelineSchedule
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.hardware import cluster_preset, load_accelerators
from mcpar.sim.planner import SearchSpace, plan
from mcpar.sim.workload import Layout, ModelShape

CALLS: Counter[str] = Counter()  # which hook of a plug-in ran (in this process)
KEEP = 0.25  # top-k: the share of each bucket sent


class TopKExchange(AllReduceExchange):
    """The bucket's top-k entries (with this rank's error added), all-gathered and averaged."""

    name = "topk_ef"

    def __init__(self, ctx: ExchangeContext):
        super().__init__(ctx.comm)
        self.errors: dict[int, torch.Tensor] = {}

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        if bucket.expert:
            return super().launch(bucket)
        buffer, comm, degree = bucket.buffer, self.comm, self.degree
        error = self.errors.setdefault(bucket.index, torch.zeros_like(buffer))

        def exchange() -> None:
            corrected = buffer + error
            k = max(1, int(KEEP * corrected.numel()))
            index = corrected.abs().topk(k).indices
            values = corrected[index]
            error.copy_(corrected)
            error[index] = 0.0  # what was sent leaves the error
            summed = torch.zeros_like(buffer)
            for v, i in zip(comm.all_gather(values), comm.all_gather(index), strict=True):
                summed.index_add_(0, i, v)
            buffer.copy_(summed / degree)

        return comm.run_async(exchange)


class TopKCodec(RuntimeCodec):
    name = "topk_ef"
    summary = "top-k sparsification with error feedback"
    strategy = "topk"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        CALLS["codec.problems"] += 1
        out = super().problems(facts)
        if facts.topology != "flat":
            out.append(("topology", "topk_ef gathers every rank's entries over one flat group; "
                        "use topology 'flat'"))
        if facts.zero_stage > 0:
            out.append(("zero_stage", "topk_ef sparsifies whole replicated gradients; use "
                        "zero_stage 0"))
        return out

    def build(self, ctx: ExchangeContext) -> tuple[GradExchange, str]:
        CALLS["codec.build"] += 1
        return TopKExchange(ctx), f"gradient exchange: top-{KEEP:.0%} with error feedback"

    def price(self, wire: Wire) -> WireCost:
        CALLS["codec.price"] += 1
        sent = KEEP * wire.count * (4.0 + 8.0)  # fp32 values and int64 indices
        return WireCost(2 * wire.calls * wire.all_gather(sent / wire.calls),
                        wire.stream(3 * 4.0 * wire.count))

    def error_state_bytes(self, params: float, dp_group: int) -> float:
        CALLS["codec.memory"] += 1
        return 4.0 * params


class LifoGPipe(PipelineSchedule):
    name = "lifo_gpipe"
    summary = "GPipe with last-in first-out backwards"

    def problem(self, pp: int, num_microbatches: int,
                virtual_stages: int) -> tuple[str, str] | None:
        CALLS["schedule.problem"] += 1
        found = super().problem(pp, num_microbatches, virtual_stages)
        if found is None and num_microbatches < pp:
            found = ("gradient_accumulation", f"lifo_gpipe needs at least as many micro-batches "
                     f"as stages ({pp}); raise gradient_accumulation to {pp}")
        return found

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        CALLS["schedule.actions"] += 1
        return ([Action("F", 0, i) for i in range(m)]
                + [Action("B", 0, i) for i in reversed(range(m))])


class MlpRecompute(RecomputePolicy):
    """Each block's MLP runs its forward again in the backward pass."""

    name = "mlp_only"
    summary = "the MLP's inner tensors rebuilt in the backward pass"

    def problems(self, facts: RecomputeFacts) -> list[tuple[str, str]]:
        CALLS["recompute.problems"] += 1
        if facts.is_moe:
            return [("recompute", "mlp_only rebuilds dense MLPs; an MoE layer would route its "
                                  "tokens again; use 'selective'")]
        return []

    def saved(self, acts: LayerActivations) -> tuple[float, float]:
        CALLS["recompute.saved"] += 1
        return acts.full - acts.mlp, acts.mlp

    def recompute_seconds(self, work: LayerWork) -> float:
        CALLS["recompute.cost"] += 1
        return work.mlp

    def targets(self, block: torch.nn.Module) -> list[torch.nn.Module]:
        CALLS["recompute.targets"] += 1
        return [block.get_submodule("mlp")]


@pytest.fixture(scope="module", autouse=True)
def plugins() -> Iterator[None]:
    CODECS.register(TopKCodec())
    SCHEDULES.register(LifoGPipe())
    RECOMPUTE_POLICIES.register(MlpRecompute())
    yield
    CODECS.unregister("topk_ef")
    SCHEDULES.unregister("lifo_gpipe")
    RECOMPUTE_POLICIES.unregister("mlp_only")


BASE = [*TINY, "model.num_layers=2", "training.steps=6", "optimization.micro_batch_size=2",
        "optimization.checkpoint.interval=0", "controllers.memory.consistency_interval=0",
        "optimization.warmup_steps=2"]
DP2 = [*BASE, "parallelism.data=2"]
TOPK = [*DP2, "controllers.communication.compression=topk_ef"]
PP2 = [*BASE, "parallelism.pipeline=2", "model.tie_embeddings=false",
       "optimization.gradient_accumulation=2"]
LIFO = [*PP2, "parallelism.schedule=lifo_gpipe"]
MLP = [*DP2, "controllers.memory.activation_checkpointing=mlp_only"]
MOE = ["model.kind=moe", "model.num_experts=2", "model.top_k=1"]


def _problems(settings: list[str], world: int) -> list[str]:
    try:
        resolve_plan(load_config(None, settings), world)
    except UserError as err:
        return err.problems
    return []


def test_check_accepts_the_plugins_and_enforces_their_rules(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    for settings, shown in ((TOPK, "codec topk_ef"), (LIFO, "(schedule lifo_gpipe)"),
                            (MLP, "recompute=2xmlp_only")):
        proc = run_cli_in_process(capsys, "check", str(empty), "--nproc", "2",
                                  *[a for s in settings for a in ("--set", s)])
        assert proc.returncode == 0, proc.stderr
        assert shown in proc.stdout
    assert _problems([*TOPK, "controllers.communication.topology=hierarchical"], 2) == [
        "controllers.communication.topology: topk_ef gathers every rank's entries over one "
        "flat group; use topology 'flat'"]
    assert any("topk_ef sparsifies whole replicated gradients" in p
               for p in _problems([*TOPK, "controllers.memory.zero_stage=1"], 2))
    # The generic rule every codec but 'none' inherits: nothing to compress at data 1.
    assert any("data 1" in p for p in _problems([*BASE, *TOPK[len(DP2):]], 1))
    refused = _problems([*LIFO, "optimization.gradient_accumulation=1"], 2)
    assert refused == ["optimization.gradient_accumulation: lifo_gpipe needs at least as many "
                       "micro-batches as stages (2); raise gradient_accumulation to 2"]
    before = CALLS["recompute.problems"]
    assert _problems([*MLP, *MOE], 2) == [
        "controllers.memory.activation_checkpointing: mlp_only rebuilds dense MLPs; an MoE "
        "layer would route its tokens again; use 'selective'"]
    assert CALLS["recompute.problems"] > before
    # An unknown name is refused with the registered names, plug-ins included.
    with pytest.raises(UserError, match="'topk_ef'"):
        load_config(None, [*DP2, "controllers.communication.compression=topk"])
    with pytest.raises(UserError, match="'mlp_only'"):
        load_config(None, [*DP2, "controllers.memory.activation_checkpointing=mlp"])


def test_the_memory_estimate_counts_the_codecs_error_buffer() -> None:
    before = CALLS["codec.memory"]
    plain = resolve_plan(load_config(None, DP2), 2).memory.estimate
    topk = resolve_plan(load_config(None, TOPK), 2).memory.estimate
    assert CALLS["codec.memory"] > before
    # 4 bytes per parameter of the rank: the error feedback buffer.
    assert topk.comm_bytes - plain.comm_bytes == 4 * topk.params_per_rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    settings = {"none": DP2, "topk": TOPK, "1f1b": PP2, "lifo": LIFO, "mlp": MLP}
    spawn_workers(train_in_turn, args=(find_free_port(), str(root), settings, 2), nprocs=2)
    return root


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_codec_trains_at_two_ranks_and_sends_what_it_says(runs: Path) -> None:
    plan_json = json.loads((runs / "topk" / "plan.json").read_text())
    assert plan_json["grad_exchange"]["codec"] == "topk_ef"
    assert plan_json["grad_exchange"]["strategy"] == "topk"
    topk, plain = _metrics(runs / "topk"), _metrics(runs / "none")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in topk)
    assert topk[-1]["loss"] < topk[0]["loss"]
    # A different exchange: not the all-reduce's losses, and its own bytes on the data axis:
    # Each rank sends its 1/4 of the entries once per all-gather peer (n - 1 = 1): 4-byte
    # values and 8-byte indices, against the ring all-reduce's 2 (n-1)/n x 4 = 4 bytes per
    # element at n = 2.
    assert [r["loss"] for r in topk[1:]] != [r["loss"] for r in plain[1:]]
    ratio = topk[-1]["comm_bytes_by_axis"]["dp"] / plain[-1]["comm_bytes_by_axis"]["dp"]
    assert ratio == pytest.approx(KEEP * 12 / 4, rel=0.02), ratio


def test_the_schedule_trains_at_two_ranks_with_1f1bs_losses(runs: Path) -> None:
    plan_json = json.loads((runs / "lifo" / "plan.json").read_text())
    assert plan_json["schedule"] == "lifo_gpipe"
    lifo, reference = _metrics(runs / "lifo"), _metrics(runs / "1f1b")
    # The same gradients, accumulated over the micro-batches in another order.
    for a, b in zip(lifo, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_the_memory_option_trains_at_two_ranks_with_the_same_losses(runs: Path) -> None:
    mlp, reference = _metrics(runs / "mlp"), _metrics(runs / "none")
    assert len(mlp) == len(reference) == 6
    # Rebuilding the MLP changes what is kept, not what is computed (dropout replays its RNG).
    for a, b in zip(mlp, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-6)


def test_the_memory_option_builds_through_its_entry() -> None:
    """The runtime asks the entry which modules rerun: each block's MLP, checkpointed."""
    from mcpar.controllers.memory.recompute import apply_recompute
    from mcpar.models.spec import get_model_spec

    cfg = load_config(None, MLP)
    spec = get_model_spec(cfg.model.kind)
    model = spec.build(cfg.model, 0)
    blocks = spec.blocks(model)
    before = CALLS["recompute.targets"]
    assert apply_recompute(blocks, "mlp_only") == len(blocks)
    assert CALLS["recompute.targets"] - before == len(blocks)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    model(x).float().mean().backward()  # the checkpointed MLPs rerun in this backward
    assert all(p.grad is not None for p in blocks[0].get_submodule("mlp").parameters())


def test_the_memory_estimate_prices_the_memory_option() -> None:
    def activations(settings: list[str]) -> int:
        return resolve_plan(load_config(None, settings), 2).memory.estimate.activation_bytes

    before = CALLS["recompute.saved"]
    none, mlp = activations(DP2), activations(MLP)
    full = activations([*DP2, "controllers.memory.activation_checkpointing=full"])
    assert CALLS["recompute.saved"] > before
    assert full < mlp < none


def _small() -> tuple[ModelShape, Layout]:
    cfg = load_config(None, [*PP2, "model.hidden_size=256", "model.num_heads=4",
                             "model.num_layers=4", "optimization.gradient_accumulation=8"])
    return config_model(cfg), config_layout(cfg, 2)


def test_simulate_prices_both_through_their_entries() -> None:
    model, layout = _small()
    cluster = cluster_preset("a100x8", load_accelerators())
    two = replace(cluster, num_gpus=2)
    before = CALLS["schedule.actions"]
    lifo = simulate(model, layout.with_(schedule="lifo_gpipe"), two)
    reference = simulate(model, layout.with_(schedule="gpipe"), two)
    assert CALLS["schedule.actions"] > before  # replayed from its actions
    # Equal stages drain LIFO as fast as GPipe: (m + p - 1) (F + B) either way.
    assert lifo.pipeline_s == pytest.approx(reference.pipeline_s, rel=1e-9)
    eight = replace(cluster, num_gpus=8)
    data = layout.with_(pp=1, dp=8, vp=1, schedule="", global_batch=64, stages=())
    before = CALLS["codec.price"]
    topk = simulate(model, data.with_(compression="topk_ef"), eight)
    plain = simulate(model, data, eight)
    assert CALLS["codec.price"] > before
    assert topk.dp_comm_s != plain.dp_comm_s
    before = CALLS["recompute.cost"]
    none, mlp, full = (simulate(model, data.with_(recompute=r), eight)
                       for r in ("none", "mlp_only", "full"))
    assert CALLS["recompute.cost"] > before
    assert none.step_s < mlp.step_s < full.step_s
    assert full.memory.activations < mlp.memory.activations < none.memory.activations


def test_the_planner_ranks_both_and_keeps_their_rules() -> None:
    m = ModelShape(layers=8, hidden=1024, heads=16, kv_heads=16, ffn=4096, ffn_kind="gelu",
                   vocab=32000, seq_len=1024)
    cluster = cluster_preset("a100x16", load_accelerators())
    space = SearchSpace(cp=(1,), compression=("none", "topk_ef"), zero_stages=(0, 1),
                        schedules=("1f1b", "lifo_gpipe"))
    result = plan(m, cluster, 64, "bf16", space, keep=100)
    ranked = [c.layout for c in result.candidates]
    assert any(lay.compression == "topk_ef" for lay in ranked)
    assert any(lay.schedule == "lifo_gpipe" for lay in ranked)
    assert any(lay.recompute == "mlp_only" for lay in ranked)
    # The memory option's rule: no MoE model is planned with it.
    moe = replace(m, experts=8, top_k=2)
    moe_ranked = [c.layout for c in plan(moe, cluster, 64, "bf16", space, keep=100).candidates]
    assert moe_ranked and not any(lay.recompute == "mlp_only" for lay in moe_ranked)
    # Its own rules, applied by the planner as by check: never hierarchical, never with ZeRO.
    assert all(lay.topology == "flat" and lay.zero_stage == 0
               for lay in ranked if lay.compression == "topk_ef")
    assert all(lay.num_microbatches >= lay.pp for lay in ranked if lay.schedule == "lifo_gpipe")


# --- a model family, registered from this file alone -------------------------------------------
# ``gpt_relu2``: GPT whose MLP is Primer's squared ReLU (So et al. 2021), relu(x)^2 instead of
# GELU, under GPT's own attribute names so that GPT's tensor-parallel plan splits it. Its rule:
# the head stays untied. Every consumer meets the kind for the first time: the config validates
# it through the registry, ``check`` applies its rule, the trainer builds and splits it through
# its entry, ``simulate`` and ``plan`` price it through its ``shape()`` (a relu2 MLP), which
# gives its parameter and FLOP counts too.
from mcpar.config import ModelConfig  # noqa: E402
from mcpar.errors import problem  # noqa: E402
from mcpar.models.gpt import (  # noqa: E402
    GPT,
    GPT_TENSOR_PARALLEL,
    Block,
    gpt_shape,
)
from mcpar.models.plan import ModelPieces  # noqa: E402
from mcpar.models.spec import ModelSpec  # noqa: E402
from mcpar.registry.model_family import MODEL_FAMILIES  # noqa: E402


class ReLU2MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.proj = torch.nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)).square())


class ReLU2Family(ModelSpec):
    name = "gpt_relu2"
    summary = "GPT with a squared-ReLU MLP"
    tensor_parallel = GPT_TENSOR_PARALLEL

    def build(self, cfg: ModelConfig, seed: int) -> torch.nn.Module:
        CALLS["family.build"] += 1
        model = GPT(cfg, block=lambda c: Block(c, mlp=ReLU2MLP))
        model.init_weights(seed)
        return model

    def pieces(self, model: torch.nn.Module) -> ModelPieces:
        return GPT.pieces(model)  # type: ignore[arg-type]

    def problems(self, cfg: ModelConfig) -> list[str]:
        CALLS["family.problems"] += 1
        out = super().problems(cfg)
        if cfg.tie_embeddings:
            out.append(problem("model.tie_embeddings",
                               "gpt_relu2 keeps its head untied; set it to false"))
        return out

    def shape(self, cfg: ModelConfig) -> ModelShape:
        CALLS["family.shape"] += 1
        return replace(gpt_shape(cfg), ffn_kind="relu2")


@pytest.fixture(scope="module", autouse=True)
def family_plugin() -> Iterator[None]:
    MODEL_FAMILIES.register(ReLU2Family())
    yield
    MODEL_FAMILIES.unregister("gpt_relu2")


RELU2 = [*BASE, "model.kind=gpt_relu2"]
RELU2_TP2 = [*RELU2, "parallelism.tensor=2"]


def test_check_accepts_the_family_and_enforces_its_rule(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    before = CALLS["family.problems"]
    proc = run_cli_in_process(capsys, "check", str(empty), "--nproc", "2",
                              *[a for s in RELU2_TP2 for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    assert "model:   gpt_relu2" in proc.stdout
    assert CALLS["family.problems"] > before
    assert _problems([*RELU2, "model.tie_embeddings=true"], 1) == [
        "model.tie_embeddings: gpt_relu2 keeps its head untied; set it to false"]
    # The generic rules still apply, and the registry names the plug-in among the kinds.
    assert any("parallelism.tensor 4" in p for p in _problems([*RELU2, "parallelism.tensor=4",
                                                               "model.num_heads=2"], 4))
    with pytest.raises(UserError, match="'gpt_relu2'"):
        load_config(None, [*BASE, "model.kind=gpt_relu"])


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("family")
    spawn_workers(train_in_turn, args=(find_free_port(), str(root), {"relu2": RELU2_TP2}, 2),
                  nprocs=2)
    return root


def test_the_family_trains_at_two_ranks(family_runs: Path) -> None:
    assert json.loads((family_runs / "relu2" / "plan.json").read_text())["degrees"]["tensor"] == 2
    summary = json.loads((family_runs / "relu2" / "summary.json").read_text())
    cfg = load_config(None, RELU2_TP2).model
    assert summary["num_params"] == MODEL_FAMILIES.get("gpt_relu2").num_params(cfg)
    rows = _metrics(family_runs / "relu2")
    assert len(rows) == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_simulate_and_plan_price_the_family_through_its_shape(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    sets = [a for s in [*RELU2, "model.hidden_size=256", "model.num_heads=4"]
            for a in ("--set", s)]
    before = CALLS["family.shape"]
    proc = run_cli_in_process(capsys, "simulate", str(empty), "--json", "--cluster", "a100x8",
                              *sets)
    assert proc.returncode == 0, proc.stderr
    priced = json.loads(proc.stdout)
    assert priced["model"]["ffn_kind"] == "relu2" and CALLS["family.shape"] > before
    before = CALLS["family.shape"]
    proc = run_cli_in_process(capsys, "plan", str(empty), "--cluster", "a100x8", "--top", "3",
                              *sets)
    assert proc.returncode == 0, proc.stderr
    assert CALLS["family.shape"] > before
    # The planner ranks layouts of its shape as of any other.
    cfg = load_config(None, [*RELU2, "model.hidden_size=256", "model.num_heads=4"])
    result = plan(config_model(cfg), cluster_preset("a100x8", load_accelerators()), 64, "bf16",
                  SearchSpace(cp=(1,)), keep=10)
    assert result.candidates and result.candidates[0].layout.num_gpus == 8
