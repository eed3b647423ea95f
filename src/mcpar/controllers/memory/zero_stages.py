"""The built-in ZeRO stages, registered by number (the contract: ``mcpar.registry.zero``).

Stage 0 replicates everything; 1 shards the AdamW state over the data axis (``zero.py``; data x
context under context parallelism: ``zero_plan.shard_axis``); 2 the
gradients too, reduce-scattered after every backward (or once per step: the entry's
``reduces_every_backward``); 3 the parameters too, gathered per layer by the parameter store
(``param_store.py``), under a pipeline as well (each stage's blocks over that stage's data
ranks; a tied embedding across stages is refused with any pipeline).
"""

from __future__ import annotations

from mcpar.registry.zero import ZERO_STAGES, ZeroFacts, ZeroStage


class Replicated(ZeroStage):
    name, stage = "0", 0
    summary = "every data rank holds full parameters, gradients and optimizer state"


class ShardedOptimizer(ZeroStage):
    name, stage = "1", 1
    shards_optimizer = True
    summary = "the AdamW state sharded over the data axis"

    def problems(self, facts: ZeroFacts) -> list[tuple[str, str]]:
        out = super().problems(facts)
        if facts.dp * facts.cp == 1:
            out.append(("zero_stage", f"{self.stage} shards over the data-parallel ranks "
                        "(data x context) and this layout has data 1 and context 1, so "
                        "nothing would be sharded; use more data-parallel ranks or "
                        "zero_stage 0"))
        if facts.topology != "flat":
            out.append(("topology", f"{facts.topology!r}: ZeRO's collectives run flat over the "
                        "data axis (the node-aware variant is controllers.memory.allocation "
                        "'topology_aware'); use topology 'flat' with zero_stage > 0"))
        if facts.scheduler != "static":
            out.append(("scheduler", f"{facts.scheduler!r} migrates experts with their "
                        "optimizer state, which ZeRO shards; use 'static' with zero_stage > 0"))
        return out


class ShardedGradients(ShardedOptimizer):
    name, stage = "2", 2
    shards_gradients = True
    summary = ("the AdamW state and the gradients sharded (reduce-scattered every backward, or "
               "once per step under a split schedule or several chunks per rank)")


class ShardedParameters(ShardedGradients):
    name, stage = "3", 3
    shards_parameters = True
    summary = "parameters sharded too, gathered per layer by the parameter store"


for _stage in (Replicated(), ShardedOptimizer(), ShardedGradients(), ShardedParameters()):
    ZERO_STAGES.register(_stage)
