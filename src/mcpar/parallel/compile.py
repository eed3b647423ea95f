"""The last step of the parallelize order: ``torch.compile`` per transformer block.

``training.compile: true`` compiles each block's ``forward`` separately after pipeline, tensor,
sequence and expert parallelism and the MemoryController's recompute have been applied, so that:

- every parallelism composes: a block's collectives (tensor parallelism's, expert all-to-alls)
  and ZeRO-3's gathers run where they ran in eager mode, the hooks around the block outside
  the compiled code, the data-parallel gradient exchange on the parameters' gradients as ever;
- recompute stays what it was: the compiled forward is the checkpointed one;
- parameter names (checkpoints) do not change: the compiled function is set on the block
  instance (as recompute does), the module is not wrapped;
- the blocks are alike, so they share their compiled graphs (one compile, not one per block);
  only the embedding and the head, run once per micro-batch, stay eager.

Graphs are static (``dynamic=False``): a micro-batch's shape is fixed by the plan, and a
different shape (an evaluation batch) compiles its own graph once. The first step's compile
time is logged apart from the step times (``compile_s`` in metrics.jsonl, step 1), measured by
``device.compile_seconds``.

Also here: which kernel the MoE experts run (``models.moe.describe_expert_kernel``), decided
before compilation so that the grouped-matmul probe never runs inside a traced function.
"""

from __future__ import annotations

import torch
from torch import nn

from mcpar.config import JobConfig
from mcpar.device import allow_recompiles, compile_seconds
from mcpar.models.moe import MoELayer, describe_expert_kernel

__all__ = ["compile_blocks", "compile_seconds", "finish_blocks"]


def finish_blocks(chunks: list[nn.Module], cfg: JobConfig, device: torch.device) -> list[str]:
    """Compile this rank's blocks when ``training.compile`` is set; the log lines to print."""
    notes = []
    if any(isinstance(m, MoELayer) for chunk in chunks for m in chunk.modules()):
        dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
        notes.append(describe_expert_kernel(device.type, dtype))
    if cfg.training.compile:
        count = compile_blocks(chunks)
        notes.append(f"torch.compile: {count} blocks of this rank compiled one by one "
                     f"({device.type}; the first step's compile time is logged as compile_s)")
    return notes


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Set a compiled ``forward`` on every block of ``chunks``; how many blocks."""
    blocks = [block for chunk in chunks for block in chunk.pieces()[1]]  # type: ignore[operator]
    # Each block may guard on its own instance, and training and evaluation differ: room for
    # a graph per block and mode, so that no block falls back to eager silently.
    allow_recompiles(2 * len(blocks) + 8)
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=False)  # type: ignore[method-assign]
    return len(blocks)
