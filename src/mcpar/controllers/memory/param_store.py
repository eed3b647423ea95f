"""ZeRO stage 3 and the hierarchical parameter store: parameters sharded over the data axis (data
x context under context parallelism: each bucket's axis), gathered per layer just before use and
freed after.

Why hand-written
    FSDP2 (``fully_shard``) gathers per module too, but on its own streams and groups with its
    own collectives: the CommunicationController could neither count them per axis and codec nor
    quantize the gathers, keep a node-local copy for the backward pass (ZeRO++'s hpZ) or reduce
    hierarchically with a compressed inter-node stage (qgZ). The unit of sharding here is the
    gradient bucket of ``grad_sync.py``, cut per layer under stage 3, so a layer's gather, its
    reduce-scatter and its optimizer shard are the same elements.

Units
    Every transformer block is a unit; the parameters outside blocks (embedding, final norm,
    head, a tied weight once) are the root unit. A gather carries a group of ``span``
    consecutive blocks, the fewest holding ``controllers.memory.gather_mb`` (``gather_span``;
    one block when blocks are large): every collective costs a rendezvous of the ranks and a
    wake-up of the backend's threads, which a block of a few hundred kB cannot amortize (16
    blocks of 0.2 MB at 2 ranks on 2 cores: 0.66x of plain data parallelism's speed gathering
    one at a time, 0.76x two, 0.79x four). A unit holds one or two buckets (dense, over
    'dp'; expert weights, over their replicas 'edp'). Per bucket: ``flat`` (the full parameters;
    the module's parameters are views of it, its storage freed between uses) and ``primary``
    (this rank's shard, the elements the optimizer updates: the global store).

Order (the ComputeController's task order, one chunk: embedding, blocks, head, then back)
    forward: the root and the first group are gathered when the chunk starts; a block's gather
    is waited for at its forward pre-hook, which, when the next block is not on its way yet,
    starts the next group's (prefetch: it crosses the link while this block computes); the
    block is freed after its forward (but those of the last group: see backward).
    backward: the gradient of a block's output arriving means its backward is next: the block
    is gathered (prefetched; the last group's blocks stay gathered from their forward, their
    backward being the next: no more blocks than the forward held at once, one gather and a
    group's bytes fewer per pass, as TorchTitan keeps the last block unsharded) and, when
    the block before it is not on its way, the group of blocks before it is prefetched; when
    all of a unit's gradients are in, its buckets are reduce-scattered and its parameters
    freed.
    The root stays gathered until its gradients are in (the end of the backward pass). Under
    ``torch.no_grad`` (evaluation) everything is freed after its forward. The hooks issue the
    store's collectives in the same order on every rank.
Under a pipeline (several micro-batches in flight, in the schedule's order)
    Each gather above is per use, so any order of forwards and backwards works: a chunk's
    backward starts by gathering its root again when another micro-batch's backward freed it
    (a pipeline's cool-down runs backwards in a row), and the ComputeController calls
    ``release_chunk`` after each backward task. Where the plan reduces once per step (a split
    schedule, several chunks per rank) the buckets launch only in the step's last backward of
    each chunk, so the units are freed there rather than at their launch.

Plain gathers and reductions (no codec, no node cache)
    They are the backend's own asynchronous collectives, started from the hooks: no thread of
    ours between the hook and the wire (a Python thread needs the interpreter and a wake-up for
    each of ~3 collectives per layer). Where the CommunicationController fuses exchanges
    (gloo), a layer's gradient reduce-scatter waits for the next gather the hooks issue, a
    block or two later, and both travel in one all-to-all (``Communicator.exchange_async``):
    the backward pass then costs one collective per layer instead of two. Nothing is held
    back for long: the previous block's gather starts as this block's backward does, and the
    last reductions of a pass go out, together, when the gradient sync waits for them.
    Expert buckets (their own axis) are never held back.
    Codecs and the node cache compose several collectives per gather or reduction; those run
    on the CommunicationController's one communication thread, in submission order.

Hierarchical store (``controllers.memory.allocation: topology_aware``; ZeRO++'s hpZ and qgZ)
    The forward gather runs over the whole data axis (it crosses nodes) and leaves, on each
    rank, a node-local cache: chunk j of every gathered dense bucket, j this rank's place in its
    node (k ranks per node, 1/k of the layer). The backward gather then runs inside the node
    only, from the caches. Gradients are aggregated hierarchically: reduce-scatter inside the
    node (chunk j = the shards of the ranks at place j of every node), then across nodes on 1/k
    of the bucket; that inter-node stage may carry bf16 or int8 with error feedback (an
    all-to-all of quantized rows, summed in fp32 at the owner). The data axis must be node-major
    (rank = node * k + place), which the store checks.

Weight codec (``controllers.communication.weight_gather: int8``, ZeRO++'s qwZ)
    Global gathers carry block-quantized int8 (``comm/int8_blocks.py``); every rank dequantizes
    the same bytes, so the replicas compute with identical weights, and the backward gather (or
    the cache) returns the same values the forward used. The fp32 shard the optimizer updates is
    never quantized.

Held between steps: the primary shards (4 P / n bytes in fp32), the node caches (4 P / k) and,
with int8 gradients, their error feedback (4 P / k). During a pass, the root unit and at most
``span`` + 1 blocks are gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from mcpar.comm.communicator import CommHandle
from mcpar.comm.int8_blocks import dequantize_rows, quantize_rows
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import GradBucket
from mcpar.errors import UserError, problem
from mcpar.parallel.expert import is_expert_sharded


class QueuedReduce(CommHandle):
    """A bucket's gradient reduce-scatter, held until the store's next gather carries it (or,
    when the gradient sync waits for it first, sent on its own with the others held)."""

    def __init__(self, store: ParameterStore, out: torch.Tensor, buffer: torch.Tensor,
                 axis: str):
        super().__init__(None)
        self.store, self.out, self.buffer, self.axis = store, out, buffer, axis
        self.issued: CommHandle | None = None

    def wait(self) -> None:
        if self.issued is None:
            self.store.send_queued()
        assert self.issued is not None
        self.issued.wait()


class HandleGroup(CommHandle):
    """Several collectives in flight, waited for together."""

    def __init__(self, handles: list[CommHandle]):
        super().__init__(None)
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


@dataclass
class StoreUnit:
    """A layer's parameters: what is gathered, freed and reduced together."""

    name: str
    buckets: list[GradBucket] = field(default_factory=list)
    gathered: bool = False  # the flats hold the full parameters (or are being filled)
    handle: CommHandle | None = None  # the gather in flight
    cache_fresh: bool = False  # the node caches hold this step's parameters
    launched: int = 0  # buckets whose gradients went to their reduce-scatter this round


def unit_groups(chunks: list[nn.Module]) -> tuple[list[str], list[list[nn.Parameter]],
                                                  list[int]]:
    """The units of the chunks (their blocks, then the rest as a root unit per chunk) and the
    stage-3 gradient buckets: (unit names, bucket parameter groups in backward order, the unit
    index of each group). A unit's dense and expert parameters are separate buckets."""
    names: list[str] = []
    members: list[list[nn.Parameter]] = []
    for c, chunk in enumerate(chunks):
        _, blocks, _, _ = chunk.pieces()  # type: ignore[operator]
        in_blocks: set[int] = set()
        for b, block in enumerate(blocks):
            params = [p for p in block.parameters() if p.requires_grad]
            in_blocks.update(id(p) for p in params)
            names.append(f"chunk{c}.block{b}")
            members.append(params)
        names.append(f"chunk{c}.root")
        members.append([p for p in chunk.parameters() if p.requires_grad
                        and id(p) not in in_blocks])
    groups: list[list[nn.Parameter]] = []
    unit_of_group: list[int] = []
    # Backward order: blocks last to first, the root (its embedding's gradient comes last).
    order = [u for u in reversed(range(len(names))) if not names[u].endswith(".root")]
    order += [u for u in range(len(names)) if names[u].endswith(".root")]
    for u in order:
        for expert in (False, True):
            group = [p for p in members[u] if is_expert_sharded(p) == expert]
            if group:
                groups.append(group)
                unit_of_group.append(u)
    return names, groups, unit_of_group


class ParameterStore:
    """Stage 3's parameters: the global store of shards, per-layer gathers and frees, the
    node-local cache, and the reduction of gradients to their owners."""

    def __init__(self, comm: CommunicationController, chunks: list[nn.Module],
                 buckets: list[GradBucket], unit_names: list[str], unit_of_bucket: list[int],
                 node_cache: bool = False, weight_codec: str = "none",
                 grad_codec: str = "none", span: int = 1):
        self.comm = comm
        self.span = span  # consecutive blocks per gather
        self.node_cache = node_cache
        self.weight_codec = weight_codec
        self.grad_codec = grad_codec
        self.units = [StoreUnit(name) for name in unit_names]
        self.unit_of_bucket = {b.index: self.units[u] for b, u in zip(buckets, unit_of_bucket,
                                                                      strict=True)}
        for bucket, u in zip(buckets, unit_of_bucket, strict=True):
            self.units[u].buckets.append(bucket)
        self.flat: dict[int, torch.Tensor] = {}
        self.primary: dict[int, torch.Tensor] = {}
        self.cache: dict[int, torch.Tensor] = {}
        self.residual: dict[int, torch.Tensor] = {}  # int8 gradients' error feedback
        # Plain collectives are the backend's own; codecs and the cache run on the comm thread.
        self.native = not node_cache and weight_codec == "none"
        self.fuse = self.native and comm.fuses_exchanges()
        self.queued: list[QueuedReduce] = []  # reduce-scatters waiting for the next gather
        self.wire_collectives = 0  # collectives the native path started (tests and profiles)
        # (event, unit) in order when a list is given: 'fetch' / 'fetch_cache' (a gather
        # starts), 'use' (a layer's compute may start), 'free'; read by tests and profiles.
        self.trace: list[tuple[str, str]] | None = None
        if node_cache:
            self._check_node_major()
        k = comm.axis_size("dp_intra")
        with torch.no_grad():
            for bucket in buckets:
                self._shard(bucket, k)
        for unit in self.units:
            self._free(unit)
        self._hook(chunks)

    def _check_node_major(self) -> None:
        k = self.comm.axis_size("dp_intra")
        expected = self.comm.axis_rank("dp_inter") * k + self.comm.axis_rank("dp_intra")
        wrong = torch.tensor([float(expected != self.comm.axis_rank("dp"))])
        self.comm.all_reduce(wrong, axis="world", op="max")
        if wrong.item():
            raise UserError(problem(
                "controllers.memory.allocation", "'topology_aware' needs the data-parallel "
                "ranks of a node to be consecutive on the data axis, and they are not here; "
                "set cluster.ranks_per_node to the ranks each node runs"))

    def _shard(self, bucket: GradBucket, k: int) -> None:
        """Move the bucket's parameters into a flat buffer; keep this rank's shard of it."""
        assert bucket.shard is not None
        flat = torch.zeros(bucket.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset:offset + p.numel()].view_as(p)
        size = bucket.numel // bucket.degree
        rank = self.comm.axis_rank(bucket.axis) if bucket.degree > 1 else 0
        self.flat[bucket.index] = flat
        self.primary[bucket.index] = flat[rank * size:(rank + 1) * size].clone()
        if self._cached(bucket):
            self.cache[bucket.index] = flat.new_zeros(bucket.numel // k)
            if self.grad_codec == "int8":
                self.residual[bucket.index] = flat.new_zeros(bucket.numel // k)

    def _cached(self, bucket: GradBucket) -> bool:
        """Dense buckets use the node cache; expert weights are gathered over their replicas."""
        return self.node_cache and not bucket.expert

    # --- the seed's API ------------------------------------------------------------------------
    def fetch_parameters(self, unit: StoreUnit, backward: bool = False) -> None:
        """Start gathering a unit's parameters (a no-op if they are gathered or on their way):
        from the node-local cache in a backward pass when it holds them, else from the global
        store. ``wait`` makes them usable."""
        self.fetch_units([unit], backward)

    def fetch_units(self, units: list[StoreUnit], backward: bool = False) -> None:
        """:meth:`fetch_parameters` of several units at once: where exchanges are fused, their
        gathers over one axis are one collective."""
        todo = [unit for unit in units if not unit.gathered]
        for unit in todo:
            unit.gathered = True
            for bucket in unit.buckets:
                flat = self.flat[bucket.index]
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            from_cache = backward and unit.cache_fresh
            self._note("fetch_cache" if from_cache else "fetch", unit)
            unit.cache_fresh = unit.cache_fresh or (self.node_cache and not backward)
            if not self.native:
                unit.handle = self.comm.run_async(
                    lambda unit=unit, from_cache=from_cache: self._gather(unit, from_cache))
        if todo and self.native:
            self._gather_native(todo)

    def _gather_native(self, units: list[StoreUnit]) -> None:
        """The units' gathers as the backend's asynchronous collectives. Where exchanges are
        fused, the gathers over one axis and the reduce-scatters held for it are one
        all-to-all; otherwise one all-gather per bucket."""
        by_axis: dict[str, list[tuple[StoreUnit, GradBucket]]] = {}
        for unit in units:
            for bucket in unit.buckets:
                by_axis.setdefault(bucket.axis, []).append((unit, bucket))
        handles: dict[str, list[CommHandle]] = {unit.name: [] for unit in units}
        for axis, members in by_axis.items():
            gathers = [(self.flat[b.index], self.primary[b.index]) for _, b in members]
            held = [q for q in self.queued if q.axis == axis]
            dtypes = {t.dtype for _, t in gathers} | {q.buffer.dtype for q in held}
            if self.fuse and (held or len(gathers) > 1) and len(dtypes) == 1:
                self.queued = [q for q in self.queued if q.axis != axis]
                handle = self.comm.exchange_async([(q.out, q.buffer) for q in held], gathers,
                                                  axis=axis)
                self.wire_collectives += 1
                for q in held:
                    q.issued = handle
                for unit in {id(u): u for u, _ in members}.values():
                    handles[unit.name].append(handle)
                continue
            for (unit, _), (flat, shard) in zip(members, gathers, strict=True):
                handles[unit.name].append(self.comm.all_gather_into_async(flat, shard,
                                                                          axis=axis))
                self.wire_collectives += 1
        for unit in units:
            mine = handles[unit.name]
            unit.handle = mine[0] if len(mine) == 1 else HandleGroup(mine)

    def send_queued(self) -> None:
        """Send every held reduce-scatter now, together (per axis): nothing will carry them."""
        by_axis: dict[str, list[QueuedReduce]] = {}
        for q in self.queued:
            by_axis.setdefault(q.axis, []).append(q)
        self.queued = []
        for axis, held in by_axis.items():
            handle = self.comm.exchange_async([(q.out, q.buffer) for q in held], [], axis=axis)
            self.wire_collectives += 1
            for q in held:
                q.issued = handle

    def _note(self, event: str, unit: StoreUnit) -> None:
        if self.trace is not None:
            self.trace.append((event, unit.name))

    def wait(self, unit: StoreUnit) -> None:
        if unit.handle is not None:
            unit.handle.wait()
            unit.handle = None

    def aggregate_gradients(self, bucket: GradBucket) -> CommHandle:
        """Reduce a full bucket's gradient (averaged) to its owners' shards, in the background:
        flat over the bucket's axis, or, with the node cache, inside the node then across nodes
        (the inter-node stage compressed per ``grad_codec``). Frees the unit's parameters once
        all its buckets are launched (its backward is done)."""
        assert bucket.scatter_out is not None
        # The dense replicas' count (data x context), for expert buckets too (as an all-reduce).
        replicas = self.comm.axis_size(self.comm.dims.grad_axis)
        if replicas > 1:
            bucket.buffer.div_(replicas)
        out, buffer = bucket.scatter_out, bucket.buffer
        handle: CommHandle
        if self.fuse and not bucket.expert:
            handle = QueuedReduce(self, out, buffer, bucket.axis)
            self.queued.append(handle)
        elif self.native:
            handle = self.comm.reduce_scatter_into(out, buffer, axis=bucket.axis, async_op=True)
            self.wire_collectives += 1
        elif self._cached(bucket):
            handle = self.comm.run_async(lambda: self._hierarchical_reduce(bucket.index, buffer,
                                                                           out))
        else:
            handle = self.comm.run_async(lambda: self.comm.reduce_scatter_into(
                out, buffer, axis=bucket.axis))
        unit = self.unit_of_bucket[bucket.index]
        unit.launched += 1
        if unit.launched == len(unit.buckets):
            unit.launched = 0
            self._free(unit)
        return handle

    # --- collectives (on the communication thread) -----------------------------------------------
    def _gather(self, unit: StoreUnit, from_cache: bool) -> None:
        for bucket in unit.buckets:
            flat, i = self.flat[bucket.index], bucket.index
            if from_cache and self._cached(bucket):
                self.comm.all_gather_into(flat, self.cache[i], axis="dp_intra")
                continue
            if self.weight_codec == "int8":
                self._int8_gather(flat, self.primary[i], bucket.axis)
            else:
                self.comm.all_gather_into(flat, self.primary[i], axis=bucket.axis)
            if self._cached(bucket) and not from_cache:
                size = self.cache[i].numel()
                j = self.comm.axis_rank("dp_intra")
                self.cache[i].copy_(flat[j * size:(j + 1) * size])

    def _int8_gather(self, flat: torch.Tensor, mine: torch.Tensor, axis: str) -> None:
        n = self.comm.axis_size(axis)
        values, scales = quantize_rows(mine.view(1, -1))
        all_values = values.new_empty(n * values.numel())
        all_scales = scales.new_empty(n * scales.numel())
        self.comm.all_gather_into(all_values, values.view(-1), axis=axis, codec="int8")
        self.comm.all_gather_into(all_scales, scales.view(-1), axis=axis, codec="int8")
        flat.view(n, -1).copy_(dequantize_rows(all_values.view(n, -1), all_scales.view(n, -1),
                                               mine.numel()))

    def _hierarchical_reduce(self, index: int, buffer: torch.Tensor, out: torch.Tensor) -> None:
        k, nodes = self.comm.axis_size("dp_intra"), self.comm.axis_size("dp_inter")
        size = out.numel()
        # Chunk j of the node stage: the shards of place j on every node (rank = node k + j).
        by_place = buffer.view(nodes, k, size).transpose(0, 1).contiguous().view(-1)
        node_sum = buffer.new_empty(nodes * size)
        self.comm.reduce_scatter_into(node_sum, by_place, axis="dp_intra")
        if self.grad_codec == "none" or nodes == 1:
            self.comm.reduce_scatter_into(out, node_sum, axis="dp_inter")
            return
        rows = node_sum.view(nodes, size)
        if self.grad_codec == "bf16":
            received = torch.empty(nodes * size, dtype=torch.bfloat16, device=out.device)
            self.comm.all_to_all_single(received, rows.to(torch.bfloat16).view(-1),
                                        axis="dp_inter", codec="bf16")
            out.copy_(received.view(nodes, size).float().sum(dim=0))
            return
        residual = self.residual[index].view(nodes, size)
        rows = rows + residual
        values, scales = quantize_rows(rows)
        residual.copy_(rows - dequantize_rows(values, scales, size))
        got_values, got_scales = torch.empty_like(values), torch.empty_like(scales)
        self.comm.all_to_all_single(got_values.view(-1), values.view(-1), axis="dp_inter",
                                    codec="int8")
        self.comm.all_to_all_single(got_scales.view(-1), scales.view(-1), axis="dp_inter",
                                    codec="int8")
        out.copy_(dequantize_rows(got_values, got_scales, size).sum(dim=0))

    # --- residency ------------------------------------------------------------------------------
    def _free(self, unit: StoreUnit) -> None:
        if unit.gathered:
            self._note("free", unit)
        self.wait(unit)
        for bucket in unit.buckets:
            self.flat[bucket.index].untyped_storage().resize_(0)
        unit.gathered = False

    def after_step(self) -> None:
        """The shards changed: the node caches are stale until the next forward gather."""
        assert not self.queued, "a reduce-scatter was held past the step that needed it"
        for unit in self.units:
            unit.cache_fresh = False
            if unit.gathered:  # a pass that ended without a backward (skipped step)
                self._free(unit)

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What the store keeps between steps (``held.py`` counts it): parameters (the shards,
        the node caches) and gradient state (int8 error feedback)."""
        return [*self.primary.values(), *self.cache.values()], list(self.residual.values())

    def owned_shards(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name, axis, shard) of each bucket's primary shard, which this rank alone holds."""
        return [(f"{unit.name}.bucket{b.index}.shard", b.axis, self.primary[b.index])
                for unit in self.units for b in unit.buckets]

    def node_caches(self) -> list[tuple[str, torch.Tensor]]:
        """(name, cache) of each node-local copy: the ranks at this place of every node hold
        the same ('dp_inter')."""
        return [(f"{unit.name}.bucket{b.index}.cache", self.cache[b.index])
                for unit in self.units for b in unit.buckets if b.index in self.cache]

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter gathered (for a checkpoint); with ``write_back``, the shards are
        taken from the parameters afterwards (a restore wrote them)."""
        for unit in self.units:
            self.fetch_parameters(unit)
            self.wait(unit)
        try:
            yield
        finally:
            if write_back:
                with torch.no_grad():
                    for unit in self.units:
                        for bucket in unit.buckets:
                            size = bucket.numel // bucket.degree
                            rank = (self.comm.axis_rank(bucket.axis)
                                    if bucket.degree > 1 else 0)
                            self.primary[bucket.index].copy_(
                                self.flat[bucket.index][rank * size:(rank + 1) * size])
            for unit in self.units:
                unit.cache_fresh = False
                self._free(unit)

    # --- hooks ----------------------------------------------------------------------------------
    def _hook(self, chunks: list[nn.Module]) -> None:
        per_chunk: dict[str, list[StoreUnit]] = {}
        for unit in self.units:
            per_chunk.setdefault(unit.name.split(".")[0], []).append(unit)
        for c, chunk in enumerate(chunks):
            units = per_chunk[f"chunk{c}"]
            blocks, root = units[:-1], units[-1]
            _, modules, _, _ = chunk.pieces()  # type: ignore[operator]
            chunk.register_forward_pre_hook(self._chunk_pre(root, blocks))
            chunk.register_forward_hook(self._chunk_post(root, blocks))
            # The last group's backward comes first, right after the head's: its blocks stay
            # gathered from their forward (no more than a forward already holds).
            last_group = (len(modules) - 1) // self.span * self.span
            for i, module in enumerate(modules):
                # The groups a block prefetches: the next blocks, and in backward the ones
                # before it (nearest first); a group goes out when its first block is not out.
                after = blocks[i + 1:i + 1 + self.span]
                before = blocks[max(0, i - self.span):i][::-1]
                module.register_forward_pre_hook(self._block_pre(blocks[i], after))
                module.register_forward_hook(self._block_post(blocks[i], before,
                                                              last=i >= last_group))

    def _chunk_pre(self, root: StoreUnit, blocks: list[StoreUnit]):  # type: ignore[no-untyped-def]
        def hook(_module: nn.Module, _args: object) -> None:
            # One collective where exchanges are fused.
            self.fetch_units([root, *blocks[:self.span]])
            self.wait(root)
            self._note("use", root)
        return hook

    def _chunk_post(self, root: StoreUnit, blocks: list[StoreUnit]):  # type: ignore[no-untyped-def]
        def hook(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and output.requires_grad):
                self._free(root)  # evaluation: nothing comes back
                return
            output.register_hook(lambda grad: self._chunk_backward_starts(root, blocks))
        return hook

    def _chunk_backward_starts(self, root: StoreUnit, blocks: list[StoreUnit]) -> None:
        """A chunk's backward begins with the head's (the last stage) or the last block's: the
        root is gathered again if a backward of another micro-batch freed it since this one's
        forward (a pipeline runs several forwards before their backwards), and the last
        block's gather crosses while the head's backward runs."""
        self.fetch_units([root, *blocks[-1:]], backward=True)
        self.wait(root)

    def release_chunk(self, chunk: int) -> None:
        """A backward of local chunk ``chunk`` has ended: free its gathered units. Under a
        reduction after every backward they are freed as their buckets launch; under one
        reduction per step (a split schedule, several chunks per rank) the launch waits for
        the step's last backward, and the weights are not needed until the next forward or
        backward gathers them (a W task reads only the saved inputs and output gradients)."""
        for unit in self.units:
            if unit.name.split(".")[0] == f"chunk{chunk}" and unit.gathered:
                self._free(unit)

    def _block_pre(self, unit: StoreUnit, after: list[StoreUnit]):  # type: ignore[no-untyped-def]
        def hook(_module: nn.Module, _args: object) -> None:
            self.fetch_parameters(unit)
            if after and not after[0].gathered:
                self.fetch_units(after)
            self.wait(unit)
            self._note("use", unit)
        return hook

    def _block_post(self, unit: StoreUnit, before: list[StoreUnit],  # type: ignore[no-untyped-def]
                    last: bool = False):
        """``last``: a block of the chunk's last group, whose backward comes next (after the
        head's): it stays gathered from its forward into its backward, one gather fewer per
        pass."""
        def backward_pre(grad: torch.Tensor) -> None:
            self.fetch_parameters(unit, backward=True)
            if before and not before[0].gathered:
                self.fetch_units(before, backward=True)
            self.wait(unit)
            self._note("use", unit)

        def hook(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
            backward_follows = torch.is_grad_enabled() and output.requires_grad
            if not (last and backward_follows):
                self._free(unit)
            if backward_follows:
                output.register_hook(backward_pre)
        return hook
