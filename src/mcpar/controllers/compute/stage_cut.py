"""The ComputeController's stage cut: where the model is cut into pipeline stages.

Stages are balanced by the modelled cost of each piece (the embedding and the output head
included, since a large vocabulary makes the head cost as much as several blocks), not by
counting layers.
"""

from __future__ import annotations

from mcpar.config import ModelConfig


def piece_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """Modelled training cost per token of (embedding, each block, head), in FLOPs.

    Blocks: the matmuls and attention of ``gpt_flops_per_token``. Head: its matmul plus the
    softmax/cross-entropy over the vocabulary. Embedding: no matmul, but reading and writing a
    row per token; counted as the elementwise work it is (a few FLOPs per hidden unit).
    """
    h, f, s, v = cfg.hidden_size, cfg.ffn_size, cfg.seq_len, cfg.vocab_size
    block = 3.0 * (2 * (4 * h * h + 2 * h * f) + 4 * s * h)
    head = 3.0 * (2 * h * v + 5 * v)
    embed = 3.0 * 4 * h
    return embed, [block] * cfg.num_layers, head


def partition_layers(cfg: ModelConfig, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges, one per stage, minimizing the costliest stage.

    Stage 0 also carries the embedding and the last stage the head. Every stage gets at least one
    block: a stage of only an embedding or a head is not a cut this model allows.
    """
    embed, blocks, head = piece_costs(cfg)
    n = len(blocks)
    if num_stages > n:
        raise ValueError(f"{n} layers cannot fill {num_stages} stages")
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> float:
        cost = prefix[end] - prefix[start]
        if stage == 0:
            cost += embed
        if stage == num_stages - 1:
            cost += head
        return cost

    inf = float("inf")
    # best[k][i]: the smallest max-stage cost placing blocks [0, i) into stages [0, k).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], stage_cost(k - 1, j, i))
                # Ties go to the later cut, which gives earlier stages (holding more in-flight
                # micro-batches under 1F1B) the lighter share.
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges: list[tuple[int, int]] = []
    end = n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]
