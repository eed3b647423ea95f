"""Optimizer-state offload (``controllers.memory.offload: cpu | nvme``): the MemoryController
keeps the AdamW state off the device and streams it through the update group by group.

What lives where
    fp32 training: the parameters are the master weights and stay where they are; only the two
    AdamW moments are offloaded (8 bytes per parameter). ``training.dtype: bfloat16`` without
    ZeRO: the model holds bf16 copies of its parameters (and bf16 gradients) and the offloaded
    state holds the fp32 master weights and the two moments (12 bytes per parameter); after
    each update the master is cast into the model's copy. (Under ZeRO the shards' pieces are
    views of fp32 flat buffers, so there the parameters stay fp32 and are the master.)

Backing store
    ``cpu``: host tensors (pinned on CUDA, so the copies of gradients to the host and of updated
    parameters back are DMA). On a CPU-only device there is nothing to move and ``cpu`` is
    refused (``capabilities.py``). ``nvme``: one file per rank under
    ``controllers.memory.offload_dir``, read and written with plain positioned file I/O into two
    reusable host buffers. Not ``mmap``: mapped pages count as the process's resident memory,
    and the point is that resident memory stays bounded by the buffers, not by the model. The
    file is unlinked as soon as it is open: its blocks are freed when the process ends, however
    it ends (its content is in the checkpoints).

Streaming
    The parameters (or ZeRO's pieces) are cut into groups of at most
    ``controllers.memory.offload_buffer_mb`` of state; a parameter larger than that spans
    several groups (AdamW is element-wise). A step walks the groups in order; one background
    thread writes group i - 1 back and reads group i + 1 while group i is updated on the host
    (double buffering: two buffers, the thread's work queued in order so that a buffer is
    written back before the next read into it). The update is torch's single-tensor AdamW,
    operation for operation, so fp32 results match ``torch.optim.AdamW`` on CPU.

Checkpoints
    ``optimizer.state`` is a mapping that reads a parameter's state (``step``, ``exp_avg``,
    ``exp_avg_sq``, shaped like the parameter) from the store when asked, and takes whatever is
    assigned or changed in place back into the store before the next step: a checkpoint holds
    the same logical state as without offload, so either side resumes the other. With bf16
    copies, the parameters hold their fp32 masters for the time of a save or restore
    (``checkpoint_parameters``), so checkpoints hold the master weights, not the copies.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcpar.device import host_empty
from mcpar.path_checks import storage_errors

MOMENTS = ("exp_avg", "exp_avg_sq")
OFFLOAD_DIR_KEY = "controllers.memory.offload_dir"
FLOAT_BYTES = 4


@dataclass
class Span:
    """Elements [lo, hi) of one parameter's flattened values, at ``at`` in its group."""

    param: torch.Tensor
    lo: int
    hi: int
    at: int


@dataclass
class Group:
    spans: list[Span]
    numel: int
    base: int  # first element of the group's block in the store (block: fields x numel)


@dataclass
class StreamTimes:
    """Seconds spent per kind of work, summed over steps (read/write: the I/O thread)."""

    steps: int = 0
    init_s: float = 0.0  # writing the initial master weights (once, before the first step)
    read_s: float = 0.0
    write_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0  # the update waiting for a read (or the last writes)
    bytes_read: int = 0
    bytes_written: int = 0

    def to_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class FileBacking:
    """One file of fp32 values, read and written at element offsets (positioned I/O).

    The filesystem refusing the file (full, over quota, read-only, denied) is the user's to
    fix, and a restart would meet it again: it is raised as a UserError naming the file and
    ``controllers.memory.offload_dir``, so the launcher stops the job (exit 2) instead of
    restarting it; the run's checkpoints are not written to here and stay as they were."""

    def __init__(self, path: Path, numel: int):
        self.path = path
        with self._storage():
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.unlink(path)  # freed with the process, however it ends
            os.ftruncate(self.fd, numel * FLOAT_BYTES)  # sparse: reads zeros until written

    def _storage(self) -> contextlib.AbstractContextManager[None]:
        return storage_errors(self.path, OFFLOAD_DIR_KEY)

    def read(self, start: int, out: torch.Tensor) -> None:
        view, offset = _bytes_view(out), start * FLOAT_BYTES
        with self._storage():
            while len(view):
                n = os.preadv(self.fd, [view], offset)
                if n <= 0:
                    raise OSError(f"short read from the offload file at byte {offset}")
                view, offset = view[n:], offset + n

    def write(self, start: int, data: torch.Tensor) -> None:
        view, offset = _bytes_view(data), start * FLOAT_BYTES
        with self._storage():
            while len(view):
                n = os.pwritev(self.fd, [view], offset)
                view, offset = view[n:], offset + n

    def close(self) -> None:
        os.close(self.fd)


def adamw_update(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 step: float, lr: float, wd: float, beta1: float, beta2: float,
                 eps: float) -> None:
    """torch's single-tensor AdamW (decoupled weight decay), operation for operation."""
    if wd != 0:
        w.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = v.sqrt().div_((1 - beta2 ** step) ** 0.5).add_(eps)  # one temporary, not two
    w.addcdiv_(m, denom, value=-step_size)


Hyper = Callable[[torch.Tensor], tuple[float, float, float, float, float]]


@dataclass
class OffloadEngine:
    """The offloaded AdamW state of ``params`` and its streamed update."""

    params: list[torch.Tensor]
    where: str  # 'cpu' | 'nvme'
    budget_bytes: int
    fields: int  # 2: moments; 3: moments and fp32 master weights
    device: torch.device
    path: Path | None = None
    groups: list[Group] = field(default_factory=list)
    steps: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    times: StreamTimes = field(default_factory=StreamTimes)

    def __post_init__(self) -> None:
        capacity = max(1, self.budget_bytes // (self.fields * FLOAT_BYTES))
        spans: list[Span] = []
        used, base = 0, 0
        self.spans_of: dict[torch.Tensor, list[tuple[Group, Span]]] = {}
        for p in self.params:
            assert p.is_contiguous(), "offloaded parameters must be contiguous"
            lo = 0
            while lo < p.numel():
                if used == capacity:
                    self.groups.append(Group(spans, used, base))
                    base += used * self.fields
                    spans, used = [], 0
                hi = min(p.numel(), lo + capacity - used)
                spans.append(Span(p, lo, hi, used))
                used += hi - lo
                lo = hi
        if spans:
            self.groups.append(Group(spans, used, base))
        for g in self.groups:
            for s in g.spans:
                self.spans_of.setdefault(s.param, []).append((g, s))
        total = sum(g.numel for g in self.groups) * self.fields
        self.largest = max((g.numel for g in self.groups), default=0) * self.fields
        pin = self.device.type == "cuda"
        self.file: FileBacking | None = None
        self.host: torch.Tensor | None = None
        if self.where == "nvme":
            assert self.path is not None
            self.file = FileBacking(self.path, total)
            self.buffers = [host_empty(self.largest, torch.float32, pin) for _ in range(2)]
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcpar-offload")
        else:
            self.host = host_empty(total, torch.float32, pin).zero_()
            self.buffers = []
        if self.fields == 3:
            t0 = time.perf_counter()
            self._store_masters()
            self.times = StreamTimes(init_s=time.perf_counter() - t0)  # the steps' own below

    # --- the store -------------------------------------------------------------------------------
    def buffer_bytes(self) -> int:
        """Bytes of the host buffers the stream reads into (nvme; cpu: the whole state)."""
        held = self.buffers if self.host is None else [self.host]
        return sum(b.numel() * b.element_size() for b in held)

    def _block(self, group: Group, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The group's block: ``buffer``'s first fields x numel elements (nvme) or the host
        tensor's block itself (cpu)."""
        n = group.numel * self.fields
        if self.host is not None:
            return self.host[group.base:group.base + n]
        assert buffer is not None
        return buffer[:n]

    def _read(self, group: Group, buffer: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        block = self._block(group, buffer)
        assert self.file is not None
        self.file.read(group.base, block)
        self.times.read_s += time.perf_counter() - t0
        self.times.bytes_read += block.numel() * FLOAT_BYTES
        return block

    def _write(self, group: Group, block: torch.Tensor) -> None:
        t0 = time.perf_counter()
        assert self.file is not None
        self.file.write(group.base, block)
        self.times.write_s += time.perf_counter() - t0
        self.times.bytes_written += block.numel() * FLOAT_BYTES

    def _store_masters(self) -> None:
        """Initial fp32 master weights from the parameters' values (fp32 at this point)."""
        for group in self.groups:
            block = self._block(group, None if self.host is not None else self.buffers[0])
            block.zero_()
            master = block[2 * group.numel:]
            for s in group.spans:
                master[s.at:s.at + s.hi - s.lo].copy_(s.param.detach().view(-1)[s.lo:s.hi])
            if self.file is not None:
                self._write(group, block)

    def _field_io(self, group: Group, span: Span, f: int, out: torch.Tensor,
                  write: bool) -> None:
        """Copy field ``f`` of ``span`` to (``write``: from) the flat fp32 ``out``."""
        start = group.base + f * group.numel + span.at
        if self.host is not None:
            stored = self.host[start:start + out.numel()]
            (stored.copy_(out) if write else out.copy_(stored))
        elif self.file is not None:
            (self.file.write(start, out) if write else self.file.read(start, out))

    def read_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s AdamW state as torch's AdamW keeps it (host tensors)."""
        out = {"step": self.steps[p].clone()}
        for f, name in enumerate(MOMENTS):
            flat = torch.empty(p.numel(), dtype=torch.float32)
            for group, span in self.spans_of[p]:
                self._field_io(group, span, f, flat[span.lo:span.hi], write=False)
            out[name] = flat.view(p.shape)
        return out

    def write_state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.steps[p] = state["step"].detach().to("cpu", torch.float32).clone()
        for f, name in enumerate(MOMENTS):
            flat = state[name].detach().to("cpu", torch.float32).reshape(-1).contiguous()
            for group, span in self.spans_of[p]:
                self._field_io(group, span, f, flat[span.lo:span.hi], write=True)

    @contextlib.contextmanager
    def master_parameters(self, write_back: bool = False) -> Iterator[None]:
        """bf16 copies only: the parameters hold their fp32 master weights for the time of a
        checkpoint save, so that checkpoints hold the master (or, ``write_back``, of a restore:
        the masters are then taken from what was loaded) and are bf16 copies again after."""
        if self.fields != 3:
            yield
            return
        unique = list({id(p): p for p in self.params}.values())
        with torch.no_grad():
            for p in unique:
                master = torch.empty(p.numel(), dtype=torch.float32)
                for group, span in self.spans_of[p]:
                    self._field_io(group, span, 2, master[span.lo:span.hi], write=False)
                p.data = master.view(p.shape).to(p.device)
        try:
            yield
        finally:
            with torch.no_grad():
                for p in unique:
                    if write_back:
                        flat = p.detach().to("cpu", torch.float32).reshape(-1).contiguous()
                        for group, span in self.spans_of[p]:
                            self._field_io(group, span, 2, flat[span.lo:span.hi], write=True)
                    p.data = p.data.to(torch.bfloat16)

    # --- the step --------------------------------------------------------------------------------
    def step(self, hyper: Hyper) -> None:
        """One AdamW step of every parameter with a gradient, streamed group by group."""
        live = [p for p in self.params if p.grad is not None]
        fresh = {p for p in live if p not in self.steps}
        for p in live:  # AdamW's step count, once per parameter whatever its spans
            self.steps.setdefault(p, torch.zeros((), dtype=torch.float32)).add_(1)
        if self.file is None:
            for group in self.groups:
                self._update(group, self._block(group), hyper, fresh)
        else:
            self._stream(hyper, fresh)
        self.times.steps += 1

    def _stream(self, hyper: Hyper, fresh: set[torch.Tensor]) -> None:
        """The double-buffered walk: the I/O thread's queue runs read 0, read 1, write 0,
        read 2, write 1, ...: the write of group i - 1 is queued before the read of group
        i + 1 into the same buffer, and both run while group i is updated."""
        groups, pool, bufs = self.groups, self.pool, self.buffers
        reading: Future[torch.Tensor] = pool.submit(self._read, groups[0], bufs[0])
        writes: list[Future[None]] = []
        for i, group in enumerate(groups):
            t0 = time.perf_counter()
            block = reading.result()
            self.times.wait_s += time.perf_counter() - t0
            if i + 1 < len(groups):
                reading = pool.submit(self._read, groups[i + 1], bufs[(i + 1) % 2])
            self._update(group, block, hyper, fresh)
            writes.append(pool.submit(self._write, group, block))
        t0 = time.perf_counter()
        for w in writes:
            w.result()
        self.times.wait_s += time.perf_counter() - t0

    def _update(self, group: Group, block: torch.Tensor, hyper: Hyper,
                fresh: set[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        n = group.numel
        for s in group.spans:
            p = s.param
            if p.grad is None:
                continue
            k = s.hi - s.lo
            m, v = block[s.at:s.at + k], block[n + s.at:n + s.at + k]
            if p in fresh:  # state created now, as AdamW creates it on the first step
                m.zero_()
                v.zero_()
            grad = p.grad.detach().view(-1)[s.lo:s.hi].to("cpu", torch.float32)
            device_values = p.detach().view(-1)[s.lo:s.hi]
            on_host = self.fields == 2 and device_values.device.type == "cpu"
            if self.fields == 3:
                w = block[2 * n + s.at:2 * n + s.at + k]
            else:
                w = device_values if on_host else device_values.to("cpu")
            lr, wd, beta1, beta2, eps = hyper(p)
            adamw_update(w, grad, m, v, self.steps[p].item(), lr, wd, beta1, beta2, eps)
            if not on_host:  # the device copy takes the master's new values (cast to its dtype)
                device_values.copy_(w, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the buffer is written next
        self.times.update_s += time.perf_counter() - t0

    def close(self) -> None:
        if self.file is not None:
            self.pool.shutdown()
            self.file.close()


class OffloadedState(MutableMapping):
    """``optimizer.state`` of an offloaded optimizer: a parameter's state is read from the
    store when asked for, and what is assigned (or changed in place, as a checkpoint restore
    does) goes back into the store at ``flush`` (before every step)."""

    def __init__(self, engine: OffloadEngine):
        self.engine = engine
        self.pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if p not in self.pending:
            if p not in self.engine.steps:
                raise KeyError(p)
            self.pending[p] = self.engine.read_state(p)
        return self.pending[p]

    def __setitem__(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.pending[p] = state

    def __delitem__(self, p: torch.Tensor) -> None:
        self.pending.pop(p, None)
        self.engine.steps.pop(p, None)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([*self.engine.steps, *(p for p in self.pending
                                           if p not in self.engine.steps)])

    def __len__(self) -> int:
        return len(set(self.engine.steps) | set(self.pending))

    def values(self) -> list[dict[str, torch.Tensor]]:  # type: ignore[override]
        """What this rank holds in memory for the state: the stream's buffers (nvme) or the
        host store (cpu), so that counting held bytes (``held.py``) reads no file."""
        held = self.engine.buffers if self.engine.host is None else [self.engine.host]
        return [{"offload buffer": b} for b in held]

    def flush(self) -> None:
        for p, state in self.pending.items():
            self.engine.write_state(p, state)
        self.pending.clear()


@dataclass
class OffloadSpec:
    """Where the optimizer state goes; ``engine``: already built (bf16 master weights, built
    before the model's parameters were cast)."""

    where: str
    path: Path | None
    budget_bytes: int
    masters: bool
    device: torch.device
    engine: OffloadEngine | None = None

    def build(self, params: list[torch.Tensor]) -> OffloadEngine:
        if self.engine is None:
            self.engine = OffloadEngine(params, self.where, self.budget_bytes,
                                        3 if self.masters else 2, self.device, self.path)
        return self.engine


def checkpoint_parameters(spec: OffloadSpec | None,
                          ) -> Callable[[bool], contextlib.AbstractContextManager[None]] | None:
    """With bf16 copies, what a checkpoint saves and restores the parameters through (the
    fp32 master weights: ``OffloadEngine.master_parameters``); None otherwise."""
    if spec is None or not spec.masters or spec.engine is None:
        return None
    return spec.engine.master_parameters


class OffloadAdamW(torch.optim.AdamW):
    """torch's AdamW, its state offloaded when ``offload`` is given (else torch's own)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float],
                 offload: OffloadSpec | None = None):
        super().__init__(groups, lr=lr, betas=betas)
        self.engine: OffloadEngine | None = None
        if offload is not None:
            self.engine = offload.build([p for g in self.param_groups for p in g["params"]])
            self.state = OffloadedState(self.engine)  # type: ignore[assignment]

    def _hyper(self) -> Hyper:
        by_param = {}
        for g in self.param_groups:
            values = (float(g["lr"]), float(g["weight_decay"]), float(g["betas"][0]),
                      float(g["betas"][1]), float(g["eps"]))
            for p in g["params"]:
                by_param[p] = values
        return by_param.__getitem__

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if self.engine is None:
            super().step()
            return
        assert isinstance(self.state, OffloadedState)
        self.state.flush()
        self.engine.step(self._hyper())

    def load_state_dict(self, state_dict: dict) -> None:
        if self.engine is None:
            super().load_state_dict(state_dict)
            return
        params = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        assert isinstance(self.state, OffloadedState)
        for index, state in state_dict["state"].items():
            self.state[params[index]] = {k: v.clone() for k, v in state.items()}
        self.state.flush()
