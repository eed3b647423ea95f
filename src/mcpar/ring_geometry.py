"""Which blocks of ring attention a rank's queries see under the zigzag, and how many scores
they compute: pure arithmetic, shared by the ring's kernels (``ring_blocks``) and the cost model
(``sim.compute``), which prices the ring without importing torch. Why the zigzag and what each
kind of block is: ``ring_blocks``' docstring."""

from __future__ import annotations

# Which part of a block a rank's queries see (``ring_blocks``' docstring).
OWN, LOWER, HIGHER = "own", "lower", "higher"


def block_kind(rank: int, source: int) -> str:
    """How the queries of ``rank`` see the K/V block of ``source`` under the zigzag."""
    if source == rank:
        return OWN
    return LOWER if source < rank else HIGHER


LAYOUTS = ("zigzag", "contiguous")


def visible(layout: str, rank: int, source: int, half: int) -> tuple[slice, slice, bool] | None:
    """(query rows, key columns, causal) of the block of ``source`` that the queries of ``rank``
    see, or None when they see none of it; ``half``: c tokens (half a rank's shard)."""
    kind = block_kind(rank, source)
    if kind == OWN:
        return slice(None), slice(None), True
    if layout == "contiguous":
        return (slice(None), slice(None), False) if kind == LOWER else None
    if kind == LOWER:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def score_elements(batch_heads: float, local_tokens: float, ranks: int) -> float:
    """Attention scores one rank's zigzag blocks compute in one call: its own causal block of
    ``2c x 2c`` whole (masked after) and ``ranks - 1`` dense ``c x 2c`` blocks, for each of
    ``batch_heads`` (batch x heads) rows of ``local_tokens`` = 2c queries."""
    c = local_tokens / 2
    return batch_heads * (4 * c * c + (ranks - 1) * 2 * c * c)
