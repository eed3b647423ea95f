"""An mcpar job config (``JobConfig``) as the simulator's model shape and layout.

The model is its family's ``shape`` (``model.kind``'s registry entry, ``mcpar.registry.
model_family``): the family says its attention, its MLP, its biases, its position table and
experts, so that the simulator counts every parameter a rank holds as the family does, for a
plug-in family as for the built-ins. The layout carries mcpar's stage cut (``stages``) and its
mixed precision (autocast: fp32 weights), so that ``mcpar check`` (``controllers.memory.
estimate``) and ``mcpar simulate`` price the same memory from the same mapping. Settings the
cost model does not price (offload, the expert scheduler, dynamic batch splitting) are returned
as notes, so the CLI says so instead of ignoring them silently.
"""

from __future__ import annotations

from dataclasses import replace

from mcpar.config import JobConfig
from mcpar.device_kernels import attention_kernel, run_device_type
from mcpar.errors import UserError, problem
from mcpar.registry import LAYOUT_KEYS
from mcpar.sim.stages import stage_sizes
from mcpar.sim.workload import Layout, ModelPreset, ModelShape
from mcpar.topology import replica_ranks

# Layout field -> the config key a problem with it should name (one table, the registry's).
CONFIG_KEYS = LAYOUT_KEYS
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def config_model(cfg: JobConfig) -> ModelShape:
    """The config's model, as its family's registry entry shapes it."""
    return cfg.model.family.shape(cfg.model)


def config_layout(cfg: JobConfig, num_gpus: int, preset: ModelPreset | None = None,
                  precision: str | None = None) -> Layout:
    """The layout of `cfg` on `num_gpus` devices. The global batch is the config's
    ``global_batch_size``, else micro-batch x ``gradient_accumulation`` x data when the
    accumulation is set, else (with a model preset) the preset's batch. The config's own model
    gets mcpar's stage cut and autocast; a preset model (a published stack) gets the even split
    and 16-bit weight copies."""
    par, mem, com, opt = (cfg.parallelism, cfg.controllers.memory, cfg.controllers.communication,
                          cfg.optimization)
    tp, pp = par.tensor, par.pipeline
    dp = par.data
    if dp is None:
        per_replica = replica_ranks(tp, pp, par.context)
        if num_gpus % per_replica:
            raise UserError(problem("parallelism", f"{num_gpus} GPUs cannot be split into tensor "
                                                   f"{tp} x pipeline {pp} x context "
                                                   f"{par.context} groups"))
        dp = num_gpus // per_replica
    if opt.global_batch_size is not None:
        global_batch = opt.global_batch_size
    elif preset is not None and opt.gradient_accumulation is None:
        global_batch = preset.global_batch
    else:
        global_batch = opt.micro_batch_size * (opt.gradient_accumulation or 1) * dp
    topology = {"flat": "flat", "hierarchical": "hierarchical", "hybrid": "auto"}[com.topology]
    # The device's kernels keep different tensors only under dropout, and its backend posts a
    # pipeline's receives ahead only on CPU (``device_kernels.py``), so only then is 'auto'
    # resolved (which asks torch); otherwise the layout keeps the default, which keeps what
    # CPU's would. A preset is a published GPU run.
    dropout = preset is None and cfg.model.dropout > 0
    resolved = dropout or (preset is None and pp > 1)
    device = run_device_type(cfg.training.device) if resolved else "cuda"
    attention = "math" if attention_kernel(device, dropout) == "math" else "auto"
    return Layout(
        tp=tp, pp=pp, vp=par.virtual_stages, cp=par.context,
        context_mode=par.context_mode if preset is None else "flash_ring", dp=dp, ep=par.experts,
        zero_stage=mem.zero_stage, seq_parallel=par.sequence_parallel,
        global_batch=global_batch, micro_batch=opt.micro_batch_size,
        recompute=mem.activation_checkpointing,
        precision=precision or PRECISION[cfg.training.dtype],
        schedule=par.schedule,
        compression=com.compression, topology=topology, bucket_mb=com.bucket_size_mb,
        allocation=mem.allocation, weight_gather=com.weight_gather, gather_mb=mem.gather_mb,
        # mcpar's pipeline sends whole activations (a sequence shard under SP), fp32 or bf16.
        p2p_split=par.sequence_parallel,
        autocast=preset is None,
        stages=_stage_cut(cfg, pp * par.virtual_stages) if preset is None else (),
        attention=attention, device=device,
        post_validation=preset is None and opt.post_validation,
    )


def _stage_cut(cfg: JobConfig, num_stages: int) -> tuple[int, ...]:
    """mcpar's cut, or none when the model has too few layers (``layout_problems`` says so)."""
    if not 1 <= num_stages <= cfg.model.num_layers:
        return ()
    return stage_sizes(cfg.model, num_stages)


def unpriced_settings(cfg: JobConfig) -> list[str]:
    """Settings of `cfg` the cost model does not price, as notes."""
    ctl = cfg.controllers
    notes = []
    for key, value, default in (
        ("controllers.memory.offload", ctl.memory.offload, "none"),
        ("controllers.compute.scheduler", ctl.compute.scheduler, "static"),
        ("controllers.compute.batch_splitting", ctl.compute.batch_splitting, "fixed"),
    ):
        if value != default:
            notes.append(f"{key}={value!r} is not priced by the cost model (simulated as "
                         f"{default!r})")
    return notes


def with_preset(model: ModelShape, preset: ModelPreset | None) -> ModelShape:
    return replace(preset.shape) if preset is not None else model
