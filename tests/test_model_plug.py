"""The model plug point: a model family plugs in through its registry entry (a ModelSpec) alone.

``Plug`` is a small pre-norm transformer whose attribute names are none of GPT's, laid out like
TorchTitan's Llama: ``tok_embeddings`` (the bare table), ``layers`` of ``attention`` (separate
``wq``/``wk``/``wv``, ``wo``, head count in ``n_heads``) and ``feed_forward`` (a SwiGLU whose
``w_in`` fuses gate|up, and ``w_out``), RMSNorms ``attention_norm``/``ffn_norm``, then ``norm`` and
``output`` at the top level (the spec wraps them into one head piece); its MoE variant routes
each token to one of the experts ``routed.w_up``/``w_down`` by a ``gate``. The specs are
registered under test-only kinds inside the workers, and the real ``parallelize`` builds the
model at tensor 2 (with and without sequence parallelism), at pipeline 2 and (the MoE variant)
at experts 2, in gloo worker processes; every layout trains a few SGD steps and must match the
single-process run: losses within 1e-4 (DESIGN.md §5), first-step gradients and final parameters
within 1e-5. Had parallel/ kept any of GPT's attribute names, it could not shard, cut or spread
this model at all.

A static check beside it: src/mcpar/parallel/ imports nothing from mcpar.models (but for
parallelize.py, the wiring point, which looks the spec up) and names no attribute of the built-in
models (the names are read off a built GPT and MoE).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import spawn_workers
from torch import nn

from mcpar.config import ModelConfig, apply_overrides, parse_config
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.launch.env import find_free_port
from mcpar.models.plan import (
    BlockPlan,
    ColumnParallel,
    EmbeddingPlan,
    ExpertPlan,
    ExpertWeight,
    ModelPieces,
    OutputPlan,
    TensorParallelPlan,
)
from mcpar.models.spec import ModelSpec, get_model_spec
from mcpar.parallel.expert import is_expert_sharded
from mcpar.parallel.parallelize import parallelize
from mcpar.parallel.tensor import is_tp_sharded, sync_sequence_parallel_grads
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.topology import ParallelDims

KIND, MOE_KIND = "plug_test", "plug_test_moe"
LAYERS, HIDDEN, HEADS, FFN, SEQ, VOCAB, BATCH, EXPERTS = 2, 32, 4, 48, 16, 64, 4, 4
SEED, STEPS, LR = 5, 4, 0.5
CFG = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
                  ffn_hidden_size=FFN, seq_len=SEQ, vocab_size=VOCAB)
MOE_CFG = CFG.model_copy(update={"num_experts": EXPERTS})


# --- the model, with names of its own ------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_heads
        h = cfg.hidden_size
        self.wq, self.wk = nn.Linear(h, h), nn.Linear(h, h, bias=False)
        self.wv, self.wo = nn.Linear(h, h, bias=False), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        # Shapes from the projections: under sequence parallelism x holds a slice of the sequence.
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)  # gate | up
        self.w_out = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


def expert_swiglu(rows: torch.Tensor, counts: list[int], w_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert, ``counts[i]`` of them for expert i (the plan's ``compute``)."""
    return torch.cat([F.silu(piece @ w_up[i]) @ w_down[i]
                      for i, piece in enumerate(rows.split(counts))])


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_up = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.ffn_size))
        self.w_down = nn.Parameter(torch.empty(cfg.num_experts, cfg.ffn_size, cfg.hidden_size))

    def forward(self, tokens: torch.Tensor, token_index: torch.Tensor,
                expert_index: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert_index, stable=True)
        counts = torch.bincount(expert_index, minlength=self.w_up.shape[0]).tolist()
        out = expert_swiglu(tokens[token_index[order]], counts, self.w_up, self.w_down)
        return out[torch.argsort(order)]


class MoEFeedForward(nn.Module):
    """Top-1 routing, the chosen expert's output weighted by its gate probability."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.routed = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weight, expert = self.gate(tokens).softmax(-1).max(-1)
        out = self.routed(tokens, torch.arange(tokens.shape[0]), expert)
        return (out * weight.unsqueeze(-1)).view_as(x)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden_size)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size)
        self.feed_forward = MoEFeedForward(cfg) if cfg.num_experts > 1 else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Plug(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class FinalHead(nn.Module):
    """The top-level ``norm`` and ``output`` as one pipeline piece (the same modules)."""

    def __init__(self, norm: nn.Module, output: nn.Module):
        super().__init__()
        self.norm, self.output = norm, output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))


def build_plug(cfg: ModelConfig, seed: int) -> Plug:
    model = Plug(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def plug_pieces(model: nn.Module) -> ModelPieces:
    return ModelPieces(model.tok_embeddings, list(model.layers),
                       FinalHead(model.norm, model.output), ("tok_embeddings", "layers", "final"))


PLUG_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=EmbeddingPlan(vocab=""),  # the piece is the table itself
    block=BlockPlan(
        column=(ColumnParallel("attention.wq"), ColumnParallel("attention.wk"),
                ColumnParallel("attention.wv"), ColumnParallel("feed_forward.w_in", fused=2)),
        row=("attention.wo", "feed_forward.w_out"),
        norms=("attention_norm", "ffn_norm"),
        heads=("attention.n_heads",),
    ),
    output=OutputPlan(projection="output", norms=("norm",)),
)


class PlugSpec(ModelSpec):
    """The family entry: its module, its pieces and its plans (the counts are not needed by
    parallelize)."""

    def __init__(self, name: str, tensor_parallel: TensorParallelPlan | None = None,
                 expert_parallel: ExpertPlan | None = None):
        self.name, self.moe = name, expert_parallel is not None
        self.tensor_parallel, self.expert_parallel = tensor_parallel, expert_parallel

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        return build_plug(cfg, seed)

    def pieces(self, model: nn.Module) -> ModelPieces:
        return plug_pieces(model)

    def _unused(self, *_: object) -> Any:
        raise AssertionError("not needed by parallelize")

    num_params = stage_num_params = flops_per_token = shape = _unused


PLUG_SPEC = PlugSpec(KIND, tensor_parallel=PLUG_TENSOR_PARALLEL)
PLUG_MOE_SPEC = PlugSpec(
    MOE_KIND,
    expert_parallel=ExpertPlan(
        layers=lambda block: [m for m in block.modules() if isinstance(m, MoEFeedForward)],
        routed="routed",
        weights=(ExpertWeight("w_up", width_dim=2), ExpertWeight("w_down", width_dim=1)),
        compute=expert_swiglu,
    ),
)


# --- training: the single-process reference and the parallel layouts ----------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, each followed by a fixed function of itself: learnable in a few steps."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, (3 * tokens + 1) % VOCAB


def train_reference(cfg: ModelConfig) -> dict:
    model = build_plug(cfg, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


LAYOUTS = {  # name -> (kind, tensor, pipeline, experts, sequence_parallel)
    "tensor2": (KIND, 2, 1, 1, False),
    "tensor2_sp": (KIND, 2, 1, 1, True),
    "pipeline2": (KIND, 1, 2, 1, False),
    "experts2": (MOE_KIND, 1, 1, 2, False),  # data 2, each rank half the batch and experts
}


def full_name(local: str, first_layer: int) -> str:
    """A stage's parameter name -> the Plug model's (blocks renumbered, head piece unwrapped)."""
    if local.startswith("layers."):
        _, index, rest = local.split(".", 2)
        return f"layers.{first_layer + int(index)}.{rest}"
    return local.removeprefix("final.")


def average_over_data(params: list[nn.Parameter], dp: int) -> None:
    """The data-parallel gradient exchange, by hand: each rank's loss is a mean over its half
    of the batch; an expert's gradient already holds both halves' tokens (the backward
    all-to-all brought them), every other gradient is summed over the ranks."""
    for p in params:
        if not is_expert_sharded(p):
            dist.all_reduce(p.grad)
        p.grad /= dp


def train_layout(rank: int, kind: str, tp: int, pp: int, ep: int, sp: bool) -> dict:
    dp = 2 // (tp * pp)
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, world_size=2)
    dims.build_mesh("cpu")
    comm = CommunicationController(dims)
    experts = EXPERTS if kind == MOE_KIND else 1
    cfg = parse_config(apply_overrides({}, [
        f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", f"model.num_heads={HEADS}",
        f"model.ffn_hidden_size={FFN}", f"model.seq_len={SEQ}", f"model.vocab_size={VOCAB}",
        f"model.num_experts={experts}", f"training.seed={SEED}",
        f"parallelism.sequence_parallel={str(sp).lower()}"]))
    # The kind is not one the schema knows: set it past validation, as a plugin would be found.
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"kind": kind})})
    ranges = [(0, LAYERS)] if pp == 1 else [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    pm = parallelize(cfg, dims, comm, torch.device("cpu"), ranges)
    chunk = pm.chunks[0]
    optimizer = torch.optim.SGD(pm.params, lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        tokens, targets = batch(step)
        if dp > 1:
            tokens, targets = tokens.chunk(dp)[rank], targets.chunk(dp)[rank]
        if pp == 1:
            loss = pm.loss_fn(chunk(tokens), targets)
            loss.backward()
            sync_sequence_parallel_grads(pm.params, comm)
            if dp > 1:
                average_over_data(pm.params, dp)
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= dp
            losses.append(loss.item())
        elif chunk.is_first:  # a one-micro-batch pipeline, by hand
            activations = chunk(tokens)
            dist.send(activations.detach().contiguous(), dst=1)
            grad = torch.empty_like(activations)
            dist.recv(grad, src=1)
            activations.backward(grad)
        else:
            received = torch.empty(BATCH, SEQ, HIDDEN)
            dist.recv(received, src=0)
            received.requires_grad_(True)
            loss = pm.loss_fn(chunk(received), targets)
            loss.backward()
            dist.send(received.grad.contiguous(), dst=0)
            losses.append(loss.item())
        if step == 0:
            grads = {full_name(n, chunk.first_layer): p.grad.clone()
                     for n, p in chunk.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    named = dict(chunk.named_parameters())
    return {"losses": losses, "grads": grads,
            "params": {full_name(n, chunk.first_layer): p.detach().clone()
                       for n, p in named.items()},
            "sharded": {full_name(n, chunk.first_layer) for n, p in named.items()
                        if is_tp_sharded(p) or is_expert_sharded(p)}}


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    # This worker only: the family entry is all mcpar learns of the model.
    MODEL_FAMILIES.register(PLUG_SPEC)
    MODEL_FAMILIES.register(PLUG_MOE_SPEC)
    try:
        results = {name: train_layout(rank, *layout) for name, layout in LAYOUTS.items()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    """(the single-process references by kind, every rank's results by layout)."""
    out_dir = tmp_path_factory.mktemp("plug")
    spawn_workers(worker, args=(2, find_free_port(), str(out_dir)), nprocs=2, join=True)
    references = {KIND: train_reference(CFG), MOE_KIND: train_reference(MOE_CFG)}
    return references, [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


def assemble(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the tensor ranks' slices, as the plan splits it."""
    if name.endswith("feed_forward.w_in.weight"):  # gate | up, each split on its own
        halves = [s.view(2, s.shape[0] // 2, -1) for s in shards]
        return torch.cat(halves, dim=1).reshape(-1, halves[0].shape[-1])
    if name.endswith(("attention.wo.weight", "feed_forward.w_out.weight")):
        return torch.cat(shards, dim=1)  # row-parallel: input columns
    return torch.cat(shards, dim=0)  # column-parallel outputs, vocabulary rows


def expected_sharded(names: set[str]) -> set[str]:
    column = ("wq.weight", "wq.bias", "wk.weight", "wv.weight", "w_in.weight", "wo.weight",
              "w_out.weight")
    return {n for n in names if n.endswith(column)} | {"tok_embeddings.weight", "output.weight"}


@pytest.mark.parametrize("name", ["tensor2", "tensor2_sp"])
def test_tensor2_matches_the_single_process_run(runs: tuple[dict, list[dict]],
                                                name: str) -> None:
    reference, ranks = runs[0][KIND], runs[1]
    results = [r[name] for r in ranks]
    for r in results:
        assert len(r["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(r["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= 1e-4, (name, step, got, want)
    assert reference["losses"][-1] < reference["losses"][0] - 0.1  # it really trained
    sharded = expected_sharded(set(reference["params"]))
    assert results[0]["sharded"] == sharded  # the plan's modules, and only those, were split
    for key in ("grads", "params"):
        assert set(results[0][key]) == set(reference[key])
        for param, want in reference[key].items():
            got = (assemble(param, [r[key][param] for r in results]) if param in sharded
                   else results[0][key][param])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} {key} {param}")
            if param not in sharded:
                torch.testing.assert_close(results[1][key][param], got, atol=1e-6, rtol=0)


def test_pipeline2_matches_the_single_process_run(runs: tuple[dict, list[dict]]) -> None:
    reference, ranks = runs[0][KIND], runs[1]
    first, last = ranks[0]["pipeline2"], ranks[1]["pipeline2"]
    assert first["losses"] == [] and len(last["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(last["losses"], reference["losses"], strict=True)):
        assert abs(got - want) <= 1e-4, (step, got, want)
    # Each stage holds its own pieces: the table and layer 0, then layer 1 and the head.
    assert {n.split(".")[0] for n in first["params"]} == {"tok_embeddings", "layers"}
    assert {n.split(".")[0] for n in last["params"]} == {"layers", "norm", "output"}
    for key in ("grads", "params"):
        merged = {**first[key], **last[key]}
        assert set(merged) == set(reference[key])
        for param, want in reference[key].items():
            torch.testing.assert_close(merged[param], want, atol=1e-5, rtol=0,
                                       msg=f"pipeline2 {key} {param}")


def test_experts2_matches_the_single_process_run(runs: tuple[dict, list[dict]]) -> None:
    reference, ranks = runs[0][MOE_KIND], runs[1]
    results = [r["experts2"] for r in ranks]
    for r in results:
        for step, (got, want) in enumerate(zip(r["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= 1e-4, (step, got, want)
    assert reference["losses"][-1] < reference["losses"][0] - 0.1
    # Each rank holds half of every layer's experts, under their names in the full model.
    routed = {n for n in reference["params"] if ".routed." in n}
    assert len(routed) == 2 * LAYERS and results[0]["sharded"] == routed
    for key in ("grads", "params"):
        for param, want in reference[key].items():
            got = (torch.cat([r[key][param] for r in results]) if param in routed
                   else results[0][key][param])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"experts2 {key} {param}")


# --- static: parallel/ names nothing of the built-in models -------------------------------------
PARALLEL = Path(__file__).resolve().parents[1] / "src" / "mcpar" / "parallel"


def builtin_model_names() -> set[str]:
    """Names of the built-in models' modules, parameters, buffers and own attributes, read off a
    built GPT and MoE (PyTorch's generic ``weight`` / ``bias`` and its own modules' attributes
    excluded)."""
    names: set[str] = set()
    base = set(vars(nn.Module()))
    for kind, extra in (("gpt", {}), ("moe", {"num_experts": 2, "top_k": 1,
                                             "shared_expert": True})):
        cfg = ModelConfig(kind=kind, num_layers=1, hidden_size=8, num_heads=2, seq_len=4,
                          vocab_size=16, **extra)
        model = get_model_spec(kind).build(cfg, 0)
        for path, module in model.named_modules():
            names.add(path.rsplit(".", 1)[-1])
            if type(module).__module__.startswith("mcpar.models"):
                names |= {k for k in vars(module) if not k.startswith("_") and k not in base}
        for path, _ in [*model.named_parameters(), *model.named_buffers()]:
            names.add(path.rsplit(".", 1)[-1])
    return {n for n in names if n and not n.isdigit()} - {"weight", "bias"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def model_references(source: str, names: set[str], allowed: frozenset[str] = frozenset()
                     ) -> list[str]:
    """Imports of mcpar.models (other than the modules ``allowed``), attribute accesses
    ``x.<name>`` and string paths with a ``<name>`` component (``getattr(x, "attn")``,
    ``"mlp.fc"``) in a module's code."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mcpar.models")
                and node.module not in allowed):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("mcpar.models") and a.name not in allowed]
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and set(node.value.split(".")) & names):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_static_check_sees_a_reach_into_gpt() -> None:
    names = builtin_model_names()
    assert {"attn", "qkv", "mlp", "fc", "embed", "blocks", "head", "tok", "pos", "ln_final",
            "out", "experts", "router", "num_heads"} <= names
    reach = ("from mcpar.models.gpt import MLP\n"
             "def f(module):\n    module.head.out = getattr(module, 'blocks')\n"
             "    return resolve(module, 'mlp.fc')\n")
    assert len(model_references(reach, names)) == 5


@pytest.mark.parametrize("path", sorted(PARALLEL.glob("*.py")), ids=lambda p: p.name)
def test_parallel_names_no_model_attribute(path: Path) -> None:
    # parallelize.py is where model.kind meets the mechanisms: it may look the spec up.
    allowed = frozenset({"mcpar.models.spec"} if path.name == "parallelize.py" else ())
    found = model_references(path.read_text(), builtin_model_names(), allowed)
    assert not found, f"{path.name} reaches into the model: {found}"


def test_the_expert_plans_name_their_family_functions() -> None:
    """The MoE families' expert plans hold their torch functions by name (so that the entries
    load without torch); each name resolves to the family's own function."""
    from mcpar.models.llama.model import swiglu_experts
    from mcpar.models.llama.plans import LLAMA_MOE_EXPERTS
    from mcpar.models.moe.model import expert_mlps, moe_layers
    from mcpar.models.moe.plans import MOE_EXPERTS

    for plan, compute in ((MOE_EXPERTS, expert_mlps), (LLAMA_MOE_EXPERTS, swiglu_experts)):
        assert plan.layers.resolve() is moe_layers  # type: ignore[attr-defined]
        assert plan.compute.resolve() is compute  # type: ignore[attr-defined]
