"""``mcpar check CONFIG``: validate a config and print the resolved plan (layout, mesh, batch,
model, each controller's decisions, memory per rank) without starting anything."""

from __future__ import annotations

import argparse

from mcpar.auto_layout import choose_layout, resolve_job
from mcpar.capabilities import unsupported_settings
from mcpar.commands.config_args import load_args
from mcpar.config import load_config
from mcpar.controllers.memory.estimate import format_bytes, params_per_pipeline_rank
from mcpar.errors import UserError, problem
from mcpar.models.spec import get_model_spec


def cmd_check(args: argparse.Namespace) -> int:
    plan = resolve_job(load_args(args), args.nproc)
    cfg = plan.config
    m, compute, memory, exchange = cfg.model, plan.compute, plan.memory, plan.communication
    spec = get_model_spec(m.kind)
    est = memory.estimate
    lines = [
        f"mcpar check: {args.config} is valid",
        f"layout:  {plan.parallel_dims().describe()}",
        f"mesh:    pp {plan.pp} x dp {plan.dp} x tp {plan.tp} "
        "(tensor innermost within a node, pipeline outermost)",
        f"batch:   {plan.global_batch_size} sequences per step = micro-batch "
        f"{plan.micro_batch_size} x accumulation {plan.num_microbatches} x data {plan.dp}; "
        f"{plan.global_batch_size * m.seq_len} tokens",
        f"model:   {m.kind}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads"
        + (f" ({m.kv_heads} key/value)" if m.family.grouped_query_attention else "") + ", "
        f"ffn {m.ffn_size}, seq {m.seq_len}, vocab {m.vocab_size}"
        + (f", {m.num_experts} experts top-{m.top_k}" if m.is_moe else "")
        + f": {est.num_params:,} parameters, "
        f"{spec.flops_per_token(m) / 1e6:.1f} MFLOPs per training token",
        f"controllers: compute scheduler={compute.balance.scheduler} "
        f"batch_splitting={compute.batch_splitting}; memory allocation="
        f"{'topology_aware' if memory.store.node_cache else 'default'} "
        f"offload={memory.offload.target} zero_stage={memory.zero_stage} recompute="
        + "+".join(f"{memory.recompute.count(mode)}x{mode}"
                   for mode in dict.fromkeys(memory.recompute)) + "; "
        f"communication codec={exchange.codec} topology={exchange.topology} "
        f"weight_gather={memory.store.weight_codec}",
        f"gradient exchange: {exchange.strategy}, {exchange.topology}, codec {exchange.codec}",
        f"pipeline: {len(plan.stage_cut)} stages of blocks "
        + " | ".join(f"{a}-{b - 1}" for a, b in plan.stage_cut)
        + f" (schedule {plan.schedule}"
        + ("" if plan.compute.held_limits is None else
           ", held to 1F1B's activation peak: at most "
           + "/".join(map(str, plan.compute.held_limits)) + " chunk activations per rank")
        + ")" if plan.pp > 1 else "pipeline: none",
        "parameters per rank by pipeline position: "
        + ", ".join(f"{n:,} ({format_bytes(4 * n)})"
                    for n in params_per_pipeline_rank(cfg, plan.parallel_dims()))
        + f" (single process: {est.num_params:,})",
    ]
    if plan.auto is not None:  # the planner's ranking (parallelism.auto)
        lines += plan.auto.report_lines()
    lines += est.report_lines()
    if memory.budget is not None:  # the MemoryController's placement to the budget
        lines += memory.budget.report_lines()
    lines += memory.holdings.report_lines()
    pending = unsupported_settings(cfg)
    if pending:
        lines.append("not trainable with this version yet (mcpar train will refuse):")
        lines += [f"  {p}" for p in pending]
    print("\n".join(lines))
    return 0


def cmd_plan_world(args: argparse.Namespace) -> int:
    """``mcpar plan CONFIG --world N``: the layout ``parallelism.auto`` would train on N workers
    of this machine, and the ranking it was chosen from (what ``mcpar check`` prints)."""
    for flag in ("model", "global_batch"):
        if getattr(args, flag, None) is not None:
            raise UserError(problem(f"--{flag.replace('_', '-')}", "is for the planner of "
                                    "published stacks; with --world the config's own model "
                                    "and batch are planned"))
    if args.world < 1:
        raise UserError(problem("--world", f"must be at least 1, got {args.world}"))
    cfg = load_config(args.config, [*args.overrides, "parallelism.auto=true"])
    print("\n".join(choose_layout(cfg, args.world).report_lines()))
    return 0
