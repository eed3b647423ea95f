"""The contract of a ZeRO stage entry, a memory option (the built-ins, stages 0-3, in
``controllers/memory/zero_stages.py``): what the stage shards over the data axis and the
layouts it cannot run.

``capabilities.zero_layout_problems`` applies an entry's ``problems`` for ``mcpar check``,
``mcpar train`` and the planner alike; the MemoryController's plan reads the entry's flags
(clipping over shards, a reduction after every backward, the parameter store).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.registry import Registry


@dataclass(frozen=True)
class ZeroFacts:
    """What a stage's rules may look at."""

    dp: int
    pp: int = 1
    cp: int = 1  # context ranks hold the dense parameters too: the shards span dp x cp
    vp: int = 1
    topology: str = "flat"  # the data axis' all-reduce algorithm
    allocation: str = "default"  # 'topology_aware': the hierarchical parameter store
    weight_gather: str = "none"  # 'int8': quantized parameter gathers
    scheduler: str = "static"  # the expert balancer (it migrates optimizer state)
    splits_backward: bool = False  # the pipeline schedule defers weight gradients to W tasks


class ZeroStage:
    """One ZeRO stage; ``name`` is its ``controllers.memory.zero_stage`` as text."""

    name: str
    stage: int
    shards_optimizer: bool = False  # each data rank keeps a shard of the AdamW state
    shards_gradients: bool = False  # gradients reduce-scattered per backward (or per step)
    shards_parameters: bool = False  # parameters gathered per layer (the parameter store)
    summary: str = ""

    def problems(self, facts: ZeroFacts) -> list[tuple[str, str]]:
        """(layout field, text) for each combination the stage cannot run with. The store's
        options need gathered parameters, which only a parameter-sharding stage has."""
        out = []
        if facts.allocation == "topology_aware" and not self.shards_parameters:
            out.append(("allocation", "'topology_aware' (the hierarchical parameter store) "
                        "caches gathered parameters, which needs zero_stage 3; set zero_stage "
                        "3 or allocation 'default'"))
        if facts.weight_gather != "none" and not self.shards_parameters:
            out.append(("weight_gather", f"{facts.weight_gather!r} quantizes ZeRO-3's "
                        "parameter gathers, and zero_stage is not 3; set zero_stage 3 or "
                        "weight_gather 'none'"))
        return out

    def reduces_every_backward(self, facts: ZeroFacts) -> bool:
        """Whether the gradients are reduce-scattered after every backward pass (no full
        gradient kept between micro-batches) rather than once per step, after each chunk's
        last backward. A gradient-sharding stage reduces per backward where each backward of a
        chunk is whole and runs before the chunk's next one; under a schedule that splits the
        backward (a micro-batch's weight gradients come in a later W task, after other
        micro-batches' B tasks) or that places several chunks on a rank, the gradients stay
        whole until the step's last backward of each chunk, as FSDP does under torch's
        pipelining (its gradient sync is requested on the last micro-batch only). The runtime
        (``MemoryPlan``), the memory estimate and the cost model all ask this."""
        return self.shards_gradients and not facts.splits_backward and facts.vp == 1


ZERO_STAGES: Registry[ZeroStage] = Registry("ZeRO stage", "controllers.memory.zero_stage")


def zero_stage(stage: int) -> ZeroStage:
    """The entry of ZeRO stage ``stage``."""
    return ZERO_STAGES.get(str(stage))
