"""Block-wise int8 quantization: what ZeRO-3's compressed gathers and reduce-scatters carry.

Each row is cut into blocks of ``BLOCK`` elements; a block is sent as int8 values and one fp32
scale (its largest magnitude / 127), i.e. 1 + 4 / BLOCK bytes per element instead of 4. The
rounding is to nearest, so the error of an element is at most half its block's scale; a block
of zeros has scale 1 (nothing to represent, and no division by zero). Deterministic: the same
input quantizes to the same bytes on every rank, which keeps replicas that dequantize the same
gathered bytes bitwise identical.
"""

from __future__ import annotations

import torch

BLOCK = 256


def padded_length(n: int) -> int:
    """Elements of a row of ``n`` once padded to whole blocks."""
    return -(-n // BLOCK) * BLOCK


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [R, padded], fp32 scales [R, padded / BLOCK]) of a 2-D float tensor."""
    r, n = rows.shape
    padded = rows.new_zeros(r, padded_length(n), dtype=torch.float32)
    padded[:, :n] = rows
    blocks = padded.view(r, -1, BLOCK)
    scales = blocks.abs().amax(dim=2) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / scales.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return values.view(r, -1), scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 rows [R, n] that ``quantize_rows`` encoded."""
    r = values.shape[0]
    blocks = values.view(r, -1, BLOCK).to(torch.float32) * scales.unsqueeze(2)
    return blocks.view(r, -1)[:, :n]
