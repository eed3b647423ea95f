"""The built-in ZeRO stages, registered by number (the contract: ``mcpar.registry.zero``).

Stage 0 replicates everything; 1 shards the AdamW state over the data axis (``zero.py``; data x
context under context parallelism: ``zero_plan.shard_axis``); 2 the
gradients too, reduce-scattered after every backward; 3 the parameters too, gathered per layer
by the parameter store (``param_store.py``).
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
    summary = "the AdamW state and the gradients sharded (reduce-scattered every backward)"

    def problems(self, facts: ZeroFacts) -> list[tuple[str, str]]:
        out = super().problems(facts)
        if facts.vp > 1:
            out.append(("vp", f"{facts.vp} chunks per rank with zero_stage {self.stage} (which "
                        "reduces after every backward) is not supported; use virtual_stages 1 "
                        "or zero_stage 1"))
        if facts.splits_backward:
            # Each backward's gradients are reduce-scattered and freed as it ends, but a split
            # schedule's weight gradients land later, in W.
            out.append(("zero_stage", f"{self.stage} reduces the gradients after every "
                        "backward, and the schedule splits the backward (its weight gradients "
                        "come later, in W tasks); use zero_stage 1 or a schedule that does not "
                        "split the backward (1f1b, interleaved_1f1b)"))
        return out


class ShardedParameters(ShardedGradients):
    name, stage = "3", 3
    shards_parameters = True
    summary = "parameters sharded too, gathered per layer by the parameter store"

    def problems(self, facts: ZeroFacts) -> list[tuple[str, str]]:
        out = super().problems(facts)
        if facts.pp > 1:
            out.append(("zero_stage", "3 with parallelism.pipeline > 1 is not supported in "
                        "this version (the stages' tied embedding would be gathered on two "
                        "ranks); use zero_stage 1 or 2 with a pipeline"))
        return out


for _stage in (Replicated(), ShardedOptimizer(), ShardedGradients(), ShardedParameters()):
    ZERO_STAGES.register(_stage)
