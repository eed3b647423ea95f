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

Graphs are static (``dynamic=False``): a micro-batch's shape is fixed by the plan. Evaluation
(no gradients) runs the blocks eagerly: a few batches per evaluation interval would not repay
compiling a forward-only graph of every shape they come in. The first step's compile
time is logged apart from the step times (``compile_s`` in metrics.jsonl, step 1), measured by
``device.compile_seconds``. What compile really did on each rank (graphs, compiled calls,
recompiles, failed frames) is counted by ``compiled_graphs`` into ``summary.json``'s
``compile``; a fallback to eager raises rather than passing silently.

Collectives run eagerly (``torch.compiler.disable`` on the Communicator's collective methods,
and on the expert-parallel shard's forward, whose all-to-all sizes are read on the host): traced,
their timing code (``time.perf_counter``) breaks the graph and the resumed code guards on the
float it returned, so every call would compile anew until dynamo gave up on the block. A
collective is a graph break either way; this makes it a clean one.

The MoE experts' kernel (``models.moe.describe_expert_kernel``) is decided by the trainer
before this step, so that the grouped-matmul probe never runs inside a traced function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.config import JobConfig
from mcpar.device import compile_seconds
from mcpar.parallel.compiled_graphs import counting_backend, make_fallbacks_loud, track
from mcpar.parallel.expert import ShardedExperts

__all__ = ["compile_blocks", "compile_modules", "compile_seconds", "finish_blocks"]


def finish_blocks(chunks: list[nn.Module], cfg: JobConfig, device: torch.device) -> list[str]:
    """Compile this rank's blocks when ``training.compile`` is set; the log lines to print.
    (A MoE model's expert kernel is chosen before this: ``models.moe.describe_expert_kernel``,
    called by the trainer, so that the grouped-matmul probe never runs inside a traced
    function.)"""
    if not cfg.training.compile:
        return []
    count = compile_blocks(chunks)
    return [f"torch.compile: {count} blocks of this rank compiled one by one "
            f"({device.type}; the first step's compile time is logged as compile_s)"]


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Set a compiled ``forward`` on every block of ``chunks``; how many blocks."""
    return compile_modules([block for chunk in chunks
                            for block in chunk.pieces()[1]])  # type: ignore[operator]


def compile_modules(blocks: list[nn.Module]) -> int:
    """Compile each module's ``forward`` in place (also the benchmarks' DDP peer's blocks, so
    that both sides compile the same way); how many."""
    # torch's recompile limit stays: the blocks share their graphs (at most 2 per frame in the
    # layouts tested, tests/test_compile.py), and a frame past it raises (compiled_graphs.py).
    make_fallbacks_loud()
    _collectives_run_eagerly()
    for block in blocks:
        for module in block.modules():
            if isinstance(module, ShardedExperts):
                module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
        block.forward = _compiled_when_training(block.forward)  # type: ignore[method-assign]
    return len(blocks)


def _compiled_when_training(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    compiled = torch.compile(forward, dynamic=False, backend=counting_backend)
    track(forward)

    def run(*args: torch.Tensor) -> torch.Tensor:
        return compiled(*args) if torch.is_grad_enabled() else forward(*args)

    run.compiled = compiled  # type: ignore[attr-defined]
    return run


_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_along",
                "reduce_scatter_along", "all_to_all_single", "all_to_all_single_async",
                "all_to_all_rows", "all_gather_into", "reduce_scatter_into", "send", "recv",
                "barrier", "run_async")


def _collectives_run_eagerly() -> None:
    """Once per process: dynamo calls the Communicator's collectives without tracing them."""
    for name in _COLLECTIVES:
        method = getattr(Communicator, name, None)
        if method is not None and not getattr(method, "_mcpar_eager", False):
            eager = torch.compiler.disable(method)
            eager._mcpar_eager = True  # type: ignore[attr-defined]
            setattr(Communicator, name, eager)
