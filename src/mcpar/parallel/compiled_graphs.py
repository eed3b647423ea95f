"""What ``torch.compile`` really did on this rank: the graphs it compiled for the blocks, how
often compiled code ran, and the frames that recompiled or failed.

A compiled block that falls back to eager still trains, with the same losses, only slower: a
loss-parity test cannot see it. So the blocks are compiled through ``counting_backend``, which
hands each graph to inductor (``compile_fx``, what the ``"inductor"`` backend runs) and wraps
the compiled function it returns: every call of that wrapper is compiled code running
(``graph_calls``), and every graph dynamo captured passed through it (``graphs``). Dynamo's own
counters give the frames it tried and converted (``frames_failed``: tried, not converted) and
the cache entries per code object give the most graphs any one frame holds (``most_per_frame``;
``recompiles``: the graphs beyond one per frame). ``summary.json``'s ``compile`` holds the counts
of every rank (``CompiledGraphs.to_json``), so a layout in which one rank ran eagerly is seen.

Fallbacks are also made loud where torch would make them silent: ``suppress_errors`` off (a
frame that fails to compile raises instead of running eagerly) and ``fail_on_recompile_limit_hit``
on (a frame past the recompile limit raises instead of running eagerly from then on).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import CodeType
from typing import Any

import torch


@dataclass
class CompiledGraphs:
    """This rank's counts (see the module docstring)."""

    modules: int = 0
    graphs: int = 0
    graph_calls: int = 0
    frames_failed: int = 0
    most_per_frame: int = 0
    recompiles: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


_lock = threading.Lock()
_counts = CompiledGraphs()
_codes: dict[int, CodeType] = {}  # the compiled blocks' forward code objects


def counting_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Inductor, with each compiled graph's calls counted."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, list(example_inputs))
    with _lock:
        _counts.graphs += 1

    def count() -> None:
        with _lock:
            _counts.graph_calls += 1

    # Dynamo calls a backend's function with the graph's inputs as arguments.
    def run(*args: Any) -> Any:
        count()
        return compiled(*args)

    return run


def make_fallbacks_loud() -> None:
    """A frame that fails to compile, or passes the recompile limit, raises: never a silent
    eager run."""
    import torch._dynamo

    config = torch._dynamo.config
    config.suppress_errors = False
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def track(forward: Callable[..., Any], modules: int = 1) -> None:
    """Count ``modules`` compiled modules whose forward is ``forward`` (its code object is where
    their graphs are cached)."""
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    with _lock:
        _counts.modules += modules
        if code is not None:
            _codes[id(code)] = code


def _graphs_per_frame() -> list[int]:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    return [len(_debug_get_cache_entry_list(code)) for code in _codes.values()]


def counts() -> CompiledGraphs:
    """This rank's counts now."""
    from torch._dynamo.utils import counters

    per_frame = _graphs_per_frame()
    frames = counters["frames"]
    with _lock:
        return CompiledGraphs(
            modules=_counts.modules, graphs=_counts.graphs, graph_calls=_counts.graph_calls,
            frames_failed=max(0, int(frames.get("total", 0)) - int(frames.get("ok", 0))),
            most_per_frame=max(per_frame, default=0),
            recompiles=sum(max(0, n - 1) for n in per_frame))


def per_rank(gather: Callable[[torch.Tensor], list[torch.Tensor]]) -> dict[str, object]:
    """``summary.json``'s ``compile``: every rank's counts (``gather``: an all-gather over the
    world, a collective every rank calls), and their totals."""
    mine = counts().to_json()
    names = list(mine)
    rows = gather(torch.tensor([mine[n] for n in names], dtype=torch.int64))
    ranks = [{n: int(v) for n, v in zip(names, row.tolist(), strict=True)} for row in rows]
    return {"ranks": ranks,
            "ranks_without_compiled_calls": [r for r, c in enumerate(ranks)
                                             if c["modules"] and not c["graph_calls"]]}
