"""``training.elastic``: the plan of a job that goes on with fewer workers than its layout asks.

When a node is lost for good, ``torchrun --nnodes MIN:MAX`` re-rendezvouses the nodes that are
left and starts their workers again with a smaller ``WORLD_SIZE``. ``elastic_layout`` is the one
decision this takes (``resolve_plan`` calls it first, so ``mcpar check``, the launcher and every
worker decide alike): the tensor, pipeline, context and expert degrees stay, the data degree
shrinks to what the world holds, and the micro-batches per step grow so that the global batch,
and with it the sequences of every step (DESIGN §4), stays exactly the same. The job then
resumes from its newest valid checkpoint, resharded onto the new layout, and rank 0 appends an
``elastic`` record to recovery.jsonl (``resize_record``) naming both layouts and the step.

A node that comes back grows the job again (``training.elastic.grow``): its agent joins the
rendezvous, the agents open a round on the larger world and stop their workers, which save a
checkpoint of the step they were in (SIGTERM); the larger world resumes it resharded onto the
asked layout, and the same record says so (``direction: grow``). The returning node's workers
are a first start to their agent (restart count 0) while the survivors' are not, so under
elastic a worker resumes whenever the run directory holds checkpoints
(``commands.train._torchrun_resumes``). The agents must not share their rendezvous store with
the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): when they do, rank 0's agent keeps
the store address of its first round and never writes it for a later one, and the returning
agent waits for it until its timeout (torch's dynamic rendezvous, read and seen on the
emulated cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcpar.config import JobConfig
from mcpar.errors import UserError, problem
from mcpar.topology import replica_ranks


@dataclass(frozen=True)
class ElasticChange:
    """The layout the config asks and the one planned for the world that is left."""

    asked: dict[str, int]
    planned: dict[str, int]

    def to_json(self) -> dict[str, object]:
        return {"asked": dict(self.asked), "planned": dict(self.planned)}

    def report_line(self) -> str:
        a, p = self.asked, self.planned
        return (f"elastic: {p['world_size']} workers of the {a['world_size']} the layout asks: "
                f"data {a['data']} -> {p['data']}, micro-batches per step "
                f"{a['num_microbatches']} -> {p['num_microbatches']}, global batch "
                f"{p['global_batch_size']} kept")


def layout_fields(cfg: JobConfig, world_size: int) -> dict[str, int]:
    """A resolved config's layout as the elastic records name it."""
    par, opt = cfg.parallelism, cfg.optimization
    data, accum = par.data or 1, opt.gradient_accumulation or 1
    return {"world_size": world_size, "data": data, "tensor": par.tensor,
            "pipeline": par.pipeline, "context": par.context, "experts": par.experts,
            "micro_batch_size": opt.micro_batch_size, "num_microbatches": accum,
            "global_batch_size": opt.micro_batch_size * accum * data}


def elastic_layout(cfg: JobConfig,
                   world_size: int | None) -> tuple[JobConfig, ElasticChange | None]:
    """``cfg`` re-planned for ``world_size`` workers when ``training.elastic`` is on and the
    world is smaller than the layout asks (else ``cfg`` unchanged and None). Raises UserError
    naming the key when the world is below ``min_world`` or cannot hold the layout."""
    elastic = cfg.training.elastic
    if elastic is None or world_size is None:
        return cfg, None
    par, opt = cfg.parallelism, cfg.optimization
    if world_size < elastic.min_world:
        raise UserError(problem(
            "training.elastic.min_world",
            f"{world_size} workers are left, fewer than min_world {elastic.min_world}; start "
            "the job on more nodes, or lower min_world"))
    if par.data is None:
        if opt.global_batch_size is None:
            raise UserError(problem(
                "training.elastic",
                "needs the global batch to keep when the world shrinks: set "
                "optimization.global_batch_size (or parallelism.data, the asked layout)"))
        return cfg, None  # the data degree already follows the world; the batch is fixed
    per_replica = replica_ranks(par.tensor, par.pipeline, par.context)
    asked_world = par.data * per_replica
    if world_size >= asked_world:
        return cfg, None  # the asked layout (a larger world is refused by the plan)
    groups = f"tensor {par.tensor} x pipeline {par.pipeline}" + (
        f" x context {par.context}" if par.context > 1 else "")
    if world_size % per_replica:
        raise UserError(problem(
            "parallelism",
            f"{world_size} workers are left, which {groups} groups of {per_replica} do not "
            "divide; training.elastic keeps those degrees and shrinks only the data degree"))
    data = world_size // per_replica
    global_batch = opt.global_batch_size or opt.micro_batch_size * (
        opt.gradient_accumulation or 1) * par.data
    per_micro = opt.micro_batch_size * data
    if global_batch % per_micro:
        raise UserError(problem(
            "optimization.micro_batch_size",
            f"the global batch {global_batch} cannot be kept on data {data} (what "
            f"{world_size} workers hold): it is not divisible by micro_batch_size "
            f"{opt.micro_batch_size} x data {data}; use a micro-batch size that divides "
            f"{global_batch // data}"))
    resized = cfg.model_copy(update={
        "parallelism": par.model_copy(update={"data": data}),
        "optimization": opt.model_copy(update={
            "gradient_accumulation": global_batch // per_micro,
            "global_batch_size": global_batch}),
    })
    asked = cfg.model_copy(update={"optimization": opt.model_copy(update={
        "gradient_accumulation": global_batch // (opt.micro_batch_size * par.data)})})
    return resized, ElasticChange(layout_fields(asked, asked_world),
                                  layout_fields(resized, world_size))


def resize_record(saved_config: dict[str, Any], saved_world: int, cfg: JobConfig,
                  world_size: int) -> dict[str, object] | None:
    """recovery.jsonl's ``elastic`` record when a checkpoint saved on ``saved_world`` workers
    is resumed on another world under ``training.elastic`` (None otherwise): a shrink, or a
    job started again on more workers (``grow``)."""
    if cfg.training.elastic is None or saved_world == world_size:
        return None
    saved = JobConfig.model_validate(saved_config)
    return {"from": layout_fields(saved, saved_world), "to": layout_fields(cfg, world_size),
            "direction": "shrink" if world_size < saved_world else "grow"}
