"""mcpar's pipeline stage cut, where the cost model can price it.

The ComputeController cuts the model into contiguous stages that balance the modelled training
cost of each piece (the embedding on the first stage, the output head on the last), not the
layer count: a large vocabulary makes the head cost as much as several blocks, so the first
stage often gets more blocks than the last. The per-rank memory (parameters of the busiest rank,
activations of the first) and the stage times follow from that cut, so the simulator needs the
same one for an mcpar config. It lives here because ``mcpar.sim`` may import only
``mcpar.config``; ``mcpar.controllers.compute.stage_cut`` has the same function (a test checks
that the two cut alike) and can import this one.
"""

from __future__ import annotations

import functools

from mcpar.config import ModelConfig


def piece_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """Modelled training FLOPs per token of (embedding, each block, head): a block's matmuls and
    attention (3 x forward); the head's matmul plus its softmax/cross-entropy over the
    vocabulary; the embedding's row read and write, a few element-wise FLOPs per hidden unit."""
    h, f, s, v = cfg.hidden_size, cfg.ffn_size, cfg.seq_len, cfg.vocab_size
    block = 3.0 * (2 * (4 * h * h + 2 * h * f) + 4 * s * h)
    head = 3.0 * (2 * h * v + 5 * v)
    return 3.0 * 4 * h, [block] * cfg.num_layers, head


def balanced_cut(first: float, blocks: list[float], last: float,
                 num_stages: int) -> list[tuple[int, int]]:
    """[start, end) block ranges of `num_stages` contiguous stages of at least one block each,
    the costliest stage as cheap as possible; stage 0 also pays `first`, the last stage `last`.
    Among equally good cuts the later boundary wins, leaving the earlier stages (which hold
    more micro-batches in flight under 1F1B) the lighter share."""
    n = len(blocks)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot fill {num_stages} stages")
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first if stage == 0 else 0.0) + (last if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # worst[k][i]: the least possible costliest stage over blocks [0, i) cut into k stages;
    # start[k][i]: where the k-th of those stages begins.
    worst = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    start = [[0] * (n + 1) for _ in range(num_stages + 1)]
    worst[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(worst[k - 1][j], cost(k - 1, j, i))
                if candidate <= worst[k][i]:
                    worst[k][i], start[k][i] = candidate, j
    ranges = []
    end = n
    for k in range(num_stages, 0, -1):
        ranges.append((start[k][end], end))
        end = start[k][end]
    return ranges[::-1]


def partition_layers(cfg: ModelConfig, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) block ranges, one per stage, balancing ``piece_costs``."""
    return list(_cached_cut(cfg, num_stages))


@functools.lru_cache(maxsize=256)
def _cached_cut(cfg: ModelConfig, num_stages: int) -> tuple[tuple[int, int], ...]:
    # The cut is O(stages x layers^2) (0.2 s for 96 layers in 32 stages) and one resolved plan
    # asks for it three times (stage cut, memory estimate, its layout); configs are frozen.
    embed, blocks, head = piece_costs(cfg)
    return tuple(balanced_cut(embed, blocks, head, num_stages))


def stage_sizes(cfg: ModelConfig, num_stages: int) -> tuple[int, ...]:
    """Blocks of each stage under mcpar's cut (what ``Layout.stages`` takes)."""
    return tuple(end - start for start, end in partition_layers(cfg, num_stages))
