"""The ``model`` section of the job configuration, and the table of published model shapes.

``mcpar.config`` re-exports ``ModelConfig``; it lives here because the model section grew with the
Llama family (grouped-query attention, rotary positions, SwiGLU rounding) and its presets.

``PUBLISHED_MODELS`` is the one table of published shapes in mcpar: ``model.preset`` fills the
model section from it (keys the config sets itself win, so ``preset: llama3-8b`` with
``num_layers: 2`` is a two-layer Llama 3 8B), and the cost model (``mcpar.sim.workload``) builds
its ``--model`` presets from the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mcpar.errors import problem
from mcpar.registry import RegisteredName
from mcpar.registry.model_family import MODEL_FAMILIES, ModelFamily

# Upper bounds of the model's numeric fields (see mcpar.config for the reasoning on bounds).
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 17  # 131072
MAX_FFN = 1 << 20
MAX_SEQ_LEN = 1 << 21  # 2M tokens
MAX_VOCAB = 1 << 24  # 16M; token ids fit a uint32 .bin source
MAX_EXPERTS = 1 << 14


@dataclass(frozen=True)
class PublishedModel:
    """A published model's shape (the ``model`` keys it fills) and how it was trained (the
    batch in sequences and the precision, which only the cost model uses)."""

    kind: str  # a registered model family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int  # of one expert for MoE
    vocab_size: int
    seq_len: int
    global_batch: int
    precision: str
    note: str
    num_experts: int = 1
    top_k: int = 1
    rope_base: float = 10000.0

    def model_keys(self) -> dict[str, Any]:
        """The ``model`` section this preset fills."""
        keys: dict[str, Any] = dict(
            kind=self.kind, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_heads=self.num_heads, ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size, seq_len=self.seq_len)
        family = MODEL_FAMILIES.get(self.kind)
        if family.grouped_query_attention:  # else full multi-head attention
            keys.update(num_kv_heads=self.num_kv_heads)
        if family.rotary_positions:  # else learned positions
            keys.update(rope_base=self.rope_base)
        if family.moe:
            keys.update(num_experts=self.num_experts, top_k=self.top_k)
        return keys


# Shapes from the papers and the released config.json files (rope_theta is the rope base).
PUBLISHED_MODELS: dict[str, PublishedModel] = {
    "gpt3-1.3b": PublishedModel("gpt", 24, 2048, 16, 16, 8192, 51200, 2048, 512, "bf16",
                                "GPT-3 XL shape (Brown et al. 2020)"),
    "gpt3-13b": PublishedModel("gpt", 40, 5120, 40, 40, 20480, 51200, 2048, 1024, "bf16",
                               "GPT-3 13B shape"),
    "gpt3-175b": PublishedModel("gpt", 96, 12288, 96, 96, 49152, 51200, 2048, 1536, "fp16",
                                "GPT-3 175B; batch 1536 as in Narayanan et al. SC21 sec. 5.1"),
    "llama2-7b": PublishedModel("llama", 32, 4096, 32, 32, 11008, 32000, 4096, 1024, "bf16",
                                "Llama 2 7B (4M-token batches)"),
    "llama2-13b": PublishedModel("llama", 40, 5120, 40, 40, 13824, 32000, 4096, 1024, "bf16",
                                 "Llama 2 13B"),
    "llama2-70b": PublishedModel("llama", 80, 8192, 64, 8, 28672, 32000, 4096, 1024, "bf16",
                                 "Llama 2 70B (grouped-query attention, 8 kv heads)"),
    "llama3-8b": PublishedModel("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 512, "bf16",
                                "Llama 3 8B", rope_base=500000.0),
    "llama3-70b": PublishedModel("llama", 80, 8192, 64, 8, 28672, 128256, 8192, 512, "bf16",
                                 "Llama 3 70B", rope_base=500000.0),
    "llama3-405b": PublishedModel("llama", 126, 16384, 128, 8, 53248, 128256, 8192, 2048,
                                  "bf16", "Llama 3 405B", rope_base=500000.0),
    "mixtral-8x7b": PublishedModel("llama_moe", 32, 4096, 32, 8, 14336, 32000, 4096, 1024,
                                   "bf16", "Mixtral 8x7B (MoE: 8 experts, top-2)",
                                   num_experts=8, top_k=2, rope_base=1e6),
}


class ModelConfig(BaseModel):
    # The rules of every config section (mcpar.config._Section): unknown keys are errors, a
    # validated config is frozen, NaN and infinity are refused.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Annotated[str, RegisteredName(MODEL_FAMILIES)] = Field(
        "gpt", description="Model family (a registered one: mcpar.registry.model_family): "
        "dense GPT, its MoE form, Llama (RMSNorm, rotary positions, SwiGLU, grouped-query "
        "attention, no biases) or Llama's MoE form (Mixtral-style SwiGLU experts).")
    preset: Literal[tuple(PUBLISHED_MODELS)] | None = Field(  # type: ignore[valid-type]
        None, description="Fill the model section from a published shape; keys set in the "
        "config win (e.g. fewer layers).")
    num_layers: int = Field(4, ge=1, le=MAX_LAYERS, description="Number of transformer blocks.")
    hidden_size: int = Field(128, ge=8, le=MAX_HIDDEN, description="Width of the residual stream.")
    num_heads: int = Field(
        8, ge=1, le=MAX_HIDDEN, description="Attention heads; must divide hidden_size."
    )
    num_kv_heads: int | None = Field(
        None, ge=1, le=MAX_HIDDEN, description="Llama: key/value heads (grouped-query "
        "attention); must divide num_heads and be divisible by parallelism.tensor; default "
        "num_heads (multi-head attention).",
    )
    ffn_hidden_size: int | None = Field(
        None, ge=1, le=MAX_FFN,
        description="Width of the MLP's inner layer (of one expert for MoE); default 4 x "
        "hidden_size for GPT, Llama's 8/3 x hidden_size rounded up to ffn_multiple_of.",
    )
    ffn_multiple_of: int = Field(
        256, ge=1, le=MAX_FFN, description="Llama: the default ffn_hidden_size is rounded up "
        "to a multiple of this.")
    rope_base: float = Field(
        10000.0, gt=1.0, le=1e12, description="Llama: base of the rotary position embedding's "
        "frequencies (rope_theta; Llama 3 uses 500000).")
    norm_eps: float = Field(
        1e-5, gt=0.0, le=1.0, description="Llama: epsilon of RMSNorm.")
    seq_len: int = Field(
        128, ge=2, le=MAX_SEQ_LEN, description="Tokens per training sequence (context length)."
    )
    vocab_size: int = Field(
        256, ge=2, le=MAX_VOCAB, description="Vocabulary size; 256 for the bytes tokenizer."
    )
    num_experts: int = Field(
        1, ge=1, le=MAX_EXPERTS, description="Experts per MoE layer (model.kind: moe, llama_moe)."
    )
    top_k: int = Field(
        1, ge=1, le=MAX_EXPERTS,
        description="Experts each token is routed to (model.kind: moe, llama_moe).",
    )
    router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="MoE: router scores, softmax over experts (Switch) or a sigmoid "
        "per expert (DeepSeek-V3); with top_k > 1 the chosen scores are renormalized to sum 1.",
    )
    capacity_factor: float | None = Field(
        None, gt=0.0, le=1000.0,
        description="MoE: each expert takes at most capacity_factor x tokens x "
        "top_k / num_experts of a rank's micro-batch, later tokens are dropped (the residual "
        "carries them); None = dropless.",
    )
    aux_loss_coef: float = Field(
        0.0, ge=0.0, le=100.0,
        description="MoE: weight of the Switch-style load-balancing loss, computed "
        "per sequence and averaged (so it is the same for every layout); 0 = off.",
    )
    router_bias_update_rate: float = Field(
        3e-3, ge=0.0, le=1.0,
        description="MoE: auxiliary-loss-free balancing (DeepSeek-V3): after each "
        "step every expert's selection bias moves by this much towards balance, by the sign of "
        "its load error over the global batch; the bias only selects, never weights; 0 = off.",
    )
    shared_expert: bool = Field(
        False, description="MoE: add a dense MLP that every token goes through, beside the "
        "routed experts.",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability; 0 = off.")
    tie_embeddings: bool = Field(
        False, description="Share the token embedding with the output head (pipeline 1 only)."
    )
    init_from: str | None = Field(
        None, min_length=4, max_length=4096,
        description="hf:DIR: a fresh run starts from the weights of a Hugging Face directory "
        "(Llama, Mixtral or GPT-2) instead of the seeded init; the section must describe its "
        "model (`mcpar import DIR` prints it).")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        # An unknown preset is left to the field's own validation, which names the choices.
        preset = data.get("preset") if isinstance(data, dict) else None
        if isinstance(preset, str) and preset in PUBLISHED_MODELS:  # a list is not hashable
            return {**PUBLISHED_MODELS[preset].model_keys(), **data}
        return data

    @property
    def family(self) -> ModelFamily:
        """The registry entry of ``kind``."""
        return MODEL_FAMILIES.get(self.kind)

    @property
    def is_moe(self) -> bool:
        return self.family.moe

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return self.family.default_ffn_size(self)

    def problems(self) -> list[str]:
        """Rules between fields of this section (those that need the layout are in mcpar.plan):
        the family's own (its entry's ``problems``: which keys it reads, e.g. num_kv_heads only
        with grouped-query attention), then the generic ones."""
        out = self.family.problems(self)
        if self.num_heads % self.kv_heads:
            out.append(problem("model.num_kv_heads", f"{self.kv_heads} key/value heads do not "
                               f"divide num_heads {self.num_heads}; use a divisor of it"))
        return out
